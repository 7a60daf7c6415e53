// FrameReader: one parser for every carrier of ferry's frames, fed in pieces of any size.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "tests/transport/wire/frame_bytes.hpp"
#include "transport/wire/frame_reader.hpp"

namespace ferry::transport::wire {
namespace {

std::string frame(FrameType type, const std::string& message, const std::string& payload = {},
                  std::uint64_t req_id = 0) {
  return test::frame_bytes(type, req_id, message, payload);
}

struct Recorder : FrameReader::Handler {
  struct Seen {
    FrameType type;
    std::string message;
    std::string payload;
    bool intact = false;
  };
  std::vector<Seen> seen;
  std::string buffer;
  bool discard = false;
  bool refuse = false;

  Sink on_frame(const FrameHeader& h, std::string message) override {
    seen.push_back({h.type, std::move(message), {}, false});
    if (refuse) return fatal("refused by the handler");
    Sink s;
    if (!discard && has_payload(h.type)) {
      buffer.assign(h.len, '\0');
      s.dest = reinterpret_cast<std::byte*>(buffer.data());
    }
    return s;
  }
  void on_payload(const FrameHeader&, std::uint64_t, bool intact) override {
    seen.back().intact = intact;
    if (intact) seen.back().payload = buffer;
  }
};

/// Feeds `stream` to `reader` `piece` bytes at a time (at most what next() asks for); the
/// first error, if any.
std::optional<std::string> feed(FrameReader& reader, const std::string& stream, std::size_t piece) {
  std::size_t at = 0;
  while (at < stream.size()) {
    auto room = reader.next();
    const std::size_t n = std::min({piece, room.size(), stream.size() - at});
    std::memcpy(room.data(), stream.data() + at, n);
    at += n;
    if (auto e = reader.advance(n)) return e;
  }
  return std::nullopt;
}

TEST(FrameReader, FramesArriveWholeWhateverTheCutsOfTheStream) {
  const std::string stream = frame(FrameType::hello, "peer") +
                             frame(FrameType::data, "", std::string(100000, 'x'), 7) +
                             frame(FrameType::status, "why");
  for (std::size_t piece : {std::size_t{1}, std::size_t{7}, std::size_t{64}, stream.size()}) {
    Recorder r;
    FrameReader reader(r);
    ASSERT_EQ(feed(reader, stream, piece), std::nullopt) << piece;
    ASSERT_EQ(r.seen.size(), 3u) << piece;
    EXPECT_EQ(r.seen[0].message, "peer");
    EXPECT_EQ(r.seen[1].payload, std::string(100000, 'x'));
    EXPECT_TRUE(r.seen[1].intact);
    EXPECT_EQ(r.seen[2].message, "why");
    EXPECT_TRUE(reader.between_frames());
  }
}

TEST(FrameReader, APayloadNobodyWantsIsReadAndDropped) {
  Recorder r;
  r.discard = true;
  FrameReader reader(r);
  ASSERT_EQ(
      feed(reader,
           frame(FrameType::write, "", std::string(300000, 'y')) + frame(FrameType::hello, "next"),
           4096),
      std::nullopt);
  ASSERT_EQ(r.seen.size(), 2u);
  EXPECT_FALSE(r.seen[0].intact);
  EXPECT_EQ(r.seen[1].message, "next") << "the dropped payload was taken for a frame";
}

TEST(FrameReader, APayloadDroppedMidwayEndsNotIntact) {
  Recorder r;
  FrameReader reader(r);
  const std::string stream = frame(FrameType::data, "", std::string(1000, 'z'));
  ASSERT_EQ(feed(reader, stream.substr(0, kHeaderSize + 10), 1000), std::nullopt);
  reader.drop_sink(0);
  ASSERT_EQ(feed(reader, stream.substr(kHeaderSize + 10), 1000), std::nullopt);
  ASSERT_EQ(r.seen.size(), 1u);
  EXPECT_FALSE(r.seen[0].intact);
}

TEST(FrameReader, AMalformedHeaderOrARefusedFrameBreaksTheStreamForGood) {
  Recorder r;
  FrameReader reader(r);
  std::string bad = frame(FrameType::hello, "");
  bad[0] = 'X';  // the magic
  EXPECT_TRUE(feed(reader, bad, 64).has_value());
  EXPECT_TRUE(feed(reader, frame(FrameType::hello, "after"), 64).has_value());
  EXPECT_TRUE(r.seen.empty());

  Recorder refusing;
  refusing.refuse = true;
  FrameReader second(refusing);
  const auto e = feed(second, frame(FrameType::hello, "x"), 64);
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(*e, "refused by the handler");
}

TEST(FrameReader, TextThatIsNotUtf8IsSanitized) {
  Recorder r;
  FrameReader reader(r);
  ASSERT_EQ(feed(reader, frame(FrameType::status, std::string("bad \xff\xfe text")), 64),
            std::nullopt);
  ASSERT_EQ(r.seen.size(), 1u);
  EXPECT_NE(r.seen[0].message, std::string("bad \xff\xfe text"));
  EXPECT_NE(r.seen[0].message.find("bad"), std::string::npos);
}

}  // namespace
}  // namespace ferry::transport::wire
