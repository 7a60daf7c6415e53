// The same-host method (cma) through the SDK: chosen between processes of this host and moving
// scatter/gather lists both ways; tcp when either side leaves cma out; falling back to tcp when
// process_vm_* is refused (a peer in a user namespace of its own, or a refusal injected by
// tests/support/faulty_transport.hpp) and remembering that per peer; a refusal after the claim;
// more pieces than one system call takes; an owner that breaks the protocol; a cancelled
// operation's memory never touched by a late copy; an owner killed mid-read; what
// probe_methods says.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ferry/ferry.hpp>

#include "tests/support/child_process.hpp"
#include "tests/support/exchange.hpp"
#include "tests/support/faulty_transport.hpp"
#include "tests/support/patterns.hpp"
#include "tests/support/raw_peer.hpp"
#include "tests/support/scattered.hpp"
#include "tests/support/util.hpp"

namespace ferry {

namespace test {
// gtest (and ctest's test list) print parameters by name, not as bytes.
inline void PrintTo(Side side, std::ostream* os) { *os << side_name(side); }
inline void PrintTo(SetupFault fault, std::ostream* os) {
  *os << (fault == SetupFault::none             ? "none"
          : fault == SetupFault::report_failure ? "report_failure"
                                                : "throw_error");
}
}  // namespace test

inline void PrintTo(ErrorCode code, std::ostream* os) { *os << to_string(code); }
inline void PrintTo(OperationStatus status, std::ostream* os) { *os << to_string(status); }

namespace {

using namespace std::chrono_literals;
using test::active_cut;
using test::child_methods;
using test::ChildProcess;
using test::eventually;
using test::exchange;
using test::expect_prefix;
using test::passive_cut;
using test::peer_command;
using test::quit;
using test::Scattered;
using test::SetupFault;
using test::Side;
using test::uneven_cut;

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr auto kWait = 120s;

/// Options that do not read the environment (neither FERRY_TRANSPORTS nor NATS).
ConnectorOptions options(std::string name, std::vector<std::string> transports = {"tcp", "cma"}) {
  ConnectorOptions o = test::named(std::move(name));
  o.transports = std::move(transports);
  o.use_environment = false;
  o.nats.use_environment = false;
  return o;
}

/// As above, with cma made slow: one copy job of `chunk` bytes at a time through the pool, so
/// that a transfer of 256 MiB is under way when the test acts.
ConnectorOptions slow_cma(std::string name, std::size_t chunk = 4096) {
  ConnectorOptions o = options(std::move(name));
  o.cma.chunk_size = chunk;
  o.cma.parallel = 1;
  o.cma.inline_max = 0;
  return o;
}

/// Why cma is not offered here (empty: it is).
std::string cma_missing() {
  for (const MethodInfo& m : probe_methods(options("probe")))
    if (m.method == "cma") return m.available ? std::string() : m.detail;
  return "this build has no cma method";
}

#define SKIP_WITHOUT_CMA()                                        \
  do {                                                            \
    if (const std::string why = cma_missing(); !why.empty())      \
      GTEST_SKIP() << "cma is not offered on this host: " << why; \
  } while (false)

ChildProcess child_with(const std::string& name, const std::string& transports,
                        std::vector<std::string> prefix = {}) {
  std::vector<std::string> argv = std::move(prefix);
  for (std::string& a : peer_command({name})) argv.push_back(std::move(a));
  return ChildProcess(argv, {"FERRY_TRANSPORTS=" + transports});
}

// ---------------------------------------------------------------------------------------
// cma between two processes of this host

class CmaBetweenProcesses : public ::testing::TestWithParam<Side> {};

TEST_P(CmaBetweenProcesses, MovesScatterGatherListsOfEverySize) {
  SKIP_WITHOUT_CMA();
  Connector us(options("parent"));
  ChildProcess child = child_with("child", "tcp,cma");
  const std::vector<std::size_t> sizes = {1, 4096 + 1, kMiB, 64 * kMiB, 256 * kMiB};
  for (std::size_t i = 0; i < sizes.size() && !HasFatalFailure(); ++i)
    exchange(us, child, GetParam(), sizes[i], i, "cma");
  quit(child);
}

std::string side_param(const ::testing::TestParamInfo<Side>& p) { return test::side_name(p.param); }

INSTANTIATE_TEST_SUITE_P(Sides, CmaBetweenProcesses,
                         ::testing::Values(Side::WeRead, Side::WeWrite, Side::OurReadable,
                                           Side::OurWritable),
                         side_param);

// ---------------------------------------------------------------------------------------
// tcp when either side leaves cma out

class CmaLeftOut : public ::testing::TestWithParam<Side> {};

TEST_P(CmaLeftOut, ByTheChildTcpMovesTheBytes) {
  Connector us(options("parent"));
  ChildProcess child = child_with("tcp-child", "tcp");
  exchange(us, child, GetParam(), kMiB + 13, 2, "tcp");
  quit(child);
}

TEST_P(CmaLeftOut, ByUsTcpMovesTheBytes) {
  Connector us(options("parent", {"tcp"}));
  ChildProcess child = child_with("child", "tcp,cma");
  exchange(us, child, GetParam(), kMiB + 13, 3, "tcp");
  quit(child);
}

INSTANTIATE_TEST_SUITE_P(Sides, CmaLeftOut,
                         ::testing::Values(Side::WeRead, Side::WeWrite, Side::OurReadable,
                                           Side::OurWritable),
                         side_param);

// ---------------------------------------------------------------------------------------
// A peer in a user namespace of its own: process_vm_* from it into us is refused

std::string find_program(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path != nullptr ? path : "/usr/bin:/bin");
  std::string dir;
  while (std::getline(dirs, dir, ':'))
    if (!dir.empty() && ::access((dir + "/" + name).c_str(), X_OK) == 0) return dir + "/" + name;
  return {};
}

/// 16 bytes of this process a peer tries to read.
const char kProbeBytes[16] = "ferry-userns";

struct UserNamespace {
  std::vector<std::string> prefix;  // the command line that puts a program in a new one
  std::string skip;                 // why the tests cannot run here (empty: they can)
};

/// Whether `unshare --user --map-root-user` works here, and whether a process in the new user
/// namespace is refused process_vm_readv into this one (checked once).
const UserNamespace& user_namespace() {
  static const UserNamespace found = [] {
    UserNamespace u;
    const std::string unshare = find_program("unshare");
    if (unshare.empty()) {
      u.skip = "no unshare program in PATH";
      return u;
    }
    u.prefix = {unshare, "--user", "--map-root-user"};
    try {
      ChildProcess child = child_with("userns-probe", "tcp,cma", u.prefix);
      char addr[32];
      std::snprintf(addr, sizeof addr, "%llx",
                    static_cast<unsigned long long>(reinterpret_cast<std::uintptr_t>(kProbeBytes)));
      child.send_line("probe_vm " + std::to_string(::getpid()) + " " + addr + " 16");
      const std::string answer = child.read_line(20s);
      child.send_line("quit");
      child.wait();
      if (answer == "PROBE ok")
        u.skip =
            "process_vm_readv from a user namespace of its own into this process is allowed "
            "here; the fallback cannot be provoked this way";
      else if (answer != "PROBE EPERM")
        u.skip = "probing process_vm_readv from a user namespace answered '" + answer + "'";
    } catch (const std::exception& e) {
      u.skip = std::string("a peer under unshare --user --map-root-user did not run: ") + e.what();
    }
    return u;
  }();
  return found;
}

class CmaFromUserNamespace : public ::testing::TestWithParam<Side> {};

// The child is the active side; the kernel refuses its process_vm_readv/writev into us (it
// holds no CAP_SYS_PTRACE over our user namespace), so cma fails at set-up and tcp moves the
// bytes.
TEST_P(CmaFromUserNamespace, TheChildFallsBackToTcp) {
  SKIP_WITHOUT_CMA();
  const UserNamespace& ns = user_namespace();
  if (!ns.skip.empty()) GTEST_SKIP() << ns.skip;
  Connector us(options("parent"));
  ChildProcess child = child_with("userns-child", "tcp,cma", ns.prefix);
  exchange(us, child, GetParam(), 4 * kMiB + 5, 1, "tcp");
  quit(child);
}

INSTANTIATE_TEST_SUITE_P(ChildActs, CmaFromUserNamespace,
                         ::testing::Values(Side::OurReadable, Side::OurWritable), side_param);

/// Whether this process may use process_vm_readv on `pid`: reading an unmapped address fails
/// with EFAULT once permitted, EPERM when not.
bool may_read(pid_t pid) {
  char byte = 0;
  iovec local{&byte, 1};
  iovec remote{reinterpret_cast<void*>(std::uintptr_t{8}), 1};
  const ssize_t got = ::process_vm_readv(pid, &local, 1, &remote, 1, 0);
  return got == 1 || errno != EPERM;
}

class CmaIntoUserNamespace : public ::testing::TestWithParam<Side> {};

// We are the active side and the child, in a user namespace of its own, owns the memory.
// Whether the kernel lets us in depends on our credentials: a process in the parent user
// namespace with CAP_SYS_PTRACE there (root, as here) or whose uid owns the child's namespace
// (an unprivileged user who made it) may read and write the child, so cma is expected; where
// it is refused, tcp is. Either way the bytes arrive.
TEST_P(CmaIntoUserNamespace, UsesWhatTheKernelAllows) {
  SKIP_WITHOUT_CMA();
  const UserNamespace& ns = user_namespace();
  if (!ns.skip.empty()) GTEST_SKIP() << ns.skip;
  Connector us(options("parent"));
  ChildProcess child = child_with("userns-owner", "tcp,cma", ns.prefix);
  child.send_line("status");  // answered once the peer runs in its namespace
  expect_prefix(child.read_line(), "STATUS ");
  const bool allowed = may_read(child.pid());
  std::cout << "process_vm_readv into the child's user namespace is "
            << (allowed ? "allowed: cma expected" : "refused: tcp expected") << std::endl;
  exchange(us, child, GetParam(), 4 * kMiB + 5, 2, allowed ? "cma" : "tcp");
  quit(child);
}

INSTANTIATE_TEST_SUITE_P(WeAct, CmaIntoUserNamespace,
                         ::testing::Values(Side::WeRead, Side::WeWrite), side_param);

// ---------------------------------------------------------------------------------------
// A refusal injected by a decorator of the real cma transport

class CmaRefused : public ::testing::TestWithParam<SetupFault> {};

TEST_P(CmaRefused, FallsBackToTcpAndRemembersThePeer) {
  SKIP_WITHOUT_CMA();
  test::FaultyTransportFactory faulty("cma");
  faulty.control().set_fault(GetParam());
  Connector us(options("us"));
  Connector first(options("first"));
  Connector second(options("second"));
  Connector third(options("third"));
  ASSERT_EQ(faulty.control().transports_made(), 4u);
  constexpr std::size_t kSize = kMiB + 7;

  auto read_from = [&](Connector& owner, std::uint64_t seed, const std::string& method) {
    Scattered src(passive_cut(kSize, seed), seed);
    Scattered dst(active_cut(kSize, seed), 0);
    auto readable = owner.create_readable(src.descriptors());
    auto read = us.begin_read(readable.metadata(), dst.descriptors());
    ASSERT_TRUE(read.wait_for_completion(kWait));
    ASSERT_TRUE(readable.wait_for_completion(kWait));
    EXPECT_EQ(read.method(), method);
    EXPECT_EQ(readable.method(), method);
    EXPECT_EQ(dst.mismatch(seed), -1);
    EXPECT_TRUE(dst.guards_intact());
  };

  // Refused: tcp moves the bytes.
  read_from(first, 1, "tcp");
  EXPECT_EQ(faulty.control().setup_attempts(), 1u);
  EXPECT_EQ(faulty.control().injected(), 1u);
  // The same peer again: cma is not tried again.
  read_from(first, 2, "tcp");
  EXPECT_EQ(faulty.control().setup_attempts(), 1u);
  // A write to that peer neither.
  {
    Scattered src(active_cut(kSize, 3), 3);
    Scattered dst(passive_cut(kSize, 3), 0);
    auto writable = first.create_writable(dst.descriptors());
    auto write = us.begin_write(src.descriptors(), writable.metadata());
    ASSERT_TRUE(write.wait_for_completion(kWait));
    ASSERT_TRUE(writable.wait_for_completion(kWait));
    EXPECT_EQ(write.method(), "tcp");
    EXPECT_EQ(dst.mismatch(3), -1);
  }
  EXPECT_EQ(faulty.control().setup_attempts(), 1u);
  // Another peer is tried again (and refused again).
  read_from(second, 4, "tcp");
  EXPECT_EQ(faulty.control().setup_attempts(), 2u);
  // With the refusals over, a peer not refused before gets cma, through the decorator.
  faulty.control().set_fault(SetupFault::none);
  read_from(third, 5, "cma");
  EXPECT_EQ(faulty.control().setup_attempts(), 3u);
  EXPECT_EQ(faulty.control().injected(), 2u);
  // ...while the refused peers stay on tcp.
  read_from(first, 6, "tcp");
  EXPECT_EQ(faulty.control().setup_attempts(), 3u);
}

INSTANTIATE_TEST_SUITE_P(Faults, CmaRefused,
                         ::testing::Values(SetupFault::report_failure, SetupFault::throw_error),
                         [](const ::testing::TestParamInfo<SetupFault>& p) {
                           return p.param == SetupFault::report_failure ? "ReportedFromTheLoop"
                                                                        : "ThrownByStart";
                         });

TEST(CmaRefused, TheBuiltInMethodIsBackOnceTheDecoratorGoes) {
  SKIP_WITHOUT_CMA();
  {
    test::FaultyTransportFactory faulty("cma");
    faulty.control().set_fault(SetupFault::throw_error);
  }
  Connector us(options("us"));
  Connector them(options("them"));
  auto src = test::patterned(kMiB, 9);
  auto dst = test::buffer(kMiB);
  auto readable = them.create_readable(src);
  auto read = us.begin_read(readable.metadata(), dst);
  ASSERT_TRUE(read.wait_for_completion(kWait));
  EXPECT_EQ(read.method(), "cma");
  EXPECT_EQ(test::first_mismatch(dst.data(), dst.size(), 9), -1);
}

// ---------------------------------------------------------------------------------------
// Refused after the claim: the owner granted the claim, then the kernel refuses the copy jobs
// (the child's pool threads get EPERM from process_vm_*; its loop thread does not, so the probe
// before the claim passes). Once an operation is claimed by cma its owner serves it by cma
// alone, so another method cannot take over. The contract of on_transfer_setup_failed ("before
// any byte was touched: another method may still work") then allows two outcomes: the bytes
// arrive by another method, or the transfer fails as itself -- both sides errored with the
// same code, the active side saying that the copy was refused -- and not as a set-up failure
// whose fallback finds the operation gone. The next transfer toward the same owner then falls
// back at set-up.

class CmaRefusedAfterClaim : public ::testing::TestWithParam<Side> {};

TEST_P(CmaRefusedAfterClaim, FallsBackOrFailsAsItself) {
  SKIP_WITHOUT_CMA();
  const bool reading = GetParam() == Side::OurReadable;
  Connector us(options("parent"));
  ChildProcess child = child_with("refused-child", "tcp,cma");
  child.send_line(std::string("refuse_pool ") +
                  (reading ? "process_vm_readv" : "process_vm_writev"));
  const std::string answer = child.read_line();
  if (answer.rfind("REFUSING ", 0) != 0) GTEST_SKIP() << "cannot refuse the call: " << answer;
  // Above inline_max, so that the copies run on the pool.
  constexpr std::size_t kSize = 4 * kMiB + 5;
  constexpr std::uint64_t kSeed = 31;
  Scattered ours(passive_cut(kSize, 1), reading ? kSeed : 0);
  Operation passive;
  std::string command;
  if (reading) {
    auto readable = us.create_readable(ours.descriptors());
    command = "read_sg " + std::to_string(kSeed) + " " + test::cut_text(active_cut(kSize, 1)) +
              " " + readable.metadata().to_json();
    passive = std::move(readable);
  } else {
    auto writable = us.create_writable(ours.descriptors());
    command = "write_sg " + std::to_string(kSeed) + " " + test::cut_text(active_cut(kSize, 1)) +
              " " + writable.metadata().to_json();
    passive = std::move(writable);
  }
  child.send_line(command);
  const std::string done = child.read_line(kWait);
  const auto [active_method, unused] = child_methods(child);
  if (done == "DONE complete") {
    EXPECT_EQ(active_method, "tcp");
    ASSERT_TRUE(passive.wait_for_completion(kWait));
    EXPECT_EQ(passive.method(), "tcp");
    EXPECT_EQ(ours.mismatch(kSeed), -1);
  } else {
    // "DONE errored <Code> <message>"
    std::istringstream in(done);
    std::string word, status, code;
    in >> word >> status >> code;
    EXPECT_EQ(status, "errored") << done;
    EXPECT_NE(done.find("EPERM"), std::string::npos)
        << "the active side's error is not the refused copy: " << done;
    EXPECT_EQ(active_method, "cma") << "fell back, yet failed: " << done;
    const ErrorCode passive_code = test::ended_with(passive, 10s);
    EXPECT_EQ(std::string(to_string(passive_code)), code)
        << "the two sides disagree; the owner says: "
        << (passive.error() ? passive.error()->what() : std::string("nothing"))
        << "; the child says: " << done;
  }
  // Either way the next transfer toward us does not try cma again: it falls back at set-up.
  exchange(us, child, GetParam(), kSize, 2, "tcp");
  quit(child);
}

INSTANTIATE_TEST_SUITE_P(ChildActs, CmaRefusedAfterClaim,
                         ::testing::Values(Side::OurReadable, Side::OurWritable), side_param);

// ---------------------------------------------------------------------------------------
// Many pieces: process_vm_* takes at most IOV_MAX (1024) pieces a call (EINVAL beyond). The
// pool's copy jobs stop at IOV_MAX pieces; a transfer of at most inline_max bytes is copied on
// the loop in one job of all its pieces, which must be split into calls just the same.

struct ManyPieces {
  bool read = true;           ///< a read (else a write)
  bool active_pieces = true;  ///< the active side is in many pieces (else the passive one)
  std::size_t inline_max = CmaOptions{}.inline_max;
};

void PrintTo(const ManyPieces& p, std::ostream* os) {
  *os << (p.read ? "read" : "write") << ", pieces on the "
      << (p.active_pieces ? "active" : "passive") << " side, inline_max " << p.inline_max;
}

class CmaManyPieces : public ::testing::TestWithParam<ManyPieces> {};

TEST_P(CmaManyPieces, MoreThanIovMaxPiecesArrive) {
  SKIP_WITHOUT_CMA();
  const ManyPieces p = GetParam();
  // 1500 pieces of 32 bytes: 48000 bytes, below the default inline_max (64 KiB).
  const std::vector<std::size_t> many(1500, 32);
  const std::vector<std::size_t> one = {1500 * 32};
  ConnectorOptions active_options = options("active");
  active_options.cma.inline_max = p.inline_max;
  Connector owner(options("owner"));
  Connector active(active_options);
  Scattered passive_mem(p.active_pieces ? one : many, p.read ? 21 : 0);
  Scattered active_mem(p.active_pieces ? many : one, p.read ? 0 : 21);
  Operation passive_op;
  Operation active_op;
  if (p.read) {
    auto readable = owner.create_readable(passive_mem.descriptors());
    active_op = active.begin_read(readable.metadata(), active_mem.descriptors());
    passive_op = std::move(readable);
  } else {
    auto writable = owner.create_writable(passive_mem.descriptors());
    active_op = active.begin_write(active_mem.descriptors(), writable.metadata());
    passive_op = std::move(writable);
  }
  try {
    EXPECT_TRUE(active_op.wait_for_completion(kWait));
  } catch (const Error& e) {
    ADD_FAILURE() << "the " << (p.read ? "read" : "write") << " failed: " << e.what();
  }
  EXPECT_EQ(active_op.method(), "cma");
  EXPECT_EQ((p.read ? active_mem : passive_mem).mismatch(21), -1);
}

INSTANTIATE_TEST_SUITE_P(Cases, CmaManyPieces,
                         ::testing::Values(ManyPieces{true, true}, ManyPieces{true, false},
                                           ManyPieces{false, true}, ManyPieces{false, false},
                                           ManyPieces{true, true, 0}, ManyPieces{false, false, 0}),
                         [](const ::testing::TestParamInfo<ManyPieces>& i) {
                           const ManyPieces& p = i.param;
                           return std::string(p.read ? "Read" : "Write") +
                                  (p.active_pieces ? "IntoActivePieces" : "OfPassivePieces") +
                                  (p.inline_max == 0 ? "OnThePool" : "Inline");
                         });

// ---------------------------------------------------------------------------------------
// An owner that breaks the protocol: the reader's connection to it closes after the notice.
// A transfer begun toward that owner meanwhile opens a second connection (the first takes no
// new requests); when the first closes, the transfer that was on it must still end.

/// A fake cma owner on an abstract Unix socket, in this process: it answers by hand. Reads and
/// accepts are bounded by socket timeouts.
class FakeCmaOwner {
 public:
  FakeCmaOwner() {
    address_ = "@ferry-cma-fake-" + std::to_string(::getpid());
    fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un sa{};
    sa.sun_family = AF_UNIX;
    std::memcpy(sa.sun_path + 1, address_.data() + 1, address_.size() - 1);
    const auto len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + address_.size());
    ok_ = fd_ >= 0 && ::bind(fd_, reinterpret_cast<sockaddr*>(&sa), len) == 0 &&
          ::listen(fd_, 4) == 0;
    timeval tv{};
    tv.tv_sec = test::kSocketTimeoutSeconds;
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  }
  ~FakeCmaOwner() {
    if (fd_ >= 0) ::close(fd_);
  }
  bool ok() const noexcept { return ok_; }
  const std::string& address() const noexcept { return address_; }

  /// Accepts a reader's connection, trades HELLOs and reads its CLAIM; null on failure.
  std::unique_ptr<test::RawClient> accept_claim(test::Frame& claim) {
    const int fd = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) return nullptr;
    auto c = std::make_unique<test::RawClient>(test::RawClient::Adopt{}, fd);
    auto hello = c->read_any_frame();
    if (!hello || hello->header.type != test::FrameType::hello) return nullptr;
    // The probe a reader checks: a nonce in this process's memory (the fake's process is the
    // real owner's), its address and value in HELLO.
    test::FrameHeader h;
    h.type = test::FrameType::hello;
    h.addr = reinterpret_cast<std::uint64_t>(nonce_.data());
    h.token = nonce_;
    if (!c->send_frame(h, "fake-owner")) return nullptr;
    auto f = c->read_any_frame();
    if (!f || f->header.type != test::FrameType::claim) return nullptr;
    claim = *f;
    return c;
  }

 private:
  std::string address_;
  int fd_ = -1;
  bool ok_ = false;
  transport::Token nonce_ = transport::random_token();
};

TEST(CmaBrokenOwner, ATransferOnAConnectionReplacedWhileClosingStillEnds) {
  SKIP_WITHOUT_CMA();
  FakeCmaOwner fake;
  ASSERT_TRUE(fake.ok()) << std::strerror(errno);
  // The real owner's metadata, its cma endpoint alone, pointing at the fake: the reader's
  // checks of the owner's process (its pid, probe and grant table are this process's) pass.
  Connector owner(options("owner"));
  Connector reader(options("reader"));
  auto src = test::patterned(4096, 3);
  auto readable = owner.create_readable(src);
  RdmaMetadata meta = readable.metadata();
  std::erase_if(meta.endpoints, [](const Endpoint& e) { return e.method != "cma"; });
  ASSERT_EQ(meta.endpoints.size(), 1u);
  meta.endpoints[0].address = fake.address();

  // First read: the fake grants a slot outside its table, a protocol error; the reader sends
  // its notice and waits for the fake to close.
  auto dst1 = test::buffer(4096);
  auto read1 = reader.begin_read(meta, dst1);
  test::Frame claim1;
  auto conn1 = fake.accept_claim(claim1);
  ASSERT_TRUE(conn1) << "no CLAIM on the first connection";
  test::FrameHeader bad;
  bad.type = test::FrameType::claimed;
  bad.req_id = claim1.header.req_id;
  bad.op_id = claim1.header.op_id;
  bad.addr = 0xffffffffu | (std::uint64_t{1} << 32);  // slot 0xffffffff, generation 1
  bad.len = 0;
  ASSERT_TRUE(conn1->send_frame(bad));
  auto notice = conn1->read_any_frame();
  ASSERT_TRUE(notice && notice->header.type == test::FrameType::status &&
              notice->header.status == test::wire_status(ErrorCode::ProtocolError))
      << "no ProtocolError notice";

  // Second read toward the same owner, meanwhile: a new connection; the fake refuses it.
  auto dst2 = test::buffer(4096);
  auto read2 = reader.begin_read(meta, dst2);
  test::Frame claim2;
  auto conn2 = fake.accept_claim(claim2);
  ASSERT_TRUE(conn2) << "no CLAIM on a second connection";
  test::FrameHeader no;
  no.type = test::FrameType::status;
  no.req_id = claim2.header.req_id;
  no.status = test::wire_status(ErrorCode::AccessDenied);
  ASSERT_TRUE(conn2->send_frame(no, "refused by the fake owner"));
  EXPECT_EQ(test::ended_with(read2, 5s), ErrorCode::AccessDenied);

  // Now the fake closes the first connection: the first read must end.
  conn1->close();
  const ErrorCode code = test::ended_with(read1, 5s);
  EXPECT_TRUE(code == ErrorCode::ProtocolError || code == ErrorCode::PeerLost) << to_string(code);
}

// ---------------------------------------------------------------------------------------
// Cancelled operations: no copy lands after cancel() has returned

constexpr std::size_t kBig = 256 * kMiB;
constexpr std::byte kSentinel{0xee};

/// Waits until the first 64 KiB of `src` are in `dst`: the copy is under way.
bool landed(const std::byte* dst, const std::byte* src) {
  return eventually(
      [&] { return std::memcmp(test::peek(dst, 64 << 10).data(), src, 64 << 10) == 0; }, 30s);
}

/// Sets all `size` bytes of `dst` to kSentinel, within microseconds where an in-order copy
/// from `src` (one job of `chunk` bytes at a time) has got to: the chunk being copied and the
/// next, backwards from their end, so that a copy still under way there lands on the sentinel
/// and shows. Returns how far the copy had got (the start of the first chunk whose first bytes
/// differ from `src`).
std::size_t sentinel_from_frontier(std::byte* dst, const std::byte* src, std::size_t size,
                                   std::size_t chunk) {
  std::size_t lo = 0;
  std::size_t hi = size / chunk;
  while (lo < hi) {
    const std::size_t mid = (lo + hi) / 2;
    if (std::memcmp(dst + mid * chunk, src + mid * chunk, 8) == 0)
      lo = mid + 1;
    else
      hi = mid;
  }
  auto fill = [&](std::size_t from, std::size_t to) {
    std::memset(dst + from, static_cast<int>(kSentinel), to - from);
  };
  const std::size_t from = lo >= 1 ? (lo - 1) * chunk : 0;
  const std::size_t to = std::min(size, (lo + 1) * chunk);
  for (std::size_t end = to; end > from;) {
    const std::size_t begin = end - std::min<std::size_t>(end - from, 256 << 10);
    fill(begin, end);
    end = begin;
  }
  fill(0, from);
  fill(to, size);
  return std::min(size, lo * chunk);
}

// Small copy jobs (4 KiB: many chances to cancel between two) and large ones (16 MiB: a copy is
// surely under way when cancel() is called, and would go on landing for milliseconds after it
// if cancel() did not wait for it).
class CmaCancel : public ::testing::TestWithParam<std::size_t> {};

TEST_P(CmaCancel, ACancelledWritableIsNeverTouchedByALateCopy) {
  SKIP_WITHOUT_CMA();
  const std::size_t chunk = GetParam();
  Connector owner(options("owner"));
  Connector writer(slow_cma("writer", chunk));
  auto src = std::make_unique_for_overwrite<std::byte[]>(kBig);
  auto dst = std::make_unique_for_overwrite<std::byte[]>(kBig);
  test::fill_pattern(src.get(), kBig, 41);
  for (int round = 1; round <= 3 && !HasFailure(); ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    std::memset(dst.get(), 0, kBig);
    auto writable = owner.create_writable({Descriptor(dst.get(), kBig)});
    auto write = writer.begin_write({Descriptor(src.get(), kBig)}, writable.metadata());
    ASSERT_TRUE(landed(dst.get(), src.get())) << "no byte arrived";
    writable.cancel();
    // From here on the memory is ours again: whatever a late copy would put there shows.
    const std::size_t arrived = sentinel_from_frontier(dst.get(), src.get(), kBig, chunk);
    std::this_thread::sleep_for(200ms);
    EXPECT_EQ(test::first_not(dst.get(), kBig, kSentinel), -1) << "a copy landed after cancel()";
    EXPECT_LT(arrived, kBig) << "the write was over before cancel()";
    EXPECT_EQ(writable.status(), OperationStatus::cancelled);
    EXPECT_EQ(write.method(), "cma");
    const ErrorCode code = test::ended_with(write, 10s);
    EXPECT_TRUE(code == ErrorCode::Cancelled || code == ErrorCode::AccessDenied) << to_string(code);
    EXPECT_EQ(test::first_not(dst.get(), kBig, kSentinel), -1) << "a copy landed after cancel()";
    std::cout << "round " << round << ": cancelled after about " << arrived
              << " bytes had arrived; the write ended " << to_string(code) << std::endl;
  }
}

TEST_P(CmaCancel, ACancelledReadIsNeverTouchedByALateCopy) {
  SKIP_WITHOUT_CMA();
  const std::size_t chunk = GetParam();
  Connector owner(options("owner"));
  Connector reader(slow_cma("reader", chunk));
  auto src = std::make_unique_for_overwrite<std::byte[]>(kBig);
  auto dst = std::make_unique_for_overwrite<std::byte[]>(kBig);
  test::fill_pattern(src.get(), kBig, 43);
  for (int round = 1; round <= 3 && !HasFailure(); ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    std::memset(dst.get(), 0, kBig);
    auto readable = owner.create_readable({Descriptor(src.get(), kBig)});
    auto read = reader.begin_read(readable.metadata(), {Descriptor(dst.get(), kBig)});
    ASSERT_TRUE(landed(dst.get(), src.get())) << "no byte arrived";
    read.cancel();
    const std::size_t arrived = sentinel_from_frontier(dst.get(), src.get(), kBig, chunk);
    std::this_thread::sleep_for(200ms);
    EXPECT_EQ(test::first_not(dst.get(), kBig, kSentinel), -1) << "a copy landed after cancel()";
    EXPECT_LT(arrived, kBig) << "the read was over before cancel()";
    EXPECT_EQ(read.status(), OperationStatus::cancelled);
    EXPECT_EQ(read.method(), "cma");
    // The owner hears that its peer gave up.
    EXPECT_NE(test::ended_with(readable, 10s), ErrorCode::Internal);
  }
}

INSTANTIATE_TEST_SUITE_P(Chunks, CmaCancel, ::testing::Values(std::size_t{4096}, 16 * kMiB),
                         test::size_name);

// ---------------------------------------------------------------------------------------
// The owner killed mid-read

TEST(CmaPeerKilled, OwnerKilledMidReadErrorsTheReadWithPeerLost) {
  SKIP_WITHOUT_CMA();
  Connector us(slow_cma("parent"));
  ChildProcess child = child_with("doomed-owner", "tcp,cma");
  test::expect_owner_killed_mid_read(us, child, "doomed-owner", kBig, "cma");
}

// ---------------------------------------------------------------------------------------
// What this host offers

TEST(CmaProbe, OfferedAboveTcpAndConnectorsAgree) {
  SKIP_WITHOUT_CMA();
  const auto probed = probe_methods(options("probe"));
  // Best first: cuda_ipc and verbs (where built, available or not), cma, tcp.
  std::size_t at = 0;
  while (at < probed.size() && (probed[at].method == "cuda_ipc" || probed[at].method == "verbs"))
    ++at;
  ASSERT_GE(probed.size(), at + 2);
  EXPECT_EQ(probed[at].method, "cma");
  EXPECT_EQ(probed[at].rank, 200);
  EXPECT_TRUE(probed[at].available) << probed[at].detail;
  EXPECT_EQ(probed[at + 1].method, "tcp");
  EXPECT_EQ(probed[at + 1].rank, 100);
  EXPECT_TRUE(probed[at + 1].available) << probed[at + 1].detail;

  Connector c(options("methods"));
  const auto methods = c.methods();
  ASSERT_EQ(methods.size(), probed.size());
  for (std::size_t i = 0; i < methods.size(); ++i) {
    EXPECT_EQ(methods[i].method, probed[i].method);
    EXPECT_EQ(methods[i].rank, probed[i].rank);
    EXPECT_EQ(methods[i].available, probed[i].available) << methods[i].method;
  }
  std::vector<std::string> served;
  for (const Endpoint& e : c.endpoints()) served.push_back(e.method);
  EXPECT_EQ(served, (std::vector<std::string>{"cma", "tcp"}));
}

TEST(CmaProbe, TransportsTcpLeavesCmaOut) {
  for (const auto& methods :
       {probe_methods(options("probe", {"tcp"})), Connector(options("c", {"tcp"})).methods()}) {
    bool seen = false;
    for (const MethodInfo& m : methods) {
      if (m.method == "tcp") {
        EXPECT_TRUE(m.available);
      }
      if (m.method != "cma") continue;
      seen = true;
      EXPECT_FALSE(m.available);
      EXPECT_NE(m.detail.find("left out"), std::string::npos) << m.detail;
    }
    EXPECT_TRUE(seen) << "cma is not listed";
  }
}

}  // namespace
}  // namespace ferry
