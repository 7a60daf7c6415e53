// Bad input at the public API gets a clear error at the call that caused it.
#include <gtest/gtest.h>

#include <ferry/ferry.hpp>

#include <array>
#include <functional>
#include <span>
#include <thread>

#include "tests/support/patterns.hpp"
#include "tests/support/util.hpp"

namespace ferry {
namespace {

using test::expect_error;

TEST(Device, ParsesItsForms) {
  EXPECT_EQ(Device("host"), Device::host());
  EXPECT_EQ(Device("cpu"), Device::host());
  EXPECT_EQ(Device("cuda"), Device::cuda(0));
  EXPECT_EQ(Device("cuda:7").id(), 7);
  EXPECT_EQ(Device("cuda:7").kind(), DeviceKind::cuda);
  EXPECT_EQ(Device::cuda(2).to_string(), "cuda:2");
  EXPECT_EQ(Device(Device::cuda(2).to_string()), Device::cuda(2));
}

TEST(Device, RejectsBadStrings) {
  for (const char* bad : {"", "gpu", "cuda:", "cuda:-1", "cuda:1x", "CUDA:1", "host "}) {
    expect_error([&] { Device d(bad); }, ErrorCode::InvalidArgument, "is not one of");
  }
  expect_error([] { Device::cuda(-1); }, ErrorCode::InvalidArgument, "< 0");
}

TEST(Descriptor, RefusesNullPointerAndZeroSize) {
  char byte = 0;
  expect_error([] { Descriptor d(nullptr, 16); }, ErrorCode::InvalidArgument, "null");
  expect_error([&] { Descriptor d(&byte, 0); }, ErrorCode::InvalidArgument, "empty (0 bytes)");
  // An empty vector's data() may be null: the message says what is wrong, that it is empty.
  std::vector<char> none;
  expect_error([&] { Descriptor d(none.data(), none.size()); }, ErrorCode::InvalidArgument,
               "empty (0 bytes)");
  expect_error([&] { Descriptor d(none); }, ErrorCode::InvalidArgument, "empty (0 bytes)");
  std::vector<int> ints(8);
  Descriptor d{std::span<int>(ints)};
  EXPECT_EQ(d.size(), 32u);
  EXPECT_EQ(d.ptr(), ints.data());
}

TEST(Descriptor, TakesTypedContiguousRangesAsTheirBytes) {
  std::vector<float> floats(10);
  Descriptor f(floats);
  EXPECT_EQ(f.ptr(), floats.data());
  EXPECT_EQ(f.size(), 40u);
  EXPECT_FALSE(f.is_read_only());
  const std::vector<double> fixed(3);
  Descriptor c(fixed);
  EXPECT_EQ(c.size(), 24u);
  EXPECT_TRUE(c.is_read_only());  // const elements: never written by ferry
  std::array<std::uint16_t, 5> shorts{};
  EXPECT_EQ(Descriptor(shorts).size(), 10u);
  std::string text = "kv";
  EXPECT_EQ(Descriptor(text).ptr(), text.data());
  struct Pair {
    int a;
    float b;
  };
  std::vector<Pair> pairs(2);
  EXPECT_EQ(Descriptor(pairs).size(), 2 * sizeof(Pair));
}

TEST(Error, WhatNamesCodeFieldAndMessage) {
  Error e(ErrorCode::InvalidMetadata, "must be positive", "descriptors[0].size");
  EXPECT_STREQ(e.what(), "InvalidMetadata: descriptors[0].size: must be positive");
  EXPECT_EQ(e.message(), "must be positive");
  EXPECT_FALSE(e.retryable());
  EXPECT_TRUE(Error(ErrorCode::PeerLost, "x").retryable());
  EXPECT_TRUE(Error(ErrorCode::Timeout, "x").retryable());
  Error gone(ErrorCode::PeerLost, "the process is gone");
  gone.set_retryable(false);
  const Error copied = gone;  // what an operation's error() hands out
  EXPECT_FALSE(copied.retryable());
}

TEST(OperationHandle, EmptyHandleIsUninitializedAndRefusesCalls) {
  ReadOperation op;
  EXPECT_FALSE(op);
  EXPECT_EQ(op.status(), OperationStatus::uninitialized);
  expect_error([&] { op.wait_for_completion(); }, ErrorCode::InvalidState, "empty");
  expect_error([&] { op.cancel(); }, ErrorCode::InvalidState, "empty");
  ReadableOperation passive;
  expect_error([&] { (void)passive.metadata(); }, ErrorCode::InvalidState, "empty");
}

class PairingTest : public ::testing::Test {
 protected:
  Connector owner_{test::named("owner")};
  Connector peer_{test::named("peer")};
  std::vector<std::byte> a_ = test::buffer(4096);
  std::vector<std::byte> b_ = test::buffer(4096);
};

TEST_F(PairingTest, ReadOfAWritableIsAKindMismatch) {
  auto writable = owner_.create_writable({Descriptor(a_.data(), a_.size())});
  expect_error([&] { (void)peer_.begin_read(writable.metadata(), {Descriptor(b_.data(), 4096)}); },
               ErrorCode::KindMismatch, "begin_read needs the metadata of a readable");
  EXPECT_EQ(writable.status(), OperationStatus::initialized);
}

TEST_F(PairingTest, WriteToAReadableIsAKindMismatch) {
  auto readable = owner_.create_readable({Descriptor(a_.data(), a_.size())});
  expect_error([&] { (void)peer_.begin_write({Descriptor(b_.data(), 4096)}, readable.metadata()); },
               ErrorCode::KindMismatch, "begin_write needs the metadata of a writable");
}

TEST_F(PairingTest, UnequalTotalsAreASizeMismatch) {
  auto readable = owner_.create_readable({Descriptor(a_.data(), 4096)});
  expect_error([&] { (void)peer_.begin_read(readable.metadata(), {Descriptor(b_.data(), 4095)}); },
               ErrorCode::SizeMismatch, "hold 4096 bytes, the local ones 4095");
  auto writable =
      owner_.create_writable({Descriptor(a_.data(), 100), Descriptor(a_.data() + 200, 100)});
  expect_error([&] { (void)peer_.begin_write({Descriptor(b_.data(), 201)}, writable.metadata()); },
               ErrorCode::SizeMismatch, "hold 200 bytes, the local ones 201");
}

TEST_F(PairingTest, EmptyListsAreRefused) {
  expect_error([&] { (void)owner_.create_readable({}); }, ErrorCode::InvalidArgument, "empty");
  expect_error([&] { (void)owner_.create_writable({}); }, ErrorCode::InvalidArgument, "empty");
  auto readable = owner_.create_readable({Descriptor(a_.data(), 4096)});
  expect_error([&] { (void)peer_.begin_read(readable.metadata(), {}); }, ErrorCode::InvalidArgument,
               "empty");
}

TEST_F(PairingTest, MetadataIsValidatedAtBegin) {
  auto readable = owner_.create_readable({Descriptor(a_.data(), 4096)});
  RdmaMetadata m = readable.metadata();
  m.version = 9;
  expect_error([&] { (void)peer_.begin_read(m, {Descriptor(b_.data(), 4096)}); },
               ErrorCode::InvalidMetadata, "unknown version 9");
}

TEST_F(PairingTest, NoMethodInCommonIsRefused) {
  auto readable = owner_.create_readable({Descriptor(a_.data(), 4096)});
  RdmaMetadata m = readable.metadata();
  m.endpoints = {{"verbs", "mlx5_0:1"}, {"carrier-pigeon", "loft 3"}};
  expect_error([&] { (void)peer_.begin_read(m, {Descriptor(b_.data(), 4096)}); },
               ErrorCode::NoCommonMethod,
               "offers [verbs, carrier-pigeon]; this connector has [cma, tcp]");
}

TEST_F(PairingTest, UnparsableTcpAddressIsInvalidMetadata) {
  auto readable = owner_.create_readable({Descriptor(a_.data(), 4096)});
  RdmaMetadata m = readable.metadata();
  m.endpoints = {{"tcp", "localhost:80"}};
  expect_error([&] { (void)peer_.begin_read(m, {Descriptor(b_.data(), 4096)}); },
               ErrorCode::InvalidMetadata, "not a numeric ip:port");
}

TEST_F(PairingTest, MetadataDescribesTheOperation) {
  auto readable = owner_.create_readable({Descriptor(a_.data(), 1000), Descriptor(b_.data(), 24)});
  const RdmaMetadata& m = readable.metadata();
  EXPECT_EQ(m.operation_kind, OperationKind::read);
  EXPECT_EQ(m.notification_key, readable.id());
  EXPECT_EQ(m.owner, owner_.identity());
  EXPECT_EQ(m.owner.name, "owner");
  EXPECT_EQ(m.endpoints, owner_.endpoints());
  ASSERT_EQ(m.descriptors.size(), 2u);
  EXPECT_EQ(m.descriptors[0].ptr, reinterpret_cast<std::uint64_t>(a_.data()));
  EXPECT_EQ(m.descriptors[1].size, 24u);
  EXPECT_EQ(m.token.size(), 32u);
  auto other = owner_.create_readable({Descriptor(a_.data(), 1000)});
  EXPECT_NE(other.metadata().token, m.token);
  EXPECT_NE(other.id(), readable.id());
}

TEST(ConnectorOptions, BadOptionsAreRefused) {
  ConnectorOptions o = test::tcp_only("wildcard");
  o.tcp.bind_address = "not-an-ip";
  expect_error([&] { Connector c(o); }, ErrorCode::InvalidArgument, "not a numeric IP address");
  o.tcp.bind_address = "0.0.0.0";
  expect_error([&] { Connector c(o); }, ErrorCode::InvalidArgument, "needs tcp.advertise_address");
  o = ConnectorOptions{};
  o.name = std::string(257, 'n');
  expect_error([&] { Connector c(o); }, ErrorCode::InvalidArgument, "longer than 256");
  o = ConnectorOptions{};
  o.peer_timeout = std::chrono::milliseconds(0);
  expect_error([&] { Connector c(o); }, ErrorCode::InvalidArgument, "peer_timeout");
  o = ConnectorOptions{};
  o.tcp.chunk_size = 1 << 20;
  o.tcp.window = 1 << 10;
  expect_error([&] { Connector c(o); }, ErrorCode::InvalidArgument, "tcp.window");
}

TEST(ConnectorOptions, NamesMustBeValidUtf8) {
  for (std::string bad :
       {std::string("caf\xe9"), std::string("a\xc0\xaf"), std::string("line\nbreak")}) {
    ConnectorOptions o = test::named(bad);
    expect_error([&] { Connector c(o); }, ErrorCode::InvalidArgument, "connector's name");
  }
  ConnectorOptions ok = test::named("caf\xc3\xa9");  // valid UTF-8 stays allowed
  Connector c(ok);
  EXPECT_EQ(c.identity().name, "caf\xc3\xa9");
}

TEST(ConnectorOptions, UnknownTransportsAreRefused) {
  ConnectorOptions o = test::named("picky");
  o.transports = {"carrier-pigeon"};
  expect_error([&] { Connector c(o); }, ErrorCode::InvalidArgument, "carrier-pigeon");
}

TEST(ConnectorOptions, BadEndpointAllowListsAreRefused) {
  for (const char* bad : {"10.0.0.0/33", "not-an-ip/8", "10.0.0.0/", "::1/129"}) {
    ConnectorOptions o = test::named("filtered");
    o.endpoint_allow = {bad};
    expect_error([&] { Connector c(o); }, ErrorCode::InvalidArgument, "endpoint_allow");
  }
}

// Metadata names the address to connect to; with an allow-list, nothing outside it is dialled.
TEST(ConnectorOptions, EndpointsOutsideTheAllowListAreNotContacted) {
  Connector owner(test::named("owner"));
  auto src = test::patterned(4096, 5);
  auto dst = test::buffer(4096);
  ConnectorOptions elsewhere = test::named("fenced");
  // Neither loopback: not the owner's tcp address, nor its cma socket on this host.
  elsewhere.endpoint_allow = {"10.0.0.0/8", "fd00::/8"};
  Connector fenced(elsewhere);
  auto readable = owner.create_readable({Descriptor(src.data(), src.size())});
  expect_error(
      [&] { (void)fenced.begin_read(readable.metadata(), {Descriptor(dst.data(), 4096)}); },
      ErrorCode::AccessDenied, "endpoint_allow");
  ConnectorOptions loopback = test::named("loopback-only");
  loopback.endpoint_allow = {"127.0.0.0/8"};
  Connector allowed(loopback);
  auto read = allowed.begin_read(readable.metadata(), {Descriptor(dst.data(), 4096)});
  ASSERT_TRUE(read.wait_for_completion(std::chrono::seconds(10)));
  EXPECT_EQ(test::first_mismatch(dst.data(), dst.size(), 5), -1);
}

TEST_F(PairingTest, MoreDescriptorsThanMetadataCarriesAreRefusedAtTheCall) {
  auto buf = test::buffer(RdmaMetadata::kMaxDescriptors + 1);
  std::vector<Descriptor> many;
  for (std::size_t i = 0; i < RdmaMetadata::kMaxDescriptors + 1; ++i)
    many.emplace_back(buf.data() + i, 1);
  expect_error([&] { (void)owner_.create_readable(many); }, ErrorCode::InvalidArgument,
               "at most " + std::to_string(RdmaMetadata::kMaxDescriptors));
  expect_error([&] { (void)owner_.create_writable(many); }, ErrorCode::InvalidArgument, "at most");
}

// nanoseconds::max() once overflowed into the past and returned false at once.
TEST_F(PairingTest, WaitingWithTheLongestTimeoutWaits) {
  auto src = test::patterned(64, 1);
  auto readable = owner_.create_readable({Descriptor(src.data(), src.size())});
  auto start = std::chrono::steady_clock::now();
  std::thread finisher([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    readable.cancel();
  });
  EXPECT_THROW((void)readable.wait_for_completion(std::chrono::nanoseconds::max()), Error);
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(150));
  finisher.join();
  EXPECT_EQ(readable.status(), OperationStatus::cancelled);
}

// Bytes in a std::vector pair directly (the README's form), and const memory may be read or
// sent but never exposed as writable nor read into.
template <class C>
concept can_expose_writable = requires(Connector& c, C& memory) {
  c.create_writable(memory);
};
static_assert(can_expose_writable<std::vector<std::byte>>);
static_assert(!can_expose_writable<const std::vector<std::byte>>);

TEST_F(PairingTest, ByteVectorsPairAndConstMemoryIsNeverWritten) {
  const std::vector<std::byte> kv(4096, std::byte{3});
  std::vector<std::byte> blocks(4096);
  auto readable = owner_.create_readable(kv);
  auto read = peer_.begin_read(readable.metadata(), blocks);
  ASSERT_TRUE(read.wait_for_completion(std::chrono::seconds(10)));
  EXPECT_EQ(blocks, kv);
  auto writable = owner_.create_writable(blocks);
  auto write = peer_.begin_write(kv, writable.metadata());
  ASSERT_TRUE(write.wait_for_completion(std::chrono::seconds(10)));
  // A read-only descriptor is refused where ferry would write into it.
  expect_error([&] { (void)owner_.create_writable({Descriptor(std::span(kv))}); },
               ErrorCode::InvalidArgument, "read-only");
  auto other = owner_.create_readable(kv);
  expect_error(
      [&] { (void)peer_.begin_read(other.metadata(), {Descriptor::read_only(kv.data(), 4096)}); },
      ErrorCode::InvalidArgument, "read-only");
}

// A connector is movable: a class member without std::optional, a vector of them. Its
// operations go with it; a moved-from one refuses calls instead of crashing.
TEST(Connector, MovesWithItsOperationsAndTheMovedFromOneRefusesCalls) {
  struct Worker {
    Connector connector;
  };
  Worker owner{Connector(test::named("owner"))};
  Connector peer(test::named("peer"));
  std::vector<std::byte> src(4096, std::byte{7});
  std::vector<std::byte> dst(4096);
  auto readable = owner.connector.create_readable(src);
  Connector moved(std::move(owner.connector));
  auto read = peer.begin_read(readable.metadata(), dst);
  EXPECT_EQ(read.wait(std::chrono::seconds(10)), OperationStatus::complete);
  EXPECT_EQ(dst, src);
  EXPECT_FALSE(owner.connector.has_side_channel());
  EXPECT_TRUE(owner.connector.identity().name.empty());
  expect_error([&] { (void)owner.connector.create_readable(src); }, ErrorCode::InvalidState,
               "moved from");
  // Assigning a new connector to the moved-from one, and moving into a live one, work.
  owner.connector = Connector(test::named("again"));
  EXPECT_EQ(owner.connector.identity().name, "again");
  std::vector<Connector> many;
  many.push_back(std::move(moved));
  many.emplace_back(test::named("second"));
  EXPECT_EQ(many[0].identity().name, "owner");
}

TEST(ConnectorOptions, WildcardBindWithAdvertisedAddressWorks) {
  ConnectorOptions o = test::tcp_only("wildcard");
  o.tcp.bind_address = "0.0.0.0";
  o.tcp.advertise_address = "127.0.0.1";
  Connector owner(o);
  Connector peer(test::tcp_only("peer"));
  auto src = test::patterned(512, 5);
  auto dst = test::buffer(512);
  auto readable = owner.create_readable({Descriptor(src.data(), src.size())});
  EXPECT_EQ(readable.metadata().endpoints[0].address.rfind("127.0.0.1:", 0), 0u);
  auto read = peer.begin_read(readable.metadata(), {Descriptor(dst.data(), dst.size())});
  read.wait_for_completion();
  EXPECT_EQ(test::first_mismatch(dst.data(), dst.size(), 5), -1);
}

}  // namespace
}  // namespace ferry
