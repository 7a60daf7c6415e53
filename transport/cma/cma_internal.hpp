#pragma once

// Shared by the parts of the cma transport (cma_transport.cpp: listener, connections;
// cma_server.cpp: serving exposures; cma_client.cpp: active transfers). Not an interface.

#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <string>

#include "transport/cma/cma_transport.hpp"
#include "transport/cma/system.hpp"

namespace ferry::transport::cma {

/// Most bytes of (addr, len) pairs one CLAIM carries: two ranges per descriptor of the
/// longest lists metadata allows, and some.
inline constexpr std::uint64_t kMaxClaimBytes = 4u << 20;
/// The tag of exposure `id`'s HANDLES frame (operation ids never have bit 63).
constexpr std::uint64_t handles_tag(std::uint64_t id) noexcept { return id | (1ull << 63); }
/// Most bytes of IPC handles one HANDLES frame carries (cuda_ipc.hpp: kMaxIpcRanges of 112).
inline constexpr std::uint64_t kMaxHandleBytes = 112u << 16;

/// What a cma endpoint's `info` says about its owner (JSON, see docs/protocol.md).
struct OwnerInfo {
  ProcessScope scope;
  std::uint64_t probe = 0;  ///< address of 16 bytes in the owner that equal `nonce`
  Token nonce{};
  int grants_fd = -1;  ///< the owner's fd of its grant table
  std::uint64_t grants_bytes = 0;
};
std::string to_info(const OwnerInfo& info);
/// Throws Error(InvalidMetadata) naming what is wrong.
OwnerInfo parse_info(const std::string& info);
/// Why a process of `owner`'s scope cannot be reached by cma from this one (another boot, or
/// another PID namespace), or empty.
std::string scope_mismatch(const ProcessScope& owner);
/// Parses "@name" into an abstract Unix socket address; false if malformed.
bool socket_address(const std::string& address, sockaddr_un& out, socklen_t& len);

class IpcImports;

/// A client's connection to one owner, with what it learned of the owner's process. Copy jobs
/// hold it too, so that its pidfd and grant view outlive every job that uses them.
struct PeerLink {
  std::string address;
  std::int64_t pid = 0;
  int pidfd = -1;  // the owner process, once proven to be it; -1 where pidfds do not exist
  std::unique_ptr<GrantView> grants;
  tcp::Connection* conn = nullptr;      // loop thread only; null once closed
  std::string refused;                  // a copy was refused (EPERM): later transfers fall back
  std::shared_ptr<IpcImports> imports;  // cuda_ipc: the owner's memory opened here
  PeerLink() = default;
  PeerLink(const PeerLink&) = delete;
  PeerLink& operator=(const PeerLink&) = delete;
  ~PeerLink() {
    if (pidfd >= 0) ::close(pidfd);
  }
};

/// Shared by a transfer and its copy jobs: a job starts copying only while `stop` is false,
/// and counts itself in `copying` meanwhile; stopping waits until `copying` is 0.
struct CopyState {
  std::mutex mu;
  std::condition_variable cv;
  int copying = 0;
  bool stop = false;
  /// Stops jobs from starting, and waits for the ones copying. Bounded: a job copies one
  /// chunk.
  void halt() {
    std::unique_lock lock(mu);
    stop = true;
    cv.wait(lock, [&] { return copying == 0; });
  }
};

/// One copy job: up to chunk_size bytes in at most IOV_MAX pieces, under one grant.
struct CmaTransport::Job {
  uv_work_t req{};
  std::weak_ptr<int> life;
  CmaTransport* transport = nullptr;
  std::uint64_t transfer = 0;
  std::shared_ptr<CopyState> state;
  std::shared_ptr<PeerLink> link;
  Grant grant;
  Access access = Access::read;
  std::vector<iovec> local;
  std::vector<iovec> remote;
  std::uint64_t bytes = 0;
  std::uint64_t unit = 0;  ///< cma staging: the transfer's StagedUnit it copies; 0: none
  // Results.
  std::uint64_t moved = 0;
  int err = 0;
  bool refused = false;  // the owner had ended the grant
  bool skipped = false;  // the transfer stopped before the job ran
  /// The copy itself; on a pool thread, or on the loop for small transfers.
  void run() noexcept;
};

/// cma with CUDA memory on the active side (cma_staging.cpp): up to chunk_size bytes of a
/// transfer's consecutive CUDA segments, passed through one pinned host chunk. A read copies
/// the owner's ranges into the chunk on the pool, then the chunk to the device; a write copies
/// the device into the chunk, then the chunk to the owner on the pool.
struct StagedUnit {
  std::byte* chunk = nullptr;
  std::vector<Segment> pieces;  ///< the device ranges, in the chunk's order
  std::uint64_t bytes = 0;
  std::vector<std::uint64_t> copies;  ///< device copies queued and not yet ended
  bool queued = false;                ///< its process_vm_* job is on the pool
};

class CmaTransfer final : public Transfer {
 public:
  CmaTransfer(CmaTransport& transport, std::uint64_t transfer_id, TransferSpec what,
              TransferObserver& obs)
      : owner(&transport), id(transfer_id), spec(std::move(what)), observer(&obs) {
    for (const Segment& s : spec.segments) total += s.len;
  }
  ~CmaTransfer() override {
    if (owner != nullptr) owner->forget_transfer(*this);
  }
  void cancel(const Error& reason) override {
    if (owner != nullptr) owner->cancel_transfer(*this, reason);
  }
  std::optional<Token> claim_secret() const override { return secret; }

  CmaTransport* owner;
  std::uint64_t id;
  TransferSpec spec;
  TransferObserver* observer;
  std::shared_ptr<PeerLink> link;
  std::shared_ptr<CopyState> copy = std::make_shared<CopyState>();
  std::vector<std::byte> claim_payload;
  Grant grant;
  bool claimed = false;
  std::optional<Token> secret;
  std::size_t seg = 0;
  std::uint64_t seg_off = 0;
  unsigned jobs = 0;  // queued on the pool, not yet back
  std::uint64_t done = 0;
  std::uint64_t total = 0;
  bool done_sent = false;
  bool ended_by_owner = false;  // a copy was refused: the owner's notice says why
  bool finished = false;
  bool notified = false;
  std::uint64_t claim_req = 0;
  std::uint64_t done_req = 0;
  // cuda_ipc.
  std::vector<std::byte> handles;  ///< the owner's HANDLES payload, once received
  bool handles_whole = false;
  std::map<std::uint64_t, std::uint64_t> copies;  ///< GPU copies under way: id -> bytes
  // cma staging (cma_staging.cpp).
  bool staged = false;         ///< some local segment is CUDA memory
  bool waiting_chunk = false;  ///< no chunk was free: pumped again when one comes back
  std::map<std::uint64_t, StagedUnit> units;  ///< chunks in use, by unit id
  std::uint64_t next_unit = 1;
};

using tcp::code_from_wire;
using tcp::fatal;

}  // namespace ferry::transport::cma
