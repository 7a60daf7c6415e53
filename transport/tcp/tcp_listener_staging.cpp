// CUDA memory served by tcp: the method moves host memory only, so the exposure's device
// memory passes through pinned host chunks (cuda::Stager), one unit per request.
//
// READ: a device-to-host copy into the unit's chunk, then DATA from the chunk (tagged
// kStagedTag | unit); the unit goes when the frame has left. A READ that finds no chunk free
// waits, in order, until one comes back (the client's window bounds how many wait).
// WRITE: the payload lands in the unit's chunk (a heap buffer when none is free: the sink is
// needed at once), then a host-to-device copy; the request is answered when the copy ends, and
// a DONE waits for every copy of its exposure.
//
// Ending an exposure (end_claim) releases its frames from the connection, then drops its units
// (the stager cancels their copies, waiting for one under way, then gives the chunks back).

#include <algorithm>

#include "transport/cuda/stager.hpp"
#include "transport/tcp/tcp_listener.hpp"
#include "transport/wire/status.hpp"

namespace ferry::transport::tcp {

using wire::FrameHeader;
using wire::FrameType;
using wire::StreamConnection;

cuda::Stager& TcpListener::stager() {
  if (!stager_) {
    if (ctx_.cuda == nullptr) throw Error(ErrorCode::Unsupported, "tcp has no CUDA driver");
    const std::uint64_t chunks =
        std::clamp<std::uint64_t>(options_.window / options_.chunk_size + 4, 4, 64);
    stager_ = std::make_unique<cuda::Stager>(ctx_.loop, *ctx_.cuda, ctx_.defer, options_.chunk_size,
                                             chunks, ctx_.log);
    stager_->set_wake([this](std::uint64_t) { serve_waiting_reads(); });
  }
  return *stager_;
}

int TcpListener::device_of(const kit::Exposures::Entry& entry, const std::byte* ptr) {
  for (const Region& r : entry.exposure.regions)
    if (r.kind == MemoryKind::cuda && ptr >= r.ptr && ptr < r.ptr + r.size) return r.cuda_device;
  return -1;
}

void TcpListener::serve_read_staged(StreamConnection& conn, const FrameHeader& h, std::byte* src,
                                    int ordinal) {
  std::uint64_t unit = 0;
  try {
    unit = stager().open(h.op_id, {{src, h.len, ordinal}});
  } catch (const Error& e) {
    reply(conn, h.req_id, &e);
    return;
  }
  if (unit == 0) {
    waiting_reads_.push_back(Parked{conn.id(), h, {}, {}, ~std::uint64_t{0}});
    return;
  }
  staged_[unit] = Staged{h.op_id, conn.id(), h.req_id, false, h.addr, h.len};
  // The memory is being read until the DATA has left (or the claim ends).
  exposures_.sending(h.op_id);
  try {
    stager_->fill(unit,
                  [this, unit](const std::optional<Error>& error) { read_copied(unit, error); });
  } catch (const Error& e) {
    staged_.erase(unit);
    stager_->close(unit);
    reply(conn, h.req_id, &e);
    if (exposures_.sent(h.op_id)) finish_exposure(h.op_id, std::nullopt);
  }
}

void TcpListener::read_copied(std::uint64_t unit, const std::optional<Error>& error) {
  auto it = staged_.find(unit);
  if (it == staged_.end()) return;
  const Staged s = it->second;
  StreamConnection* conn = conns_.find(s.conn);
  if (conn == nullptr || !conn->open() || error) {
    staged_.erase(it);
    stager_->close(unit);
    if (conn != nullptr && conn->open()) reply(*conn, s.req, &*error);
    if (exposures_.sent(s.op)) finish_exposure(s.op, std::nullopt);
    return;
  }
  FrameHeader d;
  d.type = FrameType::data;
  d.req_id = s.req;
  d.addr = s.addr;
  d.len = s.len;
  conn->send(d, {}, stager_->chunk(unit), kStagedTag | unit);  // on_sent gives the unit back
}

wire::Sink TcpListener::serve_write_staged(StreamConnection& conn, const FrameHeader& h,
                                           std::byte* dst, int ordinal) {
  std::uint64_t unit = 0;
  try {
    unit = stager().open(h.op_id, {{dst, h.len, ordinal}}, /*heap_if_none=*/true);
  } catch (const Error& e) {
    return {};  // discarded; on_payload answers (the exposure is not written)
  }
  staged_[unit] = Staged{h.op_id, conn.id(), h.req_id, true, h.addr, h.len};
  receiving_[conn.id()] = unit;
  wire::Sink sink;
  sink.dest = stager_->chunk(unit);
  sink.tag = h.op_id;  // end_claim drops the sink by operation
  return sink;
}

bool TcpListener::staged_payload(StreamConnection& conn, const FrameHeader& h, bool intact) {
  auto r = receiving_.find(conn.id());
  if (r == receiving_.end()) return false;
  const std::uint64_t unit = r->second;
  receiving_.erase(r);
  auto it = staged_.find(unit);
  if (it == staged_.end()) return false;  // dropped with its claim: refused as usual
  if (!intact || it->second.req != h.req_id || exposures_.find(h.op_id) == nullptr) {
    staged_.erase(it);
    stager_->close(unit);
    return false;
  }
  try {
    stager_->drain(unit,
                   [this, unit](const std::optional<Error>& error) { write_copied(unit, error); });
  } catch (const Error& e) {
    staged_.erase(it);
    stager_->close(unit);
    reply(conn, h.req_id, &e);
  }
  return true;
}

void TcpListener::write_copied(std::uint64_t unit, const std::optional<Error>& error) {
  auto it = staged_.find(unit);
  if (it == staged_.end()) return;
  const Staged s = it->second;
  staged_.erase(it);
  stager_->close(unit);
  if (StreamConnection* conn = conns_.find(s.conn); conn != nullptr && conn->open()) {
    if (error) {
      reply(*conn, s.req, &*error);
    } else if (exposures_.find(s.op) != nullptr) {
      exposures_.landed(s.op, s.addr, s.len);
      reply(*conn, s.req, nullptr);
    } else {
      const Error ended(ErrorCode::Cancelled, "the operation ended while bytes arrived");
      reply(*conn, s.req, &ended);
    }
  }
  // A DONE that waited for this exposure's copies is answered behind the last one.
  // Each parked DONE (ENDED) of this exposure whose earlier copies are all done is served.
  auto [from, to] = parked_done_.equal_range(s.op);
  std::vector<Parked> ready;
  for (auto d = from; d != to;) {
    if (stager_->copying(s.op, d->second.up_to)) {
      ++d;
      continue;
    }
    ready.push_back(std::move(d->second));
    d = parked_done_.erase(d);
  }
  for (Parked& done : ready) {
    StreamConnection* dc = conns_.find(done.conn);
    if (dc == nullptr || !dc->open()) continue;
    if (done.h.type == FrameType::ended)
      serve_ended(*dc, done.h, std::move(done.message), std::move(done.payload));
    else
      serve_done(*dc, done.h, done.message);
  }
}

void TcpListener::drop_staged(std::uint64_t op, StreamConnection* conn,
                              const std::function<void(FrameHeader&, std::string&)>& replace) {
  parked_done_.erase(op);
  for (auto it = staged_.begin(); it != staged_.end();) {
    if (it->second.op != op) {
      ++it;
      continue;
    }
    if (conn != nullptr && conn->id() == it->second.conn) {
      if (!it->second.write) conn->release(kStagedTag | it->first, replace);
      if (auto r = receiving_.find(it->second.conn);
          r != receiving_.end() && r->second == it->first) {
        conn->drop_sink(op);
        receiving_.erase(r);
      }
    }
    it = staged_.erase(it);
  }
  // The frames let go of the chunks: now the copies stop and the chunks go back.
  if (stager_) stager_->drop(op);
}

void TcpListener::drop_staged_conn(std::uint64_t conn) {
  receiving_.erase(conn);
  std::erase_if(waiting_reads_, [conn](const Parked& w) { return w.conn == conn; });
  std::erase_if(parked_done_, [conn](const auto& kv) { return kv.second.conn == conn; });
  for (auto it = staged_.begin(); it != staged_.end();) {
    if (it->second.conn != conn) {
      ++it;
      continue;
    }
    stager_->close(it->first);  // cancels its copy first
    it = staged_.erase(it);
  }
}

void TcpListener::serve_waiting_reads() {
  std::deque<Parked> waiting;
  waiting.swap(waiting_reads_);
  while (!waiting.empty()) {
    const Parked w = waiting.front();
    waiting.pop_front();
    StreamConnection* conn = conns_.find(w.conn);
    if (conn == nullptr || !conn->open()) continue;
    serve_read(*conn, w.h);
    if (!waiting_reads_.empty()) {
      // Out of chunks again: the rest keep waiting, in order.
      waiting_reads_.insert(waiting_reads_.end(), waiting.begin(), waiting.end());
      return;
    }
  }
}

}  // namespace ferry::transport::tcp
