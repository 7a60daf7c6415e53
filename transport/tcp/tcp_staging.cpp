// CUDA memory over tcp: the method moves host memory only, so CUDA memory is staged through
// pinned host chunks of chunk_size bytes (cuda::StagingPool), copied to and from the device
// on the device's stream (cuda::CopyEngine) while other chunks cross the network.
//
// Client, write: per chunk, a device-to-host copy into a staging chunk, then the WRITE from
// the chunk; the chunk goes back when the request is answered. DONE leaves once every WRITE is
// queued. Client, read: the READ's DATA lands in a staging chunk, then a host-to-device copy;
// the chunk counts as done (and goes back) when that copy ends.
//
// Server, read: a device-to-host copy into a chunk, then DATA from the chunk (tagged
// kStagedTag | serial), which goes back when the frame has left. Server, write: the payload
// lands in a chunk (or a heap buffer when none is free: the sink is needed at once), then a
// host-to-device copy; the request is answered when the copy ends, and a DONE waits for every
// copy of its exposure.
//
// Ending a transfer or an exposure cancels its copies first (CopyEngine::cancel waits for one
// in flight), then drops its frames from the connection, then gives its chunks back.

#include <algorithm>

#include "loop/uv_handle.hpp"
#include "transport/tcp/tcp_internal.hpp"

namespace ferry::transport::tcp {

std::byte* TcpTransport::acquire_chunk(int ordinal, bool server) {
  if (!client_staging_) {
    if (cuda_ == nullptr) throw Error(ErrorCode::Unsupported, "tcp has no CUDA driver");
    CUdevice dev = 0;
    CUcontext ctx = nullptr;
    CUresult r = cuda_->device_get(&dev, ordinal);
    if (r == CUDA_SUCCESS) r = cuda_->device_primary_ctx_retain(&ctx, dev);
    if (r != CUDA_SUCCESS)
      throw Error(ErrorCode::Internal,
                  "tcp cannot stage CUDA memory of cuda:" + std::to_string(ordinal) + ": " +
                      cuda::result_text(cuda_, r));
    try {
      if (!copies_) copies_ = std::make_unique<cuda::CopyEngine>(loop_, *cuda_);
      const std::uint64_t chunks = std::clamp<std::uint64_t>(
          options_.window / options_.chunk_size + 4, 4, std::uint64_t{64});
      client_staging_ = std::make_unique<cuda::StagingPool>(
          *cuda_, static_cast<std::size_t>(options_.chunk_size), static_cast<std::size_t>(chunks));
      server_staging_ = std::make_unique<cuda::StagingPool>(
          *cuda_, static_cast<std::size_t>(options_.chunk_size), static_cast<std::size_t>(chunks));
    } catch (...) {
      client_staging_.reset();
      server_staging_.reset();
      (void)cuda_->device_primary_ctx_release(dev);
      throw;
    }
    staging_ctx_ = ctx;
    staging_device_ = ordinal;
    client_staging_->set_on_release([this] { chunk_freed(); });
    server_staging_->set_on_release([this] { chunk_freed(); });
  }
  // Pinned chunks are portable: one context serves every device.
  return (server ? server_staging_ : client_staging_)->acquire(staging_ctx_);
}

void TcpTransport::chunk_freed() {
  if (repump_scheduled_ || (waiting_reads_.empty() && transfers_.empty())) return;
  repump_scheduled_ = true;
  defer_([this, life = std::weak_ptr<int>(life_)] {
    if (life.expired()) return;
    repump_scheduled_ = false;
    serve_waiting_reads();
    std::vector<std::uint64_t> waiting;
    for (auto& [id, t] : transfers_)
      if (t->waiting_chunk && !t->finished) waiting.push_back(id);
    for (std::uint64_t id : waiting) {
      auto it = transfers_.find(id);
      if (it == transfers_.end()) continue;
      TcpTransfer& t = *it->second;
      if (t.finished || !t.waiting_chunk || t.conn == nullptr) continue;
      t.waiting_chunk = false;
      pump(t);
    }
  });
}

int TcpTransport::region_device(const Exposures::Entry& entry, const std::byte* ptr) const {
  for (const Region& r : entry.exposure.regions)
    if (r.kind == MemoryKind::cuda && ptr >= r.ptr && ptr < r.ptr + r.size) return r.cuda_device;
  return -1;
}

// ---------------------------------------------------------------------------------------
// Client

void TcpTransport::staging_failed(TcpTransfer& t, const Error& error) {
  if (t.finished) return;
  finish_transfer(t, error);
  if (t.conn != nullptr && t.conn->open()) send_done(*t.conn, t, &error);
}

void TcpTransport::release_chunk(TcpTransfer& t, std::uint64_t req) {
  auto it = t.staged.find(req);
  if (it == t.staged.end()) return;
  std::byte* chunk = it->second.chunk;
  t.staged.erase(it);
  client_staging_->release(chunk);
}

void TcpTransport::stage_write(TcpTransfer& t, std::uint64_t req, const FrameHeader& h,
                               const std::byte* src, int ordinal) {
  TcpTransfer::Staged& s = t.staged[req];
  ++t.copying;
  try {
    s.copy = copies_->copy(ordinal, s.chunk, src, static_cast<std::size_t>(h.len),
                           [this, transfer = t.id, req, h](const std::optional<Error>& error) {
                             staged_write_ready(transfer, req, h, error);
                           });
  } catch (const Error& e) {
    staging_failed(t, e);
  }
}

void TcpTransport::staged_write_ready(std::uint64_t transfer, std::uint64_t req,
                                      const FrameHeader& h, const std::optional<Error>& error) {
  auto it = transfers_.find(transfer);
  if (it == transfers_.end() || it->second->finished) return;
  TcpTransfer& t = *it->second;
  auto s = t.staged.find(req);
  if (s == t.staged.end()) return;
  s->second.copy = 0;
  --t.copying;
  if (error) {
    staging_failed(t, *error);
    return;
  }
  t.conn->send(h, {}, s->second.chunk, t.id);
  // More chunks, or the DONE behind the last one.
  pump(t);
}

void TcpTransport::stage_read_landed(TcpTransfer& t, std::uint64_t req, const Pending& p) {
  auto s = t.staged.find(req);
  if (s == t.staged.end()) return;
  try {
    s->second.copy =
        copies_->copy(p.cuda_device, p.local, p.staging, static_cast<std::size_t>(p.len),
                      [this, transfer = t.id, req, len = p.len](const std::optional<Error>& error) {
                        staged_read_done(transfer, req, len, error);
                      });
  } catch (const Error& e) {
    staging_failed(t, e);
  }
}

void TcpTransport::staged_read_done(std::uint64_t transfer, std::uint64_t req, std::uint64_t len,
                                    const std::optional<Error>& error) {
  auto it = transfers_.find(transfer);
  if (it == transfers_.end() || it->second->finished) return;
  TcpTransfer& t = *it->second;
  if (error) {
    staging_failed(t, *error);
    return;
  }
  chunk_done(t, req, len);  // gives the chunk back first
}

// ---------------------------------------------------------------------------------------
// Server

void TcpTransport::serve_read_staged(Connection& conn, const FrameHeader& h, const std::byte* src,
                                     int ordinal) {
  std::byte* chunk = nullptr;
  try {
    chunk = acquire_chunk(ordinal, /*server=*/true);
  } catch (const Error& e) {
    reply_status(conn, h.req_id, ErrorCode::Internal, e.message());
    return;
  }
  if (chunk == nullptr) {
    // Served when a chunk comes back; the client's window bounds how many wait.
    waiting_reads_.push_back(WaitingRead{conn.id(), h});
    return;
  }
  const std::uint64_t tag = kStagedTag | next_staged_++;
  ServerStaged& s = server_staged_[tag];
  s.op = h.op_id;
  s.conn = conn.id();
  s.req = h.req_id;
  s.chunk = chunk;
  s.len = h.len;
  s.ordinal = ordinal;
  try {
    s.copy = copies_->copy(
        ordinal, chunk, src, static_cast<std::size_t>(h.len),
        [this, tag](const std::optional<Error>& error) { served_read_copied(tag, error); });
  } catch (const Error& e) {
    server_staged_.erase(tag);
    server_staging_->release(chunk);
    reply_status(conn, h.req_id, ErrorCode::Internal, e.message());
    return;
  }
  // The memory is being read until the DATA has left (or the claim ends).
  exposures_.sending(h.op_id);
}

void TcpTransport::served_read_copied(std::uint64_t tag, const std::optional<Error>& error) {
  auto it = server_staged_.find(tag);
  if (it == server_staged_.end()) return;
  ServerStaged& s = it->second;
  s.copy = 0;
  Connection* conn = find_conn(s.conn);
  if (conn == nullptr || !conn->open() || error) {
    const std::uint64_t op = s.op;
    const std::uint64_t req = s.req;
    server_staging_->release(s.chunk);
    server_staged_.erase(it);
    if (conn != nullptr && conn->open())
      reply_status(*conn, req, ErrorCode::Internal, error->message());
    if (exposures_.sent(op)) finish_exposure(op, std::nullopt);
    return;
  }
  FrameHeader d;
  d.type = FrameType::data;
  d.req_id = s.req;
  d.len = s.len;
  conn->send(d, {}, s.chunk, tag);  // on_sent(tag) gives the chunk back
}

Connection::Sink TcpTransport::serve_write_staged(Connection& conn, const FrameHeader& h,
                                                  std::byte* dst, int ordinal) {
  const std::uint64_t tag = kStagedTag | next_staged_++;
  ServerStaged s;
  s.op = h.op_id;
  s.conn = conn.id();
  s.req = h.req_id;
  s.write = true;
  s.device = dst;
  s.addr = h.addr;
  s.len = h.len;
  s.ordinal = ordinal;
  if (h.len <= options_.chunk_size) {
    try {
      s.chunk = acquire_chunk(ordinal, /*server=*/true);
    } catch (const Error&) {
      // The heap buffer below still works; the copy tells if the driver is unusable.
    }
  }
  if (s.chunk == nullptr) {
    // The sink is needed now: unpinned memory, slower to copy but as correct.
    s.heap = std::make_unique_for_overwrite<std::byte[]>(static_cast<std::size_t>(h.len));
    s.chunk = s.heap.get();
  }
  Connection::Sink sink;
  sink.dest = s.chunk;
  sink.tag = h.op_id;  // end_claim drops the sink by operation
  server_staged_.emplace(tag, std::move(s));
  receiving_[conn.id()] = tag;
  return sink;
}

namespace {

void give_back(cuda::StagingPool* pool, std::unique_ptr<std::byte[]>& heap, std::byte* chunk) {
  if (heap)
    heap.reset();
  else if (pool != nullptr && chunk != nullptr)
    pool->release(chunk);
}

}  // namespace

bool TcpTransport::staged_payload(Connection& conn, const FrameHeader& h, bool intact) {
  auto r = receiving_.find(conn.id());
  if (r == receiving_.end()) return false;
  const std::uint64_t tag = r->second;
  receiving_.erase(r);
  auto it = server_staged_.find(tag);
  if (it == server_staged_.end()) return false;  // dropped with its claim: refused as usual
  ServerStaged& s = it->second;
  if (!intact || s.req != h.req_id || exposures_.find(h.op_id) == nullptr) {
    give_back(server_staging_.get(), s.heap, s.chunk);
    server_staged_.erase(it);
    return false;
  }
  try {
    s.copy = copies_->copy(
        s.ordinal, s.device, s.chunk, static_cast<std::size_t>(s.len),
        [this, tag](const std::optional<Error>& error) { served_write_copied(tag, error); });
  } catch (const Error& e) {
    give_back(server_staging_.get(), s.heap, s.chunk);
    server_staged_.erase(it);
    reply_status(conn, h.req_id, ErrorCode::Internal, e.message());
  }
  return true;
}

void TcpTransport::served_write_copied(std::uint64_t tag, const std::optional<Error>& error) {
  auto it = server_staged_.find(tag);
  if (it == server_staged_.end()) return;
  ServerStaged s = std::move(it->second);
  server_staged_.erase(it);
  give_back(server_staging_.get(), s.heap, s.chunk);
  Connection* conn = find_conn(s.conn);
  if (conn != nullptr && conn->open()) {
    if (error) {
      reply_status(*conn, s.req, ErrorCode::Internal, error->message());
    } else if (exposures_.find(s.op) != nullptr) {
      exposures_.landed(s.op, s.addr, s.len);
      reply_ok(*conn, s.req);
    } else {
      reply_status(*conn, s.req, ErrorCode::Cancelled, "the operation ended while bytes arrived");
    }
  }
  // A DONE that waited for this exposure's copies is answered behind the last one.
  auto d = parked_done_.find(s.op);
  if (d == parked_done_.end() || writes_copying(s.op)) return;
  ParkedDone done = std::move(d->second);
  parked_done_.erase(d);
  if (Connection* dc = find_conn(done.conn); dc != nullptr && dc->open())
    serve_done(*dc, done.h, done.message);
}

bool TcpTransport::writes_copying(std::uint64_t op) const {
  return std::any_of(server_staged_.begin(), server_staged_.end(),
                     [op](const auto& kv) { return kv.second.write && kv.second.op == op; });
}

void TcpTransport::drop_staged(std::uint64_t op, Connection* conn,
                               const std::function<void(FrameHeader&, std::string&)>& replace) {
  parked_done_.erase(op);
  std::vector<std::uint64_t> tags;
  for (auto& [tag, s] : server_staged_) {
    if (s.op != op) continue;
    tags.push_back(tag);
    if (s.copy != 0) copies_->cancel(s.copy);  // waits for one in flight
  }
  for (std::uint64_t tag : tags) {
    auto it = server_staged_.find(tag);
    ServerStaged& s = it->second;
    if (conn != nullptr && conn->id() == s.conn) {
      if (!s.write) conn->release(tag, replace);
      if (auto r = receiving_.find(s.conn); r != receiving_.end() && r->second == tag) {
        conn->drop_sink(op);
        receiving_.erase(r);
      }
    }
    ServerStaged gone = std::move(s);
    server_staged_.erase(it);
    give_back(server_staging_.get(), gone.heap, gone.chunk);
  }
}

void TcpTransport::drop_staged_conn(std::uint64_t conn) {
  receiving_.erase(conn);
  std::erase_if(waiting_reads_, [conn](const WaitingRead& w) { return w.conn == conn; });
  std::erase_if(parked_done_, [conn](const auto& kv) { return kv.second.conn == conn; });
  std::vector<std::uint64_t> tags;
  for (auto& [tag, s] : server_staged_) {
    if (s.conn != conn) continue;
    tags.push_back(tag);
    if (s.copy != 0) copies_->cancel(s.copy);
  }
  for (std::uint64_t tag : tags) {
    auto it = server_staged_.find(tag);
    ServerStaged gone = std::move(it->second);
    server_staged_.erase(it);
    give_back(server_staging_.get(), gone.heap, gone.chunk);
  }
}

void TcpTransport::serve_waiting_reads() {
  std::deque<WaitingRead> waiting;
  waiting.swap(waiting_reads_);
  while (!waiting.empty()) {
    WaitingRead w = waiting.front();
    waiting.pop_front();
    Connection* conn = find_conn(w.conn);
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
