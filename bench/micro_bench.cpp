// Micro-benchmarks of ferry's control-path pieces, each on its own, no transfer involved:
//
//   MetadataEncode/descriptors:N    RdmaMetadata::to_json of a readable's metadata with N
//   MetadataDecode/descriptors:N    descriptors; from_json of that document (it validates too);
//   MetadataValidate/descriptors:N  validate() alone. N = 1, 64, 4096 (kMaxDescriptors is
//                                   65536). The owner and endpoints are a real connector's
//                                   (tcp and, where offered, cma with its info); descriptors
//                                   are 64 KiB blocks of a KV cache. Counters: json_bytes, and
//                                   items_per_second = descriptors per second.
//   RegCacheHit/regions:R           transport::kit::RegistrationCache::acquire of a range inside
//   one
//                                   of R cached disjoint registrations, visited in a shuffled
//                                   order (R = 1, 64, 4096)
//   RegCacheFind/regions:R          find() of the same ranges
//   RegCacheMiss/regions:R          acquire of a range never seen, on a full cache of R idle
//                                   registrations (max_idle = R): registers it (a trivial
//                                   register function) and evicts the least recently used one
//   FrameEncode, FrameDecode        transport::wire::encode / decode of one 64-byte header
//   FrameDecodeCheck                decode + malformed(), what the receiver does per header
//   ConnectionParse/frames:B        the real receive state machine
//   (wire::StreamConnection::read_some)
//                                   fed B frames per iteration through an AF_UNIX socketpair,
//                                   driven by uv_run on a private loop. It reads from its socket
//                                   only (one read(2) per header, per message, per payload), so
//                                   this is the parser *with* its system calls; the B frames
//                                   alternate READ (header only), STATUS (16-byte message) and
//                                   DATA (256-byte payload into a sink), written with one
//                                   write(2) per iteration
//
// Each benchmark checks one result outside its timed loop (decode(encode(x)) == x, a lookup
// returns the range asked for, ...) and reports an error instead of a number if it is wrong.
//
//   build/bench/ferry_micro_bench
//   build/bench/ferry_micro_bench --benchmark_filter=Metadata --benchmark_min_time=0.2
#include <benchmark/benchmark.h>
#include <uv.h>

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <ferry/ferry.hpp>

#include "transport/kit/registration_cache.hpp"
#include "transport/wire/frame.hpp"
#include "transport/wire/stream_connection.hpp"

namespace {

using ferry::RdmaMetadata;
using ferry::RemoteDescriptor;
namespace transport = ferry::transport;
namespace wire = ferry::transport::wire;

// ---------------------------------------------------------------------------------------------
// Metadata

// A readable's metadata as a connector of this host makes it (owner, endpoints, key, token),
// taken once from a real connector without a side channel.
const RdmaMetadata& real_metadata() {
  static const RdmaMetadata m = [] {
    ferry::ConnectorOptions options;
    options.name = "prefill-worker-3";
    options.nats.use_environment = false;
    ferry::Connector connector(options);
    std::vector<std::byte> buffer(4096);
    auto op = connector.create_readable(buffer);
    RdmaMetadata copy = op.metadata();
    op.cancel();
    return copy;
  }();
  return m;
}

// The real metadata with `n` descriptors: 64 KiB blocks of one pool at a typical mmap address.
RdmaMetadata metadata_with(std::size_t n) {
  RdmaMetadata m = real_metadata();
  m.descriptors.clear();
  constexpr std::uint64_t kBase = 0x7f3a40000000;
  constexpr std::uint64_t kBlock = 64 << 10;
  for (std::size_t i = 0; i < n; ++i)
    m.descriptors.push_back(RemoteDescriptor{kBase + i * kBlock, kBlock, ferry::Device::host()});
  return m;
}

void descriptor_args(benchmark::internal::Benchmark* b) {
  b->ArgName("descriptors");
  for (long n : {1L, 64L, 4096L}) {
    if (static_cast<std::size_t>(n) > RdmaMetadata::kMaxDescriptors)
      n = RdmaMetadata::kMaxDescriptors;
    b->Arg(n);
  }
}

// Whether from_json(json) gives `m` back; else skips the benchmark, saying why (`threw` comes
// before the message of an error thrown).
bool decodes_to(benchmark::State& state, const std::string& json, const RdmaMetadata& m,
                const std::string& threw) {
  try {
    if (RdmaMetadata::from_json(json) != m) {
      state.SkipWithError("from_json(to_json(m)) != m");
      return false;
    }
  } catch (const ferry::Error& e) {
    state.SkipWithError((threw + e.message()).c_str());
    return false;
  }
  return true;
}

void BM_MetadataEncode(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const RdmaMetadata m = metadata_with(n);
  const std::string once = m.to_json();
  if (!decodes_to(state, once, m, "from_json(to_json(m)) threw: ")) return;
  for (auto _ : state) {
    std::string json = m.to_json();
    benchmark::DoNotOptimize(json.data());
    benchmark::ClobberMemory();
  }
  state.counters["json_bytes"] = static_cast<double>(once.size());
  state.SetItemsProcessed(state.iterations() * state.range(0));
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(once.size()));
}
BENCHMARK(BM_MetadataEncode)->Name("MetadataEncode")->Apply(descriptor_args);

void BM_MetadataDecode(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const RdmaMetadata m = metadata_with(n);
  const std::string json = m.to_json();
  if (!decodes_to(state, json, m, "from_json threw: ")) return;
  for (auto _ : state) {
    RdmaMetadata decoded = RdmaMetadata::from_json(json);
    benchmark::DoNotOptimize(decoded.descriptors.data());
    benchmark::ClobberMemory();
  }
  state.counters["json_bytes"] = static_cast<double>(json.size());
  state.SetItemsProcessed(state.iterations() * state.range(0));
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(json.size()));
}
BENCHMARK(BM_MetadataDecode)->Name("MetadataDecode")->Apply(descriptor_args);

void BM_MetadataValidate(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const RdmaMetadata m = metadata_with(n);
  RdmaMetadata broken = m;
  broken.descriptors.back().size = 0;
  try {
    m.validate();
  } catch (const ferry::Error& e) {
    state.SkipWithError(("validate() refused good metadata: " + e.message()).c_str());
    return;
  }
  try {
    broken.validate();
    state.SkipWithError("validate() accepted a zero-size descriptor");
    return;
  } catch (const ferry::Error&) {
  }
  for (auto _ : state) {
    benchmark::DoNotOptimize(&m);
    m.validate();
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
}
BENCHMARK(BM_MetadataValidate)->Name("MetadataValidate")->Apply(descriptor_args);

// ---------------------------------------------------------------------------------------------
// Registration cache

constexpr std::uint64_t kRegionBase = 0x7f0000000000;
constexpr std::uint64_t kRegionSize = 1 << 20;
// Gaps between the regions: acquire() merges ranges that touch.
constexpr std::uint64_t kRegionStride = 2 * kRegionSize;

transport::Region fake_region(std::uint64_t addr, std::uint64_t size) {
  // Never dereferenced: the cache only compares addresses, and the register function is ours.
  return transport::Region{reinterpret_cast<std::byte*>(addr), size, transport::MemoryKind::host};
}

struct FilledCache {
  std::uint64_t registered = 0;  // calls of the register function
  transport::kit::RegistrationCache cache;
  std::vector<std::uint64_t> lookups;  // one address inside each region, in shuffled order

  explicit FilledCache(std::size_t regions)
      : cache(
            [this](const transport::Region&) {
              ++registered;
              return std::shared_ptr<void>();
            },
            regions) {
    for (std::size_t i = 0; i < regions; ++i)
      (void)cache.acquire(fake_region(kRegionBase + i * kRegionStride, kRegionSize));
    for (std::size_t i = 0; i < regions; ++i)
      lookups.push_back(kRegionBase + i * kRegionStride + (i * 4096) % (kRegionSize - 4096));
    std::shuffle(lookups.begin(), lookups.end(), std::mt19937_64(42));
    // A power of two of lookups, so that the timed loop indexes with a mask.
    std::size_t pow2 = 1;
    while (pow2 < lookups.size()) pow2 <<= 1;
    for (std::size_t i = lookups.size(); i < pow2; ++i) lookups.push_back(lookups[i % regions]);
  }
};

constexpr std::uint64_t kLookupLen = 4096;

// The region a lookup at `addr` must land in.
std::uint64_t region_of(std::uint64_t addr) {
  return kRegionBase + (addr - kRegionBase) / kRegionStride * kRegionStride;
}

void region_args(benchmark::internal::Benchmark* b) {
  b->ArgName("regions");
  for (long n : {1L, 64L, 4096L}) b->Arg(n);
}

void BM_RegCacheHit(benchmark::State& state) {
  FilledCache f(static_cast<std::size_t>(state.range(0)));
  if (f.cache.size() != static_cast<std::size_t>(state.range(0))) {
    state.SkipWithError("the cache does not hold every region");
    return;
  }
  const std::uint64_t before = f.registered;
  for (std::uint64_t addr : f.lookups) {
    auto reg = f.cache.acquire(fake_region(addr, kLookupLen));
    if (reg->base != region_of(addr) || reg->size != kRegionSize) {
      state.SkipWithError("acquire returned the wrong registration");
      return;
    }
  }
  const std::size_t mask = f.lookups.size() - 1;
  std::size_t i = 0;
  for (auto _ : state) {
    auto reg = f.cache.acquire(fake_region(f.lookups[i++ & mask], kLookupLen));
    benchmark::DoNotOptimize(reg.get());
  }
  if (f.registered != before) state.SkipWithError("a hit registered anew");
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_RegCacheHit)->Name("RegCacheHit")->Apply(region_args);

void BM_RegCacheFind(benchmark::State& state) {
  FilledCache f(static_cast<std::size_t>(state.range(0)));
  for (std::uint64_t addr : f.lookups) {
    auto reg = f.cache.find(addr, kLookupLen);
    if (!reg || reg->base != region_of(addr)) {
      state.SkipWithError("find returned the wrong registration");
      return;
    }
  }
  if (f.cache.find(kRegionBase + kRegionSize, kLookupLen)) {  // in the first gap
    state.SkipWithError("find found a range that is not cached");
    return;
  }
  const std::size_t mask = f.lookups.size() - 1;
  std::size_t i = 0;
  for (auto _ : state) {
    auto reg = f.cache.find(f.lookups[i++ & mask], kLookupLen);
    benchmark::DoNotOptimize(reg.get());
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_RegCacheFind)->Name("RegCacheFind")->Apply(region_args);

void BM_RegCacheMiss(benchmark::State& state) {
  const auto regions = static_cast<std::size_t>(state.range(0));
  FilledCache f(regions);
  // Fresh ranges above every cached one, each new to the cache.
  std::uint64_t next = kRegionBase + regions * kRegionStride;
  {
    const std::uint64_t before = f.registered;
    auto reg = f.cache.acquire(fake_region(next, kRegionSize));
    if (f.registered != before + 1 || reg->base != next || f.cache.size() != regions + 1) {
      state.SkipWithError("a miss did not register the range");
      return;
    }
    next += kRegionStride;
  }
  // Now idle, it is evicted by the next miss: the cache stays at regions (+1 while held).
  const std::uint64_t before = f.registered;
  for (auto _ : state) {
    auto reg = f.cache.acquire(fake_region(next, kRegionSize));
    benchmark::DoNotOptimize(reg.get());
    next += kRegionStride;
  }
  if (f.registered - before != static_cast<std::uint64_t>(state.iterations()))
    state.SkipWithError("not every miss registered");
  else if (f.cache.size() > regions + 1)
    state.SkipWithError("the cache grew past max_idle");
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_RegCacheMiss)->Name("RegCacheMiss")->Apply(region_args);

// ---------------------------------------------------------------------------------------------
// TCP frames

wire::FrameHeader sample_header() {
  wire::FrameHeader h;
  h.type = wire::FrameType::read;
  h.status = 0;
  h.msg_len = 0;
  h.req_id = 0x1234567;
  h.op_id = 0x9abcdef012345678;
  h.addr = 0x7f3a40010000;
  h.len = 2u << 20;
  for (std::size_t i = 0; i < h.token.size(); ++i) h.token[i] = static_cast<std::uint8_t>(i * 37);
  return h;
}

bool same(const wire::FrameHeader& a, const wire::FrameHeader& b) {
  return a.magic == b.magic && a.version == b.version && a.type == b.type && a.flags == b.flags &&
         a.status == b.status && a.msg_len == b.msg_len && a.req_id == b.req_id &&
         a.op_id == b.op_id && a.addr == b.addr && a.len == b.len && a.token == b.token;
}

bool round_trips(benchmark::State& state) {
  const wire::FrameHeader h = sample_header();
  const wire::HeaderBytes bytes = wire::encode(h);
  if (!same(wire::decode(bytes.data()), h)) {
    state.SkipWithError("decode(encode(h)) != h");
    return false;
  }
  if (wire::malformed(h)) {
    state.SkipWithError("malformed() refused a good header");
    return false;
  }
  wire::FrameHeader bad = h;
  bad.magic ^= 1;
  if (!wire::malformed(bad)) {
    state.SkipWithError("malformed() accepted a bad magic");
    return false;
  }
  return true;
}

void BM_FrameEncode(benchmark::State& state) {
  if (!round_trips(state)) return;
  wire::FrameHeader h = sample_header();
  for (auto _ : state) {
    benchmark::DoNotOptimize(&h);
    wire::HeaderBytes bytes = wire::encode(h);
    benchmark::DoNotOptimize(bytes.data());
    benchmark::ClobberMemory();
    ++h.req_id;
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_FrameEncode)->Name("FrameEncode");

void BM_FrameDecode(benchmark::State& state) {
  if (!round_trips(state)) return;
  wire::HeaderBytes bytes = wire::encode(sample_header());
  for (auto _ : state) {
    benchmark::DoNotOptimize(bytes.data());
    wire::FrameHeader h = wire::decode(bytes.data());
    benchmark::DoNotOptimize(&h);
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_FrameDecode)->Name("FrameDecode");

void BM_FrameDecodeCheck(benchmark::State& state) {
  if (!round_trips(state)) return;
  wire::HeaderBytes bytes = wire::encode(sample_header());
  std::size_t bad = 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(bytes.data());
    wire::FrameHeader h = wire::decode(bytes.data());
    bad += wire::malformed(h) ? 1 : 0;
    benchmark::DoNotOptimize(&h);
    benchmark::ClobberMemory();
  }
  if (bad != 0) state.SkipWithError("a good header was called malformed");
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_FrameDecodeCheck)->Name("FrameDecodeCheck");

// Counts what the connection hands up; DATA payloads go to a buffer of its own.
class CountingHandler : public wire::StreamConnection::Handler {
 public:
  wire::Sink on_frame(wire::StreamConnection&, const wire::FrameHeader& header,
                      std::string message) override {
    ++frames;
    message_bytes += message.size();
    if (header.type == wire::FrameType::data) return wire::Sink{payload.data(), 1, false, {}};
    return {};
  }
  void on_payload(wire::StreamConnection&, const wire::FrameHeader& header, std::uint64_t,
                  bool intact) override {
    payloads += intact ? 1 : 0;
    payload_bytes += header.len;
  }
  void on_sent(wire::StreamConnection&, std::uint64_t) override {}
  void on_closed(wire::StreamConnection&, const std::string& reason) override { closed = reason; }

  std::uint64_t frames = 0;
  std::uint64_t message_bytes = 0;
  std::uint64_t payloads = 0;
  std::uint64_t payload_bytes = 0;
  std::string closed;
  std::array<std::byte, 4096> payload{};
};

constexpr std::size_t kStatusMessage = 16;
constexpr std::size_t kDataPayload = 256;

// B frames: READ, STATUS with a message, DATA with a payload, in turn.
std::string frame_batch(std::size_t frames) {
  std::string out;
  for (std::size_t i = 0; i < frames; ++i) {
    wire::FrameHeader h = sample_header();
    h.req_id = i + 1;
    std::string tail;
    switch (i % 3) {
      case 0:
        h.type = wire::FrameType::read;
        break;
      case 1:
        h.type = wire::FrameType::status;
        tail.assign(kStatusMessage, 'm');
        h.msg_len = static_cast<std::uint32_t>(tail.size());
        break;
      default:
        h.type = wire::FrameType::data;
        h.len = kDataPayload;
        tail.assign(kDataPayload, 'p');
        break;
    }
    wire::HeaderBytes bytes = wire::encode(h);
    out.append(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    out += tail;
  }
  return out;
}

void BM_ConnectionParse(benchmark::State& state) {
  const auto frames = static_cast<std::size_t>(state.range(0));
  const std::string batch = frame_batch(frames);
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, fds) != 0) {
    state.SkipWithError("socketpair failed");
    return;
  }
  int sndbuf = static_cast<int>(batch.size() * 4);
  ::setsockopt(fds[1], SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof sndbuf);
  uv_loop_t loop;
  uv_loop_init(&loop);
  CountingHandler handler;
  std::string error;
  {
    // Owns fds[0]; the peer side (fds[1]) is ours to write.
    wire::StreamConnection conn(&loop, handler, wire::StreamConnection::Role::server, fds[0], 1,
                                "socketpair", std::chrono::milliseconds(60000), false,
                                wire::StreamConnection::Hello{"bench", 1}, ferry::loop::Log{});
    // The peer's HELLO first, as every connection's first frame.
    {
      wire::FrameHeader hello;
      hello.type = wire::FrameType::hello;
      const wire::HeaderBytes bytes = wire::encode(hello);
      if (::write(fds[1], bytes.data(), bytes.size()) != static_cast<ssize_t>(bytes.size()))
        error = "cannot write HELLO";
      for (int i = 0; i < 1000 && !conn.greeted(); ++i) uv_run(&loop, UV_RUN_NOWAIT);
      char drain[256];
      while (::read(fds[1], drain, sizeof drain) > 0) {
      }
    }

    // Writes one batch and runs the loop until the connection has handed all of it up.
    auto one_batch = [&]() -> bool {
      const std::uint64_t want = handler.frames + frames;
      std::size_t off = 0;
      int turns = 0;
      while (handler.frames < want) {
        if (off < batch.size()) {
          ssize_t n = ::write(fds[1], batch.data() + off, batch.size() - off);
          if (n > 0) off += static_cast<std::size_t>(n);
        }
        uv_run(&loop, UV_RUN_NOWAIT);
        if (!handler.closed.empty() || ++turns > 1000000) return false;
      }
      return true;
    };

    // Once outside the timed loop: every frame, message and payload arrives whole.
    const std::uint64_t payloads = handler.payloads;
    if (!one_batch() || handler.payloads - payloads != frames / 3 ||
        std::memcmp(handler.payload.data(), std::string(kDataPayload, 'p').data(), kDataPayload) !=
            0) {
      error = "the connection did not parse the batch: " + handler.closed;
    } else {
      for (auto _ : state) {
        if (!one_batch()) {
          error = "the connection closed: " + handler.closed;
          break;
        }
        benchmark::ClobberMemory();
      }
    }
  }  // closes fds[0] and the connection's handles
  uv_run(&loop, UV_RUN_NOWAIT);
  uv_loop_close(&loop);
  ::close(fds[1]);
  if (!error.empty()) {
    state.SkipWithError(error.c_str());
    return;
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(batch.size()));
}
BENCHMARK(BM_ConnectionParse)->Name("ConnectionParse")->ArgName("frames")->Arg(3)->Arg(48);

}  // namespace

BENCHMARK_MAIN();
