#pragma once

#include <uv.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include <ferry/error.hpp>

#include "loop/log.hpp"
#include "loop/uv_handle.hpp"
#include "transport/wire/frame_reader.hpp"

namespace ferry::transport::wire {

/// One stream connection to a peer, on the loop: TCP for tcp, an abstract Unix socket for the
/// same-host methods. A queue of outgoing frames written with sendmsg straight from their
/// memory, and a FrameReader that reads each frame's payload straight into the memory its
/// handler names. What the frames mean is the handler's business.
///
/// Silence: while it waits for its peer (connect() under way, the peer's HELLO, answers to
/// requests: expect_answers(), the last frames of a close), a watchdog fails the connection
/// once the peer has said nothing for peer_timeout. Only the peer's own bytes, and payload of
/// ours its kernel takes, count as signs of life: a stopped process's kernel keeps taking
/// small frames (keepalives, DONE) into its buffers long after the process stopped reading.
/// An idle pooled connection is left alone.
///
/// HELLO: a client sends its HELLO (name and connector id) at once; a server answers the
/// client's HELLO with its own. Each side's first frame must be a HELLO (a server may refuse
/// a client with a STATUS instead); the handler sees the frames after it.
class StreamConnection : private FrameReader::Handler {
 public:
  enum class Role { client, server };

  /// What a side says of itself in its HELLO.
  struct Hello {
    std::string name;  ///< at most 256 bytes are sent
    std::uint64_t id = 0;
  };

  class Handler {
   public:
    virtual ~Handler() = default;
    /// A frame's header and message arrived. For frames with payload, says where it goes.
    virtual Sink on_frame(StreamConnection& conn, const FrameHeader& header,
                          std::string message) = 0;
    /// All of a frame's payload arrived; `intact` is false if its sink was dropped midway.
    virtual void on_payload(StreamConnection& conn, const FrameHeader& header, std::uint64_t tag,
                            bool intact) = 0;
    /// A frame sent with a non-zero tag has left in full (its memory is no longer needed).
    virtual void on_sent(StreamConnection& conn, std::uint64_t tag) = 0;
    /// The connection is closed; called once, possibly from inside another handler call.
    /// The handler must not destroy the connection before that call has returned.
    virtual void on_closed(StreamConnection& conn, const std::string& reason) = 0;
    /// The peer's HELLO arrived (`hello` is its header; name and id are set on `conn`). A
    /// server may add to `reply`, the HELLO it answers with. Returns why the peer is refused
    /// (the connection then fails with that message); none to go on.
    virtual std::optional<Error> on_hello(StreamConnection& conn, const FrameHeader& hello,
                                          FrameHeader& reply) {
      (void)conn;
      (void)hello;
      (void)reply;
      return std::nullopt;
    }
  };

  /// Takes ownership of `fd` (non-blocking). `connecting`: a client whose connect() is under
  /// way. Throws Error(Internal) when libuv refuses the fd (which is closed then).
  StreamConnection(uv_loop_t* loop, Handler& handler, Role role, int fd, std::uint64_t id,
                   std::string peer_address, std::chrono::milliseconds peer_timeout,
                   bool connecting, Hello local, loop::Log log);
  /// Closes the socket without calling the handler.
  ~StreamConnection() override;
  StreamConnection(const StreamConnection&) = delete;
  StreamConnection& operator=(const StreamConnection&) = delete;

  std::uint64_t id() const noexcept { return id_; }
  int fd() const noexcept { return fd_; }
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
  /// Whether the peer has sent anything at all.
  bool heard() const noexcept { return heard_; }
  /// Counts requests whose answers are awaited (+1 sent, -1 answered or forgotten).
  void expect_answers(int delta) noexcept;
  /// A server's STATUS notice (req_id 0) sent before it closes: the close's real reason.
  void set_notice(std::uint32_t status, std::string message);
  std::uint32_t notice_status() const noexcept { return notice_status_; }
  const std::string& notice() const noexcept { return notice_; }
  /// The status of the notice this side sent before closing (fail_after_notice): 0 when the
  /// connection did not end for something the peer sent.
  std::uint32_t sent_notice_status() const noexcept { return sent_notice_status_; }
  /// "'name' at 1.2.3.4:5" for messages.
  std::string describe_peer() const;

  /// While a Cork lives, send() only queues; the frames leave together, in one sendmsg, when
  /// the last Cork of the connection ends. Used around a batch of frames built in one go.
  class Cork {
   public:
    explicit Cork(StreamConnection& conn) noexcept : conn_(conn) { ++conn_.corked_; }
    ~Cork() {
      if (--conn_.corked_ == 0) conn_.flush();
    }
    Cork(const Cork&) = delete;
    Cork& operator=(const Cork&) = delete;

   private:
    StreamConnection& conn_;
  };

  /// Queues a frame. For a frame with payload, `payload` holds header.len bytes and must stay
  /// valid until on_sent(tag) or release(tag); it is read only while writing, on the loop
  /// thread.
  void send(const FrameHeader& header, std::string_view message = {},
            const std::byte* payload = nullptr, std::uint64_t tag = 0);

  /// Forgets every queued frame tagged `tag`: one partly written keeps going from a private
  /// copy of its remaining payload; the others are rewritten by `replacement(header, message)`
  /// when given (into a frame without payload), else dropped. No memory of `tag` is read
  /// after this returns.
  void release(std::uint64_t tag,
               const std::function<void(FrameHeader&, std::string&)>& replacement = {});
  /// If a payload for `tag` is being received, the rest of it is discarded.
  void drop_sink(std::uint64_t tag) noexcept { reader_.drop_sink(tag); }

  /// Sends a status frame with `status` and closes the connection once it has left (or after
  /// peer_timeout); for protocol errors, after which the stream cannot be trusted.
  void fail_after_notice(std::uint32_t status, const std::string& reason);
  /// Closes now; the handler hears on_closed(reason).
  void fail(const std::string& reason);
  /// Before destruction without handler calls (the transport closes): sends what the socket
  /// takes of the queue at once and half-closes, so that the peer reads the last notices
  /// instead of a reset. Never calls the handler.
  void close_gracefully() noexcept;
  /// Open and not closing: a pooled connection that may take new requests.
  bool usable() const noexcept { return !closed_ && !closing_after_flush_ && broken_.empty(); }

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

  // FrameReader::Handler
  Sink on_frame(const FrameHeader& header, std::string message) override;
  void on_payload(const FrameHeader& header, std::uint64_t tag, bool intact) override;

  static void on_poll(uv_poll_t* handle, int status, int events);
  static void on_timer(uv_timer_t* handle);
  void poll_event(int status, int events);
  /// The peer's first frame: its HELLO, or (to a client) a server's refusal.
  Sink greet(const FrameHeader& header, std::string message);
  void timer_fired();
  /// Whether what the connection polls for (the connect's end, or the peer's bytes) is
  /// ready on the socket now, before the loop has polled.
  bool ready_now() const;
  void watchdog();
  bool awaiting_peer() const noexcept;
  void account(std::int64_t owned_delta) noexcept;
  void finish_connect();
  void read_some();
  void flush();
  /// Writing failed (the peer reset the connection, say): what it sent before is still read,
  /// on the next loop turn, before the connection fails with `reason`: a peer that said why
  /// it left (a DONE that cancels) is heard, not reported lost.
  void broke_while_sending(const std::string& reason);
  void update_poll();
  void close_socket();
  void drain();

  uv_loop_t* loop_;
  Handler& handler_;
  Hello local_;
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
  bool heard_ = false;
  int corked_ = 0;
  bool closing_after_flush_ = false;
  bool write_shut_ = false;
  bool quiet_ = false;  // closing without handler calls: see close_gracefully()
  std::string close_reason_;
  std::string broken_;  // writing failed: the reason the connection fails with, once read out
  int awaiting_ = 0;
  std::uint32_t notice_status_ = 0;
  std::uint32_t sent_notice_status_ = 0;
  std::string notice_;
  // Bytes this connection owns in its queue (headers, texts, copies). A server connection
  // whose queue grows past a high-water mark stops reading requests until it drains, so a
  // client that never reads cannot make it grow without bound.
  std::uint64_t owned_bytes_ = 0;
  bool backlogged_ = false;
  bool bulk_ = false;  ///< the last read went straight into a payload's sink

  std::deque<OutFrame> out_;
  FrameReader reader_{*this};
};

/// Answers request `req_id` on `conn`: a STATUS, success when `error` is null.
void reply(StreamConnection& conn, std::uint64_t req_id, const Error* error);
/// Tells the peer why it goes (a notice, AccessDenied) and frees the connection at once: a
/// listener's eviction. A peer that never reads must not keep its slot while a lingering close
/// waits for it.
void evict(StreamConnection& conn, const std::string& why);

}  // namespace ferry::transport::wire
