#pragma once

#include <cstdint>
#include <memory>

#include "transport/memory.hpp"

namespace ferry::transport {

/// One registered address range of a method. What the method keeps for it (an RDMA memory
/// region, say) lives in `handle` and is released, by the handle's deleter, when the last
/// Registration referring to it is gone and the cache has let go of it.
struct Registration {
  std::uint64_t base = 0;
  std::uint64_t size = 0;
  MemoryKind kind = MemoryKind::host;
  std::shared_ptr<void> handle;  ///< the method's own; null for methods that need none
  bool covers(std::uint64_t addr, std::uint64_t len) const noexcept {
    return addr >= base && len <= size && addr - base <= size - len;
  }
};

}  // namespace ferry::transport
