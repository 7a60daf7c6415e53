// ferry transfers against references measured in the same run (the machines are shared and
// noisy; compare ratios, not absolute numbers):
//   RawTcpRequestResponse  a blocking TCP pair on loopback doing what a ferry read does: a
//                          64-byte request, answered with SIZE bytes received into the
//                          destination; one connection, reused
//   Memcpy                 one copy of SIZE bytes
//   RawProcessVmReadv      one process_vm_readv of SIZE bytes from this process
//   FerryRead / FerryWrite a whole operation each iteration: create the passive side, begin
//                          the active side, wait for both to complete; once per method, both
//                          connectors restricted to it: FerryRead/tcp/SIZE, FerryRead/cma/SIZE
//                          (cma between two connectors of one process: the same system calls
//                          as between two processes)
//
//   RegionRead / RegionWrite
//                          a transfer on a region's attachment each iteration: the region
//                          created and attached once, outside the loop (docs/regions.md)
//   *Pipelined             64 transfers of 4 KiB in flight, the oldest waited for and replaced:
//                          RawTcpPipelined (64 requests outstanding on one blocking TCP pair),
//                          FerryReadPipelined (one-shot operations), RegionReadPipelined
//   KvOneDescriptor / KvBlocks
//                          a KV cache of 1024 x 16 KiB blocks read from a region: one 16 MiB
//                          range into one descriptor, or by block ids (the remote blocks in a
//                          scattered order) into 1024 separate local pages; RawKvOneRange and
//                          RawKvBlocks: the same copies by one bare process_vm_readv
//
//   build/bench/ferry_transfer_bench --benchmark_counters_tabular=true
//   build/bench/ferry_transfer_bench --benchmark_filter='Ferry|Memcpy'   (see README.md)
#include <benchmark/benchmark.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <ferry/ferry.hpp>

namespace {

void add_sizes(benchmark::internal::Benchmark* b) {
  for (long size : {64L, 4096L, 1L << 20, 16L << 20, 64L << 20, 256L << 20}) b->Arg(size);
  b->UseRealTime();
}

void set_bytes(benchmark::State& state) {
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * state.range(0));
}

void send_all(int fd, const void* data, std::size_t size) {
  auto* p = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t n = ::send(fd, p, size, MSG_NOSIGNAL);
    if (n <= 0) throw std::runtime_error("send");
    p += n;
    size -= static_cast<std::size_t>(n);
  }
}

bool recv_all(int fd, void* data, std::size_t size) {
  auto* p = static_cast<char*>(data);
  while (size > 0) {
    ssize_t n = ::recv(fd, p, size, 0);
    if (n <= 0) return false;
    p += n;
    size -= static_cast<std::size_t>(n);
  }
  return true;
}

// A blocking TCP pair on loopback, TCP_NODELAY on both ends: a server thread answers every
// 64-byte request with SIZE bytes, until the client closes.
class RequestResponsePair {
 public:
  explicit RequestResponsePair(std::size_t size) : src_(size, 'x') {
    listener_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::bind(listener_, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
    ::listen(listener_, 1);
    socklen_t len = sizeof addr;
    ::getsockname(listener_, reinterpret_cast<sockaddr*>(&addr), &len);
    server_ = std::thread([this] {
      int fd = ::accept(listener_, nullptr, nullptr);
      no_delay(fd);
      char request[64];
      while (recv_all(fd, request, sizeof request)) send_all(fd, src_.data(), src_.size());
      ::close(fd);
    });
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    no_delay(fd_);
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0)
      throw std::runtime_error("connect");
  }
  ~RequestResponsePair() {
    ::shutdown(fd_, SHUT_WR);
    ::close(fd_);
    server_.join();
    ::close(listener_);
  }
  void request() {
    static const char kRequest[64] = {};
    send_all(fd_, kRequest, sizeof kRequest);
  }
  void answer(char* into) { recv_all(fd_, into, src_.size()); }

 private:
  static void no_delay(int fd) {
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  }
  std::vector<char> src_;
  int listener_ = -1;
  int fd_ = -1;
  std::thread server_;
};

void RawTcpRequestResponse(benchmark::State& state) {
  const auto size = static_cast<std::size_t>(state.range(0));
  RequestResponsePair pair(size);
  std::vector<char> dst(size);
  for (auto _ : state) {
    pair.request();
    pair.answer(dst.data());
  }
  set_bytes(state);
}

// One process_vm_readv of SIZE bytes from this process: what cma's copy costs without ferry
// (the ferry cma rows also run between two connectors of one process).
void RawProcessVmReadv(benchmark::State& state) {
  const auto size = static_cast<std::size_t>(state.range(0));
  std::vector<char> src(size, 'x');
  std::vector<char> dst(size);
  for (auto _ : state) {
    iovec local{dst.data(), size};
    iovec remote{src.data(), size};
    if (::process_vm_readv(::getpid(), &local, 1, &remote, 1, 0) != static_cast<ssize_t>(size)) {
      state.SkipWithError("process_vm_readv failed");
      break;
    }
    benchmark::ClobberMemory();
  }
  set_bytes(state);
}

void Memcpy(benchmark::State& state) {
  const auto size = static_cast<std::size_t>(state.range(0));
  std::vector<char> src(size, 'x');
  std::vector<char> dst(size);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), size);
    benchmark::ClobberMemory();
  }
  set_bytes(state);
}

/// Connector options that offer `method` alone; empty when this host cannot offer it, and the
/// benchmark is then skipped, saying why.
std::optional<ferry::ConnectorOptions> only(benchmark::State& state, const std::string& method) {
  ferry::ConnectorOptions o;
  o.transports = {method};
  for (const ferry::MethodInfo& m : ferry::probe_methods(o))
    if (m.method == method && !m.available) {
      state.SkipWithError((method + " is not offered here: " + m.detail).c_str());
      return std::nullopt;
    }
  return o;
}

void FerryRead(benchmark::State& state, const std::string& method) {
  const auto size = static_cast<std::size_t>(state.range(0));
  auto options = only(state, method);
  if (!options) return;
  ferry::Connector owner(*options);
  ferry::Connector peer(*options);
  std::vector<std::byte> src(size, std::byte{1});
  std::vector<std::byte> dst(size);
  for (auto _ : state) {
    auto readable = owner.create_readable({ferry::Descriptor(src.data(), size)});
    auto read = peer.begin_read(readable.metadata(), {ferry::Descriptor(dst.data(), size)});
    read.wait_for_completion();
    readable.wait_for_completion();
    if (read.method() != method) {
      state.SkipWithError(("moved by " + read.method()).c_str());
      break;
    }
  }
  set_bytes(state);
}

void FerryWrite(benchmark::State& state, const std::string& method) {
  const auto size = static_cast<std::size_t>(state.range(0));
  auto options = only(state, method);
  if (!options) return;
  ferry::Connector owner(*options);
  ferry::Connector peer(*options);
  std::vector<std::byte> src(size, std::byte{1});
  std::vector<std::byte> dst(size);
  for (auto _ : state) {
    auto writable = owner.create_writable({ferry::Descriptor(dst.data(), size)});
    auto write = peer.begin_write({ferry::Descriptor(src.data(), size)}, writable.metadata());
    write.wait_for_completion();
    writable.wait_for_completion();
    if (write.method() != method) {
      state.SkipWithError(("moved by " + write.method()).c_str());
      break;
    }
  }
  set_bytes(state);
}

// Region: both connectors restricted to `method`, the region (read_write) and the attachment
// made once.
struct RegionPair {
  ferry::Connector owner;
  ferry::Connector peer;
  ferry::Region region;
  ferry::Attachment attachment;
  RegionPair(const ferry::ConnectorOptions& options, std::vector<std::byte>& pool,
             std::uint64_t block_size = 0)
      : owner(options), peer(options) {
    ferry::RegionOptions ro;
    ro.access = ferry::RegionAccess::read_write;
    ro.block_size = block_size;
    ro.queue_events = false;  // nobody reads them here
    region = owner.create_region({ferry::Descriptor(pool.data(), pool.size())}, ro);
    attachment = peer.attach(region.metadata());
    attachment.wait_attached();
  }
};

void RegionTransfer(benchmark::State& state, const std::string& method, bool read) {
  const auto size = static_cast<std::size_t>(state.range(0));
  auto options = only(state, method);
  if (!options) return;
  std::vector<std::byte> pool(size, std::byte{1});
  std::vector<std::byte> local(size);
  std::optional<RegionPair> pair;
  try {
    pair.emplace(*options, pool);
  } catch (const ferry::Error& e) {
    state.SkipWithError(e.what());
    return;
  }
  if (pair->attachment.method() != method) {
    state.SkipWithError(("attached by " + pair->attachment.method()).c_str());
    return;
  }
  for (auto _ : state) {
    if (read)
      pair->attachment.read({{0, size}}, {ferry::Descriptor(local.data(), size)})
          .wait_for_completion();
    else
      pair->attachment.write({ferry::Descriptor(local.data(), size)}, {{0, size}})
          .wait_for_completion();
  }
  set_bytes(state);
}

void RegionRead(benchmark::State& state, const std::string& method) {
  RegionTransfer(state, method, true);
}
void RegionWrite(benchmark::State& state, const std::string& method) {
  RegionTransfer(state, method, false);
}

constexpr std::size_t kInFlight = 64;

// Keeps kInFlight operations going: each iteration waits for the oldest and starts one more.
template <class Start>
void pipelined(benchmark::State& state, Start&& start) {
  std::vector<ferry::Operation> ring(kInFlight);
  for (std::size_t i = 0; i < kInFlight; ++i) ring[i] = start(i);
  std::size_t next = 0;
  for (auto _ : state) {
    ring[next].wait_for_completion();
    ring[next] = start(next);
    next = (next + 1) % kInFlight;
  }
  for (auto& op : ring) op.wait_for_completion();
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()));
  set_bytes(state);
}

void RegionReadPipelined(benchmark::State& state, const std::string& method) {
  const auto size = static_cast<std::size_t>(state.range(0));
  auto options = only(state, method);
  if (!options) return;
  std::vector<std::byte> pool(size * kInFlight, std::byte{1});
  std::vector<std::byte> local(size * kInFlight);
  RegionPair pair(*options, pool, size);
  pipelined(state, [&](std::size_t slot) -> ferry::Operation {
    return pair.attachment.read_blocks({slot},
                                       {ferry::Descriptor(local.data() + slot * size, size)});
  });
}

void FerryReadPipelined(benchmark::State& state, const std::string& method) {
  const auto size = static_cast<std::size_t>(state.range(0));
  auto options = only(state, method);
  if (!options) return;
  ferry::Connector owner(*options);
  ferry::Connector peer(*options);
  std::vector<std::byte> src(size * kInFlight, std::byte{1});
  std::vector<std::byte> dst(size * kInFlight);
  // The passive side of each slot, replaced once its read has ended.
  std::vector<ferry::ReadableOperation> readables(kInFlight);
  pipelined(state, [&](std::size_t slot) -> ferry::Operation {
    readables[slot] = owner.create_readable({ferry::Descriptor(src.data() + slot * size, size)});
    return peer.begin_read(readables[slot].metadata(),
                           {ferry::Descriptor(dst.data() + slot * size, size)});
  });
}

// 64 requests outstanding on one TCP pair: the server answers each 64-byte request with SIZE
// bytes; the client keeps 64 unanswered.
void RawTcpPipelined(benchmark::State& state) {
  const auto size = static_cast<std::size_t>(state.range(0));
  RequestResponsePair pair(size);
  std::vector<char> dst(size);
  for (std::size_t i = 0; i < kInFlight; ++i) pair.request();
  for (auto _ : state) {
    pair.answer(dst.data());
    pair.request();
  }
  for (std::size_t i = 0; i < kInFlight; ++i) pair.answer(dst.data());
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()));
  set_bytes(state);
}

constexpr std::size_t kKvBlock = 16 << 10;
constexpr std::size_t kKvBlocks = 1024;

// A KV cache of 1024 blocks: read all of it, as one range into one descriptor or by block ids.
void Kv(benchmark::State& state, const std::string& method, bool by_blocks) {
  auto options = only(state, method);
  if (!options) return;
  std::vector<std::byte> pool(kKvBlock * kKvBlocks, std::byte{1});
  RegionPair pair(*options, pool, kKvBlock);
  // By blocks: the remote blocks in a scattered order (i * 7 mod 1024), into separate pages
  // (every other page of a buffer twice the size).
  std::vector<std::uint64_t> blocks;
  for (std::uint64_t i = 0; i < kKvBlocks; ++i) blocks.push_back((i * 7) % kKvBlocks);
  std::vector<std::byte> local(kKvBlock * kKvBlocks * (by_blocks ? 2 : 1));
  std::vector<ferry::Descriptor> pages;
  for (std::size_t i = 0; i < kKvBlocks; ++i)
    pages.emplace_back(local.data() + 2 * i * kKvBlock, kKvBlock);
  for (auto _ : state) {
    if (by_blocks)
      pair.attachment.read_blocks(blocks, pages).wait_for_completion();
    else
      pair.attachment.read({{0, pool.size()}}, {ferry::Descriptor(local.data(), pool.size())})
          .wait_for_completion();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * pool.size()));
}

// The KV rows' copies without ferry: one process_vm_readv of this process, of the 1024 blocks in
// the same scattered order into the same separate pages (one call: 1024 iovecs each side, the
// kernel's IOV_MAX), or of one 16 MiB range. What the kernel makes of scattered blocks apart from
// ferry: KvBlocks/cma against RawKvBlocks, KvOneDescriptor/cma against RawKvOneRange.
void RawKv(benchmark::State& state, bool by_blocks) {
  std::vector<std::byte> pool(kKvBlock * kKvBlocks, std::byte{1});
  std::vector<std::byte> local(kKvBlock * kKvBlocks * (by_blocks ? 2 : 1));
  std::vector<iovec> to;
  std::vector<iovec> from;
  if (by_blocks) {
    for (std::size_t i = 0; i < kKvBlocks; ++i) {
      to.push_back({local.data() + 2 * i * kKvBlock, kKvBlock});
      from.push_back({pool.data() + ((i * 7) % kKvBlocks) * kKvBlock, kKvBlock});
    }
  } else {
    to.push_back({local.data(), pool.size()});
    from.push_back({pool.data(), pool.size()});
  }
  for (auto _ : state) {
    if (::process_vm_readv(::getpid(), to.data(), to.size(), from.data(), from.size(), 0) !=
        static_cast<ssize_t>(pool.size())) {
      state.SkipWithError("process_vm_readv failed");
      break;
    }
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * pool.size()));
}

void RawKvBlocks(benchmark::State& state) { RawKv(state, true); }
void RawKvOneRange(benchmark::State& state) { RawKv(state, false); }

void KvOneDescriptor(benchmark::State& state, const std::string& method) {
  Kv(state, method, false);
}
void KvBlocks(benchmark::State& state, const std::string& method) { Kv(state, method, true); }

BENCHMARK(RawTcpRequestResponse)->Apply(add_sizes);
BENCHMARK(Memcpy)->Apply(add_sizes);
BENCHMARK(RawProcessVmReadv)->Apply(add_sizes);
BENCHMARK_CAPTURE(FerryRead, tcp, std::string("tcp"))->Apply(add_sizes);
BENCHMARK_CAPTURE(FerryRead, cma, std::string("cma"))->Apply(add_sizes);
BENCHMARK_CAPTURE(FerryWrite, tcp, std::string("tcp"))->Apply(add_sizes);
BENCHMARK_CAPTURE(FerryWrite, cma, std::string("cma"))->Apply(add_sizes);
BENCHMARK_CAPTURE(RegionRead, tcp, std::string("tcp"))->Apply(add_sizes);
BENCHMARK_CAPTURE(RegionRead, cma, std::string("cma"))->Apply(add_sizes);
BENCHMARK_CAPTURE(RegionWrite, tcp, std::string("tcp"))->Apply(add_sizes);
BENCHMARK_CAPTURE(RegionWrite, cma, std::string("cma"))->Apply(add_sizes);
BENCHMARK(RawTcpPipelined)->Arg(4096)->UseRealTime();
BENCHMARK_CAPTURE(FerryReadPipelined, tcp, std::string("tcp"))->Arg(4096)->UseRealTime();
BENCHMARK_CAPTURE(RegionReadPipelined, tcp, std::string("tcp"))->Arg(4096)->UseRealTime();
BENCHMARK_CAPTURE(RegionReadPipelined, cma, std::string("cma"))->Arg(4096)->UseRealTime();
BENCHMARK(RawKvOneRange)->UseRealTime();
BENCHMARK(RawKvBlocks)->UseRealTime();
BENCHMARK_CAPTURE(KvOneDescriptor, tcp, std::string("tcp"))->UseRealTime();
BENCHMARK_CAPTURE(KvBlocks, tcp, std::string("tcp"))->UseRealTime();
BENCHMARK_CAPTURE(KvOneDescriptor, cma, std::string("cma"))->UseRealTime();
BENCHMARK_CAPTURE(KvBlocks, cma, std::string("cma"))->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
