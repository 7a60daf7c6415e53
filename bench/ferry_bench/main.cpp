// ferry-bench: the initiator/target benchmark of ferry (bench/README.md, "ferry-bench").
//
// The initiator runs the measured loop; the target, another process (started here with
// --role both), holds the passive operations. They talk over a control channel of their own
// (plain cnats, control.hpp); ferry moves the bytes by the method of each point.
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <random>
#include <thread>

#include "bench/ferry_bench/control.hpp"
#include "bench/ferry_bench/initiator.hpp"
#include "bench/ferry_bench/options.hpp"
#include "bench/ferry_bench/processes.hpp"
#include "bench/ferry_bench/report.hpp"
#include "bench/ferry_bench/sim_verbs.hpp"
#include "bench/ferry_bench/target.hpp"

namespace ferry_bench {
namespace {

std::uint64_t random64() {
  std::random_device rd;
  return (std::uint64_t{rd()} << 32) ^ rd();
}

std::vector<PointSpec> sweep(const Options& o, const std::string& session, std::uint64_t seed) {
  std::vector<PointSpec> points;
  for (const auto& method : o.methods) {
    for (const auto& op : o.op_types) {
      for (unsigned inflight : o.inflight) {
        PointSpec p;
        p.method = method;
        p.write = op == "WRITE";
        p.by_subject = o.by_subject;
        p.by_region = o.by_region;
        p.kv = o.kv;
        p.inflight = inflight;
        p.threads = o.num_threads;
        p.check = o.check_consistency;
        p.seed = seed;
        p.session = session;
        p.initiator_device = o.initiator_vram ? 0 : -1;
        p.target_device = o.target_vram ? 0 : -1;
        if (o.kv) {
          p.block_size = o.kv_page_size;
          p.batch_size = o.kv_pages;
          points.push_back(p);
          continue;
        }
        for (std::size_t batch = o.start_batch_size; batch <= o.max_batch_size; batch *= 2) {
          for (std::size_t block = o.start_block_size; block <= o.max_block_size;
               block *= o.block_size_factor) {
            p.block_size = block;
            p.batch_size = batch;
            points.push_back(p);
            if (block > o.max_block_size / o.block_size_factor) break;  // no overflow
          }
          if (batch > o.max_batch_size / 2) break;
        }
      }
    }
  }
  return points;
}

// Asks the target until it answers (it may still be starting), for up to 20 s.
void wait_for_target(ControlClient& control, Initiator& initiator) {
  const auto until = Clock::now() + std::chrono::seconds(20);
  for (;;) {
    if (auto why = initiator.aborted(); !why.empty()) throw ControlError(why, false);
    try {
      control.request(json{{"cmd", "hello"}}, std::chrono::seconds(1));
      return;
    } catch (const ControlError& e) {
      if (Clock::now() > until)
        throw ControlError(std::string("no target answers: ") + e.what(), e.no_responders());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

int run(Options o) {
  if (o.role == "target") return run_target(o);

  const auto say = [&](const std::string& what) {
    std::fprintf(stderr, "ferry-bench: %s\n", what.c_str());
  };
  install_signal_handlers();
  // VRAM is cuda:0; say at once why it cannot be (the target, a process of this host, would
  // fail the same way).
  if (o.initiator_vram || o.target_vram) {
    try {
      check_device(0);
    } catch (const std::exception& e) {
      throw std::runtime_error(std::string("VRAM: ") + e.what());
    }
  }
  if (o.session.empty()) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "fb-%08llx",
                  static_cast<unsigned long long>(random64() & 0xffffffffULL));
    o.session = buf;
  }
  std::unique_ptr<NatsServerProcess> nats;
  if (o.nats_url.empty()) {
    nats = std::make_unique<NatsServerProcess>();
    o.nats_url = nats->url();
  }
  if (o.simulated_verbs && !use_simulated_verbs()) {
    say("--simulated_verbs: this build has no simulated fabric (tests or verbs not built); "
        "verbs is what this host offers");
    o.simulated_verbs = false;
  }
  if (o.methods.empty()) {
    // Those that move the memory asked for: CUDA memory for VRAM, host memory for DRAM.
    const bool vram = o.initiator_vram || o.target_vram;
    const bool dram = !o.initiator_vram || !o.target_vram;
    for (const auto& m : ferry::probe_methods())
      if (m.available && (!vram || m.moves_cuda) && (!dram || m.moves_host))
        o.methods.push_back(m.method);
  }

  ControlClient control(o.nats_url, o.session);
  Initiator initiator(o, control);
  std::unique_ptr<ChildProcess> target;
  if (o.role == "both") {
    std::vector<std::string> argv{self_path(), "--role",    "target", "--nats_url",
                                  o.nats_url,  "--session", o.session};
    if (o.simulated_verbs) argv.push_back("--simulated_verbs");
    if (o.quiet) argv.push_back("--quiet");
    if (!o.metrics.empty()) {
      const auto colon = o.metrics.rfind(':');
      argv.insert(argv.end(),
                  {"--metrics", o.metrics.substr(0, colon + 1) +
                                    std::to_string(std::stoul(o.metrics.substr(colon + 1)) + 1)});
    }
    target = std::make_unique<ChildProcess>(argv, [&initiator](const std::string& how) {
      initiator.abort("the target process " + how);
    });
  }

  const auto points = sweep(o, o.session, random64());
  std::vector<PointResult> results;
  std::string fatal;
  try {
    wait_for_target(control, initiator);
    for (std::size_t k = 0; k < points.size(); ++k) {
      if (!o.quiet) {
        PointResult what;
        what.method =
            points[k].method == "verbs" && o.simulated_verbs ? "verbs(sim)" : points[k].method;
        what.op_type = points[k].op_type();
        what.pairing = points[k].by_region    ? "region"
                       : points[k].by_subject ? "subject"
                                              : "metadata";
        what.kv = points[k].kv;
        what.block_size = points[k].block_size;
        what.batch_size = points[k].batch_size;
        what.inflight = points[k].inflight;
        what.threads = points[k].threads;
        std::fprintf(stderr, "[%zu/%zu] %s ...\n", k + 1, points.size(), describe(what).c_str());
      }
      PointResult r = initiator.run(points[k]);
      if (!o.quiet) {
        if (!r.skipped.empty()) {
          std::fprintf(stderr, "        skipped: %s\n", r.skipped.c_str());
        } else {
          std::fprintf(stderr, "        %.3f GB/s, %llu ops in %.2f s, p50 %.1f us%s\n",
                       r.bandwidth_gbps, static_cast<unsigned long long>(r.iterations), r.seconds,
                       r.lat_p50_us,
                       r.errors > 0 ? (", " + std::to_string(r.errors) + " errors").c_str() : "");
        }
      }
      for (const auto& p : r.problems) say(describe(r) + ": " + p);
      results.push_back(std::move(r));
      if (auto why = initiator.aborted(); !why.empty()) throw ControlError(why, false);
    }
  } catch (const std::exception& e) {
    // A request cut short by abort() fails with the closed connection; say why it was closed.
    fatal = initiator.aborted().empty() ? e.what() : initiator.aborted();
  }
  if (!fatal.empty()) say("stopped: " + fatal);

  print_table(stdout, results);
  const ferry::ConnectorStats stats = initiator.stats();
  std::printf("\nthe initiator's Connector::stats():\n%s", stats.to_text().c_str());
  if (!stats.to_text().empty() && stats.to_text().back() != '\n') std::printf("\n");
  std::fflush(stdout);

  int status = fatal.empty() ? 0 : 1;
  for (const auto& r : results) {
    if (r.failed()) status = 1;
  }
  try {
    if (!o.json_path.empty())
      write_json(o.json_path, o.command, results, json::parse(stats.to_json()));
    if (!o.csv_path.empty()) write_csv(o.csv_path, results);
  } catch (const std::exception& e) {
    say(e.what());
    status = 1;
  }
  if (!o.png_path.empty()) {
    if (auto why = write_png(o.png_path, results); !why.empty()) say(why);
  }

  if (target) {
    if (!target->exited()) {
      try {
        control.request(json{{"cmd", "quit"}}, std::chrono::seconds(2));
      } catch (const std::exception&) {
        // It is stopped below either way.
      }
    }
    const std::string how = target->stop(std::chrono::seconds(5));
    if (fatal.empty() && how != "exited with status 0") {
      say("the target process " + how);
      status = 1;
    }
  }
  return status;
}

}  // namespace
}  // namespace ferry_bench

int main(int argc, char** argv) {
  ferry_bench::Options options;
  try {
    options = ferry_bench::parse_options(argc, argv);
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "ferry-bench: %s (see --help)\n", e.what());
    return 2;
  }
  try {
    return ferry_bench::run(std::move(options));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ferry-bench: %s\n", e.what());
    return 1;
  }
}
