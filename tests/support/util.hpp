#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>

#include <ferry/connector.hpp>
#include <ferry/operation.hpp>

namespace ferry::test {

/// Expects `call` to throw Error with `code`, its text naming `point`.
inline void expect_error(const std::function<void()>& call, ErrorCode code,
                         const std::string& point) {
  try {
    call();
    ADD_FAILURE() << "no error; expected " << to_string(code);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(point), std::string::npos) << e.what();
  }
}

inline ConnectorOptions named(std::string name) {
  ConnectorOptions o;
  o.name = std::move(name);
  return o;
}

/// The same, restricted to tcp: for tests of the tcp transport itself, or of SDK behaviour
/// that needs tcp's pace (a transfer slowed down by tiny chunks).
/// Operations of `c` completed by `method`, as its stats count them (both sides).
inline std::uint64_t operations_by(const Connector& c, const std::string& method) {
  for (const MethodStats& m : c.stats().methods)
    if (m.method == method) return m.complete.operations;
  return 0;
}

inline ConnectorOptions tcp_only(std::string name) {
  ConnectorOptions o = named(std::move(name));
  o.transports = {"tcp"};
  return o;
}

/// Names a size-parameterized test "bytes_<n>".
inline std::string size_name(const ::testing::TestParamInfo<std::size_t>& param) {
  return "bytes_" + std::to_string(param.param);
}

/// Waits for `op` to end with an error and returns its code; fails the test (and returns
/// Internal) if it completes or does not end within `limit`.
inline ErrorCode ended_with(const Operation& op,
                            std::chrono::seconds limit = std::chrono::seconds(30)) {
  try {
    if (!op.wait_for_completion(limit)) {
      ADD_FAILURE() << "did not end in time";
      return ErrorCode::Internal;
    }
    ADD_FAILURE() << "completed";
  } catch (const Error& e) {
    return e.code();
  }
  return ErrorCode::Internal;
}

/// Checks `done` every millisecond for at most `limit`: for states ferry has no event for
/// (a peer's progress seen from outside). Tests only.
template <class F>
bool eventually(F done, std::chrono::milliseconds limit = std::chrono::seconds(10)) {
  auto until = std::chrono::steady_clock::now() + limit;
  while (!done()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

/// Options that serve (passive) at `subject`, with a deadline when `timeout` is not zero.
inline OperationOptions at(std::string subject,
                           std::chrono::milliseconds timeout = std::chrono::milliseconds(0)) {
  OperationOptions o;
  o.subject = std::move(subject);
  o.timeout = timeout;
  return o;
}

/// Which operation this process owns in a cross-process test; the child owns the other side.
enum class Side { OurReadable, OurWritable, WeRead, WeWrite };

inline std::string side_name(Side side) {
  switch (side) {
    case Side::OurReadable:
      return "ChildReadsOurReadable";
    case Side::OurWritable:
      return "ChildWritesOurWritable";
    case Side::WeRead:
      return "WeReadChildReadable";
    case Side::WeWrite:
      return "WeWriteChildWritable";
  }
  return "?";
}

}  // namespace ferry::test
