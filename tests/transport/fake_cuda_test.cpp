// The simulated CUDA driver (tests/support/fake_cuda/), loaded as ferry loads a driver: through
// system_cuda() and FERRY_CUDA_DRIVER. These are the behaviours ferry's CUDA tests rely on.

#include "tests/cuda/simulated_driver.hpp"
#include "transport/cuda/cuda_api.hpp"

#include <dlfcn.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

namespace {

namespace cuda = ferry::transport::cuda;

#define CU_OK(x) ASSERT_EQ(CUDA_SUCCESS, (x))
// In a forked child: no gtest, an exit status per failed check.
#define CHILD_CHECK(cond, code) \
  if (!(cond)) ::_exit(code)

// Before main (ctest sets the variable too).
const bool g_driver_set = ferry::test::use_simulated_driver();

constexpr size_t kMiB = size_t{1} << 20;

std::vector<unsigned char> pattern(size_t n, unsigned seed) {
  std::vector<unsigned char> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<unsigned char>((i * 131 + seed) >> 3);
  return v;
}

CUdeviceptr host_address(const void* p) { return reinterpret_cast<uintptr_t>(p); }

int exit_status(pid_t pid) {
  int status = 0;
  if (::waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// The fake's copy totals: h2d, d2h, d2d bytes, copies.
std::vector<unsigned long long> counters() {
  auto* fn = ferry::test::simulated_function<void(unsigned long long*)>("ferry_fake_cuda_counters");
  std::vector<unsigned long long> out(4, 0);
  if (fn != nullptr) fn(out.data());
  return out;
}

// The driver bound, the primary context of device 0 retained and current on this thread.
class FakeCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    try {
      api_ = &cuda::system_cuda();
    } catch (const ferry::Error& e) {
      FAIL() << e.what();
    }
    CU_OK(api_->device_primary_ctx_retain(&ctx_, 0));
    CU_OK(api_->ctx_set_current(ctx_));
  }
  void TearDown() override {
    if (api_ == nullptr) return;
    (void)api_->ctx_set_current(nullptr);
    (void)api_->device_primary_ctx_release(0);
  }
  int memory_type(CUdeviceptr p) {
    unsigned type = 99;
    EXPECT_EQ(CUDA_SUCCESS,
              api_->pointer_get_attributes(1, std::array{CU_POINTER_ATTRIBUTE_MEMORY_TYPE}.data(),
                                           std::array<void*, 1>{&type}.data(), p));
    return static_cast<int>(type);
  }
  const cuda::CudaApi* api_ = nullptr;
  CUcontext ctx_ = nullptr;
};

TEST_F(FakeCuda, DriverAndDevices) {
  int n = 0, version = 0, value = -1;
  CU_OK(api_->device_get_count(&n));
  EXPECT_EQ(n, 2);
  CU_OK(api_->driver_get_version(&version));
  EXPECT_EQ(version, 13000);
  char name[64], bus[32];
  CU_OK(api_->device_get_name(name, sizeof name, 1));
  EXPECT_STREQ(name, "ferry fake GPU 1");
  CU_OK(api_->device_get_pci_bus_id(bus, sizeof bus, 1));
  EXPECT_STREQ(bus, "0000:02:00.0");
  for (auto attr : {CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING,
                    CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                    CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED,
                    CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED}) {
    CU_OK(api_->device_get_attribute(&value, attr, 0));
    EXPECT_EQ(value, 1) << attr;
  }
  CU_OK(api_->device_get_attribute(&value, CU_DEVICE_ATTRIBUTE_TCC_DRIVER, 0));
  EXPECT_EQ(value, 0);
  CUdevice d;
  EXPECT_EQ(api_->device_get(&d, 2), CUDA_ERROR_INVALID_DEVICE);
  EXPECT_TRUE(api_->has_vmm());
  EXPECT_TRUE(api_->has_dmabuf());
  EXPECT_EQ(cuda::result_text(api_, CUDA_ERROR_INVALID_CONTEXT),
            "CUDA_ERROR_INVALID_CONTEXT (invalid device context)");
}

// A second instance of the library (a copy under another name) has its own state: before
// cuInit everything fails, and FERRY_FAKE_CUDA_DEVICES=0 makes cuInit fail.
TEST(FakeCudaInit, NotInitializedAndNoDevice) {
  auto copy = std::filesystem::temp_directory_path() /
              ("ferry_fake_cuda_copy_" + std::to_string(::getpid()) + ".so");
  std::filesystem::copy_file(FERRY_FAKE_CUDA_PATH, copy,
                             std::filesystem::copy_options::overwrite_existing);
  void* lib = ::dlopen(copy.c_str(), RTLD_NOW | RTLD_LOCAL);
  std::filesystem::remove(copy);
  ASSERT_NE(lib, nullptr) << ::dlerror();
  auto count = reinterpret_cast<CUresult (*)(int*)>(::dlsym(lib, "cuDeviceGetCount"));
  auto alloc = reinterpret_cast<CUresult (*)(CUdeviceptr*, size_t)>(::dlsym(lib, "cuMemAlloc_v2"));
  auto init = reinterpret_cast<CUresult (*)(unsigned)>(::dlsym(lib, "cuInit"));
  ASSERT_TRUE(count && alloc && init);
  int n = 0;
  CUdeviceptr p = 0;
  EXPECT_EQ(count(&n), CUDA_ERROR_NOT_INITIALIZED);
  EXPECT_EQ(alloc(&p, 64), CUDA_ERROR_NOT_INITIALIZED);
  ::setenv("FERRY_FAKE_CUDA_DEVICES", "0", 1);
  EXPECT_EQ(init(0), CUDA_ERROR_NO_DEVICE);
  ::unsetenv("FERRY_FAKE_CUDA_DEVICES");
  EXPECT_EQ(count(&n), CUDA_ERROR_NOT_INITIALIZED);
  // Left loaded: its state (never freed, by design) stays reachable for leak checkers.
}

TEST_F(FakeCuda, CallsNeedACurrentContext) {
  CUdeviceptr p = 0;
  std::vector<unsigned char> host(64);
  CUstream stream = nullptr;
  void* pinned = nullptr;
  CU_OK(api_->ctx_set_current(nullptr));
  EXPECT_EQ(api_->mem_alloc(&p, 64), CUDA_ERROR_INVALID_CONTEXT);
  EXPECT_EQ(api_->memcpy(host_address(host.data()), host_address(host.data() + 32), 32),
            CUDA_ERROR_INVALID_CONTEXT);
  EXPECT_EQ(api_->stream_create(&stream, 0), CUDA_ERROR_INVALID_CONTEXT);
  EXPECT_EQ(api_->mem_host_alloc(&pinned, 4096, 0), CUDA_ERROR_INVALID_CONTEXT);
  EXPECT_EQ(api_->launch_host_func(
                nullptr, [](void*) {}, nullptr),
            CUDA_ERROR_INVALID_CONTEXT);
  // Device 1's context: allocations land on device 1; released to zero it is gone.
  CUcontext ctx1 = nullptr;
  CU_OK(api_->device_primary_ctx_retain(&ctx1, 1));
  EXPECT_NE(ctx1, ctx_);
  CU_OK(api_->ctx_set_current(ctx1));
  CU_OK(api_->mem_alloc(&p, 64));
  int ordinal = -1;
  CUpointer_attribute attr = CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL;
  void* data = &ordinal;
  CU_OK(api_->pointer_get_attributes(1, &attr, &data, p));
  EXPECT_EQ(ordinal, 1);
  CU_OK(api_->mem_free(p));
  CU_OK(api_->device_primary_ctx_release(1));
  EXPECT_EQ(api_->mem_alloc(&p, 64), CUDA_ERROR_INVALID_CONTEXT);
}

TEST_F(FakeCuda, CopiesRoundTrip) {
  const size_t n = kMiB + 3;
  CUdeviceptr a = 0, b = 0, big = 0;
  CU_OK(api_->mem_alloc(&a, n));
  CU_OK(api_->mem_alloc(&b, n));
  CU_OK(api_->mem_alloc(&big, 4 * kMiB));
  EXPECT_EQ(a % 512, 0u);
  EXPECT_EQ(big % (2 * kMiB), 0u);
  auto before = counters();
  auto in = pattern(n, 7);
  std::vector<unsigned char> out(n);
  CU_OK(api_->memcpy(a, host_address(in.data()), n));
  CU_OK(api_->memset_d8(a + 10, 0xEE, 5));
  CU_OK(api_->memcpy(b, a, n));
  CU_OK(api_->memcpy(host_address(out.data()), b, n));
  std::memset(in.data() + 10, 0xEE, 5);
  EXPECT_EQ(in, out);
  auto after = counters();
  EXPECT_EQ(after[0] - before[0], n);
  EXPECT_EQ(after[1] - before[1], n);
  EXPECT_EQ(after[2] - before[2], n);
  EXPECT_EQ(after[3] - before[3], 3u);
  // A device range must lie wholly in one allocation.
  EXPECT_EQ(api_->memcpy(host_address(out.data()), a + 1, n), CUDA_ERROR_INVALID_VALUE);
  CUdeviceptr base = 0;
  size_t size = 0;
  CU_OK(api_->mem_get_address_range(&base, &size, a + 100));
  EXPECT_EQ(base, a);
  EXPECT_EQ(size, n);
  EXPECT_EQ(api_->mem_get_address_range(&base, &size, host_address(out.data())),
            CUDA_ERROR_NOT_FOUND);
  for (CUdeviceptr p : {a, b, big}) CU_OK(api_->mem_free(p));
  EXPECT_EQ(api_->memcpy(host_address(out.data()), a, 16), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(api_->mem_free(a), CUDA_ERROR_INVALID_VALUE);
}

TEST_F(FakeCuda, StreamRunsInOrderAndFailureIsSticky) {
  struct Seen {
    std::vector<unsigned char>* out;
    std::vector<unsigned char> copy;
    std::thread::id thread;
  } seen;
  const size_t n = 256 * 1024;
  auto in = pattern(n, 3);
  std::vector<unsigned char> out(n);
  seen.out = &out;
  CUdeviceptr d = 0;
  CUstream stream = nullptr;
  CU_OK(api_->mem_alloc(&d, n));
  CU_OK(api_->stream_create(&stream, 0));
  CU_OK(api_->memcpy_async(d, host_address(in.data()), n, stream));
  CU_OK(api_->memcpy_async(host_address(out.data()), d, n, stream));
  // Runs on the stream's thread, after both copies.
  CU_OK(api_->launch_host_func(
      stream,
      [](void* p) {
        auto* s = static_cast<Seen*>(p);
        s->copy = *s->out;
        s->thread = std::this_thread::get_id();
      },
      &seen));
  CU_OK(api_->stream_synchronize(stream));
  EXPECT_EQ(seen.copy, in);
  EXPECT_NE(seen.thread, std::this_thread::get_id());
  // A bad address fails when the copy runs; later copies are skipped, host functions run.
  int ran = 0;
  std::memset(out.data(), 0, n);
  CU_OK(api_->memcpy_async(host_address(out.data()), d + n, 16, stream));
  CU_OK(api_->memcpy_async(host_address(out.data()), d, n, stream));
  CU_OK(api_->launch_host_func(
      stream, [](void* p) { ++*static_cast<int*>(p); }, &ran));
  EXPECT_EQ(api_->stream_synchronize(stream), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(api_->stream_synchronize(stream), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(ran, 1);
  EXPECT_EQ(out[0], 0);
  CU_OK(api_->stream_destroy(stream));
  EXPECT_EQ(api_->stream_synchronize(stream), CUDA_ERROR_INVALID_HANDLE);
  CU_OK(api_->mem_free(d));
}

TEST_F(FakeCuda, PointerAttributes) {
  CUdeviceptr d = 0;
  CU_OK(api_->mem_alloc(&d, 1000));
  unsigned type = 0;
  int ordinal = -1, managed = -1, mapped = -1;
  CUdeviceptr start = 0;
  size_t size = 0;
  unsigned long long id = 0;
  CUcontext ctx = nullptr;
  std::array attrs{CU_POINTER_ATTRIBUTE_MEMORY_TYPE,      CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                   CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                   CU_POINTER_ATTRIBUTE_BUFFER_ID,        CU_POINTER_ATTRIBUTE_IS_MANAGED,
                   CU_POINTER_ATTRIBUTE_CONTEXT,          CU_POINTER_ATTRIBUTE_MAPPED};
  std::array<void*, 8> data{&type, &ordinal, &start, &size, &id, &managed, &ctx, &mapped};
  CU_OK(api_->pointer_get_attributes(8, attrs.data(), data.data(), d + 10));
  EXPECT_EQ(type, CU_MEMORYTYPE_DEVICE);
  EXPECT_EQ(ordinal, 0);
  EXPECT_EQ(start, d);
  EXPECT_EQ(size, 1000u);
  EXPECT_EQ(managed, 0);
  EXPECT_EQ(ctx, ctx_);
  EXPECT_EQ(mapped, 1);
  // Freed and allocated again, perhaps at the same address: a new buffer id.
  const unsigned long long first_id = id;
  CU_OK(api_->mem_free(d));
  CU_OK(api_->mem_alloc(&d, 1000));
  CU_OK(api_->pointer_get_attributes(8, attrs.data(), data.data(), d));
  EXPECT_NE(id, first_id);
  CU_OK(api_->mem_free(d));
  // Pinned host memory, allocated and registered; plain host memory is no CUDA pointer.
  void* pinned = nullptr;
  CU_OK(api_->mem_host_alloc(&pinned, 5000, 0));
  EXPECT_EQ(host_address(pinned) % 4096, 0u);
  EXPECT_EQ(memory_type(host_address(pinned) + 4999), CU_MEMORYTYPE_HOST);
  std::vector<unsigned char> plain(8192);
  EXPECT_EQ(memory_type(host_address(plain.data())), 0);
  CU_OK(api_->mem_host_register(plain.data(), 4096, 0));
  EXPECT_EQ(memory_type(host_address(plain.data()) + 100), CU_MEMORYTYPE_HOST);
  EXPECT_EQ(api_->mem_host_register(plain.data() + 100, 4096, 0),
            CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
  CU_OK(api_->mem_host_unregister(plain.data()));
  EXPECT_EQ(api_->mem_host_unregister(plain.data()), CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
  EXPECT_EQ(memory_type(host_address(plain.data())), 0);
  CU_OK(api_->mem_free_host(pinned));
}

// Any call from any thread: threads allocate, copy through streams, query and free at once.
TEST_F(FakeCuda, ThreadsAtOnce) {
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      auto check = [&](bool ok) { failures += ok ? 0 : 1; };
      check(api_->ctx_set_current(ctx_) == CUDA_SUCCESS);
      CUstream stream = nullptr;
      check(api_->stream_create(&stream, 0) == CUDA_SUCCESS);
      for (int i = 0; i < 50; ++i) {
        const size_t n = 4096 * static_cast<size_t>(1 + (i + t) % 7);
        auto in = pattern(n, static_cast<unsigned>(i * 4 + t));
        std::vector<unsigned char> out(n);
        CUdeviceptr d = 0;
        check(api_->mem_alloc(&d, n) == CUDA_SUCCESS);
        check(api_->memcpy_async(d, host_address(in.data()), n, stream) == CUDA_SUCCESS);
        check(api_->memcpy_async(host_address(out.data()), d, n, stream) == CUDA_SUCCESS);
        check(memory_type(d + n / 2) == CU_MEMORYTYPE_DEVICE);
        check(api_->stream_synchronize(stream) == CUDA_SUCCESS && out == in);
        check(api_->mem_free(d) == CUDA_SUCCESS);
      }
      check(api_->stream_destroy(stream) == CUDA_SUCCESS);
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
}

TEST_F(FakeCuda, CpuAccessToDeviceMemoryCrashes) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  CUdeviceptr d = 0;
  CU_OK(api_->mem_alloc(&d, 4096));
  // SIGSEGV; under a sanitizer, which reports the SEGV, a failed exit, or SIGABRT where it is
  // told to abort on an error (ASAN_OPTIONS=abort_on_error=1, as CI runs it).
  auto segv = [](int status) {
    return WIFSIGNALED(status) ? WTERMSIG(status) == SIGSEGV || WTERMSIG(status) == SIGABRT
                               : WEXITSTATUS(status) != 0;
  };
  EXPECT_EXIT((void)*reinterpret_cast<volatile unsigned char*>(d), segv, "");
  CU_OK(api_->mem_free(d));
}

TEST_F(FakeCuda, IpcImportInAnotherProcess) {
  const size_t n = 3 * kMiB;
  auto in = pattern(n, 11);
  CUdeviceptr a = 0, b = 0, c = 0;
  CU_OK(api_->mem_alloc(&a, n));
  CU_OK(api_->mem_alloc(&b, 4096));
  CU_OK(api_->memcpy(a, host_address(in.data()), n));
  CUipcMemHandle ha, hb;
  CU_OK(api_->ipc_get_mem_handle(&ha, a + 5));
  CU_OK(api_->ipc_get_mem_handle(&hb, b));
  CUdeviceptr own = 0;
  EXPECT_EQ(api_->ipc_open_mem_handle(&own, ha, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
            CUDA_ERROR_INVALID_CONTEXT);
  CU_OK(api_->mem_free(b));
  CU_OK(api_->mem_alloc(&c, 4096));  // likely takes b's fd number: another inode
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    CUdeviceptr p = 0, again = 0;
    CHILD_CHECK(api_->ipc_open_mem_handle(&p, ha, 1) == CUDA_SUCCESS, 10);
    CHILD_CHECK(api_->ipc_open_mem_handle(&again, ha, 1) == CUDA_SUCCESS && again == p, 11);
    std::vector<unsigned char> out(n);
    CHILD_CHECK(api_->memcpy(host_address(out.data()), p, n) == CUDA_SUCCESS, 12);
    CHILD_CHECK(out == in, 13);
    CHILD_CHECK(memory_type(p + n - 1) == CU_MEMORYTYPE_DEVICE, 14);
    CHILD_CHECK(api_->memset_d8(p, 0x5A, 64) == CUDA_SUCCESS, 15);
    CHILD_CHECK(api_->ipc_close_mem_handle(p) == CUDA_SUCCESS, 16);
    CHILD_CHECK(api_->memcpy(host_address(out.data()), p, 1) == CUDA_SUCCESS, 17);  // one ref
    CHILD_CHECK(api_->ipc_close_mem_handle(p) == CUDA_SUCCESS, 18);
    CHILD_CHECK(api_->memcpy(host_address(out.data()), p, 1) == CUDA_ERROR_INVALID_VALUE, 19);
    CHILD_CHECK(api_->ipc_open_mem_handle(&p, hb, 1) == CUDA_ERROR_INVALID_HANDLE, 20);
    ::_exit(0);
  }
  EXPECT_EQ(exit_status(pid), 0);
  unsigned char first = 0;
  CU_OK(api_->memcpy(host_address(&first), a, 1));
  EXPECT_EQ(first, 0x5A);  // the importer wrote the exporter's memory
  CU_OK(api_->mem_free(a));
  CU_OK(api_->mem_free(c));
}

TEST_F(FakeCuda, VmmExportThroughFd) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  prop.location = {CU_MEM_LOCATION_TYPE_DEVICE, 0};
  size_t g = 0;
  CU_OK(api_->mem_get_allocation_granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  ASSERT_EQ(g, 2 * kMiB);
  const size_t n = 2 * g;
  CUmemGenericAllocationHandle h = 0, retained = 0;
  CUdeviceptr va = 0;
  CU_OK(api_->mem_create(&h, n, &prop, 0));
  CU_OK(api_->mem_address_reserve(&va, n, 0, 0, 0));
  CU_OK(api_->mem_map(va, n, 0, h, 0));
  auto in = pattern(n, 5);
  EXPECT_EQ(api_->memcpy(va, host_address(in.data()), n), CUDA_ERROR_INVALID_VALUE);
  CUmemAccessDesc access{{CU_MEM_LOCATION_TYPE_DEVICE, 0}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  CU_OK(api_->mem_set_access(va, n, &access, 1));
  CU_OK(api_->memcpy(va, host_address(in.data()), n));
  EXPECT_EQ(memory_type(va + n - 1), CU_MEMORYTYPE_DEVICE);
  CU_OK(api_->mem_retain_allocation_handle(&retained, reinterpret_cast<void*>(va + 100)));
  EXPECT_EQ(retained, h);
  CU_OK(api_->mem_release(retained));
  int fd = -1;
  CU_OK(api_->mem_export_to_shareable_handle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  ASSERT_GE(fd, 0);
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {  // imports the fd it inherited, as a peer would after SCM_RIGHTS
    CUmemGenericAllocationHandle imported = 0;
    CUdeviceptr p = 0;
    void* shareable = reinterpret_cast<void*>(static_cast<uintptr_t>(fd));
    CHILD_CHECK(api_->mem_import_from_shareable_handle(
                    &imported, shareable, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) == 0,
                10);
    CHILD_CHECK(api_->mem_address_reserve(&p, n, 0, 0, 0) == CUDA_SUCCESS, 11);
    CHILD_CHECK(api_->mem_map(p, n, 0, imported, 0) == CUDA_SUCCESS, 12);
    CHILD_CHECK(api_->mem_set_access(p, n, &access, 1) == CUDA_SUCCESS, 13);
    std::vector<unsigned char> out(n);
    CHILD_CHECK(api_->memcpy(host_address(out.data()), p, n) == CUDA_SUCCESS, 14);
    CHILD_CHECK(out == in, 15);
    CHILD_CHECK(api_->mem_unmap(p, n) == CUDA_SUCCESS, 16);
    CHILD_CHECK(api_->mem_release(imported) == CUDA_SUCCESS, 17);
    CHILD_CHECK(api_->mem_address_free(p, n) == CUDA_SUCCESS, 18);
    ::_exit(0);
  }
  EXPECT_EQ(exit_status(pid), 0);
  ::close(fd);
  CU_OK(api_->mem_unmap(va, n));
  CU_OK(api_->mem_address_free(va, n));
  CU_OK(api_->mem_release(h));
}

TEST_F(FakeCuda, DmabufIsTheAllocationsMemory) {
  const size_t n = 4 * 4096;
  auto in = pattern(n, 9);
  CUdeviceptr d = 0;
  CU_OK(api_->mem_alloc(&d, n));
  CU_OK(api_->memcpy(d, host_address(in.data()), n));
  int fd = -1;
  EXPECT_EQ(api_->mem_get_handle_for_address_range(&fd, d + 100, 4096,
                                                   CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0),
            CUDA_ERROR_INVALID_VALUE);
  CU_OK(api_->mem_get_handle_for_address_range(&fd, d + 4096, 4096,
                                               CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0));
  std::vector<unsigned char> out(4096);
  ASSERT_EQ(::pread(fd, out.data(), 4096, 4096), 4096);  // at the range's offset
  EXPECT_TRUE(std::equal(out.begin(), out.end(), in.begin() + 4096));
  ::close(fd);
  CU_OK(api_->mem_free(d));
}

}  // namespace
