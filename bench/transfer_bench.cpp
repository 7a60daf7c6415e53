// ferry transfers against references measured in the same run (the machines are shared and
// noisy; compare ratios, not absolute numbers):
//   RawTcpRequestResponse  a blocking TCP pair on loopback doing what a ferry read does: a
//                          64-byte request, answered with SIZE bytes received into the
//                          destination; one connection, reused
//   Memcpy                 one copy of SIZE bytes
//   FerryRead / FerryWrite a whole operation each iteration: create the passive side, begin
//                          the active side, wait for both to complete; once per method, both
//                          connectors restricted to it: FerryRead/tcp/SIZE, FerryRead/cma/SIZE
//                          (cma between two connectors of one process: the same system calls
//                          as between two processes)
//
//   build/bench/ferry_transfer_bench --benchmark_counters_tabular=true
//   build/bench/ferry_transfer_bench --benchmark_filter='Ferry|Memcpy'   (see README.md)
#include <benchmark/benchmark.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
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

void RawTcpRequestResponse(benchmark::State& state) {
  const auto size = static_cast<std::size_t>(state.range(0));
  int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  ::listen(listener, 1);
  socklen_t len = sizeof addr;
  ::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len);
  std::vector<char> src(size, 'x');
  std::thread server([&] {
    int fd = ::accept(listener, nullptr, nullptr);
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    char request[64];
    while (recv_all(fd, request, sizeof request)) send_all(fd, src.data(), size);
    ::close(fd);
  });
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0)
    throw std::runtime_error("connect");
  std::vector<char> dst(size);
  char request[64] = {};
  for (auto _ : state) {
    send_all(fd, request, sizeof request);
    recv_all(fd, dst.data(), size);
  }
  ::close(fd);
  server.join();
  ::close(listener);
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

/// Connector options that offer `method` alone; empty when this host cannot offer it (the
/// benchmark is then skipped with `why`).
std::optional<ferry::ConnectorOptions> only(const std::string& method, std::string& why) {
  ferry::ConnectorOptions o;
  o.transports = {method};
  for (const ferry::MethodInfo& m : ferry::probe_methods(o))
    if (m.method == method && !m.available) {
      why = method + " is not offered here: " + m.detail;
      return std::nullopt;
    }
  return o;
}

void FerryRead(benchmark::State& state, const std::string& method) {
  const auto size = static_cast<std::size_t>(state.range(0));
  std::string why;
  auto options = only(method, why);
  if (!options) {
    state.SkipWithError(why.c_str());
    return;
  }
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
  std::string why;
  auto options = only(method, why);
  if (!options) {
    state.SkipWithError(why.c_str());
    return;
  }
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

BENCHMARK(RawTcpRequestResponse)->Apply(add_sizes);
BENCHMARK(Memcpy)->Apply(add_sizes);
BENCHMARK_CAPTURE(FerryRead, tcp, std::string("tcp"))->Apply(add_sizes);
BENCHMARK_CAPTURE(FerryRead, cma, std::string("cma"))->Apply(add_sizes);
BENCHMARK_CAPTURE(FerryWrite, tcp, std::string("tcp"))->Apply(add_sizes);
BENCHMARK_CAPTURE(FerryWrite, cma, std::string("cma"))->Apply(add_sizes);

}  // namespace

BENCHMARK_MAIN();
