// transport/cma/cma_transport.hpp: what a cma transport judges from an endpoint alone, and
// copies cut into jobs.
#include <gtest/gtest.h>
#include <cerrno>

#include <climits>
#include <cstring>
#include <memory>
#include <vector>

#include <ferry/ferry.hpp>

#include "loop/event_loop.hpp"
#include "tests/support/util.hpp"
#include "transport/cma/cma_copier.hpp"
#include "transport/cma/cma_transport.hpp"
#include "transport/method_selector.hpp"
#include "transport/same_host/owner_info.hpp"
#include "transport/same_host/system.hpp"

namespace ferry::transport::cma {
namespace {

using namespace same_host;

OwnerInfo sample_info() {
  OwnerInfo info;
  info.scope = this_process();
  info.grants_fd = 9;
  info.grants_bytes = 4096;
  return info;
}

// Another host or PID namespace is judged from the endpoint alone: cma is passed over with
// that reason, and tcp is chosen, with no failure remembered.
TEST(Reach, AnotherHostOrNamespaceIsPassedOverWithItsReason) {
  loop::EventLoop loop;
  auto transport = loop.call([&] {
    Context c;
    c.loop = loop.uv();
    c.defer = [&loop](std::function<void()> f) { loop.defer(std::move(f)); };
    c.local_name = "reach";
    return std::make_unique<CmaTransport>(c, CmaOptions{});
  });
  Endpoint own = loop.call([&] { return transport->endpoints().at(0); });
  EXPECT_FALSE(loop.call([&] { return transport->unreachable(own); }).has_value());
  OwnerInfo other = sample_info();
  other.scope.boot_id = "00000000-0000-0000-0000-000000000000";
  Endpoint elsewhere{"cma", own.address, to_info(other)};
  const std::optional<Error> why = loop.call([&] { return transport->unreachable(elsewhere); });
  ASSERT_TRUE(why.has_value());
  EXPECT_NE(why->message().find("another host"), std::string::npos) << why->message();
  other = sample_info();
  other.scope.pid_ns += 1;
  Endpoint nested{"cma", own.address, to_info(other)};
  const std::optional<Error> nested_why = loop.call([&] { return transport->unreachable(nested); });
  ASSERT_TRUE(nested_why.has_value());
  EXPECT_NE(nested_why->message().find("PID namespace"), std::string::npos);

  MethodSelector selector;
  Capabilities cma_caps = loop.call([&] { return transport->capabilities(); });
  Capabilities tcp_caps;
  tcp_caps.method = "tcp";
  tcp_caps.rank = 100;
  MethodSelector::Needs needs;
  needs.peer = "0123456789abcdef";
  needs.peer_name = "nested";
  needs.same_host = true;
  needs.unreachable.emplace("cma", *nested_why);
  auto choices =
      selector.choose({cma_caps, tcp_caps}, {nested, Endpoint{"tcp", "127.0.0.1:1"}}, needs);
  ASSERT_EQ(choices.size(), 1u);
  EXPECT_EQ(choices[0].local, 1u);
  EXPECT_FALSE(selector.failure("0123456789abcdef", "cma"));
  loop.close([&] { transport.reset(); });
}

}  // namespace
}  // namespace ferry::transport::cma

namespace ferry {
namespace {

// More pieces than one process_vm_* call takes (IOV_MAX): the copy is cut into jobs of at most
// IOV_MAX pieces, on the thread pool, and every byte lands where the byte stream says.
// A peer whose process is gone (ESRCH) is lost for good: PeerLost, but not retryable. One
// that refused (EPERM) or whose memory is not mapped (EFAULT) is AccessDenied.
TEST(CmaErrors, AProcessThatIsGoneIsPeerLostAndNotRetryable) {
  const Error gone = transport::cma::copy_error(ESRCH, transport::Access::read, "owner", 4242);
  EXPECT_EQ(gone.code(), ErrorCode::PeerLost);
  EXPECT_FALSE(gone.retryable());
  EXPECT_NE(gone.message().find("exited during the transfer"), std::string::npos);
  EXPECT_EQ(transport::cma::copy_error(EFAULT, transport::Access::write, "owner", 4242).code(),
            ErrorCode::AccessDenied);
  EXPECT_EQ(transport::cma::copy_error(EPERM, transport::Access::read, "owner", 4242).code(),
            ErrorCode::AccessDenied);
}

TEST(CmaBatches, ScatterGatherListsLongerThanIovMaxArriveWhole) {
  ConnectorOptions o = test::named("batches");
  o.transports = {"cma"};
  o.cma.inline_max = 0;
  o.nats.use_environment = false;
  Connector owner(o);
  Connector peer(o);
  constexpr std::size_t kPieces = 2 * IOV_MAX + 77;
  constexpr std::size_t kPiece = 61;
  std::vector<std::byte> src(kPieces * kPiece);
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::byte>((i * 131) % 251);
  std::vector<std::byte> dst(src.size() + kPieces);  // one gap byte after every piece
  std::vector<Descriptor> pieces;
  for (std::size_t i = 0; i < kPieces; ++i)
    pieces.emplace_back(dst.data() + i * (kPiece + 1), kPiece);
  auto readable = owner.create_readable(src);
  auto read = peer.begin_read(readable.metadata(), pieces);
  ASSERT_TRUE(read.wait_for_completion(std::chrono::seconds(30)));
  ASSERT_TRUE(readable.wait_for_completion(std::chrono::seconds(30)));
  EXPECT_EQ(read.method(), "cma");
  for (std::size_t i = 0; i < kPieces; ++i) {
    ASSERT_EQ(std::memcmp(dst.data() + i * (kPiece + 1), src.data() + i * kPiece, kPiece), 0)
        << "piece " << i;
    ASSERT_EQ(dst[i * (kPiece + 1) + kPiece], std::byte{0}) << "gap after piece " << i;
  }
}

}  // namespace
}  // namespace ferry
