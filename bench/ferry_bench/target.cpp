#include "bench/ferry_bench/target.hpp"

#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "bench/ferry_bench/control.hpp"
#include "bench/ferry_bench/point.hpp"
#include "bench/ferry_bench/sim_verbs.hpp"

namespace ferry_bench {

namespace {

// A standalone target with nobody asking for this long exits.
constexpr auto kIdleLimit = std::chrono::minutes(10);
// How long end waits for the operations the initiator started to end here, and for the rest
// to be cancelled.
constexpr auto kEndWait = std::chrono::seconds(10);

// The passive operations of one point. Each of `pool` buffers is under at most one live
// operation at a time; when it ends (the callback, on the connector's loop), the recycler
// thread verifies the bytes (WRITE with --check_consistency), and creates the next operation
// over that buffer, so the initiator always finds operations ready: their creation is never
// on its measured path.
class TargetPoint {
 public:
  TargetPoint(ferry::Connector& connector, PointSpec spec)
      : connector_(connector), spec_(std::move(spec)), state_(std::make_shared<State>()) {
    const auto pieces = layout(spec_, Side::target);
    slots_.reserve(spec_.pool);
    for (std::size_t i = 0; i < spec_.pool; ++i) {
      Slot s{Buffer(spec_.buffer_bytes(), spec_.target_device), {}, {}};
      s.descs = descriptors(s.buffer, pieces);
      s.host = host_descriptors(s.buffer, pieces);
      slots_.push_back(std::move(s));
    }
    if (spec_.by_region) {
      // One region over every buffer, in order: buffer i is bytes [i * buffer_bytes, ...) of
      // it. An operation's end is the region's transfer event, tagged with its number.
      std::vector<ferry::Descriptor> whole;
      for (const Slot& s : slots_) {
        const int device = s.buffer.device();
        whole.push_back(device < 0 ? ferry::Descriptor(s.buffer.data(), s.buffer.size())
                                   : ferry::Descriptor(s.buffer.data(), s.buffer.size(),
                                                       ferry::Device::cuda(device)));
      }
      ferry::RegionOptions ro;
      ro.access = spec_.write ? ferry::RegionAccess::write : ferry::RegionAccess::read;
      ro.queue_events = false;
      ro.on_event = [state = state_](const ferry::RegionEvent& e) {
        if (e.type != ferry::RegionEvent::Type::transfer) return;
        std::uint64_t n = 0;
        try {
          n = std::stoull(e.tag);
        } catch (const std::exception&) {
          return;
        }
        {
          std::lock_guard lock(state->mu);
          state->ended.push_back({n, e.status, e.error ? e.error->what() : ""});
        }
        state->cv.notify_all();
      };
      region_ = connector_.create_region(std::move(whole), ro);
    }
    for (std::size_t i = 0; i < spec_.pool && i < spec_.max_ops; ++i) create(i);
    recycler_ = std::thread([this] { recycle(); });
  }

  ~TargetPoint() {
    if (!ended_) end(0, std::chrono::milliseconds(0));
  }

  TargetPoint(const TargetPoint&) = delete;
  TargetPoint& operator=(const TargetPoint&) = delete;

  // Hands out up to `max` ready operations, waiting up to `wait` for at least `min`.
  Reply batch(std::size_t max, std::size_t min, std::chrono::milliseconds wait) {
    Reply r;
    json items = json::array();
    std::unique_lock lock(state_->mu);
    state_->cv.wait_for(lock, wait, [&] {
      return state_->ready.size() >= min || exhausted_locked() || !state_->failure.empty();
    });
    if (!state_->failure.empty()) throw std::runtime_error(state_->failure);
    while (!state_->ready.empty() && items.size() < max) {
      const std::uint64_t n = state_->ready.front();
      state_->ready.pop_front();
      Live& live = state_->live.at(n);
      live.handed = true;
      ++state_->handed;
      items.push_back(json::array({n, live.doc.size()}));
      r.payload += live.doc;
      live.doc.clear();
    }
    r.header = json{{"items", std::move(items)}, {"exhausted", exhausted_locked()}};
    return r;
  }

  /// --pairing region: the region's metadata.
  std::string region_metadata() const { return region_ ? region_.metadata().to_json() : ""; }

  // Ends the point: waits for the `used` operations the initiator started to end here, then
  // cancels every other one and stops the recycler. Returns the target's counts.
  json end(std::uint64_t used, std::chrono::milliseconds wait) {
    ended_ = true;
    {
      std::unique_lock lock(state_->mu);
      state_->cv.wait_for(lock, wait, [&] { return state_->handed_done >= used; });
    }
    std::vector<ferry::Operation> cancel;
    {
      // Under create_mu_, no creation is half done: every operation is in `live`, and none
      // is created after `ending`.
      std::lock_guard create_lock(create_mu_);
      std::lock_guard lock(state_->mu);
      state_->ending = true;
      for (auto& [n, live] : state_->live) {
        if (live.op) cancel.push_back(std::move(live.op));
        // Region: an item never handed out has no transfer to end; one handed out and never
        // ended ends as the region closes.
        if (spec_.by_region) state_->ended.push_back({n, ferry::OperationStatus::cancelled, ""});
      }
    }
    // Destroying a handle cancels its operation (off the lock: the callbacks need it).
    cancel.clear();
    bool all_ended = false;
    {
      std::unique_lock lock(state_->mu);
      all_ended = state_->cv.wait_for(lock, std::max(wait, std::chrono::milliseconds(5000)),
                                      [&] { return state_->done == state_->created; });
      state_->stop = true;
    }
    state_->cv.notify_all();
    if (recycler_.joinable()) recycler_.join();

    std::lock_guard lock(state_->mu);
    if (!all_ended) {
      std::fprintf(stderr, "ferry-bench target: %llu operations did not end when cancelled\n",
                   static_cast<unsigned long long>(state_->created - state_->done));
    }
    return json{{"created", state_->created},
                {"handed", state_->handed},
                {"completed", state_->completed},
                {"errored", state_->errored},
                {"cancelled", state_->cancelled},
                {"verified", state_->verified},
                {"mismatch_bytes", state_->mismatch_bytes},
                {"first_mismatch", state_->first_mismatch},
                {"first_error", state_->first_error},
                {"all_ended", all_ended}};
  }

 private:
  struct Slot {
    Buffer buffer;
    std::vector<ferry::Descriptor> descs;
    std::vector<ferry::Descriptor> host;  // descs over the buffer's host side, for the pattern
  };
  struct Live {
    std::size_t slot = 0;
    ferry::Operation op;
    std::string doc;  // metadata JSON or subject, until handed out
    bool handed = false;
  };
  struct Ended {
    std::uint64_t n;
    ferry::OperationStatus status;
    std::string error;
  };
  // Shared with the completion callbacks, which may run after this object is gone.
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<std::uint64_t> ready;
    std::map<std::uint64_t, Live> live;
    std::deque<Ended> ended;
    std::uint64_t next_n = 0;
    std::uint64_t created = 0, handed = 0, done = 0, handed_done = 0;
    std::uint64_t completed = 0, errored = 0, cancelled = 0;
    std::uint64_t verified = 0, mismatch_bytes = 0;
    std::string first_error, first_mismatch, failure;
    bool ending = false, stop = false;
  };

  bool exhausted_locked() const {
    return state_->ready.empty() && (state_->created >= spec_.max_ops || state_->ending);
  }

  // Creates the next operation over slot `slot`'s buffer and makes it ready.
  void create(std::size_t slot) {
    std::lock_guard create_lock(create_mu_);
    std::uint64_t n = 0;
    {
      std::lock_guard lock(state_->mu);
      if (state_->ending || state_->created >= spec_.max_ops) return;
      n = state_->next_n++;
    }
    Slot& s = slots_[slot];
    Live live;
    live.slot = slot;
    if (spec_.by_region) {
      // No operation: the item names the buffer; its transfer's event ends it.
      if (!spec_.write && spec_.check) {
        fill_pattern(s.host, spec_.seed, n);
        s.buffer.push();
      }
      live.doc = std::to_string(slot);
      {
        std::lock_guard lock(state_->mu);
        state_->live.emplace(n, std::move(live));
        state_->ready.push_back(n);
        ++state_->created;
      }
      state_->cv.notify_all();
      return;
    }
    try {
      ferry::OperationOptions options;
      if (spec_.by_subject) options.subject = spec_.subject(n);
      if (spec_.write) {
        auto op = connector_.create_writable(s.descs, options);
        live.doc = spec_.by_subject ? options.subject : op.metadata().to_json();
        live.op = std::move(op);
      } else {
        if (spec_.check) {
          fill_pattern(s.host, spec_.seed, n);
          s.buffer.push();
        }
        auto op = connector_.create_readable(s.descs, options);
        live.doc = spec_.by_subject ? options.subject : op.metadata().to_json();
        live.op = std::move(op);
      }
    } catch (const std::exception& e) {
      std::lock_guard lock(state_->mu);
      if (state_->failure.empty())
        state_->failure = "creating passive operation " + std::to_string(n) + ": " + e.what();
      state_->cv.notify_all();
      return;
    }
    {
      // In `live` before its callback can run (on_complete only queues it, it never waits).
      std::lock_guard lock(state_->mu);
      auto it = state_->live.emplace(n, std::move(live)).first;
      it->second.op.on_complete(
          [state = state_, n](ferry::OperationStatus status, const ferry::Error* e) {
            {
              std::lock_guard cb_lock(state->mu);
              state->ended.push_back({n, status, e != nullptr ? e->what() : ""});
            }
            state->cv.notify_all();
          });
      state_->ready.push_back(n);
      ++state_->created;
    }
    state_->cv.notify_all();
  }

  void recycle() {
    for (;;) {
      Ended e;
      Live live;
      {
        std::unique_lock lock(state_->mu);
        state_->cv.wait(lock, [&] { return !state_->ended.empty() || state_->stop; });
        if (state_->ended.empty()) return;
        e = std::move(state_->ended.front());
        state_->ended.pop_front();
        if (auto it = state_->live.find(e.n); it != state_->live.end()) {
          live = std::move(it->second);
          state_->live.erase(it);
        }
        switch (e.status) {
          case ferry::OperationStatus::complete:
            ++state_->completed;
            break;
          case ferry::OperationStatus::cancelled:
            ++state_->cancelled;
            break;
          default:
            ++state_->errored;
            if (state_->first_error.empty())
              state_->first_error = "operation " + std::to_string(e.n) + ": " + e.error;
        }
      }
      if (spec_.write && spec_.check && e.status == ferry::OperationStatus::complete) {
        slots_[live.slot].buffer.pull();
        const Mismatch m = verify_pattern(slots_[live.slot].host, spec_.seed, e.n);
        std::lock_guard lock(state_->mu);
        ++state_->verified;
        if (m.bytes > 0) {
          if (state_->mismatch_bytes == 0) {
            state_->first_mismatch = "operation " + std::to_string(e.n) + ": " +
                                     std::to_string(m.bytes) + " bytes differ, the first at " +
                                     std::to_string(m.first_offset);
          }
          state_->mismatch_bytes += m.bytes;
        }
      }
      live.op = {};  // ended: dropping the handle is cheap
      create(live.slot);
      {
        std::lock_guard lock(state_->mu);
        ++state_->done;
        if (live.handed) ++state_->handed_done;
      }
      state_->cv.notify_all();
    }
  }

  ferry::Connector& connector_;
  const PointSpec spec_;
  std::vector<Slot> slots_;  // outlives every operation over it (they end in end())
  std::shared_ptr<State> state_;
  std::mutex create_mu_;
  std::thread recycler_;
  bool ended_ = false;
  ferry::Region region_;  // --pairing region; closed before the buffers go
};

}  // namespace

int run_target(const Options& options) {
  const auto say = [&](const std::string& what) {
    std::fprintf(stderr, "ferry-bench target: %s\n", what.c_str());
  };
  if (options.simulated_verbs) {
    if (!use_simulated_verbs()) say("--simulated_verbs: this build has no simulated fabric");
  }
  std::map<std::string, std::unique_ptr<ferry::Connector>> connectors;
  std::unique_ptr<TargetPoint> point;

  std::mutex mu;
  std::condition_variable cv;
  bool quit = false;
  auto last_request = Clock::now();

  auto handle = [&](const json& request) -> Reply {
    {
      std::lock_guard lock(mu);
      last_request = Clock::now();
    }
    const std::string cmd = request.value("cmd", "");
    if (cmd == "hello") {
      return {json{{"ok", true}, {"pid", ::getpid()}, {"simulated_verbs", options.simulated_verbs}},
              {}};
    }
    if (cmd == "prepare") {
      point.reset();
      PointSpec spec = PointSpec::from_json(request.at("point"));
      if (spec.session != options.session) throw std::runtime_error("wrong session");
      if (auto why = unavailable_reason(spec.method, options.nats_url, spec.target_device, true);
          !why.empty())
        return {json{{"skipped", "target: " + why}}, {}};
      auto& connector = connectors[spec.method];
      if (!connector) {
        connector = std::make_unique<ferry::Connector>(connector_options(
            spec.method, options.nats_url, "ferry-bench-target", options.metrics));
      }
      point = std::make_unique<TargetPoint>(*connector, std::move(spec));
      json ok{{"ok", true}};
      if (const std::string region = point->region_metadata(); !region.empty())
        ok["region"] = region;
      return {std::move(ok), {}};
    }
    if (cmd == "batch") {
      if (!point) throw std::runtime_error("batch without a prepared point");
      return point->batch(request.at("max").get<std::size_t>(),
                          request.at("min").get<std::size_t>(),
                          std::chrono::milliseconds(request.at("wait_ms").get<int>()));
    }
    if (cmd == "end") {
      if (!point) throw std::runtime_error("end without a prepared point");
      json counts = point->end(request.at("used").get<std::uint64_t>(), kEndWait);
      point.reset();
      return {std::move(counts), {}};
    }
    if (cmd == "quit") {
      point.reset();
      {
        std::lock_guard lock(mu);
        quit = true;
      }
      cv.notify_all();
      return {json{{"ok", true}}, {}};
    }
    throw std::runtime_error("unknown command '" + cmd + "'");
  };

  int status = 0;
  try {
    ControlServer server(options.nats_url, options.session, handle);
    std::unique_lock lock(mu);
    while (!quit) {
      cv.wait_for(lock, std::chrono::seconds(1));
      if (!quit && Clock::now() - last_request > kIdleLimit) {
        say("no request for 10 minutes; exiting");
        status = 1;
        break;
      }
    }
  } catch (const std::exception& e) {
    say(e.what());
    status = 1;
  }
  // The server is gone: no handler runs any more.
  point.reset();
  connectors.clear();
  return status;
}

}  // namespace ferry_bench
