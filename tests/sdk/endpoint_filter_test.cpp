// sdk/src/endpoint_filter.hpp: ConnectorOptions::endpoint_allow.
#include "sdk/src/endpoint_filter.hpp"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include <ferry/error.hpp>

namespace ferry::detail {
namespace {

TEST(EndpointFilter, AnEmptyFilterAllowsEverything) {
  EndpointFilter f;
  EXPECT_TRUE(f.empty());
  EXPECT_TRUE(f.allows("10.0.0.1:5"));
  EXPECT_TRUE(f.allows("[::1]:5"));
  EXPECT_TRUE(f.allows("fake:3"));
  EXPECT_TRUE(f.allows("not an address"));
  EXPECT_TRUE(EndpointFilter(std::vector<std::string>{}).empty());
}

TEST(EndpointFilter, IPv4Networks) {
  EndpointFilter f({"10.0.0.0/8", "192.168.1.128/25"});
  EXPECT_FALSE(f.empty());
  EXPECT_TRUE(f.allows("10.0.0.1:4222"));
  EXPECT_TRUE(f.allows("10.255.255.255:1"));
  EXPECT_TRUE(f.allows("10.1.2.3"));  // a bare address
  EXPECT_FALSE(f.allows("11.0.0.1:1"));
  EXPECT_FALSE(f.allows("9.255.255.255:1"));
  // A prefix that is not a whole number of bytes.
  EXPECT_TRUE(f.allows("192.168.1.128:1"));
  EXPECT_TRUE(f.allows("192.168.1.255:1"));
  EXPECT_FALSE(f.allows("192.168.1.127:1"));
  EXPECT_FALSE(f.allows("192.168.2.200:1"));
}

TEST(EndpointFilter, AnAddressWithoutPrefixIsOneHost) {
  EndpointFilter f({"127.0.0.1"});
  EXPECT_TRUE(f.allows("127.0.0.1:80"));
  EXPECT_FALSE(f.allows("127.0.0.2:80"));
}

TEST(EndpointFilter, PrefixZeroAllowsTheWholeFamilyOnly) {
  EndpointFilter v4({"0.0.0.0/0"});
  EXPECT_TRUE(v4.allows("1.2.3.4:5"));
  EXPECT_TRUE(v4.allows("255.255.255.255:5"));
  EXPECT_FALSE(v4.allows("[::1]:5"));
  EndpointFilter v6({"::/0"});
  EXPECT_TRUE(v6.allows("[2001:db8::1]:5"));
  EXPECT_FALSE(v6.allows("1.2.3.4:5"));
}

TEST(EndpointFilter, IPv6NetworksBracketedOrBare) {
  EndpointFilter f({"::1/128", "fe80::/10", "2001:db8:abcd::/48"});
  EXPECT_TRUE(f.allows("[::1]:4222"));
  EXPECT_TRUE(f.allows("::1"));
  EXPECT_TRUE(f.allows("[::1]"));
  EXPECT_FALSE(f.allows("[::2]:4222"));
  EXPECT_TRUE(f.allows("[fe80::1]:1"));
  EXPECT_TRUE(f.allows("[febf:ffff::1]:1"));
  EXPECT_FALSE(f.allows("[fec0::1]:1"));
  EXPECT_TRUE(f.allows("[2001:db8:abcd:12::5]:9"));
  EXPECT_FALSE(f.allows("[2001:db8:abce::5]:9"));
}

TEST(EndpointFilter, FamiliesDoNotMix) {
  EndpointFilter v4({"127.0.0.0/8"});
  EXPECT_FALSE(v4.allows("[::1]:5"));
  // An IPv4-mapped IPv6 address is an IPv6 address here: refused by an IPv4 network.
  EXPECT_FALSE(v4.allows("[::ffff:127.0.0.1]:5"));
  EndpointFilter v6({"::1/128"});
  EXPECT_FALSE(v6.allows("127.0.0.1:5"));
}

TEST(EndpointFilter, WhatIsNoIpIsRefusedByAFilter) {
  EndpointFilter f({"0.0.0.0/0", "::/0"});
  EXPECT_FALSE(f.allows("localhost:80"));
  EXPECT_FALSE(f.allows("fake:3"));
  EXPECT_FALSE(f.allows(""));
  EXPECT_FALSE(f.allows("[::1"));  // no closing bracket
  EXPECT_FALSE(f.allows("1.2.3:80"));
  EXPECT_FALSE(f.allows("1.2.3.4.5:80"));
}

void expect_refused(const std::string& cidr, const std::string& says) {
  try {
    EndpointFilter f({cidr});
    ADD_FAILURE() << "'" << cidr << "' was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidArgument) << e.what();
    EXPECT_NE(e.message().find("'" + cidr + "'"), std::string::npos) << e.what();
    EXPECT_NE(e.message().find(says), std::string::npos) << e.what();
  }
}

TEST(EndpointFilter, BadCidrsAreInvalidArguments) {
  for (const char* cidr : {"", "10.0.0", "10.0.0.0.0/8", "foo/8", "/8", "[::1]/128", "[::1]",
                           "10.0.0.0 /8", "::1::2/128"})
    expect_refused(cidr, "is not a CIDR");
  for (const char* cidr : {"10.0.0.0/33", "10.0.0.0/-1", "10.0.0.0/", "10.0.0.0/8x", "::1/129",
                           "10.0.0.0/abc", "::/", "1.2.3.4/32/1"})
    expect_refused(cidr, "bad prefix length");
}

TEST(EndpointFilter, OneBadCidrAmongGoodOnesRefusesTheList) {
  try {
    EndpointFilter f({"10.0.0.0/8", "nonsense", "::1/128"});
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
    EXPECT_NE(e.message().find("'nonsense'"), std::string::npos) << e.what();
  }
}

// A filter holds networks, not ports: a CIDR written with a port is refused, not read
// with the port silently dropped.
TEST(EndpointFilter, ACidrWithAPortIsRefused) {
  expect_refused("10.0.0.1:80/32", "is not a CIDR");
  expect_refused("10.0.0.1:80", "is not a CIDR");
}

}  // namespace
}  // namespace ferry::detail

namespace ferry::detail {
namespace {

// cma's endpoints are local sockets of this host ("@name"): a list lets them in exactly when
// it lets in this host's loopback.
TEST(EndpointFilter, ALocalSocketIsAllowedWhereLoopbackIs) {
  EXPECT_TRUE(EndpointFilter(std::vector<std::string>{}).allows("@ferry-cma-0123456789abcdef"));
  EXPECT_TRUE(EndpointFilter({"127.0.0.0/8"}).allows("@ferry-cma-0123456789abcdef"));
  EXPECT_TRUE(EndpointFilter({"::1/128"}).allows("@ferry-cma-0123456789abcdef"));
  EXPECT_FALSE(EndpointFilter({"10.0.0.0/8"}).allows("@ferry-cma-0123456789abcdef"));
  EXPECT_FALSE(EndpointFilter({"10.0.0.0/8"}).allows("fake:1"));
}

}  // namespace
}  // namespace ferry::detail
