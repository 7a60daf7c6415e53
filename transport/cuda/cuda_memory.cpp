#include "transport/cuda/cuda_memory.hpp"

#include <cstdint>

#include "transport/cuda/cuda_api.hpp"
#include "transport/transport.hpp"

namespace ferry::transport::cuda {

bool built() noexcept { return true; }

const CudaApi* usable_driver() { return unavailable() ? nullptr : &system_cuda(); }

std::optional<Error> unavailable() {
  return refusal([] { (void)system_cuda(); });
}

std::optional<Error> check_device_range(const void* ptr, std::size_t size, int ordinal) {
  if (auto why = unavailable())
    return Error(ErrorCode::Unsupported, "CUDA memory cannot be used here: " + why->message());
  const CudaApi* api = &system_cuda();
  int count = 0;
  if (api->device_get_count(&count) != CUDA_SUCCESS || ordinal >= count)
    return Error(ErrorCode::InvalidArgument, "there is no device cuda:" + std::to_string(ordinal) +
                                                 " (this host has " + std::to_string(count) + ")");
  // cuPointerGetAttributes needs no current context, and answers for memory of any context.
  unsigned int type = 0;
  int device = -1;
  CUdeviceptr start = 0;
  std::size_t range = 0;
  CUpointer_attribute attrs[] = {
      CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
      CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE};
  void* data[] = {&type, &device, &start, &range};
  const auto addr = static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(ptr));
  CUresult r = api->pointer_get_attributes(4, attrs, data, addr);
  if (r != CUDA_SUCCESS)
    return Error(ErrorCode::InvalidArgument,
                 "the CUDA driver cannot describe the pointer: " + result_text(api, r));
  if (type != CU_MEMORYTYPE_DEVICE)
    return Error(ErrorCode::InvalidArgument,
                 std::string("the memory is not CUDA device memory (") +
                     (type == CU_MEMORYTYPE_HOST ? "it is pinned host memory: describe it as host"
                                                 : "the driver does not know it") +
                     ")");
  if (device != ordinal)
    return Error(ErrorCode::InvalidArgument, "the memory is on cuda:" + std::to_string(device) +
                                                 ", not cuda:" + std::to_string(ordinal));
  if (addr < start || size > range || addr - start > range - size)
    return Error(ErrorCode::InvalidArgument, "the range runs past the end of its allocation (" +
                                                 std::to_string(range) + " bytes at offset " +
                                                 std::to_string(addr - start) + ")");
  return std::nullopt;
}

DriverInfo describe() {
  const CudaApi* api = &system_cuda();
  DriverInfo info;
  info.library = api->name;
  (void)api->driver_get_version(&info.version);
  int count = 0;
  (void)api->device_get_count(&count);
  for (int i = 0; i < count; ++i) {
    DeviceInfo d;
    d.ordinal = i;
    CUdevice dev = 0;
    if (api->device_get(&dev, i) != CUDA_SUCCESS) continue;
    char text[256] = {};
    if (api->device_get_name(text, sizeof text - 1, dev) == CUDA_SUCCESS) d.name = text;
    char bus[64] = {};
    if (api->device_get_pci_bus_id(bus, sizeof bus - 1, dev) == CUDA_SUCCESS) d.pci_bus_id = bus;
    int value = 0;
    d.vmm = api->has_vmm() &&
            api->device_get_attribute(
                &value, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev) ==
                CUDA_SUCCESS &&
            value != 0;
    value = 0;
    d.dmabuf = api->has_dmabuf() &&
               api->device_get_attribute(&value, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, dev) ==
                   CUDA_SUCCESS &&
               value != 0;
    info.devices.push_back(std::move(d));
  }
  return info;
}

}  // namespace ferry::transport::cuda
