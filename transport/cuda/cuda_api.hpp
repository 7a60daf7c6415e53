#pragma once

// The one table of CUDA driver functions ferry calls. Nothing in ferry calls libcuda by name:
// the system table binds it at run time (dlopen of libcuda.so.1), so the same library runs on
// a host without a GPU or driver and loses only CUDA memory. FERRY_CUDA_DRIVER names another
// library with the driver's symbols to load instead (tests load a simulated driver,
// tests/support/fake_cuda/, that way: into every process of a test, children too).
//
// Every entry has the signature and the error convention of the driver function it is named
// after, by the name <cuda.h> gives it (cuMemAlloc is bound as cuMemAlloc_v2, and so on).
// Entries under "optional" are null when the driver lacks them; ferry then does without what
// they give (VMM exports, dmabuf). A table is immutable once made and may be used from any
// thread, as the driver's functions may.

#include <cuda.h>

#include <string>

#include <ferry/error.hpp>

namespace ferry::transport::cuda {

struct CudaApi {
  const char* name = "";  ///< the library it was loaded from, for messages

  // Driver, devices, contexts.
  CUresult (*init)(unsigned int flags) = nullptr;
  CUresult (*driver_get_version)(int* version) = nullptr;
  CUresult (*get_error_string)(CUresult error, const char** text) = nullptr;
  CUresult (*get_error_name)(CUresult error, const char** text) = nullptr;
  CUresult (*device_get_count)(int* count) = nullptr;
  CUresult (*device_get)(CUdevice* device, int ordinal) = nullptr;
  CUresult (*device_get_name)(char* name, int len, CUdevice device) = nullptr;
  CUresult (*device_get_attribute)(int* value, CUdevice_attribute attr, CUdevice device) = nullptr;
  CUresult (*device_get_pci_bus_id)(char* id, int len, CUdevice device) = nullptr;
  CUresult (*device_primary_ctx_retain)(CUcontext* ctx, CUdevice device) = nullptr;
  CUresult (*device_primary_ctx_release)(CUdevice device) = nullptr;
  CUresult (*ctx_set_current)(CUcontext ctx) = nullptr;
  CUresult (*ctx_get_current)(CUcontext* ctx) = nullptr;

  // Pointers and memory.
  CUresult (*pointer_get_attributes)(unsigned int count, CUpointer_attribute* attrs, void** data,
                                     CUdeviceptr ptr) = nullptr;
  CUresult (*mem_get_address_range)(CUdeviceptr* base, size_t* size, CUdeviceptr ptr) = nullptr;
  CUresult (*mem_alloc)(CUdeviceptr* ptr, size_t size) = nullptr;
  CUresult (*mem_free)(CUdeviceptr ptr) = nullptr;
  CUresult (*mem_host_alloc)(void** ptr, size_t size, unsigned int flags) = nullptr;
  CUresult (*mem_free_host)(void* ptr) = nullptr;
  CUresult (*mem_host_register)(void* ptr, size_t size, unsigned int flags) = nullptr;
  CUresult (*mem_host_unregister)(void* ptr) = nullptr;

  // Copies and streams.
  CUresult (*memcpy)(CUdeviceptr dst, CUdeviceptr src, size_t size) = nullptr;
  CUresult (*memcpy_async)(CUdeviceptr dst, CUdeviceptr src, size_t size,
                           CUstream stream) = nullptr;
  CUresult (*memset_d8)(CUdeviceptr dst, unsigned char value, size_t size) = nullptr;
  CUresult (*stream_create)(CUstream* stream, unsigned int flags) = nullptr;
  CUresult (*stream_destroy)(CUstream stream) = nullptr;
  CUresult (*stream_synchronize)(CUstream stream) = nullptr;
  CUresult (*stream_query)(CUstream stream) = nullptr;
  CUresult (*launch_host_func)(CUstream stream, CUhostFn fn, void* user_data) = nullptr;

  // Legacy IPC (memory from cuMemAlloc).
  CUresult (*ipc_get_mem_handle)(CUipcMemHandle* handle, CUdeviceptr ptr) = nullptr;
  CUresult (*ipc_open_mem_handle)(CUdeviceptr* ptr, CUipcMemHandle handle,
                                  unsigned int flags) = nullptr;
  CUresult (*ipc_close_mem_handle)(CUdeviceptr ptr) = nullptr;

  // Optional: virtual memory management (memory from cuMemCreate, exported as POSIX fds).
  CUresult (*mem_create)(CUmemGenericAllocationHandle* handle, size_t size,
                         const CUmemAllocationProp* prop, unsigned long long flags) = nullptr;
  CUresult (*mem_release)(CUmemGenericAllocationHandle handle) = nullptr;
  CUresult (*mem_retain_allocation_handle)(CUmemGenericAllocationHandle* handle,
                                           void* addr) = nullptr;
  CUresult (*mem_export_to_shareable_handle)(void* shareable, CUmemGenericAllocationHandle handle,
                                             CUmemAllocationHandleType type,
                                             unsigned long long flags) = nullptr;
  CUresult (*mem_import_from_shareable_handle)(CUmemGenericAllocationHandle* handle,
                                               void* shareable,
                                               CUmemAllocationHandleType type) = nullptr;
  CUresult (*mem_get_allocation_granularity)(size_t* granularity, const CUmemAllocationProp* prop,
                                             CUmemAllocationGranularity_flags option) = nullptr;
  CUresult (*mem_address_reserve)(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                  unsigned long long flags) = nullptr;
  CUresult (*mem_address_free)(CUdeviceptr ptr, size_t size) = nullptr;
  CUresult (*mem_map)(CUdeviceptr ptr, size_t size, size_t offset,
                      CUmemGenericAllocationHandle handle, unsigned long long flags) = nullptr;
  CUresult (*mem_unmap)(CUdeviceptr ptr, size_t size) = nullptr;
  CUresult (*mem_set_access)(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc,
                             size_t count) = nullptr;

  // Optional: dmabuf export of device memory (GPUDirect RDMA without nvidia-peermem).
  CUresult (*mem_get_handle_for_address_range)(void* handle, CUdeviceptr ptr, size_t size,
                                               CUmemRangeHandleType type,
                                               unsigned long long flags) = nullptr;

  bool has_vmm() const noexcept { return mem_export_to_shareable_handle != nullptr; }
  bool has_dmabuf() const noexcept { return mem_get_handle_for_address_range != nullptr; }
};

/// The driver, bound and initialized (cuInit) once per process. Throws Error(Unsupported)
/// saying why it cannot be (at every call): the library is missing (no driver on this host),
/// lacks a function ferry needs, or cuInit failed (no GPU, a driver older than the toolkit
/// ferry was built with, ...). cuda::unavailable() asks the same without throwing. Any thread.
const CudaApi& system_cuda();

/// "CUDA_ERROR_INVALID_VALUE (invalid argument)" for messages; works with a null table.
std::string result_text(const CudaApi* api, CUresult result);

}  // namespace ferry::transport::cuda
