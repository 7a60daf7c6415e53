// A NATS reconnect must not take a ferry TCP connection off the loop.
//
// When the NATS server goes away, cnats closes its socket and reconnects later. If the closed
// descriptor's number is reused meanwhile by a TCP connection of ferry's on the same loop,
// nothing that concerns the old NATS socket may touch the new owner of the number: with
// cnats' own libuv adapter, the stale poll handle closed at the reconnect removed the number
// from the loop's epoll set, and the ferry connection was never read again.
//
// The tests make the reuse deterministic: they learn the NATS socket's number from /proc,
// hold every free number below it once cnats has closed it, and let the connector create or
// accept exactly one TCP connection, which then gets that number. After the restart, a second
// transfer over the same (pooled) connection must complete.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <ferry/ferry.hpp>

#include "tests/support/child_process.hpp"
#include "tests/support/nats_server.hpp"
#include "tests/support/patterns.hpp"
#include "tests/support/util.hpp"

namespace ferry {
namespace {

using namespace std::chrono_literals;
using test::eventually;
using test::nats_options;

constexpr int kRounds = 4;
constexpr std::size_t kSize = 64u << 10;

// The inode of the socket behind descriptor `fd` of this process, if it is one.
std::optional<unsigned long> socket_inode(int fd) {
  char link[64] = {};
  std::string path = "/proc/self/fd/" + std::to_string(fd);
  ssize_t n = ::readlink(path.c_str(), link, sizeof link - 1);
  unsigned long inode = 0;
  if (n <= 0 || std::sscanf(link, "socket:[%lu]", &inode) != 1) return std::nullopt;
  return inode;
}

struct TcpSocket {
  std::uint16_t local_port = 0;
  std::uint16_t remote_port = 0;
};

// The IPv4 TCP socket with this inode (/proc/net/tcp), if any.
std::optional<TcpSocket> tcp_socket(unsigned long inode) {
  std::ifstream table("/proc/net/tcp");
  std::string line;
  std::getline(table, line);  // the header
  while (std::getline(table, line)) {
    std::istringstream in(line);
    std::string slot, local, remote, state, queues, timer, retransmits, uid, timeout;
    unsigned long node = 0;
    in >> slot >> local >> remote >> state >> queues >> timer >> retransmits >> uid >> timeout >>
        node;
    if (!in || node != inode) continue;
    auto port = [](const std::string& address) {
      return static_cast<std::uint16_t>(
          std::stoul(address.substr(address.find(':') + 1), nullptr, 16));
    };
    return TcpSocket{port(local), port(remote)};
  }
  return std::nullopt;
}

// This process's descriptors that are TCP sockets connected to `remote_port`.
std::vector<std::pair<int, unsigned long>> connected_to(std::uint16_t remote_port) {
  std::vector<std::pair<int, unsigned long>> found;
  for (int fd = 0; fd < 4096; ++fd)
    if (auto inode = socket_inode(fd))
      if (auto s = tcp_socket(*inode); s && s->remote_port == remote_port)
        found.emplace_back(fd, *inode);
  return found;
}

bool is_tcp_on_port(int fd, std::uint16_t local_port, std::uint16_t remote_port) {
  auto inode = socket_inode(fd);
  if (!inode) return false;
  auto s = tcp_socket(*inode);
  return s && (local_port == 0 || s->local_port == local_port) &&
         (remote_port == 0 || s->remote_port == remote_port);
}

std::uint16_t port_of(const RdmaMetadata& m) {
  const std::string& address = m.endpoints.at(0).address;
  return static_cast<std::uint16_t>(std::stoul(address.substr(address.rfind(':') + 1)));
}

// Holds every free descriptor number below `target`, and `target` itself, with /dev/null.
// release_target() then frees `target` alone: the next descriptor this process creates gets
// it (unless another thread is quicker). False when `target` could not be held.
class HoldBelow {
 public:
  explicit HoldBelow(int target) : target_(target) {
    for (;;) {
      int fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
      if (fd < 0) return;
      if (fd < target) {
        below_.push_back(fd);
        continue;
      }
      if (fd == target)
        held_ = fd;
      else
        ::close(fd);  // someone else has the number now
      return;
    }
  }
  ~HoldBelow() {
    for (int fd : below_) ::close(fd);
    if (held_ >= 0) ::close(held_);
  }
  bool holds_target() const { return held_ >= 0; }
  void release_target() {
    ::close(held_);
    held_ = -1;
  }

 private:
  int target_;
  int held_ = -1;
  std::vector<int> below_;
};

struct EventLog {
  std::mutex mu;
  int disconnected = 0;
  int reconnected = 0;
  std::function<void(SideChannelEvent, const std::string&)> callback() {
    return [this](SideChannelEvent e, const std::string&) {
      std::lock_guard lock(mu);
      if (e == SideChannelEvent::disconnected) ++disconnected;
      if (e == SideChannelEvent::reconnected) ++reconnected;
    };
  }
  int count(SideChannelEvent e) {
    std::lock_guard lock(mu);
    return e == SideChannelEvent::disconnected ? disconnected : reconnected;
  }
};

class NatsFdReuse : public ::testing::Test {
 protected:
  void SetUp() override {
    ConnectorOptions o = nats_options("owner", {server_.url()});
    o.transports = {"tcp"};  // the descriptors watched here are tcp's
    // The reconnect thread's first attempt comes this long after the drop; until then, no
    // other thread of this process creates descriptors.
    o.nats.reconnect_wait = 400ms;
    o.nats.on_event = log_.callback();
    owner_ = std::make_unique<Connector>(o);
  }

  // Kills the server and returns the number cnats' NATS socket had (now closed), or -1.
  int drop_nats() {
    auto before = connected_to(server_.port());
    const int drops = log_.count(SideChannelEvent::disconnected);
    server_.kill();
    if (!eventually([&] { return log_.count(SideChannelEvent::disconnected) > drops; }, 10s))
      return -1;
    for (auto [fd, inode] : before)
      if (socket_inode(fd) != inode) return fd;
    return -1;
  }

  // Restarts the server and waits for the owner to be back.
  bool restore_nats() {
    const int back = log_.count(SideChannelEvent::reconnected);
    server_.start();
    return eventually([&] { return log_.count(SideChannelEvent::reconnected) > back; }, 10s);
  }

  test::NatsServer server_;
  EventLog log_;
  std::unique_ptr<Connector> owner_;
};

// The owner connects: its connection to a peer gets the old NATS socket's number.
TEST_F(NatsFdReuse, AConnectionMadeDuringTheOutageIsStillReadAfterTheReconnect) {
  int reused = 0;
  for (int round = 0; round < kRounds; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    // A fresh peer each round, so that the owner has no pooled connection to it yet.
    Connector peer(test::tcp_only("peer-" + std::to_string(round)));
    auto src = test::patterned(kSize, 1 + round);
    auto dst = test::buffer(kSize);
    auto first = peer.create_readable({Descriptor(src.data(), kSize)});
    const std::uint16_t peer_port = port_of(first.metadata());

    const int old_fd = drop_nats();
    ASSERT_GE(old_fd, 0) << "the NATS socket was not closed on the drop";
    bool took_number = false;
    {
      // If another thread took the number first, the round goes on without the reuse: the
      // transfers must work all the same.
      HoldBelow hold(old_fd);
      if (hold.holds_target()) hold.release_target();
      auto read = owner_->begin_read(first.metadata(), {Descriptor(dst.data(), kSize)});
      ASSERT_TRUE(read.wait_for_completion(10s));
      took_number = is_tcp_on_port(old_fd, 0, peer_port);
    }
    reused += took_number ? 1 : 0;
    EXPECT_EQ(test::first_mismatch(dst.data(), kSize, 1 + round), -1);
    ASSERT_TRUE(restore_nats()) << "the owner did not reconnect";

    // Over the same pooled connection, after the reconnect.
    auto src2 = test::patterned(kSize, 100 + round);
    auto second = peer.create_readable({Descriptor(src2.data(), kSize)});
    OperationOptions bounded;
    bounded.timeout = 5s;
    auto read = owner_->begin_read(second.metadata(), {Descriptor(dst.data(), kSize)}, bounded);
    try {
      EXPECT_TRUE(read.wait_for_completion(10s));
      EXPECT_EQ(test::first_mismatch(dst.data(), kSize, 100 + round), -1);
    } catch (const Error& e) {
      ADD_FAILURE() << "the transfer after the reconnect failed: " << e.what();
    }
    if (took_number) {
      EXPECT_TRUE(is_tcp_on_port(old_fd, 0, peer_port)) << "not the same connection";
    }
  }
  std::printf("rounds in which the NATS socket's number was reused: %d of %d\n", reused, kRounds);
  EXPECT_GT(reused, 0) << "no round reused the NATS socket's number; the test proved nothing";
}

// The owner accepts: a peer in another process connects, and the accepted connection gets
// the old NATS socket's number.
TEST_F(NatsFdReuse, AConnectionAcceptedDuringTheOutageIsStillReadAfterTheReconnect) {
  int reused = 0;
  for (int round = 0; round < kRounds; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    // Another process, so that its descriptors are not ours; started before the drop, so
    // that its pipes are in place.
    test::ChildProcess child(test::peer_command({"reader-" + std::to_string(round)}));
    auto src = test::patterned(kSize, 1 + round);
    auto first = owner_->create_readable({Descriptor(src.data(), kSize)});
    const std::uint16_t owner_port = port_of(first.metadata());

    const int old_fd = drop_nats();
    ASSERT_GE(old_fd, 0) << "the NATS socket was not closed on the drop";
    bool took_number = false;
    {
      HoldBelow hold(old_fd);
      if (hold.holds_target()) hold.release_target();
      child.send_line("read " + std::to_string(1 + round) + " " + first.metadata().to_json());
      EXPECT_EQ(child.read_line(20s), "DONE complete");
      took_number = is_tcp_on_port(old_fd, owner_port, 0);
    }
    reused += took_number ? 1 : 0;
    ASSERT_TRUE(first.wait_for_completion(10s));
    ASSERT_TRUE(restore_nats()) << "the owner did not reconnect";

    // The child reads again over its pooled connection: the owner must still read it.
    auto src2 = test::patterned(kSize, 100 + round);
    auto second = owner_->create_readable({Descriptor(src2.data(), kSize)});
    child.send_line("read " + std::to_string(100 + round) + " " + second.metadata().to_json());
    EXPECT_EQ(child.read_line(20s), "DONE complete") << "the transfer after the reconnect";
    if (took_number) {
      EXPECT_TRUE(is_tcp_on_port(old_fd, owner_port, 0)) << "not the same connection";
    }
    child.send_line("quit");
    child.wait();
  }
  std::printf("rounds in which the NATS socket's number was reused: %d of %d\n", reused, kRounds);
  EXPECT_GT(reused, 0) << "no round reused the NATS socket's number; the test proved nothing";
}

}  // namespace
}  // namespace ferry
