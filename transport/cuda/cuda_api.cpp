#include "transport/cuda/cuda_api.hpp"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <optional>
#include <string>

#include <ferry/error.hpp>

// The name the driver exports for a function of <cuda.h>, after its version macros:
// FERRY_CUDA_SYMBOL(cuMemAlloc) is "cuMemAlloc_v2".
#define FERRY_CUDA_SYMBOL_TEXT(x) #x
#define FERRY_CUDA_SYMBOL(x) FERRY_CUDA_SYMBOL_TEXT(x)

namespace ferry::transport::cuda {

namespace {

struct Loaded {
  CudaApi api;
  std::string library;
  std::optional<Error> error;  ///< why the driver cannot be used
};

/// Binds `out` to the driver's `symbol`; throws Error(Unsupported) when it lacks it.
template <class F>
void bind(void* lib, const char* symbol, F& out) {
  void* p = ::dlsym(lib, symbol);
  if (p == nullptr) throw Error(ErrorCode::Unsupported, std::string("the driver lacks ") + symbol);
  out = reinterpret_cast<F>(p);
}

template <class F>
void bind_optional(void* lib, const char* symbol, F& out) {
  if (void* p = ::dlsym(lib, symbol)) out = reinterpret_cast<F>(p);
}

#define FERRY_BIND(field, fn) bind(lib, FERRY_CUDA_SYMBOL(fn), a.field)
#define FERRY_BIND_OPTIONAL(field, fn) bind_optional(lib, FERRY_CUDA_SYMBOL(fn), a.field)

// Binds every function ferry needs of the driver in `lib` into `a`; throws Error(Unsupported)
// naming the first one it lacks.
void bind_all(void* lib, CudaApi& a) {
  FERRY_BIND(init, cuInit);
  FERRY_BIND(driver_get_version, cuDriverGetVersion);
  FERRY_BIND(get_error_string, cuGetErrorString);
  FERRY_BIND(get_error_name, cuGetErrorName);
  FERRY_BIND(device_get_count, cuDeviceGetCount);
  FERRY_BIND(device_get, cuDeviceGet);
  FERRY_BIND(device_get_name, cuDeviceGetName);
  FERRY_BIND(device_get_attribute, cuDeviceGetAttribute);
  FERRY_BIND(device_get_pci_bus_id, cuDeviceGetPCIBusId);
  FERRY_BIND(device_primary_ctx_retain, cuDevicePrimaryCtxRetain);
  FERRY_BIND(device_primary_ctx_release, cuDevicePrimaryCtxRelease);
  FERRY_BIND(ctx_set_current, cuCtxSetCurrent);
  FERRY_BIND(ctx_get_current, cuCtxGetCurrent);
  FERRY_BIND(pointer_get_attributes, cuPointerGetAttributes);
  FERRY_BIND(mem_get_address_range, cuMemGetAddressRange);
  FERRY_BIND(mem_alloc, cuMemAlloc);
  FERRY_BIND(mem_free, cuMemFree);
  FERRY_BIND(mem_host_alloc, cuMemHostAlloc);
  FERRY_BIND(mem_free_host, cuMemFreeHost);
  FERRY_BIND(mem_host_register, cuMemHostRegister);
  FERRY_BIND(mem_host_unregister, cuMemHostUnregister);
  FERRY_BIND(memcpy, cuMemcpy);
  FERRY_BIND(memcpy_async, cuMemcpyAsync);
  FERRY_BIND(memset_d8, cuMemsetD8);
  FERRY_BIND(stream_create, cuStreamCreate);
  FERRY_BIND(stream_destroy, cuStreamDestroy);
  FERRY_BIND(stream_synchronize, cuStreamSynchronize);
  FERRY_BIND(stream_query, cuStreamQuery);
  FERRY_BIND(launch_host_func, cuLaunchHostFunc);
  FERRY_BIND(ipc_get_mem_handle, cuIpcGetMemHandle);
  FERRY_BIND(ipc_open_mem_handle, cuIpcOpenMemHandle);
  FERRY_BIND(ipc_close_mem_handle, cuIpcCloseMemHandle);
  FERRY_BIND_OPTIONAL(mem_create, cuMemCreate);
  FERRY_BIND_OPTIONAL(mem_release, cuMemRelease);
  FERRY_BIND_OPTIONAL(mem_retain_allocation_handle, cuMemRetainAllocationHandle);
  FERRY_BIND_OPTIONAL(mem_export_to_shareable_handle, cuMemExportToShareableHandle);
  FERRY_BIND_OPTIONAL(mem_import_from_shareable_handle, cuMemImportFromShareableHandle);
  FERRY_BIND_OPTIONAL(mem_get_allocation_granularity, cuMemGetAllocationGranularity);
  FERRY_BIND_OPTIONAL(mem_address_reserve, cuMemAddressReserve);
  FERRY_BIND_OPTIONAL(mem_address_free, cuMemAddressFree);
  FERRY_BIND_OPTIONAL(mem_map, cuMemMap);
  FERRY_BIND_OPTIONAL(mem_unmap, cuMemUnmap);
  FERRY_BIND_OPTIONAL(mem_set_access, cuMemSetAccess);
  FERRY_BIND_OPTIONAL(mem_get_handle_for_address_range, cuMemGetHandleForAddressRange);
}

#undef FERRY_BIND
#undef FERRY_BIND_OPTIONAL

// Fills `l` in place (the table's name points into l.library); throws Error(Unsupported) when
// the driver cannot be used.
void load(Loaded& l) {
  const char* chosen = std::getenv("FERRY_CUDA_DRIVER");
  l.library = chosen != nullptr && *chosen != '\0' ? chosen : "libcuda.so.1";
  void* lib = ::dlopen(l.library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* e = ::dlerror();
    throw Error(ErrorCode::Unsupported, "no CUDA driver: " + l.library + " cannot be loaded (" +
                                            (e ? e : "unknown error") + ")");
  }
  // The library stays loaded for the life of the process, as it would linked.
  CudaApi& a = l.api;
  a.name = l.library.c_str();
  try {
    bind_all(lib, a);
  } catch (const Error& e) {
    throw Error(ErrorCode::Unsupported,
                "the CUDA driver " + l.library + " is not usable: " + e.message());
  }
  // VMM needs all of its entries, or none is used.
  if (a.mem_create == nullptr || a.mem_release == nullptr ||
      a.mem_retain_allocation_handle == nullptr || a.mem_import_from_shareable_handle == nullptr ||
      a.mem_get_allocation_granularity == nullptr || a.mem_address_reserve == nullptr ||
      a.mem_address_free == nullptr || a.mem_map == nullptr || a.mem_unmap == nullptr ||
      a.mem_set_access == nullptr)
    a.mem_export_to_shareable_handle = nullptr;
  if (CUresult r = a.init(0); r != CUDA_SUCCESS)
    throw Error(ErrorCode::Unsupported, "the CUDA driver " + l.library +
                                            " did not start: cuInit failed with " +
                                            result_text(&a, r));
}

}  // namespace

const CudaApi& system_cuda() {
  static Loaded loaded;
  static std::once_flag once;
  std::call_once(once, [] {
    try {
      load(loaded);
    } catch (const Error& e) {
      loaded.error = e;
    }
  });
  if (loaded.error) throw *loaded.error;
  return loaded.api;
}

std::string result_text(const CudaApi* api, CUresult result) {
  const char* name = nullptr;
  const char* text = nullptr;
  if (api != nullptr && api->get_error_name != nullptr) (void)api->get_error_name(result, &name);
  if (api != nullptr && api->get_error_string != nullptr)
    (void)api->get_error_string(result, &text);
  std::string out = name != nullptr ? name : "CUDA error " + std::to_string(result);
  if (text != nullptr) out += std::string(" (") + text + ")";
  return out;
}

}  // namespace ferry::transport::cuda
