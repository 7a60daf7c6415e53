// ferry_py_ref_loop: the C++ reference of bench/python/py_bench.py, the same loop in C++.
//
//   ferry_py_ref_loop SIZE ITERATIONS
//
// Two connectors in this process, no NATS (the metadata is in hand). Each iteration reads a
// readable operation created beforehand (its creation is not measured): begin_read, then a
// wait for completion. Prints one JSON line: {"size", "iterations", "p50_us", "p99_us",
// "gbps"} (GB/s of bytes read over the whole loop).
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <span>
#include <vector>

#include <ferry/ferry.hpp>

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: ferry_py_ref_loop SIZE ITERATIONS\n");
    return 2;
  }
  const std::size_t size = std::strtoull(argv[1], nullptr, 10);
  const int iterations = std::atoi(argv[2]);
  ferry::ConnectorOptions options;
  options.nats.use_environment = false;
  options.name = "ref-owner";
  ferry::Connector owner(options);
  options.name = "ref-reader";
  ferry::Connector reader(options);
  // Memory as numpy allocates it for the Python loop: 2 MiB aligned and advised for huge pages
  // above 4 MiB (numpy's default on Linux), so that both loops copy between the same kind of
  // pages.
  auto alloc = [size](std::byte fill) {
    const std::size_t align = 2u << 20;
    const std::size_t bytes = (size + align - 1) / align * align;
    auto* p = static_cast<std::byte*>(std::aligned_alloc(align, bytes));
    if (size >= (4u << 20)) ::madvise(p, bytes, MADV_HUGEPAGE);
    std::memset(p, static_cast<int>(fill), size);
    return std::unique_ptr<std::byte, decltype(&std::free)>(p, &std::free);
  };
  auto src_mem = alloc(std::byte{7});
  auto dst_mem = alloc(std::byte{0});
  std::span<std::byte> src(src_mem.get(), size);
  std::span<std::byte> dst(dst_mem.get(), size);
  const int batch = 64;  // readables made ahead, out of the measured path
  std::vector<double> us;
  us.reserve(static_cast<std::size_t>(iterations));
  std::chrono::nanoseconds total{0};
  for (int done = 0; done < iterations;) {
    std::vector<ferry::ReadableOperation> ready;
    for (int i = 0; i < batch && done + i < iterations; ++i) {
      ready.push_back(owner.create_readable({ferry::Descriptor::read_only(src.data(), size)}));
    }
    for (auto& r : ready) {
      auto t0 = std::chrono::steady_clock::now();
      auto op = reader.begin_read(r.metadata(), {ferry::Descriptor(dst.data(), size)});
      op.wait_for_completion();
      auto t = std::chrono::steady_clock::now() - t0;
      total += t;
      us.push_back(std::chrono::duration<double, std::micro>(t).count());
      ++done;
    }
  }
  std::sort(us.begin(), us.end());
  auto pct = [&](double q) {
    return us[std::min(us.size() - 1,
                       static_cast<std::size_t>(q * static_cast<double>(us.size())))];
  };
  std::printf(
      "{\"size\": %zu, \"iterations\": %d, \"p50_us\": %.2f, \"p99_us\": %.2f, \"gbps\": %.3f}\n",
      size, iterations, pct(0.5), pct(0.99),
      static_cast<double>(size) * iterations / std::chrono::duration<double>(total).count() / 1e9);
  return 0;
}
