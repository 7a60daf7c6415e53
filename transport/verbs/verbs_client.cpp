// The active side of verbs: claim, then one-sided READs or WRITEs straight between the two
// memories, then DONE on the same queue pair (so that it reaches the owner after the data).

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "transport/cuda/stager.hpp"
#include "transport/kit/exposures.hpp"
#include "transport/verbs/verbs_transport.hpp"
#include "transport/wire/status.hpp"

namespace ferry::transport::verbs {

namespace {

using wire::FrameHeader;
using wire::FrameType;

constexpr int kWrsPerTurn = 8;  // data work requests one transfer posts before the next's turn

ErrorCode code_of(ibv_wc_status status) {
  switch (status) {
    case IBV_WC_REM_ACCESS_ERR:
    case IBV_WC_REM_INV_REQ_ERR:
      return ErrorCode::AccessDenied;
    case IBV_WC_RETRY_EXC_ERR:
    case IBV_WC_RNR_RETRY_EXC_ERR:
    case IBV_WC_RESP_TIMEOUT_ERR:
      return ErrorCode::PeerLost;
    case IBV_WC_WR_FLUSH_ERR:
      return ErrorCode::Cancelled;
    default:
      return ErrorCode::Internal;
  }
}

/// The window of the owner's memory that holds `remote`, or null.
const Window* window_of(const VerbsTransfer& t, std::uint64_t remote) {
  auto w = std::upper_bound(t.windows.begin(), t.windows.end(), remote,
                            [](std::uint64_t a, const Window& x) { return a < x.addr; });
  if (w == t.windows.begin() || remote - std::prev(w)->addr >= std::prev(w)->len) return nullptr;
  return &*std::prev(w);
}

}  // namespace

std::vector<Window> windows_of(const std::string& payload) {
  std::vector<Window> out(payload.size() / 24);
  for (std::size_t i = 0; i < out.size(); ++i) {
    std::memcpy(&out[i].addr, payload.data() + i * 24, 8);
    std::memcpy(&out[i].len, payload.data() + i * 24 + 8, 8);
    std::memcpy(&out[i].rkey, payload.data() + i * 24 + 16, 4);
  }
  std::sort(out.begin(), out.end(),
            [](const Window& a, const Window& b) { return a.addr < b.addr; });
  return out;
}

VerbsClient::VerbsClient(VerbsTransport& t, Defer defer)
    : t_(t),
      pending_([this](std::uint64_t conn, int delta) {
        if (Conn* c = t_.conn_of(conn)) c->expect_answers(delta);
      }),
      transfers_(std::move(defer), static_cast<kit::TransferHooks<VerbsTransfer>&>(*this)) {}

VerbsClient::~VerbsClient() { close(); }

void VerbsClient::close() {
  // Attachments may outlive this client (their owners drop them after the transport closed).
  for (auto& [key, region] : regions_) region->orphan();
  regions_.clear();
  transfers_.detach_all();
  pending_.clear();
  chunk_regs_.clear();
  stager_.reset();  // waits for copies in flight
}

std::unique_ptr<Transfer> VerbsClient::start(TransferSpec spec, TransferObserver& observer) {
  // An endpoint that does not parse is bad metadata: thrown, not a set-up failure.
  const wire::SocketAddress dst = wire::endpoint_address(spec.endpoint);
  auto handle = transfers_.make(std::move(spec), observer);
  auto* t = &handle->get();
  for (const Segment& s : t->spec.segments) {
    const MemoryKind kind = s.cuda_device >= 0 ? MemoryKind::cuda : MemoryKind::host;
    t->regs.push_back(s.len == 0 ? nullptr : t_.acquire({s.local, s.len, kind, s.cuda_device}));
  }
  std::shared_ptr<Conn> conn;
  try {
    conn = t_.link_to(dst);
  } catch (const Error& e) {
    transfers_.finish(
        *t,
        Error(ErrorCode::PeerLost, "verbs cannot reach peer '" + t->spec.peer_name + "' at " +
                                       t->spec.endpoint.address + ": " + e.message()),
        /*setup=*/true);
    return handle;
  }
  t->conn = conn->id;
  if (conn->state == Conn::State::up)
    begin(*t);
  else
    conn->waiting.push_back(t->id());
  return handle;
}

bool VerbsClient::busy() const {
  if (!pending_.empty()) return true;
  const auto all = transfers_.all();
  return std::any_of(all.begin(), all.end(), [](const VerbsTransfer* t) { return !t->finished(); });
}

void VerbsClient::connected(Conn& conn, const std::vector<std::uint64_t>& waiting) {
  for (std::uint64_t tid : waiting)
    if (VerbsTransfer* t = transfers_.find(tid); t != nullptr && !t->finished()) begin(*t);
  std::vector<VerbsRemoteRegion*> attaching;
  for (auto& [key, region] : regions_)
    if (region->conn == conn.id && !region->sent) attaching.push_back(region);
  for (VerbsRemoteRegion* region : attaching) send_attach(conn, *region);
  pump(conn);
}

void VerbsClient::begin(VerbsTransfer& t) {
  Conn* conn = t_.conn_of(t.conn);
  if (conn == nullptr) return;
  const std::vector<std::byte> body = kit::claim_payload(t.spec.segments);
  if (body.empty()) {
    transfers_.finish(t, std::nullopt);
    return;
  }
  FrameHeader h;
  h.type = FrameType::claim;
  h.req_id =
      pending_.add(conn->id, Pending{t.id(), false, t.spec.remote_id, t.spec.token, t.spec.access});
  h.op_id = t.spec.remote_id;
  h.token = t.spec.token;
  h.flags = static_cast<std::uint16_t>(t.spec.access);
  conn->send_ctl(h, {}, std::string_view(reinterpret_cast<const char*>(body.data()), body.size()));
}

wire::Sink VerbsClient::receive_claimed(Conn& conn, const FrameHeader& h) {
  // Answers count only from the connection the request went out on.
  const Pending* p = pending_.find(h.req_id, conn.id);
  if (p == nullptr || p->done || (h.type == FrameType::attached) != (p->region != 0)) return {};
  conn.payload.assign(h.len, '\0');
  wire::Sink sink;
  sink.dest = reinterpret_cast<std::byte*>(conn.payload.data());
  return sink;
}

void VerbsClient::on_reply(Conn& conn, const FrameHeader& h, std::string msg, std::string payload) {
  std::optional<Pending> p = pending_.take(h.req_id, conn.id);
  if (!p) return;
  if (p->region != 0) {
    if (auto it = regions_.find(p->region); it != regions_.end())
      attach_answered(conn, *it->second, h, msg, payload);
    else if (h.type == FrameType::attached && conn.state == Conn::State::up) {
      // Detached while its ATTACH was on the way: the owner made the attachment for us.
      FrameHeader d;
      d.type = FrameType::detach;
      d.op_id = h.op_id;
      d.token = h.token;
      conn.send_ctl(d, {});
    }
    return;
  }
  VerbsTransfer* t = transfers_.find(p->transfer);
  if (t == nullptr || t->finished()) {
    // The transfer was cancelled while its claim was on the way: the owner holds the claim
    // for us now, so tell it we are done with an error.
    if (!p->done && h.type == FrameType::claimed && conn.state == Conn::State::up)
      send_done(conn, *p, Error(ErrorCode::Cancelled, "the transfer was cancelled"));
    return;
  }
  const std::string who = "peer '" + t->spec.peer_name + "'";
  if (h.type == FrameType::status && h.status != 0) {
    transfers_.finish(
        *t, Error(wire::from_wire(h.status), who + " refused: " + wire::reason_of(h.status, msg)));
    return;
  }
  if (p->done) {
    transfers_.finish(*t, std::nullopt);
    return;
  }
  if (h.type != FrameType::claimed || payload.size() % 24 != 0 || payload.empty()) {
    transfers_.finish(*t,
                      Error(ErrorCode::ProtocolError, who + " answered the claim with no keys"));
    return;
  }
  t->secret = h.token;
  t->windows = windows_of(payload);
  conn.ready.push_back(t->id());
  pump(conn);
}

void VerbsClient::on_notice(Conn& conn, const FrameHeader& h, const std::string& msg) {
  // The owner ended an operation (or an attachment): the transfers toward it end with the
  // owner's reason once none of their work requests is outstanding (those under way meet a
  // dead key).
  std::vector<VerbsRemoteRegion*> ended;
  for (auto& [key, region] : regions_)
    if (region->conn == conn.id && region->attachment == h.op_id) ended.push_back(region);
  for (VerbsRemoteRegion* region : ended)
    region->on_ended(Error(wire::from_wire(h.status),
                           "peer '" + region->spec().peer_name +
                               "' ended the operation: " + wire::reason_of(h.status, msg)));
  std::vector<VerbsTransfer*> now;
  for (VerbsTransfer* t : transfers_.all()) {
    if (t->conn != conn.id || t->finished() || t->spec.remote_id != h.op_id) continue;
    t->ended_by_owner = Error(
        wire::from_wire(h.status),
        "peer '" + t->spec.peer_name + "' ended the operation: " + wire::reason_of(h.status, msg));
    if (t->outstanding == 0) now.push_back(t);
  }
  for (VerbsTransfer* t : now) transfers_.finish(*t, t->ended_by_owner);
}

void VerbsClient::pump(Conn& conn) {
  conn.pump_ctl();
  while (conn.state == Conn::State::up && !conn.ready.empty() &&
         conn.posted.size() < t_.options_.queue_depth) {
    const std::uint64_t tid = conn.ready.front();
    conn.ready.pop_front();
    VerbsTransfer* t = transfers_.find(tid);
    if (t == nullptr || t->finished()) continue;
    if (post_some(conn, *t)) conn.ready.push_back(tid);
  }
  t_.devices_->arm_watchdog();
}

bool VerbsClient::post_some(Conn& conn, VerbsTransfer& t) {
  Device& dev = *conn.dev;
  const auto& segs = t.spec.segments;
  const auto max_sge = static_cast<std::size_t>(dev.max_sge);
  ibv_sge sges[32];
  for (int turn = 0; turn < kWrsPerTurn && conn.posted.size() < t_.options_.queue_depth; ++turn) {
    if (!t.postable.empty()) {
      if (!post_chunk_wr(conn, t)) return false;
      continue;
    }
    while (t.seg < segs.size() && segs[t.seg].len == 0) ++t.seg;
    if (t.seg >= segs.size()) break;
    if (staged_segment(t, t.seg)) {
      // CUDA memory the NIC cannot reach: through a staging chunk.
      try {
        if (!start_chunk(t)) break;
      } catch (const Error& e) {
        failed(t, e);
        return false;
      }
      continue;
    }
    // One WR: a run of the owner's memory inside one window, at most max_msg bytes, gathered
    // from at most max_sge local pieces, each inside one local registration.
    const std::uint64_t remote = segs[t.seg].remote_addr + t.off;
    const Window* win = window_of(t, remote);
    if (win == nullptr) {
      // failed(), not finish(), here and below: its DONE, a signalled SEND behind the work
      // requests this transfer posted (unsignalled, most of them), is what retires them, since
      // an unsignalled one that succeeds never completes on its own (settle() waits for them).
      failed(t, Error(ErrorCode::ProtocolError,
                      "peer '" + t.spec.peer_name +
                          "' gave no key for a range it accepted in the claim"));
      return false;
    }
    const std::uint64_t limit = std::min(win->addr + win->len - remote, dev.max_msg);
    std::size_t n = 0;
    std::uint64_t total = 0;
    while (n < max_sge && total < limit && t.seg < segs.size()) {
      const Segment& s = segs[t.seg];
      if (s.len == 0) {
        ++t.seg;
        continue;
      }
      if (n > 0 && (s.remote_addr + t.off != remote + total || staged_segment(t, t.seg))) break;
      std::uint64_t take = std::min(s.len - t.off, limit - total);
      const auto local = reinterpret_cast<std::uint64_t>(s.local) + t.off;
      std::uint64_t room = 0;
      const auto* set = static_cast<const MrSet*>(t.regs[t.seg]->handle.get());
      ibv_mr* mr = set == nullptr ? nullptr : set->find(dev.ctx, local, room);
      if (mr == nullptr) {
        failed(t, Error(ErrorCode::Internal, "local memory not registered on " + dev.name));
        return false;
      }
      take = std::min({take, room, std::uint64_t{1} << 31});
      sges[n].addr = local;
      sges[n].length = static_cast<std::uint32_t>(take);
      sges[n].lkey = mr->lkey;
      ++n;
      total += take;
      t.off += take;
      if (t.off == s.len) {
        ++t.seg;
        t.off = 0;
      }
    }
    while (t.seg < segs.size() && segs[t.seg].len == 0) ++t.seg;
    if (!conn.post_data(t.id(), t.spec.access, remote, win->rkey, sges, n, t.seg >= segs.size(), 0))
      return false;
    ++t.outstanding;
  }
  // Everything is posted once the segments are through and no chunk waits to be posted or
  // for its device-to-host copy.
  t.all_posted = t.seg >= segs.size() && t.postable.empty() &&
                 std::all_of(t.chunks.begin(), t.chunks.end(),
                             [](const auto& kv) { return kv.second.posted == kv.second.len; });
  if (t.all_posted) return false;
  return !t.postable.empty() || (t.seg < segs.size() && !t.waiting_chunk);
}

void VerbsClient::wr_retired(std::uint64_t tid, const Posted& p, bool failed_here) {
  VerbsTransfer* t = transfers_.find(tid);
  if (t == nullptr) return;
  if (t->outstanding > 0) --t->outstanding;
  if (p.chunk == 0) return;
  auto c = t->chunks.find(p.chunk);
  if (c != t->chunks.end() && c->second.wrs > 0 && --c->second.wrs == 0 &&
      c->second.posted == c->second.len && !failed_here && !t->finished())
    chunk_moved(tid, p.chunk);
}

void VerbsClient::wr_done(Conn& conn, std::uint64_t tid, const ibv_wc* error) {
  VerbsTransfer* found = transfers_.find(tid);
  if (found == nullptr || found->finished()) return;
  VerbsTransfer& t = *found;
  if (error != nullptr) {
    if (t.ended_by_owner) {
      transfers_.finish(t, t.ended_by_owner);
      return;
    }
    const char* op = t.spec.access == Access::read ? "RDMA READ from" : "RDMA WRITE to";
    std::string text = std::string(op) + " peer '" + t.spec.peer_name +
                       "' failed: " + conn.why_failed(error->status);
    if (error->status == IBV_WC_REM_ACCESS_ERR)
      // What a dead key means, in the words every method uses for a refused request (the
      // owner's notice, when it comes first, says why instead; it may not come: the owner's
      // queue pair fails with ours).
      text += ": no live operation matches this id and token (the owner ended it)";
    transfers_.finish(t, Error(code_of(error->status), text));
    return;
  }
  maybe_done(conn, t);
}

void VerbsClient::maybe_done(Conn& conn, VerbsTransfer& t) {
  if (t.finished() || t.outstanding != 0) return;
  if (t.ended_by_owner) {
    transfers_.finish(t, t.ended_by_owner);
    return;
  }
  if (!t.all_posted || t.done_sent || !t.chunks.empty()) return;
  // Every byte is in place (read: staged chunks copied to the device too) or placed before DONE
  // reaches the owner (write).
  t.done_sent = true;
  if (t.spec.region_tag) {
    // On an attachment: the work requests' completions say the bytes are in place (a write's
    // were acknowledged by the owner's NIC); the owner's ENDED, a SEND behind them, is a notice.
    send_ended(conn, t, std::nullopt);
    transfers_.finish(t, std::nullopt);
    return;
  }
  const Pending done{t.id(), true, t.spec.remote_id, t.spec.token, t.spec.access};
  send_done(conn, done, std::nullopt, pending_.add(conn.id, done));
}

void VerbsClient::send_done(Conn& conn, const Pending& what, const std::optional<Error>& error,
                            std::uint64_t req) {
  FrameHeader h;
  h.type = FrameType::done;
  h.req_id = req;
  h.op_id = what.op;
  h.token = what.token;
  h.flags = static_cast<std::uint16_t>(what.access);
  if (error) h.status = wire::to_wire(error->code());
  conn.send_ctl(h, error ? error->message() : std::string());
}

void VerbsClient::conn_lost(Conn& conn, ErrorCode code, const std::string& why, bool was_up,
                            bool setup) {
  std::vector<VerbsRemoteRegion*> regions;
  for (auto& [key, region] : regions_)
    if (region->conn == conn.id) regions.push_back(region);
  for (VerbsRemoteRegion* region : regions) {
    region->conn = 0;
    region->on_lost(Error(code, "verbs connection to peer '" + region->spec().peer_name + "' at " +
                                    region->spec().endpoint.address + " failed: " + why),
                    /*setup=*/setup || (!region->attached() && !was_up));
  }
  // Every transfer on it fails; those still waiting for it failed at set-up.
  std::vector<std::uint64_t> hit = conn.waiting;
  for (VerbsTransfer* t : transfers_.all())
    if (t->conn == conn.id && !t->finished()) hit.push_back(t->id());
  conn.waiting.clear();
  conn.ready.clear();
  pending_.drop_connection(conn.id);
  for (std::uint64_t tid : hit) {
    VerbsTransfer* t = transfers_.find(tid);
    if (t == nullptr || t->finished()) continue;
    const bool before = setup || (!t->secret && t->outstanding == 0 && !was_up);
    if (t->ended_by_owner) {
      transfers_.finish(*t, t->ended_by_owner);
      continue;
    }
    transfers_.finish(*t,
                      Error(code, "verbs connection to peer '" + t->spec.peer_name + "' at " +
                                      t->spec.endpoint.address + " failed: " + why),
                      before);
  }
}

void VerbsClient::failed(VerbsTransfer& t, const Error& error) {
  if (t.finished()) return;
  transfers_.finish(t, error);
  Conn* conn = t_.conn_of(t.conn);
  if (conn == nullptr || conn->state != Conn::State::up || !t.secret) return;
  if (t.spec.region_tag)
    send_ended(*conn, t, error);
  else
    send_done(*conn, Pending{t.id(), false, t.spec.remote_id, t.spec.token, t.spec.access}, error);
}

void VerbsClient::make_ready(VerbsTransfer& t) {
  Conn* conn = t_.conn_of(t.conn);
  if (conn == nullptr || conn->state != Conn::State::up || t.finished()) return;
  if (std::find(conn->ready.begin(), conn->ready.end(), t.id()) == conn->ready.end())
    conn->ready.push_back(t.id());
  pump(*conn);
}

bool VerbsClient::wait_quiet(VerbsTransfer& t, std::chrono::steady_clock::time_point deadline) {
  while (t.outstanding > 0) {
    const std::size_t found = t_.devices_->drain_all();
    if (t.outstanding == 0) break;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    if (found == 0) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  return true;
}

void VerbsClient::stop(VerbsTransfer& t) {
  // Its work requests under way complete (or are flushed) on their own: settle() waits for
  // them before the memory is the caller's again.
  // Its claim, if still unanswered, stays awaited: on_reply() then tells the owner.
  if (Conn* conn = t_.conn_of(t.conn)) {
    std::erase(conn->ready, t.id());
    std::erase(conn->waiting, t.id());
  }
}

void VerbsClient::tell_peer(VerbsTransfer& t, const Error& reason) {
  // The owner hears why, after every request of ours on the same queue pair: also when our
  // claim is still on the way (the DONE follows it in order, and its answer will not count),
  // since this connection may close before that answer comes.
  Conn* conn = t_.conn_of(t.conn);
  if (conn == nullptr || conn->state != Conn::State::up) return;
  bool claiming = false;
  pending_.forget_if([&](const Pending& p) {
    const bool ours = p.transfer == t.id() && !p.done;
    claiming = claiming || ours;
    return ours;
  });
  if (!t.secret && !claiming) return;  // nothing claimed: nothing to end
  if (t.spec.region_tag) {
    send_ended(*conn, t, reason);
    return;
  }
  send_done(*conn, Pending{t.id(), false, t.spec.remote_id, t.spec.token, t.spec.access}, reason);
}

void VerbsClient::settle(VerbsTransfer& t) {
  // cancel()'s promise: no work request touching the local memory remains when it returns.
  // Those under way complete in the time of one queue's worth of data; a peer that does not
  // answer within peer_timeout has its queue pair flushed (every transfer on it fails).
  // On a failed connection (its queue pair in error, not yet destroyed) a work request that
  // completed unsignalled before the error will never say so: a marker behind it does.
  if (t.outstanding > 0) {
    Conn* conn = t_.conn_of(t.conn);
    bool flushed = conn != nullptr && conn->state == Conn::State::failed;
    if (!flushed && !wait_quiet(t, std::chrono::steady_clock::now() + t_.ctx_.peer_timeout)) {
      conn = t_.conn_of(t.conn);
      if (conn != nullptr) t_.fail_conn(*conn, ErrorCode::Cancelled, "flushed by a cancel");
      flushed = true;
    }
    if (flushed) {
      conn = t_.conn_of(t.conn);
      if (conn != nullptr) conn->post_drain_marker();
      wait_quiet(t, std::chrono::steady_clock::now() + t_.ctx_.peer_timeout);
    }
  }
  // No work request reaches a staging chunk now: its copies stop (waiting for one under way,
  // so that none touches the device memory after this) and the chunks go back.
  t.chunks.clear();
  t.postable.clear();
  t.waiting_chunk = false;
  if (stager_) stager_->drop(t.id());
}

}  // namespace ferry::transport::verbs
