// The verbs transport on a real RDMA device, through the system's libibverbs and librdmacm.
// It needs a device and an address of it (FERRY_RDMA_ADDR, e.g. the IPv4 address of a RoCE
// interface); without them every test here skips (label rdma). No machine these tests have
// run on so far has an RDMA NIC: the logic is tested on the simulated fabric
// (verbs_transport_test, verbs_test, the conformance suite).
#include <gtest/gtest.h>

#include <cstdlib>
#include <ostream>
#include <string>
#include <vector>

#include "tests/support/patterns.hpp"
#include "tests/transport/verbs/rig.hpp"

namespace ferry::transport {
// gtest prints a parameter by this, not as bytes.
inline void PrintTo(Access access, std::ostream* os) {
  *os << (access == Access::read ? "read" : "write");
}
}  // namespace ferry::transport

namespace ferry::transport::verbs {
namespace {

using namespace rig;

/// The address to listen on, or why these tests cannot run here.
std::string device_address(std::string& why) {
  if (auto e = VerbsTransport::unavailable(nullptr)) {
    why = e->message();
    return {};
  }
  const char* addr = std::getenv("FERRY_RDMA_ADDR");
  if (addr == nullptr || *addr == '\0') {
    why = "set FERRY_RDMA_ADDR to an address of an RDMA device to run these";
    return {};
  }
  return addr;
}

#define SKIP_WITHOUT_DEVICE(addr)                \
  std::string why_;                              \
  const std::string addr = device_address(why_); \
  if (addr.empty()) GTEST_SKIP() << "no RDMA device: " << why_

class RealDevice : public ::testing::TestWithParam<Access> {};

TEST_P(RealDevice, MovesBytesBetweenTwoTransports) {
  SKIP_WITHOUT_DEVICE(addr);
  Side owner("owner", nullptr, addr);
  Side active("active", nullptr, addr);
  const Access access = GetParam();
  for (std::size_t size : {std::size_t{1}, std::size_t{4096 + 1}, std::size_t{64} << 20}) {
    SCOPED_TRACE(size);
    std::vector<std::byte> theirs(size), ours(size);
    test::fill_pattern(access == Access::read ? theirs.data() : ours.data(), size, 9);
    Log ol, al;
    Offered s = expose(owner, access, theirs.data(), size, ol);
    auto t = start(active, s, ours.data(), size, al);
    expect_ok(al, "the transfer");
    expect_ok(ol, "the owner");
    EXPECT_EQ(test::first_mismatch(access == Access::read ? ours.data() : theirs.data(), size, 9),
              -1);
    active.call([&] { t.reset(); });
  }
}

INSTANTIATE_TEST_SUITE_P(Both, RealDevice, ::testing::Values(Access::read, Access::write),
                         [](const ::testing::TestParamInfo<Access>& p) {
                           return p.param == Access::read ? "Read" : "Write";
                         });

}  // namespace
}  // namespace ferry::transport::verbs
