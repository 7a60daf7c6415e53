#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>

#include "loop/ids.hpp"
#include "transport/cma/cma_internal.hpp"
#include "transport/exposure_table.hpp"

namespace ferry::transport::cma {

namespace {

constexpr std::size_t kIovMax = IOV_MAX;

Error copy_error(int err, const TransferSpec& spec, std::int64_t pid) {
  const std::string who = "peer '" + spec.peer_name + "' (pid " + std::to_string(pid) + ")";
  const char* call = spec.access == Access::read ? "process_vm_readv" : "process_vm_writev";
  switch (err) {
    case ESRCH:
      return Error(ErrorCode::PeerLost, who + " exited during the transfer");
    case EFAULT:
      return Error(ErrorCode::AccessDenied,
                   std::string(call) + " toward " + who + ": " + errno_text(err) +
                       ": a range of the operation is not mapped (freed while exposed?)");
    case EPERM:
      return Error(ErrorCode::AccessDenied,
                   std::string(call) + " toward " + who + " refused: " + errno_text(err));
    default:
      return Error(ErrorCode::Internal,
                   std::string(call) + " toward " + who + ": " + errno_text(err));
  }
}

}  // namespace

void CmaTransport::Job::run() noexcept {
  {
    std::lock_guard lock(state->mu);
    if (state->stop) {
      skipped = true;
      return;
    }
    ++state->copying;
  }
  // The owner's grant first: while we hold it, the owner's cancel() waits for this copy; once
  // it has ended the grant, no copy starts.
  if (!link->grants->acquire(grant)) {
    refused = true;
  } else {
    if (process_exited(link->pidfd))
      err = ESRCH;  // its pid may be another process's by now
    else
      err = copy(link->pid, access, local.data(), remote.data(), local.size(), moved);
    link->grants->release(grant);
  }
  {
    std::lock_guard lock(state->mu);
    --state->copying;
  }
  state->cv.notify_all();
}

namespace {

// The owner's info of a cma endpoint in `out`, or why start() refuses the endpoint.
std::optional<Error> parse_endpoint(const Endpoint& endpoint, OwnerInfo& out) {
  sockaddr_un addr{};
  socklen_t len = 0;
  if (!socket_address(endpoint.address, addr, len))
    return Error(ErrorCode::InvalidMetadata,
                 "cma endpoint '" + endpoint.address + "' is not an abstract socket name",
                 "endpoints");
  try {
    out = parse_info(endpoint.info);
  } catch (const Error& e) {
    return e;
  }
  return std::nullopt;
}

}  // namespace

std::optional<Error> CmaTransport::endpoint_error(const Endpoint& endpoint) const {
  OwnerInfo info;
  return parse_endpoint(endpoint, info);
}

std::unique_ptr<Transfer> CmaTransport::start(TransferSpec spec, TransferObserver& observer) {
  if (closed_) throw Error(ErrorCode::InvalidState, "the transport is closed");
  OwnerInfo info;
  if (auto e = parse_endpoint(spec.endpoint, info)) throw *e;
  const bool staged = !ipc() && std::any_of(spec.segments.begin(), spec.segments.end(),
                                            [](const Segment& s) { return s.cuda_device >= 0; });
  if (staged && !caps_.moves(MemoryKind::cuda))
    throw Error(ErrorCode::Unsupported, "cma moves host memory only here (no CUDA driver)");
  auto t = std::make_unique<CmaTransfer>(*this, next_transfer_++, std::move(spec), observer);
  t->staged = staged;
  transfers_[t->id] = t.get();
  std::string error;
  bool setup_refused = false;
  t->link = link_to(t->spec, info, error, setup_refused);
  if (!t->link) {
    finish_transfer(*t, Error(setup_refused ? ErrorCode::Unsupported : ErrorCode::PeerLost, error),
                    /*setup=*/true);
    return t;
  }
  if (!uv_is_active(reinterpret_cast<uv_handle_t*>(keepalive_.get()))) {
    const auto period =
        static_cast<std::uint64_t>(std::max<long long>(1, options_.peer_timeout.count() / 3));
    uv_timer_start(
        keepalive_.get(),
        [](uv_timer_t* timer) {
          if (timer->data != nullptr) static_cast<CmaTransport*>(timer->data)->keepalive();
        },
        period, period);
  }
  send_claim(*t);
  return t;
}

std::shared_ptr<PeerLink> CmaTransport::link_to(const TransferSpec& spec, const OwnerInfo& info,
                                                std::string& error, bool& refused) {
  if (auto it = links_.find(spec.endpoint.address);
      it != links_.end() && it->second->conn != nullptr && it->second->conn->usable()) {
    if (it->second->refused.empty()) return it->second;
    refused = true;
    error = "cma: " + it->second->refused;
    return nullptr;
  }
  const std::string who =
      "peer '" + spec.peer_name + "' (pid " + std::to_string(info.scope.pid) + ")";
  refused = true;
  if (const std::string why = scope_mismatch(info.scope); !why.empty()) {
    error = "cma: " + who + ": " + why;
    return nullptr;
  }
  auto link = std::make_shared<PeerLink>();
  link->address = spec.endpoint.address;
  link->pid = info.scope.pid;
  // Pin the process first, then prove it is the owner: the 16 bytes at `probe` must be the
  // nonce. This also asks the kernel whether we may copy at all (ptrace rules).
  link->pidfd = open_pidfd(info.scope.pid);
  if (link->pidfd < 0 && errno != ENOSYS) {
    // In our own PID namespace: the owner is gone, which another method cannot fix either.
    refused = errno != ESRCH;
    error = "cma: no process " + std::to_string(info.scope.pid) + " for " + who + ": " +
            errno_text(errno);
    return nullptr;
  }
  Token seen{};
  iovec local{seen.data(), seen.size()};
  iovec remote{reinterpret_cast<void*>(info.probe), seen.size()};
  if (::process_vm_readv(static_cast<pid_t>(info.scope.pid), &local, 1, &remote, 1, 0) !=
      static_cast<ssize_t>(seen.size())) {
    const int err = errno;
    refused = err != ESRCH;
    error = "cma: process_vm_readv toward " + who + " refused: " + errno_text(err);
    if (err == EPERM)
      error +=
          " (ptrace rules: Yama's ptrace_scope, or the owner's credentials or user "
          "namespace differ from ours)";
    return nullptr;
  }
  if (!tokens_equal(seen, info.nonce)) {
    error = "cma: process " + std::to_string(info.scope.pid) + " is not " + who +
            " (the pid means another process here)";
    return nullptr;
  }
  const int fd = fetch_fd(link->pidfd, info.scope.pid, info.grants_fd);
  if (fd < 0) {
    error = "cma: cannot take the grant table of " + who + ": " + errno_text(errno);
    return nullptr;
  }
  try {
    link->grants = std::make_unique<GrantView>(fd, info.grants_bytes);
  } catch (const Error& e) {
    error = e.message();
    return nullptr;
  }
  refused = false;
  sockaddr_un addr{};
  socklen_t len = 0;
  socket_address(spec.endpoint.address, addr, len);
  const int sock = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (sock < 0) {
    error = "cma socket: " + errno_text(errno);
    return nullptr;
  }
  // A Unix socket connects at once, or not at all (EAGAIN: the owner's backlog is full).
  if (::connect(sock, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
    error = "cannot connect to " + who + " at " + spec.endpoint.address + ": " + errno_text(errno);
    ::close(sock);
    return nullptr;
  }
  const std::uint64_t id = next_conn_++;
  auto conn =
      std::make_unique<tcp::Connection>(loop_, handler(), tcp::Connection::Role::client, sock, id,
                                        spec.endpoint.address, options_.peer_timeout, false,
                                        options_.log);
  conn->set_peer_name(spec.peer_name);
  link->conn = conn.get();
  conns_[id] = std::move(conn);
  links_[link->address] = link;
  tcp::FrameHeader hello;
  hello.type = tcp::FrameType::hello;
  hello.op_id = options_.local_id;
  link->conn->send(hello, options_.local_name.substr(0, 256));
  if (link->conn == nullptr || !link->conn->open()) {
    error = "connection to " + who + " closed at once";
    return nullptr;
  }
  return link;
}

void CmaTransport::send_claim(CmaTransfer& t) {
  // The ranges of the owner's memory this transfer touches: the owner checks each before it
  // grants anything.
  t.claim_payload = claim_payload(t.spec.segments);
  tcp::FrameHeader h;
  h.type = tcp::FrameType::claim;
  h.req_id = t.claim_req = next_req_++;
  h.op_id = t.spec.remote_id;
  h.token = t.spec.token;
  h.flags = static_cast<std::uint16_t>(t.spec.access);
  h.len = t.claim_payload.size();
  add_pending(h.req_id, Pending{t.id, false, t.link->conn->id()});
  t.link->conn->send(h, {}, t.claim_payload.data(), t.id);
}

void CmaTransport::pump(CmaTransfer& t) {
  if (t.finished || !t.claimed || t.ended_by_owner) return;
#ifdef FERRY_WITH_CUDA
  if (ipc()) {
    pump_ipc(t);
    return;
  }
  // CUDA memory on this side: through staging chunks (cma_staging.cpp), never inline.
  if (t.staged) {
    pump_staged(t);
    return;
  }
#endif
  if (t.total <= options_.inline_max && t.jobs == 0 && t.seg == 0 && t.seg_off == 0) {
    copy_inline(t);
    return;
  }
  while (!t.finished && t.jobs < options_.parallel && t.seg < t.spec.segments.size())
    queue_job(t, /*host_only=*/false);
}

std::unique_ptr<CmaTransport::Job> CmaTransport::new_job(CmaTransfer& t) {
  auto job = std::make_unique<Job>();
  job->life = life_;
  job->transport = this;
  job->transfer = t.id;
  job->state = t.copy;
  job->link = t.link;
  job->grant = t.grant;
  job->access = t.spec.access;
  return job;
}

void CmaTransport::queue_job(CmaTransfer& t, bool host_only) {
  std::unique_ptr<Job> job = new_job(t);
  const std::vector<Segment>& segs = t.spec.segments;
  while (job->bytes < options_.chunk_size && job->local.size() < kIovMax && t.seg < segs.size() &&
         (!host_only || segs[t.seg].cuda_device < 0)) {
    const Segment& s = segs[t.seg];
    const std::uint64_t len =
        std::min<std::uint64_t>(options_.chunk_size - job->bytes, s.len - t.seg_off);
    job->local.push_back({s.local + t.seg_off, len});
    job->remote.push_back({reinterpret_cast<void*>(s.remote_addr + t.seg_off), len});
    job->bytes += len;
    t.seg_off += len;
    if (t.seg_off == s.len) {
      ++t.seg;
      t.seg_off = 0;
    }
  }
  job->req.data = job.get();
  ++t.jobs;
  uv_queue_work(loop_, &job->req, &CmaTransport::run_job, &CmaTransport::after_job);
  job.release();  // after_job owns it
}

void CmaTransport::copy_inline(CmaTransfer& t) {
  // Small transfers cost less on the loop than a trip through the pool.
  Job job;
  job.transfer = t.id;
  job.state = t.copy;
  job.link = t.link;
  job.grant = t.grant;
  job.access = t.spec.access;
  for (const Segment& s : t.spec.segments) {
    job.local.push_back({s.local, s.len});
    job.remote.push_back({reinterpret_cast<void*>(s.remote_addr), s.len});
    job.bytes += s.len;
  }
  t.seg = t.spec.segments.size();
  ++t.jobs;
  job.run();
  job_done(job);
}

void CmaTransport::run_job(uv_work_t* req) { static_cast<Job*>(req->data)->run(); }

void CmaTransport::after_job(uv_work_t* req, int) {
  std::unique_ptr<Job> job(static_cast<Job*>(req->data));
  if (job->life.expired()) return;  // the transport is closed
  CmaTransport* self = job->transport;
  loop::guarded(self->options_.log, "cma copy", [&] { self->job_done(*job); });
}

void CmaTransport::job_done(Job& job) {
  auto it = transfers_.find(job.transfer);
  if (it == transfers_.end()) return;
  CmaTransfer& t = *it->second;
  --t.jobs;
  if (t.finished || job.skipped) return;
  if (job.unit == 0) t.done += job.moved;  // a staged unit counts once its bytes are in place
  if (job.refused) {
    // The owner ended the operation. Its notice, which says why, is on its way (revoke()
    // sends it): wait for it, or for the connection to fail, no longer than the watchdog.
    // (A transfer whose connection closed was finished then: the connection is here.)
    if (!t.ended_by_owner) {
      t.ended_by_owner = true;
      t.link->conn->expect_answers(+1);
    }
    return;
  }
  if (job.err != 0) {
    // After the claim no other method can take over (the owner serves a claimed operation by
    // its claim's method alone): the transfer fails as itself, and the owner hears why. A
    // refusal (EPERM, which the probe on the loop thread did not meet: a seccomp filter on
    // the pool's threads, say) is kept on the link, so that the next transfer toward this
    // owner fails at set-up and falls back.
    const Error error = copy_error(job.err, t.spec, t.link->pid);
    if (job.err == EPERM) t.link->refused = error.message();
    finish_transfer(t, error);
    send_done(t, &error);
    return;
  }
#ifdef FERRY_WITH_CUDA
  if (job.unit != 0) {
    staged_job_done(t, job.unit);
    return;
  }
#endif
  if (t.done == t.total && t.jobs == 0) {
    all_copied(t);
    return;
  }
  pump(t);
}

void CmaTransport::all_copied(CmaTransfer& t) {
  if (t.spec.access == Access::read) {
    // Every byte is here: complete, and the owner learns it may let go.
    send_done(t, nullptr);
    finish_transfer(t, std::nullopt);
    return;
  }
  // A write completes when the owner has acknowledged DONE: both sides then agree.
  send_done(t, nullptr);
}

void CmaTransport::send_done(CmaTransfer& t, const Error* error) {
  if (t.done_sent || t.link == nullptr || t.link->conn == nullptr || !t.link->conn->open()) return;
  t.done_sent = true;
  tcp::FrameHeader h;
  h.type = tcp::FrameType::done;
  h.req_id = next_req_++;
  h.op_id = t.spec.remote_id;
  h.token = t.spec.token;
  h.flags = static_cast<std::uint16_t>(t.spec.access);
  std::string message;
  if (error != nullptr) {
    h.status = static_cast<std::uint32_t>(error->code());
    message = error->message().substr(0, tcp::kMaxMessage);
  }
  const bool awaited = error == nullptr && t.spec.access == Access::write;
  if (awaited) {
    t.done_req = h.req_id;
    add_pending(h.req_id, Pending{t.id, true, t.link->conn->id()});
  }
  t.link->conn->send(h, message);
}

tcp::Connection::Sink CmaTransport::client_frame(tcp::Connection& conn, const tcp::FrameHeader& h,
                                                 std::string message) {
  if (!conn.greeted()) {
    if (h.type != tcp::FrameType::hello) return fatal("expected HELLO as the first frame");
    conn.set_greeted();
    return {};
  }
  auto transfer_of = [&](std::uint64_t req) -> CmaTransfer* {
    auto it = pending_.find(req);
    if (it == pending_.end() || it->second.conn != conn.id()) return nullptr;
    const std::uint64_t id = it->second.transfer;
    erase_pending(req);
    auto t = transfers_.find(id);
    return t == transfers_.end() || t->second->finished ? nullptr : t->second;
  };
  switch (h.type) {
    case tcp::FrameType::handles: {
      // cuda_ipc: the owner's handles, ahead of CLAIMED for the same request.
      if (!ipc()) return fatal("HANDLES from a cma server");
      if (h.len > kMaxHandleBytes) return fatal("HANDLES of " + std::to_string(h.len) + " bytes");
      auto it = pending_.find(h.req_id);
      if (it == pending_.end() || it->second.conn != conn.id()) return {};  // dropped
      auto t = transfers_.find(it->second.transfer);
      if (t == transfers_.end() || t->second->finished) return {};
      t->second->handles.assign(h.len, std::byte{0});
      t->second->handles_whole = false;
      tcp::Connection::Sink sink;
      sink.dest = t->second->handles.data();
      sink.tag = t->second->id;
      return sink;
    }
    case tcp::FrameType::claimed: {
      CmaTransfer* t = transfer_of(h.req_id);
      if (t == nullptr) return {};
      Grant grant{static_cast<std::uint32_t>(h.addr), static_cast<std::uint32_t>(h.len)};
      if (h.addr > UINT32_MAX || h.len > UINT32_MAX || !t->link->grants->holds(grant))
        return fatal("CLAIMED names a grant outside the owner's table");
      t->grant = grant;
      t->secret = h.token;
      t->claimed = true;
#ifdef FERRY_WITH_CUDA
      if (ipc()) {
        ipc_claimed(*t);
        return {};
      }
#endif
      if (t->total == 0)
        all_copied(*t);
      else
        pump(*t);
      return {};
    }
    case tcp::FrameType::status: {
      if (h.req_id == 0 && h.op_id != 0) {
        // The owner ended operation op_id (cancelled, deadline, closed) and says why.
        const ErrorCode code = code_from_wire(h.status);
        Error ended(code, "peer " + conn.describe_peer() + " ended the operation: " +
                              (message.empty() ? std::string(to_string(code)) : message));
        for (auto& [id, t] : transfers_)
          if (t->link && t->link->conn == &conn && !t->finished && t->spec.remote_id == h.op_id) {
            finish_transfer(*t, ended);
            break;
          }
        return {};
      }
      if (h.req_id == 0) {
        conn.set_notice(h.status, message);
        return {};
      }
      CmaTransfer* t = transfer_of(h.req_id);
      if (t == nullptr) return {};
      if (h.status == 0) {
        if (h.req_id == t->done_req) finish_transfer(*t, std::nullopt);
        return {};
      }
      const ErrorCode code = code_from_wire(h.status);
      finish_transfer(*t,
                      Error(code, "peer " + conn.describe_peer() + " refused: " +
                                      (message.empty() ? std::string(to_string(code)) : message)));
      return {};
    }
    default:
      return fatal("unexpected frame type " + std::to_string(static_cast<int>(h.type)) +
                   " from a cma server");
  }
}

void CmaTransport::keepalive() {
  if (transfers_.empty()) {
    uv_timer_stop(keepalive_.get());
    return;
  }
  std::vector<tcp::Connection*> told;
  for (auto& [id, t] : transfers_) {
    if (t->finished || !t->link || t->link->conn == nullptr || !t->link->conn->open()) continue;
    if (std::find(told.begin(), told.end(), t->link->conn) != told.end()) continue;
    told.push_back(t->link->conn);
    tcp::FrameHeader h;
    h.type = tcp::FrameType::status;
    t->link->conn->send(h);
  }
}

void CmaTransport::finish_transfer(CmaTransfer& t, std::optional<Error> error, bool setup) {
  if (t.finished) return;
  t.finished = true;
  // No copy of this transfer runs after this: the local memory is the caller's again.
  t.copy->halt();
#ifdef FERRY_WITH_CUDA
  if (ipc()) cancel_copies(t);
  if (t.staged) drop_staged(t);  // after the halt: no job uses a chunk any more
#endif
  if (t.ended_by_owner && t.link && t.link->conn != nullptr) t.link->conn->expect_answers(-1);
  erase_pending(t.claim_req);
  erase_pending(t.done_req);
  if (t.link && t.link->conn != nullptr) {
    t.link->conn->release(t.id);
    t.link->conn->drop_sink(t.id);  // HANDLES being received into the transfer
  }
  report_later(defer_, life_, transfers_, t.id, std::move(error), setup);
}

void CmaTransport::cancel_transfer(CmaTransfer& t, const Error& reason) {
  if (!t.finished) {
    finish_transfer(t, reason);
    // Also while the claim is unanswered: the owner reads DONE after the CLAIM (or alone, if
    // the CLAIM never left), and ends the operation instead of waiting for this peer.
    send_done(t, &reason);
  }
  forget_transfer(t);
}

void CmaTransport::forget_transfer(CmaTransfer& t) {
  if (!t.finished) {
    cancel_transfer(t, Error(ErrorCode::Cancelled, "the operation was destroyed"));
    return;
  }
  transfers_.erase(t.id);
  t.owner = nullptr;
}

}  // namespace ferry::transport::cma
