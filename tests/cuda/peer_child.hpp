#pragma once

// The other process of the CUDA tests that need two: the test binary again, running a
// disabled test that calls serve_peer_commands(), which takes commands on stdin and answers on
// stdout; PeerChild starts it and speaks with it.

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <ferry/ferry.hpp>

#include <chrono>
#include <climits>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "tests/cuda/device_memory.hpp"
#include "tests/support/child_process.hpp"

namespace ferry::test {

inline Alloc alloc_named(const std::string& name) {
  if (name == "vmm") return Alloc::vmm;
  if (name == "vmm-no-export") return Alloc::vmm_no_export;
  return Alloc::legacy;
}

/// Commands, one per line; every answer starts with "IPC " (gtest writes to stdout too):
///   expose read|write DEVICE SIZE SEED [ALLOC]
///                         a readable filled with SEED, or a writable, in memory made for it
///                         (ALLOC: legacy, the default; vmm; vmm-no-export); answers
///                         "IPC META <json>", then "IPC END <status> <mismatch>" (first byte
///                         not of SEED's pattern, -1: none); or "IPC REFUSED <code> <message>"
///   share read|write SEED the same, in the memory held
///   begin read|write DEVICE SEED <json>  the active side on our metadata, same END answer
///   region DEVICE SIZE SEED WSEED        a read_write region over SIZE bytes filled with SEED
///                         (docs/regions.md); answers "IPC META <region json>", then, once a
///                         peer's write of the region completes (its event), "IPC END complete
///                         <mismatch>" (first byte not of WSEED's pattern, -1: none), or
///                         "IPC END <what ended it> -1"
///   hold DEVICE SIZE [ALLOC]             allocates SIZE bytes and keeps them; "IPC HELD"
///   free                                 frees them; "IPC FREED"
///   quit
/// DEVICE -1 is host memory.
inline void serve_peer_commands(const ConnectorOptions& options,
                                std::chrono::milliseconds wait = std::chrono::seconds(60)) {
  Connector us(options);
  std::unique_ptr<Memory> held;
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string command, kind;
    int device = 0;
    in >> command;
    if (command == "quit") break;
    if (command == "hold") {
      std::size_t size = 0;
      std::string how;
      in >> device >> size >> how;
      held = std::make_unique<Memory>(device, size, alloc_named(how));
      std::cout << "IPC HELD" << std::endl;
      continue;
    }
    if (command == "free") {
      held.reset();
      std::cout << "IPC FREED" << std::endl;
      continue;
    }
    if (command == "region") {
      std::size_t size = 0;
      std::uint64_t seed = 0, wseed = 0;
      in >> device >> size >> seed >> wseed;
      Memory memory(device, size);
      memory.fill(seed);
      RegionOptions ro;
      ro.access = RegionAccess::read_write;
      Region region;
      try {
        region = us.create_region({memory.descriptor()}, ro);
      } catch (const Error& e) {
        std::cout << "IPC REFUSED " << to_string(e.code()) << " " << e.message() << std::endl;
        continue;
      }
      std::cout << "IPC META " << region.metadata().to_json() << std::endl;
      std::string status = "timeout";
      long long mismatch = -1;
      const auto until = std::chrono::steady_clock::now() + wait;
      while (std::chrono::steady_clock::now() < until) {
        auto e = region.next_event(std::chrono::milliseconds(100));
        if (!e || e->type != RegionEvent::Type::transfer || e->kind != OperationKind::write)
          continue;
        status = e->error ? to_string(e->error->code()) : "complete";
        if (!e->error) mismatch = memory.mismatch(wseed);
        break;
      }
      std::cout << "IPC END " << status << " " << mismatch << std::endl;
      continue;
    }
    in >> kind;
    if (command != "share") in >> device;
    std::string status = "complete";
    long long mismatch = -1;
    if (command == "expose" || command == "share") {
      std::size_t size = 0;
      std::uint64_t seed = 0;
      std::string how;
      if (command == "expose") in >> size;
      in >> seed >> how;
      std::unique_ptr<Memory> made;
      if (command == "expose") made = std::make_unique<Memory>(device, size, alloc_named(how));
      Memory& memory = command == "expose" ? *made : *held;
      Operation* op = nullptr;
      ReadableOperation readable;
      WritableOperation writable;
      try {
        if (kind == "read") {
          memory.fill(seed);
          readable = us.create_readable({memory.descriptor()});
          op = &readable;
          std::cout << "IPC META " << readable.metadata().to_json() << std::endl;
        } else {
          writable = us.create_writable({memory.descriptor()});
          op = &writable;
          std::cout << "IPC META " << writable.metadata().to_json() << std::endl;
        }
      } catch (const Error& e) {
        std::cout << "IPC REFUSED " << to_string(e.code()) << " " << e.message() << std::endl;
        continue;
      }
      try {
        if (!op->wait_for_completion(wait)) status = "timeout";
      } catch (const Error& e) {
        status = std::string(to_string(e.code()));
      }
      if (kind == "write" && status == "complete") mismatch = memory.mismatch(seed);
    } else {
      std::uint64_t seed = 0;
      std::string json;
      in >> seed;
      std::getline(in >> std::ws, json);
      const RdmaMetadata remote = RdmaMetadata::from_json(json);
      Memory memory(device, remote.total_size());
      try {
        if (kind == "read") {
          auto read = us.begin_read(remote, {memory.descriptor()});
          if (!read.wait_for_completion(wait)) status = "timeout";
          mismatch = memory.mismatch(seed);
        } else {
          memory.fill(seed);
          auto write = us.begin_write({memory.descriptor()}, remote);
          if (!write.wait_for_completion(wait)) status = "timeout";
        }
      } catch (const Error& e) {
        status = std::string(to_string(e.code()));
      }
    }
    std::cout << "IPC END " << status << " " << mismatch << std::endl;
  }
}

/// The other process, running `test_name` of this binary (a disabled test that calls
/// serve_peer_commands) with `env` added to its environment.
class PeerChild {
 public:
  explicit PeerChild(const std::string& test_name, const std::vector<std::string>& env = {}) {
    char exe[PATH_MAX] = {};
    const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
    EXPECT_GT(n, 0);
    child_ = std::make_unique<ChildProcess>(
        std::vector<std::string>{exe, "--gtest_also_run_disabled_tests",
                                 "--gtest_filter=" + test_name},
        env);
  }
  /// Tells it to quit; expects a clean exit.
  void finish() {
    child_->send_line("quit");
    const int status = child_->wait();
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  }
  void send_line(const std::string& line) { child_->send_line(line); }
  /// Its next answer, without "IPC ".
  std::string answer(std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
    for (;;) {
      std::string line = child_->read_line(timeout);
      if (line.rfind("IPC ", 0) == 0) return line.substr(4);
    }
  }
  /// It exposes SIZE bytes of memory of `device` (-1: host); returns the metadata.
  RdmaMetadata exposes(const std::string& kind, int device, std::size_t size, std::uint64_t seed,
                       const std::string& how = "legacy") {
    send_line("expose " + kind + " " + std::to_string(device) + " " + std::to_string(size) + " " +
              std::to_string(seed) + " " + how);
    return metadata_answer();
  }
  /// It exposes the memory it holds.
  RdmaMetadata shares(const std::string& kind, std::uint64_t seed) {
    send_line("share " + kind + " " + std::to_string(seed));
    return metadata_answer();
  }
  /// It exposes a read_write region of SIZE bytes of `device` filled with SEED; returns its
  /// metadata (see "region" above).
  RegionMetadata region(int device, std::size_t size, std::uint64_t seed, std::uint64_t wseed) {
    send_line("region " + std::to_string(device) + " " + std::to_string(size) + " " +
              std::to_string(seed) + " " + std::to_string(wseed));
    const std::string meta = answer();
    EXPECT_EQ(meta.rfind("META ", 0), 0u) << meta;
    return RegionMetadata::from_json(meta.substr(5));
  }
  RdmaMetadata metadata_answer() {
    const std::string meta = answer();
    EXPECT_EQ(meta.rfind("META ", 0), 0u) << meta;
    return RdmaMetadata::from_json(meta.substr(5));
  }

 private:
  std::unique_ptr<ChildProcess> child_;
};

}  // namespace ferry::test
