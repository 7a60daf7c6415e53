// ferry_net_worker: a ferry worker of the network lab (net_lab_test.cpp), started inside a
// lab "host" (a network namespace) with `ip netns exec`. One connector, made from the command
// line; then one command per line on stdin, one JSON object per line on stdout.
//
//   ferry_net_worker --name NAME --nats URL[,URL...] [--bind IP] [--transports tcp[,cma]]
//                    [--peer-timeout MS] [--subject-timeout MS] [--nats-ping MS]
//
// First line: {"ready":true,"name":..,"methods":[..],"side_channel":..} once the side channel
// is connected (or {"ready":false,"error":..} after 15 s). Commands (SLOT: any word naming an
// operation; SUBJECT "-": none; TIMEOUT_MS 0: none):
//
//   expose SLOT readable|writable SIZE SEED SUBJECT TIMEOUT_MS -> {"slot","meta"}
//       a passive operation over SIZE bytes (a readable's hold SEED's pattern), served at
//       SUBJECT; "meta" is its metadata's JSON, for pairing by explicit metadata
//   begin SLOT read|write SIZE SEED TIMEOUT_MS subject SUBJECT  -> {"slot","started"}
//   begin SLOT read|write SIZE SEED TIMEOUT_MS meta JSON        -> {"slot","started"}
//       an active operation (a write sends SEED's pattern); "error" when the call throws
//   wait SLOT MS  -> {"slot","status","code","message","method","verify","ended_ms"}
//       waits at most MS for the operation to end; "verify": "ok", "mismatch at N" (a read's
//       or a writable's bytes against SEED's pattern, once complete) or "-"; "ended_ms": when
//       it ended, in CLOCK_MONOTONIC milliseconds (the test's steady_clock)
//   status SLOT   -> {"slot","status"}
//   hash SLOT     -> {"slot","hash"}: a hash of the operation's local memory (as a string)
//   drop SLOT     -> {"slot","dropped"}: the handle destroyed (cancelled if live), memory freed
//   stats         -> {"fds","rss_kb","live","side_channel","detail","ferry"}: "ferry" is the
//                    connector's ConnectorStats::to_json()
//   await_nats STATE MS -> {"side_channel","detail"} once the side channel is STATE (or MS pass)
//   quit          -> exits 0
//
// Buffers are mapped and unmapped whole (mmap), so that resident memory returns to its
// baseline when an operation is dropped, whatever the allocator keeps.
#include <dirent.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <ferry/ferry.hpp>
#include <nlohmann/json.hpp>

#include "tests/support/patterns.hpp"

namespace {

using namespace ferry;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

long long now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now().time_since_epoch())
      .count();
}

void say(const json& j) { std::cout << j.dump() << std::endl; }

/// An anonymous mapping, unmapped by the destructor.
class Buffer {
 public:
  explicit Buffer(std::size_t size) : size_(size) {
    void* p = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("mmap of " + std::to_string(size) + " bytes");
    data_ = static_cast<std::byte*>(p);
  }
  ~Buffer() { ::munmap(data_, size_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  std::byte* data() const { return data_; }
  std::size_t size() const { return size_; }

 private:
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

struct Slot {
  std::unique_ptr<Buffer> memory;
  Operation op;
  std::string kind;  // readable, writable, read, write
  std::uint64_t seed = 0;
  std::shared_ptr<std::atomic<long long>> ended_ms = std::make_shared<std::atomic<long long>>(0);
};

int count_fds() {
  int n = 0;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (const dirent* e = ::readdir(d))
      if (e->d_name[0] != '.') ++n;
    ::closedir(d);
    --n;  // the directory's own descriptor
  }
  return n;
}

long rss_kb() {
  std::ifstream statm("/proc/self/statm");
  long pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * (::sysconf(_SC_PAGESIZE) / 1024);
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, sep);)
    if (!item.empty()) out.push_back(item);
  return out;
}

json side_channel(const Connector& c) {
  SideChannelStatus s = c.side_channel_state();
  return {{"side_channel", to_string(s.state)}, {"detail", s.detail}};
}

json outcome(const std::string& name, Slot& slot) {
  json j{{"slot", name}, {"status", to_string(slot.op.status())}, {"method", slot.op.method()}};
  if (auto e = slot.op.error()) {
    j["code"] = std::string(to_string(e->code()));
    j["message"] = e->message();
  }
  std::string verify = "-";
  if (slot.op.status() == OperationStatus::complete &&
      (slot.kind == "read" || slot.kind == "writable")) {
    long long bad = test::first_mismatch(slot.memory->data(), slot.memory->size(), slot.seed);
    verify = bad < 0 ? "ok" : "mismatch at " + std::to_string(bad);
  }
  j["verify"] = verify;
  // An operation that ended within the call that began it gets its callback queued to the
  // loop: it may not have run yet. Now is then a bound on when it ended.
  if (slot.op.status() != OperationStatus::in_progress && slot.ended_ms->load() == 0)
    slot.ended_ms->store(now_ms());
  j["ended_ms"] = slot.ended_ms->load();
  return j;
}

}  // namespace

int main(int argc, char** argv) {
  ConnectorOptions o;
  o.use_environment = false;
  o.nats.use_environment = false;
  o.nats.reconnect_wait = std::chrono::milliseconds(100);
  o.nats.connect_timeout = std::chrono::milliseconds(1000);
  o.cma.ptracer_any = true;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const std::string value = argv[i + 1];
    if (flag == "--name") {
      o.name = value;
    } else if (flag == "--nats") {
      o.nats.servers = split(value, ',');
    } else if (flag == "--bind") {
      o.tcp.bind_address = value;
    } else if (flag == "--transports") {
      o.transports = split(value, ',');
    } else if (flag == "--peer-timeout") {
      o.peer_timeout = std::chrono::milliseconds(std::stoll(value));
    } else if (flag == "--nats-ping") {
      o.nats.ping_interval = std::chrono::milliseconds(std::stoll(value));
    } else if (flag == "--subject-timeout") {
      o.subject_timeout = std::chrono::milliseconds(std::stoll(value));
    } else {
      std::cerr << "ferry_net_worker: unknown flag " << flag << "\n";
      return 2;
    }
  }

  std::unique_ptr<Connector> connector;
  try {
    connector = std::make_unique<Connector>(o);
  } catch (const Error& e) {
    say({{"ready", false}, {"error", e.what()}});
    return 1;
  }
  const auto until = Clock::now() + std::chrono::seconds(15);
  while (connector->side_channel_state().state != SideChannelState::connected &&
         Clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  {
    json methods = json::array();
    for (const MethodInfo& m : connector->methods())
      if (m.available) methods.push_back(m.method);
    json ready = side_channel(*connector);
    ready["ready"] = ready["side_channel"] == "connected";
    ready["name"] = o.name;
    ready["methods"] = methods;
    say(ready);
  }

  std::map<std::string, Slot> slots;
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    std::string name;
    in >> cmd >> name;
    try {
      if (cmd == "expose") {
        std::string kind, subject;
        std::size_t size = 0;
        std::uint64_t seed = 0;
        long long timeout = 0;
        in >> kind >> size >> seed >> subject >> timeout;
        slots.erase(name);
        Slot& slot = slots[name];
        slot.kind = kind;
        slot.seed = seed;
        slot.memory = std::make_unique<Buffer>(size);
        OperationOptions opts;
        opts.timeout = std::chrono::milliseconds(timeout);
        if (subject != "-") opts.subject = subject;
        std::vector<Descriptor> local{Descriptor(slot.memory->data(), size)};
        std::string meta;
        if (kind == "readable") {
          test::fill_pattern(slot.memory->data(), size, seed);
          ReadableOperation op = connector->create_readable(local, opts);
          meta = op.metadata().to_json();
          slot.op = std::move(op);
        } else {
          WritableOperation op = connector->create_writable(local, opts);
          meta = op.metadata().to_json();
          slot.op = std::move(op);
        }
        slot.op.on_complete(
            [ended = slot.ended_ms](OperationStatus, const Error*) { ended->store(now_ms()); });
        say({{"slot", name}, {"meta", meta}});
      } else if (cmd == "begin") {
        std::string kind, how;
        std::size_t size = 0;
        std::uint64_t seed = 0;
        long long timeout = 0;
        in >> kind >> size >> seed >> timeout >> how;
        std::string rest;
        std::getline(in >> std::ws, rest);
        slots.erase(name);
        Slot& slot = slots[name];
        slot.kind = kind;
        slot.seed = seed;
        slot.memory = std::make_unique<Buffer>(size);
        if (kind == "write") test::fill_pattern(slot.memory->data(), size, seed);
        OperationOptions opts;
        opts.timeout = std::chrono::milliseconds(timeout);
        std::vector<Descriptor> local{Descriptor(slot.memory->data(), size)};
        if (how == "subject") {
          Subject subject(rest);
          if (kind == "read")
            slot.op = connector->begin_read(subject, local, opts);
          else
            slot.op = connector->begin_write(local, subject, opts);
        } else {
          RdmaMetadata meta = RdmaMetadata::from_json(rest);
          if (kind == "read")
            slot.op = connector->begin_read(meta, local, opts);
          else
            slot.op = connector->begin_write(local, meta, opts);
        }
        slot.op.on_complete(
            [ended = slot.ended_ms](OperationStatus, const Error*) { ended->store(now_ms()); });
        say({{"slot", name}, {"started", true}});
      } else if (cmd == "wait") {
        long long ms = 0;
        in >> ms;
        auto it = slots.find(name);
        if (it == slots.end()) throw std::runtime_error("no slot " + name);
        it->second.op.wait(std::chrono::milliseconds(ms));
        say(outcome(name, it->second));
      } else if (cmd == "status") {
        auto it = slots.find(name);
        if (it == slots.end()) throw std::runtime_error("no slot " + name);
        say({{"slot", name}, {"status", to_string(it->second.op.status())}});
      } else if (cmd == "hash") {
        auto it = slots.find(name);
        if (it == slots.end()) throw std::runtime_error("no slot " + name);
        // FNV-1a over 8-byte words: enough to see whether any byte changed.
        const Buffer& m = *it->second.memory;
        std::uint64_t h = 14695981039346656037ull;
        std::size_t i = 0;
        for (; i + 8 <= m.size(); i += 8) {
          std::uint64_t w;
          std::memcpy(&w, m.data() + i, 8);
          h = (h ^ w) * 1099511628211ull;
        }
        for (; i < m.size(); ++i)
          h = (h ^ std::to_integer<std::uint64_t>(m.data()[i])) * 1099511628211ull;
        say({{"slot", name}, {"hash", std::to_string(h)}});
      } else if (cmd == "drop") {
        slots.erase(name);
        say({{"slot", name}, {"dropped", true}});
      } else if (cmd == "stats") {
        json j = side_channel(*connector);
        j["fds"] = count_fds();
        j["rss_kb"] = rss_kb();
        j["live"] = connector->stats().live;
        j["ferry"] = json::parse(connector->stats().to_json(), nullptr, false);
        say(j);
      } else if (cmd == "await_nats") {
        // `name` holds the state wanted here.
        long long ms = 0;
        in >> ms;
        const auto end = Clock::now() + std::chrono::milliseconds(ms);
        while (to_string(connector->side_channel_state().state) != name && Clock::now() < end)
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
        say(side_channel(*connector));
      } else if (cmd == "quit") {
        break;
      } else {
        say({{"error", "unknown command " + cmd}});
      }
    } catch (const Error& e) {
      say({{"slot", name},
           {"error", e.what()},
           {"code", std::string(to_string(e.code()))},
           {"message", e.message()}});
    } catch (const std::exception& e) {
      say({{"slot", name}, {"error", e.what()}});
    }
  }
  slots.clear();
  connector.reset();
  return 0;
}
