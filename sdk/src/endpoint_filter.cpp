#include "sdk/src/endpoint_filter.hpp"

#include <arpa/inet.h>

#include <cstdlib>

#include <ferry/error.hpp>

namespace ferry::detail {

namespace {

// The IP of "1.2.3.4", "1.2.3.4:5", "::1", "[::1]:5", as 16 bytes (v4 in the first 4).
bool parse_ip(std::string text, bool& v6, std::array<std::uint8_t, 16>& out) {
  if (!text.empty() && text.front() == '[') {
    auto close = text.find(']');
    if (close == std::string::npos) return false;
    text = text.substr(1, close - 1);
  } else if (text.find(':') != text.rfind(':')) {
    // Several colons and no brackets: a bare IPv6 address.
  } else if (auto colon = text.find(':'); colon != std::string::npos) {
    text = text.substr(0, colon);
  }
  out = {};
  if (inet_pton(AF_INET, text.c_str(), out.data()) == 1) {
    v6 = false;
    return true;
  }
  if (inet_pton(AF_INET6, text.c_str(), out.data()) == 1) {
    v6 = true;
    return true;
  }
  return false;
}

}  // namespace

EndpointFilter::EndpointFilter(const std::vector<std::string>& cidrs) {
  for (const std::string& cidr : cidrs) {
    Net net;
    auto slash = cidr.find('/');
    std::string ip = cidr.substr(0, slash);
    // A network has no port: "10.0.0.1:80/32" would be parsed as 10.0.0.1, port dropped.
    if (!parse_ip(ip, net.v6, net.addr) || ip.find('[') != std::string::npos ||
        (!net.v6 && ip.find(':') != std::string::npos))
      throw Error(ErrorCode::InvalidArgument,
                  "endpoint_allow: '" + cidr + "' is not a CIDR such as 10.0.0.0/8 or ::1/128");
    const int max = net.v6 ? 128 : 32;
    net.prefix = max;
    if (slash != std::string::npos) {
      const std::string bits = cidr.substr(slash + 1);
      char* end = nullptr;
      long n = std::strtol(bits.c_str(), &end, 10);
      if (bits.empty() || *end != '\0' || n < 0 || n > max)
        throw Error(ErrorCode::InvalidArgument,
                    "endpoint_allow: '" + cidr + "' has a bad prefix length");
      net.prefix = static_cast<int>(n);
    }
    nets_.push_back(net);
  }
}

bool EndpointFilter::allows(const std::string& address) const {
  if (nets_.empty()) return true;
  // A local socket of this host (cma's "@name"): as far as the list trusts this host's
  // loopback.
  if (!address.empty() && address.front() == '@') return allows("127.0.0.1") || allows("::1");
  bool v6 = false;
  std::array<std::uint8_t, 16> ip{};
  if (!parse_ip(address, v6, ip)) return false;
  for (const Net& net : nets_) {
    if (net.v6 != v6) continue;
    int bits = net.prefix;
    bool match = true;
    for (std::size_t i = 0; bits > 0 && match; ++i, bits -= 8) {
      const std::uint8_t mask =
          bits >= 8 ? std::uint8_t{0xff} : static_cast<std::uint8_t>(0xff << (8 - bits));
      match = (ip[i] & mask) == (net.addr[i] & mask);
    }
    if (match) return true;
  }
  return false;
}

}  // namespace ferry::detail
