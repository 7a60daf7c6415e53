// StreamConnection's reading: frames cut from its read-ahead buffer, payloads read straight
// into their sinks, and a server's backlog that stops reading without stranding what was read
// ahead. One end is a StreamConnection on a private loop, the other a raw socket of the test.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <uv.h>

#include "tests/transport/wire/frame_bytes.hpp"
#include "transport/wire/stream_connection.hpp"

namespace ferry::transport::wire {
namespace {

using namespace std::chrono_literals;

std::string frame(FrameType type, std::uint64_t req_id, const std::string& message = {},
                  const std::string& payload = {}) {
  return test::frame_bytes(type, req_id, message, payload);
}

std::string hello() { return frame(FrameType::hello, 0, "raw"); }

std::string payload_of(std::size_t size, char seed) {
  std::string s(size, '\0');
  for (std::size_t i = 0; i < size; ++i)
    s[i] = static_cast<char>(seed + static_cast<char>(i % 251));
  return s;
}

/// The StreamConnection side: records every frame; answers each READ with a STATUS when
/// `answer` is set.
struct Recorder : StreamConnection::Handler {
  struct Seen {
    FrameType type;
    std::uint64_t req_id;
    std::string message;
    std::string payload;
    bool intact = false;
  };
  std::vector<Seen> seen;
  std::string buffer;
  bool answer = false;
  std::string closed;

  Sink on_frame(StreamConnection& conn, const FrameHeader& h, std::string message) override {
    seen.push_back({h.type, h.req_id, std::move(message), {}, false});
    if (answer && h.type == FrameType::read) reply(conn, h.req_id, nullptr);
    Sink s;
    if (has_payload(h.type)) {
      buffer.assign(h.len, '\0');
      s.dest = reinterpret_cast<std::byte*>(buffer.data());
    }
    return s;
  }
  void on_payload(StreamConnection&, const FrameHeader&, std::uint64_t, bool intact) override {
    seen.back().intact = intact;
    if (intact) seen.back().payload = buffer;
  }
  void on_sent(StreamConnection&, std::uint64_t) override {}
  void on_closed(StreamConnection&, const std::string& reason) override { closed = reason; }
};

class StreamReading : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(uv_loop_init(&loop_), 0);
    int fds[2];
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, fds), 0);
    raw_ = fds[1];
    // The raw end blocks: the test writes whole streams and reads whole answers.
    ::fcntl(raw_, F_SETFL, ::fcntl(raw_, F_GETFL) & ~O_NONBLOCK);
    conn_ = std::make_unique<StreamConnection>(&loop_, recorder_, StreamConnection::Role::server,
                                               fds[0], 1, "raw", 10s, false,
                                               StreamConnection::Hello{"server", 7}, loop::Log());
  }
  void TearDown() override {
    conn_.reset();
    uv_run(&loop_, UV_RUN_NOWAIT);
    uv_loop_close(&loop_);
    if (raw_ >= 0) ::close(raw_);
  }

  void write_raw(const std::string& bytes) {
    std::size_t at = 0;
    while (at < bytes.size()) {
      const ssize_t n = ::write(raw_, bytes.data() + at, bytes.size() - at);
      ASSERT_GT(n, 0);
      at += static_cast<std::size_t>(n);
    }
  }

  /// Turns the loop until `done`, for at most 20 s.
  template <typename Pred>
  bool turn_until(Pred done) {
    const auto until = std::chrono::steady_clock::now() + 20s;
    while (!done() && std::chrono::steady_clock::now() < until) {
      uv_run(&loop_, UV_RUN_NOWAIT);
      if (!done()) std::this_thread::sleep_for(100us);
    }
    return done();
  }

  uv_loop_t loop_{};
  Recorder recorder_;
  int raw_ = -1;
  std::unique_ptr<StreamConnection> conn_;
};

TEST_F(StreamReading, ManySmallFramesInOneWriteArriveInOrderWithTheirTexts) {
  std::string stream = hello();
  for (std::uint64_t i = 1; i <= 3000; ++i)
    stream += frame(FrameType::read, i, i % 3 == 0 ? "text " + std::to_string(i) : "");
  write_raw(stream);
  ASSERT_TRUE(turn_until([&] { return recorder_.seen.size() == 3000; }))
      << recorder_.seen.size() << " frames";
  for (std::uint64_t i = 1; i <= 3000; ++i) {
    const auto& s = recorder_.seen[i - 1];
    ASSERT_EQ(s.req_id, i);
    ASSERT_EQ(s.message, i % 3 == 0 ? "text " + std::to_string(i) : "");
  }
  EXPECT_TRUE(recorder_.closed.empty()) << recorder_.closed;
}

TEST_F(StreamReading, PayloadsSmallAndLargeLandWholeWhereverTheReadsCut) {
  // Small payloads come out of the read-ahead buffer, large ones partly from it and the rest
  // straight into the sink; sizes around the buffer's 64 KiB and the 16 KiB direct threshold.
  const std::vector<std::size_t> sizes = {0,     1,     63,    4096,   16383,    16384, 16385,
                                          65471, 65536, 65537, 200000, 1u << 20, 7,     131072 + 5};
  std::string stream = hello();
  for (std::size_t i = 0; i < sizes.size(); ++i)
    stream += frame(FrameType::write, i + 1, "w", payload_of(sizes[i], static_cast<char>(i)));
  // Written in pieces of awkward sizes, so that headers and payloads straddle the reads.
  std::thread writer([&] {
    std::size_t at = 0;
    for (std::size_t piece = 1; at < stream.size(); piece = piece * 3 + 7) {
      const std::size_t n = std::min(piece % 70001 + 1, stream.size() - at);
      write_raw(stream.substr(at, n));
      at += n;
    }
  });
  const bool all = turn_until(
      [&] { return recorder_.seen.size() == sizes.size() && recorder_.seen.back().intact; });
  if (!all) ::shutdown(raw_, SHUT_RDWR);  // a writer stuck on a full socket gives up
  writer.join();
  ASSERT_TRUE(all) << recorder_.seen.size() << " frames";
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_EQ(recorder_.seen[i].req_id, i + 1);
    EXPECT_TRUE(recorder_.seen[i].intact) << i;
    EXPECT_TRUE(recorder_.seen[i].payload == payload_of(sizes[i], static_cast<char>(i)))
        << "payload " << i << " of " << sizes[i] << " bytes differs";
  }
}

TEST_F(StreamReading, ABackloggedServerStillAnswersWhatItReadAheadOnceTheClientReads) {
  // 12000 requests, each answered by a STATUS, from a client that reads nothing at first: the
  // server's queue passes its high-water mark (4096 frames) and it stops reading, with
  // requests already read ahead. Once the client reads, every request must be answered: a
  // request stranded in the read-ahead buffer would never be (no readiness event brings it
  // back).
  recorder_.answer = true;
  constexpr std::uint64_t kRequests = 12000;
  std::string stream = hello();
  for (std::uint64_t i = 1; i <= kRequests; ++i) stream += frame(FrameType::read, i);
  std::thread writer([&] { write_raw(stream); });
  std::atomic<std::size_t> answered{0};
  const std::size_t want = (kRequests + 1) * kHeaderSize + std::strlen("server");
  std::thread reader([&] {
    std::this_thread::sleep_for(200ms);  // let the server's queue fill first
    std::vector<char> buf(1 << 16);
    while (answered.load() < want) {
      const ssize_t n = ::read(raw_, buf.data(), buf.size());
      if (n <= 0) break;
      answered += static_cast<std::size_t>(n);
    }
  });
  const auto until = std::chrono::steady_clock::now() + 20s;
  while (recorder_.seen.size() < kRequests && std::chrono::steady_clock::now() < until)
    uv_run(&loop_, UV_RUN_NOWAIT);
  // Let the last answers leave.
  while (answered.load() < want && std::chrono::steady_clock::now() < until) {
    uv_run(&loop_, UV_RUN_NOWAIT);
    std::this_thread::sleep_for(1ms);
  }
  ::shutdown(raw_, SHUT_RDWR);  // ends a writer or reader still blocked (a failed run)
  writer.join();
  reader.join();
  ASSERT_EQ(recorder_.seen.size(), kRequests);
  EXPECT_EQ(answered.load(), want);
  for (std::uint64_t i = 1; i <= kRequests; ++i) ASSERT_EQ(recorder_.seen[i - 1].req_id, i);
}

TEST_F(StreamReading, AFrameAfterAMalformedOneIsNeverSeen) {
  std::string bad = frame(FrameType::read, 2);
  bad[0] = static_cast<char>(bad[0] ^ 0x55);  // a wrong magic
  write_raw(hello() + frame(FrameType::read, 1) + bad + frame(FrameType::read, 3));
  ASSERT_TRUE(turn_until([&] { return !recorder_.closed.empty() || conn_->usable() == false; }));
  ASSERT_GE(recorder_.seen.size(), 1u);
  EXPECT_EQ(recorder_.seen[0].req_id, 1u);
  for (const auto& s : recorder_.seen) EXPECT_NE(s.req_id, 3u);
}

// ---------------------------------------------------------------------------------------
// The watchdog judges the peer by its socket: a loop held off the CPU past peer_timeout finds
// the timer due before it has polled what the peer sent meanwhile.

struct Held {
  uv_loop_t loop{};
  Recorder recorder;
  int raw = -1;
  std::unique_ptr<StreamConnection> conn;

  explicit Held(std::chrono::milliseconds peer_timeout) {
    EXPECT_EQ(uv_loop_init(&loop), 0);
    int fds[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, fds), 0);
    raw = fds[1];
    conn = std::make_unique<StreamConnection>(&loop, recorder, StreamConnection::Role::server,
                                              fds[0], 1, "raw", peer_timeout, false,
                                              StreamConnection::Hello{"server", 7}, loop::Log());
    uv_run(&loop, UV_RUN_NOWAIT);  // polling from here on
  }
  ~Held() {
    conn.reset();
    uv_run(&loop, UV_RUN_NOWAIT);
    uv_loop_close(&loop);
    ::close(raw);
  }
  /// Turns the loop for `span` (as a loop that runs does).
  void turn_for(std::chrono::milliseconds span) {
    const auto until = std::chrono::steady_clock::now() + span;
    while (std::chrono::steady_clock::now() < until && recorder.closed.empty()) {
      uv_run(&loop, UV_RUN_NOWAIT);
      std::this_thread::sleep_for(1ms);
    }
  }
};

TEST(StreamWatchdog, AHelloThatCameWhileTheLoopWasHeldIsNotBlamedOnThePeer) {
  Held h(200ms);
  const std::string bytes = hello() + frame(FrameType::read, 1);
  ASSERT_EQ(::write(h.raw, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
  std::this_thread::sleep_for(500ms);  // the loop held: its watchdog is due when it runs
  h.turn_for(100ms);
  EXPECT_EQ(h.recorder.closed, "") << "the peer was blamed for our loop's lateness";
  ASSERT_EQ(h.recorder.seen.size(), 1u) << "what the peer sent was not read";
  EXPECT_EQ(h.recorder.seen[0].req_id, 1u);
}

TEST(StreamWatchdog, APeerThatSendsNothingIsStillDroppedAfterPeerTimeout) {
  Held h(200ms);
  std::this_thread::sleep_for(500ms);
  h.turn_for(2s);
  EXPECT_NE(h.recorder.closed.find("no HELLO from the peer within 200 ms"), std::string::npos)
      << "closed: '" << h.recorder.closed << "'";
}

}  // namespace
}  // namespace ferry::transport::wire
