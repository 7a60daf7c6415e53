#include "transport/same_host/owner_info.hpp"

#include <cctype>
#include <cstddef>
#include <cstring>

#include <nlohmann/json.hpp>

#include <ferry/error.hpp>

namespace ferry::transport::same_host {

std::string to_info(const OwnerInfo& info) {
  nlohmann::json j;
  j["pid"] = info.scope.pid;
  j["boot_id"] = info.scope.boot_id;
  j["pid_ns"] = info.scope.pid_ns;
  j["net_ns"] = info.scope.net_ns;
  j["grants"] = {{"fd", info.grants_fd}, {"bytes", info.grants_bytes}};
  return j.dump();
}

OwnerInfo parse_info(const std::string& text) {
  auto bad = [](const std::string& why) {
    return Error(ErrorCode::InvalidMetadata, "same-host endpoint info: " + why, "endpoints");
  };
  nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (!j.is_object()) throw bad("not a JSON object");
  OwnerInfo info;
  try {
    info.scope.pid = j.at("pid").get<std::int64_t>();
    info.scope.boot_id = j.at("boot_id").get<std::string>();
    info.scope.pid_ns = j.at("pid_ns").get<std::uint64_t>();
    // Optional: metadata of a ferry that did not send it reaches the socket or fails there.
    if (j.contains("net_ns")) info.scope.net_ns = j.at("net_ns").get<std::uint64_t>();
    info.grants_fd = j.at("grants").at("fd").get<int>();
    info.grants_bytes = j.at("grants").at("bytes").get<std::uint64_t>();
  } catch (const nlohmann::json::exception& e) {
    throw bad(e.what());
  }
  if (info.scope.pid <= 0 || info.scope.pid > (1 << 22)) throw bad("pid out of range");
  if (info.scope.boot_id.empty() || info.scope.boot_id.size() > 64) throw bad("bad boot_id");
  if (info.grants_fd < 0 || info.grants_bytes == 0 || info.grants_bytes > (64u << 20))
    throw bad("bad grant table");
  return info;
}

std::optional<Error> scope_mismatch(const ProcessScope& owner) {
  const ProcessScope self = this_process();
  if (owner.boot_id != self.boot_id)
    return Error(ErrorCode::Unsupported, "the peer runs on another host (boot id differs)");
  if (owner.pid_ns != self.pid_ns)
    return Error(ErrorCode::Unsupported, "the peer runs in another PID namespace");
  if (owner.net_ns != 0 && self.net_ns != 0 && owner.net_ns != self.net_ns)
    return Error(ErrorCode::Unsupported,
                 "the peer runs in another network namespace (its abstract socket is not "
                 "reachable from this one)");
  return std::nullopt;
}

OwnerInfo parse_endpoint(const Endpoint& endpoint) {
  sockaddr_un addr{};
  socklen_t len = 0;
  if (!socket_address(endpoint.address, addr, len))
    throw Error(
        ErrorCode::InvalidMetadata,
        endpoint.method + " endpoint '" + endpoint.address + "' is not an abstract socket name",
        "endpoints");
  return parse_info(endpoint.info);
}

bool socket_address(const std::string& address, sockaddr_un& out, socklen_t& len) {
  if (address.size() < 2 || address.front() != '@' || address.size() > sizeof out.sun_path)
    return false;
  for (char c : address.substr(1))
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_' && c != '.')
      return false;
  out = {};
  out.sun_family = AF_UNIX;
  // An abstract name: a leading NUL, then the name, not NUL-terminated.
  std::memcpy(out.sun_path + 1, address.data() + 1, address.size() - 1);
  len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + address.size());
  return true;
}

}  // namespace ferry::transport::same_host
