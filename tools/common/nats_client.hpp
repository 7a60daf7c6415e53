#pragma once

// What ferry's tools (ferry-info, ferry-top) share to reach NATS as a connector would: the
// server list and the credentials of the FERRY_NATS_* variables (docs/sidechannel.md).

#include <nats/nats.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace ferry::tools {

/// "a, b,c" -> {"a", "b", "c"}; blanks around items and empty items dropped.
std::vector<std::string> split_list(std::string_view list);
/// The environment variable `name`, or nothing when it is unset or empty (as ferry reads it).
std::optional<std::string> env(const char* name);
/// Throws std::runtime_error naming `what` when a cnats call failed.
void check(natsStatus status, const char* what);
/// The credentials and TLS files of FERRY_NATS_USER/PASSWORD, _TOKEN, _CREDS, _NKEY(_SEED_FILE)
/// and _TLS_CA/CERT/KEY, applied to `options`.
void apply_credentials(natsOptions* options);

using NatsOptionsPtr = std::unique_ptr<natsOptions, void (*)(natsOptions*)>;
using NatsConnectionPtr = std::unique_ptr<natsConnection, void (*)(natsConnection*)>;

/// Options for `servers`, tried in order with `timeout` each, with the credentials above;
/// `name` is the connection's name on the server; `reconnect`: whether cnats reconnects.
NatsOptionsPtr connect_options(const std::vector<std::string>& servers,
                               std::chrono::milliseconds timeout, const char* name, bool reconnect);
/// The status's text, with cnats' own account of the last failure on this thread when it
/// says more ("Timeout").
std::string failure_text(natsStatus status);

}  // namespace ferry::tools
