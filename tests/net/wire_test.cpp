// ferry_net_wire (tests/net/wire.hpp) between two network namespaces of this test's own
// ("ferrywire-PID-a", "-b"): what it promises, measured from the namespaces' sockets. The delay
// shows in the round trip, the loss in the datagrams that never arrive, the reordering in their
// sequence numbers, the MTU in what passes and what is dropped, a cut in silence until healed.
// Needs root and /dev/net/tun; skips, saying why, without them.

#include "tests/net/wire.hpp"

#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace ferry::netwire {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr const char* kPrefix = "ferrywire-";
constexpr const char* kIpA = "10.234.0.1";
constexpr const char* kIpB = "10.234.0.2";
constexpr int kPort = 7007;

std::string ip_tool() {
  for (const char* p : {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"})
    if (::access(p, X_OK) == 0) return p;
  return {};
}

/// Runs argv (bounded: killed after 10 s); its exit status, -1 when it had to be killed.
int run(const std::vector<std::string>& argv) {
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    const int null = ::open("/dev/null", O_RDWR);
    if (null >= 0) {
      ::dup2(null, STDIN_FILENO);
      ::dup2(null, STDOUT_FILENO);
      ::dup2(null, STDERR_FILENO);
    }
    ::execv(args[0], args.data());
    _exit(127);
  }
  int status = 0;
  for (int i = 0; i < 1000; ++i) {  // 10 s
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    std::this_thread::sleep_for(10ms);
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, &status, 0);
  return -1;
}

/// Deletes the namespaces of wire tests whose process is gone (killed before its teardown).
void sweep_stale() {
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/var/run/netns", ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(kPrefix, 0) != 0) continue;
    const long pid = std::strtol(name.c_str() + std::strlen(kPrefix), nullptr, 10);
    if (pid > 0 && (::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM)) continue;
    run({ip_tool(), "netns", "del", name});
  }
}

/// A socket created inside network namespace `ns` (it stays there; any thread may use it).
int socket_in(const std::string& ns, int type) {
  int fd = -1;
  std::thread t([&] {
    const int nsfd = ::open(("/var/run/netns/" + ns).c_str(), O_RDONLY | O_CLOEXEC);
    if (nsfd < 0) return;
    const int rc = ::setns(nsfd, CLONE_NEWNET);
    ::close(nsfd);
    if (rc == 0) fd = ::socket(AF_INET, type | SOCK_CLOEXEC, 0);
  });
  t.join();
  return fd;
}

sockaddr_in address(const char* ip, int port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  ::inet_pton(AF_INET, ip, &a.sin_addr);
  return a;
}

void set_timeout(int fd, std::chrono::microseconds t) {
  timeval tv{static_cast<time_t>(t.count() / 1000000),
             static_cast<suseconds_t>(t.count() % 1000000)};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
}

/// The wire program, driven over its stdin and stdout; killed (and reaped) by the destructor
/// if it still runs, and with this process should the test be killed (PDEATHSIG).
class WireProcess {
 public:
  explicit WireProcess(const std::vector<std::string>& args) {
    std::vector<std::string> argv{FERRY_NET_WIRE_PATH};
    argv.insert(argv.end(), args.begin(), args.end());
    std::vector<char*> cargs;
    for (const auto& a : argv) cargs.push_back(const_cast<char*>(a.c_str()));
    cargs.push_back(nullptr);
    int in[2], out[2];
    if (::pipe2(in, O_CLOEXEC) != 0 || ::pipe2(out, O_CLOEXEC) != 0)
      throw std::runtime_error("pipe");
    const pid_t parent = ::getpid();
    pid_ = ::fork();
    if (pid_ == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) _exit(1);
      ::dup2(in[0], STDIN_FILENO);
      ::dup2(out[1], STDOUT_FILENO);
      ::execv(cargs[0], cargs.data());
      _exit(127);
    }
    ::close(in[0]);
    ::close(out[1]);
    in_ = in[1];
    out_ = out[0];
  }
  ~WireProcess() {
    close_stdin();
    if (!reaped_) {
      ::kill(pid_, SIGKILL);
      int status;
      ::waitpid(pid_, &status, 0);
    }
    ::close(out_);
  }
  WireProcess(const WireProcess&) = delete;
  WireProcess& operator=(const WireProcess&) = delete;

  std::string read_line(std::chrono::milliseconds timeout = 10s) {
    const auto until = Clock::now() + timeout;
    for (;;) {
      if (auto nl = buffered_.find('\n'); nl != std::string::npos) {
        std::string line = buffered_.substr(0, nl);
        buffered_.erase(0, nl + 1);
        return line;
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now());
      if (left.count() <= 0) return "(no answer in time)";
      pollfd p{out_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
      char buf[4096];
      const ssize_t n = ::read(out_, buf, sizeof buf);
      if (n <= 0) return "(end of output)";
      buffered_.append(buf, static_cast<std::size_t>(n));
    }
  }
  /// Sends a command; its answer.
  std::string cmd(const std::string& line) {
    const std::string l = line + "\n";
    if (::write(in_, l.data(), l.size()) != static_cast<ssize_t>(l.size())) return "(write failed)";
    return read_line();
  }
  void close_stdin() {
    if (in_ >= 0) ::close(in_);
    in_ = -1;
  }
  void signal(int sig) { ::kill(pid_, sig); }
  /// Waits up to `timeout` for the exit; its wait status, -1 when it still runs.
  int wait(std::chrono::milliseconds timeout) {
    const auto until = Clock::now() + timeout;
    int status = 0;
    while (Clock::now() < until) {
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        reaped_ = true;
        return status;
      }
      std::this_thread::sleep_for(10ms);
    }
    return -1;
  }

 private:
  pid_t pid_ = -1;
  int in_ = -1, out_ = -1;
  bool reaped_ = false;
  std::string buffered_;
};

/// A number from the wire's "OK {json}" stats answer: `key` of direction `dir`.
std::uint64_t stat(const std::string& stats, const std::string& dir, const std::string& key) {
  const auto d = stats.find("\"" + dir + "\":");
  if (d == std::string::npos) return ~0ull;
  const auto k = stats.find("\"" + key + "\":", d);
  if (k == std::string::npos) return ~0ull;
  return std::stoull(stats.substr(k + key.size() + 3));
}

/// Echoes every UDP datagram that reaches kIpB:kPort in namespace b, until destroyed.
class Echo {
 public:
  explicit Echo(const std::string& ns) : fd_(socket_in(ns, SOCK_DGRAM)) {
    const sockaddr_in a = address(kIpB, kPort);
    if (fd_ < 0 || ::bind(fd_, reinterpret_cast<const sockaddr*>(&a), sizeof a) != 0)
      throw std::runtime_error(std::string("echo socket: ") + std::strerror(errno));
    set_timeout(fd_, 50ms);
    int big = 8 << 20;
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVBUFFORCE, &big, sizeof big);
    thread_ = std::thread([this] {
      std::vector<char> buf(65536);
      const auto until = Clock::now() + 120s;  // bounded, whatever happens
      while (!stop_.load() && Clock::now() < until) {
        sockaddr_in from{};
        socklen_t len = sizeof from;
        const ssize_t n =
            ::recvfrom(fd_, buf.data(), buf.size(), 0, reinterpret_cast<sockaddr*>(&from), &len);
        if (n < 0) continue;
        if (echo_.load())
          ::sendto(fd_, buf.data(), static_cast<std::size_t>(n), 0,
                   reinterpret_cast<const sockaddr*>(&from), len);
        if (n >= 4) {
          std::uint32_t seq;
          std::memcpy(&seq, buf.data(), 4);
          std::lock_guard lock(mutex_);
          seqs_.push_back(seq);
        }
      }
    });
  }
  ~Echo() {
    stop_.store(true);
    thread_.join();
    ::close(fd_);
  }
  /// Records without answering (a sink for counted datagrams).
  void quiet() { echo_.store(false); }
  std::vector<std::uint32_t> take() {
    std::lock_guard lock(mutex_);
    return std::exchange(seqs_, {});
  }
  std::size_t count() {
    std::lock_guard lock(mutex_);
    return seqs_.size();
  }

 private:
  int fd_;
  std::atomic<bool> stop_{false}, echo_{true};
  std::mutex mutex_;
  std::vector<std::uint32_t> seqs_;
  std::thread thread_;
};

class WireTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "the wire needs root (namespaces, TAP devices)";
    if (::access("/dev/net/tun", R_OK | W_OK) != 0)
      GTEST_SKIP() << "no /dev/net/tun (CONFIG_TUN): no TAP devices here";
    if (ip_tool().empty()) GTEST_SKIP() << "no `ip` (iproute2)";
    sweep_stale();
    const std::string base = kPrefix + std::to_string(::getpid());
    for (const char* side : {"-a", "-b"}) {
      const std::string ns = base + side;
      ASSERT_EQ(run({ip_tool(), "netns", "add", ns}), 0) << "ip netns add " << ns;
      made_.push_back(ns);
      ASSERT_EQ(run({ip_tool(), "-n", ns, "link", "set", "lo", "up"}), 0);
    }
  }
  void TearDown() override {
    echo_.reset();
    wire_.reset();
    if (client_ >= 0) ::close(client_);
    for (const auto& ns : made_) run({ip_tool(), "netns", "del", ns});
  }
  const std::string& a() const { return made_[0]; }
  const std::string& b() const { return made_[1]; }

  /// Starts the wire (TAPs "w0" with kIpA/kIpB), an echo in b and a client socket in a; the
  /// first round trip (unshaped) resolves ARP before any shaping.
  void start(int mtu = 1500, bool offload = true, std::string b_end = {}) {
    if (b_end.empty()) b_end = b() + ":w0:" + kIpB + "/24";
    std::vector<std::string> args{"--a",        a() + ":w0:" + kIpA + "/24",
                                  "--b",        b_end,
                                  "--mtu",      std::to_string(mtu),
                                  "--seed",     "42",
                                  "--lifetime", "120"};
    if (!offload) args.push_back("--no-offload");
    wire_ = std::make_unique<WireProcess>(args);
    const std::string ready = wire_->read_line();
    ASSERT_EQ(ready.rfind("ready seed=42", 0), 0u) << ready;
    echo_ = std::make_unique<Echo>(b());
    if (client_ >= 0) ::close(client_);
    client_ = socket_in(a(), SOCK_DGRAM);
    ASSERT_GE(client_, 0);
    int big = 8 << 20;
    ::setsockopt(client_, SOL_SOCKET, SO_RCVBUFFORCE, &big, sizeof big);
    const sockaddr_in to = address(kIpB, kPort);
    ASSERT_EQ(::connect(client_, reinterpret_cast<const sockaddr*>(&to), sizeof to), 0);
    bool answered = false;
    for (int i = 0; i < 20 && !answered; ++i) answered = ping(500ms) >= 0;
    ASSERT_TRUE(answered) << "no echo through the unshaped wire";
  }

  void shape(const std::string& line) {
    const std::string answer = wire_->cmd(line);
    ASSERT_EQ(answer.rfind("OK", 0), 0u) << line << " -> " << answer;
  }

  /// One datagram of `size` bytes to the echo and back: its round trip in ms, -1 if none came
  /// within `timeout`.
  double ping(std::chrono::milliseconds timeout = 1s, std::size_t size = 64) {
    std::vector<char> buf(std::max<std::size_t>(size, 8));
    const std::uint32_t seq = ++seq_;
    std::memcpy(buf.data(), &seq, 4);
    const auto t0 = Clock::now();
    if (::send(client_, buf.data(), size, 0) != static_cast<ssize_t>(size)) return -1;
    std::vector<char> in(65536);
    const auto until = t0 + timeout;
    for (int i = 0; i < 1000; ++i) {
      const auto left = std::chrono::duration_cast<std::chrono::microseconds>(until - Clock::now());
      if (left.count() <= 0) return -1;
      set_timeout(client_, left);
      const ssize_t n = ::recv(client_, in.data(), in.size(), 0);
      if (n < 0) return -1;
      std::uint32_t got;
      std::memcpy(&got, in.data(), 4);
      if (got == seq)  // an earlier ping's late answer is skipped
        return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    }
    return -1;
  }

  std::vector<double> pings(int n) {
    std::vector<double> rtts;
    for (int i = 0; i < n; ++i) rtts.push_back(ping(1s));
    std::sort(rtts.begin(), rtts.end());
    return rtts;
  }

  /// Sends `n` numbered datagrams to the echo (quiet), paced so that no socket buffer on the
  /// way overflows; returns the sequence numbers in their order of arrival.
  std::vector<std::uint32_t> blast(std::uint32_t n, std::chrono::milliseconds settle) {
    echo_->quiet();
    echo_->take();
    char buf[64] = {};
    for (std::uint32_t i = 0; i < n; ++i) {
      const std::uint32_t seq = 1'000'000 + i;
      std::memcpy(buf, &seq, 4);
      ::send(client_, buf, sizeof buf, 0);
      if (i % 20 == 19) std::this_thread::sleep_for(1ms);
    }
    std::this_thread::sleep_for(settle);
    std::vector<std::uint32_t> got = echo_->take();
    std::erase_if(got, [](std::uint32_t s) { return s < 1'000'000; });
    return got;
  }

  std::vector<std::string> made_;
  std::unique_ptr<WireProcess> wire_;
  std::unique_ptr<Echo> echo_;
  int client_ = -1;
  std::uint32_t seq_ = 0;
};

TEST(WireParse, EndsAndCommands) {
  End e = parse_end("ns1:d0:10.1.2.3/24:master=br0");
  EXPECT_EQ(e.ns, "ns1");
  EXPECT_EQ(e.dev, "d0");
  EXPECT_EQ(e.cidr, "10.1.2.3/24");
  EXPECT_EQ(e.master, "br0");
  e = parse_end("sw:h1d:master=brdata");
  EXPECT_EQ(e.cidr, "");
  EXPECT_EQ(e.master, "brdata");
  EXPECT_THROW(parse_end("justone"), std::invalid_argument);
  EXPECT_THROW(parse_end("ns:averyveryverylongname"), std::invalid_argument);

  Shape s;
  apply_command(s, "delay 10ms jitter 2ms dist normal loss 1% reorder 0.05 rate 100mbit limit 50");
  EXPECT_EQ(s.delay_ns, 10'000'000);
  EXPECT_EQ(s.jitter_ns, 2'000'000);
  EXPECT_EQ(s.dist, Jitter::normal);
  EXPECT_DOUBLE_EQ(s.loss, 0.01);
  EXPECT_DOUBLE_EQ(s.reorder, 0.05);
  EXPECT_EQ(s.rate_bps, 100'000'000);
  EXPECT_EQ(s.limit, 50u);
  apply_command(s, "delay 500us cut");
  EXPECT_EQ(s.delay_ns, 500'000);
  EXPECT_DOUBLE_EQ(s.loss, 0.01);  // unnamed parameters stay
  EXPECT_TRUE(s.cut);
  apply_command(s, "heal");
  EXPECT_FALSE(s.cut);
  for (const char* bad : {"delay 10", "loss 2", "loss -1%", "reorder", "rate 5", "limit 0",
                          "dist pareto", "frobnicate 1"}) {
    Shape t = s;
    EXPECT_THROW(apply_command(t, bad), std::invalid_argument) << bad;
    EXPECT_EQ(describe(t), describe(s)) << bad << " changed the shape";
  }
  apply_command(s, "reset");
  EXPECT_EQ(describe(s), describe(Shape{}));

  // tc's netem syntax replaces the whole shape (a cut stays); correlations are ignored.
  apply_command(s, "loss 5% cut");
  apply_command(s, "netem delay 10ms 2ms 25% distribution normal reorder 25% 50%");
  EXPECT_EQ(s.delay_ns, 10'000'000);
  EXPECT_EQ(s.jitter_ns, 2'000'000);
  EXPECT_EQ(s.dist, Jitter::normal);
  EXPECT_DOUBLE_EQ(s.reorder, 0.25);
  EXPECT_DOUBLE_EQ(s.loss, 0);
  EXPECT_TRUE(s.cut);
  apply_command(s, "netem loss random 1% 10% delay 1ms rate 100mbit limit 200");
  EXPECT_DOUBLE_EQ(s.loss, 0.01);
  EXPECT_EQ(s.delay_ns, 1'000'000);
  EXPECT_EQ(s.jitter_ns, 0);
  EXPECT_EQ(s.rate_bps, 100'000'000);
  EXPECT_EQ(s.limit, 200u);
  apply_command(s, "netem delay 5ms reorder 25%");
  EXPECT_EQ(s.delay_ns, 5'000'000);
  EXPECT_DOUBLE_EQ(s.reorder, 0.25);
  for (const char* bad : {"netem delay", "netem corrupt 1%", "netem duplicate 1%", "netem slot 1"})
    EXPECT_THROW(apply_command(s, bad), std::invalid_argument) << bad;

  // Blocked addresses: added once each, removed by unblock or reset, kept by netem's syntax.
  Shape b;
  apply_command(b, "block 10.0.0.2 block 10.0.0.3 block 10.0.0.2");
  EXPECT_EQ(b.blocked, (std::vector<std::uint32_t>{0x0a000002, 0x0a000003}));
  apply_command(b, "netem delay 1ms");
  EXPECT_EQ(b.blocked.size(), 2u);
  apply_command(b, "unblock 10.0.0.2 unblock 10.0.0.9");
  EXPECT_EQ(b.blocked, (std::vector<std::uint32_t>{0x0a000003}));
  EXPECT_NE(describe(b).find("blocked 10.0.0.3"), std::string::npos) << describe(b);
  for (const char* bad : {"block", "block 10.0.0", "block ::1", "unblock host"}) {
    Shape t = b;
    EXPECT_THROW(apply_command(t, bad), std::invalid_argument) << bad;
    EXPECT_EQ(t.blocked, b.blocked) << bad << " changed the shape";
  }
  apply_command(b, "reset");
  EXPECT_TRUE(b.blocked.empty());
}

TEST_F(WireTest, AnswersCommandsAndRefusesBadOnes) {
  start();
  EXPECT_EQ(wire_->cmd("delay 10ms loss 1%"),
            "OK delay 10ms jitter 0ms dist uniform loss 0.01 reorder 0 rate 0bit limit 1000 "
            "healed");
  EXPECT_EQ(wire_->cmd("delay 10").rfind("ERR ", 0), 0u);
  EXPECT_EQ(wire_->cmd("frobnicate").rfind("ERR ", 0), 0u);
  EXPECT_EQ(wire_->cmd("show").rfind("OK delay 10ms", 0), 0u);
  EXPECT_EQ(wire_->cmd("stats").rfind("OK {\"a_to_b\":{", 0), 0u);
}

TEST_F(WireTest, RoundTripIsTwiceTheDelay) {
  start();
  const std::vector<double> plain = pings(20);
  for (int delay_ms : {1, 10}) {
    shape("delay " + std::to_string(delay_ms) + "ms");
    const std::vector<double> rtt = pings(30);
    ASSERT_GT(rtt.front(), 0) << "a ping got no answer";
    // Each way waits at least the delay; the rest is scheduling on a loaded machine.
    EXPECT_GE(rtt.front(), 2 * delay_ms) << "delay " << delay_ms << " ms";
    EXPECT_LE(rtt[rtt.size() / 2], 2 * delay_ms + 8) << "delay " << delay_ms << " ms";
    std::printf("delay %d ms: rtt min %.2f median %.2f max %.2f ms (unshaped median %.3f)\n",
                delay_ms, rtt.front(), rtt[rtt.size() / 2], rtt.back(), plain[plain.size() / 2]);
  }
  // Jitter: uniform ±5 ms each way spreads the round trips, never below 2 × (10 - 5) ms.
  shape("delay 10ms jitter 5ms");
  std::vector<double> rtt = pings(30);
  ASSERT_GT(rtt.front(), 0);
  EXPECT_GE(rtt.front(), 10.0);
  EXPECT_GT(rtt.back() - rtt.front(), 2.0) << "no spread from jitter";
  // Normal jitter is bounded at 3 sigma: never below 2 × (10 - 3 × 2) ms.
  shape("delay 10ms jitter 2ms dist normal");
  rtt = pings(30);
  ASSERT_GT(rtt.front(), 0);
  EXPECT_GE(rtt.front(), 8.0);
  EXPECT_GT(rtt.back() - rtt.front(), 0.5);
}

TEST_F(WireTest, EachDirectionCanBeShapedAlone) {
  start();
  const std::string answer = wire_->cmd("a>b delay 10ms");
  EXPECT_EQ(answer.rfind("OK a>b delay 10ms", 0), 0u) << answer;
  EXPECT_NE(answer.find("; b>a delay 0ms"), std::string::npos) << answer;
  std::vector<double> rtt = pings(10);
  ASSERT_GT(rtt.front(), 0);
  EXPECT_GE(rtt.front(), 10.0);
  EXPECT_LT(rtt.front(), 19.0) << "the way back was delayed too";
  shape("b>a delay 5ms");
  rtt = pings(10);
  ASSERT_GT(rtt.front(), 0);
  EXPECT_GE(rtt.front(), 15.0);
  // A one-way cut: the requests pass (counted at b), no answer comes back.
  shape("b>a cut");
  const std::size_t before = echo_->count();
  EXPECT_LT(ping(300ms), 0);
  EXPECT_EQ(echo_->count(), before + 1) << "the request did not reach b";
  EXPECT_EQ(wire_->cmd("b>a loss 2").rfind("ERR ", 0), 0u);
  shape("heal");
  EXPECT_GT(ping(1s), 0);
}

TEST_F(WireTest, LossIsTheProbability) {
  start();
  shape("loss 1%");
  const std::uint32_t n = 20000;
  const std::uint64_t in_before = stat(wire_->cmd("stats"), "a_to_b", "in");
  const std::vector<std::uint32_t> got = blast(n, 300ms);
  const std::string stats = wire_->cmd("stats");
  // What reached the wire (the sender's kernel may drop in front of it when the machine is too
  // busy for the wire to keep up, as in front of a NIC; that is not the wire's loss).
  const std::uint64_t reached = std::min<std::uint64_t>(n, stat(stats, "a_to_b", "in") - in_before);
  ASSERT_GE(reached, n * 9 / 10) << "the sender's kernel dropped most datagrams: " << stats;
  const std::uint64_t lost = reached - std::min<std::uint64_t>(reached, got.size());
  const std::uint64_t dropped = stat(stats, "a_to_b", "lost");
  std::printf("loss 1%%: %llu of %llu datagrams lost (%u sent); the wire dropped %llu\n",
              static_cast<unsigned long long>(lost), static_cast<unsigned long long>(reached), n,
              static_cast<unsigned long long>(dropped));
  // Binomial(20000, 0.01): mean 200, sigma 14; 0.5 % .. 2 % is beyond 7 sigma either way.
  EXPECT_GE(lost, reached / 200);
  EXPECT_LE(lost, reached / 50);
  // What went missing is what the wire dropped (nothing behind it lost any).
  EXPECT_LE(std::max(lost, dropped) - std::min(lost, dropped), 10u) << stats;

  shape("loss 0");
  EXPECT_EQ(blast(2000, 200ms).size(), 2000u) << "loss 0 lost datagrams";
}

TEST_F(WireTest, ReorderedFramesOvertake) {
  start();
  // Without reordering a delayed link keeps its order.
  shape("delay 10ms");
  std::vector<std::uint32_t> got = blast(1000, 200ms);
  ASSERT_EQ(got.size(), 1000u);
  EXPECT_TRUE(std::is_sorted(got.begin(), got.end())) << "a delayed link reordered frames";

  shape("delay 10ms reorder 25%");
  const std::uint32_t n = 2000;
  got = blast(n, 200ms);
  ASSERT_EQ(got.size(), n) << "reordering lost frames";
  // A frame overtook if one sent before it arrives after it: its sequence number is above the
  // smallest of those arriving later.
  std::size_t early = 0;
  std::uint32_t later_min = UINT32_MAX;
  for (auto it = got.rbegin(); it != got.rend(); ++it) {
    if (*it > later_min) ++early;
    later_min = std::min(later_min, *it);
  }
  const std::string stats = wire_->cmd("stats");
  std::printf("reorder 25%%: %zu of %u datagrams overtook; the wire sent %llu at once\n", early, n,
              static_cast<unsigned long long>(stat(stats, "a_to_b", "reordered")));
  EXPECT_GE(early, n * 15 / 100);
  EXPECT_LE(early, n * 35 / 100);
}

class WireMtu : public WireTest, public ::testing::WithParamInterface<int> {};

TEST_P(WireMtu, OnlyFramesWithinTheMtuPass) {
  const int mtu = GetParam();
  start(mtu);
  const int df = IP_PMTUDISC_DO;
  ASSERT_EQ(::setsockopt(client_, IPPROTO_IP, IP_MTU_DISCOVER, &df, sizeof df), 0);
  const std::size_t fits = static_cast<std::size_t>(mtu) - 28;  // IPv4 and UDP headers
  EXPECT_GT(ping(1s, fits), 0) << "a datagram of exactly the MTU did not pass";
  // One byte more with DF set: the sender's own stack refuses it (the TAP has the MTU).
  std::vector<char> big(fits + 1);
  EXPECT_EQ(::send(client_, big.data(), big.size(), 0), -1);
  EXPECT_EQ(errno, EMSGSIZE);
  // A host whose interface claims a larger MTU: the wire itself drops the oversized frame.
  ASSERT_EQ(
      run({ip_tool(), "-n", a(), "link", "set", "dev", "w0", "mtu", std::to_string(mtu + 1000)}),
      0);
  ASSERT_EQ(run({ip_tool(), "-n", a(), "route", "flush", "cache"}), 0);
  EXPECT_LT(ping(300ms, fits + 500), 0) << "a frame over the wire's MTU passed";
  EXPECT_GT(ping(1s, fits), 0) << "a frame at the MTU no longer passes";
  const std::string stats = wire_->cmd("stats");
  EXPECT_GE(stat(stats, "a_to_b", "oversize"), 1u) << stats;
}

INSTANTIATE_TEST_SUITE_P(Mtu, WireMtu, ::testing::Values(1500, 9000));

TEST_F(WireTest, QueueIsBounded) {
  start();
  shape("delay 200ms limit 10");
  const std::vector<std::uint32_t> got = blast(100, 400ms);
  const std::string stats = wire_->cmd("stats");
  EXPECT_LE(got.size(), 10u) << "more frames than the queue holds";
  EXPECT_GE(got.size(), 5u);
  EXPECT_GE(stat(stats, "a_to_b", "overflow"), 90u) << stats;
}

TEST_F(WireTest, NetemSyntaxShapesTheLink) {
  start();
  shape("netem delay 5ms 1ms 25%");
  const std::vector<double> rtt = pings(20);
  ASSERT_GT(rtt.front(), 0);
  EXPECT_GE(rtt.front(), 8.0);
  EXPECT_LE(rtt[rtt.size() / 2], 12.0 + 8);
  EXPECT_EQ(wire_->cmd("netem corrupt 1%").rfind("ERR ", 0), 0u);
}

TEST_F(WireTest, EndEnslavedToABridge) {
  // b's address is on a bridge there, as on the lab's switch; the wire's TAP is a port of it.
  ASSERT_EQ(run({ip_tool(), "-n", b(), "link", "add", "br0", "type", "bridge", "forward_delay", "0",
                 "stp_state", "0"}),
            0);
  ASSERT_EQ(run({ip_tool(), "-n", b(), "addr", "add", std::string(kIpB) + "/24", "dev", "br0"}), 0);
  ASSERT_EQ(run({ip_tool(), "-n", b(), "link", "set", "br0", "up"}), 0);
  start(1500, true, b() + ":w0:master=br0");
  shape("delay 2ms");
  const std::vector<double> rtt = pings(10);
  ASSERT_GT(rtt.front(), 0);
  EXPECT_GE(rtt.front(), 4.0);
  EXPECT_EQ(run({ip_tool(), "-n", b(), "link", "show", "w0", "master", "br0"}), 0);
}

TEST_F(WireTest, CutDropsEverythingUntilHealed) {
  start();
  shape("cut");
  for (int i = 0; i < 5; ++i) EXPECT_LT(ping(200ms), 0) << "a ping crossed a cut wire";
  EXPECT_GE(stat(wire_->cmd("stats"), "a_to_b", "cut"), 5u);
  shape("heal");
  bool answered = false;
  for (int i = 0; i < 10 && !answered; ++i) answered = ping(500ms) >= 0;
  EXPECT_TRUE(answered) << "no echo after heal";
}

// A blocked address: its IPv4 packets are dropped both ways; another address blocked leaves the
// link to b alone; unblocked, b answers again.
TEST_F(WireTest, BlockDropsOneAddressOnly) {
  start();
  shape(std::string("block ") + kIpB);
  for (int i = 0; i < 5; ++i) EXPECT_LT(ping(200ms), 0) << "a ping reached a blocked address";
  EXPECT_GE(stat(wire_->cmd("stats"), "a_to_b", "blocked"), 5u);
  shape(std::string("unblock ") + kIpB + " block 10.231.99.99");
  const std::uint64_t dropped = stat(wire_->cmd("stats"), "a_to_b", "blocked");
  bool answered = false;
  for (int i = 0; i < 10 && !answered; ++i) answered = ping(500ms) >= 0;
  EXPECT_TRUE(answered) << "blocking another address cut b off";
  EXPECT_EQ(stat(wire_->cmd("stats"), "a_to_b", "blocked"), dropped);
}

/// Bytes a TCP stream a -> b moves in `seconds` through the wire; MB/s.
double tcp_throughput(const std::string& ns_a, const std::string& ns_b, double seconds) {
  const int listener = socket_in(ns_b, SOCK_STREAM);
  const sockaddr_in at = address(kIpB, kPort + 1);
  const int one = 1;
  ::setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(listener, reinterpret_cast<const sockaddr*>(&at), sizeof at) != 0 ||
      ::listen(listener, 1) != 0)
    return -1;
  set_timeout(listener, 5s);  // accept() gives up too
  std::atomic<std::uint64_t> received{0};
  std::thread reader([&] {
    const int c = ::accept(listener, nullptr, nullptr);
    if (c < 0) return;
    set_timeout(c, 2s);
    std::vector<char> buf(1 << 20);
    for (int i = 0; i < 10'000'000; ++i) {
      const ssize_t n = ::recv(c, buf.data(), buf.size(), 0);
      if (n <= 0) break;
      received.fetch_add(static_cast<std::uint64_t>(n));
    }
    ::close(c);
  });
  const int s = socket_in(ns_a, SOCK_STREAM);
  const timeval send_limit{2, 0};  // a stalled link ends the loop below
  ::setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &send_limit, sizeof send_limit);
  double mbs = -1;
  if (::connect(s, reinterpret_cast<const sockaddr*>(&at), sizeof at) == 0) {
    std::vector<char> buf(1 << 20, 'x');
    const auto t0 = Clock::now();
    const auto until = t0 + std::chrono::duration<double>(seconds);
    const std::uint64_t start = received.load();
    while (Clock::now() < until)
      if (::send(s, buf.data(), buf.size(), MSG_NOSIGNAL) <= 0) break;
    mbs = static_cast<double>(received.load() - start) / 1e6 /
          std::chrono::duration<double>(Clock::now() - t0).count();
  }
  ::close(s);
  reader.join();
  ::close(listener);
  return mbs;
}

/// Sends `size` bytes of a pattern a -> b over TCP (bounded by `limit`); how many arrived
/// before the first wrong one (== size: all arrived intact).
std::uint64_t tcp_verified(const std::string& ns_a, const std::string& ns_b, std::uint64_t size,
                           std::chrono::seconds limit) {
  const int listener = socket_in(ns_b, SOCK_STREAM);
  const sockaddr_in at = address(kIpB, kPort + 2);
  if (::bind(listener, reinterpret_cast<const sockaddr*>(&at), sizeof at) != 0 ||
      ::listen(listener, 1) != 0)
    return 0;
  set_timeout(listener, 5s);
  auto pattern = [](std::uint64_t i) { return static_cast<char>((i % 251) ^ (i >> 20)); };
  const auto until = Clock::now() + limit;
  std::uint64_t good = 0;
  std::thread reader([&] {
    const int c = ::accept(listener, nullptr, nullptr);
    if (c < 0) return;
    set_timeout(c, 2s);
    std::vector<char> buf(1 << 20);
    while (good < size && Clock::now() < until) {
      const ssize_t n = ::recv(c, buf.data(), buf.size(), 0);
      if (n < 0 && errno == EAGAIN) continue;
      if (n <= 0) break;
      for (ssize_t k = 0; k < n; ++k, ++good)
        if (buf[static_cast<std::size_t>(k)] != pattern(good)) {
          ::close(c);
          return;
        }
    }
    ::close(c);
  });
  const int s = socket_in(ns_a, SOCK_STREAM);
  const timeval send_limit{2, 0};
  ::setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &send_limit, sizeof send_limit);
  if (::connect(s, reinterpret_cast<const sockaddr*>(&at), sizeof at) == 0) {
    std::vector<char> buf(1 << 16);
    for (std::uint64_t sent = 0; sent < size && Clock::now() < until;) {
      const std::size_t chunk =
          static_cast<std::size_t>(std::min<std::uint64_t>(buf.size(), size - sent));
      for (std::size_t k = 0; k < chunk; ++k) buf[k] = pattern(sent + k);
      std::size_t off = 0;
      while (off < chunk && Clock::now() < until) {
        const ssize_t n = ::send(s, buf.data() + off, chunk - off, MSG_NOSIGNAL);
        if (n < 0 && errno == EAGAIN) continue;
        if (n <= 0) break;
        off += static_cast<std::size_t>(n);
      }
      if (off < chunk) break;
      sent += chunk;
    }
  }
  reader.join();
  ::close(s);
  ::close(listener);
  return good;
}

class WireTcp : public WireTest, public ::testing::WithParamInterface<bool> {};

// TCP through everything at once: what arrives is the stream that was sent, byte for byte
// (frames are copied while they wait; TSO segments keep their headers).
TEST_P(WireTcp, StreamArrivesIntactThroughAShapedLink) {
  start(1500, GetParam());
  shape("delay 2ms jitter 1ms loss 0.5% reorder 5% rate 400mbit");
  const std::uint64_t size = 16 << 20;
  const auto t0 = Clock::now();
  EXPECT_EQ(tcp_verified(a(), b(), size, 25s), size);
  std::printf("16 MiB through delay 2ms jitter 1ms loss 0.5%% reorder 5%%, %s: %.1f s\n",
              GetParam() ? "offload" : "frames",
              std::chrono::duration<double>(Clock::now() - t0).count());
  // The shaping acted: frames were reordered, and lost where there were enough of them to
  // make a loss certain (with offload a few hundred 64 KiB segments may all pass).
  const std::string stats = wire_->cmd("stats");
  auto both = [&](const char* key) {
    return stat(stats, "a_to_b", key) + stat(stats, "b_to_a", key);
  };
  EXPECT_GT(both("reordered"), 0u) << stats;
  if (both("in") >= 4000) {
    EXPECT_GT(both("lost"), 0u) << stats;
  }
}

INSTANTIATE_TEST_SUITE_P(Offload, WireTcp, ::testing::Bool());

// A measurement, not a check (speed targets live in benchmarks): run it by hand with
// --gtest_also_run_disabled_tests --gtest_filter='*UnshapedThroughput*'.
TEST_F(WireTest, DISABLED_UnshapedThroughput) {
  start(1500, true);
  const double offload = tcp_throughput(a(), b(), 1.5);
  echo_.reset();
  wire_.reset();
  start(1500, false);
  const double frames = tcp_throughput(a(), b(), 1.5);
  std::printf("unshaped wire, MTU 1500, TCP a -> b: %.0f MB/s with offload, %.0f MB/s without\n",
              offload, frames);
  RecordProperty("offload_MBps", static_cast<int>(offload));
  RecordProperty("frames_MBps", static_cast<int>(frames));
  // A sanity floor only (the machine may be loaded); the measured numbers are printed.
  EXPECT_GT(offload, 10.0);
  EXPECT_GT(frames, 5.0);
}

TEST_F(WireTest, RateLimits) {
  start();
  shape("rate 40mbit");
  const double mbs = tcp_throughput(a(), b(), 2.0);
  std::printf("rate 40mbit: TCP a -> b %.2f MB/s\n", mbs);
  // 40 Mbit/s of Ethernet frames (with preamble, FCS and gap: 1538 bytes per 1448 of TCP
  // payload) carry at most 4.71 MB/s of TCP payload.
  EXPECT_LE(mbs, 4.71 * 1.05) << "faster than 40 Mbit/s";
  EXPECT_GE(mbs, 4.71 * 0.1) << "the limited link hardly carried anything";
}

TEST_F(WireTest, EndsWithStdinOrSigtermTakingItsTaps) {
  start();
  echo_.reset();
  wire_->close_stdin();
  int status = wire_->wait(5s);
  EXPECT_TRUE(status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_NE(run({ip_tool(), "-n", a(), "link", "show", "w0"}), 0) << "the TAP outlived the wire";
  EXPECT_NE(run({ip_tool(), "-n", b(), "link", "show", "w0"}), 0) << "the TAP outlived the wire";
  wire_.reset();
  start();
  wire_->signal(SIGTERM);
  status = wire_->wait(5s);
  EXPECT_TRUE(status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_NE(run({ip_tool(), "-n", a(), "link", "show", "w0"}), 0) << "the TAP outlived the wire";
}

}  // namespace
}  // namespace ferry::netwire
