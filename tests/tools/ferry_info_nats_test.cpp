// ferry-info against a private nats-server on loopback, a dead port and a silent listener.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/support/nats_server.hpp"
#include "tests/tools/tool_run.hpp"

namespace ferry::test {
namespace {

using nlohmann::json;

json nats_of(const ToolRun& run) {
  EXPECT_EQ(run.exit_code, 0) << run.err;
  return json::parse(run.out).at("nats");
}

std::string dead_url() { return "nats://127.0.0.1:" + std::to_string(free_port()); }

TEST(FerryInfoNats, ReportsALiveServerReachable) {
  NatsServer server;
  ToolRun text = run_ferry_info({"--nats", server.url()});
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find("reachable      " + server.url()), std::string::npos) << text.out;

  json nats = nats_of(run_ferry_info({"--json", "--nats", server.url()}));
  EXPECT_EQ(nats.at("source"), "--nats");
  EXPECT_EQ(nats.at("reachable"), true) << nats.dump();
  EXPECT_EQ(nats.at("connected_url"), server.url());
  EXPECT_FALSE(nats.at("server_id").get<std::string>().empty());
  EXPECT_GT(nats.at("max_payload").get<long long>(), 0);
  EXPECT_GE(nats.at("rtt_us").get<long long>(), 0);
  EXPECT_EQ(nats.at("local_ip"), "127.0.0.1");
}

TEST(FerryInfoNats, TakesTheServersFromTheEnvironmentInOrder) {
  NatsServer server;
  json nats =
      nats_of(run_ferry_info({"--json"}, {"FERRY_NATS_URL=" + dead_url() + "," + server.url()}));
  EXPECT_EQ(nats.at("source"), "FERRY_NATS_URL");
  EXPECT_EQ(nats.at("servers").size(), 2u);
  EXPECT_EQ(nats.at("reachable"), true) << nats.dump();
  EXPECT_EQ(nats.at("connected_url"), server.url());
}

TEST(FerryInfoNats, ADeadPortIsUnreachableNotAnError) {
  std::string url = dead_url();
  ToolRun text = run_ferry_info({"--nats", url});
  EXPECT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find("unreachable    "), std::string::npos) << text.out;

  json nats = nats_of(run_ferry_info({"--json", "--nats", url}));
  EXPECT_EQ(nats.at("reachable"), false);
  EXPECT_FALSE(nats.at("error").get<std::string>().empty());
}

TEST(FerryInfoNats, SaysWhereAConnectorsSideChannelStands) {
  std::string url = dead_url();
  json waiting = nats_of(run_ferry_info({"--json", "--nats", url}));
  EXPECT_EQ(waiting.at("connector").at("state"), "connecting") << waiting.dump();
  EXPECT_NE(waiting.at("connector").at("detail").get<std::string>().find(url), std::string::npos)
      << waiting.dump();
  ToolRun text = run_ferry_info({"--nats", url});
  EXPECT_NE(text.out.find("a connector    connecting (keeps trying in the background): "),
            std::string::npos)
      << text.out;

  NatsServer server;
  json up = nats_of(run_ferry_info({"--json", "--nats", server.url()}));
  EXPECT_EQ(up.at("connector").at("state"), "connected") << up.dump();
  EXPECT_EQ(up.at("connector").at("detail"), server.url());
}

TEST(FerryInfoNats, StrictFailsOnlyWhenUnreachable) {
  EXPECT_EQ(run_ferry_info({"--strict", "--nats", dead_url()}).exit_code, 1);
  NatsServer server;
  EXPECT_EQ(run_ferry_info({"--strict", "--nats", server.url()}).exit_code, 0);
}

TEST(FerryInfoNats, UsesTheTokenOfTheEnvironment) {
  NatsServer server(NatsServer::Options{0, {"--auth", "s3cret-token"}, ""});
  json refused = nats_of(run_ferry_info({"--json", "--nats", server.url()}));
  EXPECT_EQ(refused.at("reachable"), false);
  EXPECT_NE(refused.at("error").get<std::string>().find("uthoriz"), std::string::npos)
      << refused.dump();
  json let_in = nats_of(
      run_ferry_info({"--json", "--nats", server.url()}, {"FERRY_NATS_TOKEN=s3cret-token"}));
  EXPECT_EQ(let_in.at("reachable"), true) << let_in.dump();
}

TEST(FerryInfoNats, TimeoutBoundsTheWaitForASilentServer) {
  // Listens, never accepts: the connection completes in the backlog and no INFO ever comes.
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(::listen(fd, 4), 0);
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  std::string url = "nats://127.0.0.1:" + std::to_string(ntohs(addr.sin_port));

  auto start = std::chrono::steady_clock::now();
  json nats = nats_of(run_ferry_info({"--json", "--timeout-ms", "300", "--nats", url}));
  auto took = std::chrono::steady_clock::now() - start;
  ::close(fd);
  EXPECT_EQ(nats.at("reachable"), false) << nats.dump();
  EXPECT_LT(took, std::chrono::seconds(5));
}

}  // namespace
}  // namespace ferry::test
