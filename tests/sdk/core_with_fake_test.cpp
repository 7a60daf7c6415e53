// Connectors with the in-process fake transport (tests/support/fake_transport.hpp): the four
// pairings over the fake alone, how a method is chosen and offered, falling back to tcp when
// the fake fails at set-up, and what the operations see when the fake's peer misbehaves.
#include <gtest/gtest.h>

#include <future>

#include <chrono>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include <ferry/ferry.hpp>

#include "build_config.hpp"
#include "tests/support/fake_transport.hpp"
#include "tests/support/patterns.hpp"
#include "tests/support/util.hpp"

namespace ferry {

// gtest prints these by name, not as bytes.
inline void PrintTo(ErrorCode code, std::ostream* os) { *os << to_string(code); }
inline void PrintTo(OperationStatus status, std::ostream* os) { *os << to_string(status); }

namespace {

using namespace std::chrono_literals;
using test::ended_with;
using test::FakeTransport;
using test::FakeTransportFactory;
using test::FaultPolicy;
using test::first_mismatch;

constexpr auto kWait = 30s;

ConnectorOptions options(std::string name, std::vector<std::string> transports) {
  ConnectorOptions o = test::named(std::move(name));
  o.transports = std::move(transports);
  o.use_environment = false;       // no FERRY_TRANSPORTS
  o.nats.use_environment = false;  // no FERRY_NATS_URL
  return o;
}

FakeTransport::Options ranked(int rank) {
  FakeTransport::Options o;
  o.rank = rank;
  return o;
}

std::vector<std::string> methods_of(const std::vector<Endpoint>& endpoints) {
  std::vector<std::string> out;
  for (const Endpoint& e : endpoints) out.push_back(e.method);
  return out;
}

/// `size` bytes of the pattern `seed` (0: zeros) in pieces of the given sizes.
struct Memory {
  std::vector<std::vector<std::byte>> pieces;
  std::vector<Descriptor> descriptors;
  Memory(const std::vector<std::size_t>& sizes, std::uint64_t seed) {
    std::uint64_t offset = 0;
    for (std::size_t size : sizes) {
      auto& p = pieces.emplace_back(size);
      if (seed != 0) test::fill_pattern(p.data(), size, seed, offset);
      descriptors.emplace_back(p.data(), size);
      offset += size;
    }
  }
  long long mismatch(std::uint64_t seed) const {
    std::uint64_t offset = 0;
    for (const auto& p : pieces) {
      if (long long at = first_mismatch(p.data(), p.size(), seed, offset); at >= 0)
        return static_cast<long long>(offset) + at;
      offset += p.size();
    }
    return -1;
  }
};

// ---------------------------------------------------------------------------------------
// The four pairings over the fake alone

class FakePairing : public ::testing::TestWithParam<test::Side> {
 protected:
  FakeTransportFactory fake_;
  Connector us_{options("us", {"fake"})};
  Connector them_{options("them", {"fake"})};
};

TEST_P(FakePairing, MovesEveryByte) {
  constexpr std::size_t kSize = (1u << 20) + 13;
  const std::vector<std::size_t> passive_cut = {1000, 524288, kSize - 525288};
  const std::vector<std::size_t> active_cut = {3, kSize - 3};
  // Which connector owns the passive operation, and which way the bytes go.
  const test::Side side = GetParam();
  const bool we_own = side == test::Side::OurReadable || side == test::Side::OurWritable;
  const bool reading = side == test::Side::OurReadable || side == test::Side::WeRead;
  Connector& owner = we_own ? us_ : them_;
  Connector& peer = we_own ? them_ : us_;
  Memory passive(passive_cut, reading ? 71 : 0);
  Memory active(active_cut, reading ? 0 : 71);

  Operation passive_op;
  Operation active_op;
  if (reading) {
    auto readable = owner.create_readable(passive.descriptors);
    ASSERT_EQ(methods_of(readable.metadata().endpoints), std::vector<std::string>{"fake"});
    active_op = peer.begin_read(readable.metadata(), active.descriptors);
    passive_op = std::move(readable);
  } else {
    auto writable = owner.create_writable(passive.descriptors);
    ASSERT_EQ(methods_of(writable.metadata().endpoints), std::vector<std::string>{"fake"});
    active_op = peer.begin_write(active.descriptors, writable.metadata());
    passive_op = std::move(writable);
  }
  ASSERT_TRUE(active_op.wait_for_completion(kWait));
  ASSERT_TRUE(passive_op.wait_for_completion(kWait));
  EXPECT_EQ(active_op.method(), "fake");
  EXPECT_EQ(passive_op.method(), "fake");
  EXPECT_EQ((reading ? active : passive).mismatch(71), -1);
  EXPECT_GE(fake_.control().chunks_served(), 2u);
}

INSTANTIATE_TEST_SUITE_P(Sides, FakePairing,
                         ::testing::Values(test::Side::OurReadable, test::Side::OurWritable,
                                           test::Side::WeRead, test::Side::WeWrite),
                         [](const auto& param) {
                           switch (param.param) {
                             case test::Side::OurReadable:
                               return "TheyReadOurReadable";
                             case test::Side::OurWritable:
                               return "TheyWriteOurWritable";
                             case test::Side::WeRead:
                               return "WeReadTheirReadable";
                             case test::Side::WeWrite:
                               return "WeWriteTheirWritable";
                           }
                           return "unknown";
                         });

TEST(FakeOnly, AMismatchedPairingIsRefused) {
  FakeTransportFactory fake;
  Connector owner(options("owner", {"fake"}));
  Connector peer(options("peer", {"fake"}));
  std::vector<std::byte> memory(64);
  auto readable = owner.create_readable(memory);
  try {
    auto write = peer.begin_write(memory, readable.metadata());
    ADD_FAILURE() << "a write paired with a readable";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::KindMismatch) << e.what();
  }
  EXPECT_EQ(fake.control().setup_attempts(), 0u);
}

// ---------------------------------------------------------------------------------------
// Which methods are offered and chosen

TEST(Selection, WithTcpAndALowerRankedFakeTcpWins) {
  FakeTransportFactory fake(ranked(50));
  Connector owner(options("owner", {"tcp", "fake"}));
  Connector peer(options("peer", {"tcp", "fake"}));
  EXPECT_EQ(methods_of(owner.endpoints()), (std::vector<std::string>{"tcp", "fake"}));
  Memory src({4096}, 72);
  Memory dst({4096}, 0);
  auto readable = owner.create_readable(src.descriptors);
  EXPECT_EQ(methods_of(readable.metadata().endpoints), (std::vector<std::string>{"tcp", "fake"}));
  auto read = peer.begin_read(readable.metadata(), dst.descriptors);
  ASSERT_TRUE(read.wait_for_completion(kWait));
  ASSERT_TRUE(readable.wait_for_completion(kWait));
  EXPECT_EQ(read.method(), "tcp");
  EXPECT_EQ(readable.method(), "tcp");
  EXPECT_EQ(fake.control().setup_attempts(), 0u);
  EXPECT_EQ(dst.mismatch(72), -1);
}

TEST(Selection, AHigherRankedFakeWins) {
  FakeTransportFactory fake(ranked(150));
  Connector owner(options("owner", {"tcp", "fake"}));
  Connector peer(options("peer", {"tcp", "fake"}));
  EXPECT_EQ(methods_of(owner.endpoints()), (std::vector<std::string>{"fake", "tcp"}));
  Memory src({4096}, 73);
  Memory dst({4096}, 0);
  auto writable = owner.create_writable(dst.descriptors);
  auto write = peer.begin_write(src.descriptors, writable.metadata());
  ASSERT_TRUE(write.wait_for_completion(kWait));
  ASSERT_TRUE(writable.wait_for_completion(kWait));
  EXPECT_EQ(write.method(), "fake");
  EXPECT_EQ(writable.method(), "fake");
  EXPECT_EQ(dst.mismatch(73), -1);
}

TEST(Selection, TransportsTcpOffersOnlyTcp) {
  FakeTransportFactory fake(ranked(150));
  Connector owner(options("owner", {"tcp"}));
  EXPECT_EQ(methods_of(owner.endpoints()), std::vector<std::string>{"tcp"});
  std::vector<std::byte> memory(64);
  auto readable = owner.create_readable(memory);
  EXPECT_EQ(methods_of(readable.metadata().endpoints), std::vector<std::string>{"tcp"});
  EXPECT_EQ(fake.control().transports_made(), 0u) << "a left-out method was started";
}

TEST(Selection, APeerThatLeftTheFakeOutIsReachedByTcp) {
  FakeTransportFactory fake(ranked(150));
  Connector owner(options("owner", {"tcp", "fake"}));
  Connector peer(options("peer", {"tcp"}));
  Memory src({4096}, 74);
  Memory dst({4096}, 0);
  auto readable = owner.create_readable(src.descriptors);
  auto read = peer.begin_read(readable.metadata(), dst.descriptors);
  ASSERT_TRUE(read.wait_for_completion(kWait));
  EXPECT_EQ(read.method(), "tcp");
  EXPECT_EQ(fake.control().setup_attempts(), 0u);
}

TEST(Selection, NoMethodInCommonIsRefusedAtBegin) {
  FakeTransportFactory fake;
  Connector owner(options("owner", {"fake"}));
  Connector peer(options("peer", {"tcp"}));
  std::vector<std::byte> memory(64);
  auto readable = owner.create_readable(memory);
  try {
    auto read = peer.begin_read(readable.metadata(), memory);
    ADD_FAILURE() << "began a read with no method in common";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::NoCommonMethod) << e.what();
    EXPECT_EQ(e.message(), "peer 'owner' offers [fake]; this connector has [tcp]");
  }
}

/// The methods this build has, in the registry's order.
const std::string kBuilt = std::string("tcp, cma")
#if FERRY_HAS_VERBS
                           + ", verbs"
#endif
#if FERRY_HAS_CUDA
                           + ", cuda_ipc"
#endif
    ;

TEST(Selection, AnUnknownTransportNameIsAnInvalidArgument) {
  FakeTransportFactory fake;
  try {
    Connector c(options("c", {"fake", "carrier-pigeon"}));
    ADD_FAILURE() << "a connector started with an unknown method";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidArgument) << e.what();
    EXPECT_EQ(e.message(),
              "transports: unknown method 'carrier-pigeon' (this build has " + kBuilt + ", fake)");
  }
}

TEST(Selection, AMethodNotAvailableHereIsAbsentAndSaysWhy) {
  FakeTransportFactory fake;
  fake.set_available(false);
  try {
    Connector c(options("c", {"fake"}));
    ADD_FAILURE() << "a connector started without a method";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Unsupported) << e.what();
    const std::string left_out =
        ": left out by the transports option (ConnectorOptions::transports or FERRY_TRANSPORTS)";
    std::string expected =
        "no transfer method is available here (tcp" + left_out + "; cma" + left_out + "; ";
    if (kBuilt.find("verbs") != std::string::npos) expected += "verbs" + left_out + "; ";
    if (kBuilt.find("cuda_ipc") != std::string::npos) expected += "cuda_ipc" + left_out + "; ";
    EXPECT_EQ(e.message(), expected + "fake: switched off by the test)");
  }
  Connector without(options("without", {}));
  EXPECT_EQ(methods_of(without.endpoints()), (std::vector<std::string>{"cma", "tcp"}));
}

// endpoint_allow holds networks: an endpoint whose address is no IP (the fake's "fake:<n>")
// is refused once the list is set, whatever the method. Documented for EndpointFilter; a
// method that is not network-based (cma, say) would be refused the same way.
TEST(Selection, EndpointAllowRefusesAnEndpointThatIsNoIpAddress) {
  FakeTransportFactory fake;
  Connector owner(options("owner", {"fake"}));
  ConnectorOptions o = options("peer", {"fake"});
  o.endpoint_allow = {"127.0.0.0/8", "::1/128"};
  Connector peer(o);
  std::vector<std::byte> memory(64);
  std::vector<std::byte> dst(64);
  auto readable = owner.create_readable(memory);
  try {
    auto read = peer.begin_read(readable.metadata(), dst);
    ADD_FAILURE() << "connected to an endpoint outside endpoint_allow";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::AccessDenied) << e.what();
    EXPECT_NE(e.message().find("outside ConnectorOptions::endpoint_allow (fake fake:"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(fake.control().setup_attempts(), 0u);
}

// ---------------------------------------------------------------------------------------
// A fake that fails at set-up: tcp takes over, and the failure is remembered

void falls_back_to_tcp(FaultPolicy::Setup how) {
  FakeTransportFactory fake(ranked(150));
  FaultPolicy policy;
  policy.setup = how;
  policy.setup_code = ErrorCode::Unsupported;
  fake.control().set_policy(policy);
  Connector owner(options("owner", {"tcp", "fake"}));
  Connector peer(options("peer", {"tcp", "fake"}));

  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE("operation " + std::to_string(round + 1));
    Memory src({65536}, 80 + round);
    Memory dst({65536}, 0);
    auto readable = owner.create_readable(src.descriptors);
    EXPECT_EQ(methods_of(readable.metadata().endpoints), (std::vector<std::string>{"fake", "tcp"}));
    auto read = peer.begin_read(readable.metadata(), dst.descriptors);
    ASSERT_TRUE(read.wait_for_completion(kWait));
    ASSERT_TRUE(readable.wait_for_completion(kWait));
    EXPECT_EQ(read.method(), "tcp");
    EXPECT_EQ(readable.method(), "tcp");
    EXPECT_EQ(dst.mismatch(80 + static_cast<std::uint64_t>(round)), -1);
    // Tried once, for the first operation; the selector remembers the failure for this peer.
    EXPECT_EQ(fake.control().setup_attempts(), 1u);
  }
  EXPECT_EQ(fake.control().chunks_served(), 0u);
}

TEST(Fallback, AFakeThatThrowsAtSetUpFallsBackToTcp) {
  falls_back_to_tcp(FaultPolicy::Setup::throw_error);
}

TEST(Fallback, AFakeThatReportsASetUpFailureFallsBackToTcp) {
  falls_back_to_tcp(FaultPolicy::Setup::report_failure);
}

TEST(Fallback, TheFailureIsRememberedPerPeer) {
  FakeTransportFactory fake(ranked(150));
  FaultPolicy policy;
  policy.setup = FaultPolicy::Setup::throw_error;
  fake.control().set_policy(policy);
  Connector first(options("first", {"tcp", "fake"}));
  Connector second(options("second", {"tcp", "fake"}));
  Connector peer(options("peer", {"tcp", "fake"}));
  std::vector<std::byte> a(64);
  std::vector<std::byte> b(64);
  std::vector<std::byte> dst(64);
  auto from_first = first.create_readable(a);
  auto read1 = peer.begin_read(from_first.metadata(), dst);
  ASSERT_TRUE(read1.wait_for_completion(kWait));
  EXPECT_EQ(fake.control().setup_attempts(), 1u);
  // Another peer: the fake is tried again (and fails again).
  auto from_second = second.create_readable(b);
  auto read2 = peer.begin_read(from_second.metadata(), dst);
  ASSERT_TRUE(read2.wait_for_completion(kWait));
  EXPECT_EQ(fake.control().setup_attempts(), 2u);
  EXPECT_EQ(read2.method(), "tcp");
}

TEST(Fallback, WithNothingToFallBackToASetUpRefusalIsTheOperationsError) {
  FakeTransportFactory fake;
  FaultPolicy policy;
  policy.setup = FaultPolicy::Setup::report_failure;
  policy.setup_code = ErrorCode::AccessDenied;
  fake.control().set_policy(policy);
  Connector owner(options("owner", {"fake"}));
  Connector peer(options("peer", {"fake"}));
  std::vector<std::byte> memory(64);
  std::vector<std::byte> dst(64);
  auto readable = owner.create_readable(memory);
  auto read = peer.begin_read(readable.metadata(), dst);
  EXPECT_EQ(ended_with(read, 10s), ErrorCode::AccessDenied);
  EXPECT_NE(read.error()->message().find("set-up refused by the test's fault policy"),
            std::string::npos)
      << read.error()->message();
}

// begin_read does not throw a refusal only the transport's set-up finds: it ends the
// operation with NoCommonMethod, from every thread.
TEST(Fallback, WithNothingToFallBackToASetUpRefusalIsNoCommonMethod) {
  FakeTransportFactory fake;
  FaultPolicy policy;
  policy.setup = FaultPolicy::Setup::throw_error;
  fake.control().set_policy(policy);
  Connector owner(options("owner", {"fake"}));
  Connector peer(options("peer", {"fake"}));
  std::vector<std::byte> memory(64);
  auto readable = owner.create_readable(memory);
  auto read = peer.begin_read(readable.metadata(), memory);
  try {
    read.wait_for_completion();
    ADD_FAILURE() << "completed a read whose only method refused";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::NoCommonMethod) << e.what();
    EXPECT_NE(e.message().find("no method could reach peer 'owner' (fake: "), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(read.status(), OperationStatus::errored);

  // The refusal is remembered for this peer: the next begin_read, on the loop thread, ends
  // with NoCommonMethod that says so, and the fake is not asked again.
  std::promise<std::optional<Error>> ended;
  readable = owner.create_readable(memory);
  auto copy = readable.metadata();
  read = peer.begin_read(copy, memory);
  ReadOperation again;
  read.on_complete([&](OperationStatus, const Error*) {
    try {
      again = peer.begin_read(copy, memory);
      again.on_complete([&](OperationStatus, const Error* e) {
        ended.set_value(e != nullptr ? std::optional<Error>(*e) : std::nullopt);
      });
    } catch (const Error& e) {
      ADD_FAILURE() << "begin_read threw on the loop thread: " << e.what();
      ended.set_value(std::nullopt);
    }
  });
  const std::optional<Error> error = ended.get_future().get();
  ASSERT_TRUE(error);
  EXPECT_EQ(error->code(), ErrorCode::NoCommonMethod) << error->what();
  EXPECT_NE(error->message().find("fake: failed before toward this peer"), std::string::npos)
      << error->what();
  EXPECT_EQ(fake.control().setup_attempts(), 1u);
}

// A method's refusal at set-up reaches the caller of begin_read the same way from every thread:
// the call returns the operation, which ends errored with the refusal, and its callbacks run
// after the call has returned. (Checks of the arguments and the metadata are still thrown.)
TEST(SetUpRefusal, IsTheOperationsErrorFromAForeignThreadAndFromTheLoopThread) {
  FakeTransportFactory fake;
  FaultPolicy policy;
  policy.setup = FaultPolicy::Setup::throw_error;
  // Retryable: the refusal is not remembered for the peer, so that each begin_read meets it
  // at the fake's start().
  policy.setup_code = ErrorCode::PeerLost;
  fake.control().set_policy(policy);
  Connector owner(options("owner", {"fake"}));
  Connector peer(options("peer", {"fake"}));
  std::vector<std::byte> memory(64);
  std::vector<std::byte> dst(64);
  auto readable = owner.create_readable(memory);
  const RdmaMetadata metadata = readable.metadata();
  auto writable = owner.create_writable(memory);

  // From a foreign thread (this one).
  auto from_foreign = peer.begin_read(metadata, dst);
  EXPECT_EQ(ended_with(from_foreign, 10s), ErrorCode::NoCommonMethod);
  const std::string refusal = from_foreign.error()->message();
  EXPECT_NE(refusal.find("set-up refused by the test's fault policy"), std::string::npos)
      << refusal;

  // From the loop thread: inside a completion callback of the peer's connector.
  struct Seen {
    std::optional<Error> thrown;             // what begin_read threw, if it threw
    std::optional<Error> error;              // the operation's error, as its callback saw it
    bool caller_returned = false;            // the callback that called begin_read returned
    bool callback_after_return = false;      // the operation's callback ran after that
    std::optional<ErrorCode> kind_mismatch;  // what a wrong pairing threw there
  };
  Seen seen;
  std::promise<void> done;
  ReadOperation from_loop;  // kept: dropping it would cancel it
  from_foreign.on_complete([&](OperationStatus, const Error*) {
    try {
      from_loop = peer.begin_read(metadata, dst);
      from_loop.on_complete([&](OperationStatus, const Error* e) {
        if (e != nullptr) seen.error = *e;
        seen.callback_after_return = seen.caller_returned;
        done.set_value();
      });
    } catch (const Error& e) {
      seen.thrown = e;
    }
    try {
      ReadOperation wrong = peer.begin_read(writable.metadata(), dst);
    } catch (const Error& e) {
      seen.kind_mismatch = e.code();
    }
    seen.caller_returned = true;
    if (seen.thrown) done.set_value();
  });
  ASSERT_EQ(done.get_future().wait_for(10s), std::future_status::ready);
  EXPECT_FALSE(seen.thrown) << "begin_read threw on the loop thread: " << seen.thrown->what();
  ASSERT_TRUE(seen.error);
  EXPECT_EQ(seen.error->code(), ErrorCode::NoCommonMethod) << seen.error->what();
  EXPECT_EQ(seen.error->message(), refusal);
  EXPECT_TRUE(seen.callback_after_return);
  EXPECT_EQ(from_loop.status(), OperationStatus::errored);
  EXPECT_EQ(seen.kind_mismatch, ErrorCode::KindMismatch);
  EXPECT_EQ(fake.control().setup_attempts(), 2u);
}

// ---------------------------------------------------------------------------------------
// A misbehaving peer, seen through the operations

TEST(FakePeer, ADroppedLinkErrorsBothSidesWithPeerLost) {
  FakeTransportFactory fake;
  FaultPolicy policy;
  policy.drop_after_chunks = 2;
  fake.control().set_policy(policy);
  Connector owner(options("owner", {"fake"}));
  Connector peer(options("peer", {"fake"}));
  Memory src({1u << 20}, 90);
  Memory dst({1u << 20}, 0);
  auto readable = owner.create_readable(src.descriptors);
  auto read = peer.begin_read(readable.metadata(), dst.descriptors);
  EXPECT_EQ(ended_with(read, 10s), ErrorCode::PeerLost);
  EXPECT_NE(read.error()->message().find("'owner'"), std::string::npos) << read.error()->message();
  EXPECT_EQ(ended_with(readable, 10s), ErrorCode::PeerLost);
  EXPECT_NE(readable.error()->message().find("'peer'"), std::string::npos)
      << readable.error()->message();
}

TEST(FakePeer, CancellingAStalledReadTellsTheOwner) {
  FakeTransportFactory fake;
  FaultPolicy policy;
  policy.stall_after_chunks = 1;
  fake.control().set_policy(policy);
  Connector owner(options("owner", {"fake"}));
  Connector peer(options("peer", {"fake"}));
  Memory src({1u << 20}, 91);
  Memory dst({1u << 20}, 0);
  auto readable = owner.create_readable(src.descriptors);
  auto read = peer.begin_read(readable.metadata(), dst.descriptors);
  ASSERT_TRUE(test::eventually([&] { return readable.status() == OperationStatus::in_progress; }));
  EXPECT_EQ(read.status(), OperationStatus::in_progress);
  read.cancel();
  EXPECT_EQ(read.status(), OperationStatus::cancelled);
  EXPECT_EQ(ended_with(readable, 10s), ErrorCode::Cancelled);
  EXPECT_NE(readable.error()->message().find("'peer'"), std::string::npos)
      << readable.error()->message();
  // The token died with it.
  auto again = peer.begin_read(readable.metadata(), dst.descriptors);
  EXPECT_EQ(ended_with(again, 10s), ErrorCode::AccessDenied);
}

TEST(FakePeer, AStalledWriteMeetsItsDeadlineAndTheOwnerHearsWhy) {
  FakeTransportFactory fake;
  FaultPolicy policy;
  policy.stall_after_chunks = 1;
  fake.control().set_policy(policy);
  Connector owner(options("owner", {"fake"}));
  Connector peer(options("peer", {"fake"}));
  Memory src({1u << 20}, 92);
  Memory dst({1u << 20}, 0);
  auto writable = owner.create_writable(dst.descriptors);
  OperationOptions deadline;
  deadline.timeout = 200ms;
  auto write = peer.begin_write(src.descriptors, writable.metadata(), deadline);
  EXPECT_EQ(ended_with(write, 10s), ErrorCode::Timeout);
  EXPECT_EQ(ended_with(writable, 10s), ErrorCode::Timeout);
  EXPECT_NE(writable.error()->message().find("deadline of 200 ms"), std::string::npos)
      << writable.error()->message();
}

TEST(FakePeer, CancellingThePassiveSideFailsTheStalledPeer) {
  FakeTransportFactory fake;
  FaultPolicy policy;
  policy.stall_after_chunks = 1;
  fake.control().set_policy(policy);
  Connector owner(options("owner", {"fake"}));
  Connector peer(options("peer", {"fake"}));
  Memory src({1u << 20}, 93);
  Memory dst({1u << 20}, 0);
  auto readable = owner.create_readable(src.descriptors);
  auto read = peer.begin_read(readable.metadata(), dst.descriptors);
  ASSERT_TRUE(test::eventually([&] { return readable.status() == OperationStatus::in_progress; }));
  readable.cancel();
  EXPECT_EQ(readable.status(), OperationStatus::cancelled);
  EXPECT_EQ(ended_with(read, 10s), ErrorCode::Cancelled);
  EXPECT_NE(read.error()->message().find("'owner'"), std::string::npos) << read.error()->message();
}

TEST(FakePeer, ClosingTheOwnersConnectorFailsThePeerInBoundedTime) {
  FakeTransportFactory fake;
  FaultPolicy policy;
  policy.stall_after_chunks = 1;
  fake.control().set_policy(policy);
  Connector peer(options("peer", {"fake"}));
  Memory src({1u << 20}, 94);
  Memory dst({1u << 20}, 0);
  ReadOperation read;
  {
    Connector owner(options("owner", {"fake"}));
    auto readable = owner.create_readable(src.descriptors);
    read = peer.begin_read(readable.metadata(), dst.descriptors);
    ASSERT_TRUE(
        test::eventually([&] { return readable.status() == OperationStatus::in_progress; }));
  }
  const ErrorCode code = ended_with(read, 5s);
  EXPECT_TRUE(code == ErrorCode::PeerLost || code == ErrorCode::Cancelled) << to_string(code);
  EXPECT_NE(read.error()->message().find("'owner'"), std::string::npos) << read.error()->message();
}

TEST(FakePeer, AnExpiredReadableRefusesALatePeer) {
  FakeTransportFactory fake;
  Connector owner(options("owner", {"fake"}));
  Connector peer(options("peer", {"fake"}));
  std::vector<std::byte> memory(4096);
  std::vector<std::byte> dst(4096);
  OperationOptions deadline;
  deadline.timeout = 50ms;
  auto readable = owner.create_readable(memory, deadline);
  EXPECT_EQ(ended_with(readable, 10s), ErrorCode::Timeout);
  auto read = peer.begin_read(readable.metadata(), dst);
  EXPECT_EQ(ended_with(read, 10s), ErrorCode::AccessDenied);
  EXPECT_NE(read.error()->message().find("no live operation matches this id and token"),
            std::string::npos)
      << read.error()->message();
}

// One peer per operation across methods: once claimed by one method, the others stop
// serving it (a second peer there is refused).
TEST(FakePeer, AReadableClaimedByOneMethodIsRefusedToAPeerOfAnother) {
  FakeTransportFactory fake(ranked(150));
  FaultPolicy policy;
  policy.stall_after_chunks = 1;  // the fake's claimant stays mid-transfer
  fake.control().set_policy(policy);
  Connector owner(options("owner", {"tcp", "fake"}));
  Connector claimant(options("claimant", {"fake"}));
  Connector intruder(options("intruder", {"tcp"}));
  Memory src({1u << 20}, 95);
  Memory mine({1u << 20}, 0);
  Memory theirs({1u << 20}, 0);
  auto readable = owner.create_readable(src.descriptors);
  auto read = claimant.begin_read(readable.metadata(), mine.descriptors);
  ASSERT_TRUE(test::eventually([&] { return readable.status() == OperationStatus::in_progress; }));
  EXPECT_EQ(readable.method(), "fake");
  auto intrusion = intruder.begin_read(readable.metadata(), theirs.descriptors);
  EXPECT_EQ(ended_with(intrusion, 10s), ErrorCode::AccessDenied);
  EXPECT_NE(readable.status(), OperationStatus::complete)
      << "the readable completed while its claimant had read one chunk";
  EXPECT_EQ(readable.method(), "fake");
  read.cancel();
}

}  // namespace
}  // namespace ferry
