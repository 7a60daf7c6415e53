// ferry-ref-cma: the kernel's cross-memory attach, used the plainest way, as the reference for
// ferry's cma method. A forked child holds a SIZE-byte buffer; per iteration the parent moves
// all of it in one process_vm_readv (--op read) or process_vm_writev (--op write) call with
// one iovec on each side. The kernel pins and copies page by page; it may return a short
// count (it stops at the first page it cannot pin, and a single call moves at most
// MAX_RW_COUNT bytes): then the rest is moved by further calls, and "short_calls" says how
// many there were.
//
//   ferry-ref-cma --op read --size 16M --iters 50
#include <sys/mman.h>
#include <sys/uio.h>

#include <cstring>

#include "ref_common.hpp"

namespace {

using namespace ferry::ref;

void* map_touched(std::size_t size, int fill) {
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::runtime_error("mmap failed");
  std::memset(p, fill, size);  // fault every page in before timing
  return p;
}

int run(const Options& opts) {
  const std::string op = opts.str("op");
  if (op != "read" && op != "write") throw std::invalid_argument("--op read|write");
  const std::size_t size = opts.size("size");
  const std::uint64_t iters = opts.size("iters");
  const std::uint64_t warmup = opts.size("warmup");
  if (size == 0 || iters == 0) throw std::invalid_argument("--size and --iters must be > 0");

  int to_parent[2];
  int to_child[2];
  if (::pipe(to_parent) != 0 || ::pipe(to_child) != 0) throw std::runtime_error("pipe failed");

  // The child maps and touches its buffer, sends its address, and waits for the parent to
  // close the pipe.
  Child child([&] {
    ::close(to_parent[0]);
    ::close(to_child[1]);
    void* buffer = map_touched(size, 0x5a);
    const auto address = reinterpret_cast<std::uintptr_t>(buffer);
    if (!write_all(to_parent[1], &address, sizeof address)) return 1;
    char c;
    while (::read(to_child[0], &c, 1) > 0) {
    }
    return 0;
  });
  ::close(to_parent[1]);
  ::close(to_child[0]);

  std::uintptr_t remote_address = 0;
  if (!read_all(to_parent[0], &remote_address, sizeof remote_address))
    throw std::runtime_error("the child did not send its buffer address");
  auto* local = static_cast<char*>(map_touched(size, 0x3c));
  auto* remote = reinterpret_cast<char*>(remote_address);

  std::uint64_t short_calls = 0;
  auto move_once = [&] {
    std::size_t done = 0;
    while (done < size) {
      iovec l{local + done, size - done};
      iovec r{remote + done, size - done};
      const ssize_t n = op == "read" ? ::process_vm_readv(child.pid(), &l, 1, &r, 1, 0)
                                     : ::process_vm_writev(child.pid(), &l, 1, &r, 1, 0);
      if (n <= 0)
        throw std::runtime_error(std::string("process_vm_") + (op == "read" ? "readv" : "writev") +
                                 ": " + std::strerror(errno));
      done += static_cast<std::size_t>(n);
      if (done < size) ++short_calls;
    }
  };

  for (std::uint64_t i = 0; i < warmup; ++i) move_once();
  short_calls = 0;
  const Timed timed = time_iterations(iters, move_once);
  const double total_s = timed.seconds;

  ::close(to_child[1]);
  const int child_rc = child.wait(5);
  if (child_rc != 0) throw std::runtime_error("the child failed");

  const Percentiles p = percentiles(timed.us);
  const double bytes = static_cast<double>(size);
  JsonObject out;
  out.add("tool", "ferry-ref-cma").add("op", op).add("size", static_cast<std::uint64_t>(size));
  add_run(out, iters, warmup, total_s)
      .add("bandwidth_gbps", bytes / (p.p50_us * 1e-6) / 1e9)  // median iteration
      .add("bandwidth_gibps", bytes / (p.p50_us * 1e-6) / static_cast<double>(1ull << 30))
      .add("bandwidth_gbps_overall", bytes * static_cast<double>(iters) / total_s / 1e9)
      .add("", p)
      .add("short_calls", short_calls)
      .add("iteration_us", timed.us);
  out.print();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return main_of(argc, argv, "ferry-ref-cma",
                 "--op read|write --size N[K|M|G] --iters N [--warmup N]",
                 {{"op", "read"}, {"size", "16M"}, {"iters", "20"}, {"warmup", "2"}}, run);
}
