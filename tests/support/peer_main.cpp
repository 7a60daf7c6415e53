// ferry_test_peer: the other process of the cross-process tests. It reads one command per
// line on stdin and answers one line on stdout:
//
//   readable SIZE SEED    -> META <json>      expose SIZE patterned bytes for reading
//   writable SIZE         -> META <json>      expose SIZE zero bytes for writing
//   wait                  -> DONE <status> [<code> <message>]   wait for the passive operation
//   check SEED            -> CHECK ok | CHECK mismatch <offset>  verify the writable's bytes
//   status                -> STATUS <status>   the passive operation's status
//   read SEED <json>      -> DONE ...          read the described readable, verify the bytes
//   write SEED <json>     -> DONE ...          write patterned bytes into the described writable
//   start_read <json>     -> STARTED           begin a read and do not wait (for kill tests)
//   readable_at SUBJECT SIZE SEED -> READY     as readable, served at a NATS subject
//   writable_at SUBJECT SIZE      -> READY     as writable, served at a NATS subject
//   read_at SEED SIZE SUBJECT     -> DONE ...  read by subject, verify the bytes
//   write_at SEED SIZE SUBJECT    -> DONE ...  write patterned bytes by subject
//   start_read_at SIZE SUBJECT    -> STARTED   begin a read by subject and do not wait
//   readable_sg SEED CUT  -> META <json>      as readable, in pieces of the sizes in CUT
//                                             ("a,b,c"), guard bytes between them
//   writable_sg CUT       -> META <json>      as writable, in pieces
//   read_sg SEED CUT <json>  -> DONE ...      read into pieces, verify the bytes and guards
//   write_sg SEED CUT <json> -> DONE ...      write patterned bytes from pieces
//   method                -> METHOD <active> <passive>   the methods that moved the bytes of
//                                             the last active and passive operations ("-": none)
//   probe_vm PID ADDR LEN -> PROBE ok | PROBE <errno name>   process_vm_readv of LEN bytes at
//                                             ADDR (hex) in process PID, from here
//   refuse_pool CALL      -> REFUSING <threads> | ERROR <why>   from now on, every thread of
//                                             libuv's pool gets EPERM from CALL
//                                             (process_vm_readv or process_vm_writev; a seccomp
//                                             filter per thread), the loop thread does not
//   region SIZE SEED      -> META <region json>  a read_write region (docs/regions.md) over SIZE
//                                             bytes patterned with SEED, blocks of 4096 bytes
//   region_event          -> EVENT <type> <kind> <tag> <offset> <length> <status>
//                                             the region's next event (within 60 s; "EVENT none")
//   region_check SEED OFFSET LEN -> CHECK ok | CHECK mismatch <offset>   LEN bytes of the
//                                             region at OFFSET hold SEED's pattern from 0
//   region_read SEED OFFSET LEN <json>  -> DONE ...  attach (once per region) and read LEN
//                                             bytes at OFFSET, verify SEED's pattern from OFFSET
//   region_write SEED OFFSET LEN TAG <json> -> DONE ...  attach (once) and write LEN bytes of
//                                             SEED's pattern at OFFSET, tagged TAG
//   quit                  -> (exits 0)
//
// The NATS side channel comes from the environment (FERRY_NATS_URL).
//
// A transfer whose bytes do not verify answers "DONE corrupt <offset>" ("DONE corrupt guards"
// when a byte outside the pieces changed); check answers "CHECK guards" for that.
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <uv.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <ferry/ferry.hpp>

#include "build_config.hpp"
#include "tests/support/patterns.hpp"
#include "tests/support/scattered.hpp"
#if FERRY_HAS_VERBS
#include "tests/support/sim_verbs.hpp"
#endif

namespace {

using namespace ferry;

std::string describe(const Operation& op) {
  std::string line = "DONE " + std::string(to_string(op.status()));
  if (auto e = op.error()) line += " " + std::string(to_string(e->code())) + " " + e->message();
  return line;
}

void say(const std::string& line) {
  std::cout << line << std::endl;  // flushes: the parent waits for each line
}

#if defined(__x86_64__)
constexpr std::uint32_t kAuditArch = AUDIT_ARCH_X86_64;
#elif defined(__aarch64__)
constexpr std::uint32_t kAuditArch = AUDIT_ARCH_AARCH64;
#else
constexpr std::uint32_t kAuditArch = 0;
#endif

/// Installs, on every thread of libuv's pool (UV_THREADPOOL_SIZE of them, 4 by default), a
/// seccomp filter under which system call `nr` fails with EPERM; other threads (this one, the
/// connector's loop) are left as they are. Returns the number of threads, or throws
/// std::runtime_error.
unsigned refuse_on_pool_threads(long nr) {
  if (kAuditArch == 0) throw std::runtime_error("no seccomp architecture known for this build");
  unsigned threads = 4;
  if (const char* v = std::getenv("UV_THREADPOOL_SIZE"); v != nullptr && std::atoi(v) > 0)
    threads = static_cast<unsigned>(std::atoi(v));
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    unsigned arrived = 0;
    unsigned installed = 0;
    std::string error;
    unsigned threads = 0;
    long nr = 0;
  } shared;
  shared.threads = threads;
  shared.nr = nr;
  struct Item {
    uv_work_t req{};
    Shared* shared = nullptr;
  };
  std::vector<Item> items(threads);
  uv_loop_t loop;
  uv_loop_init(&loop);
  for (Item& item : items) {
    item.shared = &shared;
    item.req.data = &item;
    uv_queue_work(
        &loop, &item.req,
        [](uv_work_t* req) {
          Shared& sh = *static_cast<Item*>(req->data)->shared;
          std::unique_lock lock(sh.mu);
          // All items at once, so that each runs on a thread of its own: every pool thread.
          ++sh.arrived;
          sh.cv.notify_all();
          if (!sh.cv.wait_for(lock, std::chrono::seconds(10),
                              [&] { return sh.arrived == sh.threads; })) {
            sh.error = "the pool has fewer threads than UV_THREADPOOL_SIZE says";
            return;
          }
          sock_filter filter[] = {
              BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, arch)),
              BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, kAuditArch, 1, 0),
              BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
              BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
              BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, static_cast<std::uint32_t>(sh.nr), 0, 1),
              BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA)),
              BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
          };
          sock_fprog prog{static_cast<unsigned short>(sizeof filter / sizeof filter[0]), filter};
          if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 ||
              ::prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) != 0)
            sh.error = std::string("seccomp: ") + std::strerror(errno);
          else
            ++sh.installed;
        },
        [](uv_work_t*, int) {});
  }
  uv_run(&loop, UV_RUN_DEFAULT);
  uv_loop_close(&loop);
  if (!shared.error.empty()) throw std::runtime_error(shared.error);
  return shared.installed;
}

}  // namespace

int main(int argc, char** argv) {
  std::string name = argc > 1 ? argv[1] : "test-peer";
#if FERRY_HAS_VERBS
  if (std::getenv(test::kSimVerbsEnv) != nullptr) test::use_simulated_verbs();
#endif
  ConnectorOptions options;
  options.name = name;
  Connector connector(options);

  std::unique_ptr<std::byte[]> passive_mem;
  std::size_t passive_size = 0;
  std::unique_ptr<test::Scattered> passive_sg;  // instead of passive_mem after *_sg
  Operation passive;
  std::unique_ptr<std::byte[]> active_mem;
  std::unique_ptr<test::Scattered> active_sg;
  Operation active;
  // Regions: one served, and attachments by region id.
  std::unique_ptr<std::byte[]> region_mem;
  Region region;
  std::map<std::string, Attachment> attachments;

  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    in >> cmd;
    try {
      if (cmd == "readable") {
        std::size_t size = 0;
        std::uint64_t seed = 0;
        in >> size >> seed;
        passive_mem = test::filled(size, std::byte{0});
        passive_size = size;
        if (seed != 0) test::fill_pattern(passive_mem.get(), size, seed);
        auto op = connector.create_readable({Descriptor(passive_mem.get(), size)});
        say("META " + op.metadata().to_json());
        passive = std::move(op);
        passive_sg.reset();
      } else if (cmd == "writable") {
        std::size_t size = 0;
        in >> size;
        passive_mem = test::filled(size, std::byte{0});
        passive_size = size;
        auto op = connector.create_writable({Descriptor(passive_mem.get(), size)});
        say("META " + op.metadata().to_json());
        passive = std::move(op);
        passive_sg.reset();
      } else if (cmd == "wait") {
        try {
          passive.wait_for_completion();
        } catch (const Error&) {
        }
        say(describe(passive));
      } else if (cmd == "status") {
        say("STATUS " + std::string(to_string(passive.status())));
      } else if (cmd == "check") {
        std::uint64_t seed = 0;
        in >> seed;
        if (passive_sg && !passive_sg->guards_intact()) {
          say("CHECK guards");
          continue;
        }
        long long bad = passive_sg ? passive_sg->mismatch(seed)
                                   : test::first_mismatch(passive_mem.get(), passive_size, seed);
        say(bad < 0 ? "CHECK ok" : "CHECK mismatch " + std::to_string(bad));
      } else if (cmd == "read" || cmd == "write" || cmd == "start_read") {
        std::uint64_t seed = 0;
        if (cmd != "start_read") in >> seed;
        std::string json;
        std::getline(in >> std::ws, json);
        RdmaMetadata meta = RdmaMetadata::from_json(json);
        std::size_t size = meta.total_size();
        active_mem = test::filled(size, std::byte{0});
        if (cmd == "write") {
          test::fill_pattern(active_mem.get(), size, seed);
          active = connector.begin_write({Descriptor(active_mem.get(), size)}, meta);
        } else {
          active = connector.begin_read(meta, {Descriptor(active_mem.get(), size)});
        }
        if (cmd == "start_read") {
          say("STARTED");
          continue;
        }
        try {
          active.wait_for_completion();
        } catch (const Error&) {
        }
        if (cmd == "read" && active.status() == OperationStatus::complete) {
          long long bad = test::first_mismatch(active_mem.get(), size, seed);
          if (bad >= 0) {
            say("DONE corrupt " + std::to_string(bad));
            continue;
          }
        }
        say(describe(active));
      } else if (cmd == "readable_at" || cmd == "writable_at") {
        std::string subject;
        std::size_t size = 0;
        std::uint64_t seed = 0;
        in >> subject >> size >> seed;
        passive_mem = test::filled(size, std::byte{0});
        passive_size = size;
        if (seed != 0) test::fill_pattern(passive_mem.get(), size, seed);
        OperationOptions o;
        o.subject = subject;
        if (cmd == "readable_at")
          passive = connector.create_readable({Descriptor(passive_mem.get(), size)}, o);
        else
          passive = connector.create_writable({Descriptor(passive_mem.get(), size)}, o);
        passive_sg.reset();
        say("READY");
      } else if (cmd == "read_at" || cmd == "write_at" || cmd == "start_read_at") {
        std::uint64_t seed = 0;
        std::size_t size = 0;
        std::string subject;
        if (cmd != "start_read_at") in >> seed;
        in >> size >> subject;
        active_mem = test::filled(size, std::byte{0});
        if (cmd == "write_at") {
          test::fill_pattern(active_mem.get(), size, seed);
          active = connector.begin_write({Descriptor(active_mem.get(), size)}, Subject(subject));
        } else {
          active = connector.begin_read(Subject(subject), {Descriptor(active_mem.get(), size)});
        }
        if (cmd == "start_read_at") {
          say("STARTED");
          continue;
        }
        try {
          active.wait_for_completion();
        } catch (const Error&) {
        }
        if (cmd == "read_at" && active.status() == OperationStatus::complete) {
          long long bad = test::first_mismatch(active_mem.get(), size, seed);
          if (bad >= 0) {
            say("DONE corrupt " + std::to_string(bad));
            continue;
          }
        }
        say(describe(active));
      } else if (cmd == "readable_sg" || cmd == "writable_sg") {
        std::uint64_t seed = 0;
        std::string cut;
        if (cmd == "readable_sg") in >> seed;
        in >> cut;
        auto mem = std::make_unique<test::Scattered>(test::parse_cut(cut), seed);
        Operation op;
        if (cmd == "readable_sg") {
          auto readable = connector.create_readable(mem->descriptors());
          say("META " + readable.metadata().to_json());
          op = std::move(readable);
        } else {
          auto writable = connector.create_writable(mem->descriptors());
          say("META " + writable.metadata().to_json());
          op = std::move(writable);
        }
        passive = std::move(op);  // the old operation ends before its memory goes
        passive_sg = std::move(mem);
        passive_mem.reset();
      } else if (cmd == "read_sg" || cmd == "write_sg") {
        std::uint64_t seed = 0;
        std::string cut;
        in >> seed >> cut;
        std::string json;
        std::getline(in >> std::ws, json);
        RdmaMetadata meta = RdmaMetadata::from_json(json);
        auto mem =
            std::make_unique<test::Scattered>(test::parse_cut(cut), cmd == "write_sg" ? seed : 0);
        Operation op;
        if (cmd == "write_sg")
          op = connector.begin_write(mem->descriptors(), meta);
        else
          op = connector.begin_read(meta, mem->descriptors());
        active = std::move(op);
        active_sg = std::move(mem);
        try {
          active.wait_for_completion();
        } catch (const Error&) {
        }
        if (cmd == "read_sg" && active.status() == OperationStatus::complete) {
          if (!active_sg->guards_intact()) {
            say("DONE corrupt guards");
            continue;
          }
          if (long long bad = active_sg->mismatch(seed); bad >= 0) {
            say("DONE corrupt " + std::to_string(bad));
            continue;
          }
        }
        say(describe(active));
      } else if (cmd == "method") {
        auto of = [](const Operation& op) {
          const std::string m = op ? op.method() : std::string();
          return m.empty() ? std::string("-") : m;
        };
        say("METHOD " + of(active) + " " + of(passive));
      } else if (cmd == "probe_vm") {
        long long pid = 0;
        std::string addr;
        std::size_t len = 0;
        in >> pid >> addr >> len;
        std::vector<char> seen(len);
        iovec local{seen.data(), len};
        iovec remote{reinterpret_cast<void*>(std::stoull(addr, nullptr, 16)), len};
        const ssize_t got = ::process_vm_readv(static_cast<pid_t>(pid), &local, 1, &remote, 1, 0);
        const char* err = got < 0 ? strerrorname_np(errno) : nullptr;
        say(got == static_cast<ssize_t>(len) ? std::string("PROBE ok")
            : got >= 0                       ? "PROBE short " + std::to_string(got)
                                             : std::string("PROBE ") + (err ? err : "?"));
      } else if (cmd == "refuse_pool") {
        std::string call;
        in >> call;
        long nr = call == "process_vm_readv"    ? SYS_process_vm_readv
                  : call == "process_vm_writev" ? SYS_process_vm_writev
                                                : -1;
        if (nr < 0) {
          say("ERROR unknown system call " + call);
          continue;
        }
        try {
          say("REFUSING " + std::to_string(refuse_on_pool_threads(nr)));
        } catch (const std::exception& e) {
          say(std::string("ERROR ") + e.what());
        }
      } else if (cmd == "region") {
        std::size_t size = 0;
        std::uint64_t seed = 0;
        in >> size >> seed;
        region_mem = test::filled(size, std::byte{0});
        test::fill_pattern(region_mem.get(), size, seed);
        RegionOptions ro;
        ro.access = RegionAccess::read_write;
        ro.block_size = size % 4096 == 0 ? 4096 : 0;
        region = connector.create_region({Descriptor(region_mem.get(), size)}, ro);
        say("META " + region.metadata().to_json());
      } else if (cmd == "region_event") {
        auto e = region.next_event(std::chrono::seconds(60));
        if (!e) {
          say("EVENT none");
          continue;
        }
        static const char* types[] = {"attached", "transfer", "detached", "ended"};
        const RegionRange r = e->ranges.empty() ? RegionRange{} : e->ranges.front();
        say(std::string("EVENT ") + types[static_cast<int>(e->type)] + " " +
            std::string(to_string(e->kind)) + " " + (e->tag.empty() ? "-" : e->tag) + " " +
            std::to_string(r.offset) + " " + std::to_string(r.length) + " " +
            std::string(to_string(e->status)));
      } else if (cmd == "region_check") {
        std::uint64_t seed = 0, offset = 0, len = 0;
        in >> seed >> offset >> len;
        long long bad = test::first_mismatch(region_mem.get() + offset, len, seed);
        say(bad < 0 ? "CHECK ok" : "CHECK mismatch " + std::to_string(bad));
      } else if (cmd == "region_read" || cmd == "region_write") {
        std::uint64_t seed = 0, offset = 0, len = 0;
        std::string tag, json;
        in >> seed >> offset >> len;
        if (cmd == "region_write") in >> tag;
        std::getline(in >> std::ws, json);
        RegionMetadata meta = RegionMetadata::from_json(json);
        auto it = attachments.find(meta.region_id);
        if (it == attachments.end())
          it = attachments.emplace(meta.region_id, connector.attach(meta)).first;
        active_mem = test::filled(len, std::byte{0});
        TransferOptions t;
        t.tag = tag;
        if (cmd == "region_write") {
          test::fill_pattern(active_mem.get(), len, seed);
          active = it->second.write({Descriptor(active_mem.get(), len)}, {{offset, len}}, t);
        } else {
          active = it->second.read({{offset, len}}, {Descriptor(active_mem.get(), len)});
        }
        try {
          active.wait_for_completion();
        } catch (const Error&) {
        }
        if (cmd == "region_read" && active.status() == OperationStatus::complete) {
          long long bad = test::first_mismatch(active_mem.get(), len, seed, offset);
          if (bad >= 0) {
            say("DONE corrupt " + std::to_string(bad));
            continue;
          }
        }
        say(describe(active));
      } else if (cmd == "quit") {
        return 0;
      } else {
        say("ERROR unknown command " + cmd);
      }
    } catch (const Error& e) {
      say(std::string("ERROR ") + e.what());
    }
  }
  return 0;
}
