// ferry-embedded-nats: a decode worker on its own libuv loop, orchestrated over NATS through the
// connector's own connection, with a peer that writes the KV blocks it is told to.
//
//   FERRY_NATS_URL=nats://127.0.0.1:4222 ferry-embedded-nats
//                         runs the decode worker on this thread's loop, spawns the peer (this
//                         program, `peer NS`) from that loop, and stops cleanly once it exits
//   ferry-embedded-nats worker NS           the worker alone, until SIGINT or SIGTERM
//   ferry-embedded-nats peer NS [REQUESTS]  the peer alone, against a worker serving NS
//
// Why a sample of its own, next to samples/embedded: that one shows a worker that pairs by
// explicit metadata over a line protocol of its own, without NATS (a deployment that has
// none). This one is the NATS-orchestrated form: the worker's messages ("ready", "which blocks
// for request 17", "request 17 is filled") go over the connector's side channel
// (Connector::subscribe / publish / respond / request), so the worker opens no second NATS
// connection and wires nothing into its loop: the handlers run on the worker's loop thread,
// between its own timer and signal callbacks and the connector's transfers.
//
// Subjects, under a namespace NS ("sample.<pid>" by default, so that runs do not meet):
//   NS.ready    worker -> anyone   "decode-0 NS.kv BLOCKS BLOCK_SIZE", every 100 ms until asked
//   NS.kv       ferry serves the worker's KV region there (a writable region of BLOCKS blocks)
//   NS.blocks   request "REQ COUNT" -> "b1 b2 ..." (COUNT free blocks, now REQ's) or "error ..."
//               (queue group "decode": more decode workers would share the requests)
//   NS.filled   request "REQ" -> "verified REQ", once the worker has checked REQ's blocks
//               (and freed them), or "mismatch REQ block B" / "error ..."
// The peer attaches to NS.kv by subject, asks for blocks, writes them (write_blocks), says so,
// and checks the answer. Exit status 0 only when every request was verified on both sides and,
// for the worker, its loop closed with nothing left open.
#include <unistd.h>
#include <uv.h>

#include <array>
#include <chrono>
#include <csignal>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <map>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <ferry/ferry.hpp>

namespace {

using namespace std::chrono_literals;

constexpr std::uint64_t kBlocks = 64;
constexpr std::uint64_t kBlockSize = 16u << 10;
constexpr std::uint64_t kBlocksPerRequest = 4;
constexpr int kDefaultRequests = 20;
constexpr std::uint64_t kHeartbeatMs = 100;
constexpr std::uint64_t kPeerDeadlineMs = 60'000;
constexpr std::chrono::milliseconds kAskTimeout = 5s;

// The byte a request's writer puts at `offset` of block `block`: both sides can compute it.
std::byte pattern(std::uint64_t request, std::uint64_t block, std::uint64_t offset) {
  return static_cast<std::byte>((request * 31 + block * 7 + offset) & 0xff);
}

std::vector<std::string> words(const std::string& text) {
  std::istringstream in(text);
  std::vector<std::string> out;
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

std::optional<std::uint64_t> number(const std::string& text) {
  if (text.empty() || text.size() > 12 || text.find_first_not_of("0123456789") != std::string::npos)
    return std::nullopt;
  return std::stoull(text);
}

// ---------------------------------------------------------------------------------------------
// The decode worker: everything below runs on the one thread that runs the loop.

struct Tally {
  std::uint64_t ticks = 0;
  int assigned = 0;    // requests given blocks
  int verified = 0;    // requests whose blocks checked out
  int mismatches = 0;  // requests whose blocks did not
  bool peer_ran = false;
  std::int64_t peer_exit = -1;
  int peer_signal = 0;
  bool peer_timed_out = false;
};

class DecodeWorker {
 public:
  DecodeWorker(uv_loop_t* loop, std::string ns) : loop_(loop), ns_(std::move(ns)) {}
  DecodeWorker(const DecodeWorker&) = delete;
  DecodeWorker& operator=(const DecodeWorker&) = delete;

  // Opens the worker's handles, its connector, region and subscriptions. Throws; whatever was
  // opened is closed by shutdown() all the same.
  void start();
  // Runs this program as `peer NS REQUESTS`, as a child process watched by the loop.
  void spawn_peer(int requests);
  // Loop thread, the loop stopped: closes every handle, then the connector. The caller runs
  // the loop until it is empty, so that the closes complete.
  void shutdown();
  const Tally& tally() const { return tally_; }

 private:
  [[gnu::format(printf, 2, 3)]] void log(const char* format, ...);
  void on_blocks(const ferry::Message& m);
  void on_filled(const ferry::Message& m);
  std::string check_filled(std::uint64_t request);
  static void on_heartbeat(uv_timer_t* timer);
  static void on_signal(uv_signal_t* handle, int signum);
  static void on_peer_exit(uv_process_t* process, std::int64_t exit_status, int term_signal);
  static void on_peer_deadline(uv_timer_t* timer);

  uv_loop_t* loop_;
  std::string ns_;
  uv_timer_t heartbeat_{};
  uv_signal_t sigint_{};
  uv_signal_t sigterm_{};
  uv_process_t peer_{};
  uv_timer_t peer_deadline_{};
  bool peer_running_ = false;
  bool stop_at_next_tick_ = false;
  bool asked_ = false;  // someone asked for blocks: "ready" has been heard
  // Declared before the region, so destroyed after it: closing the region is what frees it.
  std::vector<std::byte> kv_ = std::vector<std::byte>(kBlocks * kBlockSize);
  std::vector<bool> taken_ = std::vector<bool>(kBlocks, false);
  std::map<std::uint64_t, std::vector<std::uint64_t>> requests_;  // request -> its blocks
  std::optional<ferry::Connector> connector_;
  ferry::Region region_;
  ferry::Subscription blocks_;
  ferry::Subscription filled_;
  Tally tally_;
};

void DecodeWorker::log(const char* format, ...) {
  char text[1024];
  va_list args;
  va_start(args, format);
  std::vsnprintf(text, sizeof text, format, args);
  va_end(args);
  std::fprintf(stderr, "worker [tick %3llu]: %s\n", static_cast<unsigned long long>(tally_.ticks),
               text);
}

void check(int rc, const char* what) {
  if (rc != 0) throw std::runtime_error(std::string(what) + ": " + uv_strerror(rc));
}

template <class Handle>
uv_handle_t* as_handle(Handle* h) {
  return reinterpret_cast<uv_handle_t*>(h);
}

// Closes a handle that was initialized and is not closing yet (UV_UNKNOWN_HANDLE: never was).
void close_if_open(uv_handle_t* h) {
  if (h->type != UV_UNKNOWN_HANDLE && !uv_is_closing(h)) uv_close(h, nullptr);
}

void DecodeWorker::start() {
  check(uv_timer_init(loop_, &heartbeat_), "uv_timer_init");
  heartbeat_.data = this;
  for (auto [handle, signum] : {std::pair{&sigint_, SIGINT}, std::pair{&sigterm_, SIGTERM}}) {
    check(uv_signal_init(loop_, handle), "uv_signal_init");
    handle->data = this;
    check(uv_signal_start(handle, &DecodeWorker::on_signal, signum), "uv_signal_start");
  }

  // The connector joins this loop; ferry takes this thread, which runs uv_run below, to be the
  // loop's. Its NATS connection comes from FERRY_NATS_URL.
  ferry::ConnectorOptions options;
  options.name = "decode-0";
  options.loop = loop_;
  options.default_timeout = 30s;
  connector_.emplace(options);
  if (!connector_->has_side_channel())
    throw std::runtime_error("no NATS server: set FERRY_NATS_URL (e.g. nats://127.0.0.1:4222)");

  // The KV pool, served at NS.kv for peers to write by block index.
  ferry::RegionOptions kv;
  kv.access = ferry::RegionAccess::write;
  kv.block_size = kBlockSize;
  kv.subject = ns_ + ".kv";
  kv.queue_events = false;
  kv.on_event = [this](const ferry::RegionEvent& e) {
    if (e.type == ferry::RegionEvent::Type::attached)
      log("%s attached to the KV region by %s", e.peer.c_str(), e.method.c_str());
    else if (e.type == ferry::RegionEvent::Type::transfer &&
             e.status != ferry::OperationStatus::complete)
      log("a write of %s (%s) failed: %s", e.peer.c_str(), e.tag.c_str(),
          e.error ? e.error->what() : "?");
  };
  region_ = connector_->create_region({ferry::Descriptor(kv_.data(), kv_.size())}, kv);

  // On the loop thread, subscribe() does not wait for the server: "ready" is published only
  // from the heartbeat, a loop turn later, and a peer asks again on "no responders" anyway.
  ferry::SubscribeOptions group;
  group.queue = "decode";
  blocks_ = connector_->subscribe(
      ns_ + ".blocks", [this](const ferry::Message& m) { on_blocks(m); }, group);
  filled_ =
      connector_->subscribe(ns_ + ".filled", [this](const ferry::Message& m) { on_filled(m); });

  check(uv_timer_start(&heartbeat_, &DecodeWorker::on_heartbeat, 0, kHeartbeatMs),
        "uv_timer_start");
  log("serving %llu blocks of %llu bytes at %s.kv; requests at %s.blocks (queue group decode)",
      static_cast<unsigned long long>(kBlocks), static_cast<unsigned long long>(kBlockSize),
      ns_.c_str(), ns_.c_str());
}

void DecodeWorker::on_blocks(const ferry::Message& m) {
  asked_ = true;
  const std::vector<std::string> w = words(m.data);
  const std::uint64_t request = w.size() == 2 ? number(w[0]).value_or(0) : 0;
  const std::uint64_t count = w.size() == 2 ? number(w[1]).value_or(0) : 0;
  std::string answer;
  if (request == 0 || count == 0 || count > kBlocks) {
    answer = "error expected 'REQUEST COUNT' (both from 1), got '" + m.data.substr(0, 64) + "'";
  } else if (requests_.count(request) != 0) {
    answer = "error request " + std::to_string(request) + " has blocks already";
  } else {
    std::vector<std::uint64_t> blocks;
    // Spread out, to show that the writer's blocks need not be adjacent.
    for (std::uint64_t i = 0; i < kBlocks && blocks.size() < count; ++i) {
      const std::uint64_t b = (i * 37 + request * 11) % kBlocks;
      if (!taken_[b]) {
        taken_[b] = true;
        blocks.push_back(b);
      }
    }
    if (blocks.size() < count) {
      for (std::uint64_t b : blocks) taken_[b] = false;
      answer = "error no " + std::to_string(count) + " free blocks";
    } else {
      for (std::uint64_t b : blocks) answer += (answer.empty() ? "" : " ") + std::to_string(b);
      requests_[request] = std::move(blocks);
      ++tally_.assigned;
    }
  }
  log("asked for blocks (\"%s\"): %s", m.data.c_str(), answer.c_str());
  connector_->respond(m, answer);
}

std::string DecodeWorker::check_filled(std::uint64_t request) {
  auto it = requests_.find(request);
  if (it == requests_.end()) return "error request " + std::to_string(request) + " has no blocks";
  const std::vector<std::uint64_t> blocks = std::move(it->second);
  requests_.erase(it);
  std::string verdict = "verified " + std::to_string(request);
  for (std::uint64_t b : blocks) {
    const std::byte* block = kv_.data() + b * kBlockSize;
    for (std::uint64_t i = 0; i < kBlockSize; ++i)
      if (block[i] != pattern(request, b, i)) {
        verdict = "mismatch " + std::to_string(request) + " block " + std::to_string(b);
        break;
      }
    taken_[b] = false;
  }
  return verdict;
}

void DecodeWorker::on_filled(const ferry::Message& m) {
  // The peer asks only once its write has completed, that is once its bytes are in kv_.
  const auto request = number(m.data);
  const std::string verdict = request ? check_filled(*request) : "error expected 'REQUEST'";
  if (verdict.rfind("verified", 0) == 0)
    ++tally_.verified;
  else
    ++tally_.mismatches;
  log("request %s filled: %s", m.data.c_str(), verdict.c_str());
  connector_->respond(m, verdict);
}

void DecodeWorker::on_heartbeat(uv_timer_t* timer) {
  auto* self = static_cast<DecodeWorker*>(timer->data);
  ++self->tally_.ticks;
  // Until a peer has asked, say where the blocks are, for whoever starts listening.
  if (!self->asked_)
    self->connector_->publish(self->ns_ + ".ready", "decode-0 " + self->ns_ + ".kv " +
                                                        std::to_string(kBlocks) + " " +
                                                        std::to_string(kBlockSize));
  if (self->stop_at_next_tick_) uv_stop(self->loop_);
}

void DecodeWorker::on_signal(uv_signal_t* handle, int signum) {
  auto* self = static_cast<DecodeWorker*>(handle->data);
  self->log("signal %d: stopping", signum);
  uv_stop(self->loop_);
}

void DecodeWorker::spawn_peer(int requests) {
  std::array<char, 4096> exe{};
  std::size_t exe_length = exe.size();
  check(uv_exepath(exe.data(), &exe_length), "uv_exepath");
  std::string mode = "peer";
  std::string ns = ns_;
  std::string count = std::to_string(requests);
  char* args[] = {exe.data(), mode.data(), ns.data(), count.data(), nullptr};
  uv_stdio_container_t stdio[3];
  stdio[0].flags = UV_IGNORE;
  stdio[1].flags = UV_INHERIT_FD;
  stdio[1].data.fd = STDOUT_FILENO;
  stdio[2].flags = UV_INHERIT_FD;
  stdio[2].data.fd = STDERR_FILENO;
  uv_process_options_t options{};
  options.file = exe.data();
  options.args = args;
  options.exit_cb = &DecodeWorker::on_peer_exit;
  options.stdio_count = 3;
  options.stdio = stdio;
  peer_.data = this;
  check(uv_spawn(loop_, &peer_, &options), "uv_spawn");  // initialized even on failure
  peer_running_ = true;
  tally_.peer_ran = true;
  log("spawned the peer, pid %d", peer_.pid);
  check(uv_timer_init(loop_, &peer_deadline_), "uv_timer_init");
  peer_deadline_.data = this;
  check(uv_timer_start(&peer_deadline_, &DecodeWorker::on_peer_deadline, kPeerDeadlineMs, 0),
        "uv_timer_start");
}

void DecodeWorker::on_peer_exit(uv_process_t* process, std::int64_t exit_status, int term_signal) {
  auto* self = static_cast<DecodeWorker*>(process->data);
  self->peer_running_ = false;
  self->tally_.peer_exit = exit_status;
  self->tally_.peer_signal = term_signal;
  self->log("the peer exited with status %lld%s", static_cast<long long>(exit_status),
            term_signal != 0 ? " (killed by a signal)" : "");
  uv_close(as_handle(process), nullptr);
  self->stop_at_next_tick_ = true;
}

void DecodeWorker::on_peer_deadline(uv_timer_t* timer) {
  auto* self = static_cast<DecodeWorker*>(timer->data);
  self->log("the peer has not finished within %llu ms: killing it",
            static_cast<unsigned long long>(kPeerDeadlineMs));
  self->tally_.peer_timed_out = true;
  if (self->peer_running_) uv_process_kill(&self->peer_, SIGKILL);
}

void DecodeWorker::shutdown() {
  close_if_open(as_handle(&heartbeat_));
  close_if_open(as_handle(&sigint_));
  close_if_open(as_handle(&sigterm_));
  close_if_open(as_handle(&peer_deadline_));
  if (peer_running_) {
    uv_process_kill(&peer_, SIGKILL);
    peer_running_ = false;
  }
  close_if_open(as_handle(&peer_));
  // On the loop's thread, the loop stopped: each call below runs inline. The subscriptions
  // end first (no handler runs afterwards), then the region (no peer touches kv_ afterwards),
  // then the connector, whose handles finish closing in the caller's next turns of the loop.
  blocks_.unsubscribe();
  filled_.unsubscribe();
  if (region_) region_.close();
  connector_.reset();
}

int run_worker(const std::string& ns, std::optional<int> peer_requests) {
  uv_loop_t loop;
  if (int rc = uv_loop_init(&loop); rc != 0) {
    std::fprintf(stderr, "worker: uv_loop_init: %s\n", uv_strerror(rc));
    return 1;
  }
  bool started = true;
  Tally tally;
  {
    DecodeWorker worker(&loop, ns);
    try {
      worker.start();
      if (peer_requests) worker.spawn_peer(*peer_requests);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "worker: %s\n", e.what());
      started = false;
    }
    if (started) uv_run(&loop, UV_RUN_DEFAULT);  // until the peer exits, or a signal
    worker.shutdown();
    uv_run(&loop, UV_RUN_DEFAULT);  // the closes complete; then nothing is left
    tally = worker.tally();
  }
  const int close_rc = uv_loop_close(&loop);
  std::fprintf(stderr,
               "worker: %llu heartbeats; %d request(s) given blocks, %d verified, %d mismatched; "
               "loop %s\n",
               static_cast<unsigned long long>(tally.ticks), tally.assigned, tally.verified,
               tally.mismatches,
               close_rc == 0 ? "closed cleanly" : "still had open handles (uv_loop_close failed)");
  if (!peer_requests) return started && close_rc == 0 && tally.mismatches == 0 ? 0 : 1;
  const bool ok = started && close_rc == 0 && tally.peer_ran && !tally.peer_timed_out &&
                  tally.peer_exit == 0 && tally.peer_signal == 0 &&
                  tally.verified == *peer_requests && tally.mismatches == 0;
  std::fprintf(stderr, "embedded-nats: %s\n",
               ok ? "one loop ran the worker's timer, its NATS messages and the peer's writes; "
                    "every request verified on both sides"
                  : "FAILED");
  return ok ? 0 : 1;
}

// ---------------------------------------------------------------------------------------------
// The peer: an ordinary program with an owned-mode connector, blocking calls.

int run_peer(const std::string& ns, int requests) {
  ferry::ConnectorOptions options;
  options.name = "prefill-0";
  options.default_timeout = 30s;
  ferry::Connector connector(options);  // its loop runs on a thread of its own
  if (!connector.has_side_channel()) throw std::runtime_error("no NATS server: set FERRY_NATS_URL");

  // Wait for a decode worker to say where its blocks are.
  std::promise<std::string> ready;
  auto heard = ready.get_future();
  bool told = false;  // the loop thread's alone
  ferry::Subscription announcements =
      connector.subscribe(ns + ".ready", [&](const ferry::Message& m) {
        if (!told) ready.set_value(m.data);
        told = true;
      });
  if (heard.wait_for(10s) != std::future_status::ready)
    throw std::runtime_error("no decode worker said ready at " + ns + ".ready within 10 s");
  announcements.unsubscribe();
  const std::string announcement = heard.get();
  const std::vector<std::string> w = words(announcement);
  if (w.size() != 4 || number(w[2]) != kBlocks || number(w[3]) != kBlockSize)
    throw std::runtime_error("an unexpected announcement: '" + announcement + "'");
  std::fprintf(stderr, "peer: %s is ready, its KV region at %s\n", w[0].c_str(), w[1].c_str());

  ferry::Attachment kv = connector.attach(ferry::Subject(w[1]));
  int verified = 0;
  for (int r = 1; r <= requests; ++r) {
    const auto request = static_cast<std::uint64_t>(r);
    const ferry::Message reply = connector.request(
        ns + ".blocks", std::to_string(request) + " " + std::to_string(kBlocksPerRequest),
        kAskTimeout);
    std::vector<std::uint64_t> blocks;
    for (const std::string& b : words(reply.data))
      if (auto n = number(b)) blocks.push_back(*n);
    if (blocks.size() != kBlocksPerRequest)
      throw std::runtime_error("request " + std::to_string(request) + ": '" + reply.data + "'");
    std::vector<std::byte> data(blocks.size() * kBlockSize);
    for (std::size_t k = 0; k < blocks.size(); ++k)
      for (std::uint64_t i = 0; i < kBlockSize; ++i)
        data[k * kBlockSize + i] = pattern(request, blocks[k], i);
    ferry::TransferOptions tag;
    tag.tag = "request " + std::to_string(request);
    auto write = kv.write_blocks({ferry::Descriptor(data.data(), data.size())}, blocks, tag);
    write.wait_for_completion();  // throws what went wrong
    const ferry::Message verdict =
        connector.request(ns + ".filled", std::to_string(request), kAskTimeout);
    const bool ok = verdict.data == "verified " + std::to_string(request);
    verified += ok ? 1 : 0;
    std::fprintf(stderr, "peer: request %llu wrote blocks %s by %s: %s\n",
                 static_cast<unsigned long long>(request), reply.data.c_str(),
                 write.method().c_str(), verdict.data.c_str());
  }
  std::fprintf(stderr, "peer: %d of %d request(s) verified\n", verified, requests);
  return verified == requests ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string mode = argc > 1 ? argv[1] : "";
    const std::string own_ns = "sample." + std::to_string(::getpid());
    if (argc == 1) return run_worker(own_ns, kDefaultRequests);
    if (mode == "worker" && (argc == 2 || argc == 3))
      return run_worker(argc == 3 ? argv[2] : own_ns, std::nullopt);
    if (mode == "peer" && (argc == 3 || argc == 4)) {
      const auto requests =
          argc == 4 ? number(argv[3]) : std::optional<std::uint64_t>(kDefaultRequests);
      if (requests && *requests >= 1 && *requests <= 1000)
        return run_peer(argv[2], static_cast<int>(*requests));
    }
    std::fprintf(stderr, "usage: %s [worker [NS] | peer NS [REQUESTS]]\n", argv[0]);
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "embedded-nats: %s\n", e.what());
    return 1;
  }
}
