#pragma once

#include <uv.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "loop/uv_handle.hpp"
#include "transport/tcp/frame.hpp"

namespace ferry::transport::tcp {

/// One TCP connection to a peer, on the loop: a queue of outgoing frames written with
/// writev straight from their memory, and a receive state machine that reads each frame's
/// payload straight into the memory its handler names. What the frames mean is the
/// handler's business.
class Connection {
 public:
  enum class Role { client, server };

  /// Where a frame's payload goes. `dest == nullptr` discards it (a refused write, a read
  /// response for a cancelled transfer). `fatal` closes the connection with `error`.
  struct Sink {
    std::byte* dest = nullptr;
    std::uint64_t tag = 0;
    bool fatal = false;
    std::string error;
  };

  class Handler {
   public:
    virtual ~Handler() = default;
    /// A frame's header and message arrived. For frames with payload, says where it goes.
    virtual Sink on_frame(Connection& conn, const FrameHeader& header, std::string message) = 0;
    /// All of a frame's payload arrived; `intact` is false if its sink was dropped midway.
    virtual void on_payload(Connection& conn, const FrameHeader& header, std::uint64_t tag,
                            bool intact) = 0;
    /// A frame sent with a non-zero tag has left in full (its memory is no longer needed).
    virtual void on_sent(Connection& conn, std::uint64_t tag) = 0;
    /// The connection is closed; called once, possibly from inside another handler call.
    /// The handler must not destroy the connection before that call has returned.
    virtual void on_closed(Connection& conn, const std::string& reason) = 0;
  };

  /// Takes ownership of `fd` (non-blocking). `connecting`: a client whose connect() is under
  /// way.
  ///
  /// A watchdog fails the connection when the peer has been silent (nothing received, nothing
  /// of ours accepted) for `peer_timeout` while we wait for it: for connect() to finish, for
  /// its HELLO, for answers to requests (expect_answers), or for our last frames to leave
  /// before a close. An idle pooled connection is left alone.
  Connection(uv_loop_t* loop, Handler& handler, Role role, int fd, std::uint64_t id,
             std::string peer_address, std::chrono::milliseconds peer_timeout, bool connecting,
             loop::Log log = {});
  /// Closes the socket without calling the handler.
  ~Connection();
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  std::uint64_t id() const noexcept { return id_; }
  std::chrono::steady_clock::time_point opened_at() const noexcept { return opened_at_; }
  Role role() const noexcept { return role_; }
  bool open() const noexcept { return !closed_; }
  const std::string& peer_address() const noexcept { return peer_address_; }
  const std::string& peer_name() const noexcept { return peer_name_; }
  void set_peer_name(std::string name) { peer_name_ = std::move(name); }
  /// The peer connector's id, from its HELLO (16 hex digits); empty before.
  const std::string& peer_id() const noexcept { return peer_id_; }
  void set_peer_id(std::string id) { peer_id_ = std::move(id); }
  /// Whether the peer's HELLO has arrived (it must be its first frame).
  bool greeted() const noexcept { return greeted_; }
  void set_greeted() noexcept;
  /// Counts requests whose answers are awaited (+1 sent, -1 answered or forgotten).
  void expect_answers(int delta) noexcept;
  /// A server's STATUS notice (req_id 0) sent before it closes: the close's real reason.
  void set_notice(std::uint32_t code, std::string message);
  std::uint32_t notice_code() const noexcept { return notice_code_; }
  const std::string& notice() const noexcept { return notice_; }
  /// "'name' at 1.2.3.4:5" for messages.
  std::string describe_peer() const;

  /// While a Cork lives, send() only queues; the frames leave together, in one writev, when
  /// the last Cork of the connection ends. Used around a batch of frames built in one go.
  class Cork {
   public:
    explicit Cork(Connection& conn) noexcept : conn_(conn) { ++conn_.corked_; }
    ~Cork() {
      if (--conn_.corked_ == 0) conn_.flush();
    }
    Cork(const Cork&) = delete;
    Cork& operator=(const Cork&) = delete;

   private:
    Connection& conn_;
  };

  /// Queues a frame. For DATA and WRITE, `payload` holds header.len bytes and must stay valid
  /// until on_sent(tag) or release(tag); it is read only while writing, on the loop thread.
  void send(const FrameHeader& header, std::string_view message = {},
            const std::byte* payload = nullptr, std::uint64_t tag = 0);

  /// Forgets every queued frame tagged `tag`: one partly written keeps going from a private
  /// copy of its remaining payload; the others are rewritten by `replacement(header, message)`
  /// when given (into a frame without payload), else dropped. No memory of `tag` is read after this
  /// returns.
  void release(std::uint64_t tag,
               const std::function<void(FrameHeader&, std::string&)>& replacement = {});
  /// If a payload for `tag` is being received, the rest of it is discarded.
  void drop_sink(std::uint64_t tag) noexcept;

  /// Sends a status frame with `code` and closes the connection once it has left (or after
  /// peer_timeout); for protocol errors, after which the stream cannot be trusted.
  void fail_after_notice(std::uint32_t code, const std::string& reason);
  /// Closes now; the handler hears on_closed(reason).
  void fail(const std::string& reason);
  /// Before destruction without handler calls (the transport closes): sends what the socket
  /// takes of the queue at once and half-closes, so that the peer reads the last notices
  /// instead of a reset. Never calls the handler.
  void close_gracefully() noexcept;
  /// Open and not closing: a pooled connection that may take new requests.
  bool usable() const noexcept { return !closed_ && !closing_after_flush_; }

 private:
  struct OutFrame {
    FrameHeader header;
    HeaderBytes header_bytes;
    std::string message;
    const std::byte* payload = nullptr;
    std::unique_ptr<std::byte[]> owned;  // the payload from owned_from on, copied on release()
    std::uint64_t owned_from = 0;
    std::uint64_t payload_len = 0;
    std::uint64_t tag = 0;
    std::uint64_t sent = 0;  // bytes of header + message + payload written
    std::uint64_t total() const noexcept { return kHeaderSize + message.size() + payload_len; }
  };
  enum class ReadState { header, message, payload };

  static void on_poll(uv_poll_t* handle, int status, int events);
  static void on_timer(uv_timer_t* handle);
  static void poll_event(uv_poll_t* handle, int status, int events);
  static void watchdog_fired(uv_timer_t* handle);
  void watchdog();
  bool awaiting_peer() const noexcept;
  void account(std::int64_t owned_delta) noexcept;
  void finish_connect();
  void read_some();
  void flush();
  void update_poll();
  void start_frame();
  void finish_payload();
  void close_socket();
  void drain();

  uv_loop_t* loop_;
  Handler& handler_;
  loop::Log log_;
  Role role_;
  int fd_;
  std::uint64_t id_;
  std::string peer_address_;
  std::string peer_name_;
  std::string peer_id_;
  std::chrono::milliseconds peer_timeout_;
  std::chrono::steady_clock::time_point opened_at_ = std::chrono::steady_clock::now();

  loop::Poll poll_;
  loop::Timer timer_;
  int poll_events_ = 0;
  bool connecting_;
  bool closed_ = false;
  bool greeted_ = false;
  int corked_ = 0;
  bool closing_after_flush_ = false;
  bool write_shut_ = false;
  bool quiet_ = false;  // closing without handler calls: see close_gracefully()
  std::string close_reason_;
  int awaiting_ = 0;
  std::uint32_t notice_code_ = 0;
  std::string notice_;
  // Bytes this connection owns in its queue (headers, texts, copies). A server connection
  // whose queue grows past a high-water mark stops reading requests until it drains, so a
  // client that never reads cannot make it grow without bound.
  std::uint64_t owned_bytes_ = 0;
  bool backlogged_ = false;

  std::deque<OutFrame> out_;

  ReadState state_ = ReadState::header;
  HeaderBytes header_buf_{};
  std::size_t header_got_ = 0;
  FrameHeader header_{};
  std::string message_;
  Sink sink_;
  std::uint64_t payload_got_ = 0;
  bool sink_intact_ = true;
};

/// A sink that closes the connection with `why`: for a frame that breaks the protocol.
inline Connection::Sink fatal(std::string why) {
  Connection::Sink s;
  s.fatal = true;
  s.error = std::move(why);
  return s;
}

}  // namespace ferry::transport::tcp
