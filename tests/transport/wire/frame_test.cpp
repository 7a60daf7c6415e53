// The TCP frame header of transport/wire/frame.hpp: its byte layout (docs/protocol.md,
// "Frames"), encode/decode, and the checks every received header must pass.
#include "transport/wire/frame.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>

namespace ferry::transport::wire {
namespace {

// A header whose every field holds a distinct, non-default value, so that a field written
// to the wrong place or with the wrong width shows up.
FrameHeader full_header() {
  FrameHeader h;
  h.type = FrameType::write;
  h.flags = 0x0201;
  h.status = 0x06050403;
  h.msg_len = 0x0a090807;  // over kMaxMessage; tests of malformed() set their own
  h.req_id = 0x1211100f0e0d0c0bULL;
  h.op_id = 0x1a19181716151413ULL;
  h.addr = 0x2221201f1e1d1c1bULL;
  h.len = 0x2a29282726252423ULL;
  for (std::size_t i = 0; i < h.token.size(); ++i) h.token[i] = static_cast<std::uint8_t>(0xb0 + i);
  return h;
}

std::uint8_t byte_at(const HeaderBytes& b, std::size_t offset) {
  return static_cast<std::uint8_t>(b[offset]);
}

// Reads `size` bytes at `offset` as a little-endian number, independent of the host's order.
std::uint64_t little_endian_at(const HeaderBytes& b, std::size_t offset, std::size_t size) {
  std::uint64_t v = 0;
  for (std::size_t i = size; i > 0; --i) v = v << 8 | byte_at(b, offset + i - 1);
  return v;
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(Frame, HeaderIsSixtyFourBytes) {
  EXPECT_EQ(kHeaderSize, 64u);
  EXPECT_EQ(sizeof(HeaderBytes), kHeaderSize);
  EXPECT_EQ(kMaxMessage, 4096u);
}

TEST(Frame, DefaultHeaderIsAWellFormedHello) {
  const FrameHeader h;
  EXPECT_EQ(h.magic, kMagic);
  EXPECT_EQ(h.version, kVersion);
  EXPECT_EQ(h.type, FrameType::hello);
  EXPECT_EQ(malformed(h), std::nullopt);
}

TEST(Frame, EncodeDecodeRoundTripsEveryField) {
  const FrameHeader in = full_header();
  const HeaderBytes bytes = encode(in);
  const FrameHeader out = decode(bytes.data());
  EXPECT_EQ(out.magic, in.magic);
  EXPECT_EQ(out.version, in.version);
  EXPECT_EQ(out.type, in.type);
  EXPECT_EQ(out.flags, in.flags);
  EXPECT_EQ(out.status, in.status);
  EXPECT_EQ(out.msg_len, in.msg_len);
  EXPECT_EQ(out.req_id, in.req_id);
  EXPECT_EQ(out.op_id, in.op_id);
  EXPECT_EQ(out.addr, in.addr);
  EXPECT_EQ(out.len, in.len);
  EXPECT_EQ(out.token, in.token);
  EXPECT_EQ(encode(out), bytes);
}

TEST(Frame, RoundTripsExtremeValues) {
  FrameHeader in;
  in.magic = 0xffffffffu;
  in.version = 0xff;
  in.type = static_cast<FrameType>(0xff);
  in.flags = 0xffff;
  in.status = 0xffffffffu;
  in.msg_len = 0xffffffffu;
  in.req_id = ~0ULL;
  in.op_id = ~0ULL;
  in.addr = ~0ULL;
  in.len = ~0ULL;
  in.token.fill(0xff);
  const HeaderBytes bytes = encode(in);
  for (std::size_t i = 0; i < bytes.size(); ++i) EXPECT_EQ(byte_at(bytes, i), 0xff) << i;
  const FrameHeader out = decode(bytes.data());
  EXPECT_EQ(out.magic, in.magic);
  EXPECT_EQ(out.version, in.version);
  EXPECT_EQ(out.type, in.type);
  EXPECT_EQ(out.flags, in.flags);
  EXPECT_EQ(out.status, in.status);
  EXPECT_EQ(out.msg_len, in.msg_len);
  EXPECT_EQ(out.req_id, in.req_id);
  EXPECT_EQ(out.op_id, in.op_id);
  EXPECT_EQ(out.addr, in.addr);
  EXPECT_EQ(out.len, in.len);
  EXPECT_EQ(out.token, in.token);
}

TEST(Frame, MagicSpellsFRRYOnTheWire) {
  const HeaderBytes bytes = encode(FrameHeader{});
  EXPECT_EQ(std::memcmp(bytes.data(), "FRRY", 4), 0);
}

TEST(Frame, FieldsAreLittleEndianAtTheDocumentedOffsets) {
  const FrameHeader h = full_header();
  const HeaderBytes b = encode(h);
  EXPECT_EQ(little_endian_at(b, 0, 4), kMagic);
  EXPECT_EQ(byte_at(b, 4), kVersion);
  EXPECT_EQ(byte_at(b, 5), 4);  // WRITE
  EXPECT_EQ(little_endian_at(b, 6, 2), h.flags);
  EXPECT_EQ(little_endian_at(b, 8, 4), h.status);
  EXPECT_EQ(little_endian_at(b, 12, 4), h.msg_len);
  EXPECT_EQ(little_endian_at(b, 16, 8), h.req_id);
  EXPECT_EQ(little_endian_at(b, 24, 8), h.op_id);
  EXPECT_EQ(little_endian_at(b, 32, 8), h.addr);
  EXPECT_EQ(little_endian_at(b, 40, 8), h.len);
  for (std::size_t i = 0; i < h.token.size(); ++i) EXPECT_EQ(byte_at(b, 48 + i), h.token[i]) << i;

  // full_header() numbers its bytes so that the encoding from offset 6 to 47 counts upward:
  // the lowest byte of each field first.
  for (std::size_t i = 6; i < 48; ++i)
    EXPECT_EQ(byte_at(b, i), static_cast<std::uint8_t>(i - 5)) << "offset " << i;
}

TEST(Frame, DecodeReadsHandBuiltBytes) {
  HeaderBytes b{};
  const std::uint8_t raw[] = {
      0x46, 0x52, 0x52, 0x59,                          // magic "FRRY"
      0x01,                                            // version
      0x05,                                            // STATUS
      0x02, 0x00,                                      // flags
      0x0a, 0x00, 0x00, 0x00,                          // status 10 (ProtocolError)
      0x03, 0x00, 0x00, 0x00,                          // msg_len 3
      0x01, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // req_id 0x201
      0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x80,  // op_id 2^63
      0xef, 0xbe, 0xad, 0xde, 0x00, 0x00, 0x00, 0x00,  // addr 0xdeadbeef
      0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x00,  // len 2^24
  };
  static_assert(sizeof raw == 48);
  std::memcpy(b.data(), raw, sizeof raw);
  for (std::size_t i = 48; i < kHeaderSize; ++i) b[i] = static_cast<std::byte>(i);
  const FrameHeader h = decode(b.data());
  EXPECT_EQ(h.magic, kMagic);
  EXPECT_EQ(h.version, 1);
  EXPECT_EQ(h.type, FrameType::status);
  EXPECT_EQ(h.flags, 2);
  EXPECT_EQ(h.status, 10u);
  EXPECT_EQ(h.msg_len, 3u);
  EXPECT_EQ(h.req_id, 0x201u);
  EXPECT_EQ(h.op_id, 1ULL << 63);
  EXPECT_EQ(h.addr, 0xdeadbeefULL);
  EXPECT_EQ(h.len, 1ULL << 24);
  for (std::size_t i = 0; i < h.token.size(); ++i) EXPECT_EQ(h.token[i], 48 + i) << i;
  EXPECT_EQ(malformed(h), std::nullopt);
}

TEST(Frame, TypeValuesMatchTheProtocol) {
  EXPECT_EQ(static_cast<int>(FrameType::hello), 1);
  EXPECT_EQ(static_cast<int>(FrameType::read), 2);
  EXPECT_EQ(static_cast<int>(FrameType::data), 3);
  EXPECT_EQ(static_cast<int>(FrameType::write), 4);
  EXPECT_EQ(static_cast<int>(FrameType::status), 5);
  EXPECT_EQ(static_cast<int>(FrameType::done), 6);
  EXPECT_EQ(static_cast<int>(FrameType::claimed), 7);
  EXPECT_EQ(static_cast<int>(FrameType::claim), 8);
  EXPECT_EQ(static_cast<int>(FrameType::attach), 9);
  EXPECT_EQ(static_cast<int>(FrameType::attached), 10);
  EXPECT_EQ(static_cast<int>(FrameType::ended), 11);
  EXPECT_EQ(static_cast<int>(FrameType::detach), 12);
  EXPECT_EQ(static_cast<int>(FrameType::read_ranges), 13);
}

TEST(Frame, DataWriteClaimAndClaimedCarryPayload) {
  // One rule for every carrier: tcp's, the same-host methods' and verbs' control messages.
  EXPECT_FALSE(has_payload(FrameType::hello));
  EXPECT_FALSE(has_payload(FrameType::read));
  EXPECT_TRUE(has_payload(FrameType::data));
  EXPECT_TRUE(has_payload(FrameType::write));
  EXPECT_FALSE(has_payload(FrameType::status));
  EXPECT_FALSE(has_payload(FrameType::done));
  EXPECT_TRUE(has_payload(FrameType::claimed));
  EXPECT_TRUE(has_payload(FrameType::claim));
  EXPECT_FALSE(has_payload(FrameType::attach));
  EXPECT_TRUE(has_payload(FrameType::attached));
  EXPECT_TRUE(has_payload(FrameType::ended));
  EXPECT_FALSE(has_payload(FrameType::detach));
  EXPECT_TRUE(has_payload(FrameType::read_ranges));
}

TEST(Malformed, AcceptsEveryKnownTypeWithAnyFields) {
  for (int type = 1; type <= 13; ++type) {
    FrameHeader h = full_header();
    h.type = static_cast<FrameType>(type);
    h.msg_len = 0;
    EXPECT_EQ(malformed(h), std::nullopt) << "type " << type;
    h.msg_len = kMaxMessage;  // the longest text allowed
    EXPECT_EQ(malformed(h), std::nullopt) << "type " << type;
  }
}

TEST(Malformed, CatchesBadMagic) {
  for (std::uint32_t magic : {0u, 0x46525259u, kMagic ^ 1u, 0xffffffffu}) {
    FrameHeader h;
    h.magic = magic;
    EXPECT_EQ(malformed(h), "bad magic") << std::hex << magic;
  }
  // The magic is checked first: a header that is garbage throughout says so.
  FrameHeader garbage;
  garbage.magic = 0x01020304;
  garbage.version = 9;
  garbage.type = static_cast<FrameType>(77);
  garbage.msg_len = ~0u;
  EXPECT_EQ(malformed(garbage), "bad magic");
}

TEST(Malformed, CatchesUnknownVersion) {
  for (std::uint8_t version : {std::uint8_t{0}, std::uint8_t{2}, std::uint8_t{255}}) {
    FrameHeader h;
    h.version = version;
    const std::string what = malformed(h).value_or("");
    EXPECT_TRUE(contains(what, "unsupported protocol version " + std::to_string(version))) << what;
  }
}

TEST(Malformed, CatchesUnknownType) {
  for (int type : {0, 14, 15, 0x7f, 0xff}) {
    FrameHeader h;
    h.type = static_cast<FrameType>(type);
    const std::string what = malformed(h).value_or("");
    EXPECT_EQ(what, "unknown frame type " + std::to_string(type)) << what;
  }
}

TEST(Malformed, CatchesOverlongMessage) {
  for (std::uint32_t len : {kMaxMessage + 1, 1u << 20, ~0u}) {
    FrameHeader h;
    h.type = FrameType::done;
    h.msg_len = len;
    const std::string what = malformed(h).value_or("");
    EXPECT_EQ(what, "message of " + std::to_string(len) + " bytes") << what;
  }
}

TEST(Malformed, SurvivesARoundTripThroughTheWire) {
  // A receiver sees only decoded bytes; a bad field must still be caught after decode().
  FrameHeader h = full_header();
  h.version = 3;
  EXPECT_TRUE(contains(malformed(decode(encode(h).data())).value_or(""), "version 3"));
  h = full_header();
  h.msg_len = kMaxMessage + 1;
  EXPECT_TRUE(contains(malformed(decode(encode(h).data())).value_or(""), "message of"));
  h = full_header();
  h.msg_len = kMaxMessage;
  EXPECT_EQ(malformed(decode(encode(h).data())), std::nullopt);
}

}  // namespace
}  // namespace ferry::transport::wire
