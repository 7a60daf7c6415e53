#include "sidechannel/pairing.hpp"

#include <nlohmann/json.hpp>

namespace ferry::sidechannel {

namespace {

using json = nlohmann::json;
constexpr int kVersion = 1;

std::optional<ErrorCode> code_from_name(std::string_view name) {
  for (int c = static_cast<int>(ErrorCode::InvalidArgument);
       c <= static_cast<int>(ErrorCode::Internal); ++c) {
    if (to_string(static_cast<ErrorCode>(c)) == name) return static_cast<ErrorCode>(c);
  }
  return std::nullopt;
}

}  // namespace

std::string encode(const MetadataRequest& request) {
  return json{
      {"version", kVersion}, {"want", std::string(to_string(request.want))}, {"from", request.from}}
      .dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string encode(const CompletionNotice& n) {
  json doc = {{"version", kVersion},
              {"key", n.key},
              {"token", n.token},
              {"from", n.from},
              {"from_id", n.from_id}};
  if (!n.claim.empty()) doc["claim"] = n.claim;
  if (n.error) {
    doc["status"] = "errored";
    doc["code"] = std::string(to_string(n.error->code()));
    doc["message"] = n.error->message();
  } else {
    doc["status"] = "complete";
  }
  return doc.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::optional<CompletionNotice> decode_notice(std::string_view text) {
  // Anyone may publish here: check every type before reading, never throw.
  json doc = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!doc.is_object()) return std::nullopt;
  auto version = doc.find("version");
  if (version == doc.end() || !version->is_number_integer() || *version != kVersion)
    return std::nullopt;
  auto str = [&](const char* key) -> std::optional<std::string> {
    auto it = doc.find(key);
    if (it == doc.end() || !it->is_string()) return std::nullopt;
    return it->get<std::string>();
  };
  auto key = str("key");
  auto token = str("token");
  auto status = str("status");
  if (!key || !token || !status) return std::nullopt;
  CompletionNotice n;
  n.key = *key;
  n.token = *token;
  n.from = str("from").value_or("?");
  n.from_id = str("from_id").value_or("");
  n.claim = str("claim").value_or("");
  if (*status == "complete") return n;
  if (*status != "errored") return std::nullopt;
  auto code = code_from_name(str("code").value_or(""));
  n.error = Error(code.value_or(ErrorCode::Internal), str("message").value_or(""));
  return n;
}

}  // namespace ferry::sidechannel
