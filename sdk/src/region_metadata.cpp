// RegionMetadata: the region's credential as a versioned JSON document. The fields it shares
// with RdmaMetadata (owner, endpoints, descriptors, token) are checked by RdmaMetadata's own
// reader and validate(), so that both documents are exactly as strict.
#include <ferry/error.hpp>
#include <ferry/region.hpp>

#include <nlohmann/json.hpp>

#include "sdk/src/region_metadata.hpp"

namespace ferry {

namespace {

using json = nlohmann::json;

constexpr const char* kKind = "ferry.region";

[[noreturn]] void invalid(const std::string& field, const std::string& why) {
  throw Error(ErrorCode::InvalidMetadata, why, field);
}

RegionAccess access_from_string(const std::string& s) {
  if (s == "read") return RegionAccess::read;
  if (s == "write") return RegionAccess::write;
  if (s == "read_write") return RegionAccess::read_write;
  invalid("access", "unknown access '" + s + "' (expected read, write or read_write)");
}

}  // namespace

RdmaMetadata detail::operation_view(const RegionMetadata& m) {
  RdmaMetadata o;
  o.version = RdmaMetadata::kVersion;
  o.operation_kind = OperationKind::read;
  o.notification_key = m.region_id;
  o.owner = m.owner;
  o.endpoints = m.endpoints;
  o.descriptors = m.descriptors;
  o.token = m.token;
  return o;
}

namespace {

// RdmaMetadata's checks, with its field names made the region's.
template <class F>
void as_region(F&& check) {
  try {
    check();
  } catch (const Error& e) {
    if (e.code() != ErrorCode::InvalidMetadata) throw;
    const std::string field = e.field() == "notification_key" ? "region_id" : e.field();
    throw Error(ErrorCode::InvalidMetadata,
                e.field() == "notification_key" ? "must be 16 lowercase hex digits" : e.message(),
                field);
  }
}

}  // namespace

const char* to_string(RegionAccess access) noexcept {
  switch (access) {
    case RegionAccess::read:
      return "read";
    case RegionAccess::write:
      return "write";
    case RegionAccess::read_write:
      return "read_write";
  }
  return "unknown";
}

std::uint64_t RegionMetadata::total_size() const noexcept {
  std::uint64_t total = 0;
  for (const auto& d : descriptors) total += d.size;
  return total;
}

std::uint64_t RegionMetadata::block_count() const noexcept {
  return block_size == 0 ? 0 : total_size() / block_size;
}

void RegionMetadata::validate() const {
  if (version != kVersion)
    invalid("version", "unknown version " + std::to_string(version) + " (this build reads " +
                           std::to_string(kVersion) + ")");
  if (access != RegionAccess::read && access != RegionAccess::write &&
      access != RegionAccess::read_write)
    invalid("access", "unknown access");
  as_region([&] { detail::operation_view(*this).validate(); });
  if (block_size != 0 && total_size() % block_size != 0)
    invalid("block_size", "the region's " + std::to_string(total_size()) +
                              " bytes are not a whole number of blocks of " +
                              std::to_string(block_size));
}

std::string RegionMetadata::to_json() const {
  json doc = json::parse(detail::operation_view(*this).to_json());
  doc.erase("operation_kind");
  doc.erase("notification_key");
  doc["kind"] = kKind;
  doc["version"] = version;
  doc["region_id"] = region_id;
  doc["access"] = to_string(access);
  doc["block_size"] = block_size;
  return doc.dump(-1, ' ', false, json::error_handler_t::replace);
}

RegionMetadata RegionMetadata::from_json(std::string_view text) {
  if (text.size() > RdmaMetadata::kMaxJsonBytes)
    invalid("", "document of " + std::to_string(text.size()) + " bytes exceeds the limit of " +
                    std::to_string(RdmaMetadata::kMaxJsonBytes));
  json doc = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) invalid("", "not valid JSON");
  if (!doc.is_object()) invalid("", "must be a JSON object");
  auto kind = doc.find("kind");
  if (kind == doc.end()) invalid("kind", "missing (not a region's metadata)");
  if (!kind->is_string() || kind->get<std::string>() != kKind)
    invalid("kind", std::string("must be \"") + kKind + "\"");
  auto version = doc.find("version");
  if (version == doc.end()) invalid("version", "missing");
  if (!version->is_number_integer() || version->get<std::int64_t>() != kVersion)
    invalid("version", "unknown version (this build reads " + std::to_string(kVersion) + ")");
  RegionMetadata m;
  auto id = doc.find("region_id");
  if (id == doc.end()) invalid("region_id", "missing");
  if (!id->is_string()) invalid("region_id", "must be a string");
  m.region_id = id->get<std::string>();
  auto access = doc.find("access");
  if (access == doc.end()) invalid("access", "missing");
  if (!access->is_string()) invalid("access", "must be a string");
  m.access = access_from_string(access->get<std::string>());
  auto block = doc.find("block_size");
  if (block == doc.end()) invalid("block_size", "missing");
  if (!block->is_number_unsigned()) invalid("block_size", "must be a non-negative integer");
  m.block_size = block->get<std::uint64_t>();
  for (const char* key : {"kind", "region_id", "access", "block_size"}) doc.erase(key);
  // The rest is checked as an operation's metadata is.
  doc["operation_kind"] = "read";
  doc["notification_key"] = m.region_id;
  as_region([&] {
    RdmaMetadata o =
        RdmaMetadata::from_json(doc.dump(-1, ' ', false, json::error_handler_t::replace));
    m.owner = std::move(o.owner);
    m.endpoints = std::move(o.endpoints);
    m.descriptors = std::move(o.descriptors);
    m.token = std::move(o.token);
  });
  m.validate();
  return m;
}

}  // namespace ferry
