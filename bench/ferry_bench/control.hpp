#pragma once

// ferry-bench's control channel between initiator and target: plain cnats request/reply on
// <session>.ctl, with SendAsap (no flusher delay on a round trip).
//
// A request is one JSON object with "cmd". A reply is a JSON header line, '\n', then an
// optional payload of raw bytes (the metadata documents of a batch, say). A reply larger
// than the server's max_payload is sent in pieces: the first answer carries
// {"chunked": id, "size": total} and the first piece; the client asks for the rest
// ({"cmd": "chunk", ...}) and puts the reply together before returning it.

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>

#include "bench/ferry_bench/point.hpp"

struct __natsConnection;
struct __natsSubscription;
struct __natsMsg;

namespace ferry_bench {

struct Reply {
  json header;
  std::string payload;
};

/// A control request that failed: no target answering, a timeout, a closed connection, or
/// an error the target reported ({"error": ...}).
class ControlError : public std::runtime_error {
 public:
  ControlError(const std::string& what, bool no_responders)
      : std::runtime_error(what), no_responders_(no_responders) {}
  /// Nobody serves the control subject (yet, or any more).
  bool no_responders() const { return no_responders_; }

 private:
  bool no_responders_;
};

/// One cnats connection with SendAsap. Throws ControlError when it cannot connect.
class NatsConnection {
 public:
  explicit NatsConnection(const std::string& url, const std::string& name);
  ~NatsConnection();
  NatsConnection(const NatsConnection&) = delete;
  NatsConnection& operator=(const NatsConnection&) = delete;

  __natsConnection* get() const { return nc_; }
  /// The most bytes one message may carry on this server.
  std::size_t max_payload() const;

 private:
  __natsConnection* nc_ = nullptr;
};

/// The initiator's end. request() is safe from any thread (cnats multiplexes requests).
class ControlClient {
 public:
  ControlClient(const std::string& url, const std::string& session);

  /// Sends `request` and waits up to `timeout` for the reply (per piece when chunked).
  /// Throws ControlError.
  Reply request(const json& request, std::chrono::milliseconds timeout);
  /// Closes the connection: requests waiting for a reply fail now, later ones at once. For a
  /// target that is gone, whose replies would never come. Any thread.
  void close();

 private:
  std::string raw(const std::string& data, std::chrono::milliseconds timeout);

  NatsConnection nc_;
  std::string subject_;
};

/// The target's end: serves <session>.ctl with `handler`, called on one cnats thread for one
/// request at a time. An exception from the handler is answered {"error": what}.
class ControlServer {
 public:
  using Handler = std::function<Reply(const json& request)>;
  ControlServer(const std::string& url, const std::string& session, Handler handler);
  ~ControlServer();
  ControlServer(const ControlServer&) = delete;
  ControlServer& operator=(const ControlServer&) = delete;

 private:
  static void on_message(__natsConnection* nc, __natsSubscription* sub, __natsMsg* msg,
                         void* closure);
  void answer(const std::string& reply_subject, const std::string& body);
  std::string serve(const std::string& data);

  Handler handler_;
  NatsConnection nc_;
  std::size_t piece_ = 0;
  std::uint64_t next_chunked_ = 1;
  std::map<std::uint64_t, std::string> chunked_;  // replies being fetched piece by piece
  __natsSubscription* sub_ = nullptr;
};

}  // namespace ferry_bench
