#pragma once

#include <cstddef>
#include <ranges>
#include <span>
#include <type_traits>

#include <ferry/device.hpp>

namespace ferry {

namespace detail {
template <class T>
inline constexpr bool is_span_v = false;
template <class T, std::size_t N>
inline constexpr bool is_span_v<std::span<T, N>> = true;
}  // namespace detail

/// A non-owning view of a memory range `{ptr, size, device}`. Several descriptors form a
/// scatter/gather list. The memory must stay valid until the operation that uses it has
/// ended (complete, cancelled, errored) or has been destroyed.
/// A value type; copying it copies the view, never the memory.
class Descriptor {
 public:
  /// Throws Error(InvalidArgument) when `size` is zero (an empty buffer) or `ptr` is null.
  Descriptor(void* ptr, std::size_t size, Device device = Device::host());

  /// A view of a span of trivially copyable elements in host memory. A span of const
  /// elements gives a read-only descriptor: it may be read by a peer or written to a peer,
  /// never exposed as writable or read into (InvalidArgument at that call).
  template <class T>
  requires std::is_trivially_copyable_v<T>
  explicit Descriptor(std::span<T> elements)
      : Descriptor(const_cast<std::remove_const_t<T>*>(elements.data()), elements.size_bytes()) {
    read_only_ = std::is_const_v<T>;
  }

  /// A view of a contiguous range of trivially copyable elements in host memory: a
  /// std::vector<float>, std::array, std::string, ... (its bytes, not its elements' count).
  /// A const range gives a read-only descriptor, as a span of const elements does. An empty
  /// range throws Error(InvalidArgument). The range must outlive the operations using it.
  template <std::ranges::contiguous_range R>
  requires std::ranges::sized_range<R> &&
      std::is_trivially_copyable_v<std::ranges::range_value_t<R>> &&
      (!detail::is_span_v<std::remove_cv_t<R>>)&&(
          !std::is_same_v<std::remove_cv_t<R>, Descriptor>)explicit Descriptor(R& range)
      : Descriptor(std::span(std::ranges::data(range), std::ranges::size(range))) {}

  /// A read-only descriptor (see above) of `size` bytes at `ptr`.
  static Descriptor read_only(const void* ptr, std::size_t size, Device device = Device::host()) {
    Descriptor d(const_cast<void*>(ptr), size, device);
    d.read_only_ = true;
    return d;
  }

  void* ptr() const noexcept { return ptr_; }
  std::byte* bytes() const noexcept { return static_cast<std::byte*>(ptr_); }
  std::size_t size() const noexcept { return size_; }
  const Device& device() const noexcept { return device_; }
  /// Whether the memory must not be written by ferry (see the span constructor).
  bool is_read_only() const noexcept { return read_only_; }

 private:
  void* ptr_;
  std::size_t size_;
  Device device_;
  bool read_only_ = false;
};

}  // namespace ferry
