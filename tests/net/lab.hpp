#pragma once

// The network lab: "hosts" made of Linux network namespaces, for tests of ferry between hosts
// over links that can be shaped (tc), cut and healed, each host with its own nats-server, the
// servers forming one cluster. Everything is created and torn down here; nothing outside the
// lab's own namespaces is touched (the root namespace only gains and loses their names).
//
// Topology of a lab of N hosts, named after this process's pid (P):
//
//   ferrylab-P-sw      the switch: bridges "brnats" (NATS network) and "brdata" (data network)
//   ferrylab-P-hI      host I: "n0" 10.231.1.(10+I)/24 on brnats, "d0" 10.231.2.(10+I)/24 on brdata
//
// Each host's two links are veth pairs whose other ends ("hIn", "hId") sit in the switch. The
// NATS server of host I listens on its n0 address; workers bind ferry's tcp listener to d0, so
// the side channel and the data path can be cut apart.

#include <sys/types.h>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/support/child_process.hpp"

namespace ferry::netwire {
class Wire;
}

namespace ferry::netlab {

using json = nlohmann::json;

struct CmdResult {
  int rc = -1;      ///< exit status; -1: did not end in time (killed)
  std::string out;  ///< stdout and stderr together
};

/// Runs `argv` (argv[0] a path or a name on PATH), bounded by `timeout`.
CmdResult run(const std::vector<std::string>& argv,
              std::chrono::milliseconds timeout = std::chrono::seconds(10));

/// Why the lab cannot run here (not root, no `ip`, no network namespaces, no veth or bridge,
/// no nats-server), or empty when it can.
std::string missing_prerequisite();

/// Removes the namespaces of labs whose process is gone (a test killed before its destructor
/// ran). Labs of live processes (parallel tests) are left alone.
void sweep_stale_labs();

/// Names of the namespaces that exist now and belong to labs ("ferrylab-...").
std::vector<std::string> lab_namespaces();

enum class Net { nats, data, both };

class Lab {
 public:
  /// Builds the namespaces, links and NATS cluster; throws std::runtime_error (saying which
  /// step failed) when it cannot, after tearing down what it built.
  explicit Lab(int hosts = 3, int mtu = 1500);
  /// Kills every process started in the lab and deletes its namespaces.
  ~Lab();
  Lab(const Lab&) = delete;
  Lab& operator=(const Lab&) = delete;

  int hosts() const { return hosts_; }
  std::string ns(int host) const;
  std::string nats_ip(int host) const;
  std::string data_ip(int host) const;
  /// Every server's URL, `host`'s own first (the order a worker there tries them).
  std::string nats_urls(int host) const;

  /// argv that runs `command` inside `host`'s namespace.
  std::vector<std::string> in_host(int host, const std::vector<std::string>& command) const;
  /// Runs a command in the switch's or a host's namespace; throws when it fails.
  void sh_switch(const std::vector<std::string>& args) const;

  /// Puts the switch's end of `host`'s link(s) down or up: down, the host's packets go nowhere
  /// and none reach it (a cable pulled), with no error to any socket.
  void set_link(int host, Net net, bool up);
  /// Replaces the root qdisc at both ends of `host`'s link(s) (so both directions are shaped)
  /// with `qdisc` ("netem delay 10ms", "tbf rate 100mbit burst 256k latency 400ms"); an empty
  /// vector restores the default. Where the kernel has no sch_netem, a netem qdisc is played
  /// by ferry_net_wire instead (wire.hpp): the link's veth pair is replaced, the first time,
  /// by a userspace wire of two TAPs with the same names and addresses.
  void shape(int host, Net net, const std::vector<std::string>& qdisc);
  /// Sends `line` (wire.hpp's commands: "block 10.231.2.10", "rate 80mbit", "reset") to the
  /// userspace wire of `host`'s link(s), replacing the veth pair by one first if it has none
  /// (needs /dev/net/tun; see wire_missing()). With "block", a partition between two hosts
  /// only: the host's packets from or to the other's addresses are dropped, the third host
  /// still reaches both.
  void wire_command(int host, Net net, const std::string& line);
  /// Why the userspace wire cannot be used here (no /dev/net/tun), or empty.
  static std::string wire_missing();
  /// Why netem shaping cannot be used here (no sch_netem, and no /dev/net/tun for the
  /// userspace wire), or empty.
  std::string netem_missing() const;
  /// Whether netem shaping is played by ferry_net_wire here (the kernel has no sch_netem).
  bool netem_in_userspace() const;

  void kill_nats(int host);
  void start_nats(int host);
  /// Waits until every running server has a route to every other running one.
  void await_cluster(std::chrono::milliseconds limit = std::chrono::seconds(15));
  std::string nats_log(int host) const;

 private:
  std::vector<std::string> devices(int host, Net net) const;
  void build(int mtu);
  void teardown() noexcept;

  /// The wire that replaced `host`'s link `net` ('n' or 'd'), made on first use.
  netwire::Wire& wire(int host, char net);

  int hosts_;
  int mtu_ = 1500;
  std::string prefix_;
  std::map<std::pair<int, char>, std::unique_ptr<netwire::Wire>> wires_;
  std::vector<std::unique_ptr<test::ChildProcess>> nats_;
  std::vector<std::string> logs_;
};

/// What a worker is started with (ferry_net_worker's flags).
struct WorkerOptions {
  std::string transports = "tcp";
  int peer_timeout_ms = 2000;  ///< ferry's default
  int subject_timeout_ms = 10000;
  bool bind_data = true;    ///< the tcp listener on the data network (else: NATS's address)
  int nats_host = -1;       ///< the server tried first; -1: the worker's own host's
  bool all_servers = true;  ///< every server's URL, for failover; else only the first
  int nats_ping_ms = 0;     ///< NatsOptions::ping_interval; 0: ferry's default
};

/// A ferry_net_worker in a lab host, driven over its stdin and stdout.
class Worker {
 public:
  Worker(const Lab& lab, int host, std::string name, WorkerOptions options = {});
  /// Asks the worker to quit (its connector destroyed, whatever happened to its peers) and
  /// fails the test when it does not exit 0 within 10 s (a hang, a crash, or a leak that a
  /// sanitizer reports at exit); a worker that was killed is only reaped.
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;
  /// Sends one command and returns its JSON answer (throws when none comes within `timeout`).
  json cmd(const std::string& line, std::chrono::milliseconds timeout = std::chrono::seconds(30));
  void kill(int signal);
  const json& ready() const { return ready_; }
  const std::string& name() const { return name_; }
  int host() const { return host_; }

 private:
  std::string name_;
  int host_;
  std::unique_ptr<test::ChildProcess> process_;
  json ready_;
  bool killed_ = false;
};

}  // namespace ferry::netlab
