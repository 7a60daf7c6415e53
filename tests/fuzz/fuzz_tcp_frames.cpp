// libFuzzer target: both sides of ferry's TCP protocol (docs/protocol.md), through the public
// API and raw sockets on 127.0.0.1 only (docs/testing.md).
//
// The first input byte picks the side:
//   even: server side. A Connector owns a live readable and a live writable over memory with
//         canaries around it (one input in three: a readable region in the readable's place,
//         which the raw client attaches to first, then names in its requests, ENDED and DETACH
//         frames); a raw socket connects to its listener and sends a sequence of
//         frames built from the input (HELLO first most of the time; op_id, token and addr
//         taken from the live operations with some probability, so that the checks on every
//         request are reached, else made up), then reads what comes back.
//   odd:  client side. A raw listening socket plays the owner; the Connector runs begin_read or
//         begin_write against metadata that points at it, and the fake server answers its
//         frames with frames built from the input (a valid HELLO first most of the time, then
//         DATA and STATUS frames that reuse the request ids it saw, with some probability).
//
// Findings (each aborts with a message): memory outside the exposed or local ranges changed;
// a readable's memory changed; the server sent a malformed frame, or DATA that is not the
// readable's bytes at the requested range; the client sent a request outside the metadata's
// ranges, or WRITE bytes that are not its local memory; an operation that does not reach a
// final status within kFinalWithin; a server that does not close after a malformed frame; an
// exception other than ferry::Error; every kCheckEvery iterations, a well-behaved peer that
// cannot read from and write to the same connector. Plus what ASan and UBSan catch.
//
// One pair of connectors serves every iteration (created on first use), so an iteration costs
// milliseconds; every wait has a deadline. Only the public API (<ferry/ferry.hpp>) is used: the
// frame encoder below is this file's own.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <ferry/ferry.hpp>

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

// Settings of both connectors: small, so that short inputs reach the limits.
constexpr auto kPeerTimeout = 200ms;
constexpr std::uint64_t kMaxRequest = 16u << 10;  // TcpOptions::max_request
constexpr std::uint64_t kChunk = 1024;            // TcpOptions::chunk_size
constexpr std::uint64_t kWindow = 4096;           // TcpOptions::window

// Bounds of one iteration.
constexpr auto kFinalWithin = 3s;   // an operation's final status, after the fake server stops
constexpr auto kCloseWithin = 2s;   // the server's close after a malformed frame
constexpr auto kExchangeFor = 3s;   // everything the raw socket sends and reads
constexpr auto kAcceptWithin = 2s;  // the client's connection to the fake server
constexpr int kCheckEvery = 32;     // iterations between two well-behaved peers

constexpr std::uint8_t kCanary = 0xc5;
constexpr std::size_t kGuard = 64;

// ---- the wire format (docs/protocol.md), written here rather than taken from transport/ ----

constexpr std::uint32_t kMagic = 0x59525246;
constexpr std::uint8_t kVersion = 1;
constexpr std::size_t kHeaderSize = 64;
constexpr std::uint32_t kMaxMessage = 4096;
constexpr std::uint64_t kMaxReadRanges = 4096;  // wire::kMaxReadRanges

enum Type : std::uint8_t {
  HELLO = 1,
  READ = 2,
  DATA = 3,
  WRITE = 4,
  STATUS = 5,
  DONE = 6,
  CLAIMED = 7,
  ATTACH = 9,
  ATTACHED = 10,
  ENDED = 11,
  DETACH = 12,
  READ_RANGES = 13
};

using Token = std::array<std::uint8_t, 16>;

struct Header {
  std::uint32_t magic = kMagic;
  std::uint8_t version = kVersion;
  std::uint8_t type = HELLO;
  std::uint16_t flags = 0;
  std::uint32_t status = 0;
  std::uint32_t msg_len = 0;
  std::uint64_t req_id = 0;
  std::uint64_t op_id = 0;
  std::uint64_t addr = 0;
  std::uint64_t len = 0;
  Token token{};
};

template <class T>
void put_le(std::uint8_t* at, T value) {
  for (std::size_t i = 0; i < sizeof(T); ++i) at[i] = static_cast<std::uint8_t>(value >> (8 * i));
}

template <class T>
T get_le(const std::uint8_t* at) {
  T value = 0;
  for (std::size_t i = 0; i < sizeof(T); ++i) value |= static_cast<T>(T{at[i]} << (8 * i));
  return value;
}

std::array<std::uint8_t, kHeaderSize> encode(const Header& h) {
  std::array<std::uint8_t, kHeaderSize> b{};
  put_le(b.data() + 0, h.magic);
  b[4] = h.version;
  b[5] = h.type;
  put_le(b.data() + 6, h.flags);
  put_le(b.data() + 8, h.status);
  put_le(b.data() + 12, h.msg_len);
  put_le(b.data() + 16, h.req_id);
  put_le(b.data() + 24, h.op_id);
  put_le(b.data() + 32, h.addr);
  put_le(b.data() + 40, h.len);
  std::memcpy(b.data() + 48, h.token.data(), h.token.size());
  return b;
}

Header decode(const std::uint8_t* b) {
  Header h;
  h.magic = get_le<std::uint32_t>(b + 0);
  h.version = b[4];
  h.type = b[5];
  h.flags = get_le<std::uint16_t>(b + 6);
  h.status = get_le<std::uint32_t>(b + 8);
  h.msg_len = get_le<std::uint32_t>(b + 12);
  h.req_id = get_le<std::uint64_t>(b + 16);
  h.op_id = get_le<std::uint64_t>(b + 24);
  h.addr = get_le<std::uint64_t>(b + 32);
  h.len = get_le<std::uint64_t>(b + 40);
  std::memcpy(h.token.data(), b + 48, h.token.size());
  return h;
}

bool has_payload(std::uint8_t type) {
  return type == DATA || type == WRITE || type == ENDED || type == READ_RANGES;
}

// ---- findings ----

[[noreturn]] void finding(const std::string& what) {
  std::fprintf(stderr, "fuzz_tcp_frames: FINDING: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

std::string describe(const ferry::Operation& op) {
  auto e = op.error();
  return std::string(ferry::to_string(op.status())) + (e ? std::string(": ") + e->what() : "");
}

/// FERRY_FUZZ_TRACE=1 prints every frame each way and how the operations ended, to see what
/// an input does (`fuzz_tcp_frames FILE`).
bool tracing() {
  static const bool on = std::getenv("FERRY_FUZZ_TRACE") != nullptr;
  return on;
}

void trace(const char* dir, const Header& h, std::size_t msg, std::size_t payload) {
  if (!tracing()) return;
  std::fprintf(stderr,
               "  %s type %u req %llu op %016llx addr %llx len %llu flags %u status %u "
               "msg %zu payload %zu%s\n",
               dir, h.type, static_cast<unsigned long long>(h.req_id),
               static_cast<unsigned long long>(h.op_id), static_cast<unsigned long long>(h.addr),
               static_cast<unsigned long long>(h.len), h.flags, h.status, msg, payload,
               h.magic != kMagic || h.version != kVersion ? " (bad magic/version)" : "");
}

void trace(const std::string& line) {
  if (tracing()) std::fprintf(stderr, "  %s\n", line.c_str());
}

// ---- the input, read front to back; zeros once it runs out ----

class Input {
 public:
  Input(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}
  bool empty() const { return pos_ >= size_; }
  std::uint8_t u8() { return pos_ < size_ ? data_[pos_++] : 0; }
  // Little-endian; each part read in its own statement, so that the order is defined.
  std::uint16_t u16() {
    const std::uint16_t lo = u8();
    return static_cast<std::uint16_t>(lo | u8() << 8);
  }
  std::uint32_t u32() {
    const std::uint32_t lo = u16();
    return lo | std::uint32_t{u16()} << 16;
  }
  std::uint64_t u64() {
    const std::uint64_t lo = u32();
    return lo | std::uint64_t{u32()} << 32;
  }
  std::string bytes(std::size_t n) {
    n = std::min(n, size_ - std::min(pos_, size_));
    std::string s(reinterpret_cast<const char*>(data_ + pos_), n);
    pos_ += n;
    return s;
  }
  Token token() {
    Token t;
    for (auto& b : t) b = u8();
    return t;
  }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t pos_ = 0;
};

// ---- memory with canaries around it ----

/// [kGuard canary bytes][body][kGuard canary bytes]; the body holds a pattern of `seed`.
class Guarded {
 public:
  Guarded(std::size_t size, std::uint8_t seed) : size_(size), seed_(seed), mem_(size + 2 * kGuard) {
    reset();
  }
  void reset() {
    std::fill(mem_.begin(), mem_.end(), kCanary);
    for (std::size_t i = 0; i < size_; ++i) body()[i] = pattern(i);
  }
  std::uint8_t* body() { return mem_.data() + kGuard; }
  std::size_t size() const { return size_; }
  std::uint8_t pattern(std::size_t i) const {
    // Never the canary value, so that a body byte copied into a gap shows.
    auto v = static_cast<std::uint8_t>((i * 131 + seed_ * 7 + (i >> 8)) & 0xff);
    return v == kCanary ? static_cast<std::uint8_t>(v + 1) : v;
  }
  /// Whether the bytes in [from, to) of the body (may start before it or end after it, within
  /// the guards) are all canaries.
  bool canaries(std::ptrdiff_t from, std::ptrdiff_t to) const {
    for (std::ptrdiff_t i = from; i < to; ++i)
      if (mem_[static_cast<std::size_t>(static_cast<std::ptrdiff_t>(kGuard) + i)] != kCanary)
        return false;
    return true;
  }
  bool guards_intact() const {
    return canaries(-static_cast<std::ptrdiff_t>(kGuard), 0) &&
           canaries(static_cast<std::ptrdiff_t>(size_),
                    static_cast<std::ptrdiff_t>(size_ + kGuard));
  }
  bool body_intact(std::size_t from, std::size_t to) const {
    for (std::size_t i = from; i < to; ++i)
      if (mem_[kGuard + i] != pattern(i)) return false;
    return true;
  }
  void make_gap(std::size_t from, std::size_t to) {
    std::fill(mem_.begin() + static_cast<std::ptrdiff_t>(kGuard + from),
              mem_.begin() + static_cast<std::ptrdiff_t>(kGuard + to), kCanary);
  }

 private:
  std::size_t size_;
  std::uint8_t seed_;
  std::vector<std::uint8_t> mem_;
};

// ---- sockets: non-blocking, every wait bounded by a deadline ----

class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Fd& operator=(Fd&& o) noexcept {
    reset();
    fd_ = o.fd_;
    o.fd_ = -1;
    return *this;
  }
  ~Fd() { reset(); }
  int get() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  /// Closes with a reset instead of an orderly end.
  void abort() {
    if (fd_ < 0) return;
    linger l{1, 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_LINGER, &l, sizeof l);
    reset();
  }

 private:
  int fd_ = -1;
};

void set_nonblocking(int fd) { ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK); }

int ms_until(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return static_cast<int>(std::clamp<std::int64_t>(left.count(), 0, 1000));
}

std::uint16_t port_of(const std::string& address) {
  const auto colon = address.rfind(':');
  if (colon == std::string::npos || address.substr(0, colon) != "127.0.0.1")
    finding("the connector's tcp endpoint is not on 127.0.0.1: " + address);
  return static_cast<std::uint16_t>(std::stoul(address.substr(colon + 1)));
}

Fd connect_loopback(std::uint16_t port) {
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) finding(std::string("socket: ") + std::strerror(errno));
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  sa.sin_port = htons(port);
  // A loopback connect completes (or fails) at once.
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&sa), sizeof sa) != 0)
    finding(std::string("connect to the connector's listener: ") + std::strerror(errno));
  int one = 1;
  ::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  set_nonblocking(fd.get());
  return fd;
}

Fd listen_loopback(std::uint16_t& port) {
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd) finding(std::string("socket: ") + std::strerror(errno));
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof sa;
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0 ||
      ::listen(fd.get(), 4) != 0 ||
      ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&sa), &len) != 0)
    finding(std::string("fake server listener: ") + std::strerror(errno));
  port = ntohs(sa.sin_port);
  return fd;
}

// ---- reading frames off a stream ----

class Conn;
bool ends_within(const ferry::Operation& op, Clock::duration limit, Conn* drain = nullptr);

struct Frame {
  Header h;
  std::string msg;
  std::string payload;
};

/// Cuts a byte stream into frames. Only whole frames come out; a stream that ends midway
/// leaves its tail here.
class FrameReader {
 public:
  explicit FrameReader(std::uint64_t max_payload) : max_payload_(max_payload) {}

  void feed(const char* data, std::size_t n) { buf_.append(data, n); }

  /// The next whole frame; `bad` says why the stream cannot be framed any further.
  std::optional<Frame> next(std::string& bad) {
    if (buf_.size() < kHeaderSize) return std::nullopt;
    Frame f;
    f.h = decode(reinterpret_cast<const std::uint8_t*>(buf_.data()));
    if (f.h.magic != kMagic || f.h.version != kVersion || f.h.type < HELLO ||
        (f.h.type > CLAIMED && f.h.type != ATTACHED && f.h.type != READ_RANGES) ||
        f.h.msg_len > kMaxMessage) {
      bad = "malformed header: magic " + std::to_string(f.h.magic) + " version " +
            std::to_string(f.h.version) + " type " + std::to_string(f.h.type) + " msg_len " +
            std::to_string(f.h.msg_len);
      return std::nullopt;
    }
    const std::uint64_t payload = has_payload(f.h.type) ? f.h.len : 0;
    if (payload > max_payload_) {
      bad = "a frame of type " + std::to_string(f.h.type) + " announces " +
            std::to_string(payload) + " bytes of payload";
      return std::nullopt;
    }
    const std::size_t whole = kHeaderSize + f.h.msg_len + payload;
    if (buf_.size() < whole) return std::nullopt;
    f.msg = buf_.substr(kHeaderSize, f.h.msg_len);
    f.payload = buf_.substr(kHeaderSize + f.h.msg_len, payload);
    buf_.erase(0, whole);
    return f;
  }

 private:
  std::uint64_t max_payload_;
  std::string buf_;
};

/// One raw connection: sends with deadlines, and reads whatever comes back meanwhile (so that
/// the other side never stalls on a full socket), handing every whole frame to `on_frame`.
class Conn {
 public:
  using OnFrame = void (*)(void* ctx, const Frame& f);
  Conn(Fd fd, std::uint64_t max_payload, OnFrame on_frame, void* ctx, Clock::time_point deadline)
      : fd_(std::move(fd)),
        reader_(max_payload),
        on_frame_(on_frame),
        ctx_(ctx),
        deadline_(deadline) {}

  bool open() const { return static_cast<bool>(fd_) && !eof_; }
  bool eof() const { return eof_; }
  bool sendable() const { return static_cast<bool>(fd_) && !send_failed_; }
  const std::string& bad() const { return bad_; }
  Fd& fd() { return fd_; }

  /// Sends all of `data` unless the peer goes away or the deadline passes; false then.
  bool send(const void* data, std::size_t n) {
    const auto* p = static_cast<const char*>(data);
    while (n > 0 && sendable()) {
      ssize_t w = ::send(fd_.get(), p, n, MSG_NOSIGNAL);
      if (w > 0) {
        p += w;
        n -= static_cast<std::size_t>(w);
        continue;
      }
      if (w < 0 && errno == EINTR) continue;
      if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        if (Clock::now() >= deadline_) break;
        pollfd pfd{fd_.get(), POLLIN | POLLOUT, 0};
        ::poll(&pfd, 1, ms_until(deadline_));
        if (pfd.revents & (POLLIN | POLLHUP | POLLERR)) pump(0);
        continue;
      }
      send_failed_ = true;  // reset or closed by the peer
    }
    if (n > 0) send_failed_ = true;
    return n == 0;
  }

  /// Sends `h` as it is (msg_len included, which may disagree with `msg` on purpose).
  bool send_frame(const Header& h, std::string_view msg, std::string_view payload) {
    trace("->", h, msg.size(), payload.size());
    auto b = encode(h);
    return send(b.data(), b.size()) && send(msg.data(), msg.size()) &&
           send(payload.data(), payload.size());
  }

  /// Reads what arrives for up to `wait_ms` (0: only what is there), then what follows
  /// without waiting. Returns false once the peer has closed.
  bool pump(int wait_ms) {
    if (!open()) return false;
    char buf[64 << 10];
    bool waited = false;
    for (;;) {
      ssize_t r = ::recv(fd_.get(), buf, sizeof buf, 0);
      if (r > 0) {
        feed(buf, static_cast<std::size_t>(r));
        continue;
      }
      if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        eof_ = true;
        return false;
      }
      if (r < 0 && errno == EINTR) continue;
      if (waited || wait_ms <= 0) return true;
      pollfd pfd{fd_.get(), POLLIN, 0};
      ::poll(&pfd, 1, std::min(wait_ms, ms_until(deadline_)));
      waited = true;
    }
  }

  /// Reads until the peer closes or `until` passes; true if it closed.
  bool read_to_end(Clock::time_point until) {
    while (open()) {
      if (Clock::now() >= until) return false;
      pump(std::max(1, ms_until(until)));
    }
    return eof_;
  }

 private:
  void feed(const char* data, std::size_t n) {
    if (!bad_.empty()) return;  // out of frame: the rest cannot be read as frames
    reader_.feed(data, n);
    for (;;) {
      std::string bad;
      auto f = reader_.next(bad);
      if (!bad.empty()) {
        bad_ = bad;
        return;
      }
      if (!f) return;
      trace("<-", f->h, f->msg.size(), f->payload.size());
      if (!f->msg.empty()) trace("   '" + f->msg + "'");
      on_frame_(ctx_, *f);
    }
  }

  Fd fd_;
  FrameReader reader_;
  OnFrame on_frame_;
  void* ctx_;
  Clock::time_point deadline_;
  bool eof_ = false;
  bool send_failed_ = false;
  std::string bad_;
};

/// Whether `op` reaches a final status within `limit`; meanwhile reads `drain`, if given, so
/// that the operation's peer connection is not stalled by a full socket.
bool ends_within(const ferry::Operation& op, Clock::duration limit, Conn* drain) {
  const auto until = Clock::now() + limit;
  while (!ferry::is_final(op.status())) {
    if (Clock::now() >= until) return false;
    if (drain != nullptr && drain->open())
      drain->pump(2);
    else
      std::this_thread::sleep_for(1ms);
  }
  return true;
}

// ---- the connectors, made once ----

ferry::ConnectorOptions options(const char* name) {
  ferry::ConnectorOptions o;
  o.name = name;
  o.peer_timeout = kPeerTimeout;
  o.tcp.bind_address = "127.0.0.1";
  o.tcp.max_request = kMaxRequest;
  o.tcp.chunk_size = kChunk;
  o.tcp.window = kWindow;
  o.nats.use_environment = false;  // no side channel: nothing but loopback TCP
  return o;
}

std::uint64_t parse_hex(const std::string& s) { return std::stoull(s, nullptr, 16); }

bool token_of(const std::string& hex, Token& out) {
  if (hex.size() != 32) return false;
  for (std::size_t i = 0; i < out.size(); ++i)
    out[i] = static_cast<std::uint8_t>(std::stoul(hex.substr(2 * i, 2), nullptr, 16));
  return true;
}

std::string hex(std::uint64_t v, int digits) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%0*llx", digits, static_cast<unsigned long long>(v));
  return std::string(buf).substr(0, static_cast<std::size_t>(digits));
}

std::string hex(const Token& t) {
  std::string s;
  for (auto b : t) s += hex(b, 2);
  return s;
}

struct World {
  std::unique_ptr<ferry::Connector> owner;  // serves the raw client's frames
  std::unique_ptr<ferry::Connector> peer;   // talks to the fake server; the well-behaved peer
  std::uint16_t owner_port = 0;
  std::uint64_t iterations = 0;
};

World* g_world = nullptr;

World& world() {
  if (g_world == nullptr) {
    g_world = new World;
    g_world->owner = std::make_unique<ferry::Connector>(options("fuzz-owner"));
    g_world->peer = std::make_unique<ferry::Connector>(options("fuzz-peer"));
    for (const auto& e : g_world->owner->endpoints())
      if (e.method == "tcp") g_world->owner_port = port_of(e.address);
    if (g_world->owner_port == 0) finding("the owner offers no tcp endpoint");
    // Connectors stop their loops before static destructors run.
    std::atexit([] {
      delete g_world;
      g_world = nullptr;
    });
  }
  return *g_world;
}

/// A second connector reads all of a fresh readable of the owner, and writes all of a fresh
/// writable: whatever the inputs did, the owner and the peer still serve well-behaved work.
void check_well_behaved(World& w) {
  constexpr std::size_t kSize = 3 * kChunk + 17;
  Guarded src(kSize, 11), dst(kSize, 12), back(kSize, 13);
  try {
    auto readable = w.owner->create_readable({ferry::Descriptor(src.body(), kSize)});
    auto read = w.peer->begin_read(readable.metadata(), {ferry::Descriptor(dst.body(), kSize)});
    if (!read.wait_for_completion(5s) || !readable.wait_for_completion(5s))
      finding("a well-behaved read did not complete within 5 s: read " + describe(read) +
              ", readable " + describe(readable));
    if (std::memcmp(src.body(), dst.body(), kSize) != 0)
      finding("a well-behaved read brought the wrong bytes");

    auto writable = w.owner->create_writable({ferry::Descriptor(back.body(), kSize)});
    auto write = w.peer->begin_write({ferry::Descriptor(src.body(), kSize)}, writable.metadata());
    if (!write.wait_for_completion(5s) || !writable.wait_for_completion(5s))
      finding("a well-behaved write did not complete within 5 s: write " + describe(write) +
              ", writable " + describe(writable));
    if (std::memcmp(src.body(), back.body(), kSize) != 0)
      finding("a well-behaved write left the wrong bytes");
  } catch (const ferry::Error& e) {
    finding(std::string("a well-behaved peer failed: ") + e.what());
  }
  if (!src.guards_intact() || !dst.guards_intact() || !back.guards_intact())
    finding("a well-behaved transfer wrote outside its memory");
}

// ---- server side: a raw client against the owner's live operations ----

// The readable exposes its 4096 bytes as two touching descriptors (merged into one region);
// the writable exposes two descriptors with a canary gap between them that no request may
// reach.
constexpr std::size_t kReadableSize = 4096;
constexpr std::size_t kReadableSplit = 1000;
constexpr std::size_t kWritableA = 1536;
constexpr std::size_t kWritableGap = 64;
constexpr std::size_t kWritableB = 2560;
constexpr std::size_t kWritableSize = kWritableA + kWritableGap + kWritableB;

struct Live {
  std::uint64_t op_id = 0;
  Token token{};
  std::uint64_t base = 0;
  std::uint64_t size = 0;  // from base to the end of the last descriptor
};

Live live_of(const ferry::RdmaMetadata& m) {
  Live l;
  l.op_id = parse_hex(m.notification_key);
  if (!token_of(m.token, l.token)) finding("metadata token is not 32 hex digits: " + m.token);
  l.base = m.descriptors.front().ptr;
  l.size = m.descriptors.back().ptr + m.descriptors.back().size - l.base;
  return l;
}

/// A region's id and attach token, and its memory.
Live live_of(const ferry::RegionMetadata& m) {
  Live l;
  l.op_id = parse_hex(m.region_id);
  if (!token_of(m.token, l.token)) finding("region token is not 32 hex digits: " + m.token);
  l.base = m.descriptors.front().ptr;
  l.size = m.total_size();
  return l;
}

struct ReadSent {
  std::uint64_t addr, len, op_id;
  Token token;
};

struct ServerSide {
  Guarded* readable_mem = nullptr;
  Live readable;                 // in region mode: the attachment, once ATTACHED names it
  std::uint64_t attach_req = 0;  // region mode: the ATTACH's request id (0: none sent)
  bool attached = false;
  std::multimap<std::uint64_t, ReadSent> reads;  // by req_id
  Live writable;
  std::vector<bool> written = std::vector<bool>(kWritableSize);  // bytes some WRITE may have set
  std::string problem;

  /// Notes what a WRITE that was sent whole may have written (an over-estimate: the server
  /// may have refused it).
  void wrote(const Header& h) {
    if (h.op_id != writable.op_id || h.token != writable.token || h.len == 0 ||
        h.len > kMaxRequest || h.addr < writable.base || h.len > writable.size ||
        h.addr - writable.base > writable.size - h.len)
      return;
    const std::size_t off = h.addr - writable.base;
    std::fill(written.begin() + static_cast<std::ptrdiff_t>(off),
              written.begin() + static_cast<std::ptrdiff_t>(off + h.len), true);
  }
  /// Notes the ranges of a READ_RANGES the server must serve: all of them when each is inside
  /// the readable (with its id and token), 1 byte or more, and all together at most
  /// kMaxRequest; else none.
  void asked(const Header& h, const std::string& list) {
    std::vector<ReadSent> ok;
    std::uint64_t total = 0;
    for (std::size_t at = 0; at + 16 <= list.size(); at += 16) {
      const auto* b = reinterpret_cast<const std::uint8_t*>(list.data() + at);
      const auto addr = get_le<std::uint64_t>(b);
      const auto len = get_le<std::uint64_t>(b + 8);
      if (len == 0 || len > kMaxRequest - total || addr < readable.base || len > readable.size ||
          addr - readable.base > readable.size - len)
        return;
      total += len;
      ok.push_back(ReadSent{addr, len, h.op_id, h.token});
    }
    for (const ReadSent& r : ok) reads.emplace(h.req_id, r);
  }
  bool all_written() const {
    for (std::size_t i = 0; i < kWritableSize; ++i)
      if (!written[i] && (i < kWritableA || i >= kWritableA + kWritableGap)) return false;
    return true;
  }

  static void on_frame(void* ctx, const Frame& f) { static_cast<ServerSide*>(ctx)->check(f); }

  // Every frame from the server: a type a server sends; DATA only for a READ that carried the
  // readable's id and token within its memory, and holding exactly that memory's bytes.
  void check(const Frame& f) {
    if (!problem.empty()) return;
    if (f.h.type != HELLO && f.h.type != DATA && f.h.type != STATUS && f.h.type != CLAIMED &&
        f.h.type != ATTACHED) {
      problem = "the server sent a frame of client type " + std::to_string(f.h.type);
      return;
    }
    if (f.h.type == ATTACHED) {
      // Only the ATTACH this side sent with the region's id and token may be answered so, once.
      if (attach_req == 0 || f.h.req_id != attach_req || attached || !f.payload.empty()) {
        problem = "the server sent ATTACHED for request " + std::to_string(f.h.req_id) +
                  ", which is no ATTACH with the region's token";
        return;
      }
      attached = true;
      readable.op_id = f.h.op_id;
      readable.token = f.h.token;
      return;
    }
    // A claim names one of the two live operations (never one the client guessed wrong).
    if (f.h.type == CLAIMED && f.h.op_id != readable.op_id && f.h.op_id != writable.op_id) {
      problem = "the server sent CLAIMED for operation " + std::to_string(f.h.op_id) +
                ", which it does not serve";
      return;
    }
    if (f.h.type != DATA) return;
    auto [from, to] = reads.equal_range(f.h.req_id);
    for (auto it = from; it != to; ++it) {
      const ReadSent& r = it->second;
      if (r.op_id != readable.op_id || r.token != readable.token) continue;
      if (r.addr != f.h.addr || r.len != f.payload.size() || r.addr < readable.base ||
          r.len > readable.size || r.addr - readable.base > readable.size - r.len)
        continue;
      const std::size_t off = r.addr - readable.base;
      bool same = true;
      for (std::size_t i = 0; i < r.len && same; ++i)
        same = static_cast<std::uint8_t>(f.payload[i]) == readable_mem->pattern(off + i);
      if (same) return;
    }
    problem = "DATA for request " + std::to_string(f.h.req_id) + " (" +
              std::to_string(f.payload.size()) +
              " bytes) answers no READ of the readable's memory with its token, or carries other "
              "bytes than that memory's";
  }
};

/// What a frame's fields should be, chosen by the input.
Header request_header(Input& in, std::uint8_t type, const Live& target, const Live& other,
                      bool writable_target) {
  Header h;
  h.type = type;
  const std::uint8_t c = in.u8();
  switch ((c >> 1) & 3) {
    case 0:
    case 1:
      h.op_id = target.op_id;
      h.token = target.token;
      break;
    case 2:  // the right id with one bit of the token wrong
      h.op_id = target.op_id;
      h.token = target.token;
      {
        const std::size_t byte = in.u8() % 16u;
        h.token[byte] ^= static_cast<std::uint8_t>(1u << (in.u8() % 8));
      }
      break;
    default:  // made up, or the other operation's token
      if (in.u8() % 2 == 0) {
        h.op_id = target.op_id;
        h.token = other.token;
      } else {
        h.op_id = in.u64();
        h.token = in.token();
      }
      break;
  }
  switch ((c >> 3) & 7) {
    case 0:
    case 1:
    case 2:
      h.addr = target.base + in.u16() % (target.size + 1);
      break;
    case 3:
      h.addr = target.base - (in.u8() + 1u);
      break;
    case 4:
      h.addr = target.base + target.size - in.u8();
      break;
    case 5:
      h.addr = in.u64();
      break;
    case 6:  // into the writable's gap (for the readable: just past its end)
      h.addr = writable_target ? target.base + kWritableA + in.u8() % kWritableGap
                               : target.base + target.size;
      break;
    default:
      h.addr = 0;
      break;
  }
  switch (c >> 6) {
    case 0:
    case 1:
      h.len = in.u16() % (target.size + 2);
      break;
    case 2:
      h.len = kMaxRequest + in.u8() % 3 - 1;
      break;
    default:
      h.len = in.u64();
      break;
  }
  return h;
}

/// Region mode's ATTACH: the region's id and token (flags from the input: 1 is the read the
/// region allows, 2 and 3 ask for more and are refused, 0 is no access at all).
Header attach_header(Input& in, const Live& region, std::uint64_t req_id) {
  Header h;
  h.type = ATTACH;
  h.req_id = req_id;
  h.op_id = region.op_id;
  h.token = region.token;
  h.flags = static_cast<std::uint16_t>(in.u8() % 8 < 6 ? 1 : in.u8() % 4);
  return h;
}

/// An ENDED's payload: (addr, len) pairs, mostly inside the region, some not.
std::string ended_ranges(Input& in, const Live& region) {
  std::string payload;
  const int n = in.u8() % 5;
  for (int i = 0; i < n; ++i) {
    std::uint8_t pair[16];
    std::uint64_t addr = region.base + in.u16() % (region.size + 1);
    std::uint64_t len = in.u16() % (region.size + 1);
    if (in.u8() % 4 == 0) {
      addr = in.u64();
      len = in.u64();
    }
    put_le(pair, addr);
    put_le(pair + 8, len);
    payload.append(reinterpret_cast<const char*>(pair), sizeof pair);
  }
  return payload;
}

void server_side(Input& in, World& w, bool region_mode) {
  static Guarded readable_mem(kReadableSize, 1);
  static Guarded writable_mem(kWritableSize, 2);
  static Guarded region_mem(kReadableSize, 3);
  // The previous iteration's operations are gone (their handles cancelled them on the way
  // out), so nothing touches this memory any more.
  readable_mem.reset();
  writable_mem.reset();
  writable_mem.make_gap(kWritableA, kWritableA + kWritableGap);
  region_mem.reset();

  auto readable = w.owner->create_readable(
      {ferry::Descriptor(readable_mem.body(), kReadableSplit),
       ferry::Descriptor(readable_mem.body() + kReadableSplit, kReadableSize - kReadableSplit)});
  auto writable = w.owner->create_writable(
      {ferry::Descriptor(writable_mem.body(), kWritableA),
       ferry::Descriptor(writable_mem.body() + kWritableA + kWritableGap, kWritableB)});
  Live live[2] = {live_of(readable.metadata()), live_of(writable.metadata())};
  // Region mode: a readable region over region_mem (blocks of 512 bytes) stands in for the
  // readable: the raw client attaches, and its requests name the attachment (or, when the
  // attach failed, the region's own id and token, which serve nothing but ATTACH).
  std::optional<ferry::Region> region;
  if (region_mode) {
    ferry::RegionOptions ro;
    ro.access = ferry::RegionAccess::read;
    ro.block_size = 512;
    ro.max_queued_events = 64;
    region = w.owner->create_region({ferry::Descriptor(region_mem.body(), kReadableSize)}, ro);
    live[0] = live_of(region->metadata());
  }

  ServerSide side;
  side.readable_mem = region_mode ? &region_mem : &readable_mem;
  side.readable = live[0];
  // Region mode: no DATA may answer a READ until ATTACHED names the attachment (the region's
  // own id and token serve nothing but ATTACH).
  if (region_mode) side.readable.op_id = 0;
  side.writable = live[1];
  const auto deadline = Clock::now() + kExchangeFor;
  Conn conn(connect_loopback(w.owner_port), kMaxRequest, &ServerSide::on_frame, &side, deadline);

  bool in_frame = true;     // the server reads our bytes as the frames we meant
  bool must_close = false;  // we sent what the server must answer by closing
  if (in.u8() % 8 < 6) {
    Header h;
    h.type = HELLO;
    h.op_id = in.u64();
    const std::string name = in.bytes(in.u8() % 48);
    h.msg_len = static_cast<std::uint32_t>(name.size());
    conn.send_frame(h, name, {});
  }
  if (region_mode) {
    side.attach_req = 200 + in.u8();
    conn.send_frame(attach_header(in, live[0], side.attach_req), {}, {});
    // The answer before the requests that use it (bounded: a refusal or a close ends it too).
    const auto until = Clock::now() + 1s;
    while (!side.attached && conn.open() && Clock::now() < until) conn.pump(10);
    if (side.attached) live[0] = side.readable;
  }
  const int frames = in.u8() % 24;
  // The input is read the same way whatever the server does (a send to a closed connection
  // just fails), so that an input replays the same frames.
  for (int i = 0; i < frames && in_frame && !must_close; ++i) {
    // Region mode adds ENDED, DETACH and READ_RANGES (on the attachment, or made up).
    static constexpr std::uint8_t kTypes[] = {READ, READ,  READ,   WRITE,      WRITE,  WRITE,
                                              DONE, DONE,  HELLO,  DATA,       STATUS, 0,
                                              7,    ENDED, DETACH, READ_RANGES};
    const auto pick = static_cast<std::uint8_t>(in.u8() % (region_mode ? 16 : 13));
    const std::uint8_t type = kTypes[pick];
    const bool writable_target = in.u8() % 2 == 1;
    const Live& target = live[writable_target ? 1 : 0];
    Header h = request_header(in, type, target, live[writable_target ? 0 : 1], writable_target);
    h.req_id = in.u8();
    if (type == 0) {  // raw bytes: the stream is no longer in frame
      std::string raw = in.bytes(in.u8());
      conn.send(raw.data(), raw.size());
      in_frame = false;
      break;
    }
    if (type == 7) {
      // A type no client sends a tcp server: the same-host and server-side ones (7, 8, 10),
      // and those no ferry knows (14 and up). ATTACH, ENDED, DETACH and READ_RANGES (9, 11,
      // 12, 13) are a client's, and served: the server does not close for them.
      const std::uint8_t v = in.u8() % 245;
      static constexpr std::uint8_t kNotServed[] = {7, 8, 10};
      h.type = v < 3 ? kNotServed[v] : static_cast<std::uint8_t>(14 + (v - 3));
    }
    if (type == DONE) {
      h.flags = static_cast<std::uint16_t>(in.u8() % 4);
      h.status = in.u8() % 4 == 0 ? in.u8() % 18u : 0u;
    }
    if (type == STATUS) h.status = in.u8();
    std::string ranges;
    if (type == ENDED) {
      h.flags = static_cast<std::uint16_t>(in.u8() % 4);
      h.status = in.u8() % 4 == 0 ? in.u8() % 18u : 0u;
      ranges = ended_ranges(in, live[0]);
      h.len = in.u8() % 8 == 0 ? in.u16() % 80 : ranges.size();
    }
    if (type == READ_RANGES) {
      ranges = ended_ranges(in, target);
      h.addr = 0;
      h.len = in.u8() % 8 == 0 ? in.u16() % 80 : ranges.size();
    }
    std::string msg = in.bytes(in.u8() % 64);
    h.msg_len = static_cast<std::uint32_t>(msg.size());
    std::string payload;
    bool truncate = false;
    switch (in.u8() % 16) {
      case 0:
        h.magic ^= 1u << (in.u8() % 32);
        must_close = true;
        break;
      case 1:
        h.version = static_cast<std::uint8_t>(h.version + 1 + in.u8() % 255);
        must_close = true;
        break;
      case 2:
        h.msg_len = kMaxMessage + 1 + in.u16();
        msg.clear();
        must_close = true;
        break;
      case 3:
        truncate = true;
        break;
      default:
        break;
    }
    if (type == 7) must_close = true;
    if (has_payload(h.type) && !must_close) {
      // A WRITE larger than max_request cannot be skipped: the server ends the connection.
      if (h.len > kMaxRequest) {
        must_close = h.type == WRITE || h.type == DATA;
      } else {
        payload.assign(static_cast<std::size_t>(h.len), static_cast<char>(in.u8()));
        // An ENDED's or READ_RANGES's payload starts with its ranges (as many bytes of them as
        // h.len takes).
        if (h.type == ENDED || h.type == READ_RANGES)
          std::copy_n(ranges.begin(), std::min(ranges.size(), payload.size()), payload.begin());
        if (truncate) {
          payload.resize(in.u16() % (payload.size() + 1));
          in_frame = false;
        }
      }
    }
    if (h.type == READ) side.reads.emplace(h.req_id, ReadSent{h.addr, h.len, h.op_id, h.token});
    // A list the server cannot take ends the connection; one with a range it refuses moves no
    // byte (no DATA may answer it); the others are answered range by range.
    if (h.type == READ_RANGES && !must_close && in_frame) {
      if (h.len == 0 || h.len % 16 != 0 || h.len > kMaxReadRanges * 16)
        must_close = true;
      else
        side.asked(h, payload);
    }
    if (conn.send_frame(h, msg, payload) && h.type == WRITE && in_frame && !must_close)
      side.wrote(h);
    if (in.u8() % 4 == 0) conn.pump(1);
  }

  const std::uint8_t ending = in.u8() % 4;
  if (must_close) {
    // A bad magic, version, type or text length ends the connection (after a notice).
    if (!conn.read_to_end(Clock::now() + kCloseWithin) && conn.bad().empty() && conn.sendable())
      finding("the server did not close within 2 s after a malformed frame");
  } else if (in_frame && ending < 2 && conn.sendable()) {
    // A bad magic behind everything: the server answers what came before, sends a notice and
    // closes, so reading to the end sees every answer.
    Header probe;
    probe.magic = 0;
    conn.send_frame(probe, {}, {});
    if (!conn.read_to_end(Clock::now() + kCloseWithin) && conn.bad().empty() && conn.sendable())
      finding("the server did not close within 2 s after a frame with a bad magic");
  } else if (ending == 3 && conn.sendable()) {
    ::shutdown(conn.fd().get(), SHUT_WR);
    conn.read_to_end(Clock::now() + 500ms);
  } else if (ending == 2) {
    conn.fd().abort();
  } else {
    conn.pump(1);
  }
  conn.fd().reset();

  if (!conn.bad().empty()) finding("the server's stream: " + conn.bad());
  if (!side.problem.empty()) finding(side.problem);
  // Cancel both (no effect on an operation that has ended): from here on nothing may touch
  // the memory, so the checks below see its final state.
  trace("server side: readable " + describe(readable) + "; writable " + describe(writable) +
        (conn.eof() ? "; the server closed" : ""));
  readable.cancel();
  writable.cancel();
  // Closing the region returns once no request of the attachment touches its memory.
  if (region) region->close();
  if (!region_mem.guards_intact() || !region_mem.body_intact(0, kReadableSize))
    finding("the region's memory (readable only) or the bytes around it changed");
  // docs/protocol.md: a writable refuses DONE with success until every byte it exposes has
  // been written.
  if (writable.status() == ferry::OperationStatus::complete && !side.all_written())
    finding("the writable completed although some of its bytes were never written");
  if (!readable_mem.guards_intact() || !readable_mem.body_intact(0, kReadableSize))
    finding("the readable's memory or the bytes around it changed");
  if (!writable_mem.guards_intact()) finding("the bytes around the writable's memory changed");
  if (!writable_mem.canaries(kWritableA, kWritableA + kWritableGap))
    finding("the gap between the writable's two descriptors was written");
}

// ---- client side: the connector against a fake server ----

struct RemoteDesc {
  std::uint64_t ptr, size;
};

struct ClientSide {
  bool writing = false;
  std::vector<RemoteDesc> remote;
  std::vector<std::pair<std::uint8_t*, std::size_t>> local;  // the local stream
  std::uint64_t op_id = 0;
  Token token{};
  struct Request {
    std::uint64_t req_id, addr, len;
    std::uint8_t type;
  };
  std::vector<Request> requests;
  int hellos = 0;
  std::string problem;

  static void on_frame(void* ctx, const Frame& f) { static_cast<ClientSide*>(ctx)->check(f); }

  /// Offset in the byte stream of remote bytes [addr, addr + len), if they lie within the
  /// remote descriptors, crossing only from one descriptor into the next where they touch.
  std::optional<std::uint64_t> stream_offset(std::uint64_t addr, std::uint64_t len) const {
    std::uint64_t before = 0;
    for (std::size_t i = 0; i < remote.size(); ++i) {
      const RemoteDesc& d = remote[i];
      if (addr >= d.ptr && addr - d.ptr < d.size) {
        std::uint64_t start = before + (addr - d.ptr);
        std::uint64_t left = len;
        std::uint64_t room = d.size - (addr - d.ptr);
        std::size_t j = i;
        while (left > room) {
          left -= room;
          if (j + 1 >= remote.size() || remote[j + 1].ptr != remote[j].ptr + remote[j].size)
            return std::nullopt;
          ++j;
          room = remote[j].size;
        }
        return start;
      }
      before += d.size;
    }
    return std::nullopt;
  }

  std::uint8_t local_byte(std::uint64_t at) const {
    for (const auto& [p, n] : local) {
      if (at < n) return p[at];
      at -= n;
    }
    return 0;
  }

  // Every frame from the client: HELLO first, then READ (or READ_RANGES) or WRITE (as the
  // operation's kind) within the metadata's ranges with its id and token, WRITE bytes that
  // are its own memory's, and DONE.
  void check(const Frame& f) {
    if (!problem.empty()) return;
    const std::uint8_t want = writing ? WRITE : READ;
    if (f.h.type == HELLO) {
      if (++hellos > 1) problem = "the client sent HELLO twice";
      return;
    }
    if (hellos == 0) {
      problem = "the client's first frame is not HELLO";
      return;
    }
    // A connection notice (STATUS with req_id 0) before the client closes the connection on
    // a protocol error: the connection code of both roles sends it.
    if (f.h.type == STATUS && f.h.req_id == 0) return;
    if (f.h.type != want && f.h.type != DONE && (writing || f.h.type != READ_RANGES)) {
      problem = "the client sent a frame of type " + std::to_string(f.h.type);
      return;
    }
    if (f.h.op_id != op_id || f.h.token != token) {
      problem = "the client's request carries another operation's id or token";
      return;
    }
    if (f.h.type == READ_RANGES) {
      // Its ranges, each answered on its own (a DATA naming its address): noted as READs of
      // the same request id. At least two, all within the metadata, a chunk at most in all.
      if (f.payload.size() < 32 || f.payload.size() % 16 != 0 ||
          f.payload.size() > kMaxReadRanges * 16) {
        problem = "the client sent READ_RANGES of " + std::to_string(f.payload.size()) + " bytes";
        return;
      }
      std::uint64_t total = 0;
      for (std::size_t at = 0; at < f.payload.size(); at += 16) {
        const auto* b = reinterpret_cast<const std::uint8_t*>(f.payload.data() + at);
        const auto addr = get_le<std::uint64_t>(b);
        const auto len = get_le<std::uint64_t>(b + 8);
        total += len;
        if (len == 0 || total > kChunk || !stream_offset(addr, len)) {
          problem = "the client's READ_RANGES names [" + std::to_string(addr) + ", +" +
                    std::to_string(len) +
                    "), empty, outside the metadata's descriptors or past "
                    "a chunk in all";
          return;
        }
        requests.push_back({f.h.req_id, addr, len, READ});
      }
      return;
    }
    if (f.h.type == DONE) {  // answered by STATUS like the requests
      requests.push_back({f.h.req_id, 0, 0, f.h.type});
      return;
    }
    if (f.h.len == 0 || f.h.len > kChunk) {
      problem = "the client asked for " + std::to_string(f.h.len) + " bytes at once";
      return;
    }
    auto at = stream_offset(f.h.addr, f.h.len);
    if (!at) {
      problem = "the client's request [" + std::to_string(f.h.addr) + ", +" +
                std::to_string(f.h.len) + ") is outside the metadata's descriptors";
      return;
    }
    if (writing) {
      for (std::size_t i = 0; i < f.payload.size(); ++i)
        if (static_cast<std::uint8_t>(f.payload[i]) != local_byte(*at + i)) {
          problem = "the client's WRITE carries bytes that are not its local memory's";
          return;
        }
    }
    requests.push_back({f.h.req_id, f.h.addr, f.h.len, f.h.type});
  }
};

std::string metadata_json(const ClientSide& c, std::uint64_t owner_id, std::uint16_t port) {
  std::string descs;
  for (const auto& d : c.remote)
    descs += std::string(descs.empty() ? "" : ",") + R"({"device":"host","ptr":)" +
             std::to_string(d.ptr) + R"(,"size":)" + std::to_string(d.size) + "}";
  return std::string(R"({"version":1,"operation_kind":")") + (c.writing ? "write" : "read") +
         R"(","notification_key":")" + hex(c.op_id, 16) +
         R"(","owner":{"name":"fake-owner","id":")" + hex(owner_id, 16) +
         R"(","host":"fuzz","pid":1},"endpoints":[{"method":"tcp","address":"127.0.0.1:)" +
         std::to_string(port) + R"("}],"descriptors":[)" + descs + R"(],"token":")" + hex(c.token) +
         R"("})";
}

void client_side(Input& in, World& w) {
  ClientSide side;
  side.writing = in.u8() % 2 == 1;
  const std::size_t total = 1 + in.u16() % (6 * kChunk);

  // Local memory: one descriptor, or two with a canary gap between them.
  Guarded mem(total + 32, 3);
  std::size_t split = total;
  if (total > 1 && in.u8() % 2 == 1) split = 1 + in.u16() % (total - 1);
  std::vector<ferry::Descriptor> local{ferry::Descriptor(mem.body(), split)};
  side.local.emplace_back(mem.body(), split);
  if (split < total) {
    mem.make_gap(split, split + 32);
    local.emplace_back(mem.body() + split + 32, total - split);
    side.local.emplace_back(mem.body() + split + 32, total - split);
  } else {
    mem.make_gap(total, total + 32);
  }

  // Remote descriptors: 1 to 3, adjacent or apart, somewhere in a made-up address space.
  const int count = 1 + in.u8() % 3;
  std::uint64_t ptr = 0x10000 + (std::uint64_t{in.u32()} << 12);
  std::uint64_t left = total;
  for (int i = 0; i < count && left > 0; ++i) {
    std::uint64_t size = i + 1 == count ? left : 1 + in.u16() % left;
    side.remote.push_back({ptr, size});
    ptr += size + (in.u8() % 2 == 0 ? 0 : 1 + in.u8());
    left -= size;
  }
  if (left > 0) side.remote.back().size += left;
  side.op_id = in.u64();
  side.token = in.token();
  const std::uint64_t owner_id = in.u64();

  std::uint16_t port = 0;
  Fd listener = listen_loopback(port);
  ferry::Operation op;
  try {
    auto meta = ferry::RdmaMetadata::from_json(metadata_json(side, owner_id, port));
    if (side.writing)
      op = w.peer->begin_write(local, meta);
    else
      op = w.peer->begin_read(meta, local);
  } catch (const ferry::Error& e) {
    finding(std::string("begin_* refused metadata made to be valid: ") + e.what());
  }

  // The client connects at once; accept it within a bound.
  Fd accepted;
  for (auto until = Clock::now() + kAcceptWithin; !accepted && Clock::now() < until;) {
    pollfd pfd{listener.get(), POLLIN, 0};
    ::poll(&pfd, 1, ms_until(until));
    accepted = Fd(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
  }
  listener.reset();
  if (!accepted) {
    if (!ends_within(op, kFinalWithin))
      finding("the client neither connected nor ended: " + describe(op));
    return;
  }

  const auto deadline = Clock::now() + kExchangeFor;
  Conn conn(std::move(accepted), kChunk, &ClientSide::on_frame, &side, deadline);

  const std::uint8_t opening = in.u8() % 8;
  if (opening < 6) {
    Header h;
    h.type = HELLO;
    h.op_id = owner_id;
    const std::string name = in.bytes(in.u8() % 48);
    h.msg_len = static_cast<std::uint32_t>(name.size());
    conn.send_frame(h, name, {});
  } else if (opening == 6) {
    Header h;  // a refusal instead of HELLO
    h.type = STATUS;
    h.status = in.u8() % 18u;
    const std::string name = in.bytes(in.u8() % 48);
    h.msg_len = static_cast<std::uint32_t>(name.size());
    conn.send_frame(h, name, {});
  }
  // Let the first requests arrive, so that the answers can name them.
  for (auto until = Clock::now() + 100ms;
       side.requests.empty() && conn.open() && side.problem.empty() && Clock::now() < until;)
    conn.pump(5);

  const int answers = in.u8() % 24;
  for (int i = 0; i < answers; ++i) {
    conn.pump(1);
    const std::uint8_t kind = in.u8() % 10;
    const std::uint8_t r = in.u8();
    Header h;
    std::uint64_t want_len = 0;
    if ((r & 3) != 3 && !side.requests.empty()) {
      const auto& req = side.requests[(r >> 2) % side.requests.size()];
      h.req_id = req.req_id;
      h.addr = req.addr;
      want_len = req.len;
    } else {
      h.req_id = (r & 4) ? in.u64() : in.u8();
    }
    std::string payload;
    bool truncate = false;
    if (kind <= 3) {
      h.type = DATA;
      switch (in.u8() % 4) {
        case 0:
        case 1:
        case 2:
          h.len = want_len;
          break;
        default:
          h.len = in.u8() % 2 == 0 ? in.u16() % (kMaxRequest + 2) : in.u64();
          break;
      }
    } else if (kind <= 6) {
      h.type = STATUS;
      h.status = in.u8() % 3 == 0 ? in.u8() % 18u : 0u;
    } else if (kind == 7) {
      h.type = HELLO;
    } else if (kind == 8) {
      static constexpr std::uint8_t kClientTypes[] = {READ, WRITE, DONE, 0};
      h.type = kClientTypes[in.u8() % 4];
      if (h.type == 0) h.type = static_cast<std::uint8_t>(8 + in.u8() % 248);
      h.len = in.u16() % 64;
    } else {
      std::string raw = in.bytes(in.u8());
      conn.send(raw.data(), raw.size());
      break;  // out of frame
    }
    std::string msg = in.bytes(in.u8() % 32);
    h.msg_len = static_cast<std::uint32_t>(msg.size());
    switch (in.u8() % 16) {
      case 0:
        h.magic ^= 1u << (in.u8() % 32);
        break;
      case 1:
        h.version = static_cast<std::uint8_t>(h.version + 1 + in.u8() % 255);
        break;
      case 2:
        h.msg_len = kMaxMessage + 1 + in.u16();
        msg.clear();
        break;
      case 3:
        truncate = true;
        break;
      default:
        break;
    }
    if (has_payload(h.type) && h.len <= kMaxRequest) {
      payload.assign(static_cast<std::size_t>(h.len), static_cast<char>(in.u8()));
      if (truncate) payload.resize(in.u16() % (payload.size() + 1));
    }
    conn.send_frame(h, msg, payload);
    if (truncate) break;
  }

  // The fake server stops: it closes, resets, goes silent, or half-closes. Either way the
  // operation must end within a bound (a closed peer at once, a silent one by peer_timeout).
  const char* stop = "";
  switch (in.u8() % 4) {
    case 0:
      stop = "closed its connection";
      conn.fd().reset();
      break;
    case 1:
      stop = "reset its connection";
      conn.fd().abort();
      break;
    case 2:
      stop = "went silent";
      break;
    default:
      stop = "shut down its sending side";
      ::shutdown(conn.fd().get(), SHUT_WR);
      break;
  }
  const bool ended = ends_within(op, kFinalWithin, conn.open() ? &conn : nullptr);
  const std::string state = describe(op);  // before the close below ends it
  conn.fd().reset();
  trace(std::string("client side: ") + (side.writing ? "write " : "read ") + state);
  if (!ended) finding("the operation is still " + state + " 3 s after the fake server " + stop);
  if (!side.problem.empty()) finding(side.problem);
  if (!conn.bad().empty()) finding("the client's stream: " + conn.bad());

  op = ferry::Operation();  // gone: nothing touches the local memory any more
  if (!mem.guards_intact()) finding("the bytes around the local memory changed");
  if (!mem.canaries(static_cast<std::ptrdiff_t>(split), static_cast<std::ptrdiff_t>(split + 32)))
    finding("the gap between the local descriptors was written");
  if (side.writing && !(mem.body_intact(0, split) && mem.body_intact(split + 32, total + 32)))
    finding("a write changed its own source memory");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Input in(data, size);
  World& w = world();
  try {
    const std::uint8_t side = in.u8();
    if (side % 2 == 0)
      server_side(in, w, (side >> 1) % 3 == 1);  // region mode: 2, 8, 14, ...
    else
      client_side(in, w);
    if (w.iterations++ % kCheckEvery == 0) check_well_behaved(w);
  } catch (const ferry::Error& e) {
    finding(std::string("unexpected ferry::Error: ") + e.what());
  } catch (const std::exception& e) {
    finding(std::string("an exception that is not a ferry::Error: ") + e.what());
  }
  return 0;
}
