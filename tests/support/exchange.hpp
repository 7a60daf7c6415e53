#pragma once

// One transfer between this process and a child peer (tests/support/peer_main.cpp) in every
// pairing, with both sides cut into uneven pieces, the bytes and the guards checked, and the
// method both sides name: shared by the method tests (cma_test, verbs_test).

#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <ferry/ferry.hpp>

#include "tests/support/child_process.hpp"
#include "tests/support/patterns.hpp"
#include "tests/support/scattered.hpp"
#include "tests/support/util.hpp"

namespace ferry::test {

/// How long one step of an exchange may take (a 256 MiB transfer under a sanitizer, say).
inline constexpr std::chrono::seconds kExchangeWait{120};

inline std::string expect_prefix(const std::string& line, const std::string& prefix) {
  EXPECT_EQ(line.rfind(prefix, 0), 0u) << line;
  return line.size() > prefix.size() ? line.substr(prefix.size()) : std::string();
}

/// The child's "method" answer: (its last active operation's method, its passive one's).
inline std::pair<std::string, std::string> child_methods(ChildProcess& child) {
  child.send_line("method");
  std::istringstream in(expect_prefix(child.read_line(), "METHOD "));
  std::pair<std::string, std::string> out;
  in >> out.first >> out.second;
  return out;
}

/// The passive side's cut (3 to 7 uneven pieces) and a different one for the active side.
inline std::vector<std::size_t> passive_cut(std::size_t size, std::size_t round) {
  static const std::vector<std::vector<unsigned>> weights = {
      {3, 1, 7}, {5, 2, 9, 1}, {3, 1, 7, 2, 5}, {2, 9, 1, 4, 6, 3}, {1, 8, 3, 5, 2, 7, 4}};
  return uneven_cut(size, weights[round % weights.size()]);
}
inline std::vector<std::size_t> active_cut(std::size_t size, std::size_t round) {
  static const std::vector<std::vector<unsigned>> weights = {{5, 2}, {1, 4, 3}, {6, 1, 1, 2}};
  return uneven_cut(size, weights[round % weights.size()]);
}

/// One transfer of `size` bytes between us and the child, the passive side and direction
/// given by `side`, both sides in pieces; checks the bytes (and the guards around the pieces)
/// and that both sides name `method` as the one that moved them.
inline void exchange(Connector& us, ChildProcess& child, Side side, std::size_t size,
                     std::size_t round, const std::string& method) {
  SCOPED_TRACE(test::side_name(side) + ", " + std::to_string(size) + " bytes");
  const std::uint64_t seed = 1000 + round;
  const auto pcut = passive_cut(size, round);
  const auto acut = active_cut(size, round);
  switch (side) {
    case Side::WeRead: {
      child.send_line("readable_sg " + std::to_string(seed) + " " + test::cut_text(pcut));
      auto meta = RdmaMetadata::from_json(expect_prefix(child.read_line(), "META "));
      ASSERT_EQ(meta.descriptors.size(), pcut.size());
      Scattered dst(acut, 0);
      auto read = us.begin_read(meta, dst.descriptors());
      ASSERT_TRUE(read.wait_for_completion(kExchangeWait));
      EXPECT_EQ(read.method(), method);
      EXPECT_EQ(dst.mismatch(seed), -1);
      EXPECT_TRUE(dst.guards_intact());
      child.send_line("wait");
      EXPECT_EQ(child.read_line(kExchangeWait), "DONE complete");
      EXPECT_EQ(child_methods(child).second, method);
      break;
    }
    case Side::WeWrite: {
      child.send_line("writable_sg " + test::cut_text(pcut));
      auto meta = RdmaMetadata::from_json(expect_prefix(child.read_line(), "META "));
      ASSERT_EQ(meta.descriptors.size(), pcut.size());
      Scattered src(acut, seed);
      auto write = us.begin_write(src.descriptors(), meta);
      ASSERT_TRUE(write.wait_for_completion(kExchangeWait));
      EXPECT_EQ(write.method(), method);
      child.send_line("wait");
      EXPECT_EQ(child.read_line(kExchangeWait), "DONE complete");
      child.send_line("check " + std::to_string(seed));
      EXPECT_EQ(child.read_line(kExchangeWait), "CHECK ok");
      EXPECT_EQ(child_methods(child).second, method);
      break;
    }
    case Side::OurReadable: {
      Scattered src(pcut, seed);
      auto readable = us.create_readable(src.descriptors());
      child.send_line("read_sg " + std::to_string(seed) + " " + test::cut_text(acut) + " " +
                      readable.metadata().to_json());
      EXPECT_EQ(child.read_line(kExchangeWait), "DONE complete");
      ASSERT_TRUE(readable.wait_for_completion(kExchangeWait));
      EXPECT_EQ(readable.method(), method);
      EXPECT_EQ(child_methods(child).first, method);
      break;
    }
    case Side::OurWritable: {
      Scattered dst(pcut, 0);
      auto writable = us.create_writable(dst.descriptors());
      child.send_line("write_sg " + std::to_string(seed) + " " + test::cut_text(acut) + " " +
                      writable.metadata().to_json());
      EXPECT_EQ(child.read_line(kExchangeWait), "DONE complete");
      ASSERT_TRUE(writable.wait_for_completion(kExchangeWait));
      EXPECT_EQ(writable.method(), method);
      EXPECT_EQ(dst.mismatch(seed), -1);
      EXPECT_TRUE(dst.guards_intact());
      EXPECT_EQ(child_methods(child).first, method);
      break;
    }
  }
}

inline void quit(ChildProcess& child) {
  child.send_line("quit");
  const int status = child.wait();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
}

/// The owner `child` (named `owner_name`) exposes `size` patterned bytes; we read them by
/// `method`, and once bytes arrive the child is killed: the read must end with PeerLost naming
/// the owner, in bounded time (peer_timeout, 2 s, and some slack for a loaded machine).
inline void expect_owner_killed_mid_read(Connector& us, ChildProcess& child,
                                         const std::string& owner_name, std::size_t size,
                                         const std::string& method) {
  using namespace std::chrono_literals;
  child.send_line("readable " + std::to_string(size) + " 77");
  auto meta = RdmaMetadata::from_json(expect_prefix(child.read_line(60s), "META "));
  auto dst = test::filled(size, std::byte{0});
  auto read = us.begin_read(meta, {Descriptor(dst.get(), size)});
  ASSERT_TRUE(eventually(
      [&] { return first_mismatch(peek(dst.get(), 64 << 10).data(), 64 << 10, 77) < 0; }, 30s))
      << "no byte arrived";
  ASSERT_EQ(read.status(), OperationStatus::in_progress) << "finished before the kill";
  EXPECT_EQ(read.method(), method);
  child.kill(SIGKILL);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(ended_with(read, 10s), ErrorCode::PeerLost);
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_LT(took, 3500ms) << std::chrono::duration_cast<std::chrono::milliseconds>(took).count()
                          << " ms";
  ASSERT_TRUE(read.error());
  EXPECT_NE(read.error()->message().find(owner_name), std::string::npos) << read.error()->message();
}

}  // namespace ferry::test
