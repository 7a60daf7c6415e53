// ferry-ref-nats: a NATS request/reply round trip with cnats, the reference for what pairing
// by subject adds to an operation. A forked child holds the responder's connection (a
// subscription that publishes each request's payload back to its reply subject); the parent's
// own connection sends natsConnection_Request. natsOptions_SetSendAsap on both, so neither
// waits for cnats' flusher (bench/nats_bench.cpp measures that default ~1 ms delay).
//
//   ferry-ref-nats --url nats://127.0.0.1:4222 --size 512 --iters 5000
#include <nats/nats.h>

#include <cstring>

#include "ref_common.hpp"

namespace {

using namespace ferry::ref;

void check(natsStatus s, const char* what) {
  if (s != NATS_OK) throw std::runtime_error(std::string(what) + ": " + natsStatus_GetText(s));
}

natsConnection* connect(const std::string& url) {
  natsOptions* opts = nullptr;
  check(natsOptions_Create(&opts), "natsOptions_Create");
  natsConnection* nc = nullptr;
  natsStatus s = natsOptions_SetURL(opts, url.c_str());
  if (s == NATS_OK) s = natsOptions_SetSendAsap(opts, true);
  if (s == NATS_OK) s = natsConnection_Connect(&nc, opts);
  natsOptions_Destroy(opts);
  check(s, "connect");
  return nc;
}

void echo(natsConnection* nc, natsSubscription*, natsMsg* msg, void*) {
  if (const char* reply = natsMsg_GetReply(msg))
    natsConnection_Publish(nc, reply, natsMsg_GetData(msg), natsMsg_GetDataLength(msg));
  natsMsg_Destroy(msg);
}

int run(const Options& opts) {
  std::string url = opts.str("url");
  if (url.empty())
    if (const char* env = std::getenv("FERRY_NATS_URL")) url = env;
  if (url.empty()) throw std::invalid_argument("--url (or FERRY_NATS_URL) is required");
  const std::size_t size = opts.size("size");
  const std::uint64_t iters = opts.size("iters");
  const std::uint64_t warmup = opts.size("warmup");
  if (iters == 0) throw std::invalid_argument("--iters must be > 0");
  const std::string subject = "ferry.ref.nats." + std::to_string(::getpid());

  int ready[2];
  int stop[2];
  if (::pipe(ready) != 0 || ::pipe(stop) != 0) throw std::runtime_error("pipe failed");

  // Forked before this process touches cnats (its threads would not survive a fork).
  Child child([&] {
    ::close(ready[0]);
    ::close(stop[1]);
    natsConnection* nc = connect(url);
    natsSubscription* sub = nullptr;
    check(natsConnection_Subscribe(&sub, nc, subject.c_str(), echo, nullptr), "subscribe");
    check(natsConnection_Flush(nc), "flush");  // the SUB is at the server
    const char ok = 1;
    if (!write_all(ready[1], &ok, 1)) return 1;
    char c;
    while (::read(stop[0], &c, 1) > 0) {
    }
    natsSubscription_Destroy(sub);
    natsConnection_Destroy(nc);
    nats_Close();
    return 0;
  });
  ::close(ready[1]);
  ::close(stop[0]);
  char ok = 0;
  if (!read_all(ready[0], &ok, 1)) throw std::runtime_error("the responder did not come up");

  natsConnection* nc = connect(url);
  const std::string payload(size, 'x');
  auto request = [&] {
    natsMsg* reply = nullptr;
    natsStatus s = natsConnection_Request(&reply, nc, subject.c_str(), payload.data(),
                                          static_cast<int>(payload.size()), 5000);
    if (s == NATS_OK && natsMsg_GetDataLength(reply) != static_cast<int>(size)) s = NATS_ERR;
    natsMsg_Destroy(reply);
    check(s, "request");
  };
  for (std::uint64_t i = 0; i < warmup; ++i) request();
  Timed timed = time_iterations(iters, request);
  natsConnection_Destroy(nc);
  nats_Close();
  ::close(stop[1]);
  if (child.wait(10) != 0) throw std::runtime_error("the responder failed");

  JsonObject out;
  out.add("tool", "ferry-ref-nats").add("size", static_cast<std::uint64_t>(size));
  add_round_trips(out, iters, warmup, std::move(timed));
  out.print();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return main_of(argc, argv, "ferry-ref-nats", "--url URL --size N --iters N [--warmup N]",
                 {{"url", ""}, {"size", "512"}, {"iters", "5000"}, {"warmup", "200"}}, run);
}
