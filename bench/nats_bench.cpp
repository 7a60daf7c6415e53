// Latency of a NATS request/reply round trip, and what it adds to pairing by subject, against
// references measured in the same run (the machines are shared and noisy; compare ratios, not
// absolute numbers). The issue: "A round trip must not carry cnats' default ~1 ms flush delay:
// measure it."
//
//   RawCnatsDefault      A: natsConnection_Request of 512 bytes on one connection, answered by
//                        an async subscription on a second connection that publishes the
//                        reply; default natsOptions, so the reply waits for cnats' flusher (~1 ms)
//   RawCnatsSendAsap     B: the same with natsOptions_SetSendAsap on both connections
//   FerryNatsChannel     3: ferry's side channel (sidechannel::NatsChannel, two EventLoops): the
//                        benchmark thread posts request() to one loop and waits for the answer,
//                        which the other channel's subscription publishes to msg.reply
//   FerryReadBySubject   4s: a whole 64-byte read paired by subject: create_readable serving at
//                        a fresh subject, begin_read(Subject), wait for both to complete
//   FerryReadExplicit    4e: the same with the metadata passed directly. 4s - 4e is the
//                        metadata request over NATS, plus what the race below costs: the
//                        serving SUB is sent after create_readable returns, so the request may
//                        reach the server first, get "no responders" and be retried 2 ms later
//                        (the over_2ms counter)
//   ...Ahead             4s', 4e': the same work per iteration, but each iteration creates the
//                        readable of the next one before reading its own, so the SUB is at
//                        the server in time: 4s' - 4e' is the metadata request without the race
//                        (its answer still queues on the owner's worker thread behind the SUB
//                        of the next readable and the UNSUB of the last one)
//   RegionReadBySubject  5s: a region (docs/regions.md) of 64 KiB served at a subject; the
//                        peer attaches once by that subject (one NATS request/reply, before
//                        the timing), then each iteration reads the whole region on the
//                        attachment. The attach itself is the counter attach_us
//   RegionReadExplicit   5e: the same, attached with the region's metadata in hand. The issue
//                        asks 5s/5e <= 1.2: per-transfer NATS traffic is zero either way
//   EventLoopPostRoundTrip  H: a task posted to an EventLoop that wakes the poster: the price
//                        of two thread hops, to read (3) - B by (3 makes about 14 hops, B 7)
//
// Percentiles per iteration are counters (p50_us, ...). A private nats-server on a free
// 127.0.0.1 port (/usr/sbin/nats-server) is started by the first benchmark and killed at exit.
// A summary with B/A, (3)/B and (4s)-(4e) is printed after the table.
//
//   build-bench/bench/ferry_nats_bench
#include <benchmark/benchmark.h>
#include <nats/nats.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ferry/ferry.hpp>

#include "bench/support/private_nats.hpp"
#include "loop/event_loop.hpp"
#include "sidechannel/nats_channel.hpp"

namespace {

using Clock = std::chrono::steady_clock;

constexpr std::size_t kPayload = 512;  // round trips (A, B, 3)
constexpr std::size_t kBuffer = 64;    // end to end (4)
constexpr double kMinTime = 1.0;       // seconds per benchmark

// ---------------------------------------------------------------------------------------------
// A private nats-server (bench/support/private_nats.hpp): SIGKILLed and reaped at exit, and
// killed when the thread that started it (the main thread, which runs the benchmarks) ends,
// even if its destructor never runs.

// One server for the whole run, started by the first benchmark that needs it.
const std::string& server_url() {
  static ferry::bench_support::PrivateNatsServer server;
  static const std::string url = server.url();
  return url;
}

// ---------------------------------------------------------------------------------------------
// Per-iteration latencies: percentiles as counters, means kept for the summary.

struct Result {
  std::int64_t iterations = 0;
  double mean_us = 0;
  double p50_us = 0;
};
std::mutex results_mu;
std::map<std::string, std::vector<Result>> results;

class Samples {
 public:
  explicit Samples(benchmark::State& state) : state_(state) {
    samples_.reserve(static_cast<std::size_t>(state.max_iterations));
  }
  void add(Clock::duration d) { samples_.push_back(d); }

  // Sets the counters and records the run under `key` for the summary.
  void finish(const std::string& key) {
    if (samples_.empty()) return;
    std::sort(samples_.begin(), samples_.end());
    auto us = [](Clock::duration d) {
      return std::chrono::duration<double, std::micro>(d).count();
    };
    auto at = [&](double q) {
      auto i = static_cast<std::size_t>(q * static_cast<double>(samples_.size() - 1));
      return us(samples_[i]);
    };
    Clock::duration total{};
    for (auto d : samples_) total += d;
    Result r;
    r.iterations = static_cast<std::int64_t>(samples_.size());
    r.mean_us = us(total) / static_cast<double>(samples_.size());
    r.p50_us = at(0.5);
    state_.counters["p50_us"] = r.p50_us;
    state_.counters["p90_us"] = at(0.9);
    state_.counters["p99_us"] = at(0.99);
    state_.counters["max_us"] = us(samples_.back());
    // Iterations that waited for a timer of 2 ms or more (cnats' flusher does not; ferry's
    // retry after a no-responders answer does).
    const auto slow = std::count_if(samples_.begin(), samples_.end(), [](Clock::duration d) {
      return d >= std::chrono::milliseconds(2);
    });
    state_.counters["over_2ms"] = static_cast<double>(slow) / static_cast<double>(samples_.size());
    std::lock_guard lock(results_mu);
    results[key].push_back(r);
  }

 private:
  benchmark::State& state_;
  std::vector<Clock::duration> samples_;
};

// ---------------------------------------------------------------------------------------------
// A and B: raw cnats.

void reply_with_data(natsConnection* nc, natsSubscription*, natsMsg* msg, void*) {
  if (const char* reply = natsMsg_GetReply(msg))
    natsConnection_Publish(nc, reply, natsMsg_GetData(msg), natsMsg_GetDataLength(msg));
  natsMsg_Destroy(msg);
}

void raw_cnats_round_trip(benchmark::State& state, bool send_asap, const std::string& key) {
  natsOptions* opts = nullptr;
  natsConnection* requester = nullptr;
  natsConnection* responder = nullptr;
  natsSubscription* sub = nullptr;
  const std::string subject = send_asap ? "bench.raw.asap" : "bench.raw.default";
  std::string url;
  try {
    url = server_url();
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
    return;
  }
  natsStatus s = natsOptions_Create(&opts);
  if (s == NATS_OK) s = natsOptions_SetURL(opts, url.c_str());
  if (s == NATS_OK && send_asap) s = natsOptions_SetSendAsap(opts, true);
  if (s == NATS_OK) s = natsConnection_Connect(&responder, opts);
  if (s == NATS_OK)
    s = natsConnection_Subscribe(&sub, responder, subject.c_str(), reply_with_data, nullptr);
  // The SUB is at the server once the PONG of this flush is back.
  if (s == NATS_OK) s = natsConnection_Flush(responder);
  if (s == NATS_OK) s = natsConnection_Connect(&requester, opts);

  const std::string payload(kPayload, 'x');
  auto request = [&] {
    natsMsg* reply = nullptr;
    natsStatus rs = natsConnection_Request(&reply, requester, subject.c_str(), payload.data(),
                                           static_cast<int>(payload.size()), 5000);
    if (rs == NATS_OK && natsMsg_GetDataLength(reply) != static_cast<int>(kPayload)) rs = NATS_ERR;
    natsMsg_Destroy(reply);
    return rs;
  };
  if (s == NATS_OK) s = request();  // warm up the response subscription
  if (s != NATS_OK) {
    state.SkipWithError(natsStatus_GetText(s));
  } else {
    Samples samples(state);
    for (auto _ : state) {
      const auto t0 = Clock::now();
      if (natsStatus rs = request(); rs != NATS_OK) {
        state.SkipWithError(natsStatus_GetText(rs));
        break;
      }
      samples.add(Clock::now() - t0);
    }
    samples.finish(key);
  }
  natsSubscription_Destroy(sub);
  natsConnection_Destroy(requester);
  natsConnection_Destroy(responder);
  natsOptions_Destroy(opts);
}

void RawCnatsDefault(benchmark::State& state) { raw_cnats_round_trip(state, false, "A"); }
void RawCnatsSendAsap(benchmark::State& state) { raw_cnats_round_trip(state, true, "B"); }

// ---------------------------------------------------------------------------------------------
// 3: ferry's side channel.

ferry::NatsOptions nats_options() {
  ferry::NatsOptions o;
  o.servers = {server_url()};
  o.use_environment = false;
  o.prefix = "bench";
  return o;
}

// An EventLoop with a NatsChannel built and destroyed on the loop's thread.
struct ChannelSide {
  explicit ChannelSide(const std::string& client_id) {
    const ferry::NatsOptions o = nats_options();
    channel = loop.call(
        [&] { return std::make_unique<ferry::sidechannel::NatsChannel>(loop, o, client_id); });
  }
  ~ChannelSide() {
    loop.close([this] { channel.reset(); });
  }
  ChannelSide(const ChannelSide&) = delete;
  ChannelSide& operator=(const ChannelSide&) = delete;

  ferry::loop::EventLoop loop;
  std::unique_ptr<ferry::sidechannel::NatsChannel> channel;
};

// One request through `asker`, from a foreign thread; the answer as the loop saw it.
ferry::sidechannel::Message channel_request(ChannelSide& asker, const std::string& subject,
                                            const std::string& payload) {
  auto answer = std::make_shared<std::promise<ferry::sidechannel::Message>>();
  auto got = answer->get_future();
  asker.loop.post([&asker, subject, payload, answer] {
    asker.channel->request(
        subject, payload, [answer](const ferry::sidechannel::Message& m) { answer->set_value(m); });
  });
  if (got.wait_for(std::chrono::seconds(5)) != std::future_status::ready)
    throw std::runtime_error("no answer within 5 s");
  return got.get();
}

void FerryNatsChannel(benchmark::State& state) {
  try {
    const std::string subject = "bench.channel.rt";
    ChannelSide responder("bench-responder");
    ChannelSide asker("bench-asker");
    responder.loop.call([&] {
      auto* ch = responder.channel.get();
      ch->subscribe(subject, {}, [ch](const ferry::sidechannel::Message& m) {
        if (!m.reply.empty()) ch->publish(m.reply, m.data);
      });
    });
    const std::string payload(kPayload, 'x');
    // subscribe() returns before the SUB is sent: ask until someone answers.
    const auto until = Clock::now() + std::chrono::seconds(5);
    while (channel_request(asker, subject, payload).no_responders) {
      if (Clock::now() > until) throw std::runtime_error("the responder never subscribed");
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    Samples samples(state);
    for (auto _ : state) {
      const auto t0 = Clock::now();
      auto m = channel_request(asker, subject, payload);
      if (m.no_responders || m.data.size() != kPayload) {
        state.SkipWithError("wrong answer");
        break;
      }
      samples.add(Clock::now() - t0);
    }
    samples.finish("3");
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

// ---------------------------------------------------------------------------------------------
// 4: pairing end to end.

ferry::ConnectorOptions connector_options(const std::string& name) {
  ferry::ConnectorOptions o;
  o.name = name;
  o.nats = nats_options();
  o.nats.prefix.clear();  // ferry's default namespace
  return o;
}

// ahead: each iteration creates the readable of the next one before reading its own, so that
// the serving SUB has reached the server long before begin_read asks there (no race); the
// timed work is the same: one create_readable, one begin_read, both completions.
void ferry_read(benchmark::State& state, bool by_subject, bool ahead, const std::string& key) {
  try {
    ferry::Connector owner(connector_options("bench-owner"));
    ferry::Connector peer(connector_options("bench-peer"));
    std::vector<std::byte> src(kBuffer, std::byte{1});
    std::vector<std::byte> dst(kBuffer);
    static std::atomic<std::uint64_t> next_subject{0};
    ferry::OperationOptions options;
    options.timeout = std::chrono::seconds(10);  // a lost iteration fails instead of hanging
    struct Served {
      std::string subject;
      ferry::ReadableOperation readable;
    };
    auto create = [&] {
      ferry::OperationOptions served = options;
      if (by_subject) served.subject = "bench.e2e." + std::to_string(next_subject++);
      auto readable = owner.create_readable({ferry::Descriptor(src.data(), kBuffer)}, served);
      return Served{served.subject, std::move(readable)};
    };
    auto read = [&](Served& s) {
      std::vector<ferry::Descriptor> local{ferry::Descriptor(dst.data(), kBuffer)};
      auto op = by_subject ? peer.begin_read(ferry::Subject(s.subject), std::move(local), options)
                           : peer.begin_read(s.readable.metadata(), std::move(local), options);
      op.wait_for_completion();
      s.readable.wait_for_completion();
    };
    // Warm up: the TCP connection between the two, the first subscriptions.
    Served next = create();
    read(next);
    if (ahead) {
      next = create();
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    Samples samples(state);
    for (auto _ : state) {
      const auto t0 = Clock::now();
      Served current = ahead ? std::exchange(next, create()) : create();
      read(current);
      samples.add(Clock::now() - t0);
    }
    samples.finish(key);
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

void FerryReadBySubject(benchmark::State& state) { ferry_read(state, true, false, "4s"); }
void FerryReadExplicit(benchmark::State& state) { ferry_read(state, false, false, "4e"); }
void FerryReadBySubjectAhead(benchmark::State& state) { ferry_read(state, true, true, "4s'"); }
void FerryReadExplicitAhead(benchmark::State& state) { ferry_read(state, false, true, "4e'"); }

// ---------------------------------------------------------------------------------------------
// 5: transfers on a region's attachment, attached by subject or by metadata in hand.

constexpr std::size_t kRegion = 64u << 10;

void region_read(benchmark::State& state, bool by_subject, const std::string& key) {
  try {
    ferry::Connector owner(connector_options("bench-owner"));
    ferry::Connector peer(connector_options("bench-peer"));
    std::vector<std::byte> pool(kRegion, std::byte{2});
    std::vector<std::byte> dst(kRegion);
    static std::atomic<std::uint64_t> next_subject{0};
    ferry::RegionOptions ro;
    ro.access = ferry::RegionAccess::read;
    ro.queue_events = false;
    if (by_subject) ro.subject = "bench.region." + std::to_string(next_subject++);
    auto region = owner.create_region({ferry::Descriptor(pool.data(), kRegion)}, ro);
    // The serving SUB may reach the server after create_region returns: the attach retries.
    const auto t0 = Clock::now();
    auto attachment = by_subject ? peer.attach(ferry::Subject(ro.subject))
                                 : peer.attach(region.metadata());
    attachment.wait_attached();
    state.counters["attach_us"] =
        std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
    ferry::TransferOptions options;
    options.timeout = std::chrono::seconds(10);  // a lost iteration fails instead of hanging
    auto read = [&] {
      auto op = attachment.read({ferry::RegionRange{0, kRegion}},
                                {ferry::Descriptor(dst.data(), kRegion)}, options);
      op.wait_for_completion();
    };
    read();  // warm up
    Samples samples(state);
    for (auto _ : state) {
      const auto t1 = Clock::now();
      read();
      samples.add(Clock::now() - t1);
    }
    samples.finish(key);
    if (dst != pool) state.SkipWithError("the bytes read differ from the region's");
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

void RegionReadBySubject(benchmark::State& state) { region_read(state, true, "5s"); }
void RegionReadExplicit(benchmark::State& state) { region_read(state, false, "5e"); }

// ---------------------------------------------------------------------------------------------
// H: the price of a thread hop here, for reading (3): a task posted to an EventLoop (uv_async)
// that wakes the posting thread (promise), i.e. two hops.

void EventLoopPostRoundTrip(benchmark::State& state) {
  ferry::loop::EventLoop loop;
  Samples samples(state);
  for (auto _ : state) {
    const auto t0 = Clock::now();
    std::promise<void> done;
    auto finished = done.get_future();
    loop.post([&done] { done.set_value(); });
    finished.wait();
    samples.add(Clock::now() - t0);
  }
  samples.finish("H");
}

void configure(benchmark::internal::Benchmark* b) {
  b->UseRealTime()->MinTime(kMinTime)->Unit(benchmark::kMicrosecond);
}

BENCHMARK(RawCnatsDefault)->Apply(configure);
BENCHMARK(RawCnatsSendAsap)->Apply(configure);
BENCHMARK(FerryNatsChannel)->Apply(configure);
BENCHMARK(FerryReadBySubject)->Apply(configure);
BENCHMARK(FerryReadExplicit)->Apply(configure);
BENCHMARK(FerryReadBySubjectAhead)->Apply(configure);
BENCHMARK(FerryReadExplicitAhead)->Apply(configure);
BENCHMARK(RegionReadBySubject)->Apply(configure);
BENCHMARK(RegionReadExplicit)->Apply(configure);
BENCHMARK(EventLoopPostRoundTrip)->Apply(configure);

// ---------------------------------------------------------------------------------------------
// Summary.

// The runs that were reported: those with the most iterations (the others only sized the
// loop); with --benchmark_repetitions, the median of them.
std::optional<Result> reported(const std::string& key) {
  auto it = results.find(key);
  if (it == results.end() || it->second.empty()) return std::nullopt;
  std::int64_t most = 0;
  for (const auto& r : it->second) most = std::max(most, r.iterations);
  std::vector<Result> runs;
  for (const auto& r : it->second)
    if (r.iterations == most) runs.push_back(r);
  auto median = [&](double Result::*field) {
    std::vector<double> v;
    for (const auto& r : runs) v.push_back(r.*field);
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  Result out;
  out.iterations = most;
  out.mean_us = median(&Result::mean_us);
  out.p50_us = median(&Result::p50_us);
  return out;
}

void print_summary() {
  std::lock_guard lock(results_mu);
  const std::pair<const char*, const char*> rows[] = {
      {"A", "raw cnats request/reply, default options"},
      {"B", "raw cnats request/reply, SendAsap"},
      {"3", "ferry NatsChannel request/reply"},
      {"4s", "ferry 64 B read paired by subject"},
      {"4e", "ferry 64 B read, explicit metadata"},
      {"4s'", "  by subject, readable created ahead"},
      {"4e'", "  explicit, readable created ahead"},
      {"5s", "ferry 64 KiB region read, attached by subject"},
      {"5e", "ferry 64 KiB region read, attached by metadata"},
      {"H", "two thread hops through an EventLoop"},
  };
  std::printf("\nSummary (microseconds per round trip or per operation, this run):\n");
  std::printf("  %-3s %-42s %10s %10s %10s\n", "", "", "mean", "median", "iterations");
  for (const auto& [key, what] : rows) {
    if (auto r = reported(key))
      std::printf("  %-3s %-42s %10.1f %10.1f %10lld\n", key, what, r->mean_us, r->p50_us,
                  static_cast<long long>(r->iterations));
    else
      std::printf("  %-3s %-42s %10s\n", key, what, "not run");
  }
  auto ratio = [](const char* name, const char* num, const char* den) {
    auto n = reported(num);
    auto d = reported(den);
    if (!n || !d) return;
    std::printf("  %-26s mean %8.3f   median %8.3f\n", name, n->mean_us / d->mean_us,
                n->p50_us / d->p50_us);
  };
  auto diff = [](const char* name, const char* a, const char* b) {
    auto x = reported(a);
    auto y = reported(b);
    if (!x || !y) return;
    std::printf("  %-26s mean %8.1f   median %8.1f  us\n", name, x->mean_us - y->mean_us,
                x->p50_us - y->p50_us);
  };
  ratio("B/A", "B", "A");
  ratio("(3)/B", "3", "B");
  ratio("(5 subject)/(5 explicit)", "5s", "5e");
  diff("(4 subject)-(4 explicit)", "4s", "4e");
  diff("ahead: (4s')-(4e')", "4s'", "4e'");
  diff("(3)-B", "3", "B");
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  print_summary();
  benchmark::Shutdown();
  return 0;
}
