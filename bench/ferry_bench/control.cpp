#include "bench/ferry_bench/control.hpp"

#include <nats/nats.h>

#include <algorithm>
#include <condition_variable>
#include <utility>

namespace ferry_bench {

namespace {

// Room for the header line in front of a piece.
constexpr std::size_t kHeaderRoom = 1024;

std::string status_text(natsStatus s) {
  const char* last = nats_GetLastError(nullptr);
  std::string text = natsStatus_GetText(s);
  if (last != nullptr && *last != '\0' && text != last) text += std::string(" (") + last + ")";
  return text;
}

// Splits a reply body into its header and payload.
Reply split(const std::string& body) {
  const auto nl = body.find('\n');
  Reply r;
  r.header = json::parse(body.substr(0, nl));
  if (nl != std::string::npos) r.payload = body.substr(nl + 1);
  return r;
}

}  // namespace

NatsConnection::NatsConnection(const std::string& url, const std::string& name) {
  natsOptions* opts = nullptr;
  natsStatus s = natsOptions_Create(&opts);
  if (s == NATS_OK) s = natsOptions_SetURL(opts, url.c_str());
  if (s == NATS_OK) s = natsOptions_SetName(opts, name.c_str());
  // Without it, every reply waits for cnats' flusher (about 1 ms).
  if (s == NATS_OK) s = natsOptions_SetSendAsap(opts, true);
  if (s == NATS_OK) s = natsOptions_SetTimeout(opts, 2000);
  if (s == NATS_OK) s = natsOptions_SetMaxReconnect(opts, 10);
  if (s == NATS_OK) s = natsConnection_Connect(&nc_, opts);
  natsOptions_Destroy(opts);
  if (s != NATS_OK) {
    throw ControlError("cannot connect to the NATS server at " + url + ": " + status_text(s),
                       false);
  }
}

NatsConnection::~NatsConnection() { natsConnection_Destroy(nc_); }

std::size_t NatsConnection::max_payload() const {
  const int64_t max = natsConnection_GetMaxPayload(nc_);
  return max > 0 ? static_cast<std::size_t>(max) : std::size_t{1} << 20;
}

ControlClient::ControlClient(const std::string& url, const std::string& session)
    : nc_(url, "ferry-bench-initiator"), subject_(session + ".ctl") {}

void ControlClient::close() { natsConnection_Close(nc_.get()); }

std::string ControlClient::raw(const std::string& data, std::chrono::milliseconds timeout) {
  natsMsg* msg = nullptr;
  const natsStatus s = natsConnection_Request(&msg, nc_.get(), subject_.c_str(), data.data(),
                                              static_cast<int>(data.size()), timeout.count());
  if (s != NATS_OK) {
    throw ControlError("control request on " + subject_ + ": " + status_text(s),
                       s == NATS_NO_RESPONDERS);
  }
  std::string body(natsMsg_GetData(msg), static_cast<std::size_t>(natsMsg_GetDataLength(msg)));
  natsMsg_Destroy(msg);
  return body;
}

Reply ControlClient::request(const json& request, std::chrono::milliseconds timeout) {
  std::string body = raw(request.dump(), timeout);
  Reply r;
  try {
    r = split(body);
    if (r.header.contains("chunked")) {
      const auto id = r.header.at("chunked").get<std::uint64_t>();
      const auto size = r.header.at("size").get<std::size_t>();
      std::string full = std::move(r.payload);
      while (full.size() < size) {
        std::string piece =
            raw(json{{"cmd", "chunk"}, {"id", id}, {"offset", full.size()}}.dump(), timeout);
        if (piece.empty()) throw ControlError("a chunked control reply ended early", false);
        full += piece;
      }
      r = split(full);
    }
  } catch (const json::exception& e) {
    throw ControlError(std::string("malformed control reply: ") + e.what(), false);
  }
  if (r.header.contains("error"))
    throw ControlError("the target says: " + r.header.at("error").get<std::string>(), false);
  return r;
}

ControlServer::ControlServer(const std::string& url, const std::string& session, Handler handler)
    : handler_(std::move(handler)), nc_(url, "ferry-bench-target") {
  piece_ = nc_.max_payload() - kHeaderRoom;
  const std::string subject = session + ".ctl";
  natsStatus s = natsConnection_Subscribe(&sub_, nc_.get(), subject.c_str(), on_message, this);
  if (s == NATS_OK) s = natsSubscription_SetPendingLimits(sub_, -1, -1);
  // Once the flush is back, the server has the subscription: an initiator asking now is served.
  if (s == NATS_OK) s = natsConnection_Flush(nc_.get());
  if (s != NATS_OK) {
    natsSubscription_Destroy(sub_);
    throw ControlError("cannot serve " + subject + ": " + status_text(s), false);
  }
}

ControlServer::~ControlServer() {
  // The handler may be running on cnats' thread: wait for the subscription to be done with it.
  struct Done {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
  } done;
  const bool waitable = natsSubscription_SetOnCompleteCB(
                            sub_,
                            [](void* closure) {
                              auto* d = static_cast<Done*>(closure);
                              std::lock_guard lock(d->mu);
                              d->done = true;
                              d->cv.notify_all();
                            },
                            &done) == NATS_OK;
  if (natsSubscription_Unsubscribe(sub_) == NATS_OK && waitable) {
    std::unique_lock lock(done.mu);
    done.cv.wait_for(lock, std::chrono::seconds(10), [&] { return done.done; });
  }
  natsSubscription_Destroy(sub_);
}

void ControlServer::on_message(natsConnection* nc, natsSubscription*, natsMsg* msg, void* closure) {
  auto* self = static_cast<ControlServer*>(closure);
  const std::string data(natsMsg_GetData(msg),
                         static_cast<std::size_t>(natsMsg_GetDataLength(msg)));
  const char* reply = natsMsg_GetReply(msg);
  const std::string reply_subject = reply != nullptr ? reply : "";
  natsMsg_Destroy(msg);
  const std::string body = self->serve(data);
  if (!reply_subject.empty())
    natsConnection_Publish(nc, reply_subject.c_str(), body.data(), static_cast<int>(body.size()));
}

std::string ControlServer::serve(const std::string& data) {
  json request;
  try {
    request = json::parse(data);
    if (request.value("cmd", "") == "chunk") {
      const auto id = request.at("id").get<std::uint64_t>();
      const auto offset = request.at("offset").get<std::size_t>();
      auto it = chunked_.find(id);
      if (it == chunked_.end() || offset >= it->second.size()) return {};
      std::string piece = it->second.substr(offset, piece_);
      if (offset + piece.size() >= it->second.size()) chunked_.erase(it);
      return piece;
    }
  } catch (const std::exception& e) {
    return json{{"error", std::string("bad request: ") + e.what()}}.dump() + "\n";
  }
  std::string body;
  try {
    Reply r = handler_(request);
    body = r.header.dump() + "\n" + r.payload;
  } catch (const std::exception& e) {
    return json{{"error", e.what()}}.dump() + "\n";
  }
  if (body.size() <= piece_) return body;
  // Too large for one message: keep it until the client has fetched it (a few at most, in
  // case a client gives up halfway).
  const std::uint64_t id = next_chunked_++;
  while (chunked_.size() >= 16) chunked_.erase(chunked_.begin());
  std::string stub = json{{"chunked", id}, {"size", body.size()}}.dump() + "\n";
  std::string first = body.substr(0, piece_ - stub.size());
  chunked_.emplace(id, std::move(body));
  return stub + first;
}

}  // namespace ferry_bench
