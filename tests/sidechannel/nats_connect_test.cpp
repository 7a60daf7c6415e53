// Building cnats' options and connecting (sidechannel/nats_connect): a setting cnats refuses
// is named; a server that refuses the credentials is AccessDenied, as cnats' own status says,
// even when a later server in the list cannot be reached; an unreachable server is SideChannel.
#include <gtest/gtest.h>

#include <nats/nats.h>

#include <chrono>
#include <string>
#include <vector>

#include <ferry/error.hpp>
#include <ferry/options.hpp>

#include "sidechannel/nats_connect.hpp"
#include "tests/support/nats_server.hpp"
#include "tests/support/util.hpp"

namespace ferry {
namespace {

using namespace std::chrono_literals;
using sidechannel::nats_connect;
using sidechannel::nats_options;

NatsOptions options(std::vector<std::string> servers) {
  NatsOptions o;
  o.servers = std::move(servers);
  o.use_environment = false;
  o.connect_timeout = 1000ms;
  return o;
}

std::string unreachable() { return "nats://127.0.0.1:" + std::to_string(test::free_port()); }

// Connects with `o` and closes again; throws what nats_connect throws.
void connect_once(const NatsOptions& o) {
  auto opts = nats_options(o);
  natsConnection* nc = nats_connect(opts.get(), o.servers);
  natsConnection_Close(nc);
  natsConnection_Destroy(nc);
}

TEST(NatsOptions, ASettingCnatsRefusesIsNamed) {
  NatsOptions o = options({"nats://127.0.0.1:4222"});
  o.tls_ca_file = "/nonexistent/ferry-ca.pem";
  test::expect_error([&] { nats_options(o); }, ErrorCode::SideChannel, "TLS CA file");
}

class NatsConnectTest : public ::testing::Test {
 protected:
  test::NatsServer server_{
      test::NatsServer::Options{0, {"--user", "ferry", "--pass", "s3cret"}, {}}};
  NatsOptions good() {
    NatsOptions o = options({server_.url()});
    o.user = "ferry";
    o.password = "s3cret";
    return o;
  }
};

TEST_F(NatsConnectTest, TheRightCredentialsConnect) { EXPECT_NO_THROW(connect_once(good())); }

TEST_F(NatsConnectTest, WrongOrMissingCredentialsAreAccessDenied) {
  NatsOptions wrong = good();
  wrong.password = "guess";
  test::expect_error([&] { connect_once(wrong); }, ErrorCode::AccessDenied,
                     "the NATS server at " + server_.url() + " refused the credentials");
  test::expect_error([&] { connect_once(options({server_.url()})); }, ErrorCode::AccessDenied,
                     "Authorization Violation");
}

// With the unreachable server last, natsConnection_Connect returns what that one gave
// (NATS_TIMEOUT: the connect to the closed port on loopback was in progress, then failed); the
// refusal is in the thread's last error.
TEST_F(NatsConnectTest, ARefusalIsAccessDeniedWhenALaterServerCannotBeReached) {
  NatsOptions wrong = good();
  wrong.password = "guess";
  wrong.servers = {server_.url(), unreachable()};
  test::expect_error([&] { connect_once(wrong); }, ErrorCode::AccessDenied,
                     "refused the credentials");
  wrong.servers = {unreachable(), server_.url()};
  test::expect_error([&] { connect_once(wrong); }, ErrorCode::AccessDenied,
                     "refused the credentials");
}

TEST_F(NatsConnectTest, AnEarlierRefusalOnTheSameThreadDoesNotColourALaterFailure) {
  NatsOptions wrong = good();
  wrong.password = "guess";
  test::expect_error([&] { connect_once(wrong); }, ErrorCode::AccessDenied, "refused");
  test::expect_error([&] { connect_once(options({unreachable()})); }, ErrorCode::SideChannel,
                     "cannot connect to NATS at nats://127.0.0.1:");
}

TEST(NatsConnect, AnUnreachableServerIsSideChannel) {
  const std::string url = unreachable();
  test::expect_error([&] { connect_once(options({url})); }, ErrorCode::SideChannel,
                     "cannot connect to NATS at " + url);
}

}  // namespace
}  // namespace ferry
