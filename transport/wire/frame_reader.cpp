#include "transport/wire/frame_reader.hpp"

#include <algorithm>
#include <memory>

#include "loop/ids.hpp"

namespace ferry::transport::wire {

namespace {

// Payloads nobody wants are read into this and dropped: one per thread, allocated on the
// thread's first use (never static TLS, which every thread's stack would carry: see
// stream_connection.cpp).
constexpr std::size_t kDiscardSize = 256 * 1024;
std::byte* discard_buffer() {
  thread_local std::unique_ptr<std::byte[]> buffer;
  if (!buffer) buffer = std::make_unique_for_overwrite<std::byte[]>(kDiscardSize);
  return buffer.get();
}

}  // namespace

std::span<std::byte> FrameReader::next() noexcept {
  switch (state_) {
    case State::header:
      return {header_bytes_.data() + got_, kHeaderSize - got_};
    case State::message:
      return {reinterpret_cast<std::byte*>(message_.data()) + got_, message_.size() - got_};
    case State::payload: {
      const std::uint64_t rest = header_.len - got_;
      if (sink_.dest != nullptr)
        return {sink_.dest + got_,
                static_cast<std::size_t>(std::min<std::uint64_t>(rest, 1u << 30))};
      return {discard_buffer(),
              static_cast<std::size_t>(std::min<std::uint64_t>(rest, kDiscardSize))};
    }
    case State::broken:
      break;
  }
  return {discard_buffer(), kDiscardSize};
}

std::optional<std::string> FrameReader::advance(std::size_t n) {
  if (state_ == State::broken) return std::string("the stream broke the protocol before");
  got_ += n;
  switch (state_) {
    case State::header: {
      if (got_ < kHeaderSize) return std::nullopt;
      got_ = 0;
      header_ = decode(header_bytes_.data());
      if (auto what = malformed(header_)) {
        state_ = State::broken;
        return what;
      }
      if (header_.msg_len > 0) {
        message_.assign(header_.msg_len, '\0');
        state_ = State::message;
        return std::nullopt;
      }
      message_.clear();
      return frame_read();
    }
    case State::message:
      if (got_ < message_.size()) return std::nullopt;
      got_ = 0;
      return frame_read();
    case State::payload:
      if (got_ < header_.len) return std::nullopt;
      break;
    case State::broken:
      return std::nullopt;
  }
  // The payload is complete.
  state_ = State::header;
  got_ = 0;
  const std::uint64_t tag = sink_.tag;
  const bool intact = intact_ && sink_.dest != nullptr;
  sink_ = Sink{};
  handler_.on_payload(header_, tag, intact);
  return std::nullopt;
}

std::optional<std::string> FrameReader::frame_read() {
  state_ = State::header;
  if (!message_.empty() && !loop::valid_utf8(message_)) message_ = loop::sanitized_utf8(message_);
  Sink sink = handler_.on_frame(header_, std::move(message_));
  message_.clear();
  if (sink.fatal) {
    state_ = State::broken;
    return sink.error;
  }
  if (!has_payload(header_.type)) return std::nullopt;
  sink_ = std::move(sink);
  intact_ = sink_.dest != nullptr;
  got_ = 0;
  if (header_.len > 0) {
    state_ = State::payload;
    return std::nullopt;
  }
  const std::uint64_t tag = sink_.tag;
  const bool intact = intact_;
  sink_ = Sink{};
  handler_.on_payload(header_, tag, intact);
  return std::nullopt;
}

void FrameReader::drop_sink(std::uint64_t tag) noexcept {
  if (state_ == State::payload && sink_.dest != nullptr && sink_.tag == tag) {
    sink_.dest = nullptr;
    intact_ = false;
  }
}

}  // namespace ferry::transport::wire
