// transport/method_selector.hpp: which method an active operation uses, and what it says
// when there is none.
#include "transport/method_selector.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace ferry::transport {
namespace {

using namespace std::chrono_literals;

Capabilities caps(const std::string& method, int rank, std::uint8_t kinds = bit(MemoryKind::host),
                  bool same_host_only = false) {
  Capabilities c;
  c.method = method;
  c.rank = rank;
  c.memory_kinds = kinds;
  c.same_host_only = same_host_only;
  return c;
}

Endpoint ep(const std::string& method, const std::string& address = "10.0.0.1:1") {
  return Endpoint{method, address, {}};
}

MethodSelector::Needs needs(bool same_host = false, std::uint8_t kinds = bit(MemoryKind::host)) {
  MethodSelector::Needs n;
  n.peer = "00000000000000aa";
  n.peer_name = "P";
  n.same_host = same_host;
  n.memory_kinds = kinds;
  return n;
}

const std::uint8_t kHostAndCuda = bit(MemoryKind::host) | bit(MemoryKind::cuda);

std::vector<std::string> methods(const std::vector<Capabilities>& local,
                                 const std::vector<MethodSelector::Choice>& chosen) {
  std::vector<std::string> out;
  for (const auto& c : chosen) out.push_back(local.at(c.local).method);
  return out;
}

/// Why `method` is passed over for `peer` after a failure, or "" when it is not.
std::string failure_text(const MethodSelector& s, const std::string& peer,
                         const std::string& method) {
  const std::optional<Error> why = s.failure(peer, method);
  return why ? why->message() : std::string();
}

/// The NoCommonMethod message, or a test failure.
std::string refusal(const MethodSelector& s, const std::vector<Capabilities>& local,
                    const std::vector<Endpoint>& remote, const MethodSelector::Needs& n) {
  try {
    auto chosen = s.choose(local, remote, n);
    ADD_FAILURE() << "chose " << chosen.size() << " methods";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::NoCommonMethod) << e.what();
    return e.message();
  }
  return {};
}

TEST(MethodSelector, BestRankFirstAmongTheMethodsBothOffer) {
  MethodSelector s;
  const std::vector<Capabilities> local = {caps("tcp", 100), caps("fake", 50),
                                           caps("verbs", 300, kHostAndCuda), caps("cma", 200)};
  const std::vector<Endpoint> remote = {ep("fake", "fake:1"), ep("tcp", "10.0.0.1:7"),
                                        ep("verbs", "10.0.0.1:8"), ep("shm", "x")};
  auto chosen = s.choose(local, remote, needs());
  EXPECT_EQ(methods(local, chosen), (std::vector<std::string>{"verbs", "tcp", "fake"}));
  ASSERT_EQ(chosen.size(), 3u);
  EXPECT_EQ(chosen[0].local, 2u);
  EXPECT_EQ(chosen[0].endpoint.address, "10.0.0.1:8");
  EXPECT_EQ(chosen[1].endpoint.address, "10.0.0.1:7");
  EXPECT_EQ(chosen[2].endpoint.address, "fake:1");
}

TEST(MethodSelector, EqualRanksKeepTheLocalOrder) {
  MethodSelector s;
  const std::vector<Capabilities> local = {caps("b", 100), caps("a", 100), caps("c", 100)};
  auto chosen = s.choose(local, {ep("a"), ep("c"), ep("b")}, needs());
  EXPECT_EQ(methods(local, chosen), (std::vector<std::string>{"b", "a", "c"}));
}

TEST(MethodSelector, ThePeersFirstEndpointOfAMethodIsTheOneUsed) {
  MethodSelector s;
  const std::vector<Capabilities> local = {caps("tcp", 100)};
  auto chosen = s.choose(local, {ep("tcp", "10.0.0.1:1"), ep("tcp", "10.0.0.2:2")}, needs());
  ASSERT_EQ(chosen.size(), 1u);
  EXPECT_EQ(chosen[0].endpoint.address, "10.0.0.1:1");
}

TEST(MethodSelector, MethodsThatCannotMoveTheMemoryArePassedOver) {
  MethodSelector s;
  const std::vector<Capabilities> local = {caps("tcp", 100), caps("verbs", 300, kHostAndCuda)};
  const std::vector<Endpoint> remote = {ep("tcp"), ep("verbs")};
  EXPECT_EQ(methods(local, s.choose(local, remote, needs(false, kHostAndCuda))),
            (std::vector<std::string>{"verbs"}));
  // Without verbs, nothing moves cuda memory.
  const std::string text = refusal(s, {caps("tcp", 100)}, remote, needs(false, kHostAndCuda));
  EXPECT_EQ(text,
            "peer 'P' offers [tcp, verbs]; this connector has [tcp]; tcp: moves host memory, this "
            "operation needs host+cuda");
}

TEST(MethodSelector, SameHostOnlyMethodsOnlyOnOneHost) {
  MethodSelector s;
  const std::vector<Capabilities> local = {caps("tcp", 100),
                                           caps("cma", 200, bit(MemoryKind::host), true)};
  const std::vector<Endpoint> remote = {ep("cma"), ep("tcp")};
  EXPECT_EQ(methods(local, s.choose(local, remote, needs(true))),
            (std::vector<std::string>{"cma", "tcp"}));
  EXPECT_EQ(methods(local, s.choose(local, remote, needs(false))),
            (std::vector<std::string>{"tcp"}));
  const std::string text = refusal(s, {local[1]}, remote, needs(false));
  EXPECT_EQ(text,
            "peer 'P' offers [cma, tcp]; this connector has [cma]; cma: works on one host only");
}

TEST(MethodSelector, AFailedMethodIsPassedOverTowardThatPeerUntilItExpires) {
  MethodSelector s(100ms);
  const std::vector<Capabilities> local = {caps("tcp", 100), caps("verbs", 300)};
  const std::vector<Endpoint> remote = {ep("tcp"), ep("verbs")};
  s.failed("00000000000000aa", "verbs", Error(ErrorCode::Unsupported, "no route"));
  EXPECT_EQ(failure_text(s, "00000000000000aa", "verbs"),
            "failed before toward this peer (no route)");
  // The failure keeps its code.
  const std::optional<Error> remembered = s.failure("00000000000000aa", "verbs");
  ASSERT_TRUE(remembered);
  EXPECT_EQ(remembered->code(), ErrorCode::Unsupported);
  EXPECT_EQ(failure_text(s, "00000000000000aa", "tcp"), "");
  EXPECT_EQ(failure_text(s, "00000000000000bb", "verbs"), "");
  EXPECT_EQ(methods(local, s.choose(local, remote, needs())), (std::vector<std::string>{"tcp"}));
  // Another peer is not affected.
  MethodSelector::Needs other = needs();
  other.peer = "00000000000000bb";
  EXPECT_EQ(methods(local, s.choose(local, remote, other)),
            (std::vector<std::string>{"verbs", "tcp"}));
  // Once every shared method failed, the refusal says why each was passed over.
  s.failed("00000000000000aa", "tcp", Error(ErrorCode::Unsupported, "refused"));
  EXPECT_EQ(refusal(s, local, remote, needs()),
            "peer 'P' offers [tcp, verbs]; this connector has [tcp, verbs]; tcp: failed before "
            "toward this peer (refused); verbs: failed before toward this peer (no route)");
  std::this_thread::sleep_for(150ms);
  EXPECT_EQ(failure_text(s, "00000000000000aa", "verbs"), "");
  EXPECT_EQ(methods(local, s.choose(local, remote, needs())),
            (std::vector<std::string>{"verbs", "tcp"}));
}

TEST(MethodSelector, ALaterFailureRestartsTheClock) {
  MethodSelector s(200ms);
  const std::vector<Capabilities> local = {caps("tcp", 100), caps("verbs", 300)};
  const std::vector<Endpoint> remote = {ep("tcp"), ep("verbs")};
  s.failed("00000000000000aa", "verbs", Error(ErrorCode::Unsupported, "first"));
  std::this_thread::sleep_for(120ms);
  s.failed("00000000000000aa", "verbs", Error(ErrorCode::Unsupported, "second"));
  std::this_thread::sleep_for(120ms);  // 240 ms after the first, 120 ms after the second
  EXPECT_EQ(failure_text(s, "00000000000000aa", "verbs"),
            "failed before toward this peer (second)");
  EXPECT_EQ(methods(local, s.choose(local, remote, needs())), (std::vector<std::string>{"tcp"}));
}

TEST(MethodSelector, NoSharedMethodNamesWhatEachSideOffers) {
  MethodSelector s;
  EXPECT_EQ(refusal(s, {caps("tcp", 100)}, {ep("verbs"), ep("cma")}, needs()),
            "peer 'P' offers [verbs, cma]; this connector has [tcp]");
  EXPECT_EQ(refusal(s, {caps("tcp", 100), caps("fake", 50)}, {}, needs()),
            "peer 'P' offers []; this connector has [tcp, fake]");
}

TEST(MethodSelector, EveryReasonIsNamedWhenEverySharedMethodIsPassedOver) {
  MethodSelector s;
  const std::vector<Capabilities> local = {caps("tcp", 100),
                                           caps("cma", 200, bit(MemoryKind::host), true),
                                           caps("verbs", 300, kHostAndCuda)};
  s.failed("00000000000000aa", "verbs", Error(ErrorCode::Unsupported, "port down"));
  const std::string text =
      refusal(s, local, {ep("verbs"), ep("cma"), ep("tcp")}, needs(false, kHostAndCuda));
  EXPECT_EQ(text,
            "peer 'P' offers [verbs, cma, tcp]; this connector has [tcp, cma, verbs]; tcp: moves "
            "host memory, this operation needs host+cuda; cma: moves host memory, this operation "
            "needs host+cuda; verbs: failed before toward this peer (port down)");
}

}  // namespace
}  // namespace ferry::transport
