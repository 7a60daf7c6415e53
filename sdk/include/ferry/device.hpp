#pragma once

#include <string>
#include <string_view>

namespace ferry {

enum class DeviceKind : int { unspecified = 0, host = 1, cuda = 2 };

/// Where memory lives: host memory, or the memory of CUDA device N.
/// A value type; thread-safe as any const object.
class Device {
 public:
  /// Host memory.
  constexpr Device() noexcept = default;
  /// Parses "host", "cpu", "cuda" (device 0) or "cuda:N".
  /// Throws Error(InvalidArgument) for anything else.
  explicit Device(std::string_view spec);

  static constexpr Device host() noexcept { return Device(); }
  /// Throws Error(InvalidArgument) for a negative ordinal.
  static Device cuda(int ordinal);

  constexpr DeviceKind kind() const noexcept { return kind_; }
  /// The CUDA ordinal; 0 for host memory.
  constexpr int id() const noexcept { return id_; }
  /// "host" or "cuda:N"; Device(d.to_string()) == d.
  std::string to_string() const;

  friend constexpr bool operator==(const Device&, const Device&) noexcept = default;

 private:
  constexpr Device(DeviceKind kind, int id) noexcept : kind_(kind), id_(id) {}
  DeviceKind kind_ = DeviceKind::host;
  int id_ = 0;
};

}  // namespace ferry
