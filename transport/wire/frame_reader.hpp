#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "transport/wire/frame.hpp"

namespace ferry::transport::wire {

/// Where a frame's payload goes. `dest == nullptr` discards it (a refused write, the answer
/// to a request since cancelled). `fatal`: the frame breaks the protocol; the stream ends with
/// `error`.
struct Sink {
  std::byte* dest = nullptr;
  std::uint64_t tag = 0;
  bool fatal = false;
  std::string error;
};

/// A sink that ends the stream with `why`: for a frame that breaks the protocol.
inline Sink fatal(std::string why) {
  Sink s;
  s.fatal = true;
  s.error = std::move(why);
  return s;
}

/// Cuts a stream of bytes into ferry's frames, whatever carries it (a socket read straight into
/// memory, or the SENDs of an RDMA connection copied in), and checks each the same way: a
/// well-formed header, a message of valid UTF-8 (a peer's text goes into errors and JSON:
/// anything else is sanitized), a payload only where has_payload() says. The reader never
/// allocates for a payload: the handler says where each one goes once it has seen the header
/// (it checks a token before it sizes a buffer, say), and what it refuses is skipped.
///
/// Single-threaded, like its owner.
class FrameReader {
 public:
  class Handler {
   public:
    virtual ~Handler() = default;
    /// A frame's header and message arrived. For a frame with payload, says where it goes.
    virtual Sink on_frame(const FrameHeader& header, std::string message) = 0;
    /// All of a frame's payload arrived (also for a payload of 0 bytes); `intact` is false if
    /// it was discarded, in whole or in part.
    virtual void on_payload(const FrameHeader& header, std::uint64_t tag, bool intact) = 0;
  };

  explicit FrameReader(Handler& handler) noexcept : handler_(handler) {}

  /// Where the next bytes of the stream go: never empty.
  std::span<std::byte> next() noexcept;
  /// `n` bytes, at most next().size(), were put where next() said. Calls the handler when a
  /// frame's header and message, or its payload, are complete (at most one call). Returns why
  /// the stream breaks the protocol, if it does; the reader takes nothing more after that.
  std::optional<std::string> advance(std::size_t n);
  /// If a payload tagged `tag` is being received, the rest of it is discarded.
  void drop_sink(std::uint64_t tag) noexcept;
  /// Whether the reader is between frames (nothing of a frame read yet).
  bool between_frames() const noexcept { return state_ == State::header && got_ == 0; }

 private:
  enum class State { header, message, payload, broken };
  std::optional<std::string> frame_read();

  Handler& handler_;
  State state_ = State::header;
  HeaderBytes header_bytes_{};
  FrameHeader header_{};
  std::string message_;
  Sink sink_;
  bool intact_ = true;
  std::uint64_t got_ = 0;  ///< bytes of the current stage read so far
};

}  // namespace ferry::transport::wire
