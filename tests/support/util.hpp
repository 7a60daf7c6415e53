#pragma once

#include <gtest/gtest.h>

#include <string>

#include <ferry/connector.hpp>

namespace ferry::test {

inline ConnectorOptions named(std::string name) {
  ConnectorOptions o;
  o.name = std::move(name);
  return o;
}

/// Names a size-parameterized test "bytes_<n>".
inline std::string size_name(const ::testing::TestParamInfo<std::size_t>& param) {
  return "bytes_" + std::to_string(param.param);
}

}  // namespace ferry::test
