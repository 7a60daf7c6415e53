// The passive side of verbs. The owner's CPU never touches the bytes: it checks the claim,
// hands the claimant keys that reach this operation's memory alone, and hears DONE.

#include <algorithm>
#include <cstring>

#include <ferry/rdma_metadata.hpp>

#include "loop/ids.hpp"
#include "transport/verbs/verbs_transport.hpp"
#include "transport/wire/status.hpp"

namespace ferry::transport::verbs {

namespace {

using wire::FrameHeader;
using wire::FrameType;

void* id_ptr(std::uint64_t id) { return reinterpret_cast<void*>(static_cast<std::uintptr_t>(id)); }

/// CLAIMED's and ATTACHED's payload: each window as (addr, len, rkey) in 8 + 8 + 4 bytes, padded
/// to 24.
std::string keys_body(const std::vector<Window>& windows) {
  std::string body(windows.size() * 24, '\0');
  for (std::size_t i = 0; i < windows.size(); ++i) {
    std::memcpy(body.data() + i * 24, &windows[i].addr, 8);
    std::memcpy(body.data() + i * 24 + 8, &windows[i].len, 8);
    std::memcpy(body.data() + i * 24 + 16, &windows[i].rkey, 4);
  }
  return body;
}

}  // namespace

VerbsServer::VerbsServer(VerbsTransport& t, Defer defer)
    : t_(t),
      exposures_("verbs", defer),
      regions_("verbs", exposures_, defer),
      admission_(t.ctx_.loop, t.ctx_.listener, [this](std::uint64_t id, const std::string& why) {
        // Unclaimed for too long, or making room: the peer's connection goes.
        if (Conn* conn = t_.conn_of(id)) t_.fail_conn(*conn, ErrorCode::AccessDenied, why);
      }) {}

void VerbsServer::close() {
  admission_.stop();
  std::vector<std::uint64_t> ids;
  for (auto& [id, s] : served_) ids.push_back(id);
  for (std::uint64_t id : ids) end_served(id);
  region_served_.clear();
  regions_.clear();
  exposures_.clear();
}

bool VerbsServer::serving() const {
  return std::any_of(served_.begin(), served_.end(),
                     [](const auto& kv) { return kv.second->conn != 0; });
}

rdma_cm_id* VerbsServer::connect_request(rdma_cm_event& ev) {
  rdma_cm_id* id = ev.id;
  CmPrivate priv;
  if (ev.param.conn.private_data_len < sizeof priv || t_.closed_) {
    t_.api_.reject(id, nullptr, 0);
    return id;
  }
  std::memcpy(&priv, ev.param.conn.private_data, sizeof priv);
  // Each accepted request costs a queue pair and registered buffers before the peer proves
  // anything: within the listener's bounds only.
  if (priv.magic != kCmMagic || priv.version != 1 || !admission_.admit()) {
    t_.api_.reject(id, nullptr, 0);
    return id;
  }
  std::shared_ptr<Conn> conn = t_.new_conn(false);
  conn->cm = id;
  conn->state = Conn::State::accepting;
  conn->peer_id = loop::hex16(priv.id);
  id->context = id_ptr(conn->id);
  admission_.accepted(conn->id);
  Device* dev = t_.devices_->find(id->verbs);
  try {
    if (dev == nullptr) throw Error(ErrorCode::Internal, "no device of ours reaches it");
    conn->make_qp(*dev);
  } catch (const Error& e) {
    t_.api_.reject(id, nullptr, 0);
    t_.fail_conn(*conn, e.code(), e.message());
    return nullptr;
  }
  t_.by_qp_[conn->qp_num] = conn->id;
  CmPrivate mine;
  mine.id = t_.ctx_.local_id;
  rdma_conn_param param{};
  param.private_data = &mine;
  param.private_data_len = sizeof mine;
  param.responder_resources =
      static_cast<std::uint8_t>(std::min(16, std::max(1, dev->attr.max_qp_rd_atom)));
  param.initiator_depth =
      static_cast<std::uint8_t>(std::min(16, std::max(1, dev->attr.max_qp_init_rd_atom)));
  param.retry_count = 7;
  param.rnr_retry_count = 7;
  if (t_.api_.accept(id, &param) != 0)
    t_.fail_conn(*conn, ErrorCode::PeerLost, std::string("rdma_accept: ") + std::strerror(errno));
  return nullptr;
}

void VerbsServer::register_spans(Served& served, Access access, bool cached, bool own) {
  for (const Region& span : served.spans) {
    // A span of CUDA memory may join touching allocations: a registration for each.
    const auto end = reinterpret_cast<std::uint64_t>(span.ptr) + span.size;
    for (std::uint64_t at = reinterpret_cast<std::uint64_t>(span.ptr); cached && at < end;) {
      auto reg = t_.acquire(
          Region{reinterpret_cast<std::byte*>(at), end - at, span.kind, span.cuda_device});
      served.regs.push_back(reg);
      if (const auto* set = static_cast<const MrSet*>(reg->handle.get());
          set != nullptr && set->staged)
        // The owner of one-sided RDMA cannot stage: another method serves this memory.
        throw t_.devices_->gpudirect().unreachable(*set);
      if (reg->base + reg->size <= at)
        throw Error(ErrorCode::Internal, "verbs: a registration short of its range");
      at = reg->base + reg->size;
    }
    if (own) {
      // No windows: a registration of this operation's (attachment's) own, whose keys die
      // with it.
      int flags = 0;
      if (allows(access, Access::read)) flags |= IBV_ACCESS_REMOTE_READ;
      if (allows(access, Access::write)) flags |= IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE;
      served.own.push_back(t_.devices_->register_everywhere(span, flags));
    }
  }
}

void VerbsServer::expose(const Exposure& exposure, ExposureObserver& observer) {
  exposures_.add(exposure, observer);
  auto served = std::make_unique<Served>();
  served->spans = exposures_.find(exposure.id)->spans;
  try {
    register_spans(*served, exposure.access, true, !t_.devices_->uses_memory_windows());
  } catch (...) {
    exposures_.revoke(exposure.id);
    throw;
  }
  served_[exposure.id] = std::move(served);
}

void VerbsServer::revoke(std::uint64_t id, const Error& reason) {
  const std::uint64_t conn_id = exposures_.revoke(id);
  end_served(id);
  Conn* conn = conn_id == 0 ? nullptr : t_.conn_of(conn_id);
  if (conn != nullptr && conn->state == Conn::State::up) {
    // The claimant learns why (its next request would meet a dead key in any case).
    FrameHeader h;
    h.type = FrameType::status;
    h.op_id = id;
    h.status = wire::to_wire(reason.code());
    conn->send_ctl(h, reason.message());
  }
}

void VerbsServer::end_served(std::uint64_t id) {
  auto it = served_.find(id);
  if (it == served_.end()) return;
  std::unique_ptr<Served> s = std::move(it->second);
  served_.erase(it);
  if (Conn* conn = s->conn == 0 ? nullptr : t_.conn_of(s->conn)) {
    std::erase_if(conn->outbox, [&](const CtlItem& item) {
      return item.mw != nullptr && std::find(s->mws.begin(), s->mws.end(), item.mw) != s->mws.end();
    });
  }
  // revoke()'s promise: deallocating a window (deregistering a region) returns only when no
  // access through it is under way, and none starts after.
  for (ibv_mw* mw : s->mws) t_.api_.dealloc_mw(mw);
  s->mws.clear();
  s->own.clear();
}

void VerbsServer::finish_exposure(std::uint64_t id, std::optional<Error> peer_error) {
  exposures_.finish(id, std::move(peer_error));
  end_served(id);
}

void VerbsServer::lose(Conn& conn, const Error& error) {
  admission_.closed(conn.id);
  refused_.erase(conn.id);
  std::vector<std::uint64_t> ended;
  for (auto& [id, s] : served_)
    if (s->conn == conn.id) ended.push_back(id);
  for (std::uint64_t id : ended) end_served(id);
  exposures_.lose_connection(conn.id, error);
}

void VerbsServer::reply(Conn& conn, std::uint64_t req, const Error* error) {
  conn.send_ctl(wire::status_frame(req, error), wire::status_text(error));
}

wire::Sink VerbsServer::receive_claim(Conn& conn, const FrameHeader& h) {
  // Nothing is sized by what a peer says before it shows a live token of the right kind: a
  // refused claim's ranges are read and dropped.
  refused_.erase(conn.id);
  const bool kind_ok = h.flags == static_cast<std::uint16_t>(Access::read) ||
                       h.flags == static_cast<std::uint16_t>(Access::write);
  auto v = exposures_.check(h.op_id, h.token, static_cast<Access>(h.flags), 0, 0, conn.id);
  if (!kind_ok || !v.ok()) {
    refused_[conn.id] = kind_ok ? Error(v.code, v.message)
                                : Error(ErrorCode::ProtocolError, "CLAIM names no access kind");
    return {};
  }
  const std::uint64_t most =
      16 * (2 * std::uint64_t{RdmaMetadata::kMaxDescriptors} + v.entry->exposure.regions.size());
  if (h.len == 0 || h.len % 16 != 0 || h.len > most)
    return wire::fatal("CLAIM of " + std::to_string(h.len) + " bytes of ranges");
  conn.payload.assign(h.len, '\0');
  wire::Sink sink;
  sink.dest = reinterpret_cast<std::byte*>(conn.payload.data());
  return sink;
}

void VerbsServer::windows_for(Conn& conn, Served& served, Access access, std::vector<Window>& out,
                              std::vector<CtlItem>& binds) {
  // The keys: a window per registered piece of each span, bound to this connection's queue
  // pair alone, or the pieces of the operation's own registration.
  const bool windows = t_.devices_->uses_memory_windows();
  for (std::size_t i = 0; i < served.spans.size(); ++i) {
    const Region& span = served.spans[i];
    const auto base = reinterpret_cast<std::uint64_t>(span.ptr);
    for (std::uint64_t addr = base; addr < base + span.size;) {
      const MrSet* set = windows ? nullptr : served.own[i].get();
      for (std::size_t r = 0; windows && r < served.regs.size(); ++r)
        if (served.regs[r]->covers(addr, 1))
          set = static_cast<const MrSet*>(served.regs[r]->handle.get());
      std::uint64_t room = 0;
      ibv_mr* mr = set == nullptr ? nullptr : set->find(conn.dev->ctx, addr, room);
      if (mr == nullptr)
        throw Error(ErrorCode::Internal,
                    "the operation's memory is not registered on " + conn.dev->name);
      const std::uint64_t n = std::min(room, base + span.size - addr);
      Window w{addr, n, mr->rkey};
      if (windows) {
        ibv_mw* mw = t_.api_.alloc_mw(conn.dev->pd->pd, IBV_MW_TYPE_2);
        if (mw == nullptr)
          throw Error(ErrorCode::Internal, "cannot allocate a memory window on " + conn.dev->name);
        served.mws.push_back(mw);
        CtlItem bind;
        bind.mw = mw;
        bind.rkey = ibv_inc_rkey(mw->rkey);
        bind.bind.mr = mr;
        bind.bind.addr = addr;
        bind.bind.length = n;
        unsigned flags = 0;
        if (allows(access, Access::read)) flags |= IBV_ACCESS_REMOTE_READ;
        if (allows(access, Access::write)) flags |= IBV_ACCESS_REMOTE_WRITE;
        bind.bind.mw_access_flags = flags;
        w.rkey = bind.rkey;
        binds.push_back(std::move(bind));
      }
      out.push_back(w);
      addr += n;
    }
  }
}

void VerbsServer::serve_claim(Conn& conn, const FrameHeader& h, const std::string& payload) {
  if (auto r = refused_.find(conn.id); r != refused_.end()) {
    const Error refused = *r->second;
    refused_.erase(r);
    reply(conn, h.req_id, &refused);
    return;
  }
  kit::Exposures::Ranges ranges;
  auto v = exposures_.check_claim(h.op_id, h.token, h.flags, payload.data(), payload.size(),
                                  conn.id, ranges);
  if (!v.ok()) {
    const Error refused(v.code, v.message);
    reply(conn, h.req_id, &refused);
    return;
  }
  auto sit = served_.find(h.op_id);
  if (sit == served_.end() || sit->second->conn != 0) {
    const Error refused(ErrorCode::AccessDenied, "the operation is claimed already");
    reply(conn, h.req_id, &refused);
    return;
  }
  Served& served = *sit->second;
  std::vector<Window> out;
  std::vector<CtlItem> binds;
  const std::optional<Error> failure =
      refusal([&] { windows_for(conn, served, static_cast<Access>(h.flags), out, binds); });
  std::optional<Token> secret;
  if (!failure)
    secret = exposures_.claim(*v.entry, conn.id, conn.peer_name, conn.describe(), conn.peer_id);
  if (!secret) {
    for (ibv_mw* mw : served.mws) t_.api_.dealloc_mw(mw);
    served.mws.clear();
    const Error refused =
        failure ? *failure : Error(ErrorCode::AccessDenied, "the operation is claimed already");
    reply(conn, h.req_id, &refused);
    return;
  }
  admission_.claimed(conn.id);
  served.conn = conn.id;
  served.ranges = std::move(ranges);
  t_.counters_.windows_bound += binds.size();
  // The binds go first on the same send queue: the peer has the keys only after they hold.
  for (CtlItem& b : binds) conn.bind(std::move(b));
  const std::string body = keys_body(out);
  FrameHeader answer;
  answer.type = FrameType::claimed;
  answer.req_id = h.req_id;
  answer.op_id = h.op_id;
  answer.token = *secret;
  conn.send_ctl(answer, {}, body);
}

void VerbsServer::serve_done(Conn& conn, const FrameHeader& h, const std::string& message) {
  if (regions_.is_attachment(h.op_id)) {
    // A transfer on an attachment ends with ENDED; the attachment with DETACH.
    const Error refused(ErrorCode::ProtocolError, "DONE names an attachment");
    reply(conn, h.req_id, &refused);
    return;
  }
  auto v = exposures_.check_done(h.op_id, h.token, h.flags, conn.id);
  if (!v.ok()) {
    const Error refused(v.code, v.message);
    reply(conn, h.req_id, &refused);
    return;
  }
  const auto access = static_cast<Access>(h.flags);
  if (h.status != 0) {
    const Error noted(ErrorCode::Cancelled, "noted");
    reply(conn, h.req_id, &noted);
    finish_exposure(h.op_id, wire::ended_by_peer(h.status, message, conn.describe()));
    return;
  }
  auto sit = served_.find(h.op_id);
  if (sit == served_.end() || sit->second->conn != conn.id) {
    const Error refused(ErrorCode::ProtocolError, "DONE for an operation never claimed");
    reply(conn, h.req_id, &refused);
    return;
  }
  if (access == Access::write) {
    // DONE came after the peer's writes on the same queue pair: they are in place. A writable
    // is complete only when its claimed ranges cover every byte it exposes.
    for (const auto& [addr, len] : sit->second->ranges) exposures_.landed(h.op_id, addr, len);
    if (auto short_of = exposures_.unwritten(h.op_id, conn.describe())) {
      reply(conn, h.req_id, &*short_of);
      finish_exposure(h.op_id, *short_of);
      return;
    }
  }
  reply(conn, h.req_id, nullptr);
  finish_exposure(h.op_id, std::nullopt);
}

void VerbsServer::serve_region(const RegionExposure& region, RegionObserver& observer) {
  auto served = std::make_unique<Served>();
  served->spans = kit::ExposureTable::merged(region.regions);
  // Registered once, through the cache; an attachment's keys are its own (windows, or its own
  // registrations where the device has no windows).
  register_spans(*served, region.access, true, false);
  regions_.add(region, observer);
  region_served_[region.id] = std::move(served);
}

void VerbsServer::serve_attach(Conn& conn, const FrameHeader& h) {
  auto v = regions_.attach(h.op_id, h.token, h.flags, conn.id, conn.peer_name, conn.describe(),
                           conn.peer_id);
  if (!v.ok()) {
    const Error refused(v.code, v.message);
    reply(conn, h.req_id, &refused);
    return;
  }
  const auto access = static_cast<Access>(h.flags);
  auto served = std::make_unique<Served>();
  const Served& region = *region_served_.at(h.op_id);
  served->spans = region.spans;
  served->regs = region.regs;
  std::vector<Window> out;
  std::vector<CtlItem> binds;
  std::optional<Error> failure = refusal([&] {
    if (!t_.devices_->uses_memory_windows()) register_spans(*served, access, false, true);
    windows_for(conn, *served, access, out, binds);
  });
  if (failure) {
    for (ibv_mw* mw : served->mws) t_.api_.dealloc_mw(mw);
    regions_.revoke(v.attachment);
    reply(conn, h.req_id, &*failure);
    return;
  }
  admission_.claimed(conn.id);
  served->conn = conn.id;
  served_[v.attachment] = std::move(served);
  t_.counters_.windows_bound += binds.size();
  // The binds go first on the same send queue: the peer has the keys only after they hold.
  for (CtlItem& b : binds) conn.bind(std::move(b));
  const std::string body = keys_body(out);
  FrameHeader answer;
  answer.type = FrameType::attached;
  answer.req_id = h.req_id;
  answer.op_id = v.attachment;
  answer.token = v.secret;
  conn.send_ctl(answer, {}, body);
}

wire::Sink VerbsServer::receive_ended(Conn& conn, const FrameHeader& h, std::string tag) {
  if (h.len == 0 || h.len % 16 != 0 || h.len > kit::Regions::kMaxEndedBytes)
    return wire::fatal("ENDED of " + std::to_string(h.len) + " bytes of ranges");
  conn.tag = std::move(tag);
  conn.payload.assign(h.len, '\0');
  wire::Sink sink;
  sink.dest = reinterpret_cast<std::byte*>(conn.payload.data());
  return sink;
}

void VerbsServer::serve_ended(Conn& conn, const FrameHeader& h, const std::string& ranges) {
  // A SEND behind the peer's data on the same queue pair: a write's bytes are in place.
  std::optional<Error> outcome;
  if (h.status != 0) outcome = wire::ended_by_peer(h.status, {}, conn.describe());
  auto v = regions_.ended(h.op_id, h.token, h.flags, std::move(outcome), std::move(conn.tag),
                          ranges.data(), ranges.size(), conn.id);
  conn.tag.clear();
  if (h.req_id == 0) return;  // a notice
  if (!v.ok()) {
    const Error refused(v.code, v.message);
    reply(conn, h.req_id, &refused);
    return;
  }
  reply(conn, h.req_id, nullptr);
}

void VerbsServer::serve_detach(Conn& conn, const FrameHeader& h) {
  if (!regions_.holds(h.op_id, h.token, conn.id)) return;
  end_served(h.op_id);
  regions_.detach(h.op_id, h.token, conn.id);
}

void VerbsServer::end_attachment(std::uint64_t id, const Error& reason) {
  if (!regions_.is_attachment(id)) return;
  // Its keys may be gone already (the peer detached, or its connection was lost, and the owner
  // has not heard yet): then only the owner's pending event goes.
  auto it = served_.find(id);
  if (it == served_.end()) {
    regions_.revoke(id);
    return;
  }
  Conn* conn = t_.conn_of(it->second->conn);
  // When the windows are deallocated (the registrations gone), no access through them runs.
  end_served(id);
  regions_.revoke(id);
  if (conn != nullptr && conn->state == Conn::State::up) {
    FrameHeader h;
    h.type = FrameType::status;
    h.op_id = id;
    h.status = wire::to_wire(reason.code());
    conn->send_ctl(h, reason.message());
  }
}

void VerbsServer::revoke_attachment(std::uint64_t attachment, const Error& reason) {
  end_attachment(attachment, reason);
}

void VerbsServer::end_region(std::uint64_t id, const Error& reason) {
  for (const auto& [attachment, conn] : regions_.attachments_of(id))
    end_attachment(attachment, reason);
  regions_.end(id);
  region_served_.erase(id);
}

}  // namespace ferry::transport::verbs
