// Connector::metrics() and the Prometheus endpoint (ConnectorOptions::metrics): the text is
// parsed as a scraper would, and checked against Prometheus' naming conventions and against
// what the connectors did; the endpoint is fetched over HTTP on 127.0.0.1.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <limits>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include <ferry/ferry.hpp>

#include "build_config.hpp"
#include "tests/support/patterns.hpp"
#include "tests/support/util.hpp"

namespace ferry {
namespace {

using namespace std::chrono_literals;
constexpr auto kWait = std::chrono::seconds(60);

// One sample line: name{labels} value.
struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

struct Exposition {
  std::map<std::string, std::string> type;  // family -> counter, gauge, histogram
  std::map<std::string, std::string> help;
  std::vector<Sample> samples;

  // The samples of `name` whose labels include every one of `want`.
  std::vector<Sample> find(const std::string& name,
                           const std::map<std::string, std::string>& want = {}) const {
    std::vector<Sample> out;
    for (const Sample& s : samples) {
      if (s.name != name) continue;
      bool all = true;
      for (const auto& [k, v] : want) {
        auto it = s.labels.find(k);
        all = all && it != s.labels.end() && it->second == v;
      }
      if (all) out.push_back(s);
    }
    return out;
  }
  double sum(const std::string& name, const std::map<std::string, std::string>& want = {}) const {
    double total = 0;
    for (const Sample& s : find(name, want)) total += s.value;
    return total;
  }
};

// Parses the text format strictly enough that a malformed line fails the test.
Exposition parse(const std::string& text) {
  Exposition e;
  static const std::regex help_re(R"(^# HELP ([a-zA-Z_:][a-zA-Z0-9_:]*) (.+)$)");
  static const std::regex type_re(
      R"(^# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (counter|gauge|histogram|summary|untyped)$)");
  static const std::regex sample_re(
      R"(^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? ([-+0-9.eE]+|\+Inf|-Inf|[Nn]a[Nn])$)");
  static const std::regex label_re(R"re(([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)",?)re");
  std::size_t start = 0;
  while (start < text.size()) {
    std::size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(start, end - start);
    start = end + 1;
    if (line.empty()) continue;
    std::smatch m;
    if (std::regex_match(line, m, help_re)) {
      e.help[m[1]] = m[2];
    } else if (std::regex_match(line, m, type_re)) {
      e.type[m[1]] = m[2];
    } else if (std::regex_match(line, m, sample_re)) {
      Sample s;
      s.name = m[1];
      s.value = m[4] == "+Inf" ? std::numeric_limits<double>::infinity() : std::stod(m[4]);
      const std::string labels = m[3];
      auto it = std::sregex_iterator(labels.begin(), labels.end(), label_re);
      std::size_t covered = 0;
      for (; it != std::sregex_iterator(); ++it) {
        s.labels[(*it)[1]] = (*it)[2];
        covered += static_cast<std::size_t>(it->length());
      }
      EXPECT_EQ(covered, labels.size()) << "labels not understood: " << line;
      e.samples.push_back(std::move(s));
    } else {
      ADD_FAILURE() << "not the Prometheus text format: '" << line << "'";
    }
  }
  return e;
}

// The family a sample belongs to (a histogram's _bucket, _sum and _count are its own).
std::string family_of(const Exposition& e, const std::string& name) {
  for (const char* suffix : {"_bucket", "_sum", "_count"}) {
    const std::string s = suffix;
    if (name.size() > s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0) {
      const std::string base = name.substr(0, name.size() - s.size());
      auto t = e.type.find(base);
      if (t != e.type.end() && t->second == "histogram") return base;
    }
  }
  return name;
}

void expect_conventions(const Exposition& e, const Connector& c) {
  ASSERT_FALSE(e.samples.empty());
  for (const auto& [family, type] : e.type) {
    EXPECT_EQ(family.rfind("ferry_", 0), 0u) << family;
    EXPECT_TRUE(std::regex_match(family, std::regex("[a-z][a-z0-9_]*"))) << family;
    EXPECT_TRUE(e.help.count(family)) << family << " has no HELP";
    const bool total = family.size() > 6 && family.substr(family.size() - 6) == "_total";
    if (type == "counter") {
      EXPECT_TRUE(total) << family << ": a counter ends in _total";
    } else {
      EXPECT_FALSE(total) << family << ": only counters end in _total";
    }
    if (type == "histogram") {
      EXPECT_NE(family.find("_seconds"), std::string::npos) << family << ": durations in seconds";
    }
    if (family.find("bytes") != std::string::npos) {
      EXPECT_TRUE(family.ends_with("_bytes") || family.ends_with("_bytes_total")) << family;
    }
  }
  for (const Sample& s : e.samples) {
    const std::string family = family_of(e, s.name);
    EXPECT_TRUE(e.type.count(family)) << s.name << " has no TYPE";
    EXPECT_EQ(s.labels.at("connector"), c.identity().name) << s.name;
    EXPECT_EQ(s.labels.at("connector_id"), c.identity().id) << s.name;
    EXPECT_GE(s.value, 0) << s.name;
  }
  // Every histogram: buckets cumulative, ending at +Inf with the count.
  for (const auto& [family, type] : e.type) {
    if (type != "histogram") continue;
    for (const Sample& count : e.find(family + "_count")) {
      std::map<std::string, std::string> same = count.labels;
      double last = 0;
      double at_inf = -1;
      for (const Sample& b : e.find(family + "_bucket", same)) {
        EXPECT_GE(b.value, last) << family;
        last = b.value;
        if (b.labels.at("le") == "+Inf") at_inf = b.value;
      }
      EXPECT_EQ(at_inf, count.value) << family;
    }
  }
}

TEST(Metrics, TheTextFollowsPrometheusConventionsAndCarriesWhatTheConnectorsDid) {
#if !FERRY_HAS_PROMETHEUS
  GTEST_SKIP() << "built without prometheus-cpp";
#endif
  Connector owner(test::named("owner"));
  Connector peer(test::named("peer"));
  auto src = test::patterned(3000, 1);
  auto dst = test::buffer(3000);
  auto readable = owner.create_readable({Descriptor(src.data(), src.size())});
  auto read = peer.begin_read(readable.metadata(), {Descriptor(dst.data(), dst.size())});
  ASSERT_TRUE(read.wait_for_completion(kWait));
  ASSERT_TRUE(readable.wait_for_completion(kWait));
  OperationOptions quick;
  quick.timeout = 20ms;
  auto never = owner.create_writable({Descriptor(dst.data(), dst.size())}, quick);
  EXPECT_THROW(never.wait_for_completion(), Error);
  const std::string method = read.method();

  const std::string text = owner.metrics();
  const Exposition e = parse(text);
  expect_conventions(e, owner);
  EXPECT_EQ(
      e.sum("ferry_operations_total",
            {{"method", method}, {"kind", "read"}, {"role", "passive"}, {"outcome", "complete"}}),
      1)
      << text;
  EXPECT_EQ(e.sum("ferry_operations_total", {{"kind", "write"}, {"outcome", "errored"}}), 1);
  EXPECT_EQ(e.sum("ferry_operation_errors_total", {{"code", "Timeout"}}), 1);
  EXPECT_EQ(e.sum("ferry_transferred_bytes_total", {{"method", method}, {"direction", "out"}}),
            3000);
  EXPECT_EQ(e.sum("ferry_transferred_bytes_total", {{"direction", "in"}}), 0);
  EXPECT_EQ(e.sum("ferry_operations_started_total", {{"role", "passive"}}), 2);
  EXPECT_EQ(e.sum("ferry_operations_live"), 0);
  EXPECT_EQ(e.sum("ferry_operation_latency_seconds_count", {{"method", method}}), 1);
  EXPECT_EQ(e.sum("ferry_operation_wait_seconds_count", {{"method", method}}), 1);
  EXPECT_GE(e.sum("ferry_connections", {{"method", method}}), 1) << text;
  EXPECT_EQ(e.sum("ferry_peer_transferred_bytes_total",
                  {{"peer", "peer"}, {"peer_id", peer.identity().id}, {"direction", "out"}}),
            3000);
  ASSERT_EQ(e.find("ferry_connector_info").size(), 1u);
  EXPECT_EQ(e.find("ferry_connector_info")[0].labels.at("host"), owner.identity().host);
  // The active side: the bytes came in.
  const Exposition p = parse(peer.metrics());
  EXPECT_EQ(p.sum("ferry_transferred_bytes_total", {{"direction", "in"}}), 3000);
  EXPECT_EQ(p.sum("ferry_operations_total", {{"role", "active"}, {"kind", "read"}}), 1);
}

// A free TCP port on 127.0.0.1 (bound, then let go).
int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

// GET `path` from 127.0.0.1:`port`: the body, or nothing when the request failed.
std::optional<std::string> http_get(int port, const std::string& path) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return std::nullopt;
  }
  const std::string request = "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  if (::send(fd, request.data(), request.size(), MSG_NOSIGNAL) !=
      static_cast<ssize_t>(request.size())) {
    ::close(fd);
    return std::nullopt;
  }
  std::string response;
  char buf[16384];
  for (ssize_t n; (n = ::recv(fd, buf, sizeof buf, 0)) > 0;)
    response.append(buf, static_cast<std::size_t>(n));
  ::close(fd);
  const auto body = response.find("\r\n\r\n");
  if (response.rfind("HTTP/1.", 0) != 0 || body == std::string::npos) return std::nullopt;
  if (response.find(" 200 ") > response.find("\r\n")) return std::nullopt;
  return response.substr(body + 4);
}

TEST(Metrics, OneEndpointServesEveryConnectorOfTheProcessThatNamesIt) {
#if !FERRY_HAS_PROMETHEUS
  GTEST_SKIP() << "built without prometheus-cpp";
#endif
  const int port = free_port();
  ConnectorOptions a = test::named("scraped-a");
  a.metrics.listen = "127.0.0.1:" + std::to_string(port);
  ConnectorOptions b = test::named("scraped-b");
  b.metrics.listen = a.metrics.listen;
  auto first = std::make_unique<Connector>(a);
  Connector second(b);
  auto body = http_get(port, "/metrics");
  ASSERT_TRUE(body) << "nothing served at " << a.metrics.listen;
  const Exposition e = parse(*body);
  EXPECT_EQ(e.find("ferry_connector_info", {{"connector", "scraped-a"}}).size(), 1u) << *body;
  EXPECT_EQ(e.find("ferry_connector_info", {{"connector", "scraped-b"}}).size(), 1u);
  // A connector that ends leaves the endpoint; the other stays served.
  first.reset();
  body = http_get(port, "/metrics");
  ASSERT_TRUE(body);
  const Exposition after = parse(*body);
  EXPECT_TRUE(after.find("ferry_connector_info", {{"connector", "scraped-a"}}).empty());
  EXPECT_EQ(after.find("ferry_connector_info", {{"connector", "scraped-b"}}).size(), 1u);
}

TEST(Metrics, TheEnvironmentTurnsTheEndpointOn) {
#if !FERRY_HAS_PROMETHEUS
  GTEST_SKIP() << "built without prometheus-cpp";
#endif
  const int port = free_port();
  const std::string listen = "127.0.0.1:" + std::to_string(port);
  ::setenv("FERRY_METRICS_LISTEN", listen.c_str(), 1);
  {
    Connector c(test::named("from-env"));
    auto body = http_get(port, "/metrics");
    ASSERT_TRUE(body);
    EXPECT_NE(body->find("connector=\"from-env\""), std::string::npos);
  }
  ::unsetenv("FERRY_METRICS_LISTEN");
  {
    // Not where the connector says not to read the environment. (The server started above
    // stays for the process, serving only live connectors.)
    ::setenv("FERRY_METRICS_LISTEN", listen.c_str(), 1);
    ConnectorOptions o = test::named("not-from-env");
    o.use_environment = false;
    Connector c(o);
    auto body = http_get(port, "/metrics");
    ASSERT_TRUE(body);
    EXPECT_EQ(body->find("connector=\"not-from-env\""), std::string::npos) << *body;
    EXPECT_EQ(body->find("connector=\"from-env\""), std::string::npos) << *body;
    ::unsetenv("FERRY_METRICS_LISTEN");
  }
}

TEST(Metrics, AnAddressThatCannotBeServedIsRefusedAtConstruction) {
#if !FERRY_HAS_PROMETHEUS
  GTEST_SKIP() << "built without prometheus-cpp";
#endif
  // A port someone else listens at.
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(::listen(fd, 1), 0);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  for (const std::string& listen :
       {"127.0.0.1:" + std::to_string(ntohs(a.sin_port)), std::string("no-such-host:x")}) {
    ConnectorOptions o = test::named("refused");
    o.metrics.listen = listen;
    test::expect_error([&] { Connector c(o); }, ErrorCode::InvalidArgument,
                       "cannot serve metrics at '" + listen + "'");
  }
  ::close(fd);
}

#if !FERRY_HAS_PROMETHEUS
TEST(Metrics, ABuildWithoutPrometheusSaysSo) {
  Connector c(test::named("plain"));
  test::expect_error([&] { (void)c.metrics(); }, ErrorCode::Unsupported, "prometheus-cpp");
}
#endif

}  // namespace
}  // namespace ferry
