#pragma once

// ferry_net_wire: a userspace netem. It joins two network namespaces with an Ethernet link made
// of two TAP devices (one in each namespace; this process holds both fds) and forwards frames
// between them with a one-way delay, jitter, random loss, netem-like reordering, an optional
// rate limit and an MTU, all changeable while it runs; `cut` drops everything until `heal`, and
// `block IP` drops the IPv4 packets from or to one address until `unblock IP` (a firewall's drop
// rule between two hosts, the others still reached through the same link).
// For kernels without sch_netem (tc netem), where the network lab's shaped cases cannot run.
//
// Each direction has its own bounded queue of frames waiting for their time (a timer heap);
// frames that find it full are dropped and counted. Randomness is seeded (the seed is printed).
// The TAPs vanish when the fds close: when the process ends, however it ends.

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace ferry::netwire {

/// One end of the wire: a TAP named `dev` in namespace `ns` (empty: this process's own), with
/// an optional IPv4 address ("10.0.0.1/24") and an optional bridge to enslave it to.
struct End {
  std::string ns;
  std::string dev;
  std::string cidr;
  std::string master;
};

/// Parses "NS:DEV[:IP/LEN][:master=BRIDGE]" (NS may be "-" for this process's namespace).
/// Throws std::invalid_argument saying what is wrong.
End parse_end(const std::string& spec);

enum class Jitter { uniform, normal };

/// How frames are shaped in one direction.
struct Shape {
  std::int64_t delay_ns = 0;   ///< one-way delay
  std::int64_t jitter_ns = 0;  ///< uniform: ±jitter; normal: sigma = jitter, bounded at ±3 sigma
  Jitter dist = Jitter::uniform;
  double loss = 0;            ///< probability that a frame is dropped
  double reorder = 0;         ///< probability that a frame is sent at once (overtaking others)
  std::int64_t rate_bps = 0;  ///< bits per second; 0: unlimited
  std::size_t limit = 1000;   ///< frames waiting per direction; more are dropped (counted)
  bool cut = false;           ///< every frame dropped
  /// IPv4 packets from or to these addresses dropped (host byte order; ARP and the rest pass,
  /// as through an IP firewall's drop rule).
  std::vector<std::uint32_t> blocked;
};

/// Applies a control line ("delay 10ms jitter 2ms dist normal loss 1% reorder 0.05 rate
/// 100mbit limit 1000", "cut", "heal", "block 10.0.0.2", "unblock 10.0.0.2", "reset") to
/// `shape`: named parameters change, the others stay; "reset" restores an unshaped link (and
/// heals it, and unblocks every address). A line in tc's netem syntax ("netem
/// delay 10ms 2ms loss 1% reorder 25% 50%", what `tc qdisc ... root` would be given) replaces
/// the whole shape, its correlations ignored (a cut and the blocked addresses stay). Throws
/// std::invalid_argument; `shape` is then unchanged.
void apply_command(Shape& shape, const std::string& line);
std::string describe(const Shape& shape);

enum class Dir { both, a_to_b, b_to_a };

/// Counters of one direction (a to b or b to a).
struct DirStats {
  std::uint64_t frames_in = 0;   ///< frames read from the source TAP
  std::uint64_t frames_out = 0;  ///< frames written to the other TAP
  std::uint64_t bytes_out = 0;
  std::uint64_t lost = 0;          ///< dropped by the loss probability
  std::uint64_t cut = 0;           ///< dropped while cut
  std::uint64_t blocked = 0;       ///< dropped: from or to a blocked address
  std::uint64_t overflow = 0;      ///< dropped: the queue was full
  std::uint64_t oversize = 0;      ///< dropped: larger than the MTU
  std::uint64_t reordered = 0;     ///< sent at once by the reorder probability
  std::uint64_t write_errors = 0;  ///< the other TAP refused the frame
};

struct Options {
  End a, b;
  int mtu = 1500;
  std::uint64_t seed = 0;  ///< 0: one is drawn (and reported by seed())
  Shape shape;
  /// TAPs with virtio-net headers and TSO/checksum offload (--no-offload: without): the
  /// kernels hand over TCP segments of up to 64 KiB (several times the throughput); loss,
  /// reordering and delay then apply to a whole segment, as netem's do on a veth (also a TSO
  /// device), and the MTU is checked against the frames each segment stands for (gso_size).
  /// Without: every frame of at most the MTU on its own, as on a real wire.
  bool offload = true;
};

/// The wire: its TAPs exist from construction until destruction; a thread forwards frames.
class Wire {
 public:
  /// Creates both TAPs (each from a thread inside its namespace), sets their MTU, addresses
  /// and bridge, brings them up and starts forwarding. Throws std::runtime_error on failure.
  explicit Wire(Options options);
  /// Stops forwarding and closes the TAPs (they vanish).
  ~Wire();
  Wire(const Wire&) = delete;
  Wire& operator=(const Wire&) = delete;

  /// Changes the shaping from now on (frames already waiting keep their time).
  void set_shape(const Shape& shape, Dir dir = Dir::both);
  Shape shape(Dir dir = Dir::a_to_b) const;
  /// apply_command() on each direction's current shape; a line that starts with "a>b" or
  /// "b>a" changes that direction only. Throws std::invalid_argument (nothing changed).
  void command(const std::string& line);
  /// describe() of the shape, or of each direction's ("a>b ... ; b>a ...") when they differ.
  std::string describe_shape() const;
  std::uint64_t seed() const { return seed_; }
  DirStats stats_a_to_b() const;
  DirStats stats_b_to_a() const;
  /// Both directions' counters as one line of JSON.
  std::string stats_json() const;
  /// Empty while forwarding; why the forwarding thread stopped otherwise (a TAP went away).
  std::string failure() const;

 private:
  struct Engine;
  Options options_;
  std::uint64_t seed_;
  int tap_a_ = -1, tap_b_ = -1;
  int wake_ = -1;  // eventfd: a new shape, or stop
  mutable std::mutex mutex_;
  Shape shape_ab_, shape_ba_;  // under mutex_; the engine copies them when woken
  std::string failure_;
  std::unique_ptr<Engine> engine_;
  std::thread thread_;
};

/// The program: `ferry_net_wire --a SPEC --b SPEC [--mtu N] [--seed N] [--no-offload]
/// [--shape "delay 10ms ..."]`; prints "ready seed=N ..." once the TAPs are up, then answers
/// each stdin line with "OK ..." or "ERR why"; ends at end of stdin, "quit", SIGTERM or SIGINT.
int wire_main(int argc, char** argv);

}  // namespace ferry::netwire
