// ferry_fake_cuda: a simulated CUDA driver over host memory, for tests on machines without a
// GPU. It exports every driver function transport/cuda/cuda_api.cpp binds, under the versioned
// names <cuda.h> gives them; tests load it with FERRY_CUDA_DRIVER=<path of this library>.
//
// What it simulates, and how (per process; several processes may use it at once):
// - Devices: FERRY_FAKE_CUDA_DEVICES of them (default 2, at most 8; "0": cuInit fails with
//   CUDA_ERROR_NO_DEVICE). Every other call fails with CUDA_ERROR_NOT_INITIALIZED before cuInit
//   (cuGetErrorString/Name excepted). Driver version 13000. Names "ferry fake GPU N", PCI bus
//   ids 0000:0M:00.0 (M = N + 1); unified addressing, VMM, POSIX fd handles, dmabuf and
//   GPUDirect RDMA are reported supported, attributes without a value here read 0.
// - Contexts: one primary context per device, refcounted by cuDevicePrimaryCtxRetain/Release;
//   the current context is per thread. Calls that need one (allocation, copies, memset, streams,
//   host functions, IPC, pinned host memory) fail with CUDA_ERROR_INVALID_CONTEXT when the
//   calling thread has none, or when its primary context has been released to zero.
// - Device memory lives at addresses inside one PROT_NONE reservation of 64 GiB per process, so
//   a CPU access to a device address crashes. The bytes are in a memfd per allocation, mapped
//   elsewhere. Addresses are reused after a free (first fit); buffer ids never are.
// - Copies (cuMemcpy, cuMemcpyAsync, cuMemsetD8): an address inside the reservation must lie
//   wholly in one live, accessible mapping (else CUDA_ERROR_INVALID_VALUE); any other address is
//   host memory, used as is. FERRY_FAKE_CUDA_COPY_US (read at cuInit) delays every copy and
//   memset. ferry_fake_cuda_counters() reads this process's totals.
// - Streams: a worker thread per stream runs its operations in order; stream 0 (and the legacy
//   and per-thread handles) runs them on the caller. Async addresses are checked when the copy
//   runs; a failure is sticky: the stream's later copies and memsets are skipped, its host
//   functions still run, and every later cuStreamSynchronize and cuStreamQuery returns the error.
//   cuStreamDestroy returns once the queued work has run.
// - Legacy IPC: a handle names the exporter's pid, memfd number and the memfd's inode; the
//   importer opens /proc/<pid>/fd/<fd> and refuses (CUDA_ERROR_INVALID_HANDLE) a file that is
//   gone or is another one (the buffer was freed). Opening a handle from the same process fails
//   with CUDA_ERROR_INVALID_CONTEXT; opening one twice returns the same address, refcounted.
// - VMM: granularity 2 MiB; cuMemCreate makes a memfd, exported as a dup of it (POSIX fd);
//   cuMemMap maps a handle into a range from cuMemAddressReserve; the range is not accessible
//   until cuMemSetAccess (PROT_READ allows reads only). The address hint of
//   cuMemAddressReserve is ignored.
// - cuMemGetHandleForAddressRange (dmabuf): a dup of the whole allocation's memfd; the range's
//   bytes are at file offset (ptr - allocation base), not at offset 0. The range may end with
//   the page of the allocation's last byte, but may not take in pages another allocation shares.
// - A forked child keeps its parent's state (unlike the real driver, which cannot be used after
//   fork): the parent's device memory is shared with it, its streams are gone.

#include <cuda.h>
#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#define FAKE_API extern "C" __attribute__((visibility("default")))

// cuda.h's opaque handle types, completed here.
struct CUctx_st {
  int device = 0;
  std::atomic<int> refs{0};
};

struct CUstream_st {
  struct Op {
    bool always;  // a host function: runs even after the stream failed
    std::function<CUresult()> run;
  };
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Op> queue;
  bool busy = false;
  bool stop = false;
  CUresult error = CUDA_SUCCESS;
  std::thread worker;

  void loop() {
    std::unique_lock lock(mu);
    for (;;) {
      cv.wait(lock, [&] { return stop || !queue.empty(); });
      if (queue.empty()) return;  // stopped and drained
      Op op = std::move(queue.front());
      queue.pop_front();
      bool skip = error != CUDA_SUCCESS && !op.always;
      busy = true;
      lock.unlock();
      CUresult r = skip ? CUDA_SUCCESS : op.run();
      lock.lock();
      busy = false;
      if (r != CUDA_SUCCESS && error == CUDA_SUCCESS) error = r;
      cv.notify_all();
    }
  }
};

namespace {

constexpr size_t kMiB = size_t{1} << 20;
constexpr size_t kGranularity = 2 * kMiB;
constexpr size_t kSmallAlign = 512;
constexpr size_t kReserve = size_t{64} << 30;
constexpr int kMaxDevices = 8;
constexpr uint32_t kIpcMagic = 0x46434950;  // "FCIP"

size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }
size_t page_size() { return static_cast<size_t>(::sysconf(_SC_PAGESIZE)); }

// The bytes of one allocation: a memfd and its mapping at a host address.
struct Backing {
  int fd = -1;
  size_t size = 0;
  char* host = nullptr;
  dev_t dev = 0;
  ino_t ino = 0;
  int device = 0;
  Backing() = default;
  Backing(const Backing&) = delete;
  Backing& operator=(const Backing&) = delete;
  ~Backing() {
    if (host != nullptr) ::munmap(host, size);
    if (fd >= 0) ::close(fd);
  }
};
using BackingPtr = std::shared_ptr<Backing>;

enum class Kind { alloc, ipc, vmm };

// A device address range with bytes behind it.
struct Mapping {
  size_t size = 0;
  BackingPtr backing;
  size_t offset = 0;  // into the backing
  Kind kind = Kind::alloc;
  unsigned long long id = 0;  // CU_POINTER_ATTRIBUTE_BUFFER_ID
  int device = 0;
  CUmemAccess_flags access = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUmemGenericAllocationHandle handle = 0;  // vmm
  unsigned long long handle_types = 0;      // vmm: those requested at cuMemCreate
  int ipc_refs = 0;                         // ipc
  pid_t ipc_pid = 0;                        // ipc
};

struct HostRange {
  size_t size = 0;
  bool allocated = false;  // cuMemHostAlloc, else cuMemHostRegister
  unsigned long long id = 0;
  int device = 0;
};

struct VmmHandle {
  BackingPtr backing;
  int refs = 0;
  unsigned long long types = 0;  // requested shareable handle types
};

struct IpcWire {
  uint32_t magic;
  int32_t pid;
  int32_t fd;
  int32_t device;
  uint64_t size;
  uint64_t dev;
  uint64_t ino;
  uint64_t id;
};
static_assert(sizeof(IpcWire) <= CU_IPC_HANDLE_SIZE);

struct State {
  std::mutex mu;
  std::atomic<bool> inited{false};
  int devices = 0;
  unsigned copy_us = 0;
  uintptr_t base = 0, end = 0;            // the PROT_NONE reservation
  std::map<uintptr_t, size_t> space;      // device address space in use
  std::map<uintptr_t, size_t> reserved;   // cuMemAddressReserve ranges (also in space)
  std::map<uintptr_t, Mapping> mappings;  // device ranges with bytes
  std::map<uintptr_t, HostRange> host;    // pinned host memory
  std::map<CUmemGenericAllocationHandle, VmmHandle> handles;
  std::set<CUstream_st*> streams;
  unsigned long long next_id = 0;
  CUmemGenericAllocationHandle next_handle = 0x1000;
  CUctx_st ctxs[kMaxDevices];
  std::atomic<unsigned long long> counters[4] = {};    // h2d, d2h, d2d bytes; copies
  std::atomic<unsigned long long> ipc_counts[2] = {};  // handles opened, closed
  std::atomic<unsigned long long> vmm_imports{0};      // cuMemImportFromShareableHandle
};

// Never destroyed: stream threads and late callers may outlive static destructors.
State& st() {
  static State* s = new State;
  return *s;
}

thread_local CUctx_st* t_current = nullptr;

// The entry with the greatest key <= a whose range contains a, or end().
template <class Map, class SizeOf>
auto containing(Map& m, uintptr_t a, SizeOf size_of) {
  auto it = m.upper_bound(a);
  if (it == m.begin()) return m.end();
  --it;
  return a - it->first < size_of(it->second) ? it : m.end();
}
auto containing_mapping(State& s, uintptr_t a) {
  return containing(s.mappings, a, [](const Mapping& m) { return m.size; });
}
auto containing_host(State& s, uintptr_t a) {
  return containing(s.host, a, [](const HostRange& h) { return h.size; });
}
auto containing_reserved(State& s, uintptr_t a) {
  return containing(s.reserved, a, [](size_t n) { return n; });
}

bool is_device_address(const State& s, uintptr_t a) { return a >= s.base && a < s.end; }

// First fit in the reservation; 0 when full.
uintptr_t take_space(State& s, size_t size, size_t align) {
  uintptr_t at = align_up(s.base, align);
  for (const auto& [start, len] : s.space) {
    if (at + size <= start) break;
    at = std::max(at, align_up(start + len, align));
  }
  if (at + size > s.end) return 0;
  s.space.emplace(at, size);
  return at;
}

uintptr_t take_space_for(State& s, size_t size) {
  size_t align = size >= kGranularity ? kGranularity : kSmallAlign;
  return take_space(s, align_up(size, align), align);
}

CUresult ready() {
  return st().inited.load(std::memory_order_acquire) ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
}

CUresult need_context() {
  if (CUresult r = ready(); r != CUDA_SUCCESS) return r;
  if (t_current == nullptr || t_current->refs.load() == 0) return CUDA_ERROR_INVALID_CONTEXT;
  return CUDA_SUCCESS;
}

bool valid_device(CUdevice d) { return d >= 0 && d < st().devices; }

// Maps an open memfd of ours; takes the fd. Null when it is not one.
BackingPtr adopt(int fd) {
  auto b = std::make_shared<Backing>();
  b->fd = fd;
  char link[64], target[256];
  std::snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  ssize_t n = ::readlink(link, target, sizeof target - 1);
  if (n <= 0) return nullptr;
  target[n] = '\0';
  struct stat info {};
  if (std::sscanf(target, "/memfd:ferry-fake-cuda-dev%d", &b->device) != 1 ||
      ::fstat(fd, &info) != 0 || info.st_size <= 0)
    return nullptr;
  b->size = static_cast<size_t>(info.st_size);
  b->dev = info.st_dev;
  b->ino = info.st_ino;
  void* p = ::mmap(nullptr, b->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return nullptr;
  b->host = static_cast<char*>(p);
  return b;
}

BackingPtr make_backing(size_t size, int device) {
  char name[64];
  std::snprintf(name, sizeof name, "ferry-fake-cuda-dev%d", device);
  int fd = ::memfd_create(name, MFD_CLOEXEC);
  if (fd < 0) return nullptr;
  if (::ftruncate(fd, static_cast<off_t>(align_up(size, page_size()))) != 0) {
    ::close(fd);
    return nullptr;
  }
  return adopt(fd);
}

int dup_fd(int fd) { return ::fcntl(fd, F_DUPFD_CLOEXEC, 0); }

// Under s.mu: the host bytes of [a, a + n). A device address must lie wholly in one mapping
// that allows the access; any other address is host memory.
CUresult translate(State& s, uintptr_t a, size_t n, bool write, char** out, BackingPtr* keep) {
  if (!is_device_address(s, a)) {
    *out = reinterpret_cast<char*>(a);
    return CUDA_SUCCESS;
  }
  auto it = containing_mapping(s, a);
  if (it == s.mappings.end()) return CUDA_ERROR_INVALID_VALUE;
  const Mapping& m = it->second;
  if (n > m.size - (a - it->first)) return CUDA_ERROR_INVALID_VALUE;
  bool allowed = write ? m.access == CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                       : (m.access & CU_MEM_ACCESS_FLAGS_PROT_READ) != 0;
  if (!allowed) return CUDA_ERROR_INVALID_VALUE;
  *out = m.backing->host + m.offset + (a - it->first);
  *keep = m.backing;
  return CUDA_SUCCESS;
}

void copy_delay() {
  if (unsigned us = st().copy_us; us != 0)
    std::this_thread::sleep_for(std::chrono::microseconds(us));
}

CUresult do_copy(CUdeviceptr dst, CUdeviceptr src, size_t n) {
  if (n == 0) return CUDA_SUCCESS;
  State& s = st();
  char* to = nullptr;
  char* from = nullptr;
  BackingPtr keep_to, keep_from;  // the bytes stay while the copy runs
  {
    std::lock_guard lock(s.mu);
    if (CUresult r = translate(s, dst, n, true, &to, &keep_to); r != CUDA_SUCCESS) return r;
    if (CUresult r = translate(s, src, n, false, &from, &keep_from); r != CUDA_SUCCESS) return r;
  }
  copy_delay();
  std::memmove(to, from, n);
  if (keep_to && keep_from)
    s.counters[2] += n;
  else if (keep_to)
    s.counters[0] += n;
  else if (keep_from)
    s.counters[1] += n;
  ++s.counters[3];
  return CUDA_SUCCESS;
}

CUresult do_memset(CUdeviceptr dst, unsigned char value, size_t n) {
  if (n == 0) return CUDA_SUCCESS;
  State& s = st();
  char* to = nullptr;
  BackingPtr keep;
  {
    std::lock_guard lock(s.mu);
    if (CUresult r = translate(s, dst, n, true, &to, &keep); r != CUDA_SUCCESS) return r;
  }
  copy_delay();
  std::memset(to, value, n);
  return CUDA_SUCCESS;
}

bool is_null_stream(CUstream s) {
  return s == nullptr || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD;
}

// Runs op now (stream 0) or queues it on the stream's worker.
CUresult submit(CUstream stream, bool always, std::function<CUresult()> op) {
  if (is_null_stream(stream)) return op();
  {
    std::lock_guard lock(st().mu);
    if (st().streams.count(stream) == 0) return CUDA_ERROR_INVALID_HANDLE;
  }
  std::lock_guard lock(stream->mu);
  stream->queue.push_back({always, std::move(op)});
  stream->cv.notify_all();
  return CUDA_SUCCESS;
}

struct ErrorText {
  CUresult code;
  const char* name;
  const char* text;
};
constexpr ErrorText kErrors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_MAP_FAILED, "CUDA_ERROR_MAP_FAILED", "mapping of buffer object failed"},
    {CUDA_ERROR_ALREADY_MAPPED, "CUDA_ERROR_ALREADY_MAPPED", "resource already mapped"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
     "part or all of the requested memory range is already mapped"},
    {CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
     "pointer does not correspond to a registered memory region"},
    {CUDA_ERROR_NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_OPERATING_SYSTEM, "CUDA_ERROR_OPERATING_SYSTEM",
     "OS call failed or operation not supported on this OS"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

const ErrorText* find_error(CUresult code) {
  for (const ErrorText& e : kErrors)
    if (e.code == code) return &e;
  return nullptr;
}

}  // namespace

// ---- Driver, devices, contexts ----

FAKE_API CUresult CUDAAPI cuGetErrorString(CUresult error, const char** text) {
  if (text == nullptr) return CUDA_ERROR_INVALID_VALUE;
  const ErrorText* e = find_error(error);
  *text = e != nullptr ? e->text : nullptr;
  return e != nullptr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

FAKE_API CUresult CUDAAPI cuGetErrorName(CUresult error, const char** text) {
  if (text == nullptr) return CUDA_ERROR_INVALID_VALUE;
  const ErrorText* e = find_error(error);
  *text = e != nullptr ? e->name : nullptr;
  return e != nullptr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

FAKE_API CUresult CUDAAPI cuInit(unsigned int flags) {
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  State& s = st();
  std::lock_guard lock(s.mu);
  if (s.inited) return CUDA_SUCCESS;
  int devices = 2;
  if (const char* e = std::getenv("FERRY_FAKE_CUDA_DEVICES"); e != nullptr && *e != '\0')
    devices = std::clamp(std::atoi(e), 0, kMaxDevices);
  if (devices == 0) return CUDA_ERROR_NO_DEVICE;
  if (const char* e = std::getenv("FERRY_FAKE_CUDA_COPY_US"); e != nullptr)
    s.copy_us = static_cast<unsigned>(std::strtoul(e, nullptr, 10));
  void* p = ::mmap(nullptr, kReserve + kGranularity, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  s.base = align_up(reinterpret_cast<uintptr_t>(p), kGranularity);
  s.end = s.base + kReserve;
  for (int d = 0; d < kMaxDevices; ++d) s.ctxs[d].device = d;
  s.devices = devices;
  // A child forked while another thread holds the lock would never get it.
  ::pthread_atfork([] { st().mu.lock(); }, [] { st().mu.unlock(); }, [] { st().mu.unlock(); });
  s.inited.store(true, std::memory_order_release);
  return CUDA_SUCCESS;
}

FAKE_API CUresult CUDAAPI cuDriverGetVersion(int* version) {
  if (version == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *version = 13000;  // the real one answers before cuInit too
  return CUDA_SUCCESS;
}

FAKE_API CUresult CUDAAPI cuDeviceGetCount(int* count) {
  if (CUresult r = ready(); r != CUDA_SUCCESS) return r;
  if (count == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *count = st().devices;
  return CUDA_SUCCESS;
}

FAKE_API CUresult CUDAAPI cuDeviceGet(CUdevice* device, int ordinal) {
  if (CUresult r = ready(); r != CUDA_SUCCESS) return r;
  if (device == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!valid_device(ordinal)) return CUDA_ERROR_INVALID_DEVICE;
  *device = ordinal;
  return CUDA_SUCCESS;
}

FAKE_API CUresult CUDAAPI cuDeviceGetName(char* name, int len, CUdevice device) {
  if (CUresult r = ready(); r != CUDA_SUCCESS) return r;
  if (!valid_device(device)) return CUDA_ERROR_INVALID_DEVICE;
  if (name == nullptr || len <= 0) return CUDA_ERROR_INVALID_VALUE;
  std::snprintf(name, static_cast<size_t>(len), "ferry fake GPU %d", device);
  return CUDA_SUCCESS;
}

FAKE_API CUresult CUDAAPI cuDeviceGetPCIBusId(char* id, int len, CUdevice device) {
  if (CUresult r = ready(); r != CUDA_SUCCESS) return r;
  if (!valid_device(device)) return CUDA_ERROR_INVALID_DEVICE;
  if (id == nullptr || len < 13) return CUDA_ERROR_INVALID_VALUE;
  std::snprintf(id, static_cast<size_t>(len), "0000:%02x:00.0", device + 1);
  return CUDA_SUCCESS;
}

FAKE_API CUresult CUDAAPI cuDeviceGetAttribute(int* value, CUdevice_attribute attr,
                                               CUdevice device) {
  if (CUresult r = ready(); r != CUDA_SUCCESS) return r;
  if (!valid_device(device)) return CUDA_ERROR_INVALID_DEVICE;
  if (value == nullptr) return CUDA_ERROR_INVALID_VALUE;
  switch (attr) {
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING:
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY:
    case CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED:
      *value = 1;
      break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR:
      *value = 9;
      break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT:
      *value = 132;
      break;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE:
      *value = 32;
      break;
    case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID:
      *value = device + 1;
      break;
    default:
      *value = 0;
  }
  return CUDA_SUCCESS;
}

FAKE_API CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext* ctx, CUdevice device) {
  if (CUresult r = ready(); r != CUDA_SUCCESS) return r;
  if (!valid_device(device)) return CUDA_ERROR_INVALID_DEVICE;
  if (ctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
  ++st().ctxs[device].refs;
  *ctx = &st().ctxs[device];
  return CUDA_SUCCESS;
}

FAKE_API CUresult CUDAAPI cuDevicePrimaryCtxRelease(CUdevice device) {
  if (CUresult r = ready(); r != CUDA_SUCCESS) return r;
  if (!valid_device(device)) return CUDA_ERROR_INVALID_DEVICE;
  std::atomic<int>& refs = st().ctxs[device].refs;
  for (int n = refs.load(); n > 0;)
    if (refs.compare_exchange_weak(n, n - 1)) return CUDA_SUCCESS;
  return CUDA_ERROR_INVALID_CONTEXT;
}

FAKE_API CUresult CUDAAPI cuCtxSetCurrent(CUcontext ctx) {
  if (CUresult r = ready(); r != CUDA_SUCCESS) return r;
  State& s = st();
  if (ctx != nullptr && (ctx < s.ctxs || ctx >= s.ctxs + s.devices))
    return CUDA_ERROR_INVALID_CONTEXT;
  t_current = ctx;
  return CUDA_SUCCESS;
}

FAKE_API CUresult CUDAAPI cuCtxGetCurrent(CUcontext* ctx) {
  if (CUresult r = ready(); r != CUDA_SUCCESS) return r;
  if (ctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *ctx = t_current;
  return CUDA_SUCCESS;
}

// ---- Pointers ----

namespace {

struct PointerInfo {
  unsigned type = 0;
  int device = 0;
  CUdeviceptr start = 0;
  size_t size = 0;
  unsigned long long id = 0;
  CUcontext ctx = nullptr;
};

PointerInfo lookup(State& s, uintptr_t a) {
  PointerInfo info;
  if (is_device_address(s, a)) {
    auto it = containing_mapping(s, a);
    if (it == s.mappings.end()) return info;
    const Mapping& m = it->second;
    info = {CU_MEMORYTYPE_DEVICE,
            m.device,
            it->first,
            m.size,
            m.id,
            m.kind == Kind::vmm ? nullptr : &s.ctxs[m.device]};
  } else if (auto it = containing_host(s, a); it != s.host.end()) {
    const HostRange& h = it->second;
    info = {CU_MEMORYTYPE_HOST, h.device, it->first, h.size, h.id, &s.ctxs[h.device]};
  }
  return info;
}

template <class T>
void put(void* data, T value) {
  std::memcpy(data, &value, sizeof value);
}

}  // namespace

FAKE_API CUresult CUDAAPI cuPointerGetAttributes(unsigned int count, CUpointer_attribute* attrs,
                                                 void** data, CUdeviceptr ptr) {
  if (CUresult r = ready(); r != CUDA_SUCCESS) return r;
  if (count == 0 || attrs == nullptr || data == nullptr) return CUDA_ERROR_INVALID_VALUE;
  PointerInfo info;
  {
    std::lock_guard lock(st().mu);
    info = lookup(st(), ptr);
  }
  for (unsigned i = 0; i < count; ++i) {
    if (data[i] == nullptr) return CUDA_ERROR_INVALID_VALUE;
    switch (attrs[i]) {
      case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
        put(data[i], info.type);
        break;
      case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
        put(data[i], info.device);
        break;
      case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
        put(data[i], info.start);
        break;
      case CU_POINTER_ATTRIBUTE_RANGE_SIZE:
        put(data[i], info.size);
        break;
      case CU_POINTER_ATTRIBUTE_BUFFER_ID:
        put(data[i], info.id);
        break;
      case CU_POINTER_ATTRIBUTE_IS_MANAGED:
        put(data[i], 0);
        break;
      case CU_POINTER_ATTRIBUTE_CONTEXT:
        put(data[i], info.ctx);
        break;
      case CU_POINTER_ATTRIBUTE_MAPPED:
        put(data[i], info.type != 0 ? 1 : 0);
        break;
      default:
        return CUDA_ERROR_INVALID_VALUE;  // not simulated
    }
  }
  return CUDA_SUCCESS;
}

FAKE_API CUresult CUDAAPI cuMemGetAddressRange(CUdeviceptr* base, size_t* size, CUdeviceptr ptr) {
  if (CUresult r = ready(); r != CUDA_SUCCESS) return r;
  PointerInfo info;
  {
    std::lock_guard lock(st().mu);
    info = lookup(st(), ptr);
  }
  if (info.type == 0) return CUDA_ERROR_NOT_FOUND;
  if (base != nullptr) *base = info.start;
  if (size != nullptr) *size = info.size;
  return CUDA_SUCCESS;
}

// ---- Device and pinned host memory ----

FAKE_API CUresult CUDAAPI cuMemAlloc(CUdeviceptr* ptr, size_t size) {
  if (CUresult r = need_context(); r != CUDA_SUCCESS) return r;
  if (ptr == nullptr || size == 0) return CUDA_ERROR_INVALID_VALUE;
  int device = t_current->device;
  BackingPtr b = make_backing(size, device);
  if (!b) return CUDA_ERROR_OUT_OF_MEMORY;
  State& s = st();
  std::lock_guard lock(s.mu);
  uintptr_t at = take_space_for(s, size);
  if (at == 0) return CUDA_ERROR_OUT_OF_MEMORY;
  Mapping m;
  m.size = size;
  m.backing = std::move(b);
  m.kind = Kind::alloc;
  m.id = ++s.next_id;
  m.device = device;
  s.mappings.emplace(at, std::move(m));
  *ptr = at;
  return CUDA_SUCCESS;
}

FAKE_API CUresult CUDAAPI cuMemFree(CUdeviceptr ptr) {
  if (CUresult r = need_context(); r != CUDA_SUCCESS) return r;
  State& s = st();
  BackingPtr last;  // unmapped outside the lock
  std::lock_guard lock(s.mu);
  auto it = s.mappings.find(ptr);
  if (it == s.mappings.end() || it->second.kind != Kind::alloc) return CUDA_ERROR_INVALID_VALUE;
  last = std::move(it->second.backing);
  s.mappings.erase(it);
  s.space.erase(ptr);
  return CUDA_SUCCESS;
}

FAKE_API CUresult CUDAAPI cuMemHostAlloc(void** ptr, size_t size, unsigned int /*flags*/) {
  if (CUresult r = need_context(); r != CUDA_SUCCESS) return r;
  if (ptr == nullptr || size == 0) return CUDA_ERROR_INVALID_VALUE;
  void* p = ::mmap(nullptr, align_up(size, page_size()), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  State& s = st();
  std::lock_guard lock(s.mu);
  s.host[reinterpret_cast<uintptr_t>(p)] = {size, true, ++s.next_id, t_current->device};
  *ptr = p;
  return CUDA_SUCCESS;
}

FAKE_API CUresult CUDAAPI cuMemFreeHost(void* ptr) {
  if (CUresult r = ready(); r != CUDA_SUCCESS) return r;
  State& s = st();
  std::lock_guard lock(s.mu);
  auto it = s.host.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == s.host.end() || !it->second.allocated) return CUDA_ERROR_INVALID_VALUE;
  ::munmap(ptr, align_up(it->second.size, page_size()));
  s.host.erase(it);
  return CUDA_SUCCESS;
}

FAKE_API CUresult CUDAAPI cuMemHostRegister(void* ptr, size_t size, unsigned int /*flags*/) {
  if (CUresult r = need_context(); r != CUDA_SUCCESS) return r;
  State& s = st();
  auto a = reinterpret_cast<uintptr_t>(ptr);
  if (ptr == nullptr || size == 0 || is_device_address(s, a)) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard lock(s.mu);
  auto next = s.host.lower_bound(a);
  if (containing_host(s, a) != s.host.end() || (next != s.host.end() && next->first < a + size))
    return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
  s.host[a] = {size, false, ++s.next_id, t_current->device};
  return CUDA_SUCCESS;
}

FAKE_API CUresult CUDAAPI cuMemHostUnregister(void* ptr) {
  if (CUresult r = ready(); r != CUDA_SUCCESS) return r;
  State& s = st();
  std::lock_guard lock(s.mu);
  auto it = s.host.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == s.host.end() || it->second.allocated) return CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
  s.host.erase(it);
  return CUDA_SUCCESS;
}

// ---- Copies and streams ----

FAKE_API CUresult CUDAAPI cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t size) {
  if (CUresult r = need_context(); r != CUDA_SUCCESS) return r;
  return do_copy(dst, src, size);
}

FAKE_API CUresult CUDAAPI cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t size,
                                        CUstream stream) {
  if (CUresult r = need_context(); r != CUDA_SUCCESS) return r;
  return submit(stream, false, [=] { return do_copy(dst, src, size); });
}

FAKE_API CUresult CUDAAPI cuMemsetD8(CUdeviceptr dst, unsigned char value, size_t size) {
  if (CUresult r = need_context(); r != CUDA_SUCCESS) return r;
  return do_memset(dst, value, size);
}

FAKE_API CUresult CUDAAPI cuLaunchHostFunc(CUstream stream, CUhostFn fn, void* user_data) {
  if (CUresult r = need_context(); r != CUDA_SUCCESS) return r;
  if (fn == nullptr) return CUDA_ERROR_INVALID_VALUE;
  return submit(stream, true, [=] {
    fn(user_data);
    return CUDA_SUCCESS;
  });
}

FAKE_API CUresult CUDAAPI cuStreamCreate(CUstream* stream, unsigned int flags) {
  if (CUresult r = need_context(); r != CUDA_SUCCESS) return r;
  if (stream == nullptr || (flags & ~static_cast<unsigned>(CU_STREAM_NON_BLOCKING)) != 0)
    return CUDA_ERROR_INVALID_VALUE;
  auto* s = new CUstream_st;
  s->worker = std::thread([s] { s->loop(); });
  std::lock_guard lock(st().mu);
  st().streams.insert(s);
  *stream = s;
  return CUDA_SUCCESS;
}

FAKE_API CUresult CUDAAPI cuStreamSynchronize(CUstream stream) {
  if (is_null_stream(stream)) return need_context();  // its work ran on the callers
  if (CUresult r = ready(); r != CUDA_SUCCESS) return r;
  {
    std::lock_guard lock(st().mu);
    if (st().streams.count(stream) == 0) return CUDA_ERROR_INVALID_HANDLE;
  }
  std::unique_lock lock(stream->mu);
  stream->cv.wait(lock, [&] { return stream->queue.empty() && !stream->busy; });
  return stream->error;
}

// The stream's sticky error, else whether its queued work has all run.
FAKE_API CUresult CUDAAPI cuStreamQuery(CUstream stream) {
  if (is_null_stream(stream)) return need_context();  // its work ran on the callers
  if (CUresult r = ready(); r != CUDA_SUCCESS) return r;
  {
    std::lock_guard lock(st().mu);
    if (st().streams.count(stream) == 0) return CUDA_ERROR_INVALID_HANDLE;
  }
  std::lock_guard lock(stream->mu);
  if (stream->error != CUDA_SUCCESS) return stream->error;
  return stream->queue.empty() && !stream->busy ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

FAKE_API CUresult CUDAAPI cuStreamDestroy(CUstream stream) {
  if (CUresult r = ready(); r != CUDA_SUCCESS) return r;
  if (is_null_stream(stream)) return CUDA_ERROR_INVALID_HANDLE;
  {
    std::lock_guard lock(st().mu);
    if (st().streams.erase(stream) == 0) return CUDA_ERROR_INVALID_HANDLE;
  }
  {
    std::lock_guard lock(stream->mu);
    stream->stop = true;
    stream->cv.notify_all();
  }
  if (stream->worker.get_id() == std::this_thread::get_id()) {
    stream->worker.detach();  // from its own host function (not allowed in CUDA): leaked
    return CUDA_SUCCESS;
  }
  stream->worker.join();
  delete stream;
  return CUDA_SUCCESS;
}

// ---- Legacy IPC ----

FAKE_API CUresult CUDAAPI cuIpcGetMemHandle(CUipcMemHandle* handle, CUdeviceptr ptr) {
  if (CUresult r = need_context(); r != CUDA_SUCCESS) return r;
  if (handle == nullptr) return CUDA_ERROR_INVALID_VALUE;
  State& s = st();
  std::lock_guard lock(s.mu);
  auto it = containing_mapping(s, ptr);
  if (it == s.mappings.end() || it->second.kind != Kind::alloc) return CUDA_ERROR_INVALID_VALUE;
  const Mapping& m = it->second;
  IpcWire w{kIpcMagic, ::getpid(),     m.backing->fd,  m.device,
            m.size,    m.backing->dev, m.backing->ino, m.id};
  std::memset(handle, 0, sizeof *handle);
  std::memcpy(handle->reserved, &w, sizeof w);
  return CUDA_SUCCESS;
}

FAKE_API CUresult CUDAAPI cuIpcOpenMemHandle(CUdeviceptr* ptr, CUipcMemHandle handle,
                                             unsigned int /*flags*/) {
  if (CUresult r = need_context(); r != CUDA_SUCCESS) return r;
  if (ptr == nullptr) return CUDA_ERROR_INVALID_VALUE;
  IpcWire w;
  std::memcpy(&w, handle.reserved, sizeof w);
  if (w.magic != kIpcMagic || w.size == 0) return CUDA_ERROR_INVALID_HANDLE;
  if (w.pid == ::getpid()) return CUDA_ERROR_INVALID_CONTEXT;
  State& s = st();
  {
    std::lock_guard lock(s.mu);
    for (auto& [start, m] : s.mappings)
      if (m.kind == Kind::ipc && m.ipc_pid == w.pid && m.backing->ino == w.ino &&
          m.backing->dev == w.dev) {
        ++m.ipc_refs;
        ++s.ipc_counts[0];
        *ptr = start;
        return CUDA_SUCCESS;
      }
  }
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/fd/%d", w.pid, w.fd);
  int fd = ::open(path, O_RDWR | O_CLOEXEC);
  if (fd < 0) return CUDA_ERROR_INVALID_HANDLE;  // the exporter is gone, or freed it
  struct stat info {};
  if (::fstat(fd, &info) != 0 || info.st_dev != w.dev || info.st_ino != w.ino) {
    ::close(fd);  // the fd number now names another file: the buffer was freed
    return CUDA_ERROR_INVALID_HANDLE;
  }
  BackingPtr b = adopt(fd);
  if (!b || b->size < w.size) return CUDA_ERROR_INVALID_HANDLE;
  std::lock_guard lock(s.mu);
  uintptr_t at = take_space_for(s, w.size);
  if (at == 0) return CUDA_ERROR_OUT_OF_MEMORY;
  Mapping m;
  m.size = w.size;
  m.backing = std::move(b);
  m.kind = Kind::ipc;
  m.id = ++s.next_id;
  m.device = w.device;
  m.ipc_refs = 1;
  m.ipc_pid = w.pid;
  s.mappings.emplace(at, std::move(m));
  ++s.ipc_counts[0];
  *ptr = at;
  return CUDA_SUCCESS;
}

FAKE_API CUresult CUDAAPI cuIpcCloseMemHandle(CUdeviceptr ptr) {
  if (CUresult r = need_context(); r != CUDA_SUCCESS) return r;
  State& s = st();
  BackingPtr last;
  std::lock_guard lock(s.mu);
  auto it = s.mappings.find(ptr);
  if (it == s.mappings.end() || it->second.kind != Kind::ipc) return CUDA_ERROR_INVALID_VALUE;
  ++s.ipc_counts[1];
  if (--it->second.ipc_refs > 0) return CUDA_SUCCESS;
  last = std::move(it->second.backing);
  s.mappings.erase(it);
  s.space.erase(ptr);
  return CUDA_SUCCESS;
}

// ---- Virtual memory management ----

FAKE_API CUresult CUDAAPI cuMemGetAllocationGranularity(size_t* granularity,
                                                        const CUmemAllocationProp* prop,
                                                        CUmemAllocationGranularity_flags) {
  if (CUresult r = ready(); r != CUDA_SUCCESS) return r;
  if (granularity == nullptr || prop == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *granularity = kGranularity;
  return CUDA_SUCCESS;
}

FAKE_API CUresult CUDAAPI cuMemCreate(CUmemGenericAllocationHandle* handle, size_t size,
                                      const CUmemAllocationProp* prop, unsigned long long flags) {
  if (CUresult r = ready(); r != CUDA_SUCCESS) return r;
  if (handle == nullptr || prop == nullptr || flags != 0 || size == 0 || size % kGranularity != 0 ||
      prop->type != CU_MEM_ALLOCATION_TYPE_PINNED ||
      prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
    return CUDA_ERROR_INVALID_VALUE;
  if (!valid_device(prop->location.id)) return CUDA_ERROR_INVALID_DEVICE;
  if ((prop->requestedHandleTypes & ~CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) != 0)
    return CUDA_ERROR_NOT_SUPPORTED;
  BackingPtr b = make_backing(size, prop->location.id);
  if (!b) return CUDA_ERROR_OUT_OF_MEMORY;
  State& s = st();
  std::lock_guard lock(s.mu);
  *handle = ++s.next_handle;
  s.handles[*handle] = {std::move(b), 1, prop->requestedHandleTypes};
  return CUDA_SUCCESS;
}

FAKE_API CUresult CUDAAPI cuMemRelease(CUmemGenericAllocationHandle handle) {
  if (CUresult r = ready(); r != CUDA_SUCCESS) return r;
  State& s = st();
  BackingPtr last;
  std::lock_guard lock(s.mu);
  auto it = s.handles.find(handle);
  if (it == s.handles.end()) return CUDA_ERROR_INVALID_VALUE;
  if (--it->second.refs == 0) {
    last = std::move(it->second.backing);  // mappings keep theirs
    s.handles.erase(it);
  }
  return CUDA_SUCCESS;
}

FAKE_API CUresult CUDAAPI cuMemRetainAllocationHandle(CUmemGenericAllocationHandle* handle,
                                                      void* addr) {
  if (CUresult r = ready(); r != CUDA_SUCCESS) return r;
  if (handle == nullptr) return CUDA_ERROR_INVALID_VALUE;
  State& s = st();
  std::lock_guard lock(s.mu);
  auto it = containing_mapping(s, reinterpret_cast<uintptr_t>(addr));
  if (it == s.mappings.end() || it->second.kind != Kind::vmm) return CUDA_ERROR_INVALID_VALUE;
  const Mapping& m = it->second;
  VmmHandle& h = s.handles[m.handle];  // back again if it was released while mapped
  if (h.refs++ == 0) h = {m.backing, 1, m.handle_types};
  *handle = m.handle;
  return CUDA_SUCCESS;
}

FAKE_API CUresult CUDAAPI cuMemExportToShareableHandle(void* shareable,
                                                       CUmemGenericAllocationHandle handle,
                                                       CUmemAllocationHandleType type,
                                                       unsigned long long flags) {
  if (CUresult r = ready(); r != CUDA_SUCCESS) return r;
  if (shareable == nullptr || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_NOT_SUPPORTED;
  State& s = st();
  std::lock_guard lock(s.mu);
  auto it = s.handles.find(handle);
  if (it == s.handles.end()) return CUDA_ERROR_INVALID_HANDLE;
  if ((it->second.types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) == 0)
    return CUDA_ERROR_INVALID_VALUE;  // not requested at cuMemCreate
  int fd = dup_fd(it->second.backing->fd);
  if (fd < 0) return CUDA_ERROR_OPERATING_SYSTEM;
  put(shareable, fd);
  return CUDA_SUCCESS;
}

FAKE_API CUresult CUDAAPI cuMemImportFromShareableHandle(CUmemGenericAllocationHandle* handle,
                                                         void* shareable,
                                                         CUmemAllocationHandleType type) {
  if (CUresult r = ready(); r != CUDA_SUCCESS) return r;
  if (handle == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_NOT_SUPPORTED;
  int fd = dup_fd(static_cast<int>(reinterpret_cast<uintptr_t>(shareable)));
  if (fd < 0) return CUDA_ERROR_INVALID_VALUE;
  BackingPtr b = adopt(fd);  // the caller keeps its fd
  if (!b) return CUDA_ERROR_INVALID_VALUE;
  State& s = st();
  ++s.vmm_imports;
  std::lock_guard lock(s.mu);
  *handle = ++s.next_handle;
  s.handles[*handle] = {std::move(b), 1, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR};
  return CUDA_SUCCESS;
}

FAKE_API CUresult CUDAAPI cuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t alignment,
                                              CUdeviceptr /*addr*/, unsigned long long flags) {
  if (CUresult r = ready(); r != CUDA_SUCCESS) return r;
  if (ptr == nullptr || size == 0 || size % kGranularity != 0 || flags != 0 ||
      (alignment & (alignment - 1)) != 0)
    return CUDA_ERROR_INVALID_VALUE;
  State& s = st();
  std::lock_guard lock(s.mu);
  uintptr_t at = take_space(s, size, std::max(alignment, kGranularity));
  if (at == 0) return CUDA_ERROR_OUT_OF_MEMORY;
  s.reserved.emplace(at, size);
  *ptr = at;
  return CUDA_SUCCESS;
}

FAKE_API CUresult CUDAAPI cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  if (CUresult r = ready(); r != CUDA_SUCCESS) return r;
  State& s = st();
  std::lock_guard lock(s.mu);
  auto it = s.reserved.find(ptr);
  if (it == s.reserved.end() || it->second != size) return CUDA_ERROR_INVALID_VALUE;
  auto m = s.mappings.lower_bound(ptr);
  if (m != s.mappings.end() && m->first < ptr + size) return CUDA_ERROR_INVALID_VALUE;  // mapped
  s.reserved.erase(it);
  s.space.erase(ptr);
  return CUDA_SUCCESS;
}

FAKE_API CUresult CUDAAPI cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                                   CUmemGenericAllocationHandle handle, unsigned long long flags) {
  if (CUresult r = ready(); r != CUDA_SUCCESS) return r;
  if (size == 0 || flags != 0 || ptr % kGranularity != 0 || size % kGranularity != 0 ||
      offset % kGranularity != 0)
    return CUDA_ERROR_INVALID_VALUE;
  State& s = st();
  std::lock_guard lock(s.mu);
  auto h = s.handles.find(handle);
  if (h == s.handles.end()) return CUDA_ERROR_INVALID_HANDLE;
  if (offset > h->second.backing->size || size > h->second.backing->size - offset)
    return CUDA_ERROR_INVALID_VALUE;
  auto r = containing_reserved(s, ptr);
  if (r == s.reserved.end() || ptr + size > r->first + r->second) return CUDA_ERROR_INVALID_VALUE;
  auto next = s.mappings.lower_bound(ptr);
  if (containing_mapping(s, ptr) != s.mappings.end() ||
      (next != s.mappings.end() && next->first < ptr + size))
    return CUDA_ERROR_ALREADY_MAPPED;
  Mapping m;
  m.size = size;
  m.backing = h->second.backing;
  m.offset = offset;
  m.kind = Kind::vmm;
  m.id = ++s.next_id;
  m.device = m.backing->device;
  m.access = CU_MEM_ACCESS_FLAGS_PROT_NONE;  // until cuMemSetAccess
  m.handle = handle;
  m.handle_types = h->second.types;
  s.mappings.emplace(ptr, std::move(m));
  return CUDA_SUCCESS;
}

FAKE_API CUresult CUDAAPI cuMemUnmap(CUdeviceptr ptr, size_t size) {
  if (CUresult r = ready(); r != CUDA_SUCCESS) return r;
  State& s = st();
  std::lock_guard lock(s.mu);
  auto first = s.mappings.lower_bound(ptr);
  auto last = s.mappings.lower_bound(ptr + size);
  auto cut = containing_mapping(s, ptr);
  if (first == last || containing_reserved(s, ptr) == s.reserved.end() ||
      (cut != s.mappings.end() && cut->first != ptr))
    return CUDA_ERROR_INVALID_VALUE;  // nothing mapped, or a mapping cut at ptr
  for (auto it = first; it != last; ++it)
    if (it->second.kind != Kind::vmm || it->first + it->second.size > ptr + size)
      return CUDA_ERROR_INVALID_VALUE;
  s.mappings.erase(first, last);
  return CUDA_SUCCESS;
}

FAKE_API CUresult CUDAAPI cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc,
                                         size_t count) {
  if (CUresult r = ready(); r != CUDA_SUCCESS) return r;
  if (desc == nullptr || count == 0 || size == 0) return CUDA_ERROR_INVALID_VALUE;
  CUmemAccess_flags access = CU_MEM_ACCESS_FLAGS_PROT_NONE;
  for (size_t i = 0; i < count; ++i) {
    if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(desc[i].location.id)) return CUDA_ERROR_INVALID_DEVICE;
    access = desc[i].flags;  // one access for all devices: the last one given
  }
  State& s = st();
  std::lock_guard lock(s.mu);
  // The range must be mapped throughout; the access is kept per mapping, for all of it.
  std::vector<Mapping*> covered;
  for (uintptr_t at = ptr; at < ptr + size;) {
    auto it = containing_mapping(s, at);
    if (it == s.mappings.end() || it->second.kind != Kind::vmm) return CUDA_ERROR_INVALID_VALUE;
    covered.push_back(&it->second);
    at = it->first + it->second.size;
  }
  for (Mapping* m : covered) m->access = access;
  return CUDA_SUCCESS;
}

// ---- dmabuf ----

FAKE_API CUresult CUDAAPI cuMemGetHandleForAddressRange(void* handle, CUdeviceptr ptr, size_t size,
                                                        CUmemRangeHandleType type,
                                                        unsigned long long /*flags*/) {
  if (CUresult r = ready(); r != CUDA_SUCCESS) return r;
  if (handle == nullptr || size == 0 || ptr % page_size() != 0 || size % page_size() != 0)
    return CUDA_ERROR_INVALID_VALUE;
  if (type != CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD) return CUDA_ERROR_NOT_SUPPORTED;
  State& s = st();
  std::lock_guard lock(s.mu);
  auto it = containing_mapping(s, ptr);
  // The page-aligned range around an allocation's last byte may be exported, unless another
  // allocation shares those pages (small ones are packed 512 bytes apart): one memfd cannot
  // stand for two allocations. The real driver exports such pages; the simulation refuses.
  if (it == s.mappings.end() || size > align_up(it->second.size, page_size()) - (ptr - it->first))
    return CUDA_ERROR_INVALID_VALUE;
  if (auto next = std::next(it); next != s.mappings.end() && next->first < ptr + size)
    return CUDA_ERROR_INVALID_VALUE;
  int fd = dup_fd(it->second.backing->fd);
  if (fd < 0) return CUDA_ERROR_OPERATING_SYSTEM;
  put(handle, fd);
  return CUDA_SUCCESS;
}

// ---- For tests ----

/// This process's copy totals: bytes host to device, device to host, device to device, and
/// the number of copies (host to host ones too).
FAKE_API void ferry_fake_cuda_counters(unsigned long long out[4]) {
  for (int i = 0; i < 4; ++i) out[i] = st().counters[i].load();
}

/// This process's imports of VMM allocations (cuMemImportFromShareableHandle).
FAKE_API unsigned long long ferry_fake_cuda_vmm_imports() { return st().vmm_imports.load(); }

/// This process's legacy IPC handles opened and closed (cuIpcOpenMemHandle, cuIpcCloseMemHandle).
FAKE_API void ferry_fake_cuda_ipc_counts(unsigned long long out[2]) {
  for (int i = 0; i < 2; ++i) out[i] = st().ipc_counts[i].load();
}
