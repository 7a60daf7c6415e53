#include "tools/common/nats_client.hpp"

#include <cstdlib>
#include <stdexcept>

namespace ferry::tools {

std::vector<std::string> split_list(std::string_view list) {
  std::vector<std::string> out;
  while (!list.empty()) {
    std::size_t comma = list.find(',');
    std::string_view item = list.substr(0, comma);
    std::size_t first = item.find_first_not_of(" \t");
    if (first != std::string_view::npos)
      out.emplace_back(item.substr(first, item.find_last_not_of(" \t") - first + 1));
    if (comma == std::string_view::npos) break;
    list.remove_prefix(comma + 1);
  }
  return out;
}

std::optional<std::string> env(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return std::nullopt;
  return std::string(value);
}

void check(natsStatus status, const char* what) {
  if (status != NATS_OK)
    throw std::runtime_error(std::string(what) + ": " + natsStatus_GetText(status));
}

void apply_credentials(natsOptions* options) {
  auto user = env("FERRY_NATS_USER"), password = env("FERRY_NATS_PASSWORD");
  if (user || password)
    check(
        natsOptions_SetUserInfo(options, user.value_or("").c_str(), password.value_or("").c_str()),
        "FERRY_NATS_USER/PASSWORD");
  if (auto token = env("FERRY_NATS_TOKEN"))
    check(natsOptions_SetToken(options, token->c_str()), "FERRY_NATS_TOKEN");
  if (auto creds = env("FERRY_NATS_CREDS"))
    check(natsOptions_SetUserCredentialsFromFiles(options, creds->c_str(), nullptr),
          "FERRY_NATS_CREDS");
  auto nkey = env("FERRY_NATS_NKEY"), seed = env("FERRY_NATS_NKEY_SEED_FILE");
  if (nkey || seed)
    check(
        natsOptions_SetNKeyFromSeed(options, nkey.value_or("").c_str(), seed.value_or("").c_str()),
        "FERRY_NATS_NKEY");
  auto ca = env("FERRY_NATS_TLS_CA"), cert = env("FERRY_NATS_TLS_CERT"),
       key = env("FERRY_NATS_TLS_KEY");
  if (ca || cert || key) check(natsOptions_SetSecure(options, true), "TLS");
  if (ca) check(natsOptions_LoadCATrustedCertificates(options, ca->c_str()), "FERRY_NATS_TLS_CA");
  if (cert || key)
    check(natsOptions_LoadCertificatesChain(options, cert.value_or("").c_str(),
                                            key.value_or("").c_str()),
          "FERRY_NATS_TLS_CERT/KEY");
}

NatsOptionsPtr connect_options(const std::vector<std::string>& servers,
                               std::chrono::milliseconds timeout, const char* name,
                               bool reconnect) {
  natsOptions* raw = nullptr;
  check(natsOptions_Create(&raw), "natsOptions_Create");
  NatsOptionsPtr options(raw, natsOptions_Destroy);
  std::vector<const char*> urls;
  for (const auto& url : servers) urls.push_back(url.c_str());
  check(natsOptions_SetServers(options.get(), urls.data(), static_cast<int>(urls.size())),
        "servers");
  check(natsOptions_SetNoRandomize(options.get(), true), "servers");
  check(natsOptions_SetTimeout(options.get(), timeout.count()), "timeout");
  check(natsOptions_SetAllowReconnect(options.get(), reconnect), "reconnect");
  check(natsOptions_SetName(options.get(), name), "name");
  apply_credentials(options.get());
  return options;
}

std::string failure_text(natsStatus status) {
  std::string why = natsStatus_GetText(status);
  const char* last = nats_GetLastError(nullptr);
  std::string detail = last != nullptr ? last : "";
  // cnats puts the source location first: "(conn.c:2088): No server available for connection".
  if (auto end = detail.find("): "); detail.starts_with("(") && end != std::string::npos)
    detail.erase(0, end + 3);
  if (!detail.empty() && detail != why) why += " (" + detail + ")";
  return why;
}

}  // namespace ferry::tools
