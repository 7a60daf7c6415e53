#include "tests/net/lab.hpp"

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

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <tuple>

namespace ferry::netlab {

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr const char* kPrefix = "ferrylab-";
constexpr int kNatsPort = 4222;
constexpr int kRoutePort = 6222;
constexpr int kMonitorPort = 8222;

std::string find_tool(const std::string& name) {
  for (const char* dir : {"/usr/sbin/", "/sbin/", "/usr/bin/", "/bin/"}) {
    std::string path = std::string(dir) + name;
    if (::access(path.c_str(), X_OK) == 0) return path;
  }
  return {};
}

std::string ip_tool() {
  static const std::string path = find_tool("ip");
  return path;
}

std::string tc_tool() {
  static const std::string path = find_tool("tc");
  return path;
}

constexpr const char* kNatsServer = "/usr/sbin/nats-server";

std::string joined(const std::vector<std::string>& argv) {
  std::string s;
  for (const auto& a : argv) s += (s.empty() ? "" : " ") + a;
  return s;
}

void must(const std::vector<std::string>& argv) {
  CmdResult r = run(argv);
  if (r.rc != 0)
    throw std::runtime_error("`" + joined(argv) + "` failed (" + std::to_string(r.rc) +
                             "): " + r.out);
}

/// An HTTP GET of `path` at ip:port from inside network namespace `ns`, by a thread of ours
/// that enters it (a network namespace is a per-thread attribute); the body, or empty.
std::string http_get_in(const std::string& ns, const std::string& ip, int port,
                        const std::string& path) {
  std::string response;
  std::thread worker([&] {
    int nsfd = ::open(("/run/netns/" + ns).c_str(), O_RDONLY | O_CLOEXEC);
    if (nsfd < 0) return;
    const int joined_ns = ::setns(nsfd, CLONE_NEWNET);
    ::close(nsfd);
    if (joined_ns != 0) return;
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return;
    timeval tv{1, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<std::uint16_t>(port));
    ::inet_pton(AF_INET, ip.c_str(), &addr.sin_addr);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
      const std::string req = "GET " + path + " HTTP/1.0\r\nHost: lab\r\n\r\n";
      if (::send(fd, req.data(), req.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(req.size())) {
        char buf[16384];
        for (int i = 0; i < 256; ++i) {  // bounded: 4 MiB at most
          ssize_t n = ::recv(fd, buf, sizeof buf, 0);
          if (n <= 0) break;
          response.append(buf, static_cast<std::size_t>(n));
        }
      }
    }
    ::close(fd);
  });
  worker.join();
  auto body = response.find("\r\n\r\n");
  return body == std::string::npos ? std::string() : response.substr(body + 4);
}

/// Whether `pid` runs: a zombie (killed, not yet reaped by its parent) does not.
bool process_alive(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return false;
  // "pid (comm) S ...": the state follows the last ')', since comm may hold anything.
  const auto close = line.rfind(')');
  return close != std::string::npos && close + 2 < line.size() && line[close + 2] != 'Z' &&
         line[close + 2] != 'X';
}

/// SIGKILLs every process in namespace `ns` (ip netns pids), bounded.
void kill_all_in(const std::string& ns) {
  CmdResult r = run({ip_tool(), "netns", "pids", ns}, 5s);
  std::istringstream in(r.out);
  for (long pid; in >> pid;)
    if (pid > 1 && pid != ::getpid()) ::kill(static_cast<pid_t>(pid), SIGKILL);
}

}  // namespace

CmdResult run(const std::vector<std::string>& argv, std::chrono::milliseconds timeout) {
  CmdResult result;
  int out[2];
  if (::pipe2(out, O_CLOEXEC) != 0) {
    result.out = std::string("pipe: ") + std::strerror(errno);
    return result;
  }
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(out[0]);
    ::close(out[1]);
    result.out = std::string("fork: ") + std::strerror(errno);
    return result;
  }
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) _exit(1);
    ::dup2(out[1], STDOUT_FILENO);
    ::dup2(out[1], STDERR_FILENO);
    int null = ::open("/dev/null", O_RDONLY);
    if (null >= 0) ::dup2(null, STDIN_FILENO);
    ::execvp(args[0], args.data());
    _exit(127);
  }
  ::close(out[1]);
  const auto deadline = Clock::now() + timeout;
  bool timed_out = false;
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) {
      timed_out = true;
      break;
    }
    pollfd p{out[0], POLLIN, 0};
    int rc = ::poll(&p, 1, static_cast<int>(left.count()));
    if (rc < 0 && errno == EINTR) continue;
    if (rc <= 0) continue;
    char buf[4096];
    ssize_t n = ::read(out[0], buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    result.out.append(buf, static_cast<std::size_t>(n));
  }
  ::close(out[0]);
  if (timed_out) ::kill(pid, SIGKILL);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  result.rc = timed_out ? -1 : (WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
  return result;
}

std::vector<std::string> lab_namespaces() {
  std::vector<std::string> names;
  if (ip_tool().empty()) return names;
  std::istringstream in(run({ip_tool(), "netns", "list"}, 5s).out);
  for (std::string line; std::getline(in, line);) {
    std::string name = line.substr(0, line.find(' '));
    if (name.rfind(kPrefix, 0) == 0) names.push_back(name);
  }
  return names;
}

void sweep_stale_labs() {
  for (const std::string& name : lab_namespaces()) {
    // ferrylab-<pid>-<part>: the lab of a process that is gone.
    const std::string rest = name.substr(std::strlen(kPrefix));
    char* end = nullptr;
    const long pid = std::strtol(rest.c_str(), &end, 10);
    if (end != rest.c_str() && pid > 0 && process_alive(static_cast<pid_t>(pid))) continue;
    kill_all_in(name);
    run({ip_tool(), "netns", "del", name}, 5s);
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator("/tmp", ec))
      if (e.path().filename().string().rfind(std::string(kPrefix) + std::to_string(pid) + "-", 0) ==
          0)
        std::filesystem::remove(e.path(), ec);
  }
}

std::string missing_prerequisite() {
  if (::geteuid() != 0) return "the network lab needs root (network namespaces, veth, tc)";
  if (ip_tool().empty()) return "no `ip` (iproute2) found in /usr/sbin, /sbin, /usr/bin, /bin";
  if (tc_tool().empty()) return "no `tc` (iproute2) found in /usr/sbin, /sbin, /usr/bin, /bin";
  if (::access(kNatsServer, X_OK) != 0) return std::string("no ") + kNatsServer;
  const std::string probe = std::string(kPrefix) + std::to_string(::getpid()) + "-probe";
  CmdResult r = run({ip_tool(), "netns", "add", probe});
  if (r.rc != 0) return "`ip netns add` failed: " + r.out;
  std::string why;
  r = run({ip_tool(), "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1"});
  if (r.rc != 0) why = "cannot create a veth pair: " + r.out;
  if (why.empty()) {
    r = run({ip_tool(), "-n", probe, "link", "add", "b0", "type", "bridge"});
    if (r.rc != 0) why = "cannot create a bridge: " + r.out;
  }
  run({ip_tool(), "netns", "del", probe});
  return why;
}

Lab::Lab(int hosts, int mtu)
    : hosts_(hosts), prefix_(std::string(kPrefix) + std::to_string(::getpid())) {
  sweep_stale_labs();
  nats_.resize(static_cast<std::size_t>(hosts_));
  for (int h = 0; h < hosts_; ++h) logs_.push_back("/tmp/" + ns(h) + "-nats.log");
  try {
    build(mtu);
  } catch (...) {
    teardown();
    throw;
  }
}

Lab::~Lab() { teardown(); }

std::string Lab::ns(int host) const { return prefix_ + "-h" + std::to_string(host); }
std::string Lab::nats_ip(int host) const { return "10.231.1." + std::to_string(10 + host); }
std::string Lab::data_ip(int host) const { return "10.231.2." + std::to_string(10 + host); }

std::string Lab::nats_urls(int host) const {
  std::string urls = "nats://" + nats_ip(host) + ":" + std::to_string(kNatsPort);
  for (int h = 0; h < hosts_; ++h)
    if (h != host) urls += ",nats://" + nats_ip(h) + ":" + std::to_string(kNatsPort);
  return urls;
}

std::vector<std::string> Lab::in_host(int host, const std::vector<std::string>& command) const {
  std::vector<std::string> argv{ip_tool(), "netns", "exec", ns(host)};
  argv.insert(argv.end(), command.begin(), command.end());
  return argv;
}

void Lab::sh_switch(const std::vector<std::string>& args) const {
  std::vector<std::string> argv{ip_tool(), "-n", prefix_ + "-sw"};
  argv.insert(argv.end(), args.begin(), args.end());
  must(argv);
}

void Lab::build(int mtu) {
  mtu_ = mtu;
  const std::string sw = prefix_ + "-sw";
  const std::string m = std::to_string(mtu);
  must({ip_tool(), "netns", "add", sw});
  for (int h = 0; h < hosts_; ++h) must({ip_tool(), "netns", "add", ns(h)});
  sh_switch({"link", "set", "lo", "up"});
  for (const char* br : {"brnats", "brdata"}) {
    // No STP and no forwarding delay: a port forwards as soon as its link is up, also
    // after a cut link is healed.
    sh_switch({"link", "add", br, "type", "bridge", "forward_delay", "0", "stp_state", "0"});
  }
  for (int h = 0; h < hosts_; ++h) {
    const std::string host = ns(h);
    must({ip_tool(), "-n", host, "link", "set", "lo", "up"});
    for (const auto& [net, dev, br, ip] : {std::tuple{"n", "n0", "brnats", nats_ip(h)},
                                           std::tuple{"d", "d0", "brdata", data_ip(h)}}) {
      const std::string end = "h" + std::to_string(h) + net;
      sh_switch({"link", "add", end, "mtu", m, "type", "veth", "peer", "name", dev, "mtu", m,
                 "netns", host});
      sh_switch({"link", "set", end, "master", br, "up"});
      must({ip_tool(), "-n", host, "addr", "add", ip + "/24", "dev", dev});
      must({ip_tool(), "-n", host, "link", "set", dev, "up"});
    }
  }
  for (const char* br : {"brnats", "brdata"}) sh_switch({"link", "set", br, "mtu", m, "up"});
  for (int h = 0; h < hosts_; ++h) start_nats(h);
  await_cluster();
}

void Lab::teardown() noexcept {
  try {
    wires_.clear();  // before the namespaces go: a TAP's fd would keep its namespace alive
    for (auto& p : nats_) p.reset();
    for (int h = 0; h < hosts_; ++h) kill_all_in(ns(h));
    for (int h = 0; h < hosts_; ++h) run({ip_tool(), "netns", "del", ns(h)}, 5s);
    run({ip_tool(), "netns", "del", prefix_ + "-sw"}, 5s);
    for (const auto& log : logs_) std::remove(log.c_str());
  } catch (...) {
  }
}

std::vector<std::string> Lab::devices(int host, Net net) const {
  std::vector<std::string> d;
  const std::string h = "h" + std::to_string(host);
  if (net != Net::data) d.push_back(h + "n");
  if (net != Net::nats) d.push_back(h + "d");
  return d;
}

void Lab::set_link(int host, Net net, bool up) {
  for (const auto& dev : devices(host, net)) sh_switch({"link", "set", dev, up ? "up" : "down"});
}

bool Lab::netem_in_userspace() const {
  static const bool in_userspace = [this] {
    const std::string sw = prefix_ + "-sw";
    CmdResult r =
        run({tc_tool(), "-n", sw, "qdisc", "add", "dev", "h0d", "root", "netem", "delay", "1ms"});
    if (r.rc == 0) run({tc_tool(), "-n", sw, "qdisc", "del", "dev", "h0d", "root"});
    return r.rc != 0;
  }();
  return in_userspace;
}

netwire::Wire& Lab::wire(int host, char net) {
  auto& w = wires_[{host, net}];
  if (w) return *w;
  const std::string h = "h" + std::to_string(host);
  const std::string sw = prefix_ + "-sw";
  const bool data = net == 'd';
  // The veth pair goes (deleting one end deletes both); two TAPs of the same names take its
  // place, the host's with its address, the switch's in the same bridge.
  must({ip_tool(), "-n", sw, "link", "del", h + net});
  netwire::Options o;
  o.a = netwire::End{ns(host), data ? "d0" : "n0", (data ? data_ip(host) : nats_ip(host)) + "/24",
                     ""};
  o.b = netwire::End{sw, h + net, "", data ? "brdata" : "brnats"};
  o.mtu = mtu_;
  o.seed = static_cast<std::uint64_t>(host) * 2 + (data ? 1 : 0) + 1;
  w = std::make_unique<netwire::Wire>(o);
  return *w;
}

void Lab::shape(int host, Net net, const std::vector<std::string>& qdisc) {
  if (!qdisc.empty() && qdisc.front() == "netem" && netem_in_userspace()) {
    std::string line;
    for (const std::string& word : qdisc) line += (line.empty() ? "" : " ") + word;
    for (char n : {'n', 'd'})
      if ((n == 'n' && net != Net::data) || (n == 'd' && net != Net::nats))
        wire(host, n).command(line);
    return;
  }
  if (qdisc.empty())
    for (auto& [key, w] : wires_)
      if (key.first == host &&
          ((key.second == 'n' && net != Net::data) || (key.second == 'd' && net != Net::nats)))
        w->command("netem");  // unshaped again (a cut stays: set_link heals it)
  // Both ends: the switch's end shapes what goes to the host, the host's end what leaves it.
  std::vector<std::pair<std::string, std::string>> ends;
  for (const auto& dev : devices(host, net)) {
    ends.emplace_back(prefix_ + "-sw", dev);
    ends.emplace_back(ns(host), dev.back() == 'n' ? "n0" : "d0");
  }
  for (const auto& [space, dev] : ends) {
    if (qdisc.empty()) {
      run({tc_tool(), "-n", space, "qdisc", "del", "dev", dev, "root"});
      continue;
    }
    std::vector<std::string> argv{tc_tool(), "-n", space, "qdisc", "replace", "dev", dev, "root"};
    argv.insert(argv.end(), qdisc.begin(), qdisc.end());
    must(argv);
  }
}

void Lab::wire_command(int host, Net net, const std::string& line) {
  for (char n : {'n', 'd'})
    if ((n == 'n' && net != Net::data) || (n == 'd' && net != Net::nats))
      wire(host, n).command(line);
}

std::string Lab::wire_missing() {
  if (::access("/dev/net/tun", R_OK | W_OK) != 0)
    return "no /dev/net/tun here, which ferry_net_wire needs for its TAP devices";
  return {};
}

std::string Lab::netem_missing() const {
  if (!netem_in_userspace()) return {};
  if (::access("/dev/net/tun", R_OK | W_OK) != 0)
    return "tc netem is unavailable here (sch_netem not built or not loadable), and so is "
           "/dev/net/tun for ferry_net_wire, which plays netem without it";
  return {};
}

void Lab::start_nats(int host) {
  auto& slot = nats_[static_cast<std::size_t>(host)];
  if (slot) return;
  std::string routes;
  for (int h = 0; h < hosts_; ++h)
    if (h != host)
      routes += (routes.empty() ? "" : ",") + std::string("nats://") + nats_ip(h) + ":" +
                std::to_string(kRoutePort);
  const std::string ip = nats_ip(host);
  std::vector<std::string> argv{kNatsServer,
                                "-a",
                                ip,
                                "-p",
                                std::to_string(kNatsPort),
                                "-m",
                                std::to_string(kMonitorPort),
                                "-n",
                                ns(host),
                                "--cluster_name",
                                "ferrylab",
                                "--cluster",
                                "nats://" + ip + ":" + std::to_string(kRoutePort),
                                "-l",
                                logs_[static_cast<std::size_t>(host)]};
  if (!routes.empty()) {
    argv.push_back("--routes");
    argv.push_back(routes);
  }
  slot = std::make_unique<test::ChildProcess>(in_host(host, argv));
  const auto until = Clock::now() + 10s;
  while (http_get_in(ns(host), ip, kMonitorPort, "/varz").empty()) {
    if (Clock::now() > until)
      throw std::runtime_error("nats-server of " + ns(host) + " did not come up; its log:\n" +
                               nats_log(host));
    std::this_thread::sleep_for(20ms);
  }
}

void Lab::kill_nats(int host) {
  auto& slot = nats_[static_cast<std::size_t>(host)];
  if (!slot) return;
  slot->kill(SIGKILL);
  slot->wait();
  slot.reset();
}

void Lab::await_cluster(std::chrono::milliseconds limit) {
  int running = 0;
  for (const auto& p : nats_) running += p ? 1 : 0;
  const auto until = Clock::now() + limit;
  for (int h = 0; h < hosts_; ++h) {
    if (!nats_[static_cast<std::size_t>(h)]) continue;
    // Each server routes to every other running one (nats-server 2.9: one route per peer).
    std::set<std::string> peers;
    while (static_cast<int>(peers.size()) < running - 1) {
      peers.clear();
      const std::string body = http_get_in(ns(h), nats_ip(h), kMonitorPort, "/routez");
      json z = json::parse(body, nullptr, false);
      if (!z.is_discarded() && z.contains("routes") && z["routes"].is_array())
        for (const auto& r : z["routes"])
          if (r.contains("remote_id")) peers.insert(r["remote_id"].get<std::string>());
      if (static_cast<int>(peers.size()) >= running - 1) break;
      if (Clock::now() > until)
        throw std::runtime_error("the NATS cluster did not form: " + ns(h) + " has " +
                                 std::to_string(peers.size()) + " routes of " +
                                 std::to_string(running - 1) + "; its log:\n" + nats_log(h));
      std::this_thread::sleep_for(50ms);
    }
  }
}

std::string Lab::nats_log(int host) const {
  std::ifstream in(logs_[static_cast<std::size_t>(host)]);
  std::stringstream s;
  s << in.rdbuf();
  std::string text = s.str();
  return text.size() > 4000 ? text.substr(text.size() - 4000) : text;
}

Worker::Worker(const Lab& lab, int host, std::string name, WorkerOptions options)
    : name_(std::move(name)), host_(host) {
  const int first = options.nats_host < 0 ? host : options.nats_host;
  std::string urls = lab.nats_urls(first);
  if (!options.all_servers) urls = urls.substr(0, urls.find(','));
  std::vector<std::string> argv{FERRY_NET_WORKER_PATH,
                                "--name",
                                name_,
                                "--nats",
                                urls,
                                "--transports",
                                options.transports,
                                "--peer-timeout",
                                std::to_string(options.peer_timeout_ms),
                                "--subject-timeout",
                                std::to_string(options.subject_timeout_ms)};
  if (options.nats_ping_ms > 0) {
    argv.push_back("--nats-ping");
    argv.push_back(std::to_string(options.nats_ping_ms));
  }
  if (options.bind_data) {
    argv.push_back("--bind");
    argv.push_back(lab.data_ip(host));
  }
  process_ = std::make_unique<test::ChildProcess>(lab.in_host(host, argv));
  const std::string line = process_->read_line(std::chrono::seconds(20));
  ready_ = json::parse(line, nullptr, false);
  if (ready_.is_discarded() || !ready_.value("ready", false))
    throw std::runtime_error("worker " + name_ + " did not start: " + line);
}

json Worker::cmd(const std::string& line, std::chrono::milliseconds timeout) {
  process_->send_line(line);
  const std::string answer = process_->read_line(timeout);
  json j = json::parse(answer, nullptr, false);
  if (j.is_discarded()) throw std::runtime_error(name_ + " answered `" + answer + "`");
  return j;
}

Worker::~Worker() {
  if (killed_ || !process_) return;
  try {
    process_->send_line("quit");
  } catch (const std::exception&) {
  }
  const auto start = Clock::now();
  const int status = process_->wait(10s);
  const bool clean = WIFEXITED(status) && WEXITSTATUS(status) == 0;
  if (!clean || Clock::now() - start >= 10s)
    ADD_FAILURE()
        << "worker " << name_ << " did not quit cleanly (wait status " << status << ", after "
        << std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count()
        << " ms)";
}

void Worker::kill(int signal) {
  if (signal == SIGKILL) killed_ = true;
  process_->kill(signal);
}

}  // namespace ferry::netlab
