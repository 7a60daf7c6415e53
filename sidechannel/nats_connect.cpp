#include "sidechannel/nats_connect.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <ferry/error.hpp>

namespace ferry::sidechannel {

namespace {

void check(natsStatus s, const char* what) {
  if (s != NATS_OK) throw Error(ErrorCode::SideChannel, std::string(what) + ": " + status_text(s));
}

void set_credentials(natsOptions* opts, const NatsOptions& o) {
  if (!o.user.empty() || !o.password.empty())
    check(natsOptions_SetUserInfo(opts, o.user.c_str(), o.password.c_str()), "user/password");
  if (!o.token.empty()) check(natsOptions_SetToken(opts, o.token.c_str()), "token");
  if (!o.nkey_public.empty() || !o.nkey_seed_file.empty())
    check(natsOptions_SetNKeyFromSeed(opts, o.nkey_public.c_str(), o.nkey_seed_file.c_str()),
          "NKey");
  if (!o.creds_file.empty())
    check(natsOptions_SetUserCredentialsFromFiles(opts, o.creds_file.c_str(), nullptr),
          "credentials file");
}

void set_tls(natsOptions* opts, const NatsOptions& o) {
  if (o.tls_ca_file.empty() && o.tls_cert_file.empty() && o.tls_key_file.empty()) return;
  check(natsOptions_SetSecure(opts, true), "TLS");
  if (!o.tls_ca_file.empty())
    check(natsOptions_LoadCATrustedCertificates(opts, o.tls_ca_file.c_str()), "TLS CA file");
  if (!o.tls_cert_file.empty() || !o.tls_key_file.empty())
    check(natsOptions_LoadCertificatesChain(opts, o.tls_cert_file.c_str(), o.tls_key_file.c_str()),
          "TLS certificate/key");
}

// "nats://user:pw@host:port" (any scheme, user info and port optional; "[v6]" in brackets):
// the host and the port, 4222 by default.
std::pair<std::string, std::string> host_and_port(std::string url) {
  if (auto scheme = url.find("://"); scheme != std::string::npos) url.erase(0, scheme + 3);
  if (auto slash = url.find('/'); slash != std::string::npos) url.erase(slash);
  if (auto at = url.rfind('@'); at != std::string::npos) url.erase(0, at + 1);
  std::string host = url, port = "4222";
  if (url.starts_with("[")) {
    auto close = url.find(']');
    if (close == std::string::npos) return {};
    host = url.substr(1, close - 1);
    if (close + 1 < url.size() && url[close + 1] == ':') port = url.substr(close + 2);
  } else if (auto colon = url.rfind(':'); colon != std::string::npos) {
    host = url.substr(0, colon);
    port = url.substr(colon + 1);
  }
  return {host, port};
}

std::string route_ip_to(const std::string& url) {
  auto [host, port] = host_and_port(url);
  if (host.empty() || port.empty()) return {};
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), port.c_str(), &hints, &found) != 0) return {};
  std::string ip;
  for (addrinfo* a = found; a != nullptr && ip.empty(); a = a->ai_next) {
    int fd = ::socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t len = sizeof local;
    char text[INET6_ADDRSTRLEN] = {};
    if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      const void* addr =
          local.ss_family == AF_INET6
              ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr)
              : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr);
      if (::inet_ntop(local.ss_family, addr, text, sizeof text) != nullptr) ip = text;
    }
    ::close(fd);
  }
  ::freeaddrinfo(found);
  return ip;
}

}  // namespace

std::string route_ip(const std::vector<std::string>& servers) {
  for (const auto& url : servers)
    if (std::string ip = route_ip_to(url); !ip.empty()) return ip;
  return {};
}

std::string status_text(natsStatus s) {
  std::string text = natsStatus_GetText(s);
  // cnats keeps a more precise message (e.g. the server's -ERR) per thread, behind a
  // "(file.c:line): " location that is no business of ours.
  if (const char* last = nats_GetLastError(nullptr); last != nullptr && *last != '\0') {
    std::string detail = last;
    if (auto at = detail.rfind("): "); at != std::string::npos) detail.erase(0, at + 3);
    if (!detail.empty() && detail != text) text += ": " + detail;
  }
  return text;
}

NatsOptionsPtr nats_options(const NatsOptions& o) {
  natsOptions* raw = nullptr;
  check(natsOptions_Create(&raw), "natsOptions_Create");
  NatsOptionsPtr opts(raw, natsOptions_Destroy);
  std::vector<const char*> urls;
  for (const auto& u : o.servers) urls.push_back(u.c_str());
  check(natsOptions_SetServers(opts.get(), urls.data(), static_cast<int>(urls.size())), "servers");
  check(natsOptions_SetNoRandomize(opts.get(), true), "servers");
  set_credentials(opts.get(), o);
  set_tls(opts.get(), o);
  if (!o.connection_name.empty())
    check(natsOptions_SetName(opts.get(), o.connection_name.c_str()), "name");
  check(natsOptions_SetTimeout(opts.get(), o.connect_timeout.count()), "connect_timeout");
  check(natsOptions_SetReconnectWait(opts.get(), o.reconnect_wait.count()), "reconnect_wait");
  check(natsOptions_SetMaxReconnect(opts.get(), o.max_reconnect), "max_reconnect");
  check(natsOptions_SetPingInterval(opts.get(), o.ping_interval.count()), "ping_interval");
  check(natsOptions_SetMaxPingsOut(opts.get(), o.max_pings_out), "max_pings_out");
  check(natsOptions_SetAllowReconnect(opts.get(), true), "reconnect");
  // Without it every publish waits for cnats' flusher, about a millisecond.
  check(natsOptions_SetSendAsap(opts.get(), true), "send_asap");
  // One pool of delivery threads instead of a thread per subscription.
  check(natsOptions_UseGlobalMessageDelivery(opts.get(), true), "message delivery");
  return opts;
}

bool credentials_refused(natsStatus status) noexcept {
  // cnats classifies the refusal itself. A server that refuses the CONNECT answers its PING
  // with -ERR instead of PONG; _sendConnect (src/conn.c) hands that text to _checkAuthError,
  // which knows "Authorization Violation" and "User Authentication Expired", and fails with
  // NATS_CONNECTION_AUTH_FAILED.
  if (status == NATS_CONNECTION_AUTH_FAILED) return true;
  // With several servers, natsConnection_Connect returns what the last one tried gave (one
  // that cannot be reached after one that refused: NATS_TIMEOUT), while the thread's last
  // error keeps the refusal: nats_setError records a status, and the NATS_UPDATE_ERR_STACK of
  // the callers above it does not replace it. That record is this connect's own: a TCP
  // connection that succeeds clears it (natsSock_ConnectTcp, src/comsock.c), and when no
  // server could be reached _connect sets NATS_NO_SERVER.
  natsStatus last = NATS_OK;
  nats_GetLastError(&last);
  return last == NATS_CONNECTION_AUTH_FAILED;
}

natsConnection* nats_connect(natsOptions* opts, const std::vector<std::string>& servers) {
  natsConnection* nc = nullptr;
  natsStatus s = natsConnection_Connect(&nc, opts);
  if (s == NATS_OK) return nc;
  std::string where;
  for (const auto& u : servers) where += (where.empty() ? "" : ", ") + u;
  if (credentials_refused(s))
    throw Error(ErrorCode::AccessDenied,
                "the NATS server at " + where +
                    " refused the credentials: " + status_text(NATS_CONNECTION_AUTH_FAILED));
  throw Error(ErrorCode::SideChannel, "cannot connect to NATS at " + where + ": " + status_text(s));
}

}  // namespace ferry::sidechannel
