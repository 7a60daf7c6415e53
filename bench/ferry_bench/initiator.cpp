#include "bench/ferry_bench/initiator.hpp"

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <optional>
#include <thread>
#include <variant>

namespace ferry_bench {

namespace {

constexpr std::uint64_t kMinIterations = 8;
constexpr std::uint64_t kMaxIterations = 100000;
constexpr std::size_t kMaxLiveDescriptors = 8192;
// An initiator thread that gets no operation from the target for this long fails the point.
constexpr auto kStarved = std::chrono::seconds(30);
constexpr auto kRequestTimeout = std::chrono::seconds(30);
constexpr auto kBatchTimeout = std::chrono::seconds(3);
// Waits that also watch for abort() wake at least this often.
constexpr auto kTick = std::chrono::milliseconds(50);

double us(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

// Nearest-rank percentile of sorted values.
double percentile(const std::vector<double>& sorted, double q) {
  if (sorted.empty()) return 0;
  auto rank = static_cast<std::size_t>(std::ceil(q * static_cast<double>(sorted.size())));
  return sorted[std::clamp<std::size_t>(rank, 1, sorted.size()) - 1];
}

}  // namespace

json PointResult::to_json() const {
  return json{{"method", method},
              {"op_type", op_type},
              {"pairing", pairing},
              {"kv", kv},
              {"block_size", block_size},
              {"batch_size", batch_size},
              {"bytes_per_op", bytes_per_op},
              {"inflight", inflight},
              {"threads", threads},
              {"iterations", iterations},
              {"seconds", seconds},
              {"bandwidth_gbps", bandwidth_gbps},
              {"bandwidth_gibps", bandwidth_gibps},
              {"ops_per_s", ops_per_s},
              {"lat_p50_us", lat_p50_us},
              {"lat_p99_us", lat_p99_us},
              {"lat_min_us", lat_min_us},
              {"prep_p50_us", prep_p50_us},
              {"post_p50_us", post_p50_us},
              {"transfer_p50_us", transfer_p50_us},
              {"skipped", skipped},
              {"errors", errors}};
}

// What the threads of one point share.
struct Initiator::Point {
  PointSpec spec;
  ferry::Connector* connector = nullptr;
  std::vector<Piece> pieces;
  std::chrono::milliseconds op_timeout{0};
  // --pairing region: the attachment, and where an operation's bytes lie in a target buffer.
  std::shared_ptr<ferry::Attachment> attachment;
  std::vector<Piece> target_pieces;
  std::uint64_t cap = 0;  // measured operations at most
  bool adaptive = false;
  std::size_t queue_depth = 1;  // metadata a thread keeps in hand

  std::atomic<bool> stop{false};  // an error: start nothing more
  std::atomic<std::uint64_t> measured_started{0};

  std::mutex mu;
  std::condition_variable cv;
  unsigned arrived = 0;
  bool released = false;
  Clock::time_point deadline;
  std::vector<std::string> problems;

  void problem(const std::string& what) {
    std::lock_guard lock(mu);
    if (problems.size() < 8) problems.push_back(what);
  }
};

// One initiator thread: its slots (a buffer each, reused by its operations in turn), the
// metadata in hand, and the completions the callbacks hand over.
struct Initiator::Thread {
  struct Item {
    std::uint64_t n;
    std::string doc;  // metadata JSON, or the subject
  };
  struct Slot {
    Buffer buffer;
    std::vector<ferry::Descriptor> descs;
    std::vector<ferry::Descriptor> host;  // descs over the buffer's host side, for the pattern
    ferry::Operation op;
    bool busy = false;
    bool measured = false;
    std::uint64_t n = 0;
    Clock::time_point posted, returned, done;  // begin_* called, returned; completion seen
    Clock::duration prep{};
    ferry::OperationStatus status{};
    std::string error;
  };
  struct Sample {
    Clock::time_point posted, returned, done;
    Clock::duration prep;
  };

  std::mutex mu;
  std::condition_variable cv;        // items arrived, a slot is done
  std::condition_variable fetch_cv;  // the queue runs low
  std::deque<Item> queue;
  bool exhausted = false;  // the target will hand out no more
  bool fetch_stop = false;
  std::deque<std::size_t> done;
  std::vector<Slot> slots;

  // Touched by the driving thread only.
  std::vector<Sample> samples;
  std::uint64_t started = 0;    // begin_* returned, warm-up included
  std::uint64_t completed = 0;  // warm-up included
  std::uint64_t errors = 0;
  std::uint64_t mismatched_ops = 0;
  std::size_t outstanding = 0;
};

Initiator::Initiator(const Options& options, ControlClient& control)
    : options_(options), control_(control) {}

Initiator::~Initiator() = default;

void Initiator::abort(const std::string& why) {
  {
    std::lock_guard lock(abort_mu_);
    if (abort_why_.empty()) abort_why_ = why;
  }
  abort_ = true;
  // A request the target took and will never answer would wait for its timeout.
  control_.close();
}

std::string Initiator::aborted() const {
  std::lock_guard lock(abort_mu_);
  return abort_why_;
}

ferry::ConnectorStats Initiator::stats() const {
  // One connector per method: their snapshots added up read as one connector's would.
  ferry::ConnectorStats all;
  for (const auto& [name, connector] : connectors_) {
    const ferry::ConnectorStats s = connector->stats();
    for (const ferry::MethodStats& m : s.methods) {
      auto it = std::find_if(all.methods.begin(), all.methods.end(),
                             [&](const ferry::MethodStats& a) { return a.method == m.method; });
      if (it == all.methods.end()) {
        all.methods.push_back(m);
        continue;
      }
      for (auto [into, from] :
           {std::pair{&it->complete, &m.complete}, std::pair{&it->cancelled, &m.cancelled},
            std::pair{&it->errored, &m.errored}}) {
        into->operations += from->operations;
        into->bytes += from->bytes;
      }
      it->latency.merge(m.latency);
    }
    all.latency.merge(s.latency);
    all.active += s.active;
    all.passive += s.passive;
    all.live += s.live;
  }
  std::sort(all.methods.begin(), all.methods.end(),
            [](const auto& a, const auto& b) { return a.method < b.method; });
  return all;
}

PointResult Initiator::run(PointSpec spec) {
  PointResult r;
  r.method = spec.method == "verbs" && options_.simulated_verbs ? "verbs(sim)" : spec.method;
  r.op_type = spec.op_type();
  r.pairing = spec.by_region ? "region" : spec.by_subject ? "subject" : "metadata";
  r.kv = spec.kv;
  r.block_size = spec.block_size;
  r.batch_size = spec.batch_size;
  r.bytes_per_op = spec.bytes_per_op();
  r.inflight = spec.inflight;
  r.threads = spec.threads;

  if (auto why = unavailable_reason(spec.method, options_.nats_url, spec.initiator_device, false);
      !why.empty()) {
    r.skipped = "initiator: " + why;
    return r;
  }
  // Budget: the initiator's slots, and at least as many target buffers.
  const std::size_t slots = spec.slots();
  const std::size_t per_buffer = spec.buffer_bytes();
  if (per_buffer > kBufferBudget / slots) {
    r.skipped = std::to_string(slots) + " in-flight operations of " + format_size(per_buffer) +
                " buffers exceed the " + format_size(kBufferBudget) + " buffer budget per side";
    return r;
  }
  // Target operations ahead: twice the operations in flight, and up to 256 when they are
  // small, within the budget; and, beyond twice those in flight, no more than 8192
  // descriptors live at once: operations of many descriptors are slower to create and carry
  // large metadata (about 80 KB for 1024 pages), and a few of them ahead are enough.
  const std::size_t ahead =
      std::min<std::size_t>({256, kBufferBudget / per_buffer,
                             std::max<std::size_t>(1, kMaxLiveDescriptors / spec.batch_size)});
  spec.pool = std::max(slots, std::min(std::max(2 * slots, ahead), kBufferBudget / per_buffer));
  const std::uint64_t cap = options_.num_iter > 0 ? options_.num_iter : kMaxIterations;
  spec.max_ops = options_.warmup_iter * spec.threads + cap;

  if (!aborted().empty()) throw ControlError(aborted(), false);
  Reply prepared = control_.request(json{{"cmd", "prepare"}, {"point", spec.to_json()}},
                                    std::chrono::seconds(120));
  if (prepared.header.contains("skipped")) {
    r.skipped = prepared.header.at("skipped").get<std::string>();
    return r;
  }

  auto& connector = connectors_[spec.method];
  if (!connector) {
    connector = std::make_unique<ferry::Connector>(connector_options(
        spec.method, options_.nats_url, "ferry-bench-initiator", options_.metrics));
  }

  Point point;
  point.spec = spec;
  point.connector = connector.get();
  if (spec.by_region) {
    // Once per point: the target's region, attached before anything is measured.
    try {
      point.attachment = std::make_shared<ferry::Attachment>(connector->attach(
          ferry::RegionMetadata::from_json(prepared.header.at("region").get<std::string>())));
      point.attachment->wait_attached();
    } catch (const std::exception& e) {
      r.skipped = std::string("attaching to the target's region: ") + e.what();
      return r;
    }
    point.target_pieces = layout(spec, Side::target);
  }
  point.pieces = layout(spec, Side::initiator);
  point.cap = cap;
  point.adaptive = options_.num_iter == 0;
  point.queue_depth = std::max<std::size_t>(1, spec.pool / spec.threads - spec.inflight);
  // Long enough for every operation in flight to go through at a slow 100 MB/s; an
  // operation paired by subject whose target is gone asks until then.
  point.op_timeout = std::chrono::milliseconds(
      30000 + static_cast<std::int64_t>(spec.bytes_per_op() * slots / 100000));

  std::vector<std::shared_ptr<Thread>> threads;
  for (unsigned t = 0; t < spec.threads; ++t) {
    auto th = std::make_shared<Thread>();
    th->slots.resize(spec.inflight);
    for (auto& s : th->slots) {
      s.buffer = Buffer(per_buffer, spec.initiator_device);
      s.descs = descriptors(s.buffer, point.pieces);
      s.host = host_descriptors(s.buffer, point.pieces);
    }
    threads.push_back(std::move(th));
  }
  std::vector<std::thread> workers;
  for (auto& th : threads) {
    workers.emplace_back([this, &point, th] { fetch(point, *th); });
    workers.emplace_back([this, &point, th] { drive(point, th); });
  }
  for (auto& w : workers) w.join();

  // The target's side: every operation started here has ended there (and for WRITE with
  // --check_consistency, its bytes were verified there).
  std::uint64_t started = 0, completed = 0, errors = 0, mismatched = 0;
  std::vector<double> lat, prep, post, transfer;
  std::optional<Clock::time_point> first, last;
  for (auto& th : threads) {
    started += th->started;
    completed += th->completed;
    errors += th->errors;
    mismatched += th->mismatched_ops;
    for (const auto& s : th->samples) {
      lat.push_back(us(s.done - s.posted));
      prep.push_back(us(s.prep));
      post.push_back(us(s.returned - s.posted));
      transfer.push_back(us(s.done - s.returned));
      if (!first || s.posted < *first) first = s.posted;
      if (!last || s.done > *last) last = s.done;
    }
  }
  threads.clear();

  // A target that cannot end the point ends the run (abort), but this point is still
  // reported, with what went wrong.
  json counts = json::object();
  if (aborted().empty()) {
    try {
      counts = control_.request(json{{"cmd", "end"}, {"used", started}}, kRequestTimeout).header;
    } catch (const ControlError& e) {
      abort(std::string("ending the point: ") + e.what());
    }
  }

  r.errors = errors;
  r.problems = std::move(point.problems);
  if (mismatched > 0) {
    r.problems.push_back("consistency: " + std::to_string(mismatched) +
                         " operations read wrong bytes");
  }
  if (counts.value("mismatch_bytes", std::uint64_t{0}) > 0) {
    r.problems.push_back("consistency: the target found " +
                         std::to_string(counts.value("mismatch_bytes", std::uint64_t{0})) +
                         " wrong bytes written (" + counts.value("first_mismatch", "") + ")");
  }
  if (spec.write && spec.check && aborted().empty() &&
      counts.value("verified", std::uint64_t{0}) < completed) {
    r.problems.push_back("consistency: the target verified " +
                         std::to_string(counts.value("verified", std::uint64_t{0})) + " of " +
                         std::to_string(completed) + " writes");
  }
  const auto target_completed = counts.value("completed", std::uint64_t{0});
  if (!aborted().empty()) {
    r.problems.push_back("stopped: " + aborted());
  } else if (errors == 0 && target_completed != completed) {
    r.errors +=
        completed > target_completed ? completed - target_completed : target_completed - completed;
    r.problems.push_back("the target saw " + std::to_string(target_completed) +
                         " operations complete, the initiator " + std::to_string(completed));
  }
  if (counts.value("errored", std::uint64_t{0}) > 0)
    r.problems.push_back("target: " + counts.value("first_error", ""));

  r.iterations = lat.size();
  if (first && last && *last > *first) {
    r.seconds = std::chrono::duration<double>(*last - *first).count();
    const double bytes = static_cast<double>(r.iterations) * static_cast<double>(r.bytes_per_op);
    r.bandwidth_gbps = bytes / r.seconds / 1e9;
    r.bandwidth_gibps = bytes / r.seconds / static_cast<double>(1u << 30);
    r.ops_per_s = static_cast<double>(r.iterations) / r.seconds;
  }
  for (auto* v : {&lat, &prep, &post, &transfer}) std::sort(v->begin(), v->end());
  r.lat_p50_us = percentile(lat, 0.5);
  r.lat_p99_us = percentile(lat, 0.99);
  r.lat_min_us = lat.empty() ? 0 : lat.front();
  r.prep_p50_us = percentile(prep, 0.5);
  r.post_p50_us = percentile(post, 0.5);
  r.transfer_p50_us = percentile(transfer, 0.5);
  return r;
}

// Keeps the thread's queue of metadata filled from the target, in batches, ahead of need.
void Initiator::fetch(Point& point, Thread& th) {
  const std::size_t depth = point.queue_depth;
  const std::size_t low = std::max<std::size_t>(1, depth / 2);
  for (;;) {
    std::size_t want = 0;
    {
      std::unique_lock lock(th.mu);
      th.fetch_cv.wait_for(lock, kTick, [&] { return th.fetch_stop || th.queue.size() < low; });
      if (th.fetch_stop) return;
      if (th.queue.size() >= low) continue;
      want = depth - th.queue.size();
    }
    if (abort_) return;
    // The target answers a batch within its 20 ms wait; a reply that does not come in
    // kBatchTimeout is asked again (the operations it carried are cancelled at the end), so
    // that a fetcher told to stop is never held up for long by a target that died.
    Reply r;
    try {
      const auto give_up = Clock::now() + kRequestTimeout;
      for (;;) {
        try {
          r = control_.request(json{{"cmd", "batch"},
                                    {"max", want},
                                    {"min", std::max<std::size_t>(1, want / 2)},
                                    {"wait_ms", 20}},
                               kBatchTimeout);
          break;
        } catch (const ControlError& e) {
          if (e.no_responders() || abort_ || Clock::now() > give_up) throw;
          std::lock_guard lock(th.mu);
          if (th.fetch_stop) return;
        }
      }
    } catch (const std::exception& e) {
      point.problem(std::string("fetching operations from the target: ") + e.what());
      point.stop = true;
      std::lock_guard lock(th.mu);
      th.exhausted = true;
      th.cv.notify_all();
      return;
    }
    std::deque<Thread::Item> items;
    std::size_t offset = 0;
    for (const auto& item : r.header.at("items")) {
      const auto n = item.at(0).get<std::uint64_t>();
      const auto len = item.at(1).get<std::size_t>();
      items.push_back({n, r.payload.substr(offset, len)});
      offset += len;
    }
    const bool exhausted = r.header.value("exhausted", false);
    {
      std::lock_guard lock(th.mu);
      for (auto& i : items) th.queue.push_back(std::move(i));
      th.exhausted = exhausted;
    }
    th.cv.notify_all();
    if (exhausted) return;
  }
}

void Initiator::drive(Point& point, const std::shared_ptr<Thread>& thread) {
  Thread& th = *thread;
  const PointSpec& spec = point.spec;
  struct StopFetcher {
    Thread& th;
    ~StopFetcher() {
      {
        std::lock_guard lock(th.mu);
        th.fetch_stop = true;
      }
      th.fetch_cv.notify_all();
    }
  } stop_fetcher{th};

  // Starts the next operation in slot `i`; false when there is none to start.
  auto start = [&](std::size_t i, bool measured) -> bool {
    Thread::Slot& slot = th.slots[i];
    const auto t_prep = Clock::now();
    Thread::Item item;
    {
      std::unique_lock lock(th.mu);
      const auto give_up = t_prep + kStarved;
      while (th.queue.empty()) {
        if (th.exhausted || point.stop || abort_) return false;
        if (Clock::now() > give_up) {
          point.problem("no operation from the target for " +
                        std::to_string(std::chrono::seconds(kStarved).count()) + " s");
          point.stop = true;
          return false;
        }
        if (th.queue.size() < std::max<std::size_t>(1, point.queue_depth / 2))
          th.fetch_cv.notify_one();
        th.cv.wait_for(lock, kTick);
      }
      item = std::move(th.queue.front());
      th.queue.pop_front();
      if (th.queue.size() < std::max<std::size_t>(1, point.queue_depth / 2))
        th.fetch_cv.notify_one();
    }
    const auto t_got = Clock::now();
    // The pattern is written outside the prep time (it is the benchmark's work, not ferry's).
    if (spec.write && spec.check) {
      fill_pattern(slot.host, spec.seed, item.n);
      slot.buffer.push();
    }
    const auto t_fill = Clock::now();

    ferry::OperationOptions opts;
    opts.timeout = point.op_timeout;
    std::vector<ferry::Descriptor> local = slot.descs;
    std::variant<ferry::RdmaMetadata, ferry::Subject> remote = ferry::Subject(item.doc);
    Clock::time_point posted;
    try {
      if (spec.by_region) {
        // The item names a buffer of the target's region: the operation's ranges in it.
        const std::uint64_t base = std::stoull(item.doc) * spec.buffer_bytes();
        std::vector<ferry::RegionRange> ranges;
        for (const Piece& p : point.target_pieces) ranges.push_back({base + p.offset, p.size});
        ferry::TransferOptions t;
        t.timeout = point.op_timeout;
        t.tag = std::to_string(item.n);
        posted = Clock::now();
        if (spec.write)
          slot.op = point.attachment->write(std::move(local), std::move(ranges), t);
        else
          slot.op = point.attachment->read(std::move(ranges), std::move(local), t);
      } else {
        if (!spec.by_subject) remote = ferry::RdmaMetadata::from_json(item.doc);
        posted = Clock::now();
        if (spec.write) {
          slot.op = std::visit(
              [&](const auto& to) {
                return point.connector->begin_write(std::move(local), to, opts);
              },
              remote);
        } else {
          slot.op = std::visit(
              [&](const auto& from) {
                return point.connector->begin_read(from, std::move(local), opts);
              },
              remote);
        }
      }
    } catch (const std::exception& e) {
      ++th.errors;
      point.problem("operation " + std::to_string(item.n) + ": begin_" +
                    (spec.write ? "write" : "read") + ": " + e.what());
      point.stop = true;
      return false;
    }
    const auto returned = Clock::now();
    slot.busy = true;
    slot.measured = measured;
    slot.n = item.n;
    slot.posted = posted;
    slot.returned = returned;
    slot.prep = (t_got - t_prep) + (posted - t_fill);
    ++th.started;
    ++th.outstanding;
    // Completion is pushed: the callback (on the connector's loop) notes the time and wakes
    // this thread, which starts the next operation in the slot.
    // The callback keeps the thread's state alive: it may still be returning when the
    // thread has taken its completion in and gone.
    if (slot.op.status() == ferry::OperationStatus::complete) {
      // Complete within the call (a region's small cma transfer, copied on this thread): its
      // end is now, not when a callback queued to the loop would say so.
      {
        std::lock_guard lock(th.mu);
        slot.done = returned;
        slot.status = ferry::OperationStatus::complete;
        th.done.push_back(i);
      }
      return true;
    }
    slot.op.on_complete([thread, i](ferry::OperationStatus status, const ferry::Error* e) {
      const auto now = Clock::now();
      {
        std::lock_guard lock(thread->mu);
        auto& s = thread->slots[i];
        s.done = now;
        s.status = status;
        if (e != nullptr) s.error = e->what();
        thread->done.push_back(i);
      }
      thread->cv.notify_all();
    });
    return true;
  };

  // Takes the completions in, starting the next operation in each freed slot when `more`
  // says so, until nothing is in flight.
  auto drain = [&](auto&& more, bool measured) {
    bool cancelled = false;
    while (th.outstanding > 0) {
      std::deque<std::size_t> done;
      {
        std::unique_lock lock(th.mu);
        th.cv.wait_for(lock, kTick, [&] { return !th.done.empty(); });
        done.swap(th.done);
      }
      if (abort_ && !cancelled) {
        // The target is gone: end what is in flight now rather than at its deadline.
        cancelled = true;
        for (auto& s : th.slots) {
          if (s.busy) s.op.cancel();
        }
      }
      for (std::size_t i : done) {
        Thread::Slot& s = th.slots[i];
        --th.outstanding;
        s.busy = false;
        s.op = {};
        if (s.status != ferry::OperationStatus::complete) {
          ++th.errors;
          point.problem("operation " + std::to_string(s.n) + ": " + s.error);
          point.stop = true;
          continue;
        }
        ++th.completed;
        if (!spec.write && spec.check) {
          s.buffer.pull();
          const Mismatch m = verify_pattern(s.host, spec.seed, s.n);
          if (m.bytes > 0) {
            if (th.mismatched_ops++ == 0) {
              point.problem("consistency: operation " + std::to_string(s.n) + " read " +
                            std::to_string(m.bytes) + " wrong bytes, the first at offset " +
                            std::to_string(m.first_offset));
            }
          }
        }
        if (s.measured) th.samples.push_back({s.posted, s.returned, s.done, s.prep});
        if (more()) start(i, measured);
      }
    }
  };

  // Warm-up: connections, registrations and caches, unmeasured.
  std::uint64_t warm = 0;
  auto more_warmup = [&] {
    if (point.stop || abort_ || warm >= options_.warmup_iter) return false;
    ++warm;
    return true;
  };
  for (std::size_t i = 0; i < th.slots.size(); ++i) {
    if (more_warmup()) start(i, false);
  }
  drain(more_warmup, false);

  // Every thread starts measuring at once.
  {
    std::unique_lock lock(point.mu);
    if (++point.arrived == spec.threads) {
      point.released = true;
      point.deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                          std::chrono::duration<double>(options_.point_seconds));
      point.cv.notify_all();
    }
    while (!point.released && !abort_) point.cv.wait_for(lock, kTick);
    if (!point.released) return;
  }

  auto more_measured = [&] {
    if (point.stop || abort_) return false;
    if (point.adaptive && Clock::now() >= point.deadline &&
        point.measured_started.load() >= kMinIterations)
      return false;
    return point.measured_started.fetch_add(1) < point.cap;
  };
  th.samples.reserve(static_cast<std::size_t>(
      std::min<std::uint64_t>(point.cap, options_.num_iter > 0 ? options_.num_iter : 65536)));
  for (std::size_t i = 0; i < th.slots.size(); ++i) {
    if (more_measured()) start(i, true);
  }
  drain(more_measured, true);
}

}  // namespace ferry_bench
