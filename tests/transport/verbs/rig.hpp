#pragma once

// Two verbs transports driven directly, each on a loop of its own, and an observer that
// records how things ended: shared by the tests on the simulated fabric and on a real device.

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "loop/event_loop.hpp"
#include "transport/kit/exposure_table.hpp"
#include "transport/verbs/verbs_transport.hpp"

namespace ferry::transport::verbs::rig {

using namespace std::chrono_literals;

/// One side: a transport on a loop of its own.
struct Side {
  loop::EventLoop loop;
  std::unique_ptr<VerbsTransport> transport;
  Side(std::string name, const VerbsApi* api, std::string address = "127.0.0.1",
       std::function<void(VerbsOptions&)> tune = {}, std::function<void(Context&)> setup = {}) {
    Context c;
    c.loop = loop.uv();
    c.defer = [this](std::function<void()> f) { loop.defer(std::move(f)); };
    c.bind_address = std::move(address);
    c.local_name = std::move(name);
    c.local_id = 0x1234;
    c.peer_timeout = 3s;
    if (setup) setup(c);
    VerbsOptions o;
    if (tune) tune(o);
    transport = loop.call([&] { return std::make_unique<VerbsTransport>(c, o, api); });
  }
  ~Side() {
    loop.close([this] { transport.reset(); });
  }
  template <class F>
  auto call(F&& f) {
    return loop.call(std::forward<F>(f));
  }
  Counters counters() {
    return call([&] { return transport->counters(); });
  }
};

/// Records how things ended, for either kind of observer. It must outlive the loop that calls
/// it: wait for its end (or close the side) before it goes.
class Log : public ExposureObserver, public TransferObserver {
 public:
  void on_claimed(const Claim&) override {}
  void on_peer_finished(const std::string&, const std::optional<Error>& e) override { end(e); }
  void on_peer_lost(const Error& e) override { end(e); }
  void on_transfer_complete() override { end(std::nullopt); }
  void on_transfer_failed(const Error& e) override { end(e); }

  /// How it ended (nullopt inside: success); nullopt outside: not within `limit`.
  std::optional<std::optional<Error>> wait(std::chrono::milliseconds limit = 30s) {
    std::unique_lock lock(mu_);
    if (!cv_.wait_for(lock, limit, [&] { return ended_; })) return std::nullopt;
    return error_;
  }
  bool ended() {
    std::lock_guard lock(mu_);
    return ended_;
  }

 private:
  void end(const std::optional<Error>& e) {
    std::lock_guard lock(mu_);
    if (ended_) return;
    ended_ = true;
    error_ = e;
    cv_.notify_all();
  }
  std::mutex mu_;
  std::condition_variable cv_;
  bool ended_ = false;
  std::optional<Error> error_;
};

struct Offered {
  Exposure exposure;
  Endpoint endpoint;
};

inline std::uint64_t next_id() {
  static std::atomic<std::uint64_t> id{100};
  return ++id;
}

inline Offered expose(Side& owner, Access access, std::byte* bytes, std::size_t size, Log& log) {
  Offered s;
  s.exposure.id = next_id();
  s.exposure.token = random_token();
  s.exposure.access = access;
  s.exposure.regions = {Region{bytes, size, MemoryKind::host}};
  owner.call([&] {
    owner.transport->expose(s.exposure, log);
    s.endpoint = owner.transport->endpoints().at(0);
  });
  return s;
}

inline std::unique_ptr<Transfer> start(Side& active, const Offered& s, std::byte* local,
                                       std::size_t size, Log& log) {
  TransferSpec spec;
  spec.remote_id = s.exposure.id;
  spec.token = s.exposure.token;
  spec.access = s.exposure.access;
  spec.segments = {
      Segment{reinterpret_cast<std::uint64_t>(s.exposure.regions[0].ptr), local, size}};
  spec.endpoint = s.endpoint;
  spec.peer_name = "owner";
  return active.call([&] { return active.transport->start(spec, log); });
}

inline void expect_ok(Log& log, const char* what) {
  auto end = log.wait();
  ASSERT_TRUE(end.has_value()) << what << ": no end within the wait";
  EXPECT_FALSE(end->has_value()) << what << ": " << (*end)->what();
}

}  // namespace ferry::transport::verbs::rig
