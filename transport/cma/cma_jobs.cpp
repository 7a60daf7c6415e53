// cma's copies: jobs of up to chunk_size bytes on libuv's pool, each under the owner's grant;
// small transfers copy on the loop at once.

#include <cerrno>

#include "transport/cma/cma_copier.hpp"
#include "transport/cuda/stager.hpp"
#include "transport/same_host/system.hpp"

namespace ferry::transport::cma {

Error copy_error(int err, Access access, const std::string& peer_name, std::int64_t pid) {
  const std::string who = "peer '" + peer_name + "' (pid " + std::to_string(pid) + ")";
  const char* call = access == Access::read ? "process_vm_readv" : "process_vm_writev";
  switch (err) {
    case ESRCH: {
      // The process is gone: its operation with it. Retrying the same metadata cannot help.
      Error gone(ErrorCode::PeerLost, who + " exited during the transfer");
      gone.set_retryable(false);
      return gone;
    }
    case EFAULT:
      return Error(ErrorCode::AccessDenied,
                   std::string(call) + " toward " + who + ": " + same_host::errno_text(err) +
                       ": a range of the operation is not mapped (freed while exposed?)");
    case EPERM:
      return Error(ErrorCode::AccessDenied, std::string(call) + " toward " + who +
                                                " refused: " + same_host::errno_text(err));
    default:
      return Error(ErrorCode::Internal,
                   std::string(call) + " toward " + who + ": " + same_host::errno_text(err));
  }
}

namespace {

Error copy_error(int err, const TransferSpec& spec, std::int64_t pid) {
  return cma::copy_error(err, spec.access, spec.peer_name, pid);
}

}  // namespace

std::optional<Error> DirectCmaCopy::copy(Access access,
                                         const std::vector<Segment>& segments) const {
  std::vector<iovec> local;
  std::vector<iovec> remote;
  local.reserve(segments.size());
  remote.reserve(segments.size());
  for (const Segment& s : segments) {
    if (s.len == 0) continue;
    local.push_back({s.local, s.len});
    remote.push_back({reinterpret_cast<void*>(static_cast<std::uintptr_t>(s.remote_addr)), s.len});
  }
  // The grant first, held for the copy: the owner's revoke waits for it, and once it has ended
  // the grant, no copy starts.
  if (!owner_->grants->acquire(grant_))
    return Error(ErrorCode::Cancelled, "peer '" + peer_name_ + "' ended the attachment");
  int err = 0;
  std::uint64_t moved = 0;
  if (same_host::process_exited(owner_->pidfd))
    err = ESRCH;  // its pid may be another process's by now
  else
    err = same_host::copy(owner_->pid, access, local.data(), remote.data(), local.size(), moved);
  owner_->grants->release(grant_);
  if (err != 0) return copy_error(err, access, peer_name_, owner_->pid);
  return std::nullopt;
}

void Job::run() noexcept {
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
  if (!owner->grants->acquire(grant)) {
    refused = true;
  } else {
    if (same_host::process_exited(owner->pidfd))
      err = ESRCH;  // its pid may be another process's by now
    else
      err = same_host::copy(owner->pid, access, local.data(), remote.data(), local.size(), moved);
    owner->grants->release(grant);
  }
  {
    std::lock_guard lock(state->mu);
    --state->copying;
  }
  state->cv.notify_all();
}

CmaCopier::CmaCopier(const Context& ctx, const CmaOptions& options, Owner& owner)
    : ctx_(ctx), options_(options), owner_(owner) {}

CmaCopier::~CmaCopier() { close(); }

void CmaCopier::close() {
  life_.end();
  stager_.reset();
}

void CmaCopier::stop(CmaTransfer& t) {
  // The jobs halt first, so that no job uses a staging chunk when the chunks go back.
  t.copy->halt();
  t.waiting_chunk = false;
  if (stager_) stager_->drop(t.id());
  t.units.clear();
}

void CmaCopier::pump(CmaTransfer& t) {
  if (t.finished() || !t.claimed || t.ended_by_owner) return;
  // CUDA memory on this side: through staging chunks (cma_staging.cpp), never inline.
  if (t.staged) {
    pump_staged(t);
    return;
  }
  if (t.total <= options_.inline_max && t.jobs == 0 && t.seg == 0 && t.seg_off == 0) {
    copy_inline(t);
    return;
  }
  while (!t.finished() && t.jobs < options_.parallel && t.seg < t.spec.segments.size())
    queue_job(t, /*host_only=*/false);
}

std::unique_ptr<Job> CmaCopier::new_job(CmaTransfer& t) {
  auto job = std::make_unique<Job>();
  job->life = life_.watch();
  job->copier = this;
  job->transfer = t.id();
  job->state = t.copy;
  job->owner = t.link->owner();
  job->grant = t.grant;
  job->access = t.spec.access;
  return job;
}

void CmaCopier::queue_job(CmaTransfer& t, bool host_only) {
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
  queue(std::move(job), t);
}

void CmaCopier::queue(std::unique_ptr<Job> job, CmaTransfer& t) {
  job->req.data = job.get();
  ++t.jobs;
  uv_queue_work(
      ctx_.loop, &job->req, [](uv_work_t* req) { static_cast<Job*>(req->data)->run(); },
      &CmaCopier::after_job);
  (void)job.release();  // after_job owns it
}

void CmaCopier::copy_inline(CmaTransfer& t) {
  // Small transfers cost less on the loop than a trip through the pool.
  std::unique_ptr<Job> job = new_job(t);
  for (const Segment& s : t.spec.segments) {
    job->local.push_back({s.local, s.len});
    job->remote.push_back({reinterpret_cast<void*>(s.remote_addr), s.len});
    job->bytes += s.len;
  }
  t.seg = t.spec.segments.size();
  ++t.jobs;
  job->run();
  job_done(*job);
}

void CmaCopier::after_job(uv_work_t* req, int) {
  std::unique_ptr<Job> job(static_cast<Job*>(req->data));
  if (!job->life.alive()) return;  // the copier is closed
  CmaCopier* self = job->copier;
  loop::guarded(self->ctx_.log, "a cma copy", [&] { self->job_done(*job); });
}

void CmaCopier::job_done(Job& job) {
  CmaTransfer* found = owner_.transfer(job.transfer);
  if (found == nullptr) return;
  CmaTransfer& t = *found;
  --t.jobs;
  if (t.finished() || job.skipped) return;
  if (job.unit == 0) t.done += job.moved;  // a staged unit counts once its bytes are in place
  if (job.refused) {
    // The owner ended the operation. Its notice, which says why, is on its way (revoke()
    // sends it): wait for it, or for the connection to fail, no longer than the watchdog.
    // (A transfer whose connection closed was finished then: the link is here.)
    t.link->await_notice(t);
    return;
  }
  if (job.err != 0) {
    // After the claim no other method can take over (the owner serves a claimed operation by
    // its claim's method alone): the transfer fails as itself, and the owner hears why. A
    // refusal (EPERM, which the probe on the loop thread did not meet: a seccomp filter on
    // the pool's threads, say) is kept on the link, so that the next transfer toward this
    // owner fails at set-up and falls back.
    const Error error = copy_error(job.err, t.spec, job.owner->pid);
    if (job.err == EPERM) t.link->refused = error;
    owner_.failed(t, error);
    return;
  }
  if (job.unit != 0) {
    unit_moved(t, job.unit);
    return;
  }
  if (t.done == t.total && t.jobs == 0) {
    owner_.copied(t);
    return;
  }
  pump(t);
}

}  // namespace ferry::transport::cma
