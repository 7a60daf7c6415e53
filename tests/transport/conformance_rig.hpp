#pragma once

// The rig of the transport conformance suites (conformance_test.cpp for operations,
// region_conformance_test.cpp for regions): how to make each transport (harnesses()), a side
// per transport on a loop of its own, observers that record their calls, memory with guard
// bytes, and the calls every test makes. Each side is driven directly, without a Connector.
// A new transport joins both suites by adding its harness to harnesses().

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <ostream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "build_config.hpp"
#include "loop/event_loop.hpp"
#include "tests/support/fake_transport.hpp"
#include "tests/support/gate.hpp"
#include "tests/support/patterns.hpp"
#include "transport/cma/cma_transport.hpp"
#include "transport/tcp/tcp_transport.hpp"
#include "transport/transport.hpp"
#if FERRY_HAS_VERBS
#include "tests/support/simverbs/simverbs.hpp"
#include "transport/verbs/verbs_transport.hpp"
#endif

namespace ferry {
// gtest prints these by name, not as bytes.
inline void PrintTo(ErrorCode code, std::ostream* os) { *os << to_string(code); }
}  // namespace ferry

namespace ferry::transport::conformance {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr auto kWait = 30s;  // for anything that must happen; a failure ends the wait early

// ---------------------------------------------------------------------------------------
// Harnesses: how to make each transport with sane options.

/// Who a transport is, and how fast it should move bytes.
struct Params {
  std::string name;
  std::uint64_t id = 0;  ///< the connector id it announces
  /// 0: the transport's default. Small: a slow transfer, one chunk in flight at a time.
  std::uint64_t chunk_size = 0;
};

struct Harness {
  std::string method;
  std::function<std::unique_ptr<Transport>(loop::EventLoop& loop, const Params& params)> make;
  /// An endpoint of this method where no transport answers; `keep` holds what keeps it so
  /// for as long as the test needs it.
  std::function<Endpoint(std::shared_ptr<void>& keep)> dead_endpoint;
};

inline std::function<void(std::function<void()>)> defer_on(loop::EventLoop& loop) {
  return [&loop](std::function<void()> task) { loop.defer(std::move(task)); };
}

/// What a transport of `params` is built from, on `loop`.
inline Context context_on(loop::EventLoop& loop, const Params& p) {
  Context c;
  c.loop = loop.uv();
  c.defer = defer_on(loop);
  c.local_name = p.name;
  c.local_id = p.id;
  c.peer_timeout = 5s;
  return c;
}

inline Harness tcp_harness() {
  return {"tcp",
          [](loop::EventLoop& loop, const Params& p) -> std::unique_ptr<Transport> {
            TcpOptions o;
            if (p.chunk_size != 0) {
              o.chunk_size = p.chunk_size;
              o.window = p.chunk_size;
            }
            return std::make_unique<tcp::TcpTransport>(context_on(loop, p), o);
          },
          [](std::shared_ptr<void>& keep) -> Endpoint {
            // A port bound but not listening: connecting is refused, and nobody else can
            // take the port while the socket is open.
            const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
            sockaddr_in a{};
            a.sin_family = AF_INET;
            a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
            socklen_t len = sizeof a;
            if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), len) != 0 ||
                ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0)
              throw std::runtime_error("cannot bind a loopback socket");
            keep = std::shared_ptr<void>(nullptr, [fd](void*) { ::close(fd); });
            return {"tcp", "127.0.0.1:" + std::to_string(ntohs(a.sin_port)), {}};
          }};
}

inline Harness fake_harness() {
  return {"fake",
          [](loop::EventLoop& loop, const Params& p) -> std::unique_ptr<Transport> {
            test::FakeTransport::Options o;
            o.local_name = p.name;
            o.local_id = p.id;
            if (p.chunk_size != 0) o.chunk_size = p.chunk_size;
            return std::make_unique<test::FakeTransport>(loop.uv(), defer_on(loop), o);
          },
          [](std::shared_ptr<void>&) -> Endpoint {
            return {"fake", "fake:999999999", {}};
          }};
}

inline CmaOptions cma_options(const Params& p) {
  CmaOptions o;
  if (p.chunk_size != 0) {
    o.chunk_size = p.chunk_size;
    o.parallel = 1;
    o.inline_max = 0;
  }
  return o;
}

inline Harness cma_harness() {
  return {"cma",
          [](loop::EventLoop& loop, const Params& p) -> std::unique_ptr<Transport> {
            return std::make_unique<cma::CmaTransport>(context_on(loop, p), cma_options(p));
          },
          [](std::shared_ptr<void>& keep) -> Endpoint {
            // A transport of this process, closed: its socket is gone, its process is not.
            struct Dead {
              loop::EventLoop loop;
              std::unique_ptr<cma::CmaTransport> transport;
              ~Dead() {
                loop.close([this] { transport.reset(); });
              }
            };
            auto dead = std::make_shared<Dead>();
            Endpoint e = dead->loop.call([&] {
              dead->transport = std::make_unique<cma::CmaTransport>(
                  context_on(dead->loop, {"dead", 9, 0}), cma_options({"dead", 9, 0}));
              Endpoint out = dead->transport->endpoints().at(0);
              dead->transport->close();
              return out;
            });
            keep = dead;
            return e;
          }};
}

#if FERRY_HAS_VERBS
inline VerbsOptions verbs_options(const Params& p) {
  VerbsOptions o;
  if (p.chunk_size != 0) {
    o.max_wr_bytes = p.chunk_size;
    o.queue_depth = 4;
    o.signal_every = 1;
  }
  return o;
}

// verbs against the simulated fabric (tests/support/simverbs/): no RDMA NIC here.
inline Harness verbs_harness() {
  return {"verbs",
          [](loop::EventLoop& loop, const Params& p) -> std::unique_ptr<Transport> {
            return std::make_unique<verbs::VerbsTransport>(context_on(loop, p), verbs_options(p),
                                                           &test::simverbs::api());
          },
          [](std::shared_ptr<void>&) -> Endpoint {
            // A transport that listened and closed: its port answers no more.
            loop::EventLoop loop;
            Endpoint e = loop.call([&] {
              verbs::VerbsTransport t(context_on(loop, {"dead", 9, 0}),
                                      verbs_options({"dead", 9, 0}), &test::simverbs::api());
              Endpoint out = t.endpoints().at(0);
              t.close();
              return out;
            });
            loop.close([] {});
            return e;
          }};
}
#endif

inline std::vector<Harness> harnesses() {
  return {
    tcp_harness(), fake_harness(), cma_harness(),
#if FERRY_HAS_VERBS
        verbs_harness(),
#endif
  };
}

// gtest prints a parameter by this, not as bytes.
inline void PrintTo(const Harness& harness, std::ostream* os) { *os << harness.method; }

inline std::string harness_name(const ::testing::TestParamInfo<Harness>& info) {
  return info.param.method;
}

// ---------------------------------------------------------------------------------------
// Sides, observers, memory

/// One transport on a loop thread of its own. Destructor: closes the transport on its loop,
/// then the loop.
class Side {
 public:
  Side(const Harness& harness, Params params) : params_(std::move(params)) {
    transport_ = loop_.call([&] { return harness.make(loop_, params_); });
    endpoint_ = loop_.call([&] { return transport_->endpoints().at(0); });
  }
  ~Side() {
    loop_.close([this] { transport_.reset(); });
  }
  Side(const Side&) = delete;
  Side& operator=(const Side&) = delete;

  /// Runs `fn` on the loop and returns its result.
  template <class F>
  auto call(F&& fn) {
    return loop_.call(std::forward<F>(fn));
  }
  void post(std::function<void()> task) { loop_.post(std::move(task)); }
  /// Loop thread only.
  Transport& transport() { return *transport_; }
  void destroy_transport() {
    loop_.call([this] { transport_.reset(); });
  }
  const Params& params() const { return params_; }
  const Endpoint& endpoint() const { return endpoint_; }
  /// Lets both loops run every turn that was due: what was on its way has arrived.
  void settle() {
    for (int i = 0; i < 3; ++i) {
      call([] {});
      std::this_thread::sleep_for(20ms);
    }
  }

 private:
  Params params_;
  loop::EventLoop loop_;
  std::unique_ptr<Transport> transport_;
  Endpoint endpoint_;
};

enum class Call { claimed, peer_finished, peer_lost, complete, failed, setup_failed };

inline const char* call_name(Call c) {
  switch (c) {
    case Call::claimed:
      return "on_claimed";
    case Call::peer_finished:
      return "on_peer_finished";
    case Call::peer_lost:
      return "on_peer_lost";
    case Call::complete:
      return "on_transfer_complete";
    case Call::failed:
      return "on_transfer_failed";
    case Call::setup_failed:
      return "on_transfer_setup_failed";
  }
  return "?";
}

inline void PrintTo(Call c, std::ostream* os) { *os << call_name(c); }

struct Event {
  Call call = Call::claimed;
  std::optional<Error> error;
  Claim claim;
  std::string peer;
  bool after_seal = false;  ///< came after the revoke / cancel / close that sealed the log
};

/// Observer calls as they come, from the loop thread; read from the test's thread.
class Log {
 public:
  /// On the loop thread, right after the revoke(), cancel() or close() returned: any call
  /// recorded after this breaks the contract.
  void seal() {
    std::lock_guard lock(mu_);
    sealed_ = true;
  }
  std::vector<Event> events() const {
    std::lock_guard lock(mu_);
    return events_;
  }
  std::size_t after_seal() const {
    std::lock_guard lock(mu_);
    std::size_t n = 0;
    for (const Event& e : events_) n += e.after_seal ? 1 : 0;
    return n;
  }
  /// The first call that ends the exposure or transfer, once it came (or nothing after
  /// `limit`).
  std::optional<Event> wait_end(std::chrono::milliseconds limit = kWait) const {
    std::unique_lock lock(mu_);
    std::optional<Event> out;
    cv_.wait_for(lock, limit, [&] {
      for (const Event& e : events_)
        if (e.call != Call::claimed) {
          out = e;
          return true;
        }
      return false;
    });
    return out;
  }
  std::optional<Claim> wait_claim(std::chrono::milliseconds limit = kWait) const {
    std::unique_lock lock(mu_);
    std::optional<Claim> out;
    cv_.wait_for(lock, limit, [&] {
      for (const Event& e : events_)
        if (e.call == Call::claimed) {
          out = e.claim;
          return true;
        }
      return false;
    });
    return out;
  }
  std::string text() const {
    std::string out;
    for (const Event& e : events()) {
      out += std::string(call_name(e.call)) + (e.error ? std::string(" ") + e.error->what() : "") +
             (e.after_seal ? " (after seal)" : "") + "; ";
    }
    return out;
  }

 protected:
  void add(Event e) {
    {
      std::lock_guard lock(mu_);
      e.after_seal = sealed_;
      events_.push_back(std::move(e));
    }
    cv_.notify_all();
  }

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::vector<Event> events_;
  bool sealed_ = false;
};

class ExposureLog final : public ExposureObserver, public Log {
 public:
  /// Runs on the owner's loop when the claim arrives, after it is recorded.
  std::function<void(const Claim&)> on_claim;

  void on_claimed(const Claim& claim) override {
    Event e;
    e.call = Call::claimed;
    e.claim = claim;
    add(e);
    if (on_claim) on_claim(claim);
  }
  void on_peer_finished(const std::string& peer, const std::optional<Error>& error) override {
    Event e;
    e.call = Call::peer_finished;
    e.peer = peer;
    e.error = error;
    add(e);
  }
  void on_peer_lost(const Error& error) override {
    Event e;
    e.call = Call::peer_lost;
    e.error = error;
    add(e);
  }
};

class TransferLog final : public TransferObserver, public Log {
 public:
  /// Runs on the loop after the call that ends the transfer is recorded, inside that call.
  std::function<void()> on_end;

  void on_transfer_complete() override {
    Event e;
    e.call = Call::complete;
    add(e);
    if (on_end) on_end();
  }
  void on_transfer_failed(const Error& error) override {
    Event e;
    e.call = Call::failed;
    e.error = error;
    add(e);
    if (on_end) on_end();
  }
  void on_transfer_setup_failed(const Error& error) override {
    Event e;
    e.call = Call::setup_failed;
    e.error = error;
    add(e);
    if (on_end) on_end();
  }
};

/// A stream of `sizes` bytes in pieces, each in a buffer of its own with guard bytes around
/// it, so that a byte written outside a piece is caught.
class Pieces {
 public:
  static constexpr std::size_t kGuard = 64;
  static constexpr std::byte kGuardByte{0xE7};

  /// seed 0: zeros; else the pattern of that seed, as one stream across the pieces.
  Pieces(const std::vector<std::size_t>& sizes, std::uint64_t seed) {
    std::uint64_t offset = 0;
    for (std::size_t size : sizes) {
      auto& buf = storage_.emplace_back(size + 2 * kGuard, kGuardByte);
      std::byte* p = buf.data() + kGuard;
      if (seed != 0)
        test::fill_pattern(p, size, seed, offset);
      else
        std::memset(p, 0, size);
      regions_.push_back(Region{p, size, MemoryKind::host});
      offset += size;
    }
  }
  const std::vector<Region>& regions() const { return regions_; }
  std::byte* data(std::size_t piece = 0) { return regions_.at(piece).ptr; }
  std::uint64_t total() const {
    std::uint64_t t = 0;
    for (const Region& r : regions_) t += r.size;
    return t;
  }
  /// The stream offset of the first byte that is not the pattern `seed`, or -1.
  long long mismatch(std::uint64_t seed) const {
    std::uint64_t offset = 0;
    for (const Region& r : regions_) {
      long long at = test::first_mismatch(r.ptr, r.size, seed, offset);
      if (at >= 0) return static_cast<long long>(offset) + at;
      offset += r.size;
    }
    return -1;
  }
  bool guards_intact() const {
    for (const auto& buf : storage_) {
      for (std::size_t i = 0; i < kGuard; ++i)
        if (buf[i] != kGuardByte || buf[buf.size() - 1 - i] != kGuardByte) return false;
    }
    return true;
  }

 private:
  std::deque<std::vector<std::byte>> storage_;
  std::vector<Region> regions_;
};

/// `total` cut into pieces: the sizes in `firsts` (each kept short of the end), then the rest.
inline std::vector<std::size_t> cut(std::size_t total, std::initializer_list<std::size_t> firsts) {
  std::vector<std::size_t> out;
  std::size_t left = total;
  for (std::size_t f : firsts) {
    if (left <= 1) break;
    std::size_t n = std::min(f, left - 1);
    out.push_back(n);
    left -= n;
  }
  out.push_back(left);
  return out;
}

/// Pairs the remote and local streams byte for byte, cut wherever either side's piece ends.
inline std::vector<Segment> match(const std::vector<Region>& remote,
                                  const std::vector<Region>& local) {
  std::vector<Segment> out;
  std::size_t ri = 0;
  std::size_t li = 0;
  std::uint64_t ro = 0;
  std::uint64_t lo = 0;
  while (ri < remote.size() && li < local.size()) {
    const std::uint64_t len = std::min(remote[ri].size - ro, local[li].size - lo);
    out.push_back(
        Segment{reinterpret_cast<std::uint64_t>(remote[ri].ptr) + ro, local[li].ptr + lo, len});
    ro += len;
    lo += len;
    if (ro == remote[ri].size) {
      ++ri;
      ro = 0;
    }
    if (lo == local[li].size) {
      ++li;
      lo = 0;
    }
  }
  return out;
}

inline std::uint64_t address_of(const std::byte* p) { return reinterpret_cast<std::uint64_t>(p); }

inline bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

/// A passive operation's memory, served by one side.
struct Served {
  Exposure exposure;
  std::string info;  ///< what expose() returned: the endpoint's info
  std::vector<std::shared_ptr<const Registration>> registrations;
};

inline std::atomic<std::uint64_t> next_exposure_id{0x5100};

// A loop thread waits at a test::Gate (at most 10 s) until the test opens it: meanwhile the
// transport of that loop moves nothing.
using test::Gate;

/// A transfer destroyed on its own loop.
class Running {
 public:
  Running() = default;
  Running(Side& side, std::unique_ptr<Transfer> transfer)
      : side_(&side), transfer_(std::move(transfer)) {}
  Running(Running&&) = default;
  Running& operator=(Running&&) = default;
  ~Running() { reset(); }
  void reset() {
    if (side_ != nullptr && transfer_) side_->call([this] { transfer_.reset(); });
  }
  /// Loop thread only.
  Transfer& get() { return *transfer_; }
  /// Loop thread only: destroys the transfer here and now.
  void destroy_here() { transfer_.reset(); }
  bool alive() const { return transfer_ != nullptr; }

 private:
  Side* side_ = nullptr;
  std::unique_ptr<Transfer> transfer_;
};

// ---------------------------------------------------------------------------------------
// The rig: sides, observers and the calls every test makes

class Rig {
 public:
  explicit Rig(Harness harness) : harness_(std::move(harness)) {}

  const Harness& harness() const { return harness_; }

  /// A new side named `name`; `chunk_size` as in Params.
  Side& side(const std::string& name, std::uint64_t chunk_size = 0) {
    Params p;
    p.name = name;
    p.id = 0xc0ffee0000000000ULL + sides_.size() + 1;
    p.chunk_size = chunk_size;
    return *sides_.emplace_back(std::make_unique<Side>(harness_, p));
  }
  ExposureLog& exposure_log() { return exposure_logs_.emplace_back(); }
  TransferLog& transfer_log() { return transfer_logs_.emplace_back(); }
  /// Memory that outlives every side, so that a test failing half-way leaves no transport
  /// with freed memory in hand.
  Pieces& memory(const std::vector<std::size_t>& sizes, std::uint64_t seed) {
    return memory_.emplace_back(sizes, seed);
  }

  Served expose(Side& owner, Access access, const std::vector<Region>& regions, ExposureLog& log) {
    Served s;
    s.exposure.id = next_exposure_id++;
    s.exposure.token = random_token();
    s.exposure.access = access;
    s.exposure.regions = regions;
    owner.call([&] {
      for (const Region& r : regions)
        s.registrations.push_back(owner.transport().register_memory(r));
      s.info = owner.transport().expose(s.exposure, log);
    });
    return s;
  }

  static TransferSpec spec(const Side& owner, const Served& served, std::vector<Segment> segments) {
    TransferSpec t;
    t.remote_id = served.exposure.id;
    t.token = served.exposure.token;
    t.access = served.exposure.access;
    t.segments = std::move(segments);
    t.endpoint = owner.endpoint();
    t.endpoint.info = served.info;
    t.peer_name = owner.params().name;
    return t;
  }

  /// The whole of `served` paired with `local`.
  static TransferSpec whole(const Side& owner, const Served& served,
                            const std::vector<Region>& local) {
    return spec(owner, served, match(served.exposure.regions, local));
  }

  static Running start(Side& active, TransferSpec spec, TransferLog& log) {
    auto t = active.call([&] { return active.transport().start(std::move(spec), log); });
    return Running(active, std::move(t));
  }

  /// Destroys every side now (each transport on its loop, then the loop): for a fixture whose
  /// own members (observers) must outlive the transports.
  void close_sides() { sides_.clear(); }

  /// Runs `probe` on `side`'s loop until it returns true, or `limit` passes.
  template <class F>
  static bool on_loop_when(Side& side, F probe, std::chrono::milliseconds limit = kWait) {
    const auto until = Clock::now() + limit;
    while (Clock::now() < until) {
      if (side.call(probe)) return true;
      std::this_thread::sleep_for(100us);
    }
    return false;
  }

  /// A fresh transport's attempt on `served` is refused: the token is dead for everyone.
  void expect_token_dead(Side& owner, const Served& served) {
    Side& late = side("late");
    TransferLog& log = transfer_log();
    Pieces& dst = memory({1}, 0);
    const Region& r = served.exposure.regions.at(0);
    Running t = start(late, spec(owner, served, {Segment{address_of(r.ptr), dst.data(), 1}}), log);
    auto end = log.wait_end();
    ASSERT_TRUE(end.has_value());
    ASSERT_EQ(end->call, Call::failed) << call_name(end->call);
    EXPECT_EQ(end->error->code(), ErrorCode::AccessDenied) << end->error->what();
    EXPECT_TRUE(contains(end->error->message(), "no live operation matches this id and token"))
        << end->error->what();
  }

 private:
  Harness harness_;
  // Memory and observers before sides: they outlive the transports that use them.
  std::deque<Pieces> memory_;
  std::deque<ExposureLog> exposure_logs_;
  std::deque<TransferLog> transfer_logs_;
  std::deque<std::unique_ptr<Side>> sides_;
};

/// The failure that ends a transfer whose exposure was revoked: the revoke's own reason, or
/// the table's refusal of a dead token.
inline void expect_refused_after_revoke(const std::optional<Event>& end) {
  ASSERT_TRUE(end.has_value()) << "the active transfer did not end";
  ASSERT_EQ(end->call, Call::failed) << call_name(end->call);
  const Error& e = *end->error;
  if (e.code() == ErrorCode::Cancelled)
    EXPECT_TRUE(contains(e.message(), "revoked by the test")) << e.what();
  else if (e.code() == ErrorCode::AccessDenied)
    EXPECT_TRUE(contains(e.message(), "no live operation matches this id and token")) << e.what();
  else
    ADD_FAILURE() << "expected Cancelled or AccessDenied, got " << e.what();
}

constexpr std::size_t kBig = 16u << 20;  // with 4 KiB chunks: thousands of round trips
constexpr std::uint64_t kSlowChunk = 4096;
constexpr std::size_t kMid = 1u << 20;
constexpr std::byte kPoison{0x5A};

/// Whether the 64 bytes at stream offset `at` hold the pattern `seed` (while a transfer may
/// still be writing them: cma copies on other threads).
inline bool landed(const std::byte* data, std::size_t at, std::uint64_t seed) {
  const std::vector<std::byte> seen = test::peek(data + at, 64);
  return test::first_mismatch(seen.data(), 64, seed, at) == -1;
}

inline bool all_are(const std::byte* data, std::size_t size, std::byte value) {
  for (std::size_t i = 0; i < size; ++i)
    if (data[i] != value) return false;
  return true;
}

/// Bytes of `data` that are neither untouched (zero) nor the pattern `seed`: bytes that came
/// from memory after it was poisoned.
inline std::size_t foreign_bytes(const std::byte* data, std::size_t size, std::uint64_t seed) {
  auto expected = test::patterned(size, seed);
  std::size_t n = 0;
  for (std::size_t i = 0; i < size; ++i)
    if (data[i] != std::byte{0} && data[i] != expected[i]) ++n;
  return n;
}

}  // namespace ferry::transport::conformance
