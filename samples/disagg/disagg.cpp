// ferry-disagg: disaggregated prefill/decode as a NATS-orchestrated system.
//
//   client --NATS request "disagg.generate"--> decode worker (queue group "decode")
//     decode: allocates KV blocks from its pool and asks a prefill worker to fill them
//   decode --NATS request "disagg.prefill"--> prefill worker (queue group "prefill")
//     prefill: computes the KV cache of the prompt (layers x blocks x tokens) and writes it
//              into the decode worker's blocks
//   decode: starts the request once the KV is in, verifies every byte, frees the blocks,
//           answers the client
//
// Two modes (the client's --mode, per request; the same workers serve both):
//   region   (the default) the decode worker exposes its whole pool once, as a writable region
//            with one block per (layer, block), served at "disagg.kv.<decode>"; each prefill
//            worker attaches once per decode worker and writes a request's blocks by block id
//            with the request id as tag; the decode worker's region event for that tag says
//            the bytes are in (docs/regions.md)
//   oneshot  per request, one WritableOperation over the request's blocks, served at
//            "disagg.kv.<decode>.<request>", written with begin_write(..., Subject(...))
// --compare-modes (client, all): the requests once in each mode, and both throughputs.
//
// Roles (each a process):
//   ferry-disagg decode  [--name N] [--blocks B] [--layers L] [--tokens-per-block T]
//                        [--bytes-per-token X] [--threads W] [--device D] [--metrics H:P]
//   ferry-disagg prefill [--name N] [--threads W] [--device D] [--metrics H:P]
//   ferry-disagg client  [--requests R] [--concurrency C] [--min-tokens A] [--max-tokens B]
//                        [--mode region|oneshot] [--compare-modes 1]
//   ferry-disagg all     [--prefill P] [--requests R] [--concurrency C] ...
//     runs a private nats-server (unless FERRY_NATS_URL is set), 1 decode and P prefill
//     workers as child processes, then the client; stops everything it started, also on
//     Ctrl-C or failure. Exit status 0 only when every request was verified.
//
// --metrics HOST:PORT: the worker serves its Prometheus metrics there (in `all`, the decode
// worker at PORT and prefill i at PORT+1+i); every worker answers ferry-top anyway
// (docs/operations.md).
// --device D: where the KV lives, "host" (the default) or "cuda:N": the decode worker's pool
// and the prefill worker's KV buffers are then memory of GPU N, allocated with the CUDA driver
// ferry loads and filled and checked through the driver's copies; the program exits with why
// when CUDA cannot be used. "all" passes it to every worker.
//
// NATS: FERRY_NATS_URL (default nats://127.0.0.1:4222), used by ferry and by this program.
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <nats/nats.h>
#include <ferry/ferry.hpp>
#include <nlohmann/json.hpp>

#include "samples/disagg/kv.hpp"
#include "samples/disagg/process.hpp"
#include "samples/support/device_memory.hpp"

namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr const char* kGenerate = "disagg.generate";
constexpr const char* kPrefill = "disagg.prefill";

std::atomic<bool> g_stop{false};

void on_signal(int) { g_stop = true; }

void install_stop_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);
}

// --key value options; an option the role does not know, or one without its value, is an
// error (a typo would otherwise run the defaults silently).
struct Args {
  std::map<std::string, std::string> values;
  Args(int argc, char** argv, int from, const std::vector<std::string>& known) {
    for (int i = from; i < argc; i += 2) {
      const std::string key = argv[i];
      if (std::find(known.begin(), known.end(), key) == known.end()) {
        std::string list;
        for (const auto& k : known) list += " " + k;
        throw std::invalid_argument("unknown option '" + key + "'; this role takes:" + list);
      }
      if (i + 1 >= argc) throw std::invalid_argument("option " + key + " needs a value");
      values[key] = argv[i + 1];
    }
  }
  std::string str(const std::string& key, std::string fallback) const {
    auto it = values.find(key);
    return it == values.end() ? fallback : it->second;
  }
  std::uint32_t num(const std::string& key, std::uint32_t fallback) const {
    auto it = values.find(key);
    return it == values.end() ? fallback : static_cast<std::uint32_t>(std::stoul(it->second));
  }
};

std::string nats_url() {
  const char* url = std::getenv("FERRY_NATS_URL");
  return url != nullptr && *url != '\0' ? url : "nats://127.0.0.1:4222";
}

// The program's own NATS connection (ferry's connector has another). Its callbacks run on
// cnats' threads: this is application code, free to block there.
struct Nats {
  natsConnection* nc = nullptr;
  explicit Nats(const std::string& name) {
    natsOptions* opts = nullptr;
    natsOptions_Create(&opts);
    natsOptions_SetURL(opts, nats_url().c_str());
    natsOptions_SetName(opts, name.c_str());
    natsOptions_SetSendAsap(opts, true);
    natsOptions_SetMaxReconnect(opts, -1);
    natsStatus s = natsConnection_Connect(&nc, opts);
    natsOptions_Destroy(opts);
    if (s != NATS_OK)
      throw std::runtime_error("cannot connect to NATS at " + nats_url() + ": " +
                               natsStatus_GetText(s));
  }
  ~Nats() {
    natsConnection_Close(nc);
    natsConnection_Destroy(nc);
  }
  // A blocking request; nullopt on timeout or when nobody answers.
  std::optional<std::string> request(const char* subject, const std::string& data,
                                     std::chrono::milliseconds timeout) {
    natsMsg* reply = nullptr;
    natsStatus s = natsConnection_Request(&reply, nc, subject, data.data(),
                                          static_cast<int>(data.size()), timeout.count());
    if (s != NATS_OK) return std::nullopt;
    std::string out(natsMsg_GetData(reply), static_cast<std::size_t>(natsMsg_GetDataLength(reply)));
    natsMsg_Destroy(reply);
    return out;
  }
  void reply(natsMsg* msg, const std::string& data) {
    natsConnection_Publish(nc, natsMsg_GetReply(msg), data.data(), static_cast<int>(data.size()));
  }
  // Releases every blocked request (they fail); for stopping.
  void close() { natsConnection_Close(nc); }
};

// Where a decode request stands: the writable ended, or the prefill worker answered. Set by
// ferry's completion callback and by a NATS callback; the worker thread waits for the first.
struct Outcome {
  std::mutex mu;
  std::condition_variable cv;
  bool writable_ended = false;
  std::optional<std::string> answer;
  std::optional<ferry::RegionEvent> event;  ///< region mode: the transfer's event
  template <class Pred>
  bool wait(std::chrono::milliseconds limit, Pred pred) {
    std::unique_lock lock(mu);
    return cv.wait_for(lock, limit, [&] { return pred(*this); });
  }
  void set(const std::function<void(Outcome&)>& change) {
    {
      std::lock_guard lock(mu);
      change(*this);
    }
    cv.notify_all();
  }
};

// Publishes a request whose answer lands in `out` (on cnats' thread), without blocking.
// Returns the reply subscription, to destroy once done.
natsSubscription* ask_async(Nats& nats, const char* subject, const std::string& data,
                            std::shared_ptr<Outcome> out) {
  natsInbox* inbox = nullptr;
  natsInbox_Create(&inbox);
  auto* holder = new std::shared_ptr<Outcome>(std::move(out));
  natsSubscription* sub = nullptr;
  natsConnection_Subscribe(
      &sub, nats.nc, inbox,
      [](natsConnection*, natsSubscription*, natsMsg* msg, void* closure) {
        auto& o = *static_cast<std::shared_ptr<Outcome>*>(closure);
        std::string answer(natsMsg_GetData(msg),
                           static_cast<std::size_t>(natsMsg_GetDataLength(msg)));
        natsMsg_Destroy(msg);
        o->set([&](Outcome& x) { x.answer = std::move(answer); });
      },
      holder);
  natsSubscription_SetOnCompleteCB(
      sub, [](void* c) { delete static_cast<std::shared_ptr<Outcome>*>(c); }, holder);
  natsSubscription_AutoUnsubscribe(sub, 1);
  natsConnection_PublishRequest(nats.nc, subject, inbox, data.data(),
                                static_cast<int>(data.size()));
  natsInbox_Destroy(inbox);
  return sub;
}

// A fixed pool of threads draining a queue: requests are handled concurrently, off cnats'
// delivery thread.
class Workers {
 public:
  explicit Workers(unsigned n) {
    for (unsigned i = 0; i < n; ++i)
      threads_.emplace_back([this] {
        for (;;) {
          std::function<void()> job;
          {
            std::unique_lock lock(mu_);
            cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
            if (jobs_.empty()) return;
            job = std::move(jobs_.front());
            jobs_.pop_front();
          }
          job();
        }
      });
  }
  ~Workers() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  void push(std::function<void()> job) {
    {
      std::lock_guard lock(mu_);
      jobs_.push_back(std::move(job));
    }
    cv_.notify_one();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

// Subscribes `handler` to `subject` in `queue` (messages are handed to `workers`), says
// "ready" on stdout for the supervisor, and serves until a stop signal.
void serve_until_stopped(Nats& nats, const char* subject, const char* queue, Workers& workers,
                         const std::string& name, std::function<void(natsMsg*)> handler) {
  struct Ctx {
    Workers* workers;
    std::function<void(natsMsg*)> handler;
  };
  auto* ctx = new Ctx{&workers, std::move(handler)};
  natsSubscription* sub = nullptr;
  natsStatus s = natsConnection_QueueSubscribe(
      &sub, nats.nc, subject, queue,
      [](natsConnection*, natsSubscription*, natsMsg* msg, void* closure) {
        auto* c = static_cast<Ctx*>(closure);
        c->workers->push([c, msg] {
          c->handler(msg);
          natsMsg_Destroy(msg);
        });
      },
      ctx);
  if (s != NATS_OK) throw std::runtime_error(std::string("subscribe: ") + natsStatus_GetText(s));
  natsSubscription_SetOnCompleteCB(
      sub, [](void* closure) { delete static_cast<Ctx*>(closure); }, ctx);
  std::printf("ready %s\n", name.c_str());
  std::fflush(stdout);
  while (!g_stop) std::this_thread::sleep_for(50ms);
  natsSubscription_Unsubscribe(sub);
  natsSubscription_Destroy(sub);
}

// --metrics HOST:PORT serves the connector's Prometheus metrics there (docs/operations.md);
// without it, FERRY_METRICS_LISTEN may. Either way the connector answers ferry-top.
ferry::ConnectorOptions connector_options(const std::string& name, const Args& args) {
  ferry::ConnectorOptions o;
  o.name = name;
  o.default_timeout = 30s;  // nothing waits forever
  o.metrics.listen = args.str("--metrics", "");
  return o;  // the side channel comes from FERRY_NATS_URL
}

// ---------------------------------------------------------------------------------------
// decode

// Fixed-size KV blocks, one region per layer, handed out per request: in host memory, or in
// memory of GPU `device` (not for the CPU to touch: see read()).
class BlockPool {
 public:
  BlockPool(disagg::Shape shape, std::uint32_t blocks, int device)
      : shape_(shape), blocks_(blocks), device_(device) {
    const std::size_t bytes = std::size_t{shape.layers} * blocks * shape.block_bytes();
    if (device_ < 0)
      memory_.resize(bytes);
    else
      gpu_ = std::make_unique<ferry_samples::DeviceMemory>(device_, bytes);
    for (std::uint32_t b = 0; b < blocks; ++b) free_.push_back(b);
  }
  // Waits up to `timeout` for `n` free blocks.
  std::optional<std::vector<std::uint32_t>> take(std::uint32_t n,
                                                 std::chrono::milliseconds timeout) {
    if (n > blocks_) return std::nullopt;  // never for more than the pool holds
    std::unique_lock lock(mu_);
    if (!cv_.wait_for(lock, timeout, [&] { return free_.size() >= n; })) return std::nullopt;
    std::vector<std::uint32_t> out(free_.begin(), free_.begin() + n);
    free_.erase(free_.begin(), free_.begin() + n);
    return out;
  }
  void give_back(const std::vector<std::uint32_t>& blocks) {
    {
      std::lock_guard lock(mu_);
      free_.insert(free_.end(), blocks.begin(), blocks.end());
      std::sort(free_.begin(), free_.end());  // keeps requests' blocks adjacent when it can
    }
    cv_.notify_all();
  }
  ferry::Descriptor descriptor(std::uint32_t layer, std::uint32_t b) {
    std::byte* base = device_ < 0 ? memory_.data() : gpu_->data();
    std::byte* p = base + offset(layer, b);
    return device_ < 0 ? ferry::Descriptor(p, shape_.block_bytes())
                       : ferry::Descriptor(p, shape_.block_bytes(), ferry::Device::cuda(device_));
  }
  // The whole pool, one descriptor: block (layer, b) is block layer * blocks + b of it.
  ferry::Descriptor whole() {
    const std::size_t bytes = std::size_t{shape_.layers} * blocks_ * shape_.block_bytes();
    return device_ < 0 ? ferry::Descriptor(memory_.data(), bytes)
                       : ferry::Descriptor(gpu_->data(), bytes, ferry::Device::cuda(device_));
  }
  std::uint64_t block_id(std::uint32_t layer, std::uint32_t b) const {
    return std::uint64_t{layer} * blocks_ + b;
  }
  // The block's bytes, copied to `out` (through the driver for device memory).
  void read(std::uint32_t layer, std::uint32_t b, std::byte* out) const {
    if (device_ < 0)
      std::memcpy(out, memory_.data() + offset(layer, b), shape_.block_bytes());
    else
      gpu_->read(offset(layer, b), out, shape_.block_bytes());
  }

 private:
  std::size_t offset(std::uint32_t layer, std::uint32_t b) const {
    return (std::size_t{layer} * blocks_ + b) * shape_.block_bytes();
  }
  disagg::Shape shape_;
  std::uint32_t blocks_;
  int device_;
  std::vector<std::byte> memory_;
  std::unique_ptr<ferry_samples::DeviceMemory> gpu_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::uint32_t> free_;
};

// Blocks lent to one request, given back however the request ends. Declared before the
// request's writable, so that the writable (which may still hold the blocks) is gone first.
struct Lease {
  BlockPool& pool;
  std::vector<std::uint32_t> blocks;
  ~Lease() { pool.give_back(blocks); }
};

int run_decode(const Args& args) {
  const std::string name = args.str("--name", "decode-" + std::to_string(::getpid()));
  disagg::Shape shape;
  shape.layers = args.num("--layers", shape.layers);
  shape.tokens_per_block = args.num("--tokens-per-block", shape.tokens_per_block);
  shape.bytes_per_token = args.num("--bytes-per-token", shape.bytes_per_token);
  if (shape.layers == 0 || shape.tokens_per_block == 0 || shape.bytes_per_token == 0 ||
      shape.bytes_per_token % 8 != 0)
    throw std::runtime_error(
        "--layers and --tokens-per-block must be positive, "
        "--bytes-per-token a positive multiple of 8");
  BlockPool pool(shape, args.num("--blocks", 512),
                 ferry_samples::parse_device(args.str("--device", "host")));
  ferry::Connector connector(connector_options(name, args));
  Nats nats(name);
  Workers workers(args.num("--threads", 8));
  std::atomic<std::uint64_t> served{0};

  // Region mode: the pool, exposed once. Each transfer's event (tag: the request id) goes to
  // the request waiting for it.
  std::mutex waiting_mu;
  std::map<std::string, std::shared_ptr<Outcome>> waiting;
  ferry::RegionOptions ro;
  ro.access = ferry::RegionAccess::write;
  ro.block_size = shape.block_bytes();
  ro.subject = "disagg.kv." + name;
  ro.queue_events = false;
  ro.on_event = [&](const ferry::RegionEvent& e) {
    if (e.type != ferry::RegionEvent::Type::transfer) return;
    std::shared_ptr<Outcome> o;
    {
      std::lock_guard lock(waiting_mu);
      if (auto it = waiting.find(e.tag); it != waiting.end()) o = it->second;
    }
    if (o) o->set([&](Outcome& x) { x.event = e; });
  };
  ferry::Region region = connector.create_region({pool.whole()}, ro);

  auto handle = [&](natsMsg* msg) {
    json reply;
    auto t0 = Clock::now();
    try {
      json req = json::parse(
          std::string(natsMsg_GetData(msg), static_cast<std::size_t>(natsMsg_GetDataLength(msg))));
      if (!req.contains("id")) {  // the client's "are you there?"
        nats.reply(msg, json{{"pong", name}}.dump());
        return;
      }
      const std::uint64_t id = req.at("id");
      const std::string prompt = req.at("prompt");
      const std::uint32_t tokens = req.at("tokens");
      reply["id"] = id;
      const std::uint32_t n = shape.blocks_for(tokens);
      auto taken = pool.take(n, 20s);
      if (!taken)
        throw std::runtime_error("no " + std::to_string(n) + " free KV blocks within 20 s");
      Lease lease{pool, std::move(*taken)};
      const bool by_region = req.value("mode", "region") == "region";
      reply["mode"] = by_region ? "region" : "oneshot";
      json ask = {{"id", id},
                  {"prompt", prompt},
                  {"tokens", tokens},
                  {"layers", shape.layers},
                  {"tokens_per_block", shape.tokens_per_block},
                  {"bytes_per_token", shape.bytes_per_token}};
      auto outcome = std::make_shared<Outcome>();
      std::string why;
      auto note_answer = [&] {
        json pre = json::parse(*outcome->answer);
        reply["prefill"] = pre.value("worker", "?");
        reply["method"] = pre.value("method", "?");
        if (!pre.value("ok", false))
          why = "prefill " + pre.value("worker", "?") + ": " + pre.value("error", "failed");
      };
      bool ok = false;
      if (by_region) {
        // The request's blocks, by id in the pool's region, layer by layer: matched with the
        // prefill worker's contiguous buffer.
        std::vector<std::uint64_t> ids;
        for (std::uint32_t l = 0; l < shape.layers; ++l)
          for (std::uint32_t b : lease.blocks) ids.push_back(pool.block_id(l, b));
        const std::string tag = std::to_string(id);
        {
          std::lock_guard lock(waiting_mu);
          waiting[tag] = outcome;
        }
        ask["region_subject"] = ro.subject;
        ask["blocks"] = ids;
        natsSubscription* pending = ask_async(nats, kPrefill, ask.dump(), outcome);
        // The request starts when its KV is in: the region's event for its tag. (Or the
        // prefill worker answered first that it could not.)
        outcome->wait(30s, [](Outcome& x) {
          if (x.event.has_value()) return true;
          if (!x.answer) return false;
          // Parsed, not searched: a prefill worker may format its JSON as it likes (the
          // Python one writes it with spaces by default).
          json pre = json::parse(*x.answer, nullptr, false);
          return pre.is_discarded() || !pre.value("ok", false);
        });
        if (outcome->answer) note_answer();
        if (!outcome->event && why.empty())
          why = "no region event for request " + tag + " within 30 s";
        if (outcome->event && why.empty()) {
          const ferry::RegionEvent& e = *outcome->event;
          if (e.status != ferry::OperationStatus::complete)
            why = "the KV write failed: " + (e.error ? e.error->message() : std::string("?"));
          else if (std::vector<std::uint64_t>(e.blocks) != [&] {
                     auto sorted = ids;
                     std::sort(sorted.begin(), sorted.end());
                     return sorted;
                   }())
            why = "the KV write reached other blocks than the request's";
          else
            ok = true;
        }
        {
          std::lock_guard lock(waiting_mu);
          waiting.erase(tag);
        }
        if (ok && !reply.contains("prefill")) {
          outcome->wait(2s, [](Outcome& x) { return x.answer.has_value(); });
          if (outcome->answer) note_answer();
        }
        natsSubscription_Destroy(pending);
      } else {
        // The request's KV lands in its blocks, layer by layer: one descriptor per layer and
        // block, matched with the prefill worker's contiguous buffer as one byte stream.
        std::vector<ferry::Descriptor> local;
        for (std::uint32_t l = 0; l < shape.layers; ++l)
          for (std::uint32_t b : lease.blocks) local.push_back(pool.descriptor(l, b));
        ferry::OperationOptions o;
        o.subject = "disagg.kv." + name + "." + std::to_string(id);
        auto writable = connector.create_writable(local, o);
        writable.on_complete([outcome](ferry::OperationStatus, const ferry::Error*) {
          outcome->set([](Outcome& x) { x.writable_ended = true; });
        });
        ask["kv_subject"] = o.subject;
        natsSubscription* pending = ask_async(nats, kPrefill, ask.dump(), outcome);
        // Whichever comes first: the KV arrived (or failed: a prefill worker that dies
        // mid-write fails the writable at once), or the prefill worker answered (perhaps that
        // it could not).
        outcome->wait(30s, [](Outcome& x) { return x.writable_ended || x.answer.has_value(); });
        if (outcome->answer) note_answer();
        if (!why.empty()) writable.cancel();
        if (why.empty()) {
          try {
            writable.wait_for_completion();  // its deadline is the connector's default
            ok = true;
          } catch (const ferry::Error& e) {
            why = e.what();
          }
        }
        if (ok && !reply.contains("prefill")) {
          // The bytes are in; the answer (which worker, which method) follows at once.
          outcome->wait(2s, [](Outcome& x) { return x.answer.has_value(); });
          if (outcome->answer) note_answer();
        }
        natsSubscription_Destroy(pending);
      }
      if (ok) {
        // Every byte, every layer, every block.
        const auto digest = disagg::prompt_digest(prompt);
        std::vector<std::byte> got(shape.block_bytes());
        for (std::uint32_t l = 0; l < shape.layers && ok; ++l)
          for (std::uint32_t i = 0; i < n && ok; ++i) {
            pool.read(l, lease.blocks[i], got.data());
            ok = disagg::check_block(got.data(), got.size(), digest, l, i);
          }
        if (!ok) why = "the KV cache does not verify";
      }
      reply["ok"] = ok;
      reply["bytes"] = std::uint64_t{shape.layers} * n * shape.block_bytes();
      if (!ok) reply["error"] = why;
    } catch (const std::exception& e) {
      reply["ok"] = false;
      reply["error"] = e.what();
    }
    reply["decode"] = name;
    reply["decode_us"] =
        std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t0).count();
    ++served;
    nats.reply(msg, reply.dump());
  };
  serve_until_stopped(nats, kGenerate, "decode", workers, name, handle);
  std::fprintf(stderr, "%s: served %llu requests\n%s", name.c_str(),
               static_cast<unsigned long long>(served.load()), connector.stats().to_text().c_str());
  return 0;
}

// ---------------------------------------------------------------------------------------
// prefill

int run_prefill(const Args& args) {
  const std::string name = args.str("--name", "prefill-" + std::to_string(::getpid()));
  const int device = ferry_samples::parse_device(args.str("--device", "host"));
  if (device >= 0) ferry_samples::DeviceMemory probe(device, 8);  // says at once why not
  ferry::Connector connector(connector_options(name, args));
  Nats nats(name);
  Workers workers(args.num("--threads", 4));
  std::atomic<std::uint64_t> served{0};
  // Region mode: one attachment per decode worker, made on its first request and kept.
  std::mutex attached_mu;
  std::map<std::string, std::shared_ptr<ferry::Attachment>> attached;
  auto attachment = [&](const std::string& subject) {
    std::lock_guard lock(attached_mu);
    auto& a = attached[subject];
    if (!a || a->state() == ferry::Attachment::State::detached)
      a = std::make_shared<ferry::Attachment>(connector.attach(ferry::Subject(subject)));
    return a;
  };

  auto handle = [&](natsMsg* msg) {
    json reply = {{"worker", name}};
    try {
      json req = json::parse(
          std::string(natsMsg_GetData(msg), static_cast<std::size_t>(natsMsg_GetDataLength(msg))));
      disagg::Shape shape;
      shape.layers = req.at("layers");
      shape.tokens_per_block = req.at("tokens_per_block");
      shape.bytes_per_token = req.at("bytes_per_token");
      const std::string prompt = req.at("prompt");
      const std::uint32_t n = shape.blocks_for(req.at("tokens"));
      // "Prefill": the whole KV cache of the prompt, layer after layer, block after block.
      std::vector<std::byte> kv(std::size_t{shape.layers} * n * shape.block_bytes());
      const auto digest = disagg::prompt_digest(prompt);
      for (std::uint32_t l = 0; l < shape.layers; ++l)
        for (std::uint32_t i = 0; i < n; ++i)
          disagg::fill_block(kv.data() + (std::size_t{l} * n + i) * shape.block_bytes(),
                             shape.block_bytes(), digest, l, i);
      // On a GPU, the KV computed here is copied to device memory first, and sent from there.
      std::optional<ferry_samples::DeviceMemory> gpu;
      ferry::Descriptor source(kv.data(), kv.size());
      if (device >= 0) {
        gpu.emplace(device, kv.size());
        gpu->write(0, kv.data(), kv.size());
        source = ferry::Descriptor(gpu->data(), kv.size(), ferry::Device::cuda(device));
      }
      if (req.contains("region_subject")) {
        auto att = attachment(req.at("region_subject"));
        ferry::TransferOptions t;
        t.tag = std::to_string(req.at("id").get<std::uint64_t>());
        auto write =
            att->write_blocks({source}, req.at("blocks").get<std::vector<std::uint64_t>>(), t);
        write.wait_for_completion();
        reply["method"] = write.method();
      } else {
        auto write = connector.begin_write({source}, ferry::Subject(req.at("kv_subject")));
        write.wait_for_completion();
        reply["method"] = write.method();
      }
      reply["ok"] = true;
      reply["bytes"] = kv.size();
    } catch (const std::exception& e) {
      reply["ok"] = false;
      reply["error"] = e.what();
    }
    ++served;
    nats.reply(msg, reply.dump());
  };
  serve_until_stopped(nats, kPrefill, "prefill", workers, name, handle);
  std::fprintf(stderr, "%s: prefilled %llu requests\n%s", name.c_str(),
               static_cast<unsigned long long>(served.load()), connector.stats().to_text().c_str());
  return 0;
}

// ---------------------------------------------------------------------------------------
// client

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  std::size_t i = static_cast<std::size_t>(p / 100.0 * static_cast<double>(v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

// Sends `requests` requests in `mode` and prints their summary; returns whether every one was
// verified, and the throughput in `rate` (requests/s) and `gbps` (GB/s of KV).
bool run_batch(Nats& nats, const Args& args, const std::string& mode, double& rate, double& gbps) {
  const std::uint32_t requests = args.num("--requests", 300);
  const std::uint32_t concurrency = std::max<std::uint32_t>(1, args.num("--concurrency", 8));
  const std::uint32_t min_tokens = args.num("--min-tokens", 128);
  const std::uint32_t max_tokens = std::max(min_tokens, args.num("--max-tokens", 512));

  struct Result {
    bool sent = false;
    bool ok = false;
    double ms = 0;
    std::uint64_t bytes = 0;
    std::string method, prefill, error;
  };
  std::vector<Result> results(requests);
  std::atomic<std::uint32_t> next{0};
  std::atomic<std::uint32_t> finished{0};
  std::atomic<std::uint64_t> moved{0};
  const auto start = Clock::now();

  std::vector<std::thread> threads;
  for (std::uint32_t t = 0; t < concurrency; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(1000 + t);
      std::uniform_int_distribution<std::uint32_t> tokens(min_tokens, max_tokens);
      for (std::uint32_t i; !g_stop && (i = next++) < requests;) {
        json req = {{"id", i},
                    {"prompt", "request " + std::to_string(i) + ": tell me about ferries"},
                    {"tokens", tokens(rng)},
                    {"mode", mode}};
        auto t0 = Clock::now();
        Result& r = results[i];
        r.sent = true;
        auto answer = nats.request(kGenerate, req.dump(), 30s);
        r.ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
        if (!answer) {
          r.error = g_stop ? "stopped" : "no answer from the decode worker";
        } else {
          try {
            json rep = json::parse(*answer);
            r.ok = rep.value("ok", false);
            r.bytes = rep.value("bytes", std::uint64_t{0});
            r.method = rep.value("method", "");
            r.prefill = rep.value("prefill", "");
            r.error = rep.value("error", "");
          } catch (const std::exception& e) {
            r.ok = false;
            r.error = std::string("a malformed answer: ") + e.what();
          }
          if (r.ok) moved += r.bytes;
        }
        ++finished;
      }
    });
  }
  // Progress, about twice a second.
  const bool tty = isatty(STDOUT_FILENO) != 0;
  while (finished < requests && !g_stop) {
    std::this_thread::sleep_for(500ms);
    double secs = std::chrono::duration<double>(Clock::now() - start).count();
    std::printf("%s  %4u/%u requests  %8.1f MiB moved  %6.1f req/s%s", tty ? "\r" : "",
                finished.load(), requests, static_cast<double>(moved.load()) / (1 << 20),
                finished.load() / secs, tty ? "" : "\n");
    std::fflush(stdout);
  }
  // Stopped early: requests still waiting for answers fail at once instead of at their
  // timeout.
  if (g_stop) nats.close();
  for (auto& th : threads) th.join();
  const double secs = std::chrono::duration<double>(Clock::now() - start).count();
  if (tty) std::printf("\n");

  std::vector<double> lat, failed_lat;
  std::map<std::string, int> by_prefill, by_method;
  std::uint32_t ok = 0;
  std::uint32_t sent = 0;
  std::uint64_t bytes = 0;
  for (const auto& r : results) {
    if (!r.sent) continue;
    ++sent;
    if (!r.ok) {
      failed_lat.push_back(r.ms);
      continue;
    }
    ++ok;
    bytes += r.bytes;
    lat.push_back(r.ms);
    ++by_prefill[r.prefill];
    ++by_method[r.method];
  }
  std::printf("\n== ferry disaggregated prefill/decode (%s mode) ==\n", mode.c_str());
  std::printf("requests     %u sent, %u verified, %u failed%s\n", sent, ok, sent - ok,
              g_stop ? " (stopped early)" : "");
  std::printf("bytes moved  %.1f MiB of KV cache, every byte verified by the decode worker\n",
              static_cast<double>(bytes) / (1 << 20));
  std::printf("method       ");
  for (auto& [m, n] : by_method) std::printf("%s: %d requests  ", m.c_str(), n);
  std::printf("\nprefill      ");
  for (auto& [w, n] : by_prefill) std::printf("%s: %d  ", w.c_str(), n);
  std::printf("\nlatency ms   p50 %.2f  p90 %.2f  p99 %.2f  max %.2f  (verified requests)\n",
              percentile(lat, 50), percentile(lat, 90), percentile(lat, 99), percentile(lat, 100));
  if (!failed_lat.empty())
    std::printf("failures ms  p50 %.2f  max %.2f  (time until each failed)\n",
                percentile(failed_lat, 50), percentile(failed_lat, 100));
  std::printf("throughput   %.1f requests/s, %.2f GB/s of KV over %.2f s (concurrency %u)\n",
              ok / secs, static_cast<double>(bytes) / secs / 1e9, secs, concurrency);
  int shown = 0;
  for (std::uint32_t i = 0; i < requests && shown < 5; ++i)
    if (results[i].sent && !results[i].ok) {
      std::printf("failed       request %u: %s\n", i, results[i].error.c_str());
      ++shown;
    }
  rate = ok / secs;
  gbps = static_cast<double>(bytes) / secs / 1e9;
  return ok == requests;
}

int run_client(const Args& args) {
  const std::string mode = args.str("--mode", "region");
  if (mode != "region" && mode != "oneshot")
    throw std::runtime_error("--mode is region or oneshot, not '" + mode + "'");
  Nats nats("disagg-client");
  // Wait for the decode worker to answer at all (it may still be starting).
  auto until = Clock::now() + 20s;
  while (Clock::now() < until && !g_stop) {
    if (nats.request(kGenerate, "{}", 500ms)) break;
    std::this_thread::sleep_for(100ms);
  }
  double rate = 0, gbps = 0;
  if (args.num("--compare-modes", 0) == 0) return run_batch(nats, args, mode, rate, gbps) ? 0 : 1;
  // The same requests in both modes, one after the other.
  double one_rate = 0, one_gbps = 0;
  const bool region_ok = run_batch(nats, args, "region", rate, gbps);
  const bool oneshot_ok = !g_stop && run_batch(nats, args, "oneshot", one_rate, one_gbps);
  std::printf("\n== modes compared ==\n");
  std::printf("region       %.1f requests/s, %.2f GB/s\n", rate, gbps);
  std::printf("oneshot      %.1f requests/s, %.2f GB/s\n", one_rate, one_gbps);
  if (one_rate > 0) std::printf("ratio        region / oneshot = %.2f x\n", rate / one_rate);
  return region_ok && oneshot_ok ? 0 : 1;
}

// ---------------------------------------------------------------------------------------
// all

/// The nats-server to start: the first on PATH, else Debian's; empty when there is none.
std::string find_nats_server() {
  std::string dirs = std::getenv("PATH") != nullptr ? std::getenv("PATH") : "";
  dirs += ":/usr/sbin:/usr/bin";
  std::size_t start = 0;
  while (start <= dirs.size()) {
    const std::size_t end = std::min(dirs.find(':', start), dirs.size());
    const std::string dir = dirs.substr(start, end - start);
    start = end + 1;
    if (dir.empty()) continue;
    const std::string path = dir + "/nats-server";
    if (::access(path.c_str(), X_OK) == 0) return path;
  }
  return {};
}

int run_all(const char* self, const Args& args) {
  // Destroyed in reverse: the workers stop before the server they talk to.
  std::unique_ptr<disagg::Child> nats_server;
  std::vector<std::unique_ptr<disagg::Child>> children;
  if (args.values.count("--device")) {  // says why not before starting anything
    const int device = ferry_samples::parse_device(args.values.at("--device"));
    if (device >= 0) ferry_samples::DeviceMemory probe(device, 8);
  }
  if (const char* url = std::getenv("FERRY_NATS_URL"); url == nullptr || *url == '\0') {
    const std::string server = find_nats_server();
    if (server.empty()) {
      std::fprintf(stderr,
                   "disagg: no nats-server on PATH or in /usr/sbin (install nats-server, or set "
                   "FERRY_NATS_URL to a running server)\n");
      return 2;
    }
    auto port = disagg::free_port();
    nats_server = std::make_unique<disagg::Child>(std::vector<std::string>{
        server, "-a", "127.0.0.1", "-p", std::to_string(port), "-l", "/dev/null"});
    if (!disagg::wait_for_port(port, 10s)) {
      std::fprintf(stderr, "disagg: %s did not start listening on 127.0.0.1:%d within 10 s\n",
                   server.c_str(), static_cast<int>(port));
      return 2;
    }
    ::setenv("FERRY_NATS_URL", ("nats://127.0.0.1:" + std::to_string(port)).c_str(), 1);
    std::printf("nats-server  started privately at %s\n", std::getenv("FERRY_NATS_URL"));
  }
  std::vector<std::string> pass;  // the shape options go to the decode worker
  for (const char* key : {"--layers", "--tokens-per-block", "--bytes-per-token", "--blocks"})
    if (args.values.count(key)) pass.insert(pass.end(), {key, args.values.at(key)});
  std::vector<std::string> device;  // and --device to every worker
  if (args.values.count("--device")) device = {"--device", args.values.at("--device")};
  // --metrics HOST:PORT: the decode worker serves its metrics at PORT, prefill i at PORT+1+i
  // (one endpoint per process).
  const std::string metrics = args.str("--metrics", "");
  std::string metrics_host;
  unsigned long metrics_port = 0;
  if (!metrics.empty()) {
    const auto colon = metrics.rfind(':');
    if (colon == std::string::npos)
      throw std::invalid_argument("--metrics wants HOST:PORT, not '" + metrics + "'");
    metrics_host = metrics.substr(0, colon);
    metrics_port = std::stoul(metrics.substr(colon + 1));
  }
  auto metrics_of = [&](unsigned long offset) -> std::vector<std::string> {
    if (metrics.empty()) return {};
    return {"--metrics", metrics_host + ":" + std::to_string(metrics_port + offset)};
  };
  std::vector<std::string> decode{self, "decode", "--name", "decode-0"};
  decode.insert(decode.end(), pass.begin(), pass.end());
  decode.insert(decode.end(), device.begin(), device.end());
  for (auto& m : metrics_of(0)) decode.push_back(m);
  children.push_back(std::make_unique<disagg::Child>(decode, true));
  const std::uint32_t prefills = args.num("--prefill", 2);
  for (std::uint32_t i = 0; i < prefills; ++i) {
    std::vector<std::string> prefill{self, "prefill", "--name", "prefill-" + std::to_string(i)};
    prefill.insert(prefill.end(), device.begin(), device.end());
    for (auto& m : metrics_of(1 + i)) prefill.push_back(m);
    children.push_back(std::make_unique<disagg::Child>(prefill, true));
  }
  if (!metrics.empty())
    std::printf("metrics      decode-0 at %s, prefill-i at %s:%lu+i (Prometheus text)\n",
                metrics.c_str(), metrics_host.c_str(), metrics_port + 1);
  for (auto& c : children) {
    if (!c->wait_ready(20s)) {
      std::fprintf(stderr, "disagg: a worker did not come up\n");
      return 2;
    }
  }
  std::printf("workers      decode-0, %u prefill (queue group \"prefill\")\n", prefills);
  int rc = run_client(args);
  // Stop the workers first (all at once, then wait for each), then the server they talk to.
  for (auto& c : children) c->terminate();
  for (auto& c : children) c->stop();
  children.clear();
  nats_server.reset();
  return g_stop ? 130 : rc;
}

}  // namespace

int main(int argc, char** argv) {
  install_stop_handlers();
  const bool named = argc > 1 && argv[1][0] != '-';
  const std::string role = named ? argv[1] : "all";
  const std::vector<std::string> decode = {
      "--name",    "--blocks", "--layers", "--tokens-per-block", "--bytes-per-token",
      "--threads", "--device", "--metrics"};
  const std::vector<std::string> prefill = {"--name", "--threads", "--device", "--metrics"};
  const std::vector<std::string> client = {"--requests",   "--concurrency", "--min-tokens",
                                           "--max-tokens", "--mode",        "--compare-modes"};
  std::vector<std::string> all = {"--prefill"};
  for (const auto* v : {&decode, &prefill, &client})
    for (const auto& k : *v)
      if (std::find(all.begin(), all.end(), k) == all.end()) all.push_back(k);
  try {
    const Args args(argc, argv, named ? 2 : 1,
                    role == "decode"    ? decode
                    : role == "prefill" ? prefill
                    : role == "client"  ? client
                                        : all);
    if (role == "decode") return run_decode(args);
    if (role == "prefill") return run_prefill(args);
    if (role == "client") return run_client(args);
    if (role == "all") return run_all("/proc/self/exe", args);
    std::fprintf(stderr, "usage: %s [all|decode|prefill|client] [--option value]...\n", argv[0]);
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "disagg %s: %s\n", role.c_str(), e.what());
    return 1;
  }
}
