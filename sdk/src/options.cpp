#include "sdk/src/options.hpp"

#include <algorithm>
#include <cstdlib>
#include <string_view>

#include <ferry/error.hpp>

#include "loop/ids.hpp"
#include "sdk/src/transport_registry.hpp"
#include "sidechannel/nats_channel.hpp"

namespace ferry::detail {

namespace {

std::vector<std::string> split_list(const std::string& list) {
  std::vector<std::string> out;
  std::size_t start = 0;
  while (start <= list.size()) {
    std::size_t comma = list.find(',', start);
    std::string item =
        list.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    if (!item.empty()) out.push_back(item);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

}  // namespace

NatsOptions resolve(NatsOptions o, const std::string& connector_name) {
  if (o.use_environment) {
    auto fill = [](std::string& field, const char* var) {
      if (!field.empty()) return;
      if (const char* v = std::getenv(var)) field = v;
    };
    if (o.servers.empty())
      if (const char* v = std::getenv("FERRY_NATS_URL")) o.servers = split_list(v);
    fill(o.user, "FERRY_NATS_USER");
    fill(o.password, "FERRY_NATS_PASSWORD");
    fill(o.token, "FERRY_NATS_TOKEN");
    fill(o.nkey_public, "FERRY_NATS_NKEY");
    fill(o.nkey_seed_file, "FERRY_NATS_NKEY_SEED_FILE");
    fill(o.creds_file, "FERRY_NATS_CREDS");
    fill(o.tls_ca_file, "FERRY_NATS_TLS_CA");
    fill(o.tls_cert_file, "FERRY_NATS_TLS_CERT");
    fill(o.tls_key_file, "FERRY_NATS_TLS_KEY");
    fill(o.connection_name, "FERRY_NATS_NAME");
    fill(o.prefix, "FERRY_NATS_PREFIX");
    if (const char* v = std::getenv("FERRY_NATS_STATS");
        v != nullptr && (std::string_view(v) == "0" || std::string_view(v) == "off" ||
                         std::string_view(v) == "false"))
      o.answer_stats = false;
  }
  // An entry may hold a comma-separated list, as FERRY_NATS_URL does: both read alike.
  std::vector<std::string> servers;
  for (const std::string& entry : o.servers)
    for (std::string& url : split_list(entry)) servers.push_back(std::move(url));
  o.servers = std::move(servers);
  if (o.connection_name.empty()) o.connection_name = connector_name;
  if (o.prefix.empty()) o.prefix = "ferry";
  check_text(o.connection_name, "the NATS connection name", 256);
  if (o.connect_timeout.count() <= 0 || o.request_timeout.count() <= 0 ||
      o.reconnect_wait.count() < 0 || o.connect_deadline.count() < 0)
    throw Error(ErrorCode::InvalidArgument,
                "nats: connect_timeout and request_timeout must be positive, reconnect_wait "
                "and connect_deadline not negative");
  if (o.ping_interval.count() <= 0 || o.max_pings_out <= 0)
    throw Error(ErrorCode::InvalidArgument,
                "nats: ping_interval and max_pings_out must be positive", "nats.ping_interval");
  if (o.answer_burst < 1 || o.answers_per_second < 0)
    throw Error(ErrorCode::InvalidArgument,
                "nats: answer_burst must be positive and answers_per_second not negative");
  return o;
}

std::vector<std::string> resolve_transports(const ConnectorOptions& o) {
  std::vector<std::string> wanted = o.transports;
  if (wanted.empty() && o.use_environment)
    if (const char* v = std::getenv("FERRY_TRANSPORTS")) wanted = split_list(v);
  if (wanted.empty()) return wanted;
  std::vector<std::string> known;
  for (const auto& m : methods()) known.push_back(m.name);
  for (const std::string& w : wanted) {
    if (std::find(known.begin(), known.end(), w) != known.end()) continue;
    std::string list;
    for (const auto& k : known) list += (list.empty() ? "" : ", ") + k;
    throw Error(ErrorCode::InvalidArgument,
                "transports: unknown method '" + w + "' (this build has " + list + ")");
  }
  return wanted;
}

loop::Log resolve_log(const ConnectorOptions& o, const std::string& connector_name) {
  LogOptions log = o.log;
  if (o.use_environment && log.level == LogOptions{}.level)
    if (const char* v = std::getenv("FERRY_LOG"); v != nullptr && *v != '\0') {
      if (!loop::parse_level(v, log.level))
        throw Error(ErrorCode::InvalidArgument,
                    "FERRY_LOG='" + loop::sanitized_utf8(v) +
                        "' names no level (debug, info, warning, error, off)");
    }
  return loop::Log(std::move(log), connector_name);
}

void check_subject(const std::string& subject, const std::string& prefix) {
  if (auto why = sidechannel::subject_problem(subject))
    throw Error(ErrorCode::InvalidArgument,
                "subject '" + loop::sanitized_utf8(subject) + "' " + *why);
  if (subject.rfind(prefix + ".", 0) == 0)
    throw Error(ErrorCode::InvalidArgument,
                "subject '" + subject + "' is in ferry's own namespace '" + prefix + ".'");
}

void check_text(const std::string& text, const char* what, std::size_t max) {
  if (text.size() > max)
    throw Error(ErrorCode::InvalidArgument,
                std::string(what) + " is longer than " + std::to_string(max) + " bytes");
  if (!loop::valid_utf8(text))
    throw Error(ErrorCode::InvalidArgument, std::string(what) + " is not valid UTF-8");
  for (char c : text)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f)
      throw Error(ErrorCode::InvalidArgument, std::string(what) + " contains a control character");
}

}  // namespace ferry::detail
