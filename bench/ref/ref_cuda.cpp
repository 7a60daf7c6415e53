// ferry-ref-cuda: what the GPU does without ferry, the reference for ferry's CUDA methods.
// Per size, on one device, with the driver ferry loads at run time
// (transport/cuda/cuda_api.hpp: libcuda.so.1, or FERRY_CUDA_DRIVER), never linked:
//
//   d2d  cuMemcpyAsync between two cuMemAlloc buffers (the bound of cuda_ipc on one device)
//   h2d  cuMemcpyAsync from pinned host memory (cuMemHostAlloc) to a cuMemAlloc buffer
//   d2h  the other way (h2d and d2h bound any path that stages device memory through the host)
//
// A point first times copies one at a time (each waited for: the latencies), then queues as
// many as fill --point_seconds on one non-blocking stream and waits once at the end: its
// bandwidth is the bytes of all of them over that time, the best the copy engine sustains.
// The destination is then copied back and checked byte for byte against the pattern the source
// was given (not timed); a mismatch fails the run.
//
// Prints one JSON object: "points", one per op and size, with ferry-bench's field names
// (method "cuMemcpyAsync", op_type d2d|h2d|d2h, block_size, iterations, seconds,
// bandwidth_gbps, lat_p50_us, ...). Where CUDA cannot be used: {"error": why}, exit status 1.
//
//   ferry-ref-cuda --op d2d,h2d,d2h --start_block_size 64K --max_block_size 1G
#include <cuda.h>

#include <cstring>
#include <memory>
#include <sstream>

#include "ref_common.hpp"
#include "transport/cuda/cuda_api.hpp"

namespace {

using namespace ferry::ref;
namespace cuda = ferry::transport::cuda;

class Failure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

const cuda::CudaApi* g_api = nullptr;

void check(CUresult r, const std::string& what) {
  if (r != CUDA_SUCCESS) throw Failure(what + ": " + cuda::result_text(g_api, r));
}

CUdeviceptr address(const void* p) {
  return static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(p));
}

// The device's primary context, current on this thread while this lives.
class Context {
 public:
  explicit Context(int ordinal) {
    check(g_api->device_get(&dev_, ordinal), "cuDeviceGet(" + std::to_string(ordinal) + ")");
    check(g_api->device_primary_ctx_retain(&ctx_, dev_), "cuDevicePrimaryCtxRetain");
    check(g_api->ctx_set_current(ctx_), "cuCtxSetCurrent");
  }
  ~Context() {
    (void)g_api->ctx_set_current(nullptr);
    (void)g_api->device_primary_ctx_release(dev_);
  }
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

 private:
  CUdevice dev_ = 0;
  CUcontext ctx_ = nullptr;
};

struct DeviceBuffer {
  CUdeviceptr ptr = 0;
  explicit DeviceBuffer(std::size_t size) {
    check(g_api->mem_alloc(&ptr, size), "cuMemAlloc of " + std::to_string(size) + " bytes");
  }
  ~DeviceBuffer() { (void)g_api->mem_free(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

struct PinnedBuffer {
  void* ptr = nullptr;
  explicit PinnedBuffer(std::size_t size) {
    check(g_api->mem_host_alloc(&ptr, size, CU_MEMHOSTALLOC_PORTABLE),
          "cuMemHostAlloc of " + std::to_string(size) + " bytes");
  }
  ~PinnedBuffer() { (void)g_api->mem_free_host(ptr); }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  std::uint8_t* bytes() const { return static_cast<std::uint8_t*>(ptr); }
};

struct Stream {
  CUstream s = nullptr;
  Stream() { check(g_api->stream_create(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate"); }
  ~Stream() { (void)g_api->stream_destroy(s); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
};

std::uint8_t pattern(std::size_t i, std::uint8_t seed) {
  return static_cast<std::uint8_t>(i ^ (i >> 8) ^ (i >> 16) ^ seed);
}

void fill(std::uint8_t* p, std::size_t size, std::uint8_t seed) {
  for (std::size_t i = 0; i < size; ++i) p[i] = pattern(i, seed);
}

// The first byte that differs from the pattern, or "" when none does.
std::string verify(const std::uint8_t* p, std::size_t size, std::uint8_t seed) {
  for (std::size_t i = 0; i < size; ++i) {
    if (p[i] != pattern(i, seed)) {
      std::ostringstream os;
      os << "byte " << i << " of " << size << " is " << unsigned{p[i]} << ", expected "
         << unsigned{pattern(i, seed)};
      return os.str();
    }
  }
  return {};
}

struct PointSpec {
  std::string op;
  std::size_t size = 0;
  double point_seconds = 0;
  std::uint64_t max_iters = 0;
};

std::string size_text(std::size_t n) {
  const char* units[] = {"", "K", "M", "G"};
  unsigned u = 0;
  while (u < 3 && n >= 1024 && n % 1024 == 0) {
    n /= 1024;
    ++u;
  }
  return std::to_string(n) + units[u];
}

std::string run_point(const PointSpec& spec, std::uint8_t seed) {
  const std::size_t size = spec.size;
  // Source and destination of the op; the other pair of buffers is only for the check.
  std::unique_ptr<DeviceBuffer> dev_a;
  std::unique_ptr<DeviceBuffer> dev_b;
  std::unique_ptr<PinnedBuffer> pinned;
  CUdeviceptr src = 0;
  CUdeviceptr dst = 0;
  std::vector<std::uint8_t> host;  // the host side of the check for device memory
  if (spec.op == "d2d") {
    dev_a = std::make_unique<DeviceBuffer>(size);
    dev_b = std::make_unique<DeviceBuffer>(size);
    src = dev_a->ptr;
    dst = dev_b->ptr;
    host.resize(size);
    fill(host.data(), size, seed);
    check(g_api->memcpy(src, address(host.data()), size), "cuMemcpy of the pattern");
  } else if (spec.op == "h2d") {
    pinned = std::make_unique<PinnedBuffer>(size);
    dev_a = std::make_unique<DeviceBuffer>(size);
    src = address(pinned->ptr);
    dst = dev_a->ptr;
    fill(pinned->bytes(), size, seed);
  } else {
    dev_a = std::make_unique<DeviceBuffer>(size);
    pinned = std::make_unique<PinnedBuffer>(size);
    src = dev_a->ptr;
    dst = address(pinned->ptr);
    host.resize(size);
    fill(host.data(), size, seed);
    check(g_api->memcpy(src, address(host.data()), size), "cuMemcpy of the pattern");
  }
  // The destination starts as something else than the pattern.
  if (spec.op == "d2h") {
    std::memset(pinned->ptr, static_cast<int>(seed ^ 0xa5), size);
  } else {
    check(g_api->memset_d8(dst, static_cast<unsigned char>(seed ^ 0xa5), size), "cuMemsetD8");
  }

  Stream stream;
  const auto copy = [&] { check(g_api->memcpy_async(dst, src, size, stream.s), "cuMemcpyAsync"); };
  const auto wait = [&] { check(g_api->stream_synchronize(stream.s), "cuStreamSynchronize"); };

  // Warm-up, then copies one at a time for the latencies: at most a quarter of the point's
  // time and 1000 copies, at least 3.
  for (int i = 0; i < 2; ++i) {
    copy();
    wait();
  }
  std::vector<double> lat_us;
  const auto lat_until = Clock::now() + std::chrono::duration<double>(spec.point_seconds / 4);
  while (lat_us.size() < 3 || (lat_us.size() < 1000 && Clock::now() < lat_until)) {
    const auto t0 = Clock::now();
    copy();
    wait();
    lat_us.push_back(to_us(Clock::now() - t0));
  }
  const Percentiles lat = percentiles(lat_us);

  // Bandwidth: as many copies as the median latency says fill the point, queued at once.
  const double want = spec.point_seconds * 1e6 / std::max(lat.p50_us, 0.1);
  const std::uint64_t iters =
      std::clamp<std::uint64_t>(static_cast<std::uint64_t>(want), 8, spec.max_iters);
  const auto start = Clock::now();
  for (std::uint64_t i = 0; i < iters; ++i) copy();
  wait();
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();

  // The check, off the clock.
  std::string mismatch;
  if (spec.op == "d2h") {
    mismatch = verify(pinned->bytes(), size, seed);
  } else {
    host.assign(size, 0);
    check(g_api->memcpy(address(host.data()), dst, size), "cuMemcpy of the result");
    mismatch = verify(host.data(), size, seed);
  }

  const double bytes = static_cast<double>(size) * static_cast<double>(iters);
  JsonObject point;
  point.add("method", "cuMemcpyAsync")
      .add("op_type", spec.op)
      .add("block_size", static_cast<std::uint64_t>(size))
      .add("batch_size", std::uint64_t{1})
      .add("bytes_per_op", static_cast<std::uint64_t>(size))
      .add("inflight", iters)
      .add("iterations", iters)
      .add("seconds", seconds)
      .add("bandwidth_gbps", bytes / seconds / 1e9)
      .add("bandwidth_gibps", bytes / seconds / static_cast<double>(1ull << 30))
      .add("ops_per_s", static_cast<double>(iters) / seconds)
      .add("lat_p50_us", lat.p50_us)
      .add("lat_p99_us", lat.p99_us)
      .add("lat_min_us", lat.min_us)
      .add("lat_samples", static_cast<std::uint64_t>(lat_us.size()))
      .add("skipped", "")
      .add("errors", std::uint64_t{mismatch.empty() ? 0u : 1u});
  if (!mismatch.empty()) point.add("problem", mismatch);
  std::fprintf(stderr, "ferry-ref-cuda: %s %s: %.3f GB/s, p50 %.1f us%s%s\n", spec.op.c_str(),
               size_text(size).c_str(), bytes / seconds / 1e9, lat.p50_us,
               mismatch.empty() ? "" : ", MISMATCH: ", mismatch.c_str());
  return point.text();
}

std::vector<std::string> split(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  for (std::string item; std::getline(ss, item, ',');) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

int run(const Options& opts) {
  const std::vector<std::string> ops = split(opts.str("op"));
  for (const auto& op : ops) {
    if (op != "d2d" && op != "h2d" && op != "d2h")
      throw std::invalid_argument("--op takes d2d, h2d, d2h (a list)");
  }
  if (ops.empty()) throw std::invalid_argument("--op is empty");
  const std::size_t start = opts.size("start_block_size");
  const std::size_t max = opts.size("max_block_size");
  const std::size_t factor = opts.size("block_size_factor");
  const int device = static_cast<int>(opts.size("device"));
  const double point_seconds = std::stod(opts.str("point_seconds"));
  const std::uint64_t max_iters = opts.size("max_iter");
  if (start == 0 || max < start || factor < 2)
    throw std::invalid_argument("sizes: 0 < --start_block_size <= --max_block_size, factor >= 2");
  if (!(point_seconds > 0) || max_iters < 8)
    throw std::invalid_argument("--point_seconds must be > 0 and --max_iter >= 8");

  JsonObject out;
  out.add("tool", "ferry-ref-cuda").add("device", static_cast<std::uint64_t>(device));
  try {
    g_api = &cuda::system_cuda();
  } catch (const ferry::Error& e) {
    out.add("error", "CUDA cannot be used here: " + e.message()).print();
    return 1;
  }
  out.add("driver", g_api->name);
  std::string points = "[";
  try {
    Context context(device);
    CUdevice dev = 0;
    check(g_api->device_get(&dev, device), "cuDeviceGet");
    char name[256] = {};
    check(g_api->device_get_name(name, static_cast<int>(sizeof name), dev), "cuDeviceGetName");
    out.add("device_name", name);
    std::uint8_t seed = 1;
    for (const auto& op : ops) {
      for (std::size_t size = start; size <= max; size *= factor) {
        if (points.size() > 1) points += ", ";
        points += "{" + run_point({op, size, point_seconds, max_iters}, seed++) + "}";
        if (size > max / factor) break;  // no overflow
      }
    }
  } catch (const Failure& e) {
    out.raw("points", points + "]").add("error", e.what()).print();
    return 1;
  }
  out.raw("points", points + "]").print();
  return points.find("\"problem\"") == std::string::npos ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  return main_of(argc, argv, "ferry-ref-cuda",
                 "[--op d2d,h2d,d2h] [--start_block_size 64K] [--max_block_size 1G] "
                 "[--block_size_factor 4] [--device 0] [--point_seconds 1] [--max_iter 100000]",
                 {{"op", "d2d,h2d,d2h"},
                  {"start_block_size", "64K"},
                  {"max_block_size", "1G"},
                  {"block_size_factor", "4"},
                  {"device", "0"},
                  {"point_seconds", "1"},
                  {"max_iter", "100000"}},
                 run);
}
