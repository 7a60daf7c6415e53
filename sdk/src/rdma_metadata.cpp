#include <ferry/error.hpp>
#include <ferry/rdma_metadata.hpp>

#include <charconv>
#include <cstring>
#include <limits>
#include <optional>
#include <string_view>

#include <nlohmann/json.hpp>

#include "loop/ids.hpp"
#include "sdk/src/metadata_json.hpp"

namespace ferry {

namespace {

using json = nlohmann::json;

[[noreturn]] void invalid(const std::string& field, const std::string& why) {
  throw Error(ErrorCode::InvalidMetadata, why, field);
}

bool is_lower_hex(std::string_view s, std::size_t digits) {
  return s.size() == digits && loop::is_lower_hex(s);
}

const json& member(const json& object, const std::string& path, const char* key) {
  auto it = object.find(key);
  if (it == object.end()) invalid(path + key, "missing");
  return *it;
}

std::string join(const std::string& parent, const char* key) {
  return parent.empty() ? key : parent + "." + key;
}

std::string get_string(const json& object, const std::string& parent, const char* key) {
  const json& v = member(object, parent.empty() ? "" : parent + ".", key);
  if (!v.is_string()) invalid(join(parent, key), "must be a string");
  return v.get<std::string>();
}

std::uint64_t get_unsigned(const json& object, const std::string& parent, const char* key) {
  const json& v = member(object, parent.empty() ? "" : parent + ".", key);
  if (!v.is_number_unsigned()) invalid(join(parent, key), "must be a non-negative integer");
  return v.get<std::uint64_t>();
}

std::int64_t get_integer(const json& object, const std::string& parent, const char* key) {
  const json& v = member(object, parent.empty() ? "" : parent + ".", key);
  if (!v.is_number_integer()) invalid(join(parent, key), "must be an integer");
  if (v.is_number_unsigned() &&
      v.get<std::uint64_t>() > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
    invalid(join(parent, key), "out of range");
  return v.get<std::int64_t>();
}

const json& get_array(const json& object, const char* key) {
  const json& v = member(object, "", key);
  if (!v.is_array()) invalid(key, "must be an array");
  return v;
}

OperationKind kind_from_string(const std::string& s) {
  if (s == "read") return OperationKind::read;
  if (s == "write") return OperationKind::write;
  invalid("operation_kind", "unknown kind '" + s + "' (expected read or write)");
}

}  // namespace

std::uint64_t RdmaMetadata::total_size() const noexcept {
  std::uint64_t total = 0;
  for (const auto& d : descriptors) total += d.size;
  return total;
}

void RdmaMetadata::validate() const {
  if (version != kVersion)
    invalid("version", "unknown version " + std::to_string(version) + " (this build reads " +
                           std::to_string(kVersion) + ")");
  if (operation_kind != OperationKind::read && operation_kind != OperationKind::write)
    invalid("operation_kind", "must be read or write");
  if (!is_lower_hex(notification_key, 16))
    invalid("notification_key", "must be 16 lowercase hex digits");
  if (owner.name.empty()) invalid("owner.name", "must not be empty");
  // The id names the owner's notice subject: nothing but hex may reach a NATS subject.
  if (!is_lower_hex(owner.id, 16)) invalid("owner.id", "must be 16 lowercase hex digits");
  if (endpoints.empty()) invalid("endpoints", "must list at least one endpoint");
  if (endpoints.size() > kMaxEndpoints)
    invalid("endpoints", "more than " + std::to_string(kMaxEndpoints) + " endpoints");
  for (std::size_t i = 0; i < endpoints.size(); ++i) {
    const std::string at = "endpoints[" + std::to_string(i) + "]";
    if (endpoints[i].method.empty()) invalid(at + ".method", "must not be empty");
    if (endpoints[i].address.empty()) invalid(at + ".address", "must not be empty");
    if (endpoints[i].method.size() > 64) invalid(at + ".method", "longer than 64 bytes");
    if (endpoints[i].address.size() > 256) invalid(at + ".address", "longer than 256 bytes");
    if (endpoints[i].info.size() > kMaxEndpointInfo)
      invalid(at + ".info", "longer than " + std::to_string(kMaxEndpointInfo) + " bytes");
  }
  if (descriptors.empty()) invalid("descriptors", "must list at least one descriptor");
  if (descriptors.size() > kMaxDescriptors)
    invalid("descriptors", "more than " + std::to_string(kMaxDescriptors) + " descriptors");
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < descriptors.size(); ++i) {
    // The field's name is built only for an error: this loop runs for every descriptor.
    auto at = [i] { return "descriptors[" + std::to_string(i) + "]"; };
    const auto& d = descriptors[i];
    if (d.ptr == 0) invalid(at() + ".ptr", "must not be null");
    if (d.size == 0) invalid(at() + ".size", "must be greater than zero");
    if (d.size > std::numeric_limits<std::uint64_t>::max() - d.ptr)
      invalid(at() + ".size", "ptr + size overflows");
    if (d.size > std::numeric_limits<std::uint64_t>::max() - total)
      invalid(at() + ".size", "the total size overflows");
    total += d.size;
  }
  if (!is_lower_hex(token, 32)) invalid("token", "must be 32 lowercase hex digits");
}

namespace {

template <class Int>
void put_number(std::string& out, Int value) {
  char buf[24];
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, value);
  (void)ec;  // 24 characters hold any 64-bit integer
  out.append(buf, end);
}

// Valid UTF-8 `s` as a JSON string, escaped as nlohmann's writer escapes it.
void put_string(std::string& out, std::string_view s) {
  static const char hex[] = "0123456789abcdef";
  out += '"';
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          out += "\\u00";
          out += hex[c >> 4];
          out += hex[c & 0xf];
        } else {
          out += ch;
        }
    }
  }
  out += '"';
}

}  // namespace

std::string RdmaMetadata::to_json() const {
  // The fast path writes the same bytes as the general one below (keys in the order
  // nlohmann's object sorts them, no spaces) when every text is valid UTF-8: a fraction of
  // the instructions, which matter when metadata goes out with every small operation
  // (docs/PERFORMANCE.md). Otherwise the general path replaces what is not valid UTF-8.
  std::vector<std::string> devices;
  devices.reserve(descriptors.size());
  // Valid UTF-8 without NUL (loop::valid_utf8) is copied, escaping what JSON needs escaped.
  using loop::valid_utf8;
  bool fast = valid_utf8(notification_key) && valid_utf8(owner.name) && valid_utf8(owner.id) &&
              valid_utf8(owner.host) && valid_utf8(token);
  for (const auto& e : endpoints)
    fast = fast && valid_utf8(e.method) && valid_utf8(e.address) && valid_utf8(e.info);
  for (const auto& d : descriptors) {
    devices.push_back(d.device.to_string());
    fast = fast && valid_utf8(devices.back());
  }
  if (fast) {
    std::string out;
    out.reserve(256 + 64 * descriptors.size() + 128 * endpoints.size());
    out += "{\"descriptors\":[";
    for (std::size_t i = 0; i < descriptors.size(); ++i) {
      if (i > 0) out += ',';
      out += "{\"device\":";
      put_string(out, devices[i]);
      out += ",\"ptr\":";
      put_number(out, descriptors[i].ptr);
      out += ",\"size\":";
      put_number(out, descriptors[i].size);
      out += '}';
    }
    out += "],\"endpoints\":[";
    for (std::size_t i = 0; i < endpoints.size(); ++i) {
      const Endpoint& e = endpoints[i];
      if (i > 0) out += ',';
      out += "{\"address\":";
      put_string(out, e.address);
      if (!e.info.empty()) {
        out += ",\"info\":";
        put_string(out, e.info);
      }
      out += ",\"method\":";
      put_string(out, e.method);
      out += '}';
    }
    out += "],\"notification_key\":";
    put_string(out, notification_key);
    out += ",\"operation_kind\":";
    put_string(out, to_string(operation_kind));
    out += ",\"owner\":{\"host\":";
    put_string(out, owner.host);
    out += ",\"id\":";
    put_string(out, owner.id);
    out += ",\"name\":";
    put_string(out, owner.name);
    out += ",\"pid\":";
    put_number(out, owner.pid);
    out += "},\"token\":";
    put_string(out, token);
    out += ",\"version\":";
    put_number(out, version);
    out += '}';
    return out;
  }
  json descs = json::array();
  for (const auto& d : descriptors)
    descs.push_back({{"device", d.device.to_string()}, {"ptr", d.ptr}, {"size", d.size}});
  json eps = json::array();
  for (const auto& e : endpoints) {
    json ep = {{"method", e.method}, {"address", e.address}};
    if (!e.info.empty()) ep["info"] = e.info;
    eps.push_back(std::move(ep));
  }
  json doc = {
      {"version", version},
      {"operation_kind", std::string(to_string(operation_kind))},
      {"notification_key", notification_key},
      {"owner", {{"name", owner.name}, {"id", owner.id}, {"host", owner.host}, {"pid", owner.pid}}},
      {"endpoints", std::move(eps)},
      {"descriptors", std::move(descs)},
      {"token", token},
  };
  // Text that is not valid UTF-8 (a name from a peer, say) becomes U+FFFD instead of
  // throwing: encoding metadata never fails.
  return doc.dump(-1, ' ', false, json::error_handler_t::replace);
}

namespace {

// Reads the form to_json writes, and nothing else: keys in that order, no whitespace, strings
// of ASCII with simple escapes, integers. Any other document, or a value the general reader
// would refuse before validate() (an unknown version or kind, a bad device, too many
// entries), makes it give up, and the general reader takes the text from the start; so the
// answer is the same either way, only cheaper for the documents ferry itself writes
// (docs/PERFORMANCE.md).
class CanonicalReader {
 public:
  explicit CanonicalReader(std::string_view text)
      : p_(text.data()), end_(text.data() + text.size()) {}

  std::optional<RdmaMetadata> read() {
    RdmaMetadata m;
    if (!lit("{\"descriptors\":[")) return std::nullopt;
    std::string device;
    if (!peek(']')) {
      do {
        RemoteDescriptor d;
        if (!lit("{\"device\":") || !str(device) || !lit(",\"ptr\":") || !unsigned_int(d.ptr) ||
            !lit(",\"size\":") || !unsigned_int(d.size) || !lit("}"))
          return std::nullopt;
        if (m.descriptors.size() == RdmaMetadata::kMaxDescriptors) return std::nullopt;
        try {
          d.device = device == "host" ? Device::host() : Device(device);
        } catch (const Error&) {
          return std::nullopt;
        }
        m.descriptors.push_back(d);
      } while (lit(","));
    }
    if (!lit("],\"endpoints\":[")) return std::nullopt;
    if (!peek(']')) {
      do {
        Endpoint e;
        if (!lit("{\"address\":") || !str(e.address)) return std::nullopt;
        if (lit(",\"info\":") && !str(e.info)) return std::nullopt;
        if (!lit(",\"method\":") || !str(e.method) || !lit("}")) return std::nullopt;
        if (m.endpoints.size() == RdmaMetadata::kMaxEndpoints) return std::nullopt;
        m.endpoints.push_back(std::move(e));
      } while (lit(","));
    }
    std::string kind;
    std::int64_t version = 0;
    if (!lit("],\"notification_key\":") || !str(m.notification_key) ||
        !lit(",\"operation_kind\":") || !str(kind) || !lit(",\"owner\":{\"host\":") ||
        !str(m.owner.host) || !lit(",\"id\":") || !str(m.owner.id) || !lit(",\"name\":") ||
        !str(m.owner.name) || !lit(",\"pid\":") || !signed_int(m.owner.pid) ||
        !lit("},\"token\":") || !str(m.token) || !lit(",\"version\":") || !signed_int(version) ||
        !lit("}") || p_ != end_)
      return std::nullopt;
    if (version != RdmaMetadata::kVersion) return std::nullopt;
    if (kind == "read")
      m.operation_kind = OperationKind::read;
    else if (kind == "write")
      m.operation_kind = OperationKind::write;
    else
      return std::nullopt;
    return m;
  }

 private:
  bool lit(std::string_view s) {
    if (static_cast<std::size_t>(end_ - p_) < s.size() || std::memcmp(p_, s.data(), s.size()) != 0)
      return false;
    p_ += s.size();
    return true;
  }
  bool peek(char c) const { return p_ < end_ && *p_ == c; }

  bool str(std::string& out) {
    if (!lit("\"")) return false;
    out.clear();
    const char* start = p_;
    while (p_ < end_) {
      const auto c = static_cast<unsigned char>(*p_);
      if (c == '"') {
        out.append(start, p_);
        ++p_;
        return true;
      }
      if (c < 0x20 || c >= 0x80) return false;  // raw UTF-8 and the rest: the general reader
      if (c != '\\') {
        ++p_;
        continue;
      }
      out.append(start, p_);
      if (++p_ == end_) return false;
      switch (*p_) {
        case '"':
          out += '"';
          break;
        case '\\':
          out += '\\';
          break;
        case '/':
          out += '/';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        default:
          return false;  // \u escapes: the general reader
      }
      start = ++p_;
    }
    return false;
  }

  // Digits as JSON writes an integer: no leading zero, no fraction or exponent after.
  bool digits_end(const char* from) const {
    if (from == end_ || *from < '0' || *from > '9') return false;
    if (*from == '0' && from + 1 < end_ && from[1] >= '0' && from[1] <= '9') return false;
    return true;
  }
  bool number_done() const { return p_ == end_ || (*p_ != '.' && *p_ != 'e' && *p_ != 'E'); }

  bool unsigned_int(std::uint64_t& v) {
    if (!digits_end(p_)) return false;
    auto [next, ec] = std::from_chars(p_, end_, v);
    if (ec != std::errc()) return false;
    p_ = next;
    return number_done();
  }
  bool signed_int(std::int64_t& v) {
    if (!digits_end(p_ < end_ && *p_ == '-' ? p_ + 1 : p_)) return false;
    auto [next, ec] = std::from_chars(p_, end_, v);
    if (ec != std::errc()) return false;
    p_ = next;
    return number_done();
  }

  const char* p_;
  const char* end_;
};

}  // namespace

RdmaMetadata RdmaMetadata::from_json(std::string_view text) {
  // A document over the limit goes to the general reader, which refuses it.
  if (text.size() <= kMaxJsonBytes) {
    if (std::optional<RdmaMetadata> m = CanonicalReader(text).read()) {
      m->validate();
      return std::move(*m);
    }
  }
  return detail::metadata_from_json_general(text);
}

RdmaMetadata detail::metadata_from_json_general(std::string_view text) {
  if (text.size() > RdmaMetadata::kMaxJsonBytes)
    invalid("", "document of " + std::to_string(text.size()) + " bytes exceeds the limit of " +
                    std::to_string(RdmaMetadata::kMaxJsonBytes));
  json doc = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) invalid("", "not valid JSON");
  if (!doc.is_object()) invalid("", "must be a JSON object");

  RdmaMetadata m;
  // dynamo.nixl_connect's RdmaMetadata has no version but carries the NIXL agent's own
  // metadata: say what it is rather than that a field is missing.
  if (!doc.contains("version") && doc.contains("nixl_metadata"))
    invalid("",
            "this is dynamo.nixl_connect's RdmaMetadata (it carries nixl_metadata), not "
            "ferry's: ferry pairs with ferry peers only; make the peer's metadata with "
            "ferry's create_readable / create_writable");
  // The version first: a document of another version may differ in everything else.
  std::int64_t version = get_integer(doc, "", "version");
  if (version != RdmaMetadata::kVersion)
    invalid("version", "unknown version " + std::to_string(version) + " (this build reads " +
                           std::to_string(RdmaMetadata::kVersion) + ")");
  m.version = static_cast<int>(version);
  m.operation_kind = kind_from_string(get_string(doc, "", "operation_kind"));
  m.notification_key = get_string(doc, "", "notification_key");

  const json& owner = member(doc, "", "owner");
  if (!owner.is_object()) invalid("owner", "must be an object");
  m.owner.name = get_string(owner, "owner", "name");
  m.owner.id = get_string(owner, "owner", "id");
  m.owner.host = get_string(owner, "owner", "host");
  m.owner.pid = get_integer(owner, "owner", "pid");

  const json& eps = get_array(doc, "endpoints");
  if (eps.size() > RdmaMetadata::kMaxEndpoints)
    invalid("endpoints", "more than " + std::to_string(RdmaMetadata::kMaxEndpoints) + " endpoints");
  for (std::size_t i = 0; i < eps.size(); ++i) {
    const std::string at = "endpoints[" + std::to_string(i) + "]";
    if (!eps[i].is_object()) invalid(at, "must be an object");
    Endpoint e{get_string(eps[i], at, "method"), get_string(eps[i], at, "address"), {}};
    if (eps[i].contains("info")) e.info = get_string(eps[i], at, "info");
    m.endpoints.push_back(std::move(e));
  }

  const json& descs = get_array(doc, "descriptors");
  if (descs.size() > RdmaMetadata::kMaxDescriptors)
    invalid("descriptors",
            "more than " + std::to_string(RdmaMetadata::kMaxDescriptors) + " descriptors");
  m.descriptors.reserve(descs.size());
  for (std::size_t i = 0; i < descs.size(); ++i) {
    const std::string at = "descriptors[" + std::to_string(i) + "]";
    if (!descs[i].is_object()) invalid(at, "must be an object");
    RemoteDescriptor d;
    std::string device = get_string(descs[i], at, "device");
    try {
      d.device = Device(device);
    } catch (const Error& e) {
      invalid(at + ".device", e.message());
    }
    d.ptr = get_unsigned(descs[i], at, "ptr");
    d.size = get_unsigned(descs[i], at, "size");
    m.descriptors.push_back(d);
  }
  m.token = get_string(doc, "", "token");
  m.validate();
  return m;
}

}  // namespace ferry
