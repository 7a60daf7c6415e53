// ferry_soak_worker: the peer process of the soak (soak_driver.cpp). One connector, one
// read_write region served at a NATS subject, and one one-shot operation at a time, driven by
// one command per line on stdin, answered on stdout. Every operation pairs with the driver's
// by NATS subject.
//
//   argv: NAME NATS_URL REGION_SUBJECT REGION_SIZE BLOCK_SIZE REGION_SEED TRANSPORTS
//         SUBJECT_TIMEOUT_MS PEER_TIMEOUT_MS
//     -> HELLO <pid> <methods>       once the connector and the region are up; the region's
//                                    byte at offset o holds REGION_SEED's pattern at o
//   passive KIND SUBJ SIZE SEED TIMEOUT_MS -> READY
//        a readable (SEED's pattern) or writable (KIND read|write) served at SUBJ
//   end SEED CANCEL_MS BOUND_MS -> END ...   wait for the passive operation to end, cancelling
//        it after CANCEL_MS (-1: never); a writable that completed is checked against SEED
//   active KIND SUBJ SIZE SEED TIMEOUT_MS CANCEL_MS BOUND_MS -> END ...   read from (KIND
//        read, checked against SEED) or write SEED's pattern into the operation at SUBJ
//   blocks KIND SUBJ TIMEOUT_MS CANCEL_MS BOUND_MS SEED ID:SEED,ID:SEED,... -> END ...
//        attach (once) to the driver's region served at SUBJ and read the blocks ID (each
//        checked against its SEED's pattern at its offset, 0: unknown, not checked) or write
//        SEED's pattern into them (KIND read|write)
//   quit
//
//   END <status> <code|-> <method|-> <check> <latency_us> <message...>
//     status: complete, cancelled, errored, or lost (not ended within BOUND_MS: its handle
//     and memory are kept, never reused); check: ok, corrupt@<offset>, or - (nothing to
//     check: a readable, or an operation that did not complete)
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <ferry/ferry.hpp>

#include "tests/support/patterns.hpp"

namespace {

using namespace ferry;
using Clock = std::chrono::steady_clock;

void say(const std::string& line) { std::cout << line << std::endl; }

std::string one_line(std::string text) {
  std::replace(text.begin(), text.end(), '\n', ' ');
  return text.empty() ? "-" : text;
}

bool ended(OperationStatus s) {
  return s == OperationStatus::complete || s == OperationStatus::cancelled ||
         s == OperationStatus::errored;
}

/// A buffer an operation used: reused only once that operation has ended.
struct Slot {
  std::unique_ptr<std::byte[]> memory;
  std::size_t capacity = 0;
  std::byte* get(std::size_t size) {
    if (size > capacity || !memory) {
      memory = ferry::test::filled(std::max<std::size_t>(size, 1), std::byte{0});
      capacity = std::max<std::size_t>(size, 1);
    }
    return memory.get();
  }
};

class Worker {
 public:
  Worker(Connector& connector, std::uint64_t block_size)
      : connector_(connector), block_size_(block_size) {}

  void passive(std::istringstream& in) {
    std::string kind, subject;
    std::size_t size = 0;
    std::uint64_t seed = 0;
    long long timeout_ms = 0;
    in >> kind >> subject >> size >> seed >> timeout_ms;
    std::byte* data = slot_.get(size);
    OperationOptions o;
    o.subject = subject;
    o.timeout = std::chrono::milliseconds(timeout_ms);
    kind_ = kind;
    size_ = size;
    data_ = data;
    started_ = Clock::now();
    if (kind == "read") {
      ferry::test::fill_pattern(data, size, seed);
      op_ = connector_.create_readable({Descriptor(data, size)}, o);
    } else {
      std::fill_n(data, size, std::byte{0});
      op_ = connector_.create_writable({Descriptor(data, size)}, o);
    }
    say("READY");
  }

  void end(std::istringstream& in) {
    std::uint64_t seed = 0;
    long long cancel_ms = -1, bound_ms = 0;
    in >> seed >> cancel_ms >> bound_ms;
    // The passive side verifies what was written into it; a readable has nothing to check.
    finish(seed, kind_ == "write", cancel_ms, bound_ms);
  }

  /// A block transfer on the driver's region at SUBJ, attached once (again once ended).
  void blocks(std::istringstream& in) {
    std::string kind, subject, list;
    long long timeout_ms = 0, cancel_ms = -1, bound_ms = 0;
    std::uint64_t seed = 0;
    in >> kind >> subject >> timeout_ms >> cancel_ms >> bound_ms >> seed >> list;
    std::vector<std::uint64_t> ids, seeds;
    std::istringstream items(list);
    for (std::string item; std::getline(items, item, ',');) {
      auto colon = item.find(':');
      ids.push_back(std::strtoull(item.substr(0, colon).c_str(), nullptr, 10));
      seeds.push_back(std::strtoull(item.substr(colon + 1).c_str(), nullptr, 10));
    }
    Attachment& att = attachments_[subject];
    if (!att || att.state() == Attachment::State::detached) {
      AttachOptions ao;
      ao.timeout = std::chrono::seconds(10);
      att = connector_.attach(Subject(subject), ao);
    }
    const std::size_t size = ids.size() * block_size_;
    std::byte* data = slot_.get(size);
    kind_ = kind;
    size_ = size;
    data_ = data;
    started_ = Clock::now();
    TransferOptions t;
    t.timeout = std::chrono::milliseconds(timeout_ms);
    if (kind == "write") {
      for (std::size_t j = 0; j < ids.size(); ++j)
        ferry::test::fill_pattern(data + j * block_size_, block_size_, seed, ids[j] * block_size_);
      op_ = att.write_blocks({Descriptor(data, size)}, ids, t);
      finish_with({}, cancel_ms, bound_ms);
      return;
    }
    std::fill_n(data, size, std::byte{0});
    op_ = att.read_blocks(ids, {Descriptor(data, size)}, t);
    // Every block whose content the driver knows (its seed is not 0) is checked.
    finish_with(
        [&] {
          for (std::size_t j = 0; j < ids.size(); ++j) {
            if (seeds[j] == 0) continue;
            long long bad = ferry::test::first_mismatch(data + j * block_size_, block_size_,
                                                        seeds[j], ids[j] * block_size_);
            if (bad >= 0) return static_cast<long long>(j * block_size_) + bad;
          }
          return -1LL;
        },
        cancel_ms, bound_ms);
  }

  void active(std::istringstream& in) {
    std::string kind, subject;
    std::size_t size = 0;
    std::uint64_t seed = 0;
    long long timeout_ms = 0, cancel_ms = -1, bound_ms = 0;
    in >> kind >> subject >> size >> seed >> timeout_ms >> cancel_ms >> bound_ms;
    std::byte* data = slot_.get(size);
    OperationOptions o;
    o.timeout = std::chrono::milliseconds(timeout_ms);
    kind_ = kind;
    size_ = size;
    data_ = data;
    started_ = Clock::now();
    if (kind == "read") {
      std::fill_n(data, size, std::byte{0});
      op_ = connector_.begin_read(Subject(subject), {Descriptor(data, size)}, o);
    } else {
      ferry::test::fill_pattern(data, size, seed);
      op_ = connector_.begin_write({Descriptor(data, size)}, Subject(subject), o);
    }
    finish(seed, kind == "read", cancel_ms, bound_ms);
  }

 private:
  void finish(std::uint64_t seed, bool check, long long cancel_ms, long long bound_ms) {
    finish_with(check ? std::function<long long()>([this, seed] {
                  return ferry::test::first_mismatch(data_, size_, seed);
                })
                      : std::function<long long()>(),
                cancel_ms, bound_ms);
  }

  /// Waits for the operation as finish() does; `check` (when set) returns the offset of the
  /// first wrong byte of a completed transfer, or -1.
  void finish_with(const std::function<long long()>& check, long long cancel_ms,
                   long long bound_ms) {
    using std::chrono::milliseconds;
    OperationStatus s = op_.status();
    if (cancel_ms >= 0) {
      auto at = started_ + milliseconds(cancel_ms);
      s = op_.wait(std::max(Clock::duration::zero(), at - Clock::now()));
      if (!ended(s)) op_.cancel();
    }
    s = op_.wait(
        std::max(Clock::duration::zero(), started_ + milliseconds(bound_ms) - Clock::now()));
    auto latency =
        std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - started_).count();
    if (!ended(s)) {
      // Lost: keep the operation and its memory for good, so that nothing it may still do
      // lands in a buffer the next operation uses.
      say("END lost - - - " + std::to_string(latency) + " not ended within " +
          std::to_string(bound_ms) + " ms");
      lost_.push_back(std::move(op_));
      lost_memory_.push_back(std::move(slot_.memory));
      slot_.capacity = 0;
      return;
    }
    std::string verdict = "-";
    if (s == OperationStatus::complete && check) {
      long long bad = check();
      verdict = bad < 0 ? "ok" : "corrupt@" + std::to_string(bad);
    }
    auto error = op_.error();
    std::string method = op_.method();
    say("END " + std::string(to_string(s)) + " " +
        (error ? std::string(to_string(error->code())) : "-") + " " +
        (method.empty() ? "-" : method) + " " + verdict + " " + std::to_string(latency) + " " +
        one_line(error ? error->message() : ""));
    op_ = Operation();
  }

  Connector& connector_;
  std::uint64_t block_size_;
  std::map<std::string, Attachment> attachments_;  // to the driver's region, by subject
  Slot slot_;
  Operation op_;
  std::string kind_;
  std::size_t size_ = 0;
  std::byte* data_ = nullptr;
  Clock::time_point started_;
  std::vector<Operation> lost_;
  std::vector<std::unique_ptr<std::byte[]>> lost_memory_;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 10) {
    std::cerr << "usage: ferry_soak_worker NAME NATS_URL REGION_SUBJECT REGION_SIZE BLOCK_SIZE "
                 "REGION_SEED TRANSPORTS SUBJECT_TIMEOUT_MS PEER_TIMEOUT_MS\n";
    return 2;
  }
  const std::size_t region_size = std::strtoull(argv[4], nullptr, 10);
  const std::uint64_t block_size = std::strtoull(argv[5], nullptr, 10);
  const std::uint64_t region_seed = std::strtoull(argv[6], nullptr, 10);

  ConnectorOptions options;
  options.name = argv[1];
  options.use_environment = false;
  options.nats.use_environment = false;
  options.nats.servers = {argv[2]};
  options.nats.reconnect_wait = std::chrono::milliseconds(100);
  std::istringstream transports(argv[7]);
  for (std::string t; std::getline(transports, t, ',');) options.transports.push_back(t);
  options.subject_timeout = std::chrono::milliseconds(std::atoll(argv[8]));
  options.peer_timeout = std::chrono::milliseconds(std::atoll(argv[9]));
  // Warnings about peers that vanish are the soak's everyday business; errors still show.
  options.log.level = LogLevel::error;
  Connector connector(options);

  auto region_memory = ferry::test::filled(region_size, std::byte{0});
  ferry::test::fill_pattern(region_memory.get(), region_size, region_seed);
  RegionOptions ro;
  ro.access = RegionAccess::read_write;
  ro.block_size = block_size;
  ro.subject = argv[3];
  ro.queue_events = false;  // nobody reads them: a queue would only grow
  Region region = connector.create_region({Descriptor(region_memory.get(), region_size)}, ro);

  std::string methods;
  for (const MethodInfo& m : connector.methods())
    if (m.available) methods += (methods.empty() ? "" : ",") + m.method;
  say("HELLO " + std::to_string(::getpid()) + " " + methods);

  Worker worker(connector, block_size);
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    in >> cmd;
    try {
      if (cmd == "passive") {
        worker.passive(in);
      } else if (cmd == "end") {
        worker.end(in);
      } else if (cmd == "blocks") {
        worker.blocks(in);
      } else if (cmd == "active") {
        worker.active(in);
      } else if (cmd == "quit") {
        break;
      } else {
        say("ERROR unknown command " + cmd);
      }
    } catch (const Error& e) {
      // Refused at the call (before any operation existed): the driver counts it by code.
      say(std::string("END refused ") + std::string(to_string(e.code())) + " - - 0 " +
          one_line(e.message()));
    }
  }
  return 0;
}
