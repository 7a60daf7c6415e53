#include <algorithm>
#include <cstring>

#include "transport/verbs/verbs_internal.hpp"

namespace ferry::transport::verbs {

// ---------------------------------------------------------------------------------------
// The passive side. The owner's CPU never touches the bytes: it checks the claim, hands the
// claimant keys that reach this operation's memory alone, and hears DONE.

std::string VerbsTransport::expose(const Exposure& exposure, ExposureObserver& observer) {
  if (closed_) throw Error(ErrorCode::InvalidState, "the transport is closed");
  exposures_.add(exposure, observer);
  auto served = std::make_unique<Served>();
  served->spans = exposures_.find(exposure.id)->spans;
  try {
    for (const Region& span : served->spans) {
      // A span of CUDA memory may join touching allocations: a registration for each.
      const auto end = reinterpret_cast<std::uint64_t>(span.ptr) + span.size;
      for (std::uint64_t at = reinterpret_cast<std::uint64_t>(span.ptr); at < end;) {
        auto reg = acquire(
            Region{reinterpret_cast<std::byte*>(at), end - at, span.kind, span.cuda_device});
        served->regs.push_back(reg);
        if (const auto* set = static_cast<const MrSet*>(reg->handle.get());
            set != nullptr && set->staged)
          // The owner of one-sided RDMA cannot stage: another method serves this memory.
          throw Error(ErrorCode::Unsupported, cuda_unreachable(*set));
        if (reg->base + reg->size <= at)
          throw Error(ErrorCode::Internal, "verbs: a registration short of its range");
        at = reg->base + reg->size;
      }
      if (!uses_memory_windows()) {
        // No windows: a registration of this operation's own, whose keys die with it.
        const int access = exposure.access == Access::read
                               ? IBV_ACCESS_REMOTE_READ
                               : IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE;
        served->own.push_back(register_everywhere(span, access));
      }
    }
  } catch (...) {
    exposures_.revoke(exposure.id);
    throw;
  }
  served_[exposure.id] = std::move(served);
  return {};
}

void VerbsTransport::revoke(std::uint64_t id, const Error& reason) {
  const std::uint64_t conn_id = exposures_.revoke(id);
  end_served(id);
  Conn* conn = conn_id == 0 ? nullptr : conn_of(conn_id);
  if (conn != nullptr && conn->state == Conn::State::up) {
    // The claimant learns why (its next request would meet a dead key in any case).
    tcp::FrameHeader h;
    h.type = tcp::FrameType::status;
    h.op_id = id;
    h.status = static_cast<std::uint32_t>(reason.code());
    send_ctl(*conn, h, reason.message());
  }
}

void VerbsTransport::end_served(std::uint64_t id) {
  auto it = served_.find(id);
  if (it == served_.end()) return;
  std::unique_ptr<Served> s = std::move(it->second);
  served_.erase(it);
  if (Conn* conn = s->conn == 0 ? nullptr : conn_of(s->conn)) {
    std::erase_if(conn->outbox, [&](const CtlItem& item) {
      return item.mw != nullptr && std::find(s->mws.begin(), s->mws.end(), item.mw) != s->mws.end();
    });
  }
  // revoke()'s promise: deallocating a window (deregistering a region) returns only when no
  // access through it is under way, and none starts after.
  for (ibv_mw* mw : s->mws) api_.dealloc_mw(mw);
  s->mws.clear();
  s->own.clear();
}

void VerbsTransport::finish_exposure(std::uint64_t id, std::optional<Error> peer_error) {
  exposures_.finish(id, std::move(peer_error));
  end_served(id);
}

void VerbsTransport::reply_status(Conn& conn, std::uint64_t req, ErrorCode code,
                                  const std::string& msg) {
  tcp::FrameHeader h;
  h.type = tcp::FrameType::status;
  h.req_id = req;
  h.status = static_cast<std::uint32_t>(code);
  send_ctl(conn, h, msg);
}

void VerbsTransport::serve_claim(Conn& conn, const tcp::FrameHeader& h,
                                 const std::string& payload) {
  Exposures::Ranges ranges;
  auto v = exposures_.check_claim(h.op_id, h.token, h.flags, payload.data(), payload.size(),
                                  conn.id, ranges);
  if (!v.ok()) {
    reply_status(conn, h.req_id, v.code, v.message);
    return;
  }
  Exposures::Entry* entry = v.entry;
  const auto access = static_cast<Access>(h.flags);
  auto sit = served_.find(h.op_id);
  if (sit == served_.end() || sit->second->conn != 0) {
    reply_status(conn, h.req_id, ErrorCode::AccessDenied, "the operation is claimed already");
    return;
  }
  Served& served = *sit->second;
  // The keys: a window per registered piece of each span, bound to this connection's queue
  // pair alone, or the pieces of the operation's own registration.
  const bool windows = uses_memory_windows();
  std::vector<Window> out;
  std::vector<CtlItem> binds;
  std::string failure;
  for (std::size_t i = 0; i < served.spans.size() && failure.empty(); ++i) {
    const Region& span = served.spans[i];
    const auto base = reinterpret_cast<std::uint64_t>(span.ptr);
    for (std::uint64_t addr = base; addr < base + span.size;) {
      const MrSet* set = windows ? nullptr : served.own[i].get();
      for (std::size_t r = 0; windows && r < served.regs.size(); ++r)
        if (served.regs[r]->covers(addr, 1))
          set = static_cast<const MrSet*>(served.regs[r]->handle.get());
      std::uint64_t room = 0;
      ibv_mr* mr = set == nullptr ? nullptr : set->find(conn.dev->ctx, addr, room);
      if (mr == nullptr) {
        failure = "the operation's memory is not registered on " + conn.dev->name;
        break;
      }
      const std::uint64_t n = std::min(room, base + span.size - addr);
      Window w{addr, n, mr->rkey};
      if (windows) {
        ibv_mw* mw = api_.alloc_mw(conn.dev->pd->pd, IBV_MW_TYPE_2);
        if (mw == nullptr) {
          failure = "cannot allocate a memory window on " + conn.dev->name;
          break;
        }
        served.mws.push_back(mw);
        CtlItem bind;
        bind.mw = mw;
        bind.rkey = ibv_inc_rkey(mw->rkey);
        bind.bind.mr = mr;
        bind.bind.addr = addr;
        bind.bind.length = n;
        bind.bind.mw_access_flags = static_cast<unsigned>(
            access == Access::read ? IBV_ACCESS_REMOTE_READ : IBV_ACCESS_REMOTE_WRITE);
        w.rkey = bind.rkey;
        binds.push_back(std::move(bind));
      }
      out.push_back(w);
      addr += n;
    }
  }
  if (!failure.empty()) {
    for (ibv_mw* mw : served.mws) api_.dealloc_mw(mw);
    served.mws.clear();
    reply_status(conn, h.req_id, ErrorCode::Internal, failure);
    return;
  }
  auto secret = exposures_.claim(*entry, conn.id, conn.peer_name, conn.describe(), conn.peer_id);
  if (!secret) {
    for (ibv_mw* mw : served.mws) api_.dealloc_mw(mw);
    served.mws.clear();
    reply_status(conn, h.req_id, ErrorCode::AccessDenied, "the operation is claimed already");
    return;
  }
  served.conn = conn.id;
  served.ranges = std::move(ranges);
  counters_.windows_bound += binds.size();
  // The binds go first on the same send queue: the peer has the keys only after they hold.
  for (CtlItem& b : binds) conn.outbox.push_back(std::move(b));
  std::string body(out.size() * 24, '\0');
  for (std::size_t i = 0; i < out.size(); ++i) {
    std::memcpy(body.data() + i * 24, &out[i].addr, 8);
    std::memcpy(body.data() + i * 24 + 8, &out[i].len, 8);
    std::memcpy(body.data() + i * 24 + 16, &out[i].rkey, 4);
  }
  tcp::FrameHeader reply;
  reply.type = tcp::FrameType::claimed;
  reply.req_id = h.req_id;
  reply.op_id = h.op_id;
  reply.token = *secret;
  reply.len = body.size();
  send_ctl(conn, reply, {}, body);
}

void VerbsTransport::serve_done(Conn& conn, const tcp::FrameHeader& h, const std::string& message) {
  if (h.flags != static_cast<std::uint16_t>(Access::read) &&
      h.flags != static_cast<std::uint16_t>(Access::write)) {
    reply_status(conn, h.req_id, ErrorCode::ProtocolError, "DONE names no access kind");
    return;
  }
  const auto access = static_cast<Access>(h.flags);
  auto v = exposures_.check(h.op_id, h.token, access, 0, 0, conn.id);
  if (!v.ok()) {
    reply_status(conn, h.req_id, v.code, v.message);
    return;
  }
  if (h.status != 0) {
    reply_status(conn, h.req_id, ErrorCode::Cancelled, "noted");
    const ErrorCode code = tcp::code_from_wire(h.status);
    finish_exposure(h.op_id,
                    Error(code, "peer " + conn.describe() + " ended the transfer: " +
                                    (message.empty() ? std::string(to_string(code)) : message)));
    return;
  }
  auto sit = served_.find(h.op_id);
  if (sit == served_.end() || sit->second->conn != conn.id) {
    reply_status(conn, h.req_id, ErrorCode::ProtocolError, "DONE for an operation never claimed");
    return;
  }
  if (access == Access::write) {
    // DONE came after the peer's writes on the same queue pair: they are in place. A writable
    // is complete only when its claimed ranges cover every byte it exposes.
    for (const auto& [addr, len] : sit->second->ranges) exposures_.landed(h.op_id, addr, len);
    if (auto short_of = exposures_.unwritten(h.op_id); !short_of.empty()) {
      std::string why = "peer " + conn.describe() + " said it was done " + short_of;
      reply_status(conn, h.req_id, ErrorCode::ProtocolError, why);
      finish_exposure(h.op_id, Error(ErrorCode::ProtocolError, why));
      return;
    }
  }
  reply_status(conn, h.req_id, static_cast<ErrorCode>(0), {});
  finish_exposure(h.op_id, std::nullopt);
}

}  // namespace ferry::transport::verbs
