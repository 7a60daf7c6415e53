#pragma once

#include <nats/nats.h>

#include <memory>
#include <string>
#include <vector>

#include <ferry/options.hpp>

namespace ferry::sidechannel {

/// cnats' options, owned.
using NatsOptionsPtr = std::unique_ptr<natsOptions, void (*)(natsOptions*)>;

/// cnats' options for `o`: the servers (tried in the order given), the credentials, TLS, the
/// timeouts and the reconnect policy, and ferry's fixed choices (each publish sent at once,
/// one pool of delivery threads). The event loop and the connection's callbacks are the
/// caller's to add. Throws Error(SideChannel) naming the setting cnats refused (a credentials
/// or TLS file it cannot read, say).
NatsOptionsPtr nats_options(const NatsOptions& o);

/// Connects with `opts` (natsConnection_Connect): blocks for the handshake, at most the
/// connect timeout per server. The caller closes and destroys the connection. Throws
/// Error(AccessDenied) when a server refused the credentials (credentials_refused),
/// Error(SideChannel) otherwise; both name `servers`, the URLs `opts` holds.
natsConnection* nats_connect(natsOptions* opts, const std::vector<std::string>& servers);

/// The local address this host would use to reach the first of `servers` that resolves (a UDP
/// socket connected there, which sends nothing), or empty: where the connection's socket would
/// be bound, known before any server answers. Blocks for name resolution.
std::string route_ip(const std::vector<std::string>& servers);

/// Whether the natsConnection_Connect that has just failed on this thread with `status` was
/// refused by a server over its credentials.
bool credentials_refused(natsStatus status) noexcept;

/// natsStatus_GetText(s), followed by the more precise text cnats keeps for this thread's last
/// error (the server's -ERR, say) when it has one. On the thread of the call that failed.
std::string status_text(natsStatus s);

}  // namespace ferry::sidechannel
