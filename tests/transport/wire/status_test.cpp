// The wire's status table: fixed numbers, every ErrorCode there and back.
#include <gtest/gtest.h>

#include <set>

#include "transport/wire/status.hpp"

namespace ferry::transport::wire {
namespace {

constexpr ErrorCode kEvery[] = {
    ErrorCode::InvalidArgument, ErrorCode::InvalidMetadata, ErrorCode::KindMismatch,
    ErrorCode::SizeMismatch,    ErrorCode::NoCommonMethod,  ErrorCode::AccessDenied,
    ErrorCode::Timeout,         ErrorCode::Cancelled,       ErrorCode::PeerLost,
    ErrorCode::ProtocolError,   ErrorCode::WrongThread,     ErrorCode::InvalidState,
    ErrorCode::Unsupported,     ErrorCode::SideChannel,     ErrorCode::Internal,
};

TEST(WireStatus, EveryCodeHasItsOwnNumberAndComesBack) {
  std::set<std::uint32_t> seen;
  for (ErrorCode c : kEvery) {
    const std::uint32_t w = to_wire(c);
    EXPECT_NE(w, 0u) << to_string(c) << " would read as success";
    EXPECT_TRUE(seen.insert(w).second) << to_string(c) << " shares its number";
    EXPECT_EQ(from_wire(w), c) << to_string(c);
  }
}

TEST(WireStatus, TheNumbersAreTheProtocols) {
  // docs/protocol.md: peers of other versions read these numbers.
  EXPECT_EQ(to_wire(ErrorCode::AccessDenied), 6u);
  EXPECT_EQ(to_wire(ErrorCode::Cancelled), 8u);
  EXPECT_EQ(to_wire(ErrorCode::PeerLost), 9u);
  EXPECT_EQ(to_wire(ErrorCode::ProtocolError), 10u);
  EXPECT_EQ(to_wire(ErrorCode::Internal), 15u);
}

TEST(WireStatus, SuccessOrAnUnknownNumberFromAPeerIsAProtocolError) {
  EXPECT_EQ(from_wire(0), ErrorCode::ProtocolError);
  EXPECT_EQ(from_wire(16), ErrorCode::ProtocolError);
  EXPECT_EQ(from_wire(0xffffffffu), ErrorCode::ProtocolError);
}

}  // namespace
}  // namespace ferry::transport::wire
