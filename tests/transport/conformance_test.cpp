// Every transport built, held to the Transport contract (transport/transport.hpp) by the same
// tests: driven directly, without a Connector, each side on an EventLoop of its own. A new
// transport joins by adding its harness to harnesses().
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
#include <tuple>
#include <vector>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "build_config.hpp"
#include "loop/event_loop.hpp"
#include "loop/ids.hpp"
#include "tests/support/fake_transport.hpp"
#include "tests/support/patterns.hpp"
#include "transport/cma/cma_transport.hpp"
#include "transport/kit/exposure_table.hpp"
#include "transport/region.hpp"
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

namespace ferry::transport {
namespace {

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

std::function<void(std::function<void()>)> defer_on(loop::EventLoop& loop) {
  return [&loop](std::function<void()> task) { loop.defer(std::move(task)); };
}

/// What a transport of `params` is built from, on `loop`.
Context context_on(loop::EventLoop& loop, const Params& p) {
  Context c;
  c.loop = loop.uv();
  c.defer = defer_on(loop);
  c.local_name = p.name;
  c.local_id = p.id;
  c.peer_timeout = 5s;
  return c;
}

Harness tcp_harness() {
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

Harness fake_harness() {
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

CmaOptions cma_options(const Params& p) {
  CmaOptions o;
  if (p.chunk_size != 0) {
    o.chunk_size = p.chunk_size;
    o.parallel = 1;
    o.inline_max = 0;
  }
  return o;
}

Harness cma_harness() {
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
VerbsOptions verbs_options(const Params& p) {
  VerbsOptions o;
  if (p.chunk_size != 0) {
    o.max_wr_bytes = p.chunk_size;
    o.queue_depth = 4;
    o.signal_every = 1;
  }
  return o;
}

// verbs against the simulated fabric (tests/support/simverbs/): no RDMA NIC here.
Harness verbs_harness() {
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

std::vector<Harness> harnesses() {
  return {
    tcp_harness(), fake_harness(), cma_harness(),
#if FERRY_HAS_VERBS
        verbs_harness(),
#endif
  };
}

// gtest prints a parameter by this, not as bytes.
void PrintTo(const Harness& harness, std::ostream* os) { *os << harness.method; }

std::string harness_name(const ::testing::TestParamInfo<Harness>& info) {
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

const char* call_name(Call c) {
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

void PrintTo(Call c, std::ostream* os) { *os << call_name(c); }

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
std::vector<std::size_t> cut(std::size_t total, std::initializer_list<std::size_t> firsts) {
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
std::vector<Segment> match(const std::vector<Region>& remote, const std::vector<Region>& local) {
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

std::uint64_t address_of(const std::byte* p) { return reinterpret_cast<std::uint64_t>(p); }

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

/// A passive operation's memory, served by one side.
struct Served {
  Exposure exposure;
  std::string info;  ///< what expose() returned: the endpoint's info
  std::vector<std::shared_ptr<const Registration>> registrations;
};

std::atomic<std::uint64_t> next_exposure_id{0x5100};

/// A gate a loop thread waits at (for at most 10 s) until the test opens it: while it waits,
/// the transport of that loop moves nothing.
class Gate {
 public:
  void wait() {
    std::unique_lock lock(mu_);
    cv_.wait_for(lock, 10s, [&] { return open_; });
  }
  void open() {
    {
      std::lock_guard lock(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

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
void expect_refused_after_revoke(const std::optional<Event>& end) {
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
bool landed(const std::byte* data, std::size_t at, std::uint64_t seed) {
  const std::vector<std::byte> seen = test::peek(data + at, 64);
  return test::first_mismatch(seen.data(), 64, seed, at) == -1;
}

bool all_are(const std::byte* data, std::size_t size, std::byte value) {
  for (std::size_t i = 0; i < size; ++i)
    if (data[i] != value) return false;
  return true;
}

/// Bytes of `data` that are neither untouched (zero) nor the pattern `seed`: bytes that came
/// from memory after it was poisoned.
std::size_t foreign_bytes(const std::byte* data, std::size_t size, std::uint64_t seed) {
  auto expected = test::patterned(size, seed);
  std::size_t n = 0;
  for (std::size_t i = 0; i < size; ++i)
    if (data[i] != std::byte{0} && data[i] != expected[i]) ++n;
  return n;
}

class Conformance : public ::testing::TestWithParam<Harness>, public Rig {
 protected:
  Conformance() : Rig(GetParam()) {}
};

// ---------------------------------------------------------------------------------------
// Data across regions and segments

class Data : public ::testing::TestWithParam<std::tuple<Harness, std::size_t>>, public Rig {
 protected:
  Data() : Rig(std::get<0>(GetParam())) {}

  // Moves the bytes in the direction `access` between pieces cut differently on each side.
  void run(Access access) {
    const std::size_t size = std::get<1>(GetParam());
    Side& owner = side("owner");
    Side& active = side("active");
    const std::uint64_t seed = access == Access::read ? 11 : 12;
    Pieces& remote = memory(cut(size, {1000, 1, 300000}), access == Access::read ? seed : 0);
    Pieces& local = memory(cut(size, {2048, 7, 524288}), access == Access::read ? 0 : seed);
    ExposureLog& olog = exposure_log();
    TransferLog& alog = transfer_log();
    Served served = expose(owner, access, remote.regions(), olog);
    Running t = start(active, whole(owner, served, local.regions()), alog);

    auto end = alog.wait_end();
    ASSERT_TRUE(end.has_value()) << "the transfer did not end";
    ASSERT_EQ(end->call, Call::complete)
        << call_name(end->call) << ": " << (end->error ? end->error->what() : "");
    auto passive_end = olog.wait_end();
    ASSERT_TRUE(passive_end.has_value()) << "the owner did not hear the end";
    EXPECT_EQ(passive_end->call, Call::peer_finished) << call_name(passive_end->call);
    EXPECT_FALSE(passive_end->error.has_value()) << passive_end->error->what();
    // Both loops are done with the memory: this thread may read it.
    owner.call([] {});
    active.call([] {});
    const Pieces& dst = access == Access::read ? local : remote;
    EXPECT_EQ(dst.mismatch(seed), -1);
    EXPECT_TRUE(remote.guards_intact());
    EXPECT_TRUE(local.guards_intact());
    EXPECT_EQ(alog.events().size(), 1u) << alog.text();
  }
};

TEST_P(Data, ReadAcrossRegions) { run(Access::read); }
TEST_P(Data, WriteAcrossRegions) { run(Access::write); }

std::string data_name(const ::testing::TestParamInfo<std::tuple<Harness, std::size_t>>& info) {
  return std::get<0>(info.param).method + "_bytes_" + std::to_string(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(Transports, Data,
                         ::testing::Combine(::testing::ValuesIn(harnesses()),
                                            ::testing::Values(std::size_t{1}, std::size_t{4096},
                                                              std::size_t{1} << 20)),
                         data_name);

// ---------------------------------------------------------------------------------------
// Revoke: no byte of the memory moves after it returns, no observer call follows

TEST_P(Conformance, RevokeMidWriteStopsEveryLaterWrite) {
  Side& owner = side("owner");
  Side& active = side("active", kSlowChunk);
  Pieces& dst = memory({kBig}, 0);
  Pieces& src = memory({kBig}, 21);
  ExposureLog& olog = exposure_log();
  TransferLog& alog = transfer_log();
  Served served = expose(owner, Access::write, dst.regions(), olog);
  Running t = start(active, whole(owner, served, src.regions()), alog);

  bool finished_first = false;
  ASSERT_TRUE(on_loop_when(owner, [&] {
    if (!landed(dst.data(), kMid, 21)) return false;
    finished_first = landed(dst.data(), kBig - 64, 21);
    owner.transport().revoke(served.exposure.id,
                             Error(ErrorCode::Cancelled, "revoked by the test"));
    olog.seal();
    std::memset(dst.data(), static_cast<int>(kPoison), kBig);
    return true;
  })) << "the write never reached the middle of the memory";
  ASSERT_FALSE(finished_first) << "the transfer ended before the revoke; it must be slower";

  expect_refused_after_revoke(alog.wait_end());
  owner.settle();
  active.settle();
  EXPECT_TRUE(owner.call([&] { return all_are(dst.data(), kBig, kPoison); }))
      << "bytes were written into the memory after revoke() returned";
  EXPECT_TRUE(dst.guards_intact());
  EXPECT_EQ(olog.after_seal(), 0u) << olog.text();
  expect_token_dead(owner, served);
}

TEST_P(Conformance, RevokeMidReadStopsEveryLaterRead) {
  Side& owner = side("owner");
  Side& active = side("active", kSlowChunk);
  Pieces& src = memory({kBig}, 22);
  Pieces& dst = memory({kBig}, 0);
  ExposureLog& olog = exposure_log();
  TransferLog& alog = transfer_log();
  Served served = expose(owner, Access::read, src.regions(), olog);
  Running t = start(active, whole(owner, served, dst.regions()), alog);

  ASSERT_TRUE(on_loop_when(active, [&] { return landed(dst.data(), kMid, 22); }))
      << "the read never reached the middle of the memory";
  owner.call([&] {
    owner.transport().revoke(served.exposure.id,
                             Error(ErrorCode::Cancelled, "revoked by the test"));
    olog.seal();
    std::memset(src.data(), static_cast<int>(kPoison), kBig);
  });

  auto end = alog.wait_end();
  ASSERT_TRUE(end.has_value());
  ASSERT_NE(end->call, Call::complete) << "the transfer ended before the revoke; it must be slower";
  expect_refused_after_revoke(end);
  owner.settle();
  active.settle();
  // Whatever reached the reader was read before the revoke: no byte of the poison.
  EXPECT_EQ(active.call([&] { return foreign_bytes(dst.data(), kBig, 22); }), 0u);
  EXPECT_FALSE(active.call([&] { return landed(dst.data(), kBig - 64, 22); }));
  EXPECT_EQ(olog.after_seal(), 0u) << olog.text();
  expect_token_dead(owner, served);
}

TEST_P(Conformance, RevokeBeforeAnyRequestLeavesNothingToClaim) {
  Side& owner = side("owner");
  Side& active = side("active");
  Pieces& src = memory({4096}, 23);
  ExposureLog& olog = exposure_log();
  Served served = expose(owner, Access::read, src.regions(), olog);
  owner.call([&] {
    owner.transport().revoke(served.exposure.id,
                             Error(ErrorCode::Cancelled, "revoked by the test"));
    olog.seal();
  });
  (void)active;
  expect_token_dead(owner, served);
  owner.settle();
  EXPECT_TRUE(olog.events().empty()) << olog.text();
}

TEST_P(Conformance, RevokeOfAnUnknownIdDoesNothing) {
  Side& owner = side("owner");
  EXPECT_NO_THROW(owner.call(
      [&] { owner.transport().revoke(0xdead, Error(ErrorCode::Cancelled, "nothing there")); }));
}

// ---------------------------------------------------------------------------------------
// Cancel: the local memory is left alone, the peer is told, no observer call follows

TEST_P(Conformance, CancelMidReadLeavesTheLocalMemoryAloneAndTellsThePeer) {
  Side& owner = side("owner");
  Side& active = side("active", kSlowChunk);
  Pieces& src = memory({kBig}, 24);
  Pieces& dst = memory({kBig}, 0);
  ExposureLog& olog = exposure_log();
  TransferLog& alog = transfer_log();
  Served served = expose(owner, Access::read, src.regions(), olog);
  Running t = start(active, whole(owner, served, dst.regions()), alog);

  bool finished_first = false;
  ASSERT_TRUE(on_loop_when(active, [&] {
    if (!landed(dst.data(), kMid, 24)) return false;
    finished_first = landed(dst.data(), kBig - 64, 24);
    t.get().cancel(Error(ErrorCode::Cancelled, "cancelled by the test"));
    alog.seal();
    std::memset(dst.data(), static_cast<int>(kPoison), kBig);
    return true;
  }));
  ASSERT_FALSE(finished_first) << "the transfer ended before the cancel; it must be slower";

  // The peer is told: its exposure ends with the reason.
  auto end = olog.wait_end();
  ASSERT_TRUE(end.has_value()) << "the owner was not told";
  EXPECT_EQ(end->call, Call::peer_finished) << call_name(end->call);
  ASSERT_TRUE(end->error.has_value());
  EXPECT_EQ(end->error->code(), ErrorCode::Cancelled) << end->error->what();
  EXPECT_TRUE(contains(end->error->message(), "cancelled by the test")) << end->error->what();
  EXPECT_TRUE(contains(end->error->message(), "'active'")) << end->error->what();

  owner.settle();
  active.settle();
  EXPECT_TRUE(active.call([&] { return all_are(dst.data(), kBig, kPoison); }))
      << "bytes were written into the local memory after cancel() returned";
  EXPECT_TRUE(alog.events().empty()) << alog.text();
  expect_token_dead(owner, served);
}

TEST_P(Conformance, CancelMidWriteReadsNoMoreLocalMemoryAndTellsThePeer) {
  Side& owner = side("owner");
  Side& active = side("active", kSlowChunk);
  Pieces& dst = memory({kBig}, 0);
  Pieces& src = memory({kBig}, 25);
  ExposureLog& olog = exposure_log();
  TransferLog& alog = transfer_log();
  Served served = expose(owner, Access::write, dst.regions(), olog);
  Running t = start(active, whole(owner, served, src.regions()), alog);

  ASSERT_TRUE(on_loop_when(owner, [&] { return landed(dst.data(), kMid, 25); }));
  const bool finished_first = active.call([&] {
    t.get().cancel(Error(ErrorCode::Cancelled, "cancelled by the test"));
    alog.seal();
    std::memset(src.data(), static_cast<int>(kPoison), kBig);
    return !alog.events().empty();
  });
  ASSERT_FALSE(finished_first) << "the transfer ended before the cancel; it must be slower";

  auto end = olog.wait_end();
  ASSERT_TRUE(end.has_value()) << "the owner was not told";
  EXPECT_EQ(end->call, Call::peer_finished) << call_name(end->call);
  ASSERT_TRUE(end->error.has_value());
  EXPECT_EQ(end->error->code(), ErrorCode::Cancelled) << end->error->what();
  EXPECT_TRUE(contains(end->error->message(), "cancelled by the test")) << end->error->what();

  owner.settle();
  active.settle();
  // Whatever reached the owner was read from the local memory before the cancel.
  EXPECT_EQ(owner.call([&] { return foreign_bytes(dst.data(), kBig, 25); }), 0u);
  EXPECT_FALSE(owner.call([&] { return landed(dst.data(), kBig - 64, 25); }));
  EXPECT_EQ(alog.after_seal(), 0u) << alog.text();
  expect_token_dead(owner, served);
}

TEST_P(Conformance, DestroyingATransferCancelsIt) {
  Side& owner = side("owner");
  Side& active = side("active", kSlowChunk);
  Pieces& src = memory({kBig}, 26);
  Pieces& dst = memory({kBig}, 0);
  ExposureLog& olog = exposure_log();
  TransferLog& alog = transfer_log();
  Served served = expose(owner, Access::read, src.regions(), olog);
  Running t = start(active, whole(owner, served, dst.regions()), alog);
  ASSERT_TRUE(olog.wait_claim().has_value());
  t.reset();

  auto end = olog.wait_end();
  ASSERT_TRUE(end.has_value()) << "the owner was not told";
  EXPECT_EQ(end->call, Call::peer_finished) << call_name(end->call);
  ASSERT_TRUE(end->error.has_value());
  EXPECT_EQ(end->error->code(), ErrorCode::Cancelled) << end->error->what();
  active.settle();
  EXPECT_TRUE(alog.events().empty()) << alog.text();
}

// ---------------------------------------------------------------------------------------
// Claims: one peer per exposure; refusals that teach a prober nothing

// `access` exposure claimed by one transfer; another transport's transfer is refused while
// the first goes on, and the first still completes with every byte its own.
void second_claimant_refused(Rig& rig, Access access) {
  Side& owner = rig.side("owner");
  Side& first = rig.side("first", kSlowChunk);
  Side& second = rig.side("second");
  constexpr std::size_t size = 4u << 20;
  const bool reading = access == Access::read;
  Pieces& theirs = rig.memory({size}, reading ? 31 : 0);
  Pieces& mine = rig.memory({size}, reading ? 0 : 31);
  ExposureLog& olog = rig.exposure_log();
  TransferLog& flog = rig.transfer_log();
  TransferLog& slog = rig.transfer_log();
  // Once the claim is made, the first transfer's loop stops until the second was refused.
  auto gate = std::make_shared<Gate>();
  olog.on_claim = [&first, gate](const Claim&) { first.post([gate] { gate->wait(); }); };
  Served served = rig.expose(owner, access, theirs.regions(), olog);
  Running t1 = Rig::start(first, Rig::whole(owner, served, mine.regions()), flog);
  ASSERT_TRUE(olog.wait_claim().has_value());

  Pieces& poison = rig.memory({4096}, 0);
  std::memset(poison.data(), static_cast<int>(kPoison), 4096);
  const Region& r = theirs.regions()[0];
  Running t2 = Rig::start(
      second, Rig::spec(owner, served, {Segment{address_of(r.ptr), poison.data(), 4096}}), slog);
  auto refused = slog.wait_end();
  gate->open();
  ASSERT_TRUE(refused.has_value());
  ASSERT_EQ(refused->call, Call::failed) << call_name(refused->call);
  EXPECT_EQ(refused->error->code(), ErrorCode::AccessDenied) << refused->error->what();
  EXPECT_TRUE(
      contains(refused->error->message(), "the operation is claimed by another peer (first)"))
      << refused->error->what();

  auto done = flog.wait_end();
  ASSERT_TRUE(done.has_value());
  EXPECT_EQ(done->call, Call::complete)
      << call_name(done->call) << " " << (done->error ? done->error->what() : "");
  auto end = olog.wait_end();
  ASSERT_TRUE(end.has_value());
  EXPECT_EQ(end->call, Call::peer_finished) << call_name(end->call);
  EXPECT_FALSE(end->error.has_value()) << end->error->what();
  owner.call([] {});
  first.call([] {});
  const Pieces& dst = reading ? mine : theirs;
  EXPECT_EQ(dst.mismatch(31), -1);
  const auto claims = olog.events();
  EXPECT_EQ(std::count_if(claims.begin(), claims.end(),
                          [](const Event& e) { return e.call == Call::claimed; }),
            1);
}

TEST_P(Conformance, SecondClaimantOfAReadableIsRefused) {
  second_claimant_refused(*this, Access::read);
}

TEST_P(Conformance, SecondClaimantOfAWritableIsRefused) {
  second_claimant_refused(*this, Access::write);
}

TEST_P(Conformance, WrongTokenAndUnknownIdGetTheSameRefusal) {
  Side& owner = side("owner");
  Side& prober = side("prober");
  Pieces& src = memory({4096}, 32);
  Pieces& dst = memory({4096}, 0);
  ExposureLog& olog = exposure_log();
  Served served = expose(owner, Access::read, src.regions(), olog);

  TransferSpec wrong_token = whole(owner, served, dst.regions());
  wrong_token.token[3] ^= 0x40;
  TransferSpec unknown_id = whole(owner, served, dst.regions());
  unknown_id.remote_id += 1000;
  std::vector<std::string> texts;
  for (TransferSpec* s : {&wrong_token, &unknown_id}) {
    TransferLog& log = transfer_log();
    Running t = start(prober, *s, log);
    auto end = log.wait_end();
    ASSERT_TRUE(end.has_value());
    ASSERT_EQ(end->call, Call::failed) << call_name(end->call);
    EXPECT_EQ(end->error->code(), ErrorCode::AccessDenied) << end->error->what();
    EXPECT_TRUE(contains(end->error->message(), "no live operation matches this id and token"))
        << end->error->what();
    texts.push_back(end->error->message());
  }
  EXPECT_EQ(texts[0], texts[1]);

  // Refusals claim nothing: the right token still works, for the same prober.
  TransferLog& log = transfer_log();
  Running t = start(prober, whole(owner, served, dst.regions()), log);
  auto end = log.wait_end();
  ASSERT_TRUE(end.has_value());
  EXPECT_EQ(end->call, Call::complete) << (end->error ? end->error->what() : "");
  prober.call([] {});
  EXPECT_EQ(dst.mismatch(32), -1);
}

TEST_P(Conformance, WrongAccessKindIsRefused) {
  Side& owner = side("owner");
  Side& prober = side("prober");
  Pieces& readable = memory({4096}, 33);
  Pieces& writable = memory({4096}, 0);
  Pieces& local = memory({4096}, 34);
  Served r = expose(owner, Access::read, readable.regions(), exposure_log());
  Served w = expose(owner, Access::write, writable.regions(), exposure_log());

  TransferSpec write_readable = whole(owner, r, local.regions());
  write_readable.access = Access::write;
  TransferSpec read_writable = whole(owner, w, local.regions());
  read_writable.access = Access::read;
  const std::pair<TransferSpec*, std::string> cases[] = {
      {&write_readable, "the operation is readable; it cannot be written"},
      {&read_writable, "the operation is writable; it cannot be read"},
  };
  for (const auto& [s, text] : cases) {
    TransferLog& log = transfer_log();
    Running t = start(prober, *s, log);
    auto end = log.wait_end();
    ASSERT_TRUE(end.has_value());
    ASSERT_EQ(end->call, Call::failed) << call_name(end->call);
    EXPECT_EQ(end->error->code(), ErrorCode::AccessDenied) << end->error->what();
    EXPECT_TRUE(contains(end->error->message(), text)) << end->error->what();
  }
  owner.settle();
  EXPECT_EQ(owner.call([&] { return readable.mismatch(33); }), -1);
  EXPECT_TRUE(owner.call([&] { return all_are(writable.data(), 4096, std::byte{0}); }));
}

TEST_P(Conformance, RangesOutsideTheExposureAreRefused) {
  Side& owner = side("owner");
  Side& prober = side("prober");
  // Two regions with a gap between them: a range across the gap is outside too.
  Pieces& block = memory({3 * 4096}, 0);
  std::memset(block.data(), 0x77, 3 * 4096);
  std::byte* a = block.data();
  std::byte* b = block.data() + 2 * 4096;
  const std::vector<Region> regions = {{a, 4096, MemoryKind::host}, {b, 4096, MemoryKind::host}};
  Pieces& local = memory({8192}, 35);

  struct Case {
    Access access;
    std::uint64_t addr;
    std::uint64_t len;
  };
  const Case cases[] = {
      {Access::read, address_of(a) + 4000, 200},  // runs off the end of the first region
      {Access::read, address_of(a) - 1, 1},       // one byte before
      {Access::read, address_of(b) + 4096, 1},    // one byte after
      {Access::read, address_of(a) + 4095, 2},    // into the gap
      {Access::write, address_of(a) + 4000, 200},
      {Access::write, address_of(a) + 4096, 4096},  // the gap itself
      {Access::write, address_of(b) - 8, 16},
  };
  for (const Case& c : cases) {
    Served served = expose(owner, c.access, regions, exposure_log());
    TransferLog& log = transfer_log();
    Running t = start(prober, spec(owner, served, {Segment{c.addr, local.data(), c.len}}), log);
    auto end = log.wait_end();
    ASSERT_TRUE(end.has_value());
    ASSERT_EQ(end->call, Call::failed) << call_name(end->call);
    EXPECT_EQ(end->error->code(), ErrorCode::AccessDenied) << end->error->what();
    char hex[32];
    std::snprintf(hex, sizeof hex, "%llx", static_cast<unsigned long long>(c.addr));
    EXPECT_TRUE(contains(end->error->message(), "range of " + std::to_string(c.len) +
                                                    " bytes at 0x" + hex +
                                                    " is outside the operation's memory"))
        << end->error->what();
  }
  owner.settle();
  EXPECT_TRUE(owner.call([&] { return all_are(block.data(), 3 * 4096, std::byte{0x77}); }))
      << "a refused write changed the memory";
}

// ---------------------------------------------------------------------------------------
// The claim's secret goes to the claimant

void claim_secret_reaches_the_claimant(Rig& rig, Access access) {
  Side& owner = rig.side("owner");
  Side& active = rig.side("claimant");
  const bool reading = access == Access::read;
  Pieces& theirs = rig.memory({65536}, reading ? 41 : 0);
  Pieces& mine = rig.memory({65536}, reading ? 0 : 41);
  ExposureLog& olog = rig.exposure_log();
  TransferLog& alog = rig.transfer_log();
  Served served = rig.expose(owner, access, theirs.regions(), olog);
  Running t = Rig::start(active, Rig::whole(owner, served, mine.regions()), alog);
  auto end = alog.wait_end();
  ASSERT_TRUE(end.has_value());
  ASSERT_EQ(end->call, Call::complete) << (end->error ? end->error->what() : "");
  auto claim = olog.wait_claim();
  ASSERT_TRUE(claim.has_value());

  const std::optional<Token> secret = active.call([&] { return t.get().claim_secret(); });
  ASSERT_TRUE(secret.has_value()) << "the claimant never got the claim's secret";
  EXPECT_TRUE(tokens_equal(*secret, claim->secret));
  EXPECT_FALSE(tokens_equal(claim->secret, served.exposure.token));
  EXPECT_FALSE(tokens_equal(claim->secret, Token{}));
  EXPECT_EQ(claim->method, rig.harness().method);
  EXPECT_EQ(claim->peer_id, loop::hex16(active.params().id));
  EXPECT_TRUE(contains(claim->peer, "'claimant'")) << claim->peer;
}

TEST_P(Conformance, ClaimSecretOfAReadReachesTheClaimant) {
  claim_secret_reaches_the_claimant(*this, Access::read);
}

TEST_P(Conformance, ClaimSecretOfAWriteReachesTheClaimant) {
  claim_secret_reaches_the_claimant(*this, Access::write);
}

// ---------------------------------------------------------------------------------------
// Peer loss

TEST_P(Conformance, DestroyingThePassiveSideFailsTheActiveTransferInBoundedTime) {
  Side& owner = side("owner");
  Side& active = side("active", kSlowChunk);
  Pieces& src = memory({kBig}, 51);
  Pieces& dst = memory({kBig}, 0);
  ExposureLog& olog = exposure_log();
  TransferLog& alog = transfer_log();
  Served served = expose(owner, Access::read, src.regions(), olog);
  Running t = start(active, whole(owner, served, dst.regions()), alog);
  ASSERT_TRUE(olog.wait_claim().has_value());
  served.registrations.clear();
  const auto at = Clock::now();
  owner.call([&] {
    owner.transport().close();
    olog.seal();
  });
  owner.destroy_transport();

  auto end = alog.wait_end(10s);
  ASSERT_TRUE(end.has_value()) << "the active side did not notice";
  EXPECT_LT(Clock::now() - at, 5s);
  ASSERT_EQ(end->call, Call::failed) << call_name(end->call);
  const ErrorCode code = end->error->code();
  EXPECT_TRUE(code == ErrorCode::PeerLost || code == ErrorCode::Cancelled) << end->error->what();
  EXPECT_TRUE(contains(end->error->message(), "'owner'")) << end->error->what();
  EXPECT_EQ(olog.after_seal(), 0u) << olog.text();
}

TEST_P(Conformance, ClosingTheActiveSideLosesThePassivePeerInBoundedTime) {
  Side& owner = side("owner");
  Side& active = side("active", kSlowChunk);
  Pieces& dst = memory({kBig}, 0);
  Pieces& src = memory({kBig}, 52);
  ExposureLog& olog = exposure_log();
  TransferLog& alog = transfer_log();
  Served served = expose(owner, Access::write, dst.regions(), olog);
  Running t = start(active, whole(owner, served, src.regions()), alog);
  ASSERT_TRUE(olog.wait_claim().has_value());
  const auto at = Clock::now();
  active.call([&] {
    active.transport().close();
    alog.seal();
  });

  auto end = olog.wait_end(10s);
  ASSERT_TRUE(end.has_value()) << "the owner did not notice";
  EXPECT_LT(Clock::now() - at, 5s);
  ASSERT_TRUE(end->error.has_value()) << call_name(end->call) << " without an error";
  if (end->call == Call::peer_lost)
    EXPECT_EQ(end->error->code(), ErrorCode::PeerLost) << end->error->what();
  else
    EXPECT_EQ(end->call, Call::peer_finished) << call_name(end->call);
  EXPECT_TRUE(contains(end->error->message(), "'active'")) << end->error->what();
  active.settle();
  EXPECT_EQ(alog.after_seal(), 0u) << alog.text();
  // The exposure is gone with its peer.
  expect_token_dead(owner, served);
}

// ---------------------------------------------------------------------------------------
// A writable is complete only when every byte was written

TEST_P(Conformance, OverlappingWritesDoNotCountTwice) {
  Side& owner = side("owner");
  Side& active = side("active");
  Pieces& dst = memory({8192}, 0);
  Pieces& src = memory({8192}, 61);
  ExposureLog& olog = exposure_log();
  TransferLog& alog = transfer_log();
  Served served = expose(owner, Access::write, dst.regions(), olog);
  // 8192 bytes sent, but the same 4096 twice.
  const std::uint64_t base = address_of(dst.data());
  Running t = start(active,
                    spec(owner, served,
                         {Segment{base, src.data(), 4096}, Segment{base, src.data() + 4096, 4096}}),
                    alog);
  auto end = alog.wait_end();
  ASSERT_TRUE(end.has_value());
  ASSERT_EQ(end->call, Call::failed) << call_name(end->call);
  EXPECT_EQ(end->error->code(), ErrorCode::ProtocolError) << end->error->what();
  auto passive = olog.wait_end();
  ASSERT_TRUE(passive.has_value());
  EXPECT_EQ(passive->call, Call::peer_finished) << call_name(passive->call);
  ASSERT_TRUE(passive->error.has_value()) << "the writable completed with 4096 bytes missing";
  EXPECT_EQ(passive->error->code(), ErrorCode::ProtocolError) << passive->error->what();
  EXPECT_TRUE(contains(passive->error->message(), "said it was done after writing 4096 of 8192"))
      << passive->error->what();
}

TEST_P(Conformance, OverlappingWritesThatCoverEveryByteComplete) {
  Side& owner = side("owner");
  Side& active = side("active");
  Pieces& dst = memory({8192}, 0);
  Pieces& src = memory({12288}, 62);
  ExposureLog& olog = exposure_log();
  TransferLog& alog = transfer_log();
  Served served = expose(owner, Access::write, dst.regions(), olog);
  const std::uint64_t base = address_of(dst.data());
  Running t =
      start(active,
            spec(owner, served,
                 {Segment{base, src.data(), 6144}, Segment{base + 2048, src.data() + 6144, 6144}}),
            alog);
  auto end = alog.wait_end();
  ASSERT_TRUE(end.has_value());
  ASSERT_EQ(end->call, Call::complete) << (end->error ? end->error->what() : "");
  auto passive = olog.wait_end();
  ASSERT_TRUE(passive.has_value());
  EXPECT_EQ(passive->call, Call::peer_finished);
  EXPECT_FALSE(passive->error.has_value()) << passive->error->what();
  owner.call([] {});
  EXPECT_EQ(test::first_mismatch(dst.data(), 2048, 62, 0), -1);
  EXPECT_EQ(test::first_mismatch(dst.data() + 2048, 6144, 62, 6144), -1);
}

// ---------------------------------------------------------------------------------------
// How Core uses a transport

TEST_P(Conformance, AnObserverMayDestroyItsTransferFromItsCallback) {
  Side& owner = side("owner");
  Side& active = side("active");
  for (Access access : {Access::read, Access::write}) {
    Pieces& theirs = memory({65536}, access == Access::read ? 81 : 0);
    Pieces& mine = memory({65536}, access == Access::read ? 0 : 81);
    ExposureLog& olog = exposure_log();
    TransferLog& alog = transfer_log();
    Served served = expose(owner, access, theirs.regions(), olog);
    auto holder = std::make_shared<Running>();
    alog.on_end = [holder] { holder->destroy_here(); };
    active.call([&] {
      *holder =
          Running(active, active.transport().start(whole(owner, served, mine.regions()), alog));
    });
    auto end = alog.wait_end();
    ASSERT_TRUE(end.has_value());
    EXPECT_EQ(end->call, Call::complete) << (end->error ? end->error->what() : "");
    auto passive = olog.wait_end();
    ASSERT_TRUE(passive.has_value());
    EXPECT_EQ(passive->call, Call::peer_finished);
    EXPECT_FALSE(passive->error.has_value());
    active.settle();
    EXPECT_FALSE(active.call([&] { return holder->alive(); }));
    EXPECT_EQ(alog.events().size(), 1u) << alog.text();
    EXPECT_EQ((access == Access::read ? mine : theirs).mismatch(81), -1);
  }
}

TEST_P(Conformance, ManyTransfersAtOnceThroughOneTransport) {
  Side& owner = side("owner");
  Side& active = side("active", kSlowChunk);
  constexpr int kCount = 8;
  std::vector<Running> running;
  std::vector<TransferLog*> logs;
  std::vector<ExposureLog*> owner_logs;
  std::vector<Pieces*> destinations;
  for (int i = 0; i < kCount; ++i) {
    const Access access = i % 2 == 0 ? Access::read : Access::write;
    const std::uint64_t seed = 100 + static_cast<std::uint64_t>(i);
    Pieces& theirs =
        memory({65536 + 4096 * static_cast<std::size_t>(i)}, access == Access::read ? seed : 0);
    Pieces& mine =
        memory({65536 + 4096 * static_cast<std::size_t>(i)}, access == Access::read ? 0 : seed);
    ExposureLog& olog = exposure_log();
    Served served = expose(owner, access, theirs.regions(), olog);
    TransferLog& log = transfer_log();
    logs.push_back(&log);
    owner_logs.push_back(&olog);
    destinations.push_back(access == Access::read ? &mine : &theirs);
    running.push_back(start(active, whole(owner, served, mine.regions()), log));
  }
  for (int i = 0; i < kCount; ++i) {
    auto end = logs[i]->wait_end();
    ASSERT_TRUE(end.has_value()) << "transfer " << i;
    EXPECT_EQ(end->call, Call::complete)
        << "transfer " << i << ": " << (end->error ? end->error->what() : "");
    auto passive = owner_logs[i]->wait_end();
    ASSERT_TRUE(passive.has_value()) << "exposure " << i;
    EXPECT_FALSE(passive->error.has_value()) << passive->error->what();
  }
  owner.call([] {});
  active.call([] {});
  for (int i = 0; i < kCount; ++i)
    EXPECT_EQ(destinations[i]->mismatch(100 + static_cast<std::uint64_t>(i)), -1)
        << "transfer " << i;
}

// Transport::start() documents a peer it cannot reach as a set-up failure (another method may
// still work). tcp reports it as on_transfer_failed instead; see the report of this suite.
// What every transport does agree on: the transfer fails with PeerLost, in bounded time, and
// the message says where it tried.
TEST_P(Conformance, AnUnreachablePeerFailsTheTransferWithPeerLost) {
  Side& active = side("active");
  Pieces& dst = memory({4096}, 0);
  std::shared_ptr<void> keep;
  TransferSpec s;
  s.remote_id = 1;
  s.token = random_token();
  s.access = Access::read;
  s.segments = {Segment{0x10000, dst.data(), 4096}};
  s.endpoint = harness().dead_endpoint(keep);
  s.peer_name = "nobody";
  TransferLog& log = transfer_log();
  const auto at = Clock::now();
  Running t = start(active, s, log);
  auto end = log.wait_end(10s);
  ASSERT_TRUE(end.has_value()) << "no word on an unreachable peer";
  EXPECT_LT(Clock::now() - at, 5s);
  EXPECT_TRUE(end->call == Call::failed || end->call == Call::setup_failed) << call_name(end->call);
  ASSERT_TRUE(end->error.has_value());
  EXPECT_EQ(end->error->code(), ErrorCode::PeerLost) << end->error->what();
  EXPECT_TRUE(contains(end->error->message(), "'nobody'")) << end->error->what();
  EXPECT_TRUE(contains(end->error->message(), s.endpoint.address)) << end->error->what();
  EXPECT_TRUE(dst.guards_intact());
}

// A peer that cannot be reached is a set-up failure (nothing was touched), so a connector
// falls back to its next method; Core does not remember it (the peer may be back soon).
TEST_P(Conformance, AnUnreachablePeerIsASetUpFailure) {
  Side& active = side("active");
  Pieces& dst = memory({4096}, 0);
  std::shared_ptr<void> keep;
  TransferSpec s;
  s.remote_id = 1;
  s.token = random_token();
  s.access = Access::read;
  s.segments = {Segment{0x10000, dst.data(), 4096}};
  s.endpoint = harness().dead_endpoint(keep);
  s.peer_name = "nobody";
  TransferLog& log = transfer_log();
  Running t = start(active, s, log);
  auto end = log.wait_end(10s);
  ASSERT_TRUE(end.has_value());
  EXPECT_EQ(end->call, Call::setup_failed) << call_name(end->call);
}

// ---------------------------------------------------------------------------------------
// Calls that are wrong at once

TEST_P(Conformance, AnEndpointItCannotParseIsInvalidMetadata) {
  Side& owner = side("owner");
  Side& active = side("active");
  Pieces& src = memory({16}, 71);
  Pieces& dst = memory({16}, 0);
  Served served = expose(owner, Access::read, src.regions(), exposure_log());
  TransferSpec s = whole(owner, served, dst.regions());
  s.endpoint.address = "no address at all";
  TransferLog& log = transfer_log();
  try {
    Running t = start(active, s, log);
    ADD_FAILURE() << "start() accepted endpoint '" << s.endpoint.address << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidMetadata) << e.what();
    EXPECT_EQ(e.field(), "endpoints");
  }
  active.settle();
  EXPECT_TRUE(log.events().empty()) << log.text();
}

TEST_P(Conformance, AClosedTransportRefusesNewWork) {
  Side& owner = side("owner");
  Side& active = side("active");
  Pieces& src = memory({16}, 72);
  Served served = expose(owner, Access::read, src.regions(), exposure_log());
  const TransferSpec s = whole(owner, served, src.regions());
  active.call([&] { active.transport().close(); });
  TransferLog& log = transfer_log();
  ExposureLog& elog = exposure_log();
  try {
    Running t = start(active, s, log);
    ADD_FAILURE() << "a closed transport started a transfer";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidState) << e.what();
  }
  try {
    expose(active, Access::read, src.regions(), elog);
    ADD_FAILURE() << "a closed transport exposed memory";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidState) << e.what();
  }
}

TEST_P(Conformance, ARangeInsideARegisteredOneReusesItsRegistration) {
  Side& owner = side("owner");
  Pieces& bytes = memory({65536}, 0);
  owner.call([&] {
    Transport& t = owner.transport();
    auto whole_range = t.register_memory({bytes.data(), 65536, MemoryKind::host});
    auto inner = t.register_memory({bytes.data() + 4096, 4096, MemoryKind::host});
    EXPECT_EQ(inner.get(), whole_range.get());
    EXPECT_TRUE(whole_range->covers(address_of(bytes.data()), 65536));
    if (!t.capabilities().moves(MemoryKind::cuda)) {
      try {
        (void)t.register_memory({bytes.data(), 16, MemoryKind::cuda});
        ADD_FAILURE() << "registered a memory kind it does not move";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::Unsupported) << e.what();
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Transports, Conformance, ::testing::ValuesIn(harnesses()), harness_name);

// ---------------------------------------------------------------------------------------
// Regions (docs/regions.md): the contracts above, per attachment. Every built-in method that
// has a harness here serves regions; the fake transport does not (it keeps the defaults of
// transport.hpp, refusing them), so it is not among these.

/// What a region's owner hears, from its loop; sealed like Log.
class RegionLog final : public RegionObserver {
 public:
  /// Runs on the owner's loop for each transfer notice, after it is recorded.
  std::function<void(const RegionNotice&)> on_notice;

  void on_attached(const Attachment& a) override { add("attached", a.id); }
  void on_region_transfer(const RegionNotice& n) override {
    add(n.error ? "transfer failed" : "transfer", n.attachment);
    if (on_notice) on_notice(n);
  }
  void on_detached(std::uint64_t attachment, const std::optional<Error>&) override {
    add("detached", attachment);
  }
  void seal() {
    std::lock_guard lock(mu_);
    sealed_ = true;
  }
  std::size_t after_seal() const {
    std::lock_guard lock(mu_);
    return after_seal_;
  }
  /// The attachments heard of, in order (waits for `n` of them).
  std::vector<std::uint64_t> attached(std::size_t n) const {
    std::unique_lock lock(mu_);
    cv_.wait_for(lock, kWait, [&] { return attached_.size() >= n; });
    return attached_;
  }
  std::size_t count(const std::string& what) const {
    std::lock_guard lock(mu_);
    std::size_t k = 0;
    for (const auto& e : events_) k += e == what ? 1 : 0;
    return k;
  }

 private:
  void add(const std::string& what, std::uint64_t attachment) {
    {
      std::lock_guard lock(mu_);
      events_.push_back(what);
      if (what == "attached") attached_.push_back(attachment);
      if (sealed_) ++after_seal_;
    }
    cv_.notify_all();
  }
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::vector<std::string> events_;
  std::vector<std::uint64_t> attached_;
  bool sealed_ = false;
  std::size_t after_seal_ = 0;
};

/// How an attachment fares, active side.
class AttachLog final : public AttachObserver {
 public:
  void on_attached() override { set(1, std::nullopt); }
  void on_attach_failed(const Error& e, bool) override { set(2, e); }
  void on_detached(const Error& e) override { set(3, e); }
  /// Waits for `state` (1 attached, 2 failed, 3 detached); false after kWait.
  bool wait(int state) const {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, kWait, [&] { return state_ >= state; });
  }

 private:
  void set(int state, std::optional<Error> e) {
    {
      std::lock_guard lock(mu_);
      state_ = state;
      error_ = std::move(e);
    }
    cv_.notify_all();
  }
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  int state_ = 0;
  std::optional<Error> error_;
};

std::vector<Harness> region_harnesses() {
  return {
    tcp_harness(), cma_harness(),
#if FERRY_HAS_VERBS
        verbs_harness(),
#endif
  };
}

class RegionConformance : public ::testing::TestWithParam<Harness>, public Rig {
 protected:
  RegionConformance() : Rig(GetParam()) {}

  /// Serves `regions` of `owner` as a region of `access`.
  RegionExposure serve(Side& owner, Access access, const std::vector<Region>& regions,
                       RegionLog& log) {
    RegionExposure r;
    r.id = next_exposure_id++;
    r.token = random_token();
    r.access = access;
    r.regions = regions;
    info_ = owner.call([&] {
      for (const Region& x : regions)
        registrations_.push_back(owner.transport().register_exposed(x));
      return owner.transport().serve_region(r, log);
    });
    return r;
  }
  /// Attaches `active` to `region` of `owner`; waits until attached.
  std::unique_ptr<RemoteRegion> attach(Side& active, Side& owner, const RegionExposure& region,
                                       AttachLog& log) {
    AttachSpec spec;
    spec.region = region.id;
    spec.token = region.token;
    spec.access = region.access;
    spec.endpoint = owner.endpoint();
    spec.endpoint.info = info_;
    spec.peer_name = owner.params().name;
    auto remote = active.call([&] { return active.transport().attach(spec, log); });
    EXPECT_TRUE(log.wait(1)) << "not attached";
    return remote;
  }
  /// A transfer of `local` on `remote`, the whole region of `remote_regions`.
  Running transfer(Side& active, RemoteRegion& remote, Access access,
                   const std::vector<Region>& remote_regions, const std::vector<Region>& local,
                   TransferLog& log) {
    TransferSpec spec;
    spec.access = access;
    spec.segments = match(remote_regions, local);
    spec.region_tag = "conformance";
    auto t = active.call([&] { return remote.start(std::move(spec), log); });
    return Running(active, std::move(t));
  }
  /// Drops the RemoteRegion on its loop.
  static void drop(Side& active, std::unique_ptr<RemoteRegion>& remote) {
    active.call([&] { remote.reset(); });
  }

  std::string info_;
  std::vector<std::shared_ptr<const Registration>> registrations_;
};

TEST_P(RegionConformance, RevokingAnAttachmentMidWriteStopsEveryLaterWrite) {
  Side& owner = side("owner");
  Side& active = side("active", kSlowChunk);
  Pieces& dst = memory({kBig}, 0);
  Pieces& src = memory({kBig}, 31);
  RegionLog rlog;
  AttachLog alog;
  TransferLog& tlog = transfer_log();
  RegionExposure region = serve(owner, Access::write, dst.regions(), rlog);
  auto remote = attach(active, owner, region, alog);
  ASSERT_TRUE(remote);
  const std::uint64_t att = rlog.attached(1).at(0);
  Running t = transfer(active, *remote, Access::write, dst.regions(), src.regions(), tlog);
  bool finished_first = false;
  ASSERT_TRUE(on_loop_when(owner, [&] {
    if (!landed(dst.data(), kMid, 31)) return false;
    finished_first = landed(dst.data(), kBig - 64, 31);
    owner.transport().revoke_attachment(att, Error(ErrorCode::Cancelled, "revoked by the test"));
    rlog.seal();
    std::memset(dst.data(), static_cast<int>(kPoison), kBig);
    return true;
  })) << "the write never reached the middle of the memory";
  ASSERT_FALSE(finished_first) << "the transfer ended before the revoke; it must be slower";
  expect_refused_after_revoke(tlog.wait_end());
  EXPECT_TRUE(alog.wait(3)) << "the peer did not hear it was revoked";
  owner.settle();
  active.settle();
  EXPECT_TRUE(owner.call([&] { return all_are(dst.data(), kBig, kPoison); }))
      << "bytes were written into the memory after revoke_attachment() returned";
  EXPECT_TRUE(dst.guards_intact());
  EXPECT_EQ(rlog.after_seal(), 0u);
  // The attachment is over: no transfer starts on it.
  EXPECT_THROW(
      (void)transfer(active, *remote, Access::write, dst.regions(), src.regions(), transfer_log()),
      Error);
  t.reset();
  drop(active, remote);
}

TEST_P(RegionConformance, EndingTheRegionStopsEveryAttachmentAndRefusesNewOnes) {
  Side& owner = side("owner");
  Side& a = side("a", kSlowChunk);
  Side& b = side("b", kSlowChunk);
  Pieces& dst = memory({kBig}, 0);
  Pieces& src = memory({kBig}, 32);
  RegionLog rlog;
  AttachLog alog_a, alog_b;
  TransferLog& ta = transfer_log();
  TransferLog& tb = transfer_log();
  RegionExposure region = serve(owner, Access::write, dst.regions(), rlog);
  auto ra = attach(a, owner, region, alog_a);
  auto rb = attach(b, owner, region, alog_b);
  ASSERT_TRUE(ra && rb);
  EXPECT_EQ(rlog.attached(2).size(), 2u);
  Running t1 = transfer(a, *ra, Access::write, dst.regions(), src.regions(), ta);
  Running t2 = transfer(b, *rb, Access::write, dst.regions(), src.regions(), tb);
  ASSERT_TRUE(on_loop_when(owner, [&] {
    if (!landed(dst.data(), kMid, 32)) return false;
    owner.transport().end_region(region.id, Error(ErrorCode::Cancelled, "revoked by the test"));
    rlog.seal();
    std::memset(dst.data(), static_cast<int>(kPoison), kBig);
    return true;
  }));
  expect_refused_after_revoke(ta.wait_end());
  expect_refused_after_revoke(tb.wait_end());
  owner.settle();
  a.settle();
  b.settle();
  EXPECT_TRUE(owner.call([&] { return all_are(dst.data(), kBig, kPoison); }))
      << "bytes were written into the memory after end_region() returned";
  EXPECT_EQ(rlog.after_seal(), 0u);
  // Attaching again with the region's token is refused.
  AttachLog late;
  AttachSpec spec;
  spec.region = region.id;
  spec.token = region.token;
  spec.access = Access::write;
  spec.endpoint = owner.endpoint();
  spec.endpoint.info = info_;
  spec.peer_name = "owner";
  Side& c = side("c");
  auto rc = c.call([&] { return c.transport().attach(spec, late); });
  EXPECT_TRUE(late.wait(2));
  t1.reset();
  t2.reset();
  drop(a, ra);
  drop(b, rb);
  drop(c, rc);
}

TEST_P(RegionConformance, AWritesNoticeComesOnlyOnceItsBytesAreIn) {
  Side& owner = side("owner");
  Side& active = side("active");
  Pieces& dst = memory({kMid}, 0);
  Pieces& src = memory({kMid}, 33);
  RegionLog rlog;
  AttachLog alog;
  std::atomic<int> notices{0};
  std::atomic<bool> in_place{false};
  rlog.on_notice = [&](const RegionNotice& n) {
    // On the owner's loop: the bytes must be there now.
    in_place = !n.error && test::first_mismatch(dst.data(), kMid, 33) == -1;
    ++notices;
  };
  TransferLog& tlog = transfer_log();
  RegionExposure region = serve(owner, Access::write, dst.regions(), rlog);
  auto remote = attach(active, owner, region, alog);
  ASSERT_TRUE(remote);
  Running t = transfer(active, *remote, Access::write, dst.regions(), src.regions(), tlog);
  auto end = tlog.wait_end();
  ASSERT_TRUE(end.has_value());
  ASSERT_EQ(end->call, Call::complete) << (end->error ? end->error->what() : "");
  ASSERT_TRUE(on_loop_when(owner, [&] { return notices.load() == 1; }));
  EXPECT_TRUE(in_place.load());
  t.reset();
  drop(active, remote);
  // The owner hears the peer detach.
  EXPECT_TRUE(on_loop_when(owner, [&] { return rlog.count("detached") == 1; }));
}

INSTANTIATE_TEST_SUITE_P(Transports, RegionConformance, ::testing::ValuesIn(region_harnesses()),
                         harness_name);

}  // namespace
}  // namespace ferry::transport
