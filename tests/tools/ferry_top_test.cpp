// ferry-top (tools/ferry-top): its view fed answers by hand; the program against connectors
// that move data on a private nats-server, as JSON and as a person sees it in a terminal
// (tmux, 150 columns).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <ferry/ferry.hpp>
#include <nlohmann/json.hpp>

#include "tests/support/nats_server.hpp"
#include "tests/support/patterns.hpp"
#include "tests/support/util.hpp"
#include "tests/tools/tool_run.hpp"
#include "tools/ferry-top/view.hpp"

namespace ferry {
namespace {

using namespace std::chrono_literals;
using json = nlohmann::json;
using tools::View;

// A stats answer as a connector gives it, with what the view reads.
json answer(const std::string& name, const std::string& id, double uptime, std::uint64_t ended,
            std::uint64_t in, std::uint64_t out, json peers = json::array(),
            json errors = json::object()) {
  return {{"version", 1},
          {"name", name},
          {"id", id},
          {"host", "h-" + name},
          {"pid", 42},
          {"uptime_s", uptime},
          {"methods", {"cma", "tcp"}},
          {"nats", {{"state", "connected"}}},
          {"stats",
           {{"methods", {{{"method", "cma"}, {"complete", {{"operations", ended}}}}}},
            {"bytes_in", in},
            {"bytes_out", out},
            {"live", 2},
            {"latency", {{"p50_us", 45.0}, {"p99_us", 2100.0}}},
            {"errors", errors},
            {"peers", peers}}}};
}

TEST(FerryTopView, RatesComeFromTwoRoundsOverEachConnectorsOwnClock) {
  View v;
  v.update({answer("prefill-1", "a", 10, 100, 0, 1'000'000'000),
            answer("decode-1", "b", 20, 100, 1'000'000'000, 0)});
  ASSERT_EQ(v.rows().size(), 2u);
  EXPECT_FALSE(v.rows()[0].ops_per_s) << "no rates from one round";
  // Two seconds later by prefill's clock, four by decode's.
  const json peers =
      json::array({json{{"id", "b"}, {"name", "decode-1"}, {"bytes_out", 3'000'000'000u}}});
  v.update({answer("prefill-1", "a", 12, 300, 0, 3'000'000'000, peers, json{{"Timeout", 3}}),
            answer("decode-1", "b", 24, 180, 1'000'000'000, 0)});
  const View::Row* prefill = nullptr;
  for (const auto& r : v.rows())
    if (r.name == "prefill-1") prefill = &r;
  ASSERT_NE(prefill, nullptr);
  EXPECT_DOUBLE_EQ(*prefill->ops_per_s, 100.0);
  EXPECT_DOUBLE_EQ(*prefill->out_bytes_per_s, 1e9);
  EXPECT_EQ(prefill->errors.at("Timeout"), 3u);
  const json j = v.to_json();
  EXPECT_DOUBLE_EQ(j["totals"]["ops_per_s"].get<double>(), 100.0 + 20.0);
  EXPECT_EQ(j["totals"]["errors"], 3);
  EXPECT_EQ(j["totals"]["live"], 4);
  ASSERT_EQ(j["pairs"].size(), 1u);
  EXPECT_EQ(j["pairs"][0]["bytes"], 3'000'000'000u);
  const std::string table = v.table("title", 150);
  EXPECT_NE(table.find("prefill-1"), std::string::npos) << table;
  EXPECT_NE(table.find("1.00 GB/s"), std::string::npos) << table;
  EXPECT_NE(table.find("Timeout:3"), std::string::npos) << table;
  EXPECT_NE(table.find("2.1ms"), std::string::npos) << table;
  EXPECT_NE(table.find("TOTAL"), std::string::npos) << table;
  EXPECT_NE(table.find("decode-1 <-> prefill-1"), std::string::npos) << table;
  // A connector that restarted (its counters fell) shows no negative rate.
  v.update({answer("prefill-1", "a", 13, 5, 0, 10)});
  EXPECT_DOUBLE_EQ(*v.rows()[0].ops_per_s, 0.0);
  // Junk in a round is skipped, whole.
  json wrong = answer("y", "d", 1, 0, 0, 0);
  wrong["methods"] = json::array({1, 2});
  v.update({json("not an answer"), json::object(), wrong, answer("x", "c", 1, 0, 0, 0)});
  ASSERT_EQ(v.rows().size(), 1u);
  EXPECT_EQ(v.rows()[0].name, "x");
}

TEST(FerryTopView, ATableFitsItsWidth) {
  View v;
  v.update({answer(std::string(80, 'n'), "a", 1, 0, 0, 0)});
  const std::string table = v.table(std::string(200, 't'), 60);
  std::size_t start = 0;
  while (start < table.size()) {
    const std::size_t end = table.find('\n', start);
    EXPECT_LE(end - start, 60u) << table.substr(start, end - start);
    start = end + 1;
  }
}

// Three workers moving data all the time, in this process: prefill-1 serves readables that
// decode-1 and decode-2 read, by metadata, each read followed by the next.
class Cluster {
 public:
  explicit Cluster(const std::string& url) {
    for (const char* name : {"prefill-1", "decode-1", "decode-2"})
      workers_.push_back(std::make_unique<Connector>(test::nats_options(name, {url})));
    mover_ = std::thread([this] { move(); });
  }
  ~Cluster() {
    stop_ = true;
    mover_.join();
  }
  std::uint64_t moved() const { return moved_.load(); }

 private:
  void move() {
    auto src = test::patterned(1 << 20, 1);
    auto dst = test::buffer(1 << 20);
    for (std::uint64_t i = 0; !stop_; ++i) {
      Connector& reader = *workers_[1 + i % 2];
      try {
        auto readable = workers_[0]->create_readable({Descriptor(src.data(), src.size())});
        auto read = reader.begin_read(readable.metadata(), {Descriptor(dst.data(), dst.size())});
        if (read.wait_for_completion(10s) && readable.wait_for_completion(10s)) ++moved_;
      } catch (const Error&) {
      }
      std::this_thread::sleep_for(5ms);
    }
  }

  std::vector<std::unique_ptr<Connector>> workers_;
  std::atomic<bool> stop_{false};
  std::atomic<std::uint64_t> moved_{0};
  std::thread mover_;
};

TEST(FerryTop, OnceAsJsonSeesEveryWorkerAndTheirRates) {
  test::NatsServer server;
  Cluster cluster(server.url());
  ASSERT_TRUE(test::eventually([&] { return cluster.moved() > 5; }, 20s));
  const test::ToolRun run = test::run_tool(
      FERRY_TOP_PATH,
      {"--nats", server.url(), "--once", "--json", "--interval", "0.5", "--timeout-ms", "300"});
  ASSERT_EQ(run.exit_code, 0) << run.err;
  const json j = json::parse(run.out);
  ASSERT_EQ(j["workers"].size(), 3u) << run.out;
  double prefill_out = 0;
  for (const json& w : j["workers"]) {
    EXPECT_EQ(w["nats"], "connected");
    EXPECT_FALSE(w["ops_per_s"].is_null()) << w;
    if (w["name"] == "prefill-1") prefill_out = w["out_bytes_per_s"].get<double>();
  }
  EXPECT_GT(prefill_out, 0) << run.out;
  EXPECT_GT(j["totals"]["ops_per_s"].get<double>(), 0);
  ASSERT_GE(j["pairs"].size(), 2u) << run.out;
  EXPECT_EQ(j["subject"], "ferry.stats");
}

TEST(FerryTop, NoServerAndBadArgumentsSaySo) {
  const test::ToolRun none =
      test::run_tool(FERRY_TOP_PATH, {"--nats", "nats://127.0.0.1:1", "--once"});
  EXPECT_EQ(none.exit_code, 1);
  EXPECT_NE(none.err.find("cannot reach NATS at nats://127.0.0.1:1"), std::string::npos)
      << none.err;
  const test::ToolRun bad = test::run_tool(FERRY_TOP_PATH, {"--interval", "zero"});
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.err.find("--interval wants seconds"), std::string::npos) << bad.err;
  const test::ToolRun unset = test::run_tool(FERRY_TOP_PATH, {"--once"});
  EXPECT_EQ(unset.exit_code, 2);
  EXPECT_NE(unset.err.find("FERRY_NATS_URL"), std::string::npos) << unset.err;
}

// What `tmux capture-pane` shows of the pane, or "" when tmux failed.
std::string pane(const std::string& socket) {
  const test::ToolRun r =
      test::run_tool("/usr/bin/tmux", {"-L", socket, "capture-pane", "-p", "-t", "top"});
  return r.exit_code == 0 ? r.out : std::string();
}

// As a person sees it: ferry-top live in a 150x40 terminal, refreshed twice a second.
TEST(FerryTop, LiveInATerminalShowsEveryWorkerTheTotalsAndTheBusiestPairs) {
  if (::access("/usr/bin/tmux", X_OK) != 0) GTEST_SKIP() << "tmux is not installed";
  test::NatsServer server;
  Cluster cluster(server.url());
  const std::string socket = "ferry-top-test-" + std::to_string(::getpid());
  const std::string command =
      std::string(FERRY_TOP_PATH) + " --nats " + server.url() + " --interval 0.5 --timeout-ms 300";
  const test::ToolRun started =
      test::run_tool("/usr/bin/tmux", {"-L", socket, "-f", "/dev/null", "new-session", "-d", "-s",
                                       "top", "-x", "150", "-y", "40", command});
  ASSERT_EQ(started.exit_code, 0) << started.err;
  std::string screen;
  const bool shown = test::eventually(
      [&] {
        screen = pane(socket);
        return screen.find("decode-2") != std::string::npos &&
               screen.find("BUSIEST PAIRS") != std::string::npos &&
               screen.find("decode-1 <-> prefill-1") != std::string::npos &&
               screen.find("MB/s") != std::string::npos;
      },
      20s);
  test::run_tool("/usr/bin/tmux", {"-L", socket, "kill-server"});
  ASSERT_TRUE(shown) << "the terminal showed:\n" << screen;
  // One line per worker, a header, the totals; the clear-screen redraw leaves one table.
  EXPECT_EQ(screen.find("HOST"), screen.rfind("HOST")) << screen;
  EXPECT_NE(screen.find("3 connectors answering at 'ferry.stats'"), std::string::npos) << screen;
  EXPECT_NE(screen.find("TOTAL"), std::string::npos) << screen;
  for (const char* name : {"prefill-1", "decode-1", "decode-2"})
    EXPECT_NE(screen.find(name), std::string::npos) << screen;
  std::printf("%s\n", screen.c_str());
}

}  // namespace
}  // namespace ferry
