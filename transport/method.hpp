#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ferry/error.hpp>
#include <ferry/options.hpp>

#include "transport/context.hpp"
#include "transport/memory.hpp"
#include "transport/transport.hpp"

namespace ferry::transport {

/// One method, described once: its folder defines `const Method& <name>_method()`, and the
/// build lists the methods it has (builtin_methods()). A transport's Capabilities come from its
/// record; the connector's registry and ferry-info read the same record.
struct Method {
  std::string name;  ///< the name put into endpoints ("tcp")
  /// Preference among the methods both sides offer: the highest rank that fits wins.
  int rank = 0;
  /// The memory kinds it moves (bit(MemoryKind)), CUDA memory only where the driver is usable,
  /// and the kinds it lets a peer reach (a method may move memory on its active side that it
  /// cannot serve: cma stages the active side's CUDA memory, cuda_ipc copies to or from the
  /// active side's host memory).
  std::uint8_t moves = bit(MemoryKind::host);
  std::uint8_t serves = bit(MemoryKind::host);
  bool same_host_only = false;    ///< works only between processes of one host
  bool passive_cpu_free = false;  ///< the passive side's CPU does not touch the bytes
  /// What it needs of a peer, shown when it is available.
  std::string needs;
  /// Why this host cannot offer it under `options`, without starting anything; none: it can.
  /// Empty function: it always can.
  std::function<std::optional<Error>(const ConnectorOptions& options)> unavailable;
  /// Makes its transport. Throws Error(Unsupported) when this host cannot offer it (why in the
  /// message), Error(InvalidArgument) for bad options.
  std::function<std::unique_ptr<Transport>(const Context& context, const ConnectorOptions& options)>
      make;

  /// What its transport reports under `context` (CUDA memory only with a driver).
  Capabilities capabilities(const Context& context) const {
    Capabilities c;
    c.method = name;
    c.rank = rank;
    c.memory_kinds = context.cuda != nullptr ? moves : (moves & bit(MemoryKind::host));
    c.same_host_only = same_host_only;
    c.passive_cpu_free = passive_cpu_free;
    return c;
  }
  /// Whether it moves CUDA memory on both sides where the driver is usable.
  bool moves_cuda_both_ways() const noexcept {
    return (moves & serves & bit(MemoryKind::cuda)) != 0;
  }
};

/// The methods of this build, in the order they were added to it (generated).
std::vector<const Method*> builtin_methods();

}  // namespace ferry::transport
