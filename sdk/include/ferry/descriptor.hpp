#pragma once

#include <cstddef>
#include <span>
#include <type_traits>

#include <ferry/device.hpp>

namespace ferry {

/// A non-owning view of a memory range `{ptr, size, device}`. Several descriptors form a
/// scatter/gather list. The memory must stay valid until the operation that uses it has
/// ended (complete, cancelled, errored) or has been destroyed.
/// A value type; copying it copies the view, never the memory.
class Descriptor {
 public:
  /// Throws Error(InvalidArgument) when `ptr` is null or `size` is zero.
  Descriptor(void* ptr, std::size_t size, Device device = Device::host());

  /// A view of a span of trivially copyable elements in host memory.
  template <class T>
  requires std::is_trivially_copyable_v<T>
  explicit Descriptor(std::span<T> elements)
      : Descriptor(const_cast<std::remove_const_t<T>*>(elements.data()), elements.size_bytes()) {}

  void* ptr() const noexcept { return ptr_; }
  std::byte* bytes() const noexcept { return static_cast<std::byte*>(ptr_); }
  std::size_t size() const noexcept { return size_; }
  const Device& device() const noexcept { return device_; }

 private:
  void* ptr_;
  std::size_t size_;
  Device device_;
};

}  // namespace ferry
