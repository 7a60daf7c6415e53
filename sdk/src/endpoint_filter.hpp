#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace ferry::detail {

/// ConnectorOptions::endpoint_allow: the networks (CIDRs) a peer's endpoint address must lie
/// in. An empty filter allows everything.
class EndpointFilter {
 public:
  EndpointFilter() = default;
  /// Throws Error(InvalidArgument) naming a CIDR it cannot parse.
  explicit EndpointFilter(const std::vector<std::string>& cidrs);

  bool empty() const noexcept { return nets_.empty(); }
  /// Whether `address` ("1.2.3.4:5", "[::1]:5", or a bare IP) lies in an allowed network.
  /// A local socket address ("@name", cma's) is allowed when the loopback address is.
  /// Any other address that is no IP at all is allowed only by an empty filter.
  bool allows(const std::string& address) const;

 private:
  struct Net {
    bool v6 = false;
    std::array<std::uint8_t, 16> addr{};
    int prefix = 0;
  };
  std::vector<Net> nets_;
};

}  // namespace ferry::detail
