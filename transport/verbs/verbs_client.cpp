#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "transport/tcp/socket.hpp"
#include "transport/verbs/verbs_internal.hpp"

namespace ferry::transport::verbs {

namespace {

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

}  // namespace

// ---------------------------------------------------------------------------------------
// The active side: claim, then one-sided READs or WRITEs straight between the two memories,
// then DONE on the same queue pair (so it reaches the owner after the data).

std::unique_ptr<Transfer> VerbsTransport::start(TransferSpec spec, TransferObserver& observer) {
  if (closed_) throw Error(ErrorCode::InvalidState, "the transport is closed");
  tcp::SocketAddress dst;
  if (auto e = parse_endpoint(spec.endpoint, dst)) throw *e;
  auto t = std::make_unique<VerbsTransfer>(*this, next_transfer_++, std::move(spec), observer);
  for (const Segment& s : t->spec.segments) {
    const MemoryKind kind = s.cuda_device >= 0 ? MemoryKind::cuda : MemoryKind::host;
    t->regs.push_back(s.len == 0 ? nullptr : acquire({s.local, s.len, kind, s.cuda_device}));
  }
  transfers_[t->id] = t.get();
  std::string why;
  std::shared_ptr<Conn> conn = link_to(dst, why);
  if (!conn) {
    t->finished = true;
    report_later(defer_, life_, transfers_, t->id,
                 Error(ErrorCode::PeerLost, "verbs cannot reach peer '" + t->spec.peer_name +
                                                "' at " + t->spec.endpoint.address + ": " + why),
                 true);
    return t;
  }
  t->conn = conn->id;
  if (conn->state == Conn::State::up)
    begin(*t);
  else
    conn->waiting.push_back(t->id);
  return t;
}

void VerbsTransport::begin(VerbsTransfer& t) {
  Conn* conn = conn_of(t.conn);
  if (conn == nullptr) return;
  const std::vector<std::byte> body = claim_payload(t.spec.segments);
  if (body.empty()) {
    finish_transfer(t, std::nullopt);
    return;
  }
  tcp::FrameHeader h;
  h.type = tcp::FrameType::claim;
  h.req_id = next_req_++;
  h.op_id = t.spec.remote_id;
  h.token = t.spec.token;
  h.flags = static_cast<std::uint16_t>(t.spec.access);
  h.len = body.size();
  pending_[h.req_id] = Pending{t.id, false, t.spec.remote_id, t.spec.token, t.spec.access};
  send_ctl(*conn, h, {}, std::string_view(reinterpret_cast<const char*>(body.data()), body.size()));
}

void VerbsTransport::on_reply(Conn& conn, const tcp::FrameHeader& h, std::string msg,
                              std::string payload) {
  auto pit = pending_.find(h.req_id);
  if (pit == pending_.end()) return;
  const Pending p = pit->second;
  pending_.erase(pit);
  auto it = transfers_.find(p.transfer);
  VerbsTransfer* t = it == transfers_.end() ? nullptr : it->second;
  if (t == nullptr || t->finished) {
    // The transfer was cancelled while its claim was on the way: the owner holds the claim
    // for us now, so tell it we are done with an error.
    if (!p.done && h.type == tcp::FrameType::claimed && conn.state == Conn::State::up)
      send_done(conn, p, Error(ErrorCode::Cancelled, "the transfer was cancelled"));
    return;
  }
  const std::string who = "peer '" + t->spec.peer_name + "'";
  if (h.type == tcp::FrameType::status && h.status != 0) {
    const ErrorCode code = tcp::code_from_wire(h.status);
    finish_transfer(
        *t, Error(code, who + " refused: " + (msg.empty() ? std::string(to_string(code)) : msg)));
    return;
  }
  if (p.done) {
    finish_transfer(*t, std::nullopt);
    return;
  }
  if (h.type != tcp::FrameType::claimed || payload.size() % 24 != 0 || payload.empty()) {
    finish_transfer(*t, Error(ErrorCode::ProtocolError, who + " answered the claim with no keys"));
    return;
  }
  t->secret = h.token;
  t->windows.resize(payload.size() / 24);
  for (std::size_t i = 0; i < t->windows.size(); ++i) {
    std::memcpy(&t->windows[i].addr, payload.data() + i * 24, 8);
    std::memcpy(&t->windows[i].len, payload.data() + i * 24 + 8, 8);
    std::memcpy(&t->windows[i].rkey, payload.data() + i * 24 + 16, 4);
  }
  std::sort(t->windows.begin(), t->windows.end(),
            [](const Window& a, const Window& b) { return a.addr < b.addr; });
  conn.ready.push_back(t->id);
  pump(conn);
}

void VerbsTransport::on_notice(Conn& conn, const tcp::FrameHeader& h, const std::string& msg) {
  // The owner ended an operation: the transfer toward it ends with the owner's reason once
  // none of its work requests is outstanding (those under way meet a dead key).
  const ErrorCode code = tcp::code_from_wire(h.status);
  std::vector<std::uint64_t> now;
  for (auto& [tid, t] : transfers_) {
    if (t->conn != conn.id || t->finished || t->spec.remote_id != h.op_id) continue;
    t->ended_by_owner = Error(code, "peer '" + t->spec.peer_name + "' ended the operation: " +
                                        (msg.empty() ? std::string(to_string(code)) : msg));
    if (t->outstanding == 0) now.push_back(tid);
  }
  for (std::uint64_t tid : now)
    finish_transfer(*transfers_.at(tid), transfers_.at(tid)->ended_by_owner);
}

void VerbsTransport::pump(Conn& conn) {
  pump_ctl(conn);
  while (conn.state == Conn::State::up && !conn.ready.empty() &&
         conn.posted.size() < options_.queue_depth) {
    const std::uint64_t tid = conn.ready.front();
    conn.ready.pop_front();
    auto it = transfers_.find(tid);
    if (it == transfers_.end() || it->second->finished) continue;
    if (post_some(conn, *it->second)) conn.ready.push_back(tid);
  }
  arm_watchdog();
}

namespace {

/// The window of the owner's memory that holds `remote`, or null.
const Window* window_of(const VerbsTransfer& t, std::uint64_t remote) {
  auto w = std::upper_bound(t.windows.begin(), t.windows.end(), remote,
                            [](std::uint64_t a, const Window& x) { return a < x.addr; });
  if (w == t.windows.begin() || remote - std::prev(w)->addr >= std::prev(w)->len) return nullptr;
  return &*std::prev(w);
}

}  // namespace

bool VerbsTransport::post_data(Conn& conn, VerbsTransfer& t, std::uint64_t remote,
                               std::uint32_t rkey, ibv_sge* sges, std::size_t n, bool last,
                               std::uint64_t chunk) {
  ibv_send_wr wr{};
  Posted p;
  p.seq = conn.next_seq++;
  p.transfer = t.id;
  p.chunk = chunk;
  wr.wr_id = p.seq;
  wr.opcode = t.spec.access == Access::read ? IBV_WR_RDMA_READ : IBV_WR_RDMA_WRITE;
  wr.sg_list = sges;
  wr.num_sge = static_cast<int>(n);
  wr.wr.rdma.remote_addr = remote;
  wr.wr.rdma.rkey = rkey;
  // Selective signalling: one in signal_every, the last of a transfer (or of a staging chunk),
  // and the one that fills the queue (so that some completion always comes back to make room).
  const bool signaled = ++conn.since_signal >= options_.signal_every || last ||
                        conn.posted.size() + 1 >= options_.queue_depth;
  if (signaled) {
    wr.send_flags = IBV_SEND_SIGNALED;
    conn.since_signal = 0;
    ++counters_.signaled_wrs;
  }
  ibv_send_wr* bad = nullptr;
  if (api_.post_send(conn.qp, &wr, &bad) != 0) {
    fail_conn(conn, ErrorCode::Internal, std::string("ibv_post_send: ") + std::strerror(errno));
    return false;
  }
  conn.posted.push_back(p);
  ++t.outstanding;
  ++counters_.data_wrs;
  return true;
}

bool VerbsTransport::post_chunk_wr(Conn& conn, VerbsTransfer& t) {
  const std::uint64_t id = t.postable.front();
  Chunk& c = t.chunks.at(id);
  const std::uint64_t remote = c.remote + c.posted;
  const Window* win = window_of(t, remote);
  if (win == nullptr) {
    finish_transfer(t, Error(ErrorCode::ProtocolError,
                             "peer '" + t.spec.peer_name +
                                 "' gave no key for a range it accepted in the claim"));
    return false;
  }
  std::uint64_t take =
      std::min({win->addr + win->len - remote, conn.dev->max_msg, c.len - c.posted});
  const auto local = reinterpret_cast<std::uint64_t>(c.buf) + c.posted;
  std::uint64_t room = 0;
  const MrSet* set = chunk_set(c.buf);
  ibv_mr* mr = set == nullptr ? nullptr : set->find(conn.dev->ctx, local, room);
  if (mr == nullptr) {
    finish_transfer(
        t, Error(ErrorCode::Internal, "staging chunk not registered on " + conn.dev->name));
    return false;
  }
  take = std::min({take, room, std::uint64_t{1} << 31});
  ibv_sge sge{local, static_cast<std::uint32_t>(take), mr->lkey};
  const bool last = c.posted + take == c.len;
  if (!post_data(conn, t, remote, win->rkey, &sge, 1, last, id)) return false;
  c.posted += take;
  ++c.wrs;
  if (last) t.postable.pop_front();
  return true;
}

bool VerbsTransport::post_some(Conn& conn, VerbsTransfer& t) {
  Device& dev = *conn.dev;
  const auto& segs = t.spec.segments;
  const auto max_sge = static_cast<std::size_t>(dev.max_sge);
  ibv_sge sges[32];
  for (int turn = 0; turn < kWrsPerTurn && conn.posted.size() < options_.queue_depth; ++turn) {
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
        staging_failed(t, e);
        return false;
      }
      continue;
    }
    // One WR: a run of the owner's memory inside one window, at most max_msg bytes, gathered
    // from at most max_sge local pieces, each inside one local registration.
    const std::uint64_t remote = segs[t.seg].remote_addr + t.off;
    const Window* win = window_of(t, remote);
    if (win == nullptr) {
      finish_transfer(t, Error(ErrorCode::ProtocolError,
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
        finish_transfer(t,
                        Error(ErrorCode::Internal, "local memory not registered on " + dev.name));
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
    if (!post_data(conn, t, remote, win->rkey, sges, n, t.seg >= segs.size(), 0)) return false;
  }
  // Everything is posted once the segments are through and no chunk waits to be posted or
  // for its device-to-host copy.
  t.all_posted = t.seg >= segs.size() && t.postable.empty() &&
                 std::all_of(t.chunks.begin(), t.chunks.end(),
                             [](const auto& kv) { return kv.second.posted == kv.second.len; });
  if (t.all_posted) return false;
  return !t.postable.empty() || (t.seg < segs.size() && !t.waiting_chunk);
}

void VerbsTransport::wr_done(Conn& conn, std::uint64_t tid, const ibv_wc* error) {
  auto it = transfers_.find(tid);
  if (it == transfers_.end() || it->second->finished) return;
  VerbsTransfer& t = *it->second;
  if (error != nullptr) {
    const char* op = t.spec.access == Access::read ? "RDMA READ from" : "RDMA WRITE to";
    if (t.ended_by_owner) {
      finish_transfer(t, t.ended_by_owner);
      return;
    }
    std::string text = std::string(op) + " peer '" + t.spec.peer_name +
                       "' failed: " + why_failed(conn, error->status);
    if (error->status == IBV_WC_REM_ACCESS_ERR)
      // What a dead key means, in the words every method uses for a refused request (the
      // owner's notice, when it comes first, says why instead; it may not come: the owner's
      // queue pair fails with ours).
      text += ": no live operation matches this id and token (the owner ended it)";
    finish_transfer(t, Error(code_of(error->status), text));
    return;
  }
  maybe_done(conn, t);
}

void VerbsTransport::maybe_done(Conn& conn, VerbsTransfer& t) {
  if (t.finished || t.outstanding != 0) return;
  if (t.ended_by_owner) {
    finish_transfer(t, t.ended_by_owner);
    return;
  }
  if (!t.all_posted || t.done_sent || !t.chunks.empty()) return;
  // Every byte is in place (read: staged chunks copied to the device too) or placed before DONE
  // reaches the owner (write).
  t.done_sent = true;
  const std::uint64_t req = next_req_++;
  const Pending& done = pending_[req] =
      Pending{t.id, true, t.spec.remote_id, t.spec.token, t.spec.access};
  send_done(conn, done, std::nullopt, req);
}

void VerbsTransport::send_done(Conn& conn, const Pending& what, const std::optional<Error>& error,
                               std::uint64_t req) {
  tcp::FrameHeader h;
  h.type = tcp::FrameType::done;
  h.req_id = req;
  h.op_id = what.op;
  h.token = what.token;
  h.flags = static_cast<std::uint16_t>(what.access);
  if (error) h.status = static_cast<std::uint32_t>(error->code());
  send_ctl(conn, h, error ? error->message() : std::string());
}

void VerbsTransport::finish_transfer(VerbsTransfer& t, std::optional<Error> error, bool setup) {
  if (t.finished) return;
  t.finished = true;
  if (Conn* conn = conn_of(t.conn)) {
    std::erase(conn->ready, t.id);
    std::erase(conn->waiting, t.id);
  }
  report_later(defer_, life_, transfers_, t.id, std::move(error), setup);
}

bool VerbsTransport::wait_quiet(VerbsTransfer& t, std::chrono::steady_clock::time_point deadline) {
  while (t.outstanding > 0) {
    std::size_t found = 0;
    for (auto& dev : devices_) found += drain(*dev);
    if (t.outstanding == 0) break;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    if (found == 0) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  return true;
}

void VerbsTransport::cancel_transfer(VerbsTransfer& t, const Error& reason) {
  const bool was_finished = t.finished;
  t.finished = true;
  t.notified = true;  // no observer call after cancel()
  Conn* conn = conn_of(t.conn);
  if (conn != nullptr) {
    std::erase(conn->ready, t.id);
    std::erase(conn->waiting, t.id);
  }
  // cancel()'s promise: no work request touching the local memory remains when it returns.
  // Those under way complete in the time of one queue's worth of data; a peer that does not
  // answer within peer_timeout has its queue pair flushed (every transfer on it fails).
  if (t.outstanding > 0) {
    const auto deadline = std::chrono::steady_clock::now() + options_.peer_timeout;
    if (!wait_quiet(t, deadline) && (conn = conn_of(t.conn)) != nullptr) {
      fail_conn(*conn, ErrorCode::Cancelled, "flushed by cancel: " + reason.message());
      wait_quiet(t, std::chrono::steady_clock::now() + options_.peer_timeout);
    }
  }
  // No work request reaches a staging chunk now: cancel the chunks' copies (waiting for one
  // under way, so that none touches the device memory after this) and give them back.
  if (!t.chunks.empty()) drop_chunks(t);
  if (was_finished) return;
  conn = conn_of(t.conn);
  if (conn == nullptr || conn->state != Conn::State::up) return;
  if (t.secret) {
    // The owner hears why, after every request of ours on the same queue pair.
    send_done(*conn, Pending{t.id, false, t.spec.remote_id, t.spec.token, t.spec.access}, reason);
  }
  // A claim still on the way is answered by on_reply(), which tells the owner then.
}

void VerbsTransport::forget_transfer(VerbsTransfer& t) {
  if (!t.finished || t.outstanding > 0 || !t.chunks.empty())
    cancel_transfer(t, Error(ErrorCode::Cancelled, "the transfer was dropped"));
  transfers_.erase(t.id);
  t.owner = nullptr;
}

}  // namespace ferry::transport::verbs
