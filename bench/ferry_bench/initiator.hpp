#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "bench/ferry_bench/control.hpp"
#include "bench/ferry_bench/options.hpp"
#include "bench/ferry_bench/point.hpp"

namespace ferry_bench {

/// One row of the results: the fields of a point in --json and --csv, in that order.
struct PointResult {
  std::string method;  ///< "verbs(sim)" on the simulated fabric
  std::string op_type;
  std::string pairing;
  bool kv = false;
  std::size_t block_size = 0;
  std::size_t batch_size = 0;
  std::size_t bytes_per_op = 0;
  unsigned inflight = 0;
  unsigned threads = 0;
  std::uint64_t iterations = 0;
  double seconds = 0;
  double bandwidth_gbps = 0;
  double bandwidth_gibps = 0;
  double ops_per_s = 0;
  double lat_p50_us = 0;
  double lat_p99_us = 0;
  double lat_min_us = 0;
  double prep_p50_us = 0;
  double post_p50_us = 0;
  double transfer_p50_us = 0;
  std::string skipped;
  std::uint64_t errors = 0;

  /// What went wrong (errors, a failed consistency check), for stderr; not an output field.
  std::vector<std::string> problems;
  bool failed() const { return errors > 0 || !problems.empty(); }
  json to_json() const;
};

/// The initiator: one connector per method (restricted to it), and the measured loop.
class Initiator {
 public:
  Initiator(const Options& options, ControlClient& control);
  ~Initiator();

  /// Runs one point against the target. Throws ControlError when the target does not take
  /// the point; when it fails later (the target gone), the point is returned with its errors
  /// and aborted() says why the run cannot go on.
  PointResult run(PointSpec spec);

  /// Makes the running point (and any later one) stop at once: in-flight operations are
  /// cancelled and the control connection is closed. Any thread.
  void abort(const std::string& why);
  /// Why abort() was called; empty if it was not.
  std::string aborted() const;

  /// Connector::stats() of the initiator's connectors (one per method), added up.
  ferry::ConnectorStats stats() const;

 private:
  struct Point;
  struct Thread;
  void fetch(Point& point, Thread& thread);
  void drive(Point& point, const std::shared_ptr<Thread>& thread);

  const Options& options_;
  ControlClient& control_;
  std::map<std::string, std::unique_ptr<ferry::Connector>> connectors_;
  std::atomic<bool> abort_{false};
  mutable std::mutex abort_mu_;
  std::string abort_why_;
};

}  // namespace ferry_bench
