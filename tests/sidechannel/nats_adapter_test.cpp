// ferry's driver of cnats' socket (sidechannel/nats_adapter.cpp) when the server resets the
// connection behind data the connector has not read yet: libuv reports EPOLLERR, stops the
// poll handle by itself, and cnats, which reads one buffer per call, sees the reset only after
// the data. The driver must keep reading until then, or the connection is neither read nor
// written again (under a request flood that left an owner deaf until cnats' pings gave up).
//
// A fake NATS server makes it deterministic: the connector runs on an embedded loop that the
// test turns, so the server can queue more than one buffer of data and reset the connection
// before the connector reads any of it.
#include <gtest/gtest.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>
#include <uv.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <memory>
#include <string>
#include <thread>

#include <ferry/ferry.hpp>

#include "sidechannel/nats_adapter.hpp"
#include "tests/support/nats_server.hpp"

namespace ferry {
namespace {

using namespace std::chrono_literals;

// Accepts one connection, does the NATS handshake (INFO; PONG for the client's PING), then on
// reset() sends `bytes` of "+OK" lines (which cnats reads and ignores) and resets the
// connection (SO_LINGER 0).
class ResettingServer {
 public:
  ResettingServer() {
    listener_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::bind(listener_, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    socklen_t len = sizeof addr;
    ::getsockname(listener_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    EXPECT_EQ(::listen(listener_, 4), 0);
    thread_ = std::thread([this] { serve(); });
  }
  ~ResettingServer() {
    if (!went_) go_.set_value();
    ::shutdown(listener_, SHUT_RDWR);
    thread_.join();
    ::close(listener_);
  }
  std::string url() const { return "nats://127.0.0.1:" + std::to_string(port_); }
  // Sends the data and the reset; returns how many bytes of data went out.
  std::size_t reset() {
    went_ = true;
    go_.set_value();
    return sent_.get_future().get();
  }

 private:
  void serve() {
    int fd = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      sent_.set_value(0);
      return;
    }
    const std::string info =
        R"(INFO {"server_id":"fake","version":"2.9.10","proto":1,"host":"127.0.0.1","port":)" +
        std::to_string(port_) + R"(,"max_payload":1048576,"headers":true})" + "\r\n";
    ::send(fd, info.data(), info.size(), MSG_NOSIGNAL);
    // Until the client's PING (after its CONNECT): then it is connected.
    std::string seen;
    char buf[4096];
    timeval tv{5, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    while (seen.find("PING\r\n") == std::string::npos && seen.size() < 65536) {
      ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n <= 0) break;
      seen.append(buf, static_cast<std::size_t>(n));
    }
    ::send(fd, "PONG\r\n", 6, MSG_NOSIGNAL);
    go_future_.wait();
    // Three of cnats' 32 KiB read buffers, or as much as the socket takes without blocking.
    std::string data;
    while (data.size() < 96 * 1024) data += "+OK\r\n";
    std::size_t sent = 0;
    const auto until = std::chrono::steady_clock::now() + 2s;
    while (sent < data.size() && std::chrono::steady_clock::now() < until) {
      ssize_t n = ::send(fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0)
        sent += static_cast<std::size_t>(n);
      else
        std::this_thread::sleep_for(1ms);
    }
    // Let it all reach the client's receive queue before the reset does.
    std::this_thread::sleep_for(100ms);
    linger hard{1, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &hard, sizeof hard);
    ::close(fd);
    sent_.set_value(sent);
  }

  int listener_ = -1;
  std::uint16_t port_ = 0;
  std::thread thread_;
  std::promise<void> go_;
  bool went_ = false;
  std::shared_future<void> go_future_ = go_.get_future().share();
  std::promise<std::size_t> sent_;
};

TEST(NatsAdapter, AResetBehindUnreadDataIsSeenAndTheConnectionDropped) {
  ResettingServer server;
  uv_loop_t loop;
  ASSERT_EQ(uv_loop_init(&loop), 0);
  std::atomic<int> disconnected{0};
  {
    ConnectorOptions o = test::nats_options("reset", {server.url()});
    o.loop = &loop;
    o.nats.reconnect_wait = 5000ms;  // no second connection while the test looks
    o.nats.on_event = [&](SideChannelEvent e, const std::string&) {
      if (e == SideChannelEvent::disconnected) ++disconnected;
    };
    Connector c(o);
    // The loop has not run: nothing of what the server sends now is read before the reset.
    const std::size_t sent = server.reset();
    ASSERT_GT(sent, 64u * 1024) << "the data must fill more than two of cnats' read buffers";
    const auto until = std::chrono::steady_clock::now() + 5s;
    while (disconnected.load() == 0 && std::chrono::steady_clock::now() < until) {
      uv_run(&loop, UV_RUN_NOWAIT);
      std::this_thread::sleep_for(1ms);
    }
    EXPECT_EQ(disconnected.load(), 1)
        << "the reset was never seen: the socket is no longer polled after EPOLLERR";
  }
  uv_run(&loop, UV_RUN_DEFAULT);  // until the side channel has closed
  EXPECT_EQ(uv_loop_close(&loop), 0);
}

// cnats may call the driver after natsConnection_Close has returned: Close returns at once while
// another thread (the reconnect thread that gave up after max_reconnect, or the side channel's
// worker that gave up a first connect) is inside cnats' own close, and that thread calls detach
// only after it has let go of the connection's lock, when the channel may have shut the driver
// down and destroyed it. Such calls must do nothing. (Before, the callbacks were handed a
// pointer to the driver's state, and this test read freed memory: AddressSanitizer reports it,
// and a plain build could abort without a message in libuv when the freed memory was reused.)
TEST(NatsAdapter, CallbacksAfterTheDriverIsGoneDoNothing) {
  uv_loop_t loop;
  ASSERT_EQ(uv_loop_init(&loop), 0);
  int pair[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair), 0);
  auto driver = std::make_unique<sidechannel::NatsSocketDriver>(&loop, loop::Log{});
  const sidechannel::NatsSocketDriver::Callbacks cb = driver->callbacks();
  void* user = nullptr;
  // As cnats does after connecting: the driver polls the socket for reading (the connection
  // itself is touched only when the socket is readable, which it never is here, so none is
  // needed).
  ASSERT_EQ(cb.attach(&user, cb.loop, nullptr, pair[0]), NATS_OK);
  uv_run(&loop, UV_RUN_NOWAIT);
  driver->shutdown();
  driver.reset();
  uv_run(&loop, UV_RUN_DEFAULT);  // closes the poll handle and ferry's duplicate
  EXPECT_EQ(uv_loop_close(&loop), 0) << "the driver left a handle open";

  // cnats' late calls: each finds no driver and does nothing.
  EXPECT_EQ(cb.read(user, false), NATS_OK);
  EXPECT_EQ(cb.write(user, false), NATS_OK);
  EXPECT_EQ(cb.detach(user), NATS_OK);
  void* again = nullptr;
  EXPECT_EQ(cb.attach(&again, cb.loop, nullptr, pair[0]), NATS_ILLEGAL_STATE);
  EXPECT_EQ(again, nullptr);

  // And a driver made afterwards is not reached through the old one's token.
  uv_loop_t other;
  ASSERT_EQ(uv_loop_init(&other), 0);
  {
    sidechannel::NatsSocketDriver fresh(&other, loop::Log{});
    EXPECT_NE(fresh.callbacks().loop, cb.loop);
    EXPECT_EQ(cb.attach(&again, cb.loop, nullptr, pair[0]), NATS_ILLEGAL_STATE);
  }
  uv_run(&other, UV_RUN_DEFAULT);
  EXPECT_EQ(uv_loop_close(&other), 0);
  ::close(pair[0]);
  ::close(pair[1]);
}

}  // namespace
}  // namespace ferry
