#include "tests/net/wire.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <linux/sockios.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <sstream>
#include <stdexcept>
#include <vector>

namespace ferry::netwire {

namespace {

std::string errno_text(const std::string& what) { return what + ": " + std::strerror(errno); }

std::int64_t now_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

std::vector<std::string> words(const std::string& line) {
  std::istringstream in(line);
  std::vector<std::string> w;
  for (std::string s; in >> s;) w.push_back(s);
  return w;
}

double number(const std::string& text, std::size_t& used) {
  try {
    return std::stod(text, &used);
  } catch (const std::exception&) {
    throw std::invalid_argument("not a number: '" + text + "'");
  }
}

std::int64_t parse_duration(const std::string& text) {
  std::size_t used = 0;
  const double v = number(text, used);
  const std::string unit = text.substr(used);
  double scale = 0;
  if (unit == "s" || unit == "sec") scale = 1e9;
  if (unit == "ms" || unit == "msec") scale = 1e6;
  if (unit == "us" || unit == "usec") scale = 1e3;
  if (unit == "ns") scale = 1;
  if (scale == 0)
    throw std::invalid_argument("a time needs a unit (s, ms, us, ns): '" + text + "'");
  if (!(v >= 0) || v > 3600) throw std::invalid_argument("time out of range: '" + text + "'");
  return static_cast<std::int64_t>(std::llround(v * scale));
}

double parse_probability(const std::string& text) {
  std::size_t used = 0;
  double v = number(text, used);
  const std::string unit = text.substr(used);
  if (unit == "%")
    v /= 100;
  else if (!unit.empty())
    throw std::invalid_argument("a probability is 0..1 or a percentage: '" + text + "'");
  if (!(v >= 0 && v <= 1)) throw std::invalid_argument("probability out of range: '" + text + "'");
  return v;
}

std::int64_t parse_rate(const std::string& text) {
  std::size_t used = 0;
  const double v = number(text, used);
  const std::string unit = text.substr(used);
  double scale = 0;
  if (unit == "bit") scale = 1;
  if (unit == "kbit") scale = 1e3;
  if (unit == "mbit") scale = 1e6;
  if (unit == "gbit") scale = 1e9;
  if (unit == "bps") scale = 8;
  if (unit == "kbps") scale = 8e3;
  if (unit == "mbps") scale = 8e6;
  if (unit == "gbps") scale = 8e9;
  if (scale == 0)
    throw std::invalid_argument(
        "a rate needs a unit (bit, kbit, mbit, gbit, bps, kbps, mbps, "
        "gbps): '" +
        text + "'");
  if (!(v >= 0) || v * scale > 1e12)
    throw std::invalid_argument("rate out of range: '" + text + "'");
  return static_cast<std::int64_t>(std::llround(v * scale));
}

std::string duration_text(std::int64_t ns) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%gms", static_cast<double>(ns) / 1e6);
  return buf;
}

/// Runs `fn` on a thread that has entered network namespace `ns` (a per-thread attribute), so
/// that what it creates (a TAP, a socket) lives there. Throws what fn throws.
template <typename Fn>
void in_netns(const std::string& ns, Fn fn) {
  std::string error;
  std::thread t([&] {
    try {
      if (!ns.empty() && ns != "-") {
        const std::string path = ns.find('/') == std::string::npos ? "/var/run/netns/" + ns : ns;
        const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
        if (fd < 0) throw std::runtime_error(errno_text("open " + path));
        const int rc = ::setns(fd, CLONE_NEWNET);
        ::close(fd);
        if (rc != 0) throw std::runtime_error(errno_text("setns " + path));
      }
      fn();
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  t.join();
  if (!error.empty()) throw std::runtime_error(error);
}

void set_name(ifreq& ifr, const std::string& name) {
  std::memset(&ifr, 0, sizeof ifr);
  std::snprintf(ifr.ifr_name, IFNAMSIZ, "%s", name.c_str());
}

/// Creates the TAP of `end` (in its namespace) and configures it; returns its fd.
int make_tap(const End& end, int mtu, bool offload) {
  int tap = -1;
  in_netns(end.ns, [&] {
    const int fd = ::open("/dev/net/tun", O_RDWR | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) throw std::runtime_error(errno_text("open /dev/net/tun"));
    tap = fd;
    ifreq ifr;
    set_name(ifr, end.dev);
    ifr.ifr_flags = static_cast<short>(IFF_TAP | IFF_NO_PI | (offload ? IFF_VNET_HDR : 0));
    if (::ioctl(fd, TUNSETIFF, &ifr) != 0)
      throw std::runtime_error(errno_text("TUNSETIFF " + end.dev + " in " + end.ns));
    if (offload) {
      const unsigned features = TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6 | TUN_F_TSO_ECN;
      if (::ioctl(fd, TUNSETOFFLOAD, features) != 0)
        throw std::runtime_error(errno_text("TUNSETOFFLOAD " + end.dev));
    }
    const int s = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (s < 0) throw std::runtime_error(errno_text("socket"));
    auto ctl = [&](unsigned long request, ifreq& r, const std::string& what) {
      if (::ioctl(s, request, &r) != 0) {
        const std::string why = errno_text(what + " " + end.dev + " in " + end.ns);
        ::close(s);
        throw std::runtime_error(why);
      }
    };
    set_name(ifr, end.dev);
    ifr.ifr_mtu = mtu;
    ctl(SIOCSIFMTU, ifr, "set mtu " + std::to_string(mtu) + " of");
    set_name(ifr, end.dev);
    ifr.ifr_qlen = 4096;  // the TAP's ring: what the kernel holds for us before dropping
    ctl(SIOCSIFTXQLEN, ifr, "set txqueuelen of");
    if (!end.cidr.empty()) {
      const auto slash = end.cidr.find('/');
      const std::string ip = end.cidr.substr(0, slash);
      const int len = slash == std::string::npos ? 32 : std::stoi(end.cidr.substr(slash + 1));
      sockaddr_in sin{};
      sin.sin_family = AF_INET;
      if (::inet_pton(AF_INET, ip.c_str(), &sin.sin_addr) != 1 || len < 0 || len > 32) {
        ::close(s);
        throw std::runtime_error("not an IPv4 address/length: " + end.cidr);
      }
      set_name(ifr, end.dev);
      std::memcpy(&ifr.ifr_addr, &sin, sizeof sin);
      ctl(SIOCSIFADDR, ifr, "set address " + end.cidr + " of");
      sin.sin_addr.s_addr = htonl(len == 0 ? 0u : ~0u << (32 - len));
      set_name(ifr, end.dev);
      std::memcpy(&ifr.ifr_netmask, &sin, sizeof sin);
      ctl(SIOCSIFNETMASK, ifr, "set netmask of");
    }
    if (!end.master.empty()) {
      set_name(ifr, end.dev);
      ctl(SIOCGIFINDEX, ifr, "index of");
      const int index = ifr.ifr_ifindex;
      set_name(ifr, end.master);
      ifr.ifr_ifindex = index;
      ctl(SIOCBRADDIF, ifr, "enslave to " + end.master + ":");
    }
    set_name(ifr, end.dev);
    ctl(SIOCGIFFLAGS, ifr, "flags of");
    ifr.ifr_flags = static_cast<short>(ifr.ifr_flags | IFF_UP);
    ctl(SIOCSIFFLAGS, ifr, "bring up");
    ::close(s);
  });
  return tap;
}

/// Single-writer counters that another thread may read.
struct Counters {
  std::atomic<std::uint64_t> frames_in{0}, frames_out{0}, bytes_out{0}, lost{0}, cut{0}, blocked{0},
      overflow{0}, oversize{0}, reordered{0}, write_errors{0};
  static void bump(std::atomic<std::uint64_t>& c, std::uint64_t by = 1) {
    c.store(c.load(std::memory_order_relaxed) + by, std::memory_order_relaxed);
  }
  DirStats snapshot() const {
    auto r = [](const std::atomic<std::uint64_t>& c) { return c.load(std::memory_order_relaxed); };
    return DirStats{r(frames_in), r(frames_out), r(bytes_out), r(lost),      r(cut),
                    r(blocked),   r(overflow),   r(oversize),  r(reordered), r(write_errors)};
  }
};

std::string stats_text(const DirStats& s) {
  std::ostringstream o;
  o << "{\"in\":" << s.frames_in << ",\"out\":" << s.frames_out << ",\"bytes_out\":" << s.bytes_out
    << ",\"lost\":" << s.lost << ",\"cut\":" << s.cut << ",\"blocked\":" << s.blocked
    << ",\"overflow\":" << s.overflow << ",\"oversize\":" << s.oversize
    << ",\"reordered\":" << s.reordered << ",\"write_errors\":" << s.write_errors << "}";
  return o.str();
}

// struct virtio_net_hdr (linux/virtio_net.h, which is not C++): what precedes each frame with
// IFF_VNET_HDR.
struct VnetHdr {
  std::uint8_t flags;
  std::uint8_t gso_type;
  std::uint16_t hdr_len, gso_size, csum_start, csum_offset;
};
constexpr std::uint8_t kGsoNone = 0, kGsoEcn = 0x80;
constexpr std::size_t kVnetHdr = sizeof(VnetHdr);
static_assert(kVnetHdr == 10);
constexpr int kBatch = 64;  // frames read from one TAP before the other gets its turn

}  // namespace

End parse_end(const std::string& spec) {
  std::vector<std::string> parts;
  std::size_t start = 0;
  for (int i = 0; i < 8; ++i) {
    const auto colon = spec.find(':', start);
    parts.push_back(spec.substr(start, colon - start));
    if (colon == std::string::npos) break;
    start = colon + 1;
  }
  if (parts.size() < 2 || parts.size() > 4 || parts[0].empty() || parts[1].empty())
    throw std::invalid_argument("an end is NS:DEV[:IP/LEN][:master=BRIDGE], not '" + spec + "'");
  End end{parts[0], parts[1], {}, {}};
  if (end.dev.size() >= IFNAMSIZ) throw std::invalid_argument("device name too long: " + end.dev);
  for (std::size_t i = 2; i < parts.size(); ++i) {
    if (parts[i].rfind("master=", 0) == 0)
      end.master = parts[i].substr(7);
    else if (end.cidr.empty() && !parts[i].empty())
      end.cidr = parts[i];
    else
      throw std::invalid_argument("unexpected '" + parts[i] + "' in '" + spec + "'");
  }
  return end;
}

namespace {

bool is_time(const std::string& w) {
  try {
    parse_duration(w);
    return true;
  } catch (const std::invalid_argument&) {
    return false;
  }
}

bool is_percent(const std::string& w) { return !w.empty() && w.back() == '%'; }

/// tc's netem syntax ("netem delay 10ms 2ms 25% distribution normal loss random 1% 25%
/// reorder 25% 50% rate 100mbit limit 1000"): the whole shape is replaced (a cut stays);
/// correlations are accepted and ignored (every draw here is independent).
Shape netem(const std::vector<std::string>& w, const Shape& now) {
  Shape s;
  s.cut = now.cut;
  s.blocked = now.blocked;
  auto value = [&](std::size_t& i) -> const std::string& {
    if (i + 1 >= w.size()) throw std::invalid_argument("netem: '" + w[i] + "' needs a value");
    return w[++i];
  };
  for (std::size_t i = 1; i < w.size(); ++i) {
    const std::string& key = w[i];
    if (key == "delay") {
      s.delay_ns = parse_duration(value(i));
      if (i + 1 < w.size() && is_time(w[i + 1])) s.jitter_ns = parse_duration(w[++i]);
      if (i + 1 < w.size() && is_percent(w[i + 1])) ++i;  // correlation
    } else if (key == "distribution") {
      const std::string& v = value(i);
      if (v == "normal")
        s.dist = Jitter::normal;
      else if (v == "uniform")
        s.dist = Jitter::uniform;
      else
        throw std::invalid_argument("netem: distribution normal or uniform, not '" + v + "'");
    } else if (key == "loss") {
      if (i + 1 < w.size() && w[i + 1] == "random") ++i;
      s.loss = parse_probability(value(i));
      if (i + 1 < w.size() && is_percent(w[i + 1])) ++i;
    } else if (key == "reorder") {
      s.reorder = parse_probability(value(i));
      if (i + 1 < w.size() && is_percent(w[i + 1])) ++i;
    } else if (key == "rate") {
      s.rate_bps = parse_rate(value(i));
    } else if (key == "limit") {
      Shape t;
      apply_command(t, "limit " + value(i));
      s.limit = t.limit;
    } else {
      throw std::invalid_argument("netem: '" + key + "' is not supported here");
    }
  }
  return s;
}

}  // namespace

void apply_command(Shape& shape, const std::string& line) {
  const std::vector<std::string> w = words(line);
  if (!w.empty() && w[0] == "netem") {
    shape = netem(w, shape);
    return;
  }
  Shape s = shape;
  for (std::size_t i = 0; i < w.size(); ++i) {
    const std::string& key = w[i];
    if (key == "cut") {
      s.cut = true;
      continue;
    }
    if (key == "heal") {
      s.cut = false;
      continue;
    }
    if (key == "reset") {
      s = Shape{};
      continue;
    }
    if (i + 1 >= w.size()) throw std::invalid_argument("'" + key + "' needs a value");
    const std::string& v = w[++i];
    if (key == "block" || key == "unblock") {
      in_addr a{};
      if (::inet_pton(AF_INET, v.c_str(), &a) != 1)
        throw std::invalid_argument(key + " needs an IPv4 address, not '" + v + "'");
      const std::uint32_t ip = ntohl(a.s_addr);
      auto it = std::find(s.blocked.begin(), s.blocked.end(), ip);
      if (key == "block" && it == s.blocked.end()) s.blocked.push_back(ip);
      if (key == "unblock" && it != s.blocked.end()) s.blocked.erase(it);
    } else if (key == "delay")
      s.delay_ns = parse_duration(v);
    else if (key == "jitter")
      s.jitter_ns = parse_duration(v);
    else if (key == "dist" || key == "distribution") {
      if (v == "uniform")
        s.dist = Jitter::uniform;
      else if (v == "normal")
        s.dist = Jitter::normal;
      else
        throw std::invalid_argument("dist is uniform or normal, not '" + v + "'");
    } else if (key == "loss")
      s.loss = parse_probability(v);
    else if (key == "reorder")
      s.reorder = parse_probability(v);
    else if (key == "rate")
      s.rate_bps = parse_rate(v);
    else if (key == "limit") {
      std::size_t used = 0;
      const double n = number(v, used);
      if (used != v.size() || n < 1 || n > 1e6 || n != std::floor(n))
        throw std::invalid_argument("limit is a count of frames (1..1000000), not '" + v + "'");
      s.limit = static_cast<std::size_t>(n);
    } else
      throw std::invalid_argument("unknown parameter '" + key + "'");
  }
  shape = s;
}

std::string describe(const Shape& s) {
  std::ostringstream o;
  o << "delay " << duration_text(s.delay_ns) << " jitter " << duration_text(s.jitter_ns) << " dist "
    << (s.dist == Jitter::normal ? "normal" : "uniform") << " loss " << s.loss << " reorder "
    << s.reorder << " rate " << s.rate_bps << "bit limit " << s.limit
    << (s.cut ? " cut" : " healed");
  for (std::uint32_t ip : s.blocked) {
    in_addr a{};
    a.s_addr = htonl(ip);
    char text[INET_ADDRSTRLEN] = {};
    ::inet_ntop(AF_INET, &a, text, sizeof text);
    o << " blocked " << text;
  }
  return o.str();
}

// The forwarding thread's state: one direction per source TAP.
struct Wire::Engine {
  struct Pending {
    std::int64_t due;
    std::uint64_t order;  // ties keep arrival order
    std::uint32_t len;
    std::unique_ptr<char[]> data;
  };
  struct Direction {
    int src, dst;
    std::vector<Pending> heap;  // min-heap on (due, order)
    std::int64_t busy_until = 0;
    Counters counters;
    Shape shape;
  };
  static bool later(const Pending& x, const Pending& y) {
    return x.due != y.due ? x.due > y.due : x.order > y.order;
  }

  Direction ab, ba;
  std::mt19937_64 rng;
  std::uniform_real_distribution<double> unit{0.0, 1.0};
  std::normal_distribution<double> gauss{0.0, 1.0};
  std::uint64_t order = 0;
  std::size_t max_l2;  // largest frame (Ethernet header + MTU + a VLAN tag)
  int mtu;
  bool offload;
  std::vector<char> buf;
  std::atomic<bool> stop{false};
  std::atomic<bool> reshape{false};
  std::string failure;  // set by the thread before it ends, read after (under Wire::mutex_)

  Engine(int a, int b, const Options& o, std::uint64_t seed)
      : ab{a, b, {}, 0, {}, o.shape},
        ba{b, a, {}, 0, {}, o.shape},
        rng(seed),
        max_l2(static_cast<std::size_t>(o.mtu) + 18),
        mtu(o.mtu),
        offload(o.offload),
        buf((o.offload ? 65536 + 256 : max_l2 + 64) + kVnetHdr) {}

  /// A frame as read: the frames it stands for on the wire (a TSO segment: several, of
  /// `seg_l3` bytes of IP packet each but the last) and their L2 headers' length.
  struct Segments {
    std::size_t l2;       // bytes after the virtio header
    std::size_t count;    // frames on the wire
    std::size_t seg_l3;   // IP packet of each full frame (0: not a TSO segment, or unparsable)
    std::size_t headers;  // Ethernet, IP and TCP headers, repeated in every frame
  };
  // The EtherType of an Ethernet frame of `l2` bytes (at least 14), after one VLAN tag at
  // most; `off` is set to where its payload starts.
  static unsigned ether_type(const unsigned char* p, std::size_t l2, std::size_t& off) {
    off = 14;
    unsigned type = (static_cast<unsigned>(p[12]) << 8) | p[13];
    if (type == 0x8100 && l2 >= 18) {
      type = (static_cast<unsigned>(p[16]) << 8) | p[17];
      off = 18;
    }
    return type;
  }

  Segments segments(const char* frame, std::size_t len) const {
    Segments g{len - (offload ? kVnetHdr : 0), 1, 0, 0};
    if (!offload) return g;
    VnetHdr h;
    std::memcpy(&h, frame, sizeof h);
    if ((h.gso_type & ~kGsoEcn) == kGsoNone || h.gso_size == 0) return g;
    // Parse Ethernet, IP and TCP for the headers' length that each frame repeats.
    const auto* p = reinterpret_cast<const unsigned char*>(frame + kVnetHdr);
    if (g.l2 < 60) return g;
    std::size_t off = 0;
    const unsigned type = ether_type(p, g.l2, off);
    std::size_t l3 = 0;
    if (type == 0x0800)
      l3 = static_cast<std::size_t>(p[off] & 0x0f) * 4;
    else if (type == 0x86dd)
      l3 = 40;
    else
      return g;
    if (off + l3 + 13 >= g.l2) return g;
    const std::size_t l4 = static_cast<std::size_t>(p[off + l3 + 12] >> 4) * 4;
    const std::size_t headers = off + l3 + l4;
    if (headers >= g.l2) return g;
    g.headers = headers;
    g.seg_l3 = l3 + l4 + h.gso_size;
    g.count = (g.l2 - headers + h.gso_size - 1) / h.gso_size;
    return g;
  }

  // An IPv4 packet (after the virtio-net header, if any, and one VLAN tag at most) from or to
  // one of the shape's blocked addresses.
  bool blocked(const Shape& shape, const char* frame, std::size_t len) const {
    const std::size_t skip = offload ? kVnetHdr : 0;
    if (len < skip + 14) return false;
    const auto* p = reinterpret_cast<const unsigned char*>(frame + skip);
    const std::size_t l2 = len - skip;
    std::size_t off = 0;
    if (ether_type(p, l2, off) != 0x0800 || l2 < off + 20) return false;
    auto address = [&](std::size_t at) {
      return (static_cast<std::uint32_t>(p[at]) << 24) |
             (static_cast<std::uint32_t>(p[at + 1]) << 16) |
             (static_cast<std::uint32_t>(p[at + 2]) << 8) | static_cast<std::uint32_t>(p[at + 3]);
    };
    const std::uint32_t src = address(off + 12), dst = address(off + 16);
    for (std::uint32_t ip : shape.blocked)
      if (ip == src || ip == dst) return true;
    return false;
  }

  bool oversize(const Segments& g) const {
    if (g.seg_l3 == 0) return g.l2 > max_l2;
    return g.seg_l3 > static_cast<std::size_t>(mtu);
  }

  /// Bytes the frame(s) occupy a link for: each frame's own, plus preamble, FCS and gap.
  static std::size_t wire_bytes(const Segments& g) {
    if (g.seg_l3 == 0) return g.l2 + 24;
    return (g.l2 - g.headers) + g.count * (g.headers + 24);
  }

  void send(Direction& d, const char* frame, std::size_t len) {
    const ssize_t n = ::write(d.dst, frame, len);
    if (n != static_cast<ssize_t>(len)) {
      Counters::bump(d.counters.write_errors);
      return;
    }
    Counters::bump(d.counters.frames_out);
    Counters::bump(d.counters.bytes_out, len - (offload ? kVnetHdr : 0));
  }

  void take(Direction& d, std::size_t len, std::int64_t now) {
    const Shape& shape = d.shape;
    Counters::bump(d.counters.frames_in);
    const Segments g = segments(buf.data(), len);
    if (oversize(g)) {
      Counters::bump(d.counters.oversize);
      return;
    }
    if (shape.cut) {
      Counters::bump(d.counters.cut);
      return;
    }
    if (!shape.blocked.empty() && blocked(shape, buf.data(), len)) {
      Counters::bump(d.counters.blocked);
      return;
    }
    if (shape.loss > 0 && unit(rng) < shape.loss) {
      Counters::bump(d.counters.lost);
      return;
    }
    const bool plain = shape.delay_ns == 0 && shape.jitter_ns == 0 && shape.rate_bps == 0;
    if (plain && d.heap.empty()) {
      send(d, buf.data(), len);
      return;
    }
    if (d.heap.size() >= shape.limit) {
      Counters::bump(d.counters.overflow);
      return;
    }
    std::int64_t start = now;
    if (shape.rate_bps > 0) {
      const std::size_t bits = 8 * wire_bytes(g);
      start = std::max(now, d.busy_until);
      d.busy_until = start + static_cast<std::int64_t>(static_cast<double>(bits) * 1e9 /
                                                       static_cast<double>(shape.rate_bps));
      start = d.busy_until;
    }
    std::int64_t due = start;
    if (shape.reorder > 0 && unit(rng) < shape.reorder) {
      Counters::bump(d.counters.reordered);
    } else {
      double jitter = 0;
      const double j = static_cast<double>(shape.jitter_ns);
      if (j > 0) {
        jitter = shape.dist == Jitter::normal ? std::clamp(gauss(rng) * j, -3 * j, 3 * j)
                                              : (2 * unit(rng) - 1) * j;
      }
      due += std::max<std::int64_t>(0, shape.delay_ns + std::llround(jitter));
    }
    Pending p{due, order++, static_cast<std::uint32_t>(len), std::make_unique<char[]>(len)};
    std::memcpy(p.data.get(), buf.data(), len);
    d.heap.push_back(std::move(p));
    std::push_heap(d.heap.begin(), d.heap.end(), later);
  }

  /// Reads up to kBatch frames; false when the TAP is gone.
  bool drain(Direction& d) {
    const std::int64_t now = now_ns();
    for (int i = 0; i < kBatch; ++i) {
      const ssize_t n = ::read(d.src, buf.data(), buf.size());
      if (n < 0) {
        if (errno == EAGAIN || errno == EINTR) return true;
        failure = errno_text(std::string("read from TAP ") + (&d == &ab ? "a" : "b"));
        return false;
      }
      if (n == 0) return true;
      take(d, static_cast<std::size_t>(n), now);
    }
    return true;
  }

  void flush(Direction& d, std::int64_t now) {
    // Bounded by the queue's length.
    while (!d.heap.empty() && d.heap.front().due <= now) {
      std::pop_heap(d.heap.begin(), d.heap.end(), later);
      Pending p = std::move(d.heap.back());
      d.heap.pop_back();
      send(d, p.data.get(), p.len);
    }
  }

  std::int64_t next_due() const {
    std::int64_t next = INT64_MAX;
    if (!ab.heap.empty()) next = ab.heap.front().due;
    if (!ba.heap.empty()) next = std::min(next, ba.heap.front().due);
    return next;
  }

  void run(int wake, std::mutex& mutex, const Shape& shared_ab, const Shape& shared_ba) {
    ::prctl(PR_SET_TIMERSLACK, 1UL);
    const int ep = ::epoll_create1(EPOLL_CLOEXEC);
    const int timer = ::timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    if (ep < 0 || timer < 0) {
      failure = errno_text("epoll/timerfd");
      if (ep >= 0) ::close(ep);
      if (timer >= 0) ::close(timer);
      return;
    }
    for (int fd : {ab.src, ba.src, wake, timer}) {
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.fd = fd;
      ::epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev);
    }
    std::int64_t armed = INT64_MAX;
    while (!stop.load()) {
      const std::int64_t next = next_due();
      if (next != armed) {
        itimerspec its{};
        if (next != INT64_MAX) {
          its.it_value.tv_sec = static_cast<time_t>(next / 1'000'000'000);
          its.it_value.tv_nsec = static_cast<long>(next % 1'000'000'000);
          if (its.it_value.tv_sec == 0 && its.it_value.tv_nsec == 0) its.it_value.tv_nsec = 1;
        }
        ::timerfd_settime(timer, TFD_TIMER_ABSTIME, &its, nullptr);
        armed = next;
      }
      epoll_event events[4];
      const int n = ::epoll_wait(ep, events, 4, 250);
      if (n < 0 && errno != EINTR) {
        failure = errno_text("epoll_wait");
        break;
      }
      // A quiet quarter second: read anyway, which fails once a TAP is gone (its namespace
      // deleted), a change epoll does not report.
      bool ok = n != 0 || (drain(ab) && drain(ba));
      for (int i = 0; i < n && ok; ++i) {
        const int fd = events[i].data.fd;
        if (fd == ab.src)
          ok = drain(ab);
        else if (fd == ba.src)
          ok = drain(ba);
        else if (fd == wake || fd == timer) {
          std::uint64_t v;
          [[maybe_unused]] const ssize_t r = ::read(fd, &v, sizeof v);
          if (fd == wake && reshape.exchange(false)) {
            std::lock_guard lock(mutex);
            ab.shape = shared_ab;
            ba.shape = shared_ba;
          }
        }
      }
      if (!ok) break;
      const std::int64_t now = now_ns();
      flush(ab, now);
      flush(ba, now);
    }
    ::close(timer);
    ::close(ep);
  }
};

Wire::Wire(Options options) : options_(std::move(options)) {
  seed_ = options_.seed;
  shape_ab_ = shape_ba_ = options_.shape;
  if (seed_ == 0)
    seed_ = (static_cast<std::uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}() ^
            static_cast<std::uint64_t>(now_ns());
  if (seed_ == 0) seed_ = 1;
  if (options_.mtu < 68 || options_.mtu > 65000)
    throw std::runtime_error("mtu out of range: " + std::to_string(options_.mtu));
  try {
    tap_a_ = make_tap(options_.a, options_.mtu, options_.offload);
    tap_b_ = make_tap(options_.b, options_.mtu, options_.offload);
    wake_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (wake_ < 0) throw std::runtime_error(errno_text("eventfd"));
  } catch (...) {
    for (int fd : {tap_a_, tap_b_, wake_})
      if (fd >= 0) ::close(fd);
    throw;
  }
  engine_ = std::make_unique<Engine>(tap_a_, tap_b_, options_, seed_);
  thread_ = std::thread([this] {
    engine_->run(wake_, mutex_, shape_ab_, shape_ba_);
    std::lock_guard lock(mutex_);
    if (engine_->failure.empty() && !engine_->stop.load()) engine_->failure = "stopped";
    failure_ = engine_->failure;
  });
}

Wire::~Wire() {
  engine_->stop.store(true);
  const std::uint64_t one = 1;
  [[maybe_unused]] const ssize_t n = ::write(wake_, &one, sizeof one);
  thread_.join();
  for (int fd : {tap_a_, tap_b_, wake_}) ::close(fd);
}

void Wire::set_shape(const Shape& shape, Dir dir) {
  {
    std::lock_guard lock(mutex_);
    if (dir != Dir::b_to_a) shape_ab_ = shape;
    if (dir != Dir::a_to_b) shape_ba_ = shape;
  }
  engine_->reshape.store(true);
  const std::uint64_t one = 1;
  [[maybe_unused]] const ssize_t n = ::write(wake_, &one, sizeof one);
}

Shape Wire::shape(Dir dir) const {
  std::lock_guard lock(mutex_);
  return dir == Dir::b_to_a ? shape_ba_ : shape_ab_;
}

void Wire::command(const std::string& line) {
  const std::vector<std::string> w = words(line);
  Dir dir = Dir::both;
  std::string rest = line;
  if (!w.empty() && (w[0] == "a>b" || w[0] == "b>a")) {
    dir = w[0] == "a>b" ? Dir::a_to_b : Dir::b_to_a;
    rest = line.substr(line.find(w[0]) + 3);
  }
  // Each direction changes from its own shape; both are checked before either is set.
  Shape ab = shape(Dir::a_to_b), ba = shape(Dir::b_to_a);
  if (dir != Dir::b_to_a) apply_command(ab, rest);
  if (dir != Dir::a_to_b) apply_command(ba, rest);
  if (dir != Dir::b_to_a) set_shape(ab, Dir::a_to_b);
  if (dir != Dir::a_to_b) set_shape(ba, Dir::b_to_a);
}

std::string Wire::describe_shape() const {
  const std::string ab = describe(shape(Dir::a_to_b)), ba = describe(shape(Dir::b_to_a));
  return ab == ba ? ab : "a>b " + ab + " ; b>a " + ba;
}

DirStats Wire::stats_a_to_b() const { return engine_->ab.counters.snapshot(); }
DirStats Wire::stats_b_to_a() const { return engine_->ba.counters.snapshot(); }

std::string Wire::stats_json() const {
  return "{\"a_to_b\":" + stats_text(stats_a_to_b()) + ",\"b_to_a\":" + stats_text(stats_b_to_a()) +
         "}";
}

std::string Wire::failure() const {
  std::lock_guard lock(mutex_);
  return failure_;
}

namespace {

void say(const std::string& line) {
  std::fputs((line + "\n").c_str(), stdout);
  std::fflush(stdout);
}

const char* kUsage =
    "usage: ferry_net_wire --a NS:DEV[:IP/LEN][:master=BRIDGE] --b "
    "NS:DEV[:IP/LEN][:master=BRIDGE]\n"
    "         [--mtu N] [--seed N] [--no-offload] [--shape \"delay 10ms jitter 2ms loss 1% ...\"]\n"
    "         [--lifetime SECONDS]\n"
    "Joins two network namespaces (NS: a name under /var/run/netns, or - for this one) with a\n"
    "shaped link of two TAP devices. Prints \"ready seed=N ...\", then reads commands on stdin,\n"
    "each answered \"OK ...\" or \"ERR why\":\n"
    "  delay T  jitter T  dist uniform|normal  loss P  reorder P  rate R  limit N   (any of them)\n"
    "  netem ARGS  (tc's syntax: \"netem delay 10ms 2ms loss 1%\"; replaces the whole shape)\n"
    "  a>b ...  b>a ...  (prefix: one direction only; else both)\n"
    "  block IP  unblock IP  (IPv4 packets from or to IP dropped, or no longer)\n"
    "  cut  heal  reset  show  stats  quit\n"
    "T: 10ms, 500us; P: 0.01 or 1%; R: 100mbit, 1gbit, 10mbps. Ends at end of stdin, quit,\n"
    "SIGTERM, SIGINT or after --lifetime; its TAPs vanish with it.\n";

}  // namespace

int wire_main(int argc, char** argv) {
  Options o;
  double lifetime_s = 0;
  bool have_a = false, have_b = false;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string arg = argv[i];
      auto value = [&]() -> std::string {
        if (i + 1 >= argc) throw std::invalid_argument(arg + " needs a value");
        return argv[++i];
      };
      if (arg == "--a") {
        o.a = parse_end(value());
        have_a = true;
      } else if (arg == "--b") {
        o.b = parse_end(value());
        have_b = true;
      } else if (arg == "--mtu")
        o.mtu = std::stoi(value());
      else if (arg == "--seed")
        o.seed = std::stoull(value());
      else if (arg == "--offload")
        o.offload = true;
      else if (arg == "--no-offload")
        o.offload = false;
      else if (arg == "--shape")
        apply_command(o.shape, value());
      else if (arg == "--lifetime")
        lifetime_s = std::stod(value());
      else if (arg == "--help" || arg == "-h") {
        std::fputs(kUsage, stdout);
        return 0;
      } else
        throw std::invalid_argument("unknown argument " + arg);
    }
    if (!have_a || !have_b) throw std::invalid_argument("--a and --b are required");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ferry_net_wire: %s\n%s", e.what(), kUsage);
    return 2;
  }

  // SIGTERM, SIGINT and SIGHUP come through a signalfd (blocked before any thread starts, so
  // every thread inherits the mask); a closed stdout is not fatal.
  sigset_t mask;
  sigemptyset(&mask);
  for (int s : {SIGTERM, SIGINT, SIGHUP}) sigaddset(&mask, s);
  ::pthread_sigmask(SIG_BLOCK, &mask, nullptr);
  ::signal(SIGPIPE, SIG_IGN);
  const int sfd = ::signalfd(-1, &mask, SFD_CLOEXEC);

  std::unique_ptr<Wire> wire;
  try {
    wire = std::make_unique<Wire>(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ferry_net_wire: %s\n", e.what());
    say(std::string("ERR ") + e.what());
    return 1;
  }
  say("ready seed=" + std::to_string(wire->seed()) + " a=" + o.a.ns + ":" + o.a.dev +
      " b=" + o.b.ns + ":" + o.b.dev + " mtu=" + std::to_string(o.mtu) +
      (o.offload ? " offload" : "") + " " + wire->describe_shape());

  const std::int64_t end =
      lifetime_s > 0 ? now_ns() + static_cast<std::int64_t>(lifetime_s * 1e9) : INT64_MAX;
  std::string pending;
  int rc = 0;
  for (;;) {  // ends at end of stdin, quit, a signal, the lifetime, or a dead TAP
    if (now_ns() >= end) break;
    if (std::string why = wire->failure(); !why.empty()) {
      std::fprintf(stderr, "ferry_net_wire: forwarding stopped: %s\n", why.c_str());
      rc = 1;
      break;
    }
    pollfd p[2] = {{STDIN_FILENO, POLLIN, 0}, {sfd, POLLIN, 0}};
    const int n = ::poll(p, sfd >= 0 ? 2 : 1, 200);
    if (n < 0 && errno != EINTR) break;
    if (n <= 0) continue;
    if (sfd >= 0 && (p[1].revents & POLLIN)) break;
    if (!(p[0].revents & (POLLIN | POLLHUP | POLLERR))) continue;
    char chunk[4096];
    const ssize_t got = ::read(STDIN_FILENO, chunk, sizeof chunk);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) break;
    pending.append(chunk, static_cast<std::size_t>(got));
    bool quit = false;
    for (auto nl = pending.find('\n'); nl != std::string::npos && !quit; nl = pending.find('\n')) {
      std::string line = pending.substr(0, nl);
      pending.erase(0, nl + 1);
      if (!line.empty() && line.back() == '\r') line.pop_back();
      const std::vector<std::string> w = words(line);
      if (w.empty()) continue;
      if (w[0] == "quit") {
        say("OK bye");
        quit = true;
      } else if (w[0] == "stats") {
        say("OK " + wire->stats_json());
      } else if (w[0] == "show") {
        say("OK " + wire->describe_shape());
      } else {
        try {
          wire->command(line);
          say("OK " + wire->describe_shape());
        } catch (const std::exception& e) {
          say(std::string("ERR ") + e.what());
        }
      }
    }
    if (quit) break;
    if (pending.size() > 65536) pending.clear();  // a line that never ends
  }
  wire.reset();
  if (sfd >= 0) ::close(sfd);
  return rc;
}

}  // namespace ferry::netwire

#ifdef FERRY_NET_WIRE_MAIN
int main(int argc, char** argv) { return ferry::netwire::wire_main(argc, argv); }
#endif
