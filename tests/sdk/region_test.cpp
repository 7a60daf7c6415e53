// Regions (docs/regions.md): a pool exposed once, attached to once per peer, then many
// transfers by range or block, with the owner told of each. Two or more connectors in one
// process, over the methods that serve regions here.
#include <gtest/gtest.h>

#include <ferry/ferry.hpp>

#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "build_config.hpp"
#include "tests/support/nats_server.hpp"
#include "tests/support/patterns.hpp"
#include "tests/support/util.hpp"
#if FERRY_HAS_VERBS
#include "sdk/src/transport_registry.hpp"
#include "tests/support/sim_verbs.hpp"
#include "tests/support/simverbs/simverbs.hpp"
#endif

namespace ferry {
namespace {

using test::buffer;
using test::first_mismatch;
using test::patterned;

constexpr auto kWait = std::chrono::seconds(60);
constexpr std::size_t kBlock = 4096;
constexpr std::size_t kBlocks = 64;

// Every test runs once per method that serves regions, both connectors restricted to it
// (verbs on the simulated fabric; cuda_ipc, which moves CUDA memory only, in cuda_ipc_test).
class RegionTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
#if FERRY_HAS_VERBS
    if (GetParam() == "verbs") test::use_simulated_verbs();
#else
    if (GetParam() == "verbs") GTEST_SKIP() << "this ferry was built without verbs";
#endif
    for (const MethodInfo& m : probe_methods(options("probe")))
      if (m.method == GetParam() && !m.available) GTEST_SKIP() << m.method << ": " << m.detail;
  }
  ConnectorOptions options(std::string name) const {
    ConnectorOptions o = test::named(std::move(name));
    o.transports = {GetParam()};
    return o;
  }
#if FERRY_HAS_VERBS
  void TearDown() override {
    if (fabric_) test::simverbs::configure(*fabric_);
  }
  std::optional<test::simverbs::Config> fabric_;  ///< as it was before slow() changed it
#endif
  // A transfer slowed to one small request (copy) at a time, so that a test can act
  // mid-transfer. (verbs: the simulated NIC sends 800 Mbit/s, until the test ends.)
  ConnectorOptions slow(std::string name) {
#if FERRY_HAS_VERBS
    if (GetParam() == "verbs" && !fabric_) {
      fabric_ = test::simverbs::current_config();
      auto slower = *fabric_;
      slower.rate_mbps = 800;
      test::simverbs::configure(slower);
    }
#endif
    ConnectorOptions o = options(std::move(name));
    o.tcp.chunk_size = 4096;
    o.tcp.window = 4096;
    o.cma.chunk_size = 4096;
    o.cma.parallel = 1;
    return o;
  }
};

// Waits for the region's next event of `type` (others before it are skipped and returned).
RegionEvent next_of(Region& region, RegionEvent::Type type,
                    std::vector<RegionEvent>* skipped = nullptr) {
  const auto until = std::chrono::steady_clock::now() + kWait;
  while (std::chrono::steady_clock::now() < until) {
    auto e = region.next_event(std::chrono::seconds(1));
    if (!e) continue;
    if (e->type == type) return *e;
    if (skipped != nullptr) skipped->push_back(*e);
  }
  ADD_FAILURE() << "no event of type " << static_cast<int>(type);
  return {};
}

bool eventually(const std::function<bool()>& cond) {
  const auto until = std::chrono::steady_clock::now() + kWait;
  while (std::chrono::steady_clock::now() < until) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return cond();
}

// With an owner and a peer.
class RegionPair : public RegionTest {
 protected:
  void SetUp() override {
    RegionTest::SetUp();
    if (IsSkipped()) return;
    owner_store_ = std::make_unique<Connector>(options("owner"));
    peer_store_ = std::make_unique<Connector>(options("peer"));
  }
  std::unique_ptr<Connector> owner_store_, peer_store_;
  Connector& owner() { return *owner_store_; }
  Connector& peer() { return *peer_store_; }
};

TEST_P(RegionPair, WriteBlocksAndTheOwnerHearsTagAndBlocks) {
  auto pool = buffer(kBlock * kBlocks);
  RegionOptions o;
  o.access = RegionAccess::write;
  o.block_size = kBlock;
  auto region = owner().create_region({Descriptor(pool.data(), pool.size())}, o);
  EXPECT_EQ(region.metadata().block_count(), kBlocks);
  auto att = peer().attach(region.metadata());
  auto src = patterned(3 * kBlock, 7);
  TransferOptions t;
  t.tag = "request-17";
  // Blocks 5, 6 and 9, from one local buffer.
  att.wait_attached();
  auto w = att.write_blocks({Descriptor(src.data(), src.size())}, {5, 6, 9}, t);
  // cma copies a transfer this small on the calling thread: complete on return.
  if (GetParam() == "cma") {
    EXPECT_EQ(w.status(), OperationStatus::complete);
  }
  w.wait_for_completion();
  EXPECT_EQ(att.state(), Attachment::State::attached);
  EXPECT_EQ(att.method(), GetParam());
  EXPECT_EQ(first_mismatch(pool.data() + 5 * kBlock, 2 * kBlock, 7), -1);
  EXPECT_EQ(first_mismatch(pool.data() + 9 * kBlock, kBlock, 7, 2 * kBlock), -1);
  // Untouched blocks stay zero.
  EXPECT_EQ(test::first_not(pool.data(), 5 * kBlock, std::byte{0}), -1);
  EXPECT_EQ(test::first_not(pool.data() + 7 * kBlock, 2 * kBlock, std::byte{0}), -1);

  std::vector<RegionEvent> before;
  RegionEvent e = next_of(region, RegionEvent::Type::transfer, &before);
  ASSERT_EQ(before.size(), 1u);
  EXPECT_EQ(before[0].type, RegionEvent::Type::attached);
  EXPECT_EQ(before[0].peer_id, peer().identity().id);
  EXPECT_EQ(e.attachment, before[0].attachment);
  EXPECT_EQ(e.kind, OperationKind::write);
  EXPECT_EQ(e.tag, "request-17");
  EXPECT_EQ(e.status, OperationStatus::complete);
  EXPECT_EQ(e.blocks, (std::vector<std::uint64_t>{5, 6, 9}));
  ASSERT_EQ(e.ranges.size(), 2u);
  EXPECT_EQ(e.ranges[0], (RegionRange{5 * kBlock, 2 * kBlock}));
  EXPECT_EQ(e.ranges[1], (RegionRange{9 * kBlock, kBlock}));
  ASSERT_EQ(region.peers().size(), 1u);
  EXPECT_EQ(region.peers()[0].peer_id, peer().identity().id);
}

TEST_P(RegionPair, ReadRangesAcrossDescriptorsManyTimesOnOneAttachment) {
  // Three descriptors form one byte stream of 3 x 10000 bytes.
  auto stream = patterned(30000, 3);
  auto a = buffer(10000), b = buffer(10000), c = buffer(10000);
  std::memcpy(a.data(), stream.data(), 10000);
  std::memcpy(b.data(), stream.data() + 10000, 10000);
  std::memcpy(c.data(), stream.data() + 20000, 10000);
  auto region = owner().create_region(
      {Descriptor(a.data(), 10000), Descriptor(b.data(), 10000), Descriptor(c.data(), 10000)});
  auto att = peer().attach(region.metadata());
  for (int round = 0; round < 20; ++round) {
    // 1500 bytes across the first seam, then 12000 across the second (in two local pieces).
    auto x = buffer(1500), y = buffer(7000), z = buffer(5000);
    auto r = att.read(
        {{9000 + static_cast<std::uint64_t>(round), 1500}, {15000, 12000}},
        {Descriptor(x.data(), 1500), Descriptor(y.data(), 7000), Descriptor(z.data(), 5000)});
    r.wait_for_completion();
    EXPECT_EQ(first_mismatch(x.data(), 1500, 3, 9000 + round), -1);
    EXPECT_EQ(first_mismatch(y.data(), 7000, 3, 15000), -1);
    EXPECT_EQ(first_mismatch(z.data(), 5000, 3, 22000), -1);
  }
  // One attach for the twenty reads.
  int attached = 0, transfers = 0;
  while (auto e = region.next_event(std::chrono::milliseconds(500))) {
    attached += e->type == RegionEvent::Type::attached;
    transfers += e->type == RegionEvent::Type::transfer;
    if (transfers == 20) break;
  }
  EXPECT_EQ(attached, 1);
  EXPECT_EQ(transfers, 20);
}

TEST_P(RegionPair, ManyPeersReadAndWriteDifferentBlocksAtOnce) {
  constexpr int kPeers = 4;
  constexpr int kPerPeer = 8;
  auto pool = buffer(kBlock * kBlocks);
  // The second half starts patterned: peers read it while others write the first half.
  test::fill_pattern(pool.data() + kBlock * kBlocks / 2, kBlock * kBlocks / 2, 99);
  RegionOptions o;
  o.access = RegionAccess::read_write;
  o.block_size = kBlock;
  auto region = owner().create_region({Descriptor(pool.data(), pool.size())}, o);
  // The peers' connectors are made and destroyed here, their transfers run on threads of
  // their own. (libuv closes its loops' descriptors with a raw system call that ThreadSanitizer
  // does not see: a connector made on a short-lived thread leaves it records of descriptors
  // that another thread's sockets later reuse.)
  std::vector<std::unique_ptr<Connector>> peers;
  for (int p = 0; p < kPeers; ++p)
    peers.push_back(std::make_unique<Connector>(options("peer" + std::to_string(p))));
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int p = 0; p < kPeers; ++p) {
    threads.emplace_back([&, p] {
      auto att = peers[static_cast<std::size_t>(p)]->attach(region.metadata());
      std::vector<std::vector<std::byte>> srcs, dsts;
      std::vector<Operation> ops;
      for (int i = 0; i < kPerPeer; ++i) {
        const std::uint64_t mine = static_cast<std::uint64_t>(p * kPerPeer + i);  // < 32
        srcs.push_back(patterned(kBlock, 1000 + mine));
        ops.push_back(att.write_blocks({Descriptor(srcs.back().data(), kBlock)},
                                       std::vector<std::uint64_t>{mine}));
        dsts.push_back(buffer(kBlock));
        ops.push_back(att.read_blocks({32 + mine}, {Descriptor(dsts.back().data(), kBlock)}));
      }
      for (auto& op : ops)
        if (!op.wait_for_completion(kWait) || op.status() != OperationStatus::complete) ++failures;
      for (int i = 0; i < kPerPeer; ++i) {
        const std::uint64_t mine = static_cast<std::uint64_t>(p * kPerPeer + i);
        if (first_mismatch(dsts[i].data(), kBlock, 99, mine * kBlock) != -1) ++failures;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  for (std::uint64_t b = 0; b < 32; ++b)
    EXPECT_EQ(first_mismatch(pool.data() + b * kBlock, kBlock, 1000 + b), -1) << "block " << b;
}

TEST_P(RegionPair, RevokingOnePeerLeavesTheOthersWorking) {
  auto pool = buffer(kBlock * kBlocks);
  RegionOptions o;
  o.access = RegionAccess::write;
  o.block_size = kBlock;
  auto region = owner().create_region({Descriptor(pool.data(), pool.size())}, o);
  Connector other(options("other"));
  auto a = peer().attach(region.metadata());
  auto b = other.attach(region.metadata());
  auto src = patterned(kBlock, 5);
  a.write_blocks({Descriptor(src.data(), kBlock)}, {1}).wait_for_completion();
  b.write_blocks({Descriptor(src.data(), kBlock)}, {2}).wait_for_completion();
  EXPECT_EQ(region.revoke(peer().identity().id), 1u);
  // At once, before the peer has heard of it: its credential is dead (cma: a copy on the
  // calling thread finds the grant ended), so the write is refused and the memory untouched.
  std::memset(pool.data() + 3 * kBlock, 0, kBlock);
  auto late = a.write_blocks({Descriptor(src.data(), kBlock)}, {3});
  (void)test::ended_with(late);  // fails the test if it completed
  EXPECT_EQ(test::first_not(pool.data() + 3 * kBlock, kBlock, std::byte{0}), -1);
  // The revoked peer learns why.
  ASSERT_TRUE(eventually([&] { return a.state() == Attachment::State::detached; }));
  EXPECT_EQ(a.error()->code(), ErrorCode::Cancelled);
  EXPECT_NE(a.error()->message().find("revoked"), std::string::npos) << a.error()->message();
  auto later = a.write_blocks({Descriptor(src.data(), kBlock)}, {3});
  (void)test::ended_with(later);
  EXPECT_EQ(test::first_not(pool.data() + 3 * kBlock, kBlock, std::byte{0}), -1);
  // The other goes on.
  auto w = b.write_blocks({Descriptor(src.data(), kBlock)}, {4});
  w.wait_for_completion();
  EXPECT_EQ(first_mismatch(pool.data() + 4 * kBlock, kBlock, 5), -1);
  // A fresh attach of the revoked peer with the same metadata works: revocation ends an
  // attachment, not the region (close() does that).
  auto again = peer().attach(region.metadata());
  again.write_blocks({Descriptor(src.data(), kBlock)}, {6}).wait_for_completion();
}

TEST_P(RegionTest, CloseNothingLandsAfterCloseReturns) {
  constexpr std::size_t kBig = 64u << 20;
  Connector owner(options("owner"));
  Connector writer(slow("writer"));
  auto pool = buffer(kBig);
  RegionOptions o;
  o.access = RegionAccess::write;
  auto region = owner.create_region({Descriptor(pool.data(), kBig)}, o);
  auto src = std::vector<std::byte>(kBig, std::byte{0x22});
  auto att = writer.attach(region.metadata());
  auto w = att.write({Descriptor(src.data(), kBig)}, {{0, kBig}});
  // Mid-transfer: attached, and some of its 16384 small requests (copies) done. (Reading the
  // memory to see would race with the transfer.)
  att.wait_attached();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(w.status(), OperationStatus::in_progress);
  region.close();
  EXPECT_FALSE(region.is_open());
  // From here on the memory is the owner's again: poison it, and nothing may overwrite it.
  std::memset(pool.data(), 0x5a, kBig);
  EXPECT_EQ(test::ended_with(w), ErrorCode::Cancelled);
  EXPECT_NE(w.error()->message().find("'owner'"), std::string::npos) << w.error()->message();
  EXPECT_EQ(test::first_not(pool.data(), kBig, std::byte{0x5a}), -1);
  // Attaching after close is refused.
  auto late = writer.attach(region.metadata());
  EXPECT_THROW(late.wait_attached(), Error);
  EXPECT_EQ(late.error()->code(), ErrorCode::AccessDenied);
  // The owner's last event says how the region ended.
  RegionEvent e = next_of(region, RegionEvent::Type::ended);
  EXPECT_EQ(e.error->code(), ErrorCode::Cancelled);
}

TEST_P(RegionPair, TheDeadlineEndsTheRegionWithTimeout) {
  auto pool = buffer(kBlock);
  RegionOptions o;
  o.timeout = std::chrono::milliseconds(100);
  auto region = owner().create_region({Descriptor(pool.data(), kBlock)}, o);
  RegionEvent e = next_of(region, RegionEvent::Type::ended);
  ASSERT_TRUE(e.error);
  EXPECT_EQ(e.error->code(), ErrorCode::Timeout);
  EXPECT_FALSE(region.is_open());
  auto att = peer().attach(region.metadata());
  EXPECT_THROW(att.wait_attached(), Error);
  EXPECT_EQ(att.error()->code(), ErrorCode::AccessDenied);
}

TEST_P(RegionPair, BadRangesAndBlocksAreRefusedBeforeAnyByteMoves) {
  auto pool = buffer(kBlock * 4);
  RegionOptions o;
  o.access = RegionAccess::read_write;
  o.block_size = kBlock;
  auto region = owner().create_region({Descriptor(pool.data(), pool.size())}, o);
  auto att = peer().attach(region.metadata());
  auto src = patterned(kBlock, 1);
  test::expect_error([&] { (void)att.write_blocks({Descriptor(src.data(), kBlock)}, {4}); },
                     ErrorCode::InvalidArgument, "past the region's 4 blocks");
  test::expect_error(
      [&] {
        (void)att.write({Descriptor(src.data(), kBlock)}, {{3 * kBlock + 1, kBlock}});
      },
      ErrorCode::InvalidArgument, "outside the region");
  test::expect_error(
      [&] {
        (void)att.write({Descriptor(src.data(), kBlock)}, {{~std::uint64_t{0}, kBlock}});
      },
      ErrorCode::InvalidArgument, "outside the region");
  test::expect_error(
      [&] {
        (void)att.write({Descriptor(src.data(), kBlock)}, {{0, 100}});
      },
      ErrorCode::SizeMismatch, "local descriptors");
  TransferOptions long_tag;
  long_tag.tag = std::string(300, 'x');
  test::expect_error(
      [&] { (void)att.write_blocks({Descriptor(src.data(), kBlock)}, {0}, long_tag); },
      ErrorCode::InvalidArgument, "tag");
  EXPECT_EQ(test::first_not(pool.data(), pool.size(), std::byte{0}), -1);
}

TEST_P(RegionPair, AReadableRegionCannotBeWritten) {
  auto pool = buffer(kBlock);
  auto region = owner().create_region({Descriptor(pool.data(), kBlock)});
  AttachOptions writing;
  writing.access = RegionAccess::write;
  test::expect_error([&] { (void)peer().attach(region.metadata(), writing); },
                     ErrorCode::KindMismatch, "allows read");
  auto att = peer().attach(region.metadata());
  auto src = patterned(kBlock, 1);
  auto w = att.write({Descriptor(src.data(), kBlock)}, {{0, kBlock}});
  EXPECT_EQ(test::ended_with(w), ErrorCode::KindMismatch);
  EXPECT_EQ(test::first_not(pool.data(), kBlock, std::byte{0}), -1);
  // A writable region of const memory is refused at once.
  const std::vector<std::byte> constant(kBlock);
  RegionOptions w_opts;
  w_opts.access = RegionAccess::write;
  test::expect_error(
      [&] {
        (void)owner().create_region({Descriptor::read_only(constant.data(), kBlock)}, w_opts);
      },
      ErrorCode::InvalidArgument, "read-only");
  RegionOptions odd;
  odd.block_size = 3000;
  test::expect_error([&] { (void)owner().create_region({Descriptor(pool.data(), kBlock)}, odd); },
                     ErrorCode::InvalidArgument, "whole number of blocks");
}

TEST_P(RegionPair, ABatchStartsEveryTransferAndEachEndsOnItsOwn) {
  auto pool = buffer(kBlock * kBlocks);
  RegionOptions o;
  o.access = RegionAccess::read_write;
  o.block_size = kBlock;
  auto region = owner().create_region({Descriptor(pool.data(), pool.size())}, o);
  auto att = peer().attach(region.metadata());
  std::vector<std::vector<std::byte>> srcs;
  std::vector<Attachment::Transfer> batch;
  for (std::uint64_t i = 0; i < 32; ++i) {
    srcs.push_back(patterned(kBlock, 500 + i));
    Attachment::Transfer t;
    t.kind = OperationKind::write;
    t.remote = {{i * kBlock, kBlock}};
    t.local = {Descriptor(srcs.back().data(), kBlock)};
    t.options.tag = "b" + std::to_string(i);
    batch.push_back(std::move(t));
  }
  auto ops = att.submit(std::move(batch));
  ASSERT_EQ(ops.size(), 32u);
  for (auto& op : ops) op.wait_for_completion();
  for (std::uint64_t i = 0; i < 32; ++i)
    EXPECT_EQ(first_mismatch(pool.data() + i * kBlock, kBlock, 500 + i), -1);
  std::vector<std::string> tags;
  while (tags.size() < 32) {
    auto e = region.next_event(std::chrono::seconds(5));
    ASSERT_TRUE(e);
    if (e->type == RegionEvent::Type::transfer) tags.push_back(e->tag);
  }
  std::sort(tags.begin(), tags.end());
  EXPECT_EQ(tags.front(), "b0");
  // One bad entry refuses the whole batch, starting none.
  std::vector<Attachment::Transfer> bad(2);
  bad[0].kind = OperationKind::write;
  bad[0].remote = {{0, kBlock}};
  bad[0].local = {Descriptor(srcs[0].data(), kBlock)};
  bad[1] = bad[0];
  bad[1].remote = {{kBlocks * kBlock, kBlock}};
  std::memset(pool.data(), 0, kBlock);
  EXPECT_THROW((void)att.submit(std::move(bad)), Error);
  EXPECT_EQ(test::first_not(pool.data(), kBlock, std::byte{0}), -1);
}

TEST_P(RegionPair, TheOwnerHearsAPeerThatDetachesOrDies) {
  auto pool = buffer(kBlock);
  Region region = owner().create_region({Descriptor(pool.data(), kBlock)});
  {
    auto att = peer().attach(region.metadata());
    att.wait_attached();
    att.detach();
  }
  RegionEvent gone = next_of(region, RegionEvent::Type::detached);
  EXPECT_FALSE(gone.error) << gone.error->message();
  {
    Connector doomed(options("doomed"));
    auto att = doomed.attach(region.metadata());
    att.wait_attached();
    // The connector goes away with the attachment still live.
  }
  RegionEvent lost = next_of(region, RegionEvent::Type::detached);
  EXPECT_EQ(lost.peer.find("doomed") != std::string::npos, true) << lost.peer;
  EXPECT_TRUE(region.peers().empty());
}

TEST_P(RegionTest, OwnerDeathAPeerMidTransferHearsTheOwnerIsGone) {
  constexpr std::size_t kBig = 32u << 20;
  auto owner = std::make_unique<Connector>(options("owner"));
  Connector reader(slow("reader"));
  auto pool = patterned(kBig, 4);
  auto region = owner->create_region({Descriptor(pool.data(), kBig)});
  auto att = reader.attach(region.metadata());
  auto dst = buffer(kBig);
  auto r = att.read({{0, kBig}}, {Descriptor(dst.data(), kBig)});
  att.wait_attached();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // mid-transfer (as above)
  EXPECT_EQ(r.status(), OperationStatus::in_progress);
  owner.reset();  // ends the region and closes every connection
  ASSERT_TRUE(eventually([&] { return is_final(r.status()); }));
  EXPECT_NE(r.status(), OperationStatus::complete);
  ASSERT_TRUE(eventually([&] { return att.state() == Attachment::State::detached; }));
  EXPECT_TRUE(att.error());
}

TEST_P(RegionTest, JsonRoundTripsAndIsStrict) {
  Connector owner(options("owner"));
  auto pool = buffer(kBlock * 2);
  RegionOptions o;
  o.access = RegionAccess::read_write;
  o.block_size = kBlock;
  auto region = owner.create_region({Descriptor(pool.data(), pool.size())}, o);
  const std::string json = region.metadata().to_json();
  EXPECT_EQ(RegionMetadata::from_json(json), region.metadata());
  EXPECT_NE(json.find("\"kind\":\"ferry.region\""), std::string::npos) << json;
  auto field_of = [](const std::string& text) {
    try {
      (void)RegionMetadata::from_json(text);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::InvalidMetadata);
      return e.field();
    }
    return std::string("(accepted)");
  };
  auto edit = [&](const std::function<void(nlohmann::json&)>& change) {
    auto doc = nlohmann::json::parse(json);
    change(doc);
    return doc.dump();
  };
  EXPECT_EQ(field_of(edit([](auto& d) { d.erase("kind"); })), "kind");
  EXPECT_EQ(field_of(edit([](auto& d) { d["kind"] = "ferry.operation"; })), "kind");
  EXPECT_EQ(field_of(edit([](auto& d) { d["version"] = 2; })), "version");
  EXPECT_EQ(field_of(edit([](auto& d) { d["access"] = "execute"; })), "access");
  EXPECT_EQ(field_of(edit([](auto& d) { d["block_size"] = -1; })), "block_size");
  EXPECT_EQ(field_of(edit([](auto& d) { d["block_size"] = 3000; })), "block_size");
  EXPECT_EQ(field_of(edit([](auto& d) { d["region_id"] = "XYZ"; })), "region_id");
  EXPECT_EQ(field_of(edit([](auto& d) { d["token"] = "short"; })), "token");
  EXPECT_EQ(field_of(edit([](auto& d) { d["descriptors"][0]["size"] = 0; })),
            "descriptors[0].size");
  // An operation's metadata is not a region's, and the other way round.
  auto readable = owner.create_readable({Descriptor(pool.data(), kBlock)});
  EXPECT_EQ(field_of(readable.metadata().to_json()), "kind");
  EXPECT_THROW((void)RdmaMetadata::from_json(json), Error);
}

TEST_P(RegionTest, BySubjectAttachOnceByAskingThenTransferWithoutNats) {
  test::NatsServer server;
  ConnectorOptions a = options("owner");
  a.nats.servers = {server.url()};
  ConnectorOptions b = options("peer");
  b.nats.servers = {server.url()};
  Connector owner(a);
  Connector peer(b);
  auto pool = buffer(kBlock * kBlocks);
  RegionOptions o;
  o.access = RegionAccess::write;
  o.block_size = kBlock;
  o.subject = "kv.decode.0";
  auto region = owner.create_region({Descriptor(pool.data(), pool.size())}, o);
  auto att = peer.attach(Subject("kv.decode.0"));
  auto src = patterned(kBlock, 8);
  // Started before the attachment exists: it waits for it.
  auto w =
      att.write_blocks({Descriptor(src.data(), kBlock)}, {3}, {std::chrono::milliseconds(0), "r1"});
  w.wait_for_completion();
  EXPECT_EQ(first_mismatch(pool.data() + 3 * kBlock, kBlock, 8), -1);
  EXPECT_EQ(att.metadata(), region.metadata());
  RegionEvent e = next_of(region, RegionEvent::Type::transfer);
  EXPECT_EQ(e.tag, "r1");
  // Nobody serves this one: the deadline says so.
  AttachOptions quick;
  quick.timeout = std::chrono::milliseconds(300);
  auto nobody = peer.attach(Subject("kv.typo"), quick);
  EXPECT_THROW(nobody.wait_attached(), Error);
  EXPECT_EQ(nobody.error()->code(), ErrorCode::Timeout);
  EXPECT_NE(nobody.error()->message().find("kv.typo"), std::string::npos)
      << nobody.error()->message();
}

TEST_P(RegionPair, AnEventCallbackRunsOnTheLoopInOrder) {
  auto pool = buffer(kBlock * 4);
  std::mutex mu;
  std::vector<RegionEvent::Type> seen;
  RegionOptions o;
  o.access = RegionAccess::write;
  o.queue_events = false;
  o.on_event = [&](const RegionEvent& e) {
    std::lock_guard lock(mu);
    seen.push_back(e.type);
  };
  auto region = owner().create_region({Descriptor(pool.data(), pool.size())}, o);
  {
    auto att = peer().attach(region.metadata());
    auto src = patterned(kBlock, 1);
    att.write({Descriptor(src.data(), kBlock)}, {{0, kBlock}}).wait_for_completion();
  }
  ASSERT_TRUE(eventually([&] {
    std::lock_guard lock(mu);
    return seen.size() >= 3;
  }));
  region.close();
  std::lock_guard lock(mu);
  ASSERT_EQ(seen.size(), 4u);
  EXPECT_EQ(seen[0], RegionEvent::Type::attached);
  EXPECT_EQ(seen[1], RegionEvent::Type::transfer);
  EXPECT_EQ(seen[2], RegionEvent::Type::detached);
  EXPECT_EQ(seen[3], RegionEvent::Type::ended);
  EXPECT_FALSE(region.next_event());  // queue_events off
}

#if FERRY_HAS_VERBS
// verbs on a device without memory windows: each attachment gets registrations of its own,
// and revoking it deregisters them (its keys die; the other attachment's live on).
TEST(RegionVerbsWithoutWindows, RevokingOnePeerDeregistersItsKeysAlone) {
  test::use_simulated_verbs();
  const auto before = test::simverbs::current_config();
  auto no_mw = before;
  no_mw.mw = false;
  test::simverbs::configure(no_mw);
  {
    ConnectorOptions o = test::named("owner");
    o.transports = {"verbs"};
    Connector owner(o);
    o.name = "a";
    Connector a(o);
    o.name = "b";
    Connector b(o);
    auto pool = buffer(kBlock * 8);
    RegionOptions ro;
    ro.access = RegionAccess::write;
    ro.block_size = kBlock;
    auto region = owner.create_region({Descriptor(pool.data(), pool.size())}, ro);
    auto att_a = a.attach(region.metadata());
    auto att_b = b.attach(region.metadata());
    auto src = patterned(kBlock, 3);
    att_a.write_blocks({Descriptor(src.data(), kBlock)}, {0}).wait_for_completion();
    att_b.write_blocks({Descriptor(src.data(), kBlock)}, {1}).wait_for_completion();
    EXPECT_EQ(att_a.method(), "verbs");
    EXPECT_EQ(region.revoke(a.identity().id), 1u);
    std::memset(pool.data() + 2 * kBlock, 0, kBlock);
    ASSERT_TRUE(eventually([&] { return att_a.state() == Attachment::State::detached; }));
    auto late = att_a.write_blocks({Descriptor(src.data(), kBlock)}, {2});
    (void)test::ended_with(late);  // fails the test if it completed
    EXPECT_EQ(test::first_not(pool.data() + 2 * kBlock, kBlock, std::byte{0}), -1);
    att_b.write_blocks({Descriptor(src.data(), kBlock)}, {3}).wait_for_completion();
    EXPECT_EQ(first_mismatch(pool.data() + 3 * kBlock, kBlock, 3), -1);
  }
  test::simverbs::configure(before);
  detail::remove_method("verbs");
}
#endif

std::string method_name(const ::testing::TestParamInfo<std::string>& info) { return info.param; }

INSTANTIATE_TEST_SUITE_P(Methods, RegionTest, ::testing::Values("tcp", "cma", "verbs"),
                         method_name);
INSTANTIATE_TEST_SUITE_P(Methods, RegionPair, ::testing::Values("tcp", "cma", "verbs"),
                         method_name);

}  // namespace
}  // namespace ferry
