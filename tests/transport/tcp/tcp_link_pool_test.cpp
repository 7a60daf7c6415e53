// The tcp client keeps its connections to owners for reuse, within bounds: metadata that
// names many addresses of one peer (600 ports here, each a fake owner that greets and refuses
// every read) must not leave a reader holding a descriptor per address once its operations
// have ended.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include <ferry/ferry.hpp>

#include "tests/support/patterns.hpp"
#include "tests/support/raw_peer.hpp"
#include "tests/support/util.hpp"

namespace ferry {
namespace {

using namespace std::chrono_literals;
using test::FrameHeader;
using test::FrameType;

std::size_t open_descriptors() {
  std::size_t n = 0;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (::readdir(d) != nullptr) ++n;
    ::closedir(d);
  }
  return n;
}

void send_all(int fd, const void* data, std::size_t size) {
  const auto* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::send(fd, p, size, MSG_NOSIGNAL);
    if (n <= 0) return;
    p += n;
    size -= static_cast<std::size_t>(n);
  }
}

void answer(int fd, FrameHeader h, const std::string& message) {
  h.msg_len = static_cast<std::uint32_t>(message.size());
  const auto bytes = transport::wire::encode(h);
  send_all(fd, bytes.data(), bytes.size());
  send_all(fd, message.data(), message.size());
}

/// Fake owners on every socket of `listeners`, in a child process: each greets and refuses
/// every read. Runs until `quit` reaches end of file.
[[noreturn]] void serve_fakes(const std::vector<int>& listeners, int quit) {
  std::vector<pollfd> fds;
  fds.push_back({quit, POLLIN, 0});
  for (int l : listeners) fds.push_back({l, POLLIN, 0});
  const std::size_t first_conn = fds.size();
  std::map<int, std::string> input;
  for (;;) {
    if (::poll(fds.data(), fds.size(), -1) < 0) continue;
    if (fds[0].revents != 0) ::_exit(0);
    for (std::size_t i = 1; i < first_conn; ++i)
      if (fds[i].revents & POLLIN) {
        const int c = ::accept4(fds[i].fd, nullptr, nullptr, SOCK_CLOEXEC);
        if (c >= 0) fds.push_back({c, POLLIN, 0});
      }
    for (std::size_t i = first_conn; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      char buf[4096];
      const ssize_t n = ::recv(fds[i].fd, buf, sizeof buf, 0);
      if (n <= 0) {
        ::close(fds[i].fd);
        input.erase(fds[i].fd);
        fds.erase(fds.begin() + static_cast<std::ptrdiff_t>(i--));
        continue;
      }
      std::string& in = input[fds[i].fd];
      in.append(buf, static_cast<std::size_t>(n));
      while (in.size() >= transport::wire::kHeaderSize) {
        const FrameHeader h =
            transport::wire::decode(reinterpret_cast<const std::byte*>(in.data()));
        const std::size_t size = transport::wire::kHeaderSize + h.msg_len +
                                 (transport::wire::has_payload(h.type) ? h.len : 0);
        if (in.size() < size) break;
        in.erase(0, size);
        FrameHeader out;
        if (h.type == FrameType::hello) {
          out.type = FrameType::hello;
          out.op_id = 0xfa4e;
          answer(fds[i].fd, out, "fake-owner");
        } else if (h.type == FrameType::read) {
          out.type = FrameType::status;
          out.req_id = h.req_id;
          out.status = test::wire_status(ErrorCode::AccessDenied);
          answer(fds[i].fd, out, "refused by a fake owner");
        }
      }
    }
  }
}

TEST(TcpLinkPool, ManyAddressesOfOnePeerLeaveBoundedDescriptorsBehind) {
  constexpr int kPorts = 600;
  rlimit r{};
  ::getrlimit(RLIMIT_NOFILE, &r);
  if (r.rlim_cur < 2 * kPorts + 256) {
    r.rlim_cur = std::min<rlim_t>(r.rlim_max, 4096);
    ::setrlimit(RLIMIT_NOFILE, &r);
    ::getrlimit(RLIMIT_NOFILE, &r);
  }
  if (r.rlim_cur < 2 * kPorts + 256) GTEST_SKIP() << "the descriptor limit is " << r.rlim_cur;

  std::vector<int> listeners;
  std::vector<int> ports;
  for (int i = 0; i < kPorts; ++i) {
    const int l = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof sa;
    ASSERT_EQ(::bind(l, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0) << std::strerror(errno);
    ASSERT_EQ(::listen(l, 16), 0);
    ASSERT_EQ(::getsockname(l, reinterpret_cast<sockaddr*>(&sa), &len), 0);
    listeners.push_back(l);
    ports.push_back(ntohs(sa.sin_port));
  }
  int quit[2];
  ASSERT_EQ(::pipe2(quit, O_CLOEXEC), 0);
  // No connector exists yet: this process has no other threads to lose in the fork.
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(quit[1]);
    serve_fakes(listeners, quit[0]);
  }
  ::close(quit[0]);
  for (int l : listeners) ::close(l);

  {
    // A real owner's metadata, its endpoint pointed at one fake after another.
    ConnectorOptions o = test::named("owner");
    o.transports = {"tcp"};
    Connector owner(o);
    o.name = "reader";
    Connector reader(o);
    auto memory = test::patterned(4096, 3);
    auto readable = owner.create_readable({Descriptor(memory.data(), memory.size())});
    RdmaMetadata meta = readable.metadata();
    std::erase_if(meta.endpoints, [](const Endpoint& e) { return e.method != "tcp"; });
    ASSERT_EQ(meta.endpoints.size(), 1u);
    auto dst = test::buffer(4096);
    auto read_from = [&](int port) {
      meta.endpoints[0].address = "127.0.0.1:" + std::to_string(port);
      auto read = reader.begin_read(meta, {Descriptor(dst.data(), dst.size())});
      return test::ended_with(read, 10s);
    };
    ASSERT_EQ(read_from(ports[0]), ErrorCode::AccessDenied);
    const std::size_t before = open_descriptors();
    for (int i = 1; i < kPorts; ++i) ASSERT_EQ(read_from(ports[i]), ErrorCode::AccessDenied) << i;
    const std::size_t after = open_descriptors();
    // The pool keeps at most 64 idle connections; a few more may be closing.
    EXPECT_LE(after, before + 64 + 8)
        << kPorts << " operations toward as many addresses, all ended, left " << after - before
        << " more descriptors open";
  }
  ::close(quit[1]);
  int status = 0;
  ::waitpid(child, &status, 0);
}

}  // namespace
}  // namespace ferry
