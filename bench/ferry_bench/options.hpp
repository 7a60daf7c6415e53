#pragma once

// ferry-bench's command line (nixlbench's names where they mean the same).

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace ferry_bench {

struct Options {
  std::string role = "both";  ///< both, initiator, target
  std::string nats_url;       ///< empty: $FERRY_NATS_URL, else a private server (role both)
  std::string session;        ///< empty: random
  std::vector<std::string> op_types{"WRITE"};
  std::vector<std::string> methods;  ///< empty: every method offered here
  bool simulated_verbs = false;
  std::size_t start_block_size = 4u << 10;
  std::size_t max_block_size = 64u << 20;
  std::size_t block_size_factor = 4;
  std::size_t start_batch_size = 1;
  std::size_t max_batch_size = 1;
  std::vector<unsigned> inflight{1};
  unsigned num_threads = 1;
  std::uint64_t num_iter = 0;  ///< 0: adapt to point_seconds
  std::uint64_t warmup_iter = 4;
  double point_seconds = 1.0;
  bool by_subject = false;  ///< --pairing subject
  bool by_region = false;   ///< --pairing region
  bool kv = false;
  std::size_t kv_page_size = 16u << 10;
  std::size_t kv_pages = 1024;
  bool check_consistency = false;
  bool initiator_vram = false;  ///< --initiator_seg_type VRAM: the initiator's buffers on cuda:0
  bool target_vram = false;     ///< --target_seg_type VRAM: the target's buffers on cuda:0
  std::string json_path;
  std::string csv_path;
  std::string png_path;
  /// --metrics HOST:PORT: this process's connectors serve their Prometheus metrics there
  /// (role both: the target's at PORT+1); "": FERRY_METRICS_LISTEN, else none.
  std::string metrics;
  bool quiet = false;
  std::string command;  ///< the command line, as given
};

/// Parses argv. Throws std::invalid_argument with a message for bad usage; prints the help
/// and exits 0 for --help.
Options parse_options(int argc, char** argv);

}  // namespace ferry_bench
