#pragma once

#include <sys/socket.h>
#include <sys/un.h>

#include <cstdint>
#include <optional>
#include <string>

#include "transport/same_host/system.hpp"

namespace ferry::transport::same_host {

/// What a same-host endpoint's `info` says of its owner (JSON, docs/protocol.md): its process
/// and where its grant table is. Nothing in it proves anything: the peer checks that the
/// socket it connects to belongs to that process (SO_PEERCRED), then reads a nonce of that
/// connection's own in the process's memory.
struct OwnerInfo {
  ProcessScope scope;
  int grants_fd = -1;  ///< the owner's fd of its grant table
  std::uint64_t grants_bytes = 0;
};

std::string to_info(const OwnerInfo& info);
/// Throws Error(InvalidMetadata) naming what is wrong.
OwnerInfo parse_info(const std::string& info);
/// Why a process of `owner`'s scope cannot be reached from this one (another boot, or another
/// PID namespace): Unsupported; none when it can.
std::optional<Error> scope_mismatch(const ProcessScope& owner);
/// The owner's info of a same-host endpoint (cma's, cuda_ipc's). Throws
/// Error(InvalidMetadata, field "endpoints") naming what is wrong: an address that is no
/// abstract socket name, or info that does not parse.
OwnerInfo parse_endpoint(const Endpoint& endpoint);
/// Parses "@name" into an abstract Unix socket address; false if malformed.
bool socket_address(const std::string& address, sockaddr_un& out, socklen_t& len);

}  // namespace ferry::transport::same_host
