#include <ferry/descriptor.hpp>
#include <ferry/error.hpp>

namespace ferry {

Descriptor::Descriptor(void* ptr, std::size_t size, Device device)
    : ptr_(ptr), size_(size), device_(device) {
  if (size == 0)
    throw Error(ErrorCode::InvalidArgument,
                "descriptor is empty (0 bytes): ferry moves 1 byte or more per descriptor");
  if (ptr == nullptr) throw Error(ErrorCode::InvalidArgument, "descriptor pointer is null");
}

}  // namespace ferry
