// Connect floods against a tcp owner, from peers that connect and say nothing:
//  - the owner's loop accepts in bounded batches, so what else it has to do waits a batch,
//    not the whole backlog;
//  - making room evicts connections that have sent nothing before one that greeted, so a
//    burst of silent connects cannot push out a peer that is talking.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <ferry/ferry.hpp>

#include "tests/support/patterns.hpp"
#include "tests/support/raw_peer.hpp"
#include "tests/support/util.hpp"

namespace ferry {
namespace {

using namespace std::chrono_literals;
using namespace test;
using Clock = std::chrono::steady_clock;

/// Whether the server closes `c` within the socket timeout, after whatever it sends first.
bool closed_after_any_notice(RawClient& c) {
  char buf[256];
  for (;;) {
    const ssize_t n = ::recv(c.fd(), buf, sizeof buf, 0);
    if (n == 0 || (n < 0 && errno == ECONNRESET)) return true;
    if (n < 0 && errno != EINTR) return false;
  }
}

/// Connects `n` sockets to `address` ("127.0.0.1:port"), sending nothing; the kernel completes
/// them whether or not the owner accepts.
std::vector<int> connect_many(const std::string& address, int n) {
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  const auto colon = address.rfind(':');
  inet_pton(AF_INET, address.substr(0, colon).c_str(), &sa.sin_addr);
  sa.sin_port = htons(static_cast<std::uint16_t>(std::stoul(address.substr(colon + 1))));
  std::vector<int> fds;
  for (int i = 0; i < n; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) break;
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&sa), sizeof sa) != 0) {
      ::close(fd);
      break;
    }
    fds.push_back(fd);
  }
  return fds;
}

/// How many of `fds` the owner has dealt with: told to go (a notice) or closed.
int answered(const std::vector<int>& fds) {
  int n = 0;
  for (int fd : fds) {
    char byte;
    const ssize_t got = ::recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
    n += got > 0 || got == 0 || (got < 0 && errno == ECONNRESET) ? 1 : 0;
  }
  return n;
}

// A backlog of connects piles up while the owner's loop is busy, then a claimant's DONE
// arrives behind it: the DONE is served after a batch of accepts, not after the whole backlog.
// (Before, one callback accepted until the backlog was empty, and a flood that kept it full
// held the loop there: a create_readable() took 5.2 s during a 6 s flood.) Counted in
// connections dealt with before the DONE's operation completed, not in time.
TEST(TcpFlood, WorkBehindABacklogOfConnectsWaitsABatchOfAcceptsNotTheWholeBacklog) {
  constexpr int kBacklog = 1500;
  rlimit r{};
  ::getrlimit(RLIMIT_NOFILE, &r);
  r.rlim_cur = std::min<rlim_t>(r.rlim_max, 8192);
  ::setrlimit(RLIMIT_NOFILE, &r);
  if (r.rlim_cur < 2 * kBacklog + 256) GTEST_SKIP() << "the descriptor limit is " << r.rlim_cur;

  ConnectorOptions o = test::named("owner");
  o.transports = {"tcp"};
  o.listener.max_unclaimed = 16;  // every connection past 16 makes one go, with a notice
  Connector owner(o);
  auto memory = patterned(4096, 3);
  auto readable = owner.create_readable({Descriptor(memory.data(), memory.size())});
  const Target t = target_of(readable.metadata());
  // A claimant that has read everything and will end the operation later.
  RawClient claimant(t.address);
  ASSERT_TRUE(claimant.connected() && claimant.greet("claimant")) << claimant.error();
  ASSERT_TRUE(claimant.send_frame(request(FrameType::read, t, 1, t.base, 4096)));
  ASSERT_TRUE(is_data(claimant.read_frame(), 1, 4096, 3, 0)) << claimant.error();
  // Runs on the owner's loop the moment the DONE has been served.
  std::vector<int> backlog;
  std::promise<int> seen;
  readable.on_complete([&](OperationStatus, const Error*) { seen.set_value(answered(backlog)); });

  // Hold the loop (a callback of an operation that has ended runs on it) while the backlog
  // piles up.
  auto ended = owner.create_readable({Descriptor(memory.data(), memory.size())},
                                     OperationOptions{.timeout = 1ms, .subject = {}});
  EXPECT_THROW((void)ended.wait_for_completion(10s), Error);
  std::promise<void> holding;
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  ended.on_complete([&](OperationStatus, const Error*) {
    holding.set_value();
    (void)released.wait_for(30s);
  });
  holding.get_future().wait();
  backlog = connect_many(t.address, kBacklog);
  ASSERT_EQ(backlog.size(), static_cast<std::size_t>(kBacklog)) << std::strerror(errno);
  ASSERT_TRUE(claimant.send_frame(done_frame(t, 2, transport::Access::read, 0)));
  release.set_value();
  auto count = seen.get_future();
  ASSERT_EQ(count.wait_for(30s), std::future_status::ready) << "the DONE was never served";
  const int before = count.get();
  EXPECT_LE(before, 64) << "the owner dealt with " << before << " of " << kBacklog
                        << " connects before the DONE that arrived behind them";

  // And it still serves.
  for (int fd : backlog) ::close(fd);
  auto again = owner.create_readable({Descriptor(memory.data(), memory.size())});
  Connector reader(test::named("reader"));
  auto got = buffer(4096);
  auto read = reader.begin_read(again.metadata(), {Descriptor(got.data(), got.size())});
  EXPECT_TRUE(read.wait_for_completion(30s));
  EXPECT_EQ(first_mismatch(got.data(), got.size(), 3), -1);
}

TEST(TcpFlood, ABurstOfSilentConnectsDoesNotEvictAPeerThatGreeted) {
  ConnectorOptions o = test::named("owner");
  o.listener.max_unclaimed = 8;
  o.listener.unclaimed_timeout = 30s;
  Connector owner(o);
  auto memory = patterned(4096, 3);
  auto readable = owner.create_readable({Descriptor(memory.data(), memory.size())});
  const Target t = target_of(readable.metadata());

  RawClient talking(t.address);
  ASSERT_TRUE(talking.connected() && talking.greet("talking")) << talking.error();
  // The burst: five times the room, sending nothing.
  std::vector<std::unique_ptr<RawClient>> silent;
  for (int i = 0; i < 40; ++i) silent.push_back(std::make_unique<RawClient>(t.address));
  // The owner takes them all in, closing the oldest silent ones for room (after a notice).
  ASSERT_TRUE(closed_after_any_notice(*silent.front())) << "the owner never made room";

  // The peer that greeted first, and is the oldest unclaimed connection, is still served.
  ASSERT_TRUE(talking.send_frame(request(FrameType::read, t, 1, t.base, 64))) << talking.error();
  EXPECT_TRUE(is_data(talking.read_frame(), 1, 64, 3, 0)) << talking.error();
}

}  // namespace
}  // namespace ferry
