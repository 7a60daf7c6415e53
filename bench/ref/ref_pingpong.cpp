// ferry-ref-pingpong: a blocking TCP ping-pong over 127.0.0.1 between two processes, the
// reference for one small ferry operation and its acknowledgement. Per iteration the parent
// sends SIZE bytes and waits for REPLY bytes back from a forked child; TCP_NODELAY on both
// ends. Reports the round trip's percentiles. With --outstanding N (> 1) the parent keeps N
// requests unanswered (a pipelined request/response, as a region's transfers with N in
// flight): it sends N, then per iteration takes one answer in and sends one more; round_trips_per_s
// is then the answers per second (the percentiles time an answer's wait, not a round trip).
//
//   ferry-ref-pingpong --size 4096 --reply 64 --iters 20000
//   ferry-ref-pingpong --size 64 --reply 4096 --outstanding 64 --iters 200000
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>

#include "ref_common.hpp"

namespace {

using namespace ferry::ref;

void no_delay(int fd) {
  int one = 1;
  if (::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) != 0)
    throw std::runtime_error("TCP_NODELAY failed");
}

int run(const Options& opts) {
  const std::size_t size = opts.size("size");
  const std::size_t reply = opts.size("reply");
  const std::uint64_t iters = opts.size("iters");
  const std::uint64_t warmup = opts.size("warmup");
  const std::uint64_t outstanding = opts.size("outstanding");
  if (size == 0 || reply == 0 || iters == 0)
    throw std::invalid_argument("--size, --reply and --iters must be > 0");

  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  if (listener < 0) throw std::runtime_error("socket failed");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  if (::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::listen(listener, 1) != 0 ||
      ::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0)
    throw std::runtime_error(std::string("listen on 127.0.0.1 failed: ") + std::strerror(errno));

  // The child answers every SIZE bytes with REPLY bytes until the parent closes.
  Child child([&] {
    const int fd = ::accept(listener, nullptr, nullptr);
    if (fd < 0) return 1;
    ::close(listener);
    no_delay(fd);
    std::vector<char> in(size), out(reply, 'r');
    while (read_all(fd, in.data(), size)) {
      if (!write_all(fd, out.data(), reply)) return 1;
    }
    ::close(fd);
    return 0;
  });
  ::close(listener);

  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0)
    throw std::runtime_error("connect to the child failed");
  no_delay(fd);

  std::vector<char> out(size, 'p'), in(reply);
  auto round_trip = [&] {
    if (!write_all(fd, out.data(), size) || !read_all(fd, in.data(), reply))
      throw std::runtime_error("the connection broke");
  };
  auto pipelined = [&] {
    if (!read_all(fd, in.data(), reply) || !write_all(fd, out.data(), size))
      throw std::runtime_error("the connection broke");
  };
  Timed timed;
  if (outstanding > 1) {
    for (std::uint64_t i = 0; i < outstanding; ++i)
      if (!write_all(fd, out.data(), size)) throw std::runtime_error("the connection broke");
    for (std::uint64_t i = 0; i < warmup; ++i) pipelined();
    timed = time_iterations(iters, pipelined);
    for (std::uint64_t i = 0; i < outstanding; ++i)
      if (!read_all(fd, in.data(), reply)) throw std::runtime_error("the connection broke");
  } else {
    for (std::uint64_t i = 0; i < warmup; ++i) round_trip();
    timed = time_iterations(iters, round_trip);
  }
  ::close(fd);
  if (child.wait(5) != 0) throw std::runtime_error("the child failed");

  JsonObject out_json;
  out_json.add("tool", "ferry-ref-pingpong")
      .add("size", static_cast<std::uint64_t>(size))
      .add("reply", static_cast<std::uint64_t>(reply))
      .add("outstanding", std::max<std::uint64_t>(outstanding, 1));
  add_round_trips(out_json, iters, warmup, std::move(timed));
  out_json.print();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return main_of(argc, argv, "ferry-ref-pingpong",
                 "--size N --reply N --iters N [--warmup N] [--outstanding N]",
                 {{"size", "4096"},
                  {"reply", "64"},
                  {"iters", "10000"},
                  {"warmup", "1000"},
                  {"outstanding", "1"}},
                 run);
}
