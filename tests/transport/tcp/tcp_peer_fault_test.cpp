// Broken, silent and lying servers seen from a Connector's active side (the client role):
// fake servers speak ferry's frames by hand on loopback.
#include <gtest/gtest.h>

#include <uv.h>

#include <chrono>
#include <cstring>
#include <future>
#include <thread>

#include <ferry/ferry.hpp>

#include "tests/support/patterns.hpp"
#include "tests/support/raw_peer.hpp"
#include "tests/support/util.hpp"

namespace ferry {
namespace {

using namespace std::chrono_literals;
using namespace test;

// Metadata for a passive operation "owned" by a fake server at `address`.
RdmaMetadata fake(OperationKind kind, const std::string& address, const std::string& owner) {
  RdmaMetadata m;
  m.operation_kind = kind;
  m.notification_key = "0000000000000001";
  m.owner = {owner, "00000000000000aa", "fake-host", 1};
  m.endpoints = {{"tcp", address}};
  m.descriptors = {{0x10000, 4096, Device::host()}};
  m.token = std::string(32, 'a');
  return m;
}

ConnectorOptions quick(std::string name) {
  ConnectorOptions o = tcp_only(std::move(name));
  o.peer_timeout = 300ms;
  return o;
}

TEST(PeerFaults, AnswersForgedByAnotherPeerAreIgnored) {
  RawListener a;  // never answers
  RawListener b;  // answers requests it never got
  std::thread silent([&] {
    int fd = a.accept();
    RawClient peer(RawClient::Adopt{}, fd);
    while (peer.read_frame()) {
    }
  });
  std::thread forger([&] {
    int fd = b.accept();
    RawClient peer(RawClient::Adopt{}, fd);
    (void)peer.read_frame();  // HELLO
    FrameHeader hello;
    hello.type = FrameType::hello;
    peer.send_frame(hello, "B");
    for (std::uint64_t req = 1; req <= 4; ++req) {
      FrameHeader status;
      status.type = FrameType::status;
      status.req_id = req;
      peer.send_frame(status);
    }
    while (peer.read_frame()) {
    }
  });
  {
    Connector client(quick("client"));
    std::vector<char> src(4096, 7), dst(4096);
    auto write = client.begin_write({Descriptor(src.data(), 4096)},
                                    fake(OperationKind::write, a.address(), "A"));
    auto read = client.begin_read(fake(OperationKind::read, b.address(), "B"),
                                  {Descriptor(dst.data(), 4096)});
    // A never answers: its write must not be completed by B's forged answers.
    EXPECT_EQ(ended_with(write), ErrorCode::PeerLost);
    EXPECT_NE(write.error()->message().find("'A'"), std::string::npos) << write.error()->message();
  }
  silent.join();
  forger.join();
}

TEST(PeerFaults, ServerSilentAfterHelloFailsWithinPeerTimeout) {
  RawListener server;
  std::promise<void> release;
  std::thread fake_server([&] {
    int fd = server.accept();
    RawClient peer(RawClient::Adopt{}, fd);
    (void)peer.read_frame();
    FrameHeader hello;
    hello.type = FrameType::hello;
    peer.send_frame(hello, "mute");
    release.get_future().wait();  // keeps the connection open, answers nothing
  });
  {
    Connector client(quick("client"));
    std::vector<char> dst(4096);
    auto start = std::chrono::steady_clock::now();
    auto read = client.begin_read(fake(OperationKind::read, server.address(), "mute"),
                                  {Descriptor(dst.data(), 4096)});
    EXPECT_EQ(ended_with(read), ErrorCode::PeerLost);
    EXPECT_LT(std::chrono::steady_clock::now() - start, 3s);
    EXPECT_NE(read.error()->message().find("has not answered for 300 ms"), std::string::npos)
        << read.error()->message();
  }
  release.set_value();
  fake_server.join();
}

// A pooled connection that is closing (it saw a protocol error and waits for the peer to
// close) must not be handed to a new transfer: that one gets a fresh connection.
TEST(PeerFaults, AClosingPooledConnectionIsNotReused) {
  RawListener server;
  std::promise<void> release;
  std::thread fake_server([&] {
    RawClient first(RawClient::Adopt{}, server.accept());
    (void)first.read_frame();  // HELLO
    FrameHeader hello;
    hello.type = FrameType::hello;
    first.send_frame(hello, "flaky");
    (void)first.read_frame();  // the first READ
    const char junk[64] = "this is no frame header";
    first.send_bytes(junk, sizeof junk);  // the client must stop trusting this stream
    // A second connection serves the next transfer properly.
    RawClient second(RawClient::Adopt{}, server.accept());
    (void)second.read_frame();  // HELLO
    second.send_frame(hello, "flaky");
    auto req = second.read_frame();
    if (req && req->header.type == FrameType::read) {
      FrameHeader data;
      data.type = FrameType::data;
      data.req_id = req->header.req_id;
      data.len = req->header.len;
      second.send_frame(data, {}, std::vector<std::byte>(req->header.len, std::byte{9}));
    }
    release.get_future().wait();  // the first connection stays open, never closed by us
  });
  {
    ConnectorOptions o = quick("client");
    o.peer_timeout = 2s;
    Connector client(o);
    std::vector<char> dst(4096);
    auto first = client.begin_read(fake(OperationKind::read, server.address(), "flaky"),
                                   {Descriptor(dst.data(), 4096)});
    std::this_thread::sleep_for(100ms);  // the junk has arrived: the connection is closing
    std::vector<char> dst2(4096);
    auto start = std::chrono::steady_clock::now();
    auto second = client.begin_read(fake(OperationKind::read, server.address(), "flaky"),
                                    {Descriptor(dst2.data(), 4096)});
    bool done = false;
    try {
      done = second.wait_for_completion(5s);
    } catch (const Error& e) {
      ADD_FAILURE() << "the second transfer failed: " << e.what();
    }
    EXPECT_TRUE(done);
    EXPECT_LT(std::chrono::steady_clock::now() - start, 1500ms)
        << "the second transfer waited for the closing connection";
    EXPECT_EQ(dst2[0], 9);
  }
  release.set_value();
  fake_server.join();
}

// A server that answers DONE before the write's last chunk lies (it answers DONE only after
// every earlier frame); the write must end, not wait for an answer that already came.
TEST(PeerFaults, DoneAnsweredBeforeTheLastChunkIsAProtocolError) {
  RawListener server;
  std::promise<void> release;
  std::thread fake_server([&] {
    RawClient peer(RawClient::Adopt{}, server.accept());
    (void)peer.read_frame();  // HELLO
    FrameHeader hello;
    hello.type = FrameType::hello;
    peer.send_frame(hello, "liar");
    auto write = peer.read_frame();
    auto done = peer.read_frame();
    if (write && done) {
      FrameHeader ok;
      ok.type = FrameType::status;
      ok.req_id = done->header.req_id;
      peer.send_frame(ok);
      ok.req_id = write->header.req_id;
      peer.send_frame(ok);
    }
    release.get_future().wait();  // connected and silent from here on
  });
  {
    Connector client(quick("client"));
    std::vector<char> src(4096, 1);
    auto write = client.begin_write({Descriptor(src.data(), src.size())},
                                    fake(OperationKind::write, server.address(), "liar"));
    EXPECT_EQ(ended_with(write, 5s), ErrorCode::ProtocolError);
    EXPECT_NE(write.error()->message().find("answered DONE before"), std::string::npos)
        << write.error()->message();
  }
  release.set_value();
  fake_server.join();
}

// A read into many small pieces asks for them all in one READ_RANGES; the owner answers each
// range with a DATA naming its address, in any order. `lie` answers one piece at an address
// that no range names instead.
struct RangesServer {
  explicit RangesServer(bool lie)
      : thread([this, lie] {
          RawClient peer(RawClient::Adopt{}, listener.accept());
          (void)peer.read_frame();  // HELLO
          FrameHeader hello;
          hello.type = FrameType::hello;
          peer.send_frame(hello, "ranges");
          auto f = peer.read_frame();
          if (!f) return;
          type = f->header.type;
          for (std::size_t at = 0; at + 16 <= f->payload.size(); at += 16) {
            std::uint64_t addr = 0, len = 0;
            std::memcpy(&addr, f->payload.data() + at, 8);
            std::memcpy(&len, f->payload.data() + at + 8, 8);
            ranges.emplace_back(addr, len);
          }
          const auto source = patterned(4096, 5);
          for (auto it = ranges.rbegin(); it != ranges.rend(); ++it) {
            FrameHeader d;
            d.type = FrameType::data;
            d.req_id = f->header.req_id;
            d.addr = lie && it == ranges.rbegin() ? it->first + 1 : it->first;
            d.len = it->second;
            const std::vector<std::byte> bytes(source.begin() + (it->first - 0x10000),
                                               source.begin() + (it->first - 0x10000 + it->second));
            peer.send_frame(d, {}, bytes);
          }
          while (peer.read_frame()) {
          }
        }) {}
  ~RangesServer() {
    if (thread.joinable()) thread.join();
  }
  RawListener listener;
  FrameType type = FrameType::hello;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges;
  std::thread thread;
};

TEST(PeerFaults, ManySmallPiecesAreAskedForInOneRequestAndMayArriveInAnyOrder) {
  RangesServer server(/*lie=*/false);
  std::vector<std::byte> dst(4096);
  {
    Connector client(quick("client"));
    std::vector<Descriptor> pieces;
    for (std::size_t i = 0; i < 8; ++i) pieces.emplace_back(dst.data() + i * 512, 512);
    auto read =
        client.begin_read(fake(OperationKind::read, server.listener.address(), "ranges"), pieces);
    EXPECT_TRUE(read.wait_for_completion(5s));
  }
  server.thread.join();
  EXPECT_EQ(server.type, FrameType::read_ranges);
  ASSERT_EQ(server.ranges.size(), 8u);
  for (std::size_t i = 0; i < 8; ++i)
    EXPECT_EQ(server.ranges[i],
              std::make_pair(std::uint64_t{0x10000 + i * 512}, std::uint64_t{512}));
  EXPECT_EQ(first_mismatch(dst.data(), dst.size(), 5), -1);
}

TEST(PeerFaults, DataNamingNoRangeOfTheRequestIsAProtocolError) {
  RangesServer server(/*lie=*/true);
  std::vector<std::byte> dst(4096);
  Connector client(quick("client"));
  auto read =
      client.begin_read(fake(OperationKind::read, server.listener.address(), "ranges"),
                        {Descriptor(dst.data(), 1024), Descriptor(dst.data() + 1024, 3072)});
  EXPECT_EQ(ended_with(read, 5s), ErrorCode::ProtocolError);
  EXPECT_NE(read.error()->message().find("matches no range"), std::string::npos)
      << read.error()->message();
}

TEST(PeerFaults, ServerThatNeverSendsHelloFails) {
  RawListener server;
  std::promise<void> release;
  std::thread fake_server([&] {
    int fd = server.accept();
    release.get_future().wait();
    ::close(fd);
  });
  {
    Connector client(quick("client"));
    std::vector<char> dst(4096);
    auto read = client.begin_read(fake(OperationKind::read, server.address(), "wrong-service"),
                                  {Descriptor(dst.data(), 4096)});
    EXPECT_EQ(ended_with(read), ErrorCode::PeerLost);
    EXPECT_NE(read.error()->message().find("no HELLO"), std::string::npos)
        << read.error()->message();
  }
  release.set_value();
  fake_server.join();
}

TEST(PeerFaults, WritingToAResetPeerDoesNotKillTheProcess) {
  // Embedded, so that this thread decides when the loop notices what the peer did.
  RawListener server;
  uv_loop_t loop;
  ASSERT_EQ(uv_loop_init(&loop), 0);
  {
    ConnectorOptions o = tcp_only("client");
    o.loop = &loop;
    Connector client(o);
    std::vector<char> dst(4096);
    auto first = client.begin_read(fake(OperationKind::read, server.address(), "quitter"),
                                   {Descriptor(dst.data(), 4096)});
    for (int i = 0; i < 20; ++i) uv_run(&loop, UV_RUN_NOWAIT);
    int fd = server.accept();
    ASSERT_GE(fd, 0);
    char junk[4096];
    std::this_thread::sleep_for(50ms);
    (void)!::read(fd, junk, sizeof junk);  // HELLO and READ
    ::close(fd);                           // the peer goes away: FIN, then RST for what follows
    std::this_thread::sleep_for(50ms);
    first.cancel();  // writes DONE to the closed peer, which answers with a reset
    std::this_thread::sleep_for(50ms);
    // Writes on the same (pooled, now reset) connection: EPIPE, not SIGPIPE.
    auto second = client.begin_read(fake(OperationKind::read, server.address(), "quitter"),
                                    {Descriptor(dst.data(), 4096)});
    for (int i = 0; i < 100 && !is_final(second.status()); ++i) uv_run(&loop, UV_RUN_NOWAIT);
    EXPECT_EQ(second.status(), OperationStatus::errored);
  }
  uv_run(&loop, UV_RUN_DEFAULT);
  EXPECT_EQ(uv_loop_close(&loop), 0);
}

TEST(PeerFaults, AChunkLargerThanTheOwnerServesIsRefusedAndTheOwnerIsTold) {
  Connector owner(tcp_only("owner"));  // max_request: 16 MiB
  ConnectorOptions greedy = tcp_only("greedy");
  greedy.tcp.chunk_size = 32u << 20;
  greedy.tcp.window = 32u << 20;
  Connector reader(greedy);
  auto src = patterned(32u << 20, 61);
  auto dst = buffer(32u << 20);
  auto readable = owner.create_readable({Descriptor(src.data(), src.size())});
  auto read = reader.begin_read(readable.metadata(), {Descriptor(dst.data(), dst.size())});
  EXPECT_EQ(ended_with(read), ErrorCode::AccessDenied);
  // The reader gives up and says so: the owner does not wait for its deadline.
  EXPECT_EQ(ended_with(readable, 3s), ErrorCode::AccessDenied);
  EXPECT_NE(readable.error()->message().find("requests take 1 to"), std::string::npos);
}

TEST(PeerFaults, AWriteLargerThanTheOwnerServesIsAProtocolErrorNotALostPeer) {
  Connector owner(tcp_only("owner"));
  ConnectorOptions greedy = tcp_only("greedy");
  greedy.tcp.chunk_size = 32u << 20;
  greedy.tcp.window = 32u << 20;
  Connector writer(greedy);
  auto src = patterned(32u << 20, 62);
  auto dst = buffer(32u << 20);
  auto writable = owner.create_writable({Descriptor(dst.data(), dst.size())});
  auto write = writer.begin_write({Descriptor(src.data(), src.size())}, writable.metadata());
  EXPECT_EQ(ended_with(write), ErrorCode::ProtocolError);
  EXPECT_FALSE(write.error()->retryable());
  EXPECT_NE(write.error()->message().find("exceeds the limit"), std::string::npos)
      << write.error()->message();
}

}  // namespace
}  // namespace ferry
