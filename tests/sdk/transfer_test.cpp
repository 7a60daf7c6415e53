// Transfers between two connectors in one process, over TCP on loopback.
#include <gtest/gtest.h>

#include <ferry/ferry.hpp>

#include <atomic>
#include <vector>

#include "tests/support/patterns.hpp"
#include "tests/support/util.hpp"

namespace ferry {
namespace {

using test::buffer;
using test::first_mismatch;
using test::patterned;

constexpr auto kWait = std::chrono::seconds(60);

class TransferTest : public ::testing::TestWithParam<std::size_t> {
 protected:
  Connector owner_{test::named("owner")};
  Connector peer_{test::named("peer")};
};

TEST_P(TransferTest, ReadableToRead) {
  const std::size_t size = GetParam();
  auto src = patterned(size, 1);
  auto dst = buffer(size);
  auto readable = owner_.create_readable({Descriptor(src.data(), size)});
  EXPECT_EQ(readable.status(), OperationStatus::initialized);
  auto read = peer_.begin_read(readable.metadata(), {Descriptor(dst.data(), size)});
  ASSERT_TRUE(read.wait_for_completion(kWait));
  ASSERT_TRUE(readable.wait_for_completion(kWait));
  EXPECT_EQ(read.status(), OperationStatus::complete);
  EXPECT_EQ(readable.status(), OperationStatus::complete);
  EXPECT_EQ(first_mismatch(dst.data(), size, 1), -1);
}

TEST_P(TransferTest, WritableToWrite) {
  const std::size_t size = GetParam();
  auto src = patterned(size, 2);
  auto dst = buffer(size);
  auto writable = owner_.create_writable({Descriptor(dst.data(), size)});
  auto write = peer_.begin_write({Descriptor(src.data(), size)}, writable.metadata());
  ASSERT_TRUE(write.wait_for_completion(kWait));
  ASSERT_TRUE(writable.wait_for_completion(kWait));
  EXPECT_EQ(first_mismatch(dst.data(), size, 2), -1);
}

INSTANTIATE_TEST_SUITE_P(Sizes, TransferTest, ::testing::Values(1, 4096, 1u << 20, 64u << 20),
                         test::size_name);

}  // namespace
}  // namespace ferry
