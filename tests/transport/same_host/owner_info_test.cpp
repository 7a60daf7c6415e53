// transport/same_host/owner_info.hpp: what a same-host endpoint says of its owner, and the
// abstract socket names.
#include <gtest/gtest.h>

#include <string>

#include <ferry/error.hpp>

#include "transport/same_host/owner_info.hpp"

namespace ferry::transport::same_host {
namespace {

OwnerInfo sample_info() {
  OwnerInfo info;
  info.scope = this_process();
  info.grants_fd = 9;
  info.grants_bytes = 4096;
  return info;
}

TEST(Info, RoundTripsAndRefusesWhatIsWrong) {
  const OwnerInfo info = sample_info();
  const OwnerInfo back = parse_info(to_info(info));
  EXPECT_EQ(back.scope.pid, info.scope.pid);
  EXPECT_EQ(back.scope.boot_id, info.scope.boot_id);
  EXPECT_EQ(back.scope.pid_ns, info.scope.pid_ns);
  EXPECT_EQ(back.scope.net_ns, info.scope.net_ns);
  EXPECT_NE(back.scope.net_ns, 0u);
  EXPECT_EQ(back.grants_fd, 9);
  for (const char* bad : {"", "[]", "{}", R"({"pid":1})", "not json",
                          R"({"pid":-4,"boot_id":"b","pid_ns":1,"grants":{"fd":3,"bytes":16}})",
                          R"({"pid":4,"boot_id":"","pid_ns":1,"grants":{"fd":3,"bytes":16}})",
                          R"({"pid":4,"boot_id":"b","pid_ns":1,"grants":{"fd":-1,"bytes":16}})",
                          R"({"pid":4,"boot_id":"b","pid_ns":1,"grants":{"fd":3,"bytes":0}})"}) {
    try {
      parse_info(bad);
      ADD_FAILURE() << "accepted: " << bad;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::InvalidMetadata) << bad;
      EXPECT_EQ(e.field(), "endpoints");
    }
  }
}

TEST(Address, OnlyAnAbstractNameOfPlainCharacters) {
  sockaddr_un a{};
  socklen_t len = 0;
  EXPECT_TRUE(socket_address("@ferry-cma-0123456789abcdef", a, len));
  EXPECT_EQ(a.sun_path[0], '\0');
  for (const char* bad : {"", "@", "ferry", "/tmp/sock", "@a b", "@a/b", "127.0.0.1:80"})
    EXPECT_FALSE(socket_address(bad, a, len)) << bad;
  EXPECT_FALSE(socket_address("@" + std::string(200, 'a'), a, len));
}

TEST(Info, SaysNothingTheProofNeeds) {
  // The probe and its nonce travel on the owner's socket, to whoever connected to it; metadata
  // that anyone may have seen holds neither.
  const std::string text = to_info(sample_info());
  EXPECT_EQ(text.find("probe"), std::string::npos) << text;
  EXPECT_EQ(text.find("nonce"), std::string::npos) << text;
}

TEST(Info, AnOwnerInAnotherNetworkNamespaceIsOutOfReach) {
  OwnerInfo owner = sample_info();
  EXPECT_FALSE(scope_mismatch(owner.scope).has_value());
  owner.scope.net_ns += 1;
  const std::optional<Error> why = scope_mismatch(owner.scope);
  ASSERT_TRUE(why.has_value()) << "an owner in another network namespace was taken as reachable";
  EXPECT_EQ(why->code(), ErrorCode::Unsupported);
  EXPECT_NE(why->message().find("network namespace"), std::string::npos) << why->message();
  owner.scope.net_ns = 0;  // metadata that does not say: the connect decides
  EXPECT_FALSE(scope_mismatch(owner.scope).has_value());
}

}  // namespace
}  // namespace ferry::transport::same_host
