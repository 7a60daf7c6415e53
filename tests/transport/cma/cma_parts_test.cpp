// The parts of the same-host method that need no peer: the grant table that keeps cancel()'s
// promise, what Yama's settings mean, and the endpoint's info.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <climits>
#include <cstring>

#include <ferry/ferry.hpp>

#include "loop/event_loop.hpp"
#include "tests/support/util.hpp"
#include "transport/cma/cma_internal.hpp"
#include "transport/cma/grant_table.hpp"
#include "transport/cma/system.hpp"
#include "transport/exposure_table.hpp"
#include "transport/method_selector.hpp"

namespace ferry::transport::cma {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// A second mapping of the owner's table, as a peer process has it.
GrantView view_of(const GrantTable& table) {
  return GrantView(fetch_fd(open_pidfd(::getpid()), ::getpid(), table.fd()), table.bytes());
}

TEST(GrantTable, APeerCopiesOnlyUnderALiveGrantOfItsGeneration) {
  GrantTable table(4);
  GrantView peer = view_of(table);
  auto g = table.open();
  ASSERT_TRUE(g.has_value());
  EXPECT_TRUE(peer.holds(*g));
  ASSERT_TRUE(peer.acquire(*g));
  EXPECT_EQ(table.in_flight(*g), 1u);
  peer.release(*g);
  EXPECT_EQ(table.in_flight(*g), 0u);
  Grant stale = *g;
  stale.generation += 1;
  EXPECT_FALSE(peer.acquire(stale)) << "a grant of another generation was taken";
  EXPECT_TRUE(table.close(*g, Clock::now() + 1s, {}));
  EXPECT_FALSE(peer.acquire(*g)) << "a copy started under an ended grant";
}

TEST(GrantTable, CloseWaitsForTheCopyUnderWayAndNoLonger) {
  GrantTable table(4);
  GrantView peer = view_of(table);
  auto g = table.open();
  ASSERT_TRUE(g.has_value());
  ASSERT_TRUE(peer.acquire(*g));
  std::atomic<bool> released{false};
  std::thread copier([&] {
    std::this_thread::sleep_for(150ms);
    released = true;
    peer.release(*g);
  });
  const auto at = Clock::now();
  EXPECT_TRUE(table.close(*g, Clock::now() + 10s, {}));
  EXPECT_TRUE(released.load()) << "close() returned while a copy was under way";
  EXPECT_LT(Clock::now() - at, 5s) << "close() did not wake when the copy ended";
  copier.join();
}

TEST(GrantTable, ACopyThatOutlivesTheDeadlineQuarantinesItsSlot) {
  GrantTable table(1);
  GrantView peer = view_of(table);
  auto g = table.open();
  ASSERT_TRUE(g.has_value());
  ASSERT_TRUE(peer.acquire(*g));
  EXPECT_FALSE(table.close(*g, Clock::now() + 50ms, {}));
  EXPECT_EQ(table.quarantined(), 1u);
  EXPECT_FALSE(table.open().has_value()) << "a quarantined slot was handed out again";
  peer.release(*g);
}

TEST(GrantTable, APeerThatExitedIsNotWaitedFor) {
  GrantTable table(2);
  GrantView peer = view_of(table);
  auto g = table.open();
  ASSERT_TRUE(g.has_value());
  ASSERT_TRUE(peer.acquire(*g));  // and never released: the peer "died"
  const auto at = Clock::now();
  EXPECT_TRUE(table.close(*g, Clock::now() + 10s, [] { return true; }));
  EXPECT_LT(Clock::now() - at, 1s);
  EXPECT_EQ(table.quarantined(), 0u);
}

TEST(GrantTable, SlotsAreReusedWithAFreshGenerationAndRunOut) {
  GrantTable table(2);
  auto a = table.open();
  auto b = table.open();
  ASSERT_TRUE(a && b);
  EXPECT_FALSE(table.open().has_value());
  ASSERT_TRUE(table.close(*a, Clock::now(), {}));
  auto c = table.open();
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->slot, a->slot);
  EXPECT_NE(c->generation, a->generation);
  GrantView peer = view_of(table);
  EXPECT_FALSE(peer.acquire(*a)) << "the old generation took the reused slot";
  EXPECT_TRUE(peer.acquire(*c));
  peer.release(*c);
}

TEST(GrantTable, ALateReleaseOfAnOldGrantLeavesTheSlotsNextGrantAlone) {
  GrantTable table(1);
  GrantView peer = view_of(table);
  auto old = table.open();
  ASSERT_TRUE(old.has_value());
  ASSERT_TRUE(peer.acquire(*old));
  // The owner stopped waiting (a stopped peer), and the slot went to the next grant.
  ASSERT_TRUE(table.close(*old, Clock::now() + 1s, [] { return true; }));
  auto next = table.open();
  ASSERT_TRUE(next.has_value());
  ASSERT_EQ(next->slot, old->slot);
  ASSERT_TRUE(peer.acquire(*next));
  peer.release(*old);  // the stopped peer resumes and gives back what it held
  EXPECT_EQ(table.in_flight(*next), 1u) << "an old release took the new grant's copy away";
  peer.release(*next);
  EXPECT_EQ(table.in_flight(*next), 0u);
}

TEST(System, AStoppedProcessIsSeenStoppedAndARunningOneNot) {
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    for (;;) ::pause();
  }
  EXPECT_FALSE(process_stopped(child));
  ::kill(child, SIGSTOP);
  bool stopped = false;
  for (int i = 0; i < 200 && !stopped; ++i) {
    std::this_thread::sleep_for(5ms);
    stopped = process_stopped(child);
  }
  EXPECT_TRUE(stopped);
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  EXPECT_FALSE(process_stopped(::getpid()));
}

TEST(GrantView, ASlotOutsideTheTableIsNotHeld) {
  GrantTable table(2);
  GrantView peer = view_of(table);
  EXPECT_FALSE(peer.holds(Grant{2, 1}));
  EXPECT_FALSE(peer.holds(Grant{0, 0}));
  EXPECT_TRUE(peer.holds(Grant{1, 7}));
}

TEST(Yama, EachScopeSaysWhatItMeansForPeers) {
  EXPECT_EQ(yama_reason(-1, false), "");
  EXPECT_EQ(yama_reason(0, false), "");
  EXPECT_NE(yama_reason(1, false).find("ptracer_any"), std::string::npos);
  EXPECT_EQ(yama_reason(1, true), "");
  EXPECT_NE(yama_reason(2, false).find("CAP_SYS_PTRACE"), std::string::npos);
  EXPECT_NE(yama_reason(2, true).find("CAP_SYS_PTRACE"), std::string::npos);
  EXPECT_NE(yama_reason(3, true).find("no process"), std::string::npos);
}

TEST(System, ThisProcessHasAScopeAndMayOfferCmaHere) {
  const ProcessScope self = this_process();
  EXPECT_EQ(self.boot_id.size(), 36u) << self.boot_id;
  EXPECT_NE(self.pid_ns, 0u);
  EXPECT_EQ(self.pid, ::getpid());
  // This machine has no Yama (or scope 0) and no seccomp filter: the same-host method must be
  // on offer. Elsewhere the reason is printed.
  if (yama_ptrace_scope() > 0) GTEST_SKIP() << unavailable_reason(false);
  EXPECT_EQ(unavailable_reason(false), "");
}

TEST(System, CopyGoesOnAfterAPartialCopyAndNamesTheFault) {
  std::vector<char> src(8192, 'x');
  std::vector<char> dst(8192, 0);
  iovec local[2] = {{dst.data(), 4096}, {dst.data() + 4096, 4096}};
  iovec remote[2] = {{src.data(), 4096}, {nullptr, 4096}};  // the second piece is unmapped
  std::uint64_t moved = 0;
  EXPECT_EQ(copy(::getpid(), Access::read, local, remote, 2, moved), EFAULT);
  EXPECT_EQ(moved, 4096u);
  EXPECT_EQ(dst[0], 'x');
  EXPECT_EQ(dst[4096], 0);
}

OwnerInfo sample_info() {
  OwnerInfo info;
  info.scope = this_process();
  info.probe = 0x7f0000001000;
  info.nonce = random_token();
  info.grants_fd = 9;
  info.grants_bytes = 4096;
  return info;
}

TEST(Info, RoundTripsAndRefusesWhatIsWrong) {
  const OwnerInfo info = sample_info();
  const OwnerInfo back = parse_info(to_info(info));
  EXPECT_EQ(back.scope.pid, info.scope.pid);
  EXPECT_EQ(back.scope.boot_id, info.scope.boot_id);
  EXPECT_EQ(back.scope.pid_ns, info.scope.pid_ns);
  EXPECT_EQ(back.probe, info.probe);
  EXPECT_TRUE(tokens_equal(back.nonce, info.nonce));
  EXPECT_EQ(back.grants_fd, 9);
  for (
      const char* bad :
      {"", "[]", "{}", R"({"pid":1})", "not json",
       R"({"pid":-4,"boot_id":"b","pid_ns":1,"probe":"0000000000001000","nonce":"00000000000000000000000000000000","grants":{"fd":3,"bytes":16}})",
       R"({"pid":4,"boot_id":"b","pid_ns":1,"probe":"xyz","nonce":"00000000000000000000000000000000","grants":{"fd":3,"bytes":16}})",
       R"({"pid":4,"boot_id":"b","pid_ns":1,"probe":"0000000000001000","nonce":"00000000000000000000000000000000","grants":{"fd":3,"bytes":0}})"}) {
    try {
      parse_info(bad);
      ADD_FAILURE() << "accepted: " << bad;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::InvalidMetadata) << bad;
      EXPECT_EQ(e.field(), "endpoints");
    }
  }
}

TEST(Address, OnlyAnAbstractNameOfPlainCharacters) {
  sockaddr_un a{};
  socklen_t len = 0;
  EXPECT_TRUE(socket_address("@ferry-cma-0123456789abcdef", a, len));
  EXPECT_EQ(a.sun_path[0], '\0');
  for (const char* bad : {"", "@", "ferry", "/tmp/sock", "@a b", "@a/b", "127.0.0.1:80"})
    EXPECT_FALSE(socket_address(bad, a, len)) << bad;
  EXPECT_FALSE(socket_address("@" + std::string(200, 'a'), a, len));
}

// Another host or PID namespace is judged from the endpoint alone: cma is passed over with
// that reason, and tcp is chosen, with no failure remembered.
TEST(Reach, AnotherHostOrNamespaceIsPassedOverWithItsReason) {
  loop::EventLoop loop;
  auto transport = loop.call([&] {
    CmaTransport::Options o;
    o.local_name = "reach";
    return std::make_unique<CmaTransport>(
        loop.uv(), [&loop](std::function<void()> f) { loop.defer(std::move(f)); }, o);
  });
  Endpoint own = loop.call([&] { return transport->endpoints().at(0); });
  EXPECT_EQ(loop.call([&] { return transport->unreachable(own); }), "");
  OwnerInfo other = sample_info();
  other.scope.boot_id = "00000000-0000-0000-0000-000000000000";
  Endpoint elsewhere{"cma", own.address, to_info(other)};
  const std::string why = loop.call([&] { return transport->unreachable(elsewhere); });
  EXPECT_NE(why.find("another host"), std::string::npos) << why;
  other = sample_info();
  other.scope.pid_ns += 1;
  Endpoint nested{"cma", own.address, to_info(other)};
  EXPECT_NE(loop.call([&] { return transport->unreachable(nested); }).find("PID namespace"),
            std::string::npos);

  MethodSelector selector;
  Capabilities cma_caps = loop.call([&] { return transport->capabilities(); });
  Capabilities tcp_caps;
  tcp_caps.method = "tcp";
  tcp_caps.rank = 100;
  MethodSelector::Needs needs;
  needs.peer = "0123456789abcdef";
  needs.peer_name = "nested";
  needs.same_host = true;
  needs.unreachable["cma"] = "the peer runs in another PID namespace";
  auto choices =
      selector.choose({cma_caps, tcp_caps}, {nested, Endpoint{"tcp", "127.0.0.1:1"}}, needs);
  ASSERT_EQ(choices.size(), 1u);
  EXPECT_EQ(choices[0].local, 1u);
  EXPECT_EQ(selector.failure("0123456789abcdef", "cma"), "");
  loop.close([&] { transport.reset(); });
}

}  // namespace
}  // namespace ferry::transport::cma

namespace ferry {
namespace {

// More pieces than one process_vm_* call takes (IOV_MAX): the copy is cut into jobs of at most
// IOV_MAX pieces, on the thread pool, and every byte lands where the byte stream says.
TEST(CmaBatches, ScatterGatherListsLongerThanIovMaxArriveWhole) {
  ConnectorOptions o = test::named("batches");
  o.transports = {"cma"};
  o.cma.inline_max = 0;
  o.nats.use_environment = false;
  Connector owner(o);
  Connector peer(o);
  constexpr std::size_t kPieces = 2 * IOV_MAX + 77;
  constexpr std::size_t kPiece = 61;
  std::vector<std::byte> src(kPieces * kPiece);
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::byte>((i * 131) % 251);
  std::vector<std::byte> dst(src.size() + kPieces);  // one gap byte after every piece
  std::vector<Descriptor> pieces;
  for (std::size_t i = 0; i < kPieces; ++i)
    pieces.emplace_back(dst.data() + i * (kPiece + 1), kPiece);
  auto readable = owner.create_readable(src);
  auto read = peer.begin_read(readable.metadata(), pieces);
  ASSERT_TRUE(read.wait_for_completion(std::chrono::seconds(30)));
  ASSERT_TRUE(readable.wait_for_completion(std::chrono::seconds(30)));
  EXPECT_EQ(read.method(), "cma");
  for (std::size_t i = 0; i < kPieces; ++i) {
    ASSERT_EQ(std::memcmp(dst.data() + i * (kPiece + 1), src.data() + i * kPiece, kPiece), 0)
        << "piece " << i;
    ASSERT_EQ(dst[i * (kPiece + 1) + kPiece], std::byte{0}) << "gap after piece " << i;
  }
}

}  // namespace
}  // namespace ferry
