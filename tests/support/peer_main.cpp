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
//   quit                  -> (exits 0)
//
// The NATS side channel comes from the environment (FERRY_NATS_URL).
//
// A transfer whose bytes do not verify answers "DONE corrupt <offset>".
#include <cstdio>
#include <cstring>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <ferry/ferry.hpp>

#include "tests/support/patterns.hpp"

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

// A buffer that is not filled byte by byte: large kill-test buffers are only touched once.
std::unique_ptr<std::byte[]> make_buffer(std::size_t size) {
  auto buf = std::make_unique<std::byte[]>(size);
  std::memset(buf.get(), 0, size);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  std::string name = argc > 1 ? argv[1] : "test-peer";
  ConnectorOptions options;
  options.name = name;
  Connector connector(options);

  std::unique_ptr<std::byte[]> passive_mem;
  std::size_t passive_size = 0;
  Operation passive;
  std::unique_ptr<std::byte[]> active_mem;
  Operation active;

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
        passive_mem = make_buffer(size);
        passive_size = size;
        if (seed != 0) test::fill_pattern(passive_mem.get(), size, seed);
        auto op = connector.create_readable({Descriptor(passive_mem.get(), size)});
        say("META " + op.metadata().to_json());
        passive = std::move(op);
      } else if (cmd == "writable") {
        std::size_t size = 0;
        in >> size;
        passive_mem = make_buffer(size);
        passive_size = size;
        auto op = connector.create_writable({Descriptor(passive_mem.get(), size)});
        say("META " + op.metadata().to_json());
        passive = std::move(op);
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
        long long bad = test::first_mismatch(passive_mem.get(), passive_size, seed);
        say(bad < 0 ? "CHECK ok" : "CHECK mismatch " + std::to_string(bad));
      } else if (cmd == "read" || cmd == "write" || cmd == "start_read") {
        std::uint64_t seed = 0;
        if (cmd != "start_read") in >> seed;
        std::string json;
        std::getline(in >> std::ws, json);
        RdmaMetadata meta = RdmaMetadata::from_json(json);
        std::size_t size = meta.total_size();
        active_mem = make_buffer(size);
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
        passive_mem = make_buffer(size);
        passive_size = size;
        if (seed != 0) test::fill_pattern(passive_mem.get(), size, seed);
        OperationOptions o;
        o.subject = subject;
        if (cmd == "readable_at")
          passive = connector.create_readable({Descriptor(passive_mem.get(), size)}, o);
        else
          passive = connector.create_writable({Descriptor(passive_mem.get(), size)}, o);
        say("READY");
      } else if (cmd == "read_at" || cmd == "write_at" || cmd == "start_read_at") {
        std::uint64_t seed = 0;
        std::size_t size = 0;
        std::string subject;
        if (cmd != "start_read_at") in >> seed;
        in >> size >> subject;
        active_mem = make_buffer(size);
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
