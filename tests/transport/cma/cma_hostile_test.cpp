// Hostile peers of the same-host claim exchange (cma here; cuda_ipc shares its listener and
// link), tried as an adversary would:
//  - a forger that hands a reader metadata naming a victim's process with the forger's own
//    socket, and relays the victim's HELLO (its probe) so that every check of the process
//    passes: the reader must see that the socket is not the victim's before it claims
//    anything, or it becomes the forger's deputy inside the victim's memory;
//  - connections that greet and go silent, past the listener's bounds: honest peers still get
//    in;
//  - CLAIM headers that announce megabytes of ranges under a wrong token: the owner sizes
//    nothing before the token is checked;
//  - a claimant that takes copy grants and never gives them back: the owner's loop waits for
//    it at most peer_timeout in all, not once per claim, and honest peers go on;
//  - an owner whose metadata overstates its grant table: the reader maps nothing.
#include <gtest/gtest.h>

#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <fstream>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <ferry/ferry.hpp>

#include "tests/support/child_process.hpp"
#include "tests/support/patterns.hpp"
#include "tests/support/raw_peer.hpp"
#include "tests/support/util.hpp"
#include "transport/same_host/grant_table.hpp"
#include "transport/same_host/owner_info.hpp"
#include "transport/same_host/system.hpp"
#include "transport/token.hpp"

namespace ferry {
namespace {

using namespace std::chrono_literals;
using test::ChildProcess;
using test::FrameHeader;
using test::FrameType;
using test::RawClient;

ConnectorOptions cma_only(const std::string& name) {
  ConnectorOptions o = test::named(name);
  o.transports = {"cma"};
  o.use_environment = false;
  o.nats.use_environment = false;
  return o;
}

#define SKIP_WITHOUT_CMA()                                                        \
  do {                                                                            \
    for (const MethodInfo& m : probe_methods(cma_only("probe")))                  \
      if (m.method == "cma" && !m.available) GTEST_SKIP() << "cma: " << m.detail; \
  } while (0)

sockaddr_un abstract(const std::string& name, socklen_t& len) {
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  std::memcpy(sa.sun_path + 1, name.data() + 1, name.size() - 1);  // "@name": abstract
  len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + name.size());
  return sa;
}

/// A blocking client connection to the abstract socket `name`; not connected() on failure.
std::unique_ptr<RawClient> connect_to(const std::string& name) {
  socklen_t len = 0;
  sockaddr_un sa = abstract(name, len);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd >= 0 && ::connect(fd, reinterpret_cast<sockaddr*>(&sa), len) != 0) {
    ::close(fd);
    return std::make_unique<RawClient>(RawClient::Adopt{}, -1);
  }
  return std::make_unique<RawClient>(RawClient::Adopt{}, fd);
}

const Endpoint& cma_endpoint(const RdmaMetadata& meta) {
  for (const Endpoint& e : meta.endpoints)
    if (e.method == "cma") return e;
  throw std::runtime_error("the metadata offers no cma endpoint");
}

RdmaMetadata readable_of(ChildProcess& owner, std::size_t size, int seed) {
  owner.send_line("readable " + std::to_string(size) + " " + std::to_string(seed));
  const std::string line = owner.read_line();
  if (line.rfind("META ", 0) != 0) throw std::runtime_error("the owner said: " + line);
  return RdmaMetadata::from_json(line.substr(5));
}

// ---------------------------------------------------------------------------------------
// The confused deputy

TEST(CmaHostile, ASocketThatIsNotTheNamedProcesssIsRefusedBeforeAnyClaim) {
  SKIP_WITHOUT_CMA();
  ChildProcess victim(test::peer_command({"victim"}), {"FERRY_TRANSPORTS=cma"});
  const RdmaMetadata real = readable_of(victim, 64 << 10, 7);
  const std::string victims_socket = cma_endpoint(real).address;

  // The forger's socket, in the metadata in place of the victim's: pid, probe and grant
  // table all still the victim's.
  const std::string forger_name = "@ferry-forger-" + std::to_string(::getpid());
  socklen_t len = 0;
  sockaddr_un sa = abstract(forger_name, len);
  const int listener = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(listener, 0);
  ASSERT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&sa), len), 0) << std::strerror(errno);
  ASSERT_EQ(::listen(listener, 4), 0);
  timeval tv{};
  tv.tv_sec = test::kSocketTimeoutSeconds;
  ::setsockopt(listener, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  RdmaMetadata forged = real;
  std::erase_if(forged.endpoints, [](const Endpoint& e) { return e.method != "cma"; });
  forged.endpoints[0].address = forger_name;

  // The forger relays the HELLOs between the reader and the victim, then waits for the claim.
  std::atomic<bool> relayed{false};
  auto claimed = std::async(std::launch::async, [&]() -> bool {
    const int fd = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) return false;
    RawClient reader(RawClient::Adopt{}, fd);
    auto to_victim = connect_to(victims_socket);
    auto hello = reader.read_any_frame();
    if (!hello || !to_victim->connected() ||
        !to_victim->send_frame(hello->header, hello->message, hello->payload))
      return false;
    auto answer = to_victim->read_any_frame();
    if (!answer || !reader.send_frame(answer->header, answer->message, answer->payload))
      return false;
    relayed = true;
    auto next = reader.read_any_frame();
    return next && next->header.type == FrameType::claim;
  });

  Connector deputy(cma_only("deputy"));
  auto dst = test::buffer(64 << 10);
  auto read = deputy.begin_read(forged, dst);
  const ErrorCode code = test::ended_with(read, 15s);
  EXPECT_FALSE(claimed.get()) << "the reader sent its claim (and the token) to the forger";
  EXPECT_EQ(code, ErrorCode::AccessDenied) << to_string(code);
  EXPECT_FALSE(relayed) << "the reader spoke to the forger's socket";
  ::close(listener);
}

// ---------------------------------------------------------------------------------------
// Bounds on what unauthenticated peers hold

/// Raises the descriptor limit to `want` (or the hard limit); the limit now in force.
rlim_t raise_descriptors(rlim_t want) {
  rlimit r{};
  ::getrlimit(RLIMIT_NOFILE, &r);
  if (r.rlim_cur < want) {
    r.rlim_cur = std::min(want, r.rlim_max);
    ::setrlimit(RLIMIT_NOFILE, &r);
    ::getrlimit(RLIMIT_NOFILE, &r);
  }
  return r.rlim_cur;
}

TEST(CmaHostile, ConnectionsThatGreetAndGoSilentDoNotLockOutHonestPeers) {
  SKIP_WITHOUT_CMA();
  constexpr int kSilent = 1100;
  // Both ends of every connection are in this process.
  if (raise_descriptors(4096) < 2 * kSilent + 256)
    GTEST_SKIP() << "the descriptor limit is below " << 2 * kSilent + 256;
  Connector owner(cma_only("owner"));
  auto src = test::patterned(1 << 20, 4);
  auto readable = owner.create_readable(src);
  const std::string address = cma_endpoint(readable.metadata()).address;

  std::vector<std::unique_ptr<RawClient>> silent;
  int greeted = 0;
  for (int i = 0; i < kSilent; ++i) {
    silent.push_back(connect_to(address));
    if (silent.back()->connected() && silent.back()->greet("silent-" + std::to_string(i)))
      ++greeted;
  }
  EXPECT_GT(greeted, 0) << "no silent connection got in: nothing was tested";

  Connector reader(cma_only("reader"));
  auto dst = test::buffer(1 << 20);
  auto read = reader.begin_read(readable.metadata(), dst);
  try {
    EXPECT_TRUE(read.wait_for_completion(15s)) << "an honest read did not end";
  } catch (const Error& e) {
    ADD_FAILURE() << "an honest read after " << greeted << " silent connections: " << e.what();
  }
  EXPECT_EQ(test::first_mismatch(dst.data(), dst.size(), 4), -1);

  // The owner kept no more of them than ListenerOptions::max_unclaimed.
  std::size_t open = 0;
  for (auto& c : silent) {
    char byte;
    const ssize_t n = ::recv(c->fd(), &byte, 1, MSG_DONTWAIT);
    open += n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) ? 1 : 0;
  }
  EXPECT_LE(open, ListenerOptions{}.max_unclaimed);
}

std::size_t resident_bytes(pid_t pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  return 0;
}

TEST(CmaHostile, ClaimsAnnouncingHugeRangesUnderAWrongTokenCostTheOwnerNothing) {
  SKIP_WITHOUT_CMA();
  constexpr int kConnections = 128;
  constexpr std::uint64_t kAnnounced = 4u << 20;
  ChildProcess owner(test::peer_command({"owner"}), {"FERRY_TRANSPORTS=cma"});
  const RdmaMetadata meta = readable_of(owner, 4096, 3);
  const std::string address = cma_endpoint(meta).address;
  const std::uint64_t op_id = std::stoull(meta.notification_key, nullptr, 16);
  const std::size_t before = resident_bytes(owner.pid());
  ASSERT_GT(before, 0u);

  std::vector<std::unique_ptr<RawClient>> claimants;
  for (int i = 0; i < kConnections; ++i) {
    auto c = connect_to(address);
    ASSERT_TRUE(c->connected() && c->greet("claimant")) << c->error();
    FrameHeader claim;
    claim.type = FrameType::claim;
    claim.req_id = 1;
    claim.op_id = op_id;
    claim.token = transport::random_token();  // not the operation's
    claim.flags = 1;                          // read
    claim.len = kAnnounced;                   // and not one byte of it sent
    ASSERT_TRUE(c->send_frame(claim)) << c->error();
    claimants.push_back(std::move(c));
  }
  // The owner reads each header as it comes (it would answer once the announced ranges have
  // been read and dropped); a second is plenty for 128 headers.
  std::this_thread::sleep_for(1s);
  const std::size_t after = resident_bytes(owner.pid());
  EXPECT_LT(after, before + (64u << 20))
      << kConnections << " claims under a wrong token grew the owner from " << before << " to "
      << after << " bytes resident";
}

// ---------------------------------------------------------------------------------------
// Copy grants held and never given back

TEST(CmaHostile, AClaimantHoldingGrantsStallsTheOwnerOnePeerTimeoutNotOnePerClaim) {
  SKIP_WITHOUT_CMA();
  constexpr int kClaims = 4;
  constexpr auto kPeerTimeout = 1000ms;
  ConnectorOptions o = cma_only("owner");
  o.peer_timeout = kPeerTimeout;
  Connector owner(o);
  std::vector<std::vector<std::byte>> bufs;
  std::vector<ReadableOperation> ops;
  for (int i = 0; i < kClaims; ++i) {
    bufs.push_back(test::patterned(4096, i));
    ops.push_back(owner.create_readable(bufs.back()));
  }
  const RdmaMetadata first = ops[0].metadata();
  const Endpoint& endpoint = cma_endpoint(first);
  auto staller = connect_to(endpoint.address);
  ASSERT_TRUE(staller->connected() && staller->greet("staller")) << staller->error();

  // Every claim honest, its grant taken for a copy, and never given back.
  const transport::same_host::OwnerInfo info = transport::same_host::parse_endpoint(endpoint);
  transport::same_host::GrantView table(
      transport::same_host::fetch_fd(transport::same_host::open_pidfd(::getpid()), ::getpid(),
                                     info.grants_fd),
      info.grants_bytes);
  for (int i = 0; i < kClaims; ++i) {
    const RdmaMetadata meta = ops[static_cast<std::size_t>(i)].metadata();
    FrameHeader claim;
    claim.type = FrameType::claim;
    claim.req_id = static_cast<std::uint64_t>(i) + 1;
    claim.op_id = std::stoull(meta.notification_key, nullptr, 16);
    ASSERT_TRUE(transport::token_from_hex(meta.token, claim.token));
    claim.flags = 1;  // read
    claim.len = 16;
    std::vector<std::byte> range(16);
    const std::uint64_t addr = meta.descriptors.at(0).ptr;
    const std::uint64_t len = meta.descriptors.at(0).size;
    std::memcpy(range.data(), &addr, 8);
    std::memcpy(range.data() + 8, &len, 8);
    ASSERT_TRUE(staller->send_frame(claim, {}, range)) << staller->error();
    auto claimed = staller->read_any_frame();
    ASSERT_TRUE(claimed && claimed->header.type == FrameType::claimed)
        << "claim " << i << ": " << (claimed ? claimed->message : staller->error());
    const transport::same_host::Grant grant{
        static_cast<std::uint32_t>(claimed->header.addr & 0xffffffffu),
        static_cast<std::uint32_t>(claimed->header.addr >> 32)};
    ASSERT_TRUE(table.acquire(grant)) << "claim " << i;
  }

  // Cancelling all of them holds the owner for one peer_timeout (the first), not one each.
  const auto at = std::chrono::steady_clock::now();
  for (auto& op : ops) op.cancel();
  const auto took = std::chrono::steady_clock::now() - at;
  EXPECT_LT(took, 2 * kPeerTimeout + 500ms)
      << "cancelling " << kClaims << " operations a stalled claimant held took "
      << std::chrono::duration_cast<std::chrono::milliseconds>(took).count() << " ms";
  // The staller hears why (a STATUS per operation, then the eviction) and is disconnected;
  // an honest reader is served as before.
  for (int frames = 0; frames < 2 * kClaims + 2 && staller->read_any_frame(); ++frames) {
  }
  EXPECT_TRUE(staller->closed_by_peer()) << staller->error();
  Connector reader(cma_only("reader"));
  auto src = test::patterned(4096, 9);
  auto readable = owner.create_readable(src);
  auto dst = test::buffer(4096);
  auto read = reader.begin_read(readable.metadata(), dst);
  ASSERT_TRUE(read.wait_for_completion(30s));
  EXPECT_EQ(dst, src);
}

// ---------------------------------------------------------------------------------------
// An owner's grant table larger in its metadata than in truth

TEST(CmaHostile, MetadataOverstatingTheOwnersGrantTableIsRefusedNotMapped) {
  SKIP_WITHOUT_CMA();
  Connector owner(cma_only("owner"));
  Connector reader(cma_only("reader"));
  auto src = test::patterned(4096, 4);
  auto readable = owner.create_readable(src);
  RdmaMetadata meta = readable.metadata();
  for (Endpoint& e : meta.endpoints) {
    if (e.method != "cma") continue;
    transport::same_host::OwnerInfo info = transport::same_host::parse_endpoint(e);
    info.grants_bytes *= 4;  // slots past the real end would fault the reader's copies
    e.info = transport::same_host::to_info(info);
  }
  auto dst = test::buffer(4096);
  auto read = reader.begin_read(meta, dst);
  EXPECT_EQ(test::ended_with(read, 30s), ErrorCode::ProtocolError);
  ASSERT_TRUE(read.error().has_value());
  EXPECT_NE(read.error()->message().find("grant table"), std::string::npos) << read.error()->what();
}

}  // namespace
}  // namespace ferry
