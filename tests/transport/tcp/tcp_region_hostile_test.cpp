// Hostile tcp clients against a real Connector's regions (docs/protocol.md, "Regions"): ATTACH,
// the attachment's requests, ENDED and DETACH spoken by hand over a raw socket. Each test checks
// the owner's answer, that the region's memory is untouched, and what the owner was told.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include <ferry/ferry.hpp>

#include "sdk/src/region_metadata.hpp"
#include "tests/support/patterns.hpp"
#include "tests/support/raw_peer.hpp"
#include "tests/support/util.hpp"
#include "transport/wire/frame.hpp"

namespace ferry {
namespace {

using namespace test;
using transport::wire::FrameHeader;
using transport::wire::FrameType;

constexpr std::size_t kSize = 64u << 10;
constexpr std::uint64_t kSeed = 9;

// An attachment, as the raw client holds it.
struct Attached {
  std::uint64_t id = 0;
  transport::Token secret{};
};

class TcpRegionHostileTest : public ::testing::Test {
 protected:
  Region make(RegionAccess access) {
    RegionOptions o;
    o.access = access;
    o.block_size = 4096;
    return owner_.create_region({Descriptor(memory_.data(), kSize)}, o);
  }
  static Target target(const Region& r) { return target_of(detail::operation_view(r.metadata())); }

  static FrameHeader attach_frame(const Target& t, std::uint64_t req, transport::Access access) {
    FrameHeader h = request(FrameType::attach, t, req, 0, 0);
    h.flags = static_cast<std::uint16_t>(access);
    return h;
  }
  // ATTACH, and the ATTACHED that answers it.
  static std::optional<Attached> attach(RawClient& c, const Target& t, transport::Access access) {
    if (!c.send_frame(attach_frame(t, 1, access))) return std::nullopt;
    auto f = c.read_frame();
    if (!f || f->header.type != FrameType::attached || f->header.req_id != 1) {
      ADD_FAILURE() << "no ATTACHED: " << (f ? f->message : c.error());
      return std::nullopt;
    }
    return Attached{f->header.op_id, f->header.token};
  }
  static FrameHeader on(const Attached& a, FrameType type, std::uint64_t req, std::uint64_t addr,
                        std::uint64_t len) {
    FrameHeader h;
    h.type = type;
    h.req_id = req;
    h.op_id = a.id;
    h.token = a.secret;
    h.addr = addr;
    h.len = len;
    return h;
  }
  static std::vector<std::byte> ranges(std::uint64_t addr, std::uint64_t len) {
    std::vector<std::byte> out(16);
    std::memcpy(out.data(), &addr, 8);
    std::memcpy(out.data() + 8, &len, 8);
    return out;
  }
  // The events the owner has heard so far, by type.
  std::vector<RegionEvent::Type> heard(Region& r) {
    std::vector<RegionEvent::Type> out;
    while (auto e = r.next_event(std::chrono::milliseconds(200))) out.push_back(e->type);
    return out;
  }
  bool memory_unchanged() const { return first_mismatch(memory_.data(), kSize, kSeed) == -1; }

  Connector owner_{test::named("owner")};
  std::vector<std::byte> memory_ = patterned(kSize, kSeed);
};

TEST_F(TcpRegionHostileTest, AWrongTokenAndAnUnknownRegionGetTheSameRefusal) {
  auto region = make(RegionAccess::read);
  const Target t = target(region);
  RawClient c(t.address);
  ASSERT_TRUE(c.connected() && c.greet("raw")) << c.error();
  FrameHeader wrong = attach_frame(t, 1, transport::Access::read);
  wrong.token = flipped(t.token);
  ASSERT_TRUE(c.send_frame(wrong));
  auto a = c.read_frame();
  EXPECT_TRUE(is_status(a, 1, ErrorCode::AccessDenied, "no live region matches"));
  FrameHeader unknown = attach_frame(t, 2, transport::Access::read);
  unknown.op_id ^= 1;
  ASSERT_TRUE(c.send_frame(unknown));
  auto b = c.read_frame();
  EXPECT_TRUE(is_status(b, 2, ErrorCode::AccessDenied, "no live region matches"));
  ASSERT_TRUE(a && b);
  EXPECT_EQ(a->message, b->message);
  EXPECT_TRUE(heard(region).empty());
}

TEST_F(TcpRegionHostileTest, AttachingBeyondTheRegionsAccessIsRefused) {
  auto region = make(RegionAccess::read);
  const Target t = target(region);
  RawClient c(t.address);
  ASSERT_TRUE(c.connected() && c.greet("raw")) << c.error();
  ASSERT_TRUE(c.send_frame(attach_frame(t, 1, transport::Access::read_write)));
  EXPECT_TRUE(is_status(c.read_frame(), 1, ErrorCode::AccessDenied, "cannot be written"));
  ASSERT_TRUE(c.send_frame(attach_frame(t, 2, static_cast<transport::Access>(7))));
  EXPECT_TRUE(is_status(c.read_frame(), 2, ErrorCode::ProtocolError, "no access kind"));
  // A read attachment cannot write.
  auto a = attach(c, t, transport::Access::read);
  ASSERT_TRUE(a);
  auto data = patterned(64, 1);
  ASSERT_TRUE(c.send_frame(on(*a, FrameType::write, 3, t.base, 64), {}, data));
  EXPECT_TRUE(is_status(c.read_frame(), 3, ErrorCode::AccessDenied, "cannot be written"));
  EXPECT_TRUE(memory_unchanged());
}

TEST_F(TcpRegionHostileTest, AnAttachmentIsBoundToTheConnectionThatMadeIt) {
  auto region = make(RegionAccess::read);
  const Target t = target(region);
  RawClient first(t.address);
  ASSERT_TRUE(first.connected() && first.greet("first")) << first.error();
  auto a = attach(first, t, transport::Access::read);
  ASSERT_TRUE(a);
  RawClient thief(t.address);
  ASSERT_TRUE(thief.connected() && thief.greet("thief")) << thief.error();
  ASSERT_TRUE(thief.send_frame(on(*a, FrameType::read, 1, t.base, 64)));
  EXPECT_TRUE(is_status(thief.read_frame(), 1, ErrorCode::AccessDenied, "another peer"));
  // Its rightful holder reads.
  ASSERT_TRUE(first.send_frame(on(*a, FrameType::read, 2, t.base + 64, 64)));
  EXPECT_TRUE(is_data(first.read_frame(), 2, 64, kSeed, 64));
}

TEST_F(TcpRegionHostileTest, AnEndedIsCheckedBeforeTheOwnerHearsOfIt) {
  auto region = make(RegionAccess::read);
  const Target t = target(region);
  RawClient c(t.address);
  ASSERT_TRUE(c.connected() && c.greet("raw")) << c.error();
  auto a = attach(c, t, transport::Access::read);
  ASSERT_TRUE(a);
  auto ended = [&](std::uint64_t req, transport::Access kind) {
    FrameHeader h = on(*a, FrameType::ended, req, 0, 16);
    h.flags = static_cast<std::uint16_t>(kind);
    return h;
  };
  // A wrong secret.
  FrameHeader wrong = ended(1, transport::Access::read);
  wrong.token = flipped(a->secret);
  ASSERT_TRUE(c.send_frame(wrong, "t1", ranges(t.base, 64)));
  EXPECT_TRUE(is_status(c.read_frame(), 1, ErrorCode::AccessDenied, "no live operation"));
  // A range outside the region.
  ASSERT_TRUE(c.send_frame(ended(2, transport::Access::read), "t2", ranges(t.base + kSize, 1)));
  EXPECT_TRUE(is_status(c.read_frame(), 2, ErrorCode::AccessDenied, "outside"));
  // A kind the attachment does not have.
  ASSERT_TRUE(c.send_frame(ended(3, transport::Access::write), "t3", ranges(t.base, 64)));
  EXPECT_TRUE(is_status(c.read_frame(), 3, ErrorCode::AccessDenied, "cannot be written"));
  // A tag over 256 bytes.
  ASSERT_TRUE(
      c.send_frame(ended(4, transport::Access::read), std::string(300, 'x'), ranges(t.base, 64)));
  EXPECT_TRUE(is_status(c.read_frame(), 4, ErrorCode::ProtocolError, "tag"));
  // A good one is heard.
  ASSERT_TRUE(c.send_frame(ended(5, transport::Access::read), "t5", ranges(t.base, 64)));
  EXPECT_TRUE(is_ok(c.read_frame(), 5));
  std::vector<RegionEvent> events;
  while (auto e = region.next_event(std::chrono::milliseconds(300))) events.push_back(*e);
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].type, RegionEvent::Type::attached);
  EXPECT_EQ(events[1].type, RegionEvent::Type::transfer);
  EXPECT_EQ(events[1].tag, "t5");
  ASSERT_EQ(events[1].ranges.size(), 1u);
  EXPECT_EQ(events[1].ranges[0], (RegionRange{0, 64}));
  // Ranges that are not whole pairs end the connection (the stream cannot be trusted).
  FrameHeader ragged = ended(6, transport::Access::read);
  ragged.len = 17;
  ASSERT_TRUE(c.send_frame(ragged, "t6", std::vector<std::byte>(17)));
  auto f = c.read_frame();
  EXPECT_TRUE(is_status(f, 0, ErrorCode::ProtocolError, "ENDED of 17 bytes")) << c.error();
}

TEST_F(TcpRegionHostileTest, AfterRevokeTheOldSecretWritesNothing) {
  auto region = make(RegionAccess::write);
  const Target t = target(region);
  RawClient c(t.address);
  ASSERT_TRUE(c.connected() && c.greet("raw")) << c.error();
  auto a = attach(c, t, transport::Access::write);
  ASSERT_TRUE(a);
  auto first = region.next_event(std::chrono::seconds(5));
  ASSERT_TRUE(first && first->type == RegionEvent::Type::attached);
  EXPECT_EQ(region.revoke(first->attachment), 1u);
  // The peer is told at once, naming the attachment.
  auto notice = c.read_frame();
  ASSERT_TRUE(notice);
  EXPECT_EQ(notice->header.type, FrameType::status);
  EXPECT_EQ(notice->header.op_id, a->id);
  EXPECT_EQ(notice->header.status, wire_status(ErrorCode::Cancelled));
  EXPECT_NE(notice->message.find("revoked"), std::string::npos) << notice->message;
  // Its secret is dead: a write lands nowhere.
  auto data = patterned(4096, 77);
  ASSERT_TRUE(c.send_frame(on(*a, FrameType::write, 1, t.base, 4096), {}, data));
  EXPECT_TRUE(is_status(c.read_frame(), 1, ErrorCode::AccessDenied, "no live operation"));
  EXPECT_TRUE(memory_unchanged());
  // A DETACH of a dead attachment does nothing; a fresh attach works.
  ASSERT_TRUE(c.send_frame(on(*a, FrameType::detach, 0, 0, 0)));
  auto b = attach(c, t, transport::Access::write);
  ASSERT_TRUE(b);
  EXPECT_NE(b->id, a->id);
}

TEST_F(TcpRegionHostileTest, ADoneNamingAnAttachmentIsRefusedAndTheAttachmentLivesOn) {
  auto region = make(RegionAccess::read);
  const Target t = target(region);
  RawClient c(t.address);
  ASSERT_TRUE(c.connected() && c.greet("raw")) << c.error();
  auto a = attach(c, t, transport::Access::read);
  ASSERT_TRUE(a);
  FrameHeader done = on(*a, FrameType::done, 1, 0, 0);
  done.flags = static_cast<std::uint16_t>(transport::Access::read);
  ASSERT_TRUE(c.send_frame(done));
  EXPECT_TRUE(is_status(c.read_frame(), 1, ErrorCode::ProtocolError, "DONE names an attachment"));
  ASSERT_TRUE(c.send_frame(on(*a, FrameType::read, 2, t.base, 64)));
  EXPECT_TRUE(is_data(c.read_frame(), 2, 64, kSeed, 0));
  ASSERT_EQ(region.peers().size(), 1u);
}

TEST_F(TcpRegionHostileTest, OneConnectionCannotAttachWithoutBound) {
  auto region = make(RegionAccess::read);
  const Target t = target(region);
  RawClient c(t.address);
  ASSERT_TRUE(c.connected() && c.greet("raw")) << c.error();
  std::size_t attached = 0;
  for (std::uint64_t req = 1; req <= 300; ++req) {
    ASSERT_TRUE(c.send_frame(attach_frame(t, req, transport::Access::read)));
    auto f = c.read_frame();
    ASSERT_TRUE(f) << c.error();
    if (f->header.type == FrameType::attached) {
      ++attached;
      continue;
    }
    EXPECT_TRUE(is_status(f, req, ErrorCode::Unsupported, "too many attachments"));
    break;
  }
  EXPECT_EQ(attached, 256u);
}

// READ_RANGES: one request names a block list; the owner checks every range before any byte
// moves, then answers each with a DATA naming its address.
std::vector<std::byte> range_list(const std::vector<std::pair<std::uint64_t, std::uint64_t>>& rs) {
  std::vector<std::byte> out(rs.size() * 16);
  for (std::size_t i = 0; i < rs.size(); ++i) {
    std::memcpy(out.data() + i * 16, &rs[i].first, 8);
    std::memcpy(out.data() + i * 16 + 8, &rs[i].second, 8);
  }
  return out;
}

TEST_F(TcpRegionHostileTest, AReadOfRangesIsAnsweredByOneDataPerRangeNamingIt) {
  auto region = make(RegionAccess::read);
  const Target t = target(region);
  RawClient c(t.address);
  ASSERT_TRUE(c.connected() && c.greet("raw")) << c.error();
  auto a = attach(c, t, transport::Access::read);
  ASSERT_TRUE(a);
  // Out of order, one range twice, one 1-byte range.
  const std::vector<std::pair<std::uint64_t, std::uint64_t>> rs = {
      {t.base + 8192, 4096}, {t.base, 100}, {t.base + 8192, 4096}, {t.base + kSize - 1, 1}};
  const auto list = range_list(rs);
  ASSERT_TRUE(c.send_frame(on(*a, FrameType::read_ranges, 7, 0, list.size()), {}, list));
  for (const auto& [addr, len] : rs) {
    auto f = c.read_frame();
    EXPECT_TRUE(is_data(f, 7, len, kSeed, addr - t.base));
    if (f) {
      EXPECT_EQ(f->header.addr, addr);
    }
  }
  // Nothing more for that request: the next answer is the next request's.
  ASSERT_TRUE(c.send_frame(on(*a, FrameType::read, 8, t.base, 16)));
  EXPECT_TRUE(is_data(c.read_frame(), 8, 16, kSeed, 0));
}

TEST_F(TcpRegionHostileTest, AReadOfRangesWithOneBadRangeMovesNoByte) {
  auto region = make(RegionAccess::read);
  const Target t = target(region);
  RawClient c(t.address);
  ASSERT_TRUE(c.connected() && c.greet("raw")) << c.error();
  auto a = attach(c, t, transport::Access::read);
  ASSERT_TRUE(a);
  struct Case {
    std::pair<std::uint64_t, std::uint64_t> bad;
    ErrorCode code;
    const char* point;
  };
  const Case cases[] = {
      {{t.base + kSize - 10, 11}, ErrorCode::AccessDenied, "outside"},
      {{t.base - 1, 1}, ErrorCode::AccessDenied, "outside"},
      {{~std::uint64_t{0} - 4, 16}, ErrorCode::AccessDenied, "outside"},
      {{t.base, 0}, ErrorCode::AccessDenied, "each takes 1 byte or more"},
      {{t.base, TcpOptions{}.max_request}, ErrorCode::AccessDenied, "at most"},
  };
  std::uint64_t req = 10;
  for (const Case& k : cases) {
    // Good ranges on both sides of the bad one.
    const auto list = range_list({{t.base, 64}, k.bad, {t.base + 64, 64}});
    ASSERT_TRUE(c.send_frame(on(*a, FrameType::read_ranges, ++req, 0, list.size()), {}, list));
    EXPECT_TRUE(is_status(c.read_frame(), req, k.code, k.point))
        << k.bad.first << "+" << k.bad.second;
  }
  // The attachment goes on: no DATA of the refused requests is left on the stream.
  ASSERT_TRUE(c.send_frame(on(*a, FrameType::read, 99, t.base + 128, 16)));
  EXPECT_TRUE(is_data(c.read_frame(), 99, 16, kSeed, 128));
}

TEST_F(TcpRegionHostileTest, AMalformedRangeListEndsTheConnection) {
  auto region = make(RegionAccess::read);
  const Target t = target(region);
  for (std::uint64_t len :
       {std::uint64_t{24}, std::uint64_t{(transport::wire::kMaxReadRanges + 1) * 16}}) {
    RawClient c(t.address);
    ASSERT_TRUE(c.connected() && c.greet("raw")) << c.error();
    auto a = attach(c, t, transport::Access::read);
    ASSERT_TRUE(a);
    // Only the header: a server that waited for the list would time out here.
    ASSERT_TRUE(c.send_frame(on(*a, FrameType::read_ranges, 1, 0, len)));
    EXPECT_TRUE(is_status(c.read_frame(), 0, ErrorCode::ProtocolError,
                          "READ_RANGES of " + std::to_string(len) + " bytes of ranges"));
    EXPECT_TRUE(c.closed_by_peer()) << c.error();
  }
}

}  // namespace
}  // namespace ferry
