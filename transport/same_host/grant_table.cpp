#include "transport/same_host/grant_table.hpp"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <climits>
#include <ctime>

#include "transport/same_host/system.hpp"

namespace ferry::transport::same_host {

namespace {

constexpr std::uint64_t kEnded = std::uint64_t{1} << 31;
constexpr std::uint64_t kCopies = kEnded - 1;

std::uint32_t generation_of(std::uint64_t w) noexcept {
  return static_cast<std::uint32_t>(w >> 32);
}

// The futex is the word's low half: ended bit and copy count, what close() waits on.
std::uint32_t* low_half(std::byte* word) noexcept {
  auto* p = reinterpret_cast<std::uint32_t*>(word);
  return std::endian::native == std::endian::little ? p : p + 1;
}

void futex_wait(std::uint32_t* addr, std::uint32_t expected, std::chrono::nanoseconds limit) {
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(limit.count() / 1'000'000'000);
  ts.tv_nsec = static_cast<long>(limit.count() % 1'000'000'000);
  // Not FUTEX_PRIVATE: the waker is another process mapping the same memfd page.
  ::syscall(SYS_futex, addr, FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake(std::uint32_t* addr) {
  ::syscall(SYS_futex, addr, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

}  // namespace

GrantTable::GrantTable(std::uint32_t slots) : slots_(slots) {
  fd_ = ::memfd_create("ferry-cma-grants", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd_ < 0) throw Error(ErrorCode::Internal, "memfd_create: " + errno_text(errno));
  // Sealed before any peer can see it: its size is then what every peer maps, for good.
  if (::ftruncate(fd_, static_cast<off_t>(bytes())) != 0 ||
      ::fcntl(fd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    const int err = errno;
    ::close(fd_);
    throw Error(ErrorCode::Internal, "sizing and sealing the cma grant table: " + errno_text(err));
  }
  void* p = ::mmap(nullptr, bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    ::close(fd_);
    throw Error(ErrorCode::Internal, "mapping the cma grant table: " + errno_text(err));
  }
  base_ = static_cast<std::byte*>(p);
}

GrantTable::~GrantTable() {
  ::munmap(base_, bytes());
  ::close(fd_);
}

std::atomic_ref<std::uint64_t> GrantTable::word(std::uint32_t slot) const noexcept {
  return std::atomic_ref<std::uint64_t>(
      *reinterpret_cast<std::uint64_t*>(base_ + std::size_t{slot} * kSlotBytes));
}

void GrantTable::reclaim() {
  std::erase_if(quarantine_, [this](const Held& h) {
    const std::uint64_t w = word(h.grant.slot).load(std::memory_order_acquire);
    if (generation_of(w) == h.grant.generation && (w & kCopies) != 0 &&
        !(h.peer_idle && h.peer_idle()))
      return false;
    word(h.grant.slot).store(0, std::memory_order_release);
    free_.push_back(h.grant.slot);
    return true;
  });
}

std::optional<Grant> GrantTable::open() {
  if (free_.empty() && fresh_ >= slots_) reclaim();
  std::uint32_t slot = 0;
  if (!free_.empty()) {
    // Oldest first: a slot waits as long as possible before it is reused.
    slot = free_.front();
    free_.erase(free_.begin());
  } else if (fresh_ < slots_) {
    slot = fresh_++;
  } else {
    return std::nullopt;
  }
  if (next_generation_ == 0) next_generation_ = 1;
  const std::uint32_t generation = next_generation_++;
  word(slot).store(std::uint64_t{generation} << 32, std::memory_order_release);
  return Grant{slot, generation};
}

bool GrantTable::close(Grant grant, std::chrono::steady_clock::time_point deadline,
                       const std::function<bool()>& peer_idle) {
  auto w = word(grant.slot);
  if (generation_of(w.load(std::memory_order_acquire)) != grant.generation) {
    // Only a peer breaking the protocol writes a generation: the grant is over either way
    // (no copy starts under a generation that is not the grant's), and the slot is reused.
    w.store(0, std::memory_order_release);
    free_.push_back(grant.slot);
    return true;
  }
  std::uint64_t cur = w.fetch_or(kEnded, std::memory_order_acq_rel) | kEnded;
  std::uint32_t* futex = low_half(base_ + std::size_t{grant.slot} * kSlotBytes);
  while ((cur & kCopies) != 0) {
    // A peer that died, or whose every thread is stopped, is copying nothing: its count
    // stays behind, and a later release of it does nothing to the slot's next grant.
    if (peer_idle && peer_idle()) break;
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) {
      ++quarantined_;
      quarantine_.push_back(Held{grant, peer_idle});
      return false;
    }
    // Wake up now and then to look at the peer; a copy job lasts a chunk's copy.
    futex_wait(futex, static_cast<std::uint32_t>(cur),
               std::min<std::chrono::nanoseconds>(deadline - now, std::chrono::milliseconds(5)));
    cur = w.load(std::memory_order_acquire);
  }
  w.store(0, std::memory_order_release);
  free_.push_back(grant.slot);
  return true;
}

std::uint32_t GrantTable::in_flight(Grant grant) const noexcept {
  const std::uint64_t w = word(grant.slot).load(std::memory_order_acquire);
  if (generation_of(w) != grant.generation) return 0;
  return static_cast<std::uint32_t>(w & kCopies);
}

namespace {

// Why the owner's table behind `fd` cannot be mapped as `bytes`; empty when it can.
std::string table_fault(int fd, std::size_t bytes) {
  if (bytes == 0 || bytes % kSlotBytes != 0 || bytes > kMaxTableBytes)
    return "its metadata states " + std::to_string(bytes) + " bytes (a whole number of " +
           std::to_string(kSlotBytes) + "-byte slots, at most " + std::to_string(kMaxTableBytes) +
           ", is expected)";
  // Unsealed, the owner could shrink the file under our mapping: a copy's grant would fault.
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0) return "it is not a sealable memfd (" + errno_text(errno) + ")";
  if ((seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW))
    return "it is not sealed against shrinking and growing";
  struct stat st {};
  if (::fstat(fd, &st) != 0) return "fstat: " + errno_text(errno);
  if (static_cast<std::uint64_t>(st.st_size) != bytes)
    return "it holds " + std::to_string(st.st_size) + " bytes, its metadata states " +
           std::to_string(bytes);
  return {};
}

}  // namespace

GrantView::GrantView(int fd, std::size_t bytes) : bytes_(bytes) {
  const std::string fault = table_fault(fd, bytes);
  void* p = !fault.empty() ? MAP_FAILED
                           : ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close_fetched(fd);  // fetch_fd made it
  if (!fault.empty())
    throw Error(ErrorCode::ProtocolError, "the owner's grant table is refused: " + fault);
  if (p == MAP_FAILED)
    throw Error(ErrorCode::Unsupported, "cannot map the owner's grant table: " + errno_text(err));
  base_ = static_cast<std::byte*>(p);
}

GrantView::~GrantView() { ::munmap(base_, bytes_); }

std::atomic_ref<std::uint64_t> GrantView::word(std::uint32_t slot) const noexcept {
  return std::atomic_ref<std::uint64_t>(
      *reinterpret_cast<std::uint64_t*>(base_ + std::size_t{slot} * kSlotBytes));
}

bool GrantView::holds(Grant grant) const noexcept {
  return grant.generation != 0 && (std::size_t{grant.slot} + 1) * kSlotBytes <= bytes_;
}

bool GrantView::acquire(Grant grant) const noexcept {
  auto w = word(grant.slot);
  std::uint64_t cur = w.load(std::memory_order_acquire);
  for (;;) {
    if (generation_of(cur) != grant.generation || (cur & kEnded) != 0) return false;
    if ((cur & kCopies) == kCopies) return false;
    if (w.compare_exchange_weak(cur, cur + 1, std::memory_order_acq_rel, std::memory_order_acquire))
      return true;
  }
}

void GrantView::release(Grant grant) const noexcept {
  // Only the grant's own generation: an owner that stopped waiting for this copy (its peer
  // was stopped, see GrantTable::close) may have handed the slot to another grant since.
  auto w = word(grant.slot);
  std::uint64_t cur = w.load(std::memory_order_acquire);
  do {
    if (generation_of(cur) != grant.generation || (cur & kCopies) == 0) return;
  } while (
      !w.compare_exchange_weak(cur, cur - 1, std::memory_order_acq_rel, std::memory_order_acquire));
  if ((cur & kEnded) != 0 && (cur & kCopies) == 1)
    futex_wake(low_half(base_ + std::size_t{grant.slot} * kSlotBytes));
}

}  // namespace ferry::transport::same_host
