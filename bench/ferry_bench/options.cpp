#include "bench/ferry_bench/options.hpp"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <sstream>
#include <stdexcept>

#include "bench/ferry_bench/point.hpp"

namespace ferry_bench {

namespace {

constexpr const char* kHelp = R"(usage: ferry-bench [options]

Moves buffers between an initiator and a target process with ferry and reports bandwidth and
latency per point of a sweep (method x op_type x inflight x batch size x block size).

  --role both|initiator|target   both (default): start the target as a child process
  --nats_url URL                 control channel and ferry's side channel; default
                                 $FERRY_NATS_URL, else (role both) a private nats-server
  --session NAME                 subject prefix pairing initiator and target (default random)
  --op_type READ|WRITE[,...]     default WRITE
  --method tcp|cma|verbs|cuda_ipc[,...]
                                 default: every method offered here
  --simulated_verbs              verbs on the simulated RDMA fabric (labelled verbs(sim))
  --start_block_size N           bytes per descriptor, K/M/G suffixes (default 4K)
  --max_block_size N             (default 64M)
  --block_size_factor N          (default 4)
  --start_batch_size N           descriptors per operation (default 1), doubling up to
  --max_batch_size N             (default 1)
  --inflight N[,...]             operations in flight per thread (default 1)
  --num_threads N                initiator threads (default 1)
  --num_iter N                   operations measured per point (default: about
                                 --point_seconds of them, 8 to 100000)
  --warmup_iter N                unmeasured operations per thread first (default 4)
  --point_seconds S              (default 1.0)
  --pairing metadata|subject|region
                                 metadata (default): metadata handed over ahead;
                                 subject: every operation pairs by its NATS subject;
                                 region: the target exposes its buffers once as a region, the
                                 initiator attaches once, every operation is a transfer on it
                                 (docs/regions.md)
  --kv                           KV-shaped: --kv_pages pages of --kv_page_size per operation,
  --kv_page_size N               picked non-contiguously from a pool (defaults 16K, 1024)
  --kv_pages N
  --check_consistency            verify every byte moved; a mismatch fails the run
  --initiator_seg_type DRAM|VRAM the initiator's buffers: host memory (default) or memory
  --target_seg_type DRAM|VRAM    of GPU cuda:0, through the CUDA driver ferry loads
  --json FILE  --csv FILE  --png FILE
  --metrics HOST:PORT            serve the connectors' Prometheus metrics there while the run
                                 lasts (role both: the target's at PORT+1; docs/operations.md)
  --quiet                        no progress on stderr
  --help

Exit status: 0 when every point ran without error (skipped points included) and the data
held; 1 otherwise; 2 for bad usage.
)";

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (item.empty()) throw std::invalid_argument("empty item in list '" + text + "'");
    out.push_back(item);
  }
  if (out.empty()) throw std::invalid_argument("empty list");
  return out;
}

std::uint64_t parse_count(const std::string& name, const std::string& text, bool zero_ok) {
  std::size_t used = 0;
  unsigned long long v = 0;
  try {
    v = std::stoull(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || text.empty() || text[0] == '-' || (!zero_ok && v == 0))
    throw std::invalid_argument("--" + name + ": not a " + (zero_ok ? "count" : "positive count") +
                                ": '" + text + "'");
  return v;
}

// DRAM -> false, VRAM -> true.
bool parse_seg_type(const std::string& name, const std::string& text) {
  if (text == "DRAM") return false;
  if (text == "VRAM") return true;
  throw std::invalid_argument("--" + name + ": DRAM or VRAM, not '" + text + "'");
}

std::size_t parse_positive_size(const std::string& name, const std::string& text) {
  std::size_t v = 0;
  try {
    v = parse_size(text);
  } catch (const std::exception& e) {
    throw std::invalid_argument("--" + name + ": " + e.what());
  }
  if (v == 0) throw std::invalid_argument("--" + name + " must be positive");
  return v;
}

std::string quoted(const std::string& arg) {
  if (!arg.empty() && arg.find_first_of(" \t\"'\\$`") == std::string::npos) return arg;
  std::string out = "'";
  for (char c : arg) {
    if (c == '\'')
      out += "'\\''";
    else
      out += c;
  }
  return out + "'";
}

}  // namespace

Options parse_options(int argc, char** argv) {
  Options o;
  for (int i = 0; i < argc; ++i) o.command += (i > 0 ? " " : "") + quoted(argv[i]);

  std::map<std::string, std::function<void()>> flags{
      {"simulated_verbs", [&] { o.simulated_verbs = true; }},
      {"kv", [&] { o.kv = true; }},
      {"check_consistency", [&] { o.check_consistency = true; }},
      {"quiet", [&] { o.quiet = true; }},
      {"help",
       [&] {
         std::fputs(kHelp, stdout);
         std::exit(0);
       }},
  };
  using Setter = std::function<void(const std::string&, const std::string&)>;
  std::map<std::string, Setter> values{
      {"role",
       [&](auto& n, auto& v) {
         if (v != "both" && v != "initiator" && v != "target")
           throw std::invalid_argument("--" + n + ": both, initiator or target");
         o.role = v;
       }},
      {"nats_url", [&](auto&, auto& v) { o.nats_url = v; }},
      {"session",
       [&](auto& n, auto& v) {
         for (char c : v) {
           if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_')
             throw std::invalid_argument("--" + n + ": letters, digits, '-' and '_' only");
         }
         if (v.empty()) throw std::invalid_argument("--" + n + ": empty");
         o.session = v;
       }},
      {"op_type",
       [&](auto& n, auto& v) {
         o.op_types = split_list(v);
         for (auto& t : o.op_types) {
           if (t != "READ" && t != "WRITE")
             throw std::invalid_argument("--" + n + ": READ or WRITE, not '" + t + "'");
         }
       }},
      {"method",
       [&](auto& n, auto& v) {
         o.methods = split_list(v);
         for (auto& m : o.methods) {
           if (m != "tcp" && m != "cma" && m != "verbs" && m != "cuda_ipc")
             throw std::invalid_argument("--" + n + ": tcp, cma, verbs or cuda_ipc, not '" + m +
                                         "'");
         }
       }},
      {"initiator_seg_type", [&](auto& n, auto& v) { o.initiator_vram = parse_seg_type(n, v); }},
      {"target_seg_type", [&](auto& n, auto& v) { o.target_vram = parse_seg_type(n, v); }},
      {"start_block_size",
       [&](auto& n, auto& v) { o.start_block_size = parse_positive_size(n, v); }},
      {"max_block_size", [&](auto& n, auto& v) { o.max_block_size = parse_positive_size(n, v); }},
      {"block_size_factor",
       [&](auto& n, auto& v) {
         o.block_size_factor = static_cast<std::size_t>(parse_count(n, v, false));
         if (o.block_size_factor < 2) throw std::invalid_argument("--" + n + " must be >= 2");
       }},
      {"start_batch_size",
       [&](auto& n, auto& v) {
         o.start_batch_size = static_cast<std::size_t>(parse_count(n, v, false));
       }},
      {"max_batch_size",
       [&](auto& n, auto& v) {
         o.max_batch_size = static_cast<std::size_t>(parse_count(n, v, false));
       }},
      {"inflight",
       [&](auto& n, auto& v) {
         o.inflight.clear();
         for (auto& item : split_list(v)) {
           const auto k = parse_count(n, item, false);
           if (k > 4096) throw std::invalid_argument("--" + n + ": at most 4096");
           o.inflight.push_back(static_cast<unsigned>(k));
         }
       }},
      {"num_threads",
       [&](auto& n, auto& v) {
         const auto k = parse_count(n, v, false);
         if (k > 64) throw std::invalid_argument("--" + n + ": at most 64");
         o.num_threads = static_cast<unsigned>(k);
       }},
      {"num_iter", [&](auto& n, auto& v) { o.num_iter = parse_count(n, v, false); }},
      {"warmup_iter", [&](auto& n, auto& v) { o.warmup_iter = parse_count(n, v, true); }},
      {"point_seconds",
       [&](auto& n, auto& v) {
         std::size_t used = 0;
         try {
           o.point_seconds = std::stod(v, &used);
         } catch (const std::exception&) {
           used = 0;
         }
         if (used != v.size() || !(o.point_seconds > 0) || o.point_seconds > 3600)
           throw std::invalid_argument("--" + n + ": seconds, above 0 and at most 3600");
       }},
      {"pairing",
       [&](auto& n, auto& v) {
         if (v != "metadata" && v != "subject" && v != "region")
           throw std::invalid_argument("--" + n + ": metadata, subject or region");
         o.by_subject = v == "subject";
         o.by_region = v == "region";
       }},
      {"kv_page_size", [&](auto& n, auto& v) { o.kv_page_size = parse_positive_size(n, v); }},
      {"kv_pages",
       [&](auto& n, auto& v) { o.kv_pages = static_cast<std::size_t>(parse_count(n, v, false)); }},
      {"json", [&](auto&, auto& v) { o.json_path = v; }},
      {"csv", [&](auto&, auto& v) { o.csv_path = v; }},
      {"png", [&](auto&, auto& v) { o.png_path = v; }},
      {"metrics",
       [&](auto& n, auto& v) {
         const auto colon = v.rfind(':');
         if (colon == std::string::npos || colon + 1 == v.size())
           throw std::invalid_argument("--" + n + " wants HOST:PORT, not '" + v + "'");
         o.metrics = v;
       }},
  };

  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg.rfind("--", 0) != 0) throw std::invalid_argument("unexpected argument '" + arg + "'");
    std::string name = arg.substr(2);
    std::string value;
    bool has_value = false;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    // nixlbench's --snake_case names, and --kebab-case as ferry-info takes them: both.
    std::replace(name.begin(), name.end(), '-', '_');
    if (auto f = flags.find(name); f != flags.end()) {
      if (has_value) throw std::invalid_argument("--" + name + " takes no value");
      f->second();
      continue;
    }
    auto s = values.find(name);
    if (s == values.end()) throw std::invalid_argument("unknown option '--" + name + "'");
    if (!has_value) {
      if (i + 1 >= argc) throw std::invalid_argument("--" + name + " needs a value");
      value = argv[++i];
    }
    s->second(name, value);
  }

  if (o.start_block_size > o.max_block_size)
    throw std::invalid_argument("--start_block_size is above --max_block_size");
  if (o.start_batch_size > o.max_batch_size)
    throw std::invalid_argument("--start_batch_size is above --max_batch_size");
  if (o.max_batch_size > ferry::RdmaMetadata::kMaxDescriptors ||
      o.kv_pages > ferry::RdmaMetadata::kMaxDescriptors)
    throw std::invalid_argument("at most " + std::to_string(ferry::RdmaMetadata::kMaxDescriptors) +
                                " descriptors per operation");
  if (o.nats_url.empty()) {
    if (const char* env = std::getenv("FERRY_NATS_URL"); env != nullptr && *env != '\0') {
      // The side channel takes a comma-separated list; the control channel takes the first.
      o.nats_url = split_list(env).front();
    }
  }
  if (o.role != "both" && o.nats_url.empty())
    throw std::invalid_argument("--role " + o.role +
                                " needs --nats_url (or FERRY_NATS_URL) and --session");
  if (o.role != "both" && o.session.empty())
    throw std::invalid_argument("--role " + o.role + " needs --session (the same on both sides)");
  return o;
}

}  // namespace ferry_bench
