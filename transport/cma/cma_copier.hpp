#pragma once

#include <uv.h>

#include <climits>
#include <cstdint>
#include <memory>
#include <optional>

#include <ferry/error.hpp>
#include <ferry/options.hpp>

#include "transport/cma/cma_transfer.hpp"
#include "transport/context.hpp"
#include "transport/kit/lifetime.hpp"
#include "transport/region.hpp"
#include "transport/same_host/link.hpp"

namespace ferry::transport::cuda {
class Stager;
}

namespace ferry::transport::cma {

/// The most pieces one process_vm_readv/writev call takes (a job's list, a staged unit's).
inline constexpr std::size_t kIovMax = IOV_MAX;

/// What a failed process_vm_readv/writev (errno `err`) toward `peer_name` (pid `pid`) means.
Error copy_error(int err, Access access, const std::string& peer_name, std::int64_t pid);

/// A small transfer on an attachment, copied on the calling thread under the attachment's grant
/// (docs/regions.md): one process_vm_readv/writev, no thread hop. Any thread.
class DirectCmaCopy final : public DirectCopy {
 public:
  DirectCmaCopy(std::shared_ptr<same_host::OwnerProcess> owner, same_host::Grant grant,
                std::string peer_name)
      : owner_(std::move(owner)), grant_(grant), peer_name_(std::move(peer_name)) {}
  std::optional<Error> copy(Access access, const std::vector<Segment>& segments) const override;
  std::size_t max_segments() const override { return kIovMax; }

 private:
  std::shared_ptr<same_host::OwnerProcess> owner_;
  same_host::Grant grant_;
  std::string peer_name_;
};

/// The copies of cma's active transfers, once the owner has granted them: jobs of up to
/// chunk_size bytes on libuv's pool, `parallel` per transfer, each under the owner's grant
/// (cma_jobs.cpp); small transfers on the loop at once; CUDA memory of this side through
/// pinned host chunks (cma_staging.cpp). It tells its owner (the transport) when a transfer's
/// bytes are all in place, or why they cannot be. Loop thread only.
class CmaCopier {
 public:
  class Owner {
   public:
    /// The live transfer `id`, or null.
    virtual CmaTransfer* transfer(std::uint64_t id) = 0;
    /// Every byte of `t` is in place.
    virtual void copied(CmaTransfer& t) = 0;
    /// `t` cannot go on: it ends with `error`, and the owner hears why.
    virtual void failed(CmaTransfer& t, const Error& error) = 0;

   protected:
    ~Owner() = default;
  };

  CmaCopier(const Context& ctx, const CmaOptions& options, Owner& owner);
  ~CmaCopier();
  CmaCopier(const CmaCopier&) = delete;
  CmaCopier& operator=(const CmaCopier&) = delete;

  /// Starts what `t` may copy now: after its grant, and again as its jobs end and chunks come
  /// back.
  void pump(CmaTransfer& t);
  /// No copy of `t` runs after this, and its chunks are back: its local memory is the caller's
  /// again. Bounded: a job copies one chunk.
  void stop(CmaTransfer& t);
  /// Jobs still on the pool do nothing when they come back; the chunks go.
  void close();

 private:
  std::unique_ptr<Job> new_job(CmaTransfer& t);
  /// Queues one copy job of the transfer's next pieces, up to a chunk (`host_only`: up to the
  /// next segment of CUDA memory).
  void queue_job(CmaTransfer& t, bool host_only);
  void queue(std::unique_ptr<Job> job, CmaTransfer& t);
  void copy_inline(CmaTransfer& t);
  static void after_job(uv_work_t* req, int status);
  void job_done(Job& job);

  // CUDA memory of this side (cma_staging.cpp).
  cuda::Stager& stager();
  void pump_staged(CmaTransfer& t);
  /// Unit `unit`'s process_vm_* job ended: a read's bytes go on to the device, a write's unit
  /// is done.
  void unit_moved(CmaTransfer& t, std::uint64_t unit);
  /// A device copy of `unit` ended: a read's unit is done, a write's goes on to the owner.
  void unit_copied(std::uint64_t transfer, std::uint64_t unit, const std::optional<Error>& error);
  void unit_done(CmaTransfer& t, std::uint64_t unit);

  Context ctx_;
  CmaOptions options_;
  Owner& owner_;
  kit::Lifetime life_;
  std::unique_ptr<cuda::Stager> stager_;
};

}  // namespace ferry::transport::cma
