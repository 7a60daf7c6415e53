// RdmaMetadata: JSON round trip and strict validation, each error by code and field.
#include <gtest/gtest.h>

#include <ferry/ferry.hpp>

#include <functional>
#include <limits>

#include <nlohmann/json.hpp>

#include "sdk/src/metadata_json.hpp"

namespace ferry {
namespace {

using json = nlohmann::json;

RdmaMetadata sample() {
  RdmaMetadata m;
  m.operation_kind = OperationKind::write;
  m.notification_key = "0123456789abcdef";
  m.owner = {"decode-0", "00000000deadbeef", "host-a", 4242};
  m.endpoints = {{"tcp", "127.0.0.1:4000"}, {"tcp", "[::1]:4000"}};
  m.descriptors = {{0x7f0000001000, 4096, Device::host()},
                   {std::numeric_limits<std::uint64_t>::max() - 10, 10, Device::cuda(3)}};
  m.token = "00112233445566778899aabbccddeeff";
  return m;
}

// Runs from_json on `doc` after `mutate`, and expects InvalidMetadata naming `field`.
void expect_invalid(const std::function<void(json&)>& mutate, const std::string& field,
                    const std::string& point) {
  json doc = json::parse(sample().to_json());
  mutate(doc);
  try {
    RdmaMetadata::from_json(doc.dump());
    ADD_FAILURE() << "accepted: " << doc.dump();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidMetadata) << e.what();
    EXPECT_EQ(e.field(), field) << e.what();
    EXPECT_NE(std::string(e.what()).find(point), std::string::npos) << e.what();
  }
}

TEST(RdmaMetadata, RoundTripKeepsEveryField) {
  RdmaMetadata m = sample();
  RdmaMetadata back = RdmaMetadata::from_json(m.to_json());
  EXPECT_EQ(back, m);
  EXPECT_EQ(back.descriptors[1].device, Device::cuda(3));
  EXPECT_EQ(back.descriptors[1].ptr, std::numeric_limits<std::uint64_t>::max() - 10);
  EXPECT_EQ(back.total_size(), 4106u);
}

// Encoding never fails: text that is not valid UTF-8 (a name that came from a peer, say)
// becomes U+FFFD instead of throwing from to_json().
TEST(RdmaMetadata, ToJsonReplacesInvalidUtf8InsteadOfThrowing) {
  RdmaMetadata m = sample();
  m.owner.name = "bad\xff\xfename";
  std::string doc;
  ASSERT_NO_THROW(doc = m.to_json());
  RdmaMetadata back = RdmaMetadata::from_json(doc);
  EXPECT_EQ(back.owner.name.find('\xff'), std::string::npos) << back.owner.name;
  EXPECT_NE(back.owner.name.find("\xef\xbf\xbd"), std::string::npos) << back.owner.name;
}

// to_json writes plain text fast and everything else through the general JSON writer: both
// give exactly the bytes nlohmann's dump of the same document gives (keys sorted, no spaces).
TEST(RdmaMetadata, ToJsonWritesWhatTheGeneralWriterWrites) {
  auto reference = [](const RdmaMetadata& m) {
    json descs = json::array();
    for (const auto& d : m.descriptors)
      descs.push_back({{"device", d.device.to_string()}, {"ptr", d.ptr}, {"size", d.size}});
    json eps = json::array();
    for (const auto& e : m.endpoints) {
      json ep = {{"method", e.method}, {"address", e.address}};
      if (!e.info.empty()) ep["info"] = e.info;
      eps.push_back(ep);
    }
    json doc = {{"version", m.version},
                {"operation_kind", std::string(to_string(m.operation_kind))},
                {"notification_key", m.notification_key},
                {"owner",
                 {{"name", m.owner.name},
                  {"id", m.owner.id},
                  {"host", m.owner.host},
                  {"pid", m.owner.pid}}},
                {"endpoints", eps},
                {"descriptors", descs},
                {"token", m.token}};
    return doc.dump(-1, ' ', false, json::error_handler_t::replace);
  };
  RdmaMetadata m = sample();
  EXPECT_EQ(m.to_json(), reference(m));
  m.endpoints.push_back({"cma", "@ferry-cma-1234", "{\"pid\":1,\"boot\":\"x\"}"});  // escapes
  EXPECT_EQ(m.to_json(), reference(m));
  m.endpoints.pop_back();
  m.owner.name = "tab\there";  // a control character
  EXPECT_EQ(m.to_json(), reference(m));
  m.owner.name =
      "d\xc3\xa9"
      "code";  // UTF-8
  EXPECT_EQ(m.to_json(), reference(m));
  // Every escape, 4-byte UTF-8, and the invalid forms the general writer replaces.
  for (std::string text :
       {std::string("q\"b\\s\b\f\n\r\t\x01\x1f\x7f"), std::string("\xf0\x9f\x98\x80 \xe2\x82\xac"),
        std::string("\xc0\xaf"), std::string("\xed\xa0\x80"), std::string("\xf4\x90\x80\x80"),
        std::string("\xe2\x82"), std::string("\x80"), std::string("ok\xff"),
        std::string(1, '\0')}) {
    m.owner.host = text;
    m.endpoints[0].address = text;
    EXPECT_EQ(m.to_json(), reference(m)) << "text of " << text.size() << " bytes";
  }
  m.endpoints = sample().endpoints;
  m.owner.name = "decode";
  m.owner.pid = -1;
  m.descriptors.clear();
  for (std::uint64_t i = 0; i < 300; ++i)
    m.descriptors.push_back(
        {0x1000 * (i + 1), i + 1, i % 3 == 0 ? Device::cuda(1) : Device::host()});
  m.endpoints.clear();
  EXPECT_EQ(m.to_json(), reference(m));
  m.descriptors = {{std::numeric_limits<std::uint64_t>::max(), 0, Device::host()}};
  m.owner.pid = std::numeric_limits<std::int64_t>::min();
  EXPECT_EQ(m.to_json(), reference(m));
}

// from_json reads to_json's own form directly and everything else through the general reader:
// for any text, both give the same value or the same error (code, field and message).
std::string outcome(const std::function<RdmaMetadata()>& read) {
  try {
    return "ok " + read().to_json();
  } catch (const Error& e) {
    return "error " + std::string(to_string(e.code())) + " " + e.field() + ": " + e.message();
  }
}

void expect_same_reading(const std::string& text) {
  EXPECT_EQ(outcome([&] { return RdmaMetadata::from_json(text); }),
            outcome([&] { return detail::metadata_from_json_general(text); }))
      << text;
}

TEST(RdmaMetadata, FastReadingAgreesWithTheGeneralReader) {
  RdmaMetadata m = sample();
  m.endpoints.push_back({"cma", "@ferry-cma-1", "{\"pid\":12,\"boot\":\"a/b\\c\"}"});
  const std::string doc = m.to_json();
  expect_same_reading(doc);
  EXPECT_EQ(RdmaMetadata::from_json(doc), m);
  // Every byte dropped, and every byte replaced by each of a few that matter to JSON.
  for (std::size_t i = 0; i < doc.size(); ++i) {
    std::string dropped = doc;
    dropped.erase(i, 1);
    expect_same_reading(dropped);
    for (char c : {'0', '9', '-', '"', '\\', ' ', '}', ',', 'x', '.', 'e', '\x80', '\x01'}) {
      std::string changed = doc;
      changed[i] = c;
      expect_same_reading(changed);
    }
  }
  // Values the general reader refuses before validate(), and numbers at their limits.
  for (const std::string& text : {doc.substr(0, doc.size() - 2) + "2}", std::string("{}"),
                                  std::string(""), doc + " ", " " + doc}) {
    expect_same_reading(text);
  }
  auto with = [&](const std::string& from, const std::string& to) {
    std::string t = doc;
    const auto at = t.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    if (at != std::string::npos) t.replace(at, from.size(), to);
    return t;
  };
  for (const std::string& text :
       {with("\"pid\":4242", "\"pid\":-0"), with("\"pid\":4242", "\"pid\":-9223372036854775808"),
        with("\"pid\":4242", "\"pid\":9223372036854775808"),
        with("\"pid\":4242", "\"pid\":-9223372036854775809"),
        with("\"size\":4096", "\"size\":18446744073709551615"),
        with("\"size\":4096", "\"size\":18446744073709551616"), with("\"size\":4096", "\"size\":0"),
        with("\"size\":4096", "\"size\":04096"), with("\"size\":4096", "\"size\":4096.0"),
        with("\"size\":4096", "\"size\":4e3"), with("\"device\":\"host\"", "\"device\":\"cuda:x\""),
        with("\"operation_kind\":\"write\"", "\"operation_kind\":\"both\""),
        with("\"name\":\"decode-0\"", "\"name\":\"\""),
        with("\"name\":\"decode-0\"", "\"name\":\"d\\u00e9code\""),
        with("\"name\":\"decode-0\"",
             "\"name\":\"d\xc3\xa9"
             "code\""),
        with("\"version\":1", "\"version\":01")}) {
    expect_same_reading(text);
  }
}

TEST(RdmaMetadata, DocumentCarriesAVersion) {
  json doc = json::parse(sample().to_json());
  EXPECT_EQ(doc.at("version"), RdmaMetadata::kVersion);
  EXPECT_EQ(doc.at("operation_kind"), "write");
}

TEST(RdmaMetadata, RejectsNonJsonAndNonObject) {
  for (const char* text : {"", "{", "not json", "[1,2]", "42"}) {
    try {
      RdmaMetadata::from_json(text);
      ADD_FAILURE() << "accepted: " << text;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::InvalidMetadata);
      EXPECT_EQ(e.field(), "");
    }
  }
}

TEST(RdmaMetadata, RejectsUnknownVersion) {
  expect_invalid([](json& d) { d["version"] = 2; }, "version", "unknown version 2");
  expect_invalid([](json& d) { d["version"] = "1"; }, "version", "must be an integer");
}

// What dynamo.nixl_connect's RdmaMetadata serializes to (its pydantic model): no version, the
// NIXL agent's metadata as hex.
TEST(RdmaMetadata, NixlConnectsMetadataIsNamedAsSuch) {
  const std::string nixl =
      R"({"descriptors": [{"device": "cuda:0", "ptr": 140000000, "size": 4096}],
    "nixl_metadata": "0a1b2c", "notification_key": "abc", "operation_kind": 1})";
  try {
    (void)RdmaMetadata::from_json(nixl);
    ADD_FAILURE() << "nixl_connect's metadata was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidMetadata);
    EXPECT_NE(e.message().find("dynamo.nixl_connect's RdmaMetadata"), std::string::npos)
        << e.what();
  }
}

TEST(RdmaMetadata, RejectsMissingFields) {
  for (const char* key : {"version", "operation_kind", "notification_key", "owner", "endpoints",
                          "descriptors", "token"}) {
    expect_invalid([&](json& d) { d.erase(key); }, key, "missing");
  }
  expect_invalid([](json& d) { d["owner"].erase("name"); }, "owner.name", "missing");
  expect_invalid([](json& d) { d["descriptors"][1].erase("size"); }, "descriptors[1].size",
                 "missing");
  expect_invalid([](json& d) { d["endpoints"][0].erase("address"); }, "endpoints[0].address",
                 "missing");
}

TEST(RdmaMetadata, RejectsWrongTypes) {
  expect_invalid([](json& d) { d["operation_kind"] = 1; }, "operation_kind", "must be a string");
  expect_invalid([](json& d) { d["owner"] = "x"; }, "owner", "must be an object");
  expect_invalid([](json& d) { d["owner"]["pid"] = "7"; }, "owner.pid", "must be an integer");
  expect_invalid([](json& d) { d["endpoints"] = json::object(); }, "endpoints", "must be an array");
  expect_invalid([](json& d) { d["descriptors"][0] = 5; }, "descriptors[0]", "must be an object");
  expect_invalid([](json& d) { d["descriptors"][0]["ptr"] = -1; }, "descriptors[0].ptr",
                 "non-negative integer");
  expect_invalid([](json& d) { d["descriptors"][0]["size"] = 1.5; }, "descriptors[0].size",
                 "non-negative integer");
  expect_invalid([](json& d) { d["descriptors"][0]["ptr"] = "0x10"; }, "descriptors[0].ptr",
                 "non-negative integer");
  expect_invalid([](json& d) { d["token"] = 7; }, "token", "must be a string");
}

TEST(RdmaMetadata, RejectsUnknownKind) {
  expect_invalid([](json& d) { d["operation_kind"] = "copy"; }, "operation_kind",
                 "unknown kind 'copy'");
  expect_invalid([](json& d) { d["operation_kind"] = "unspecified"; }, "operation_kind",
                 "unknown kind");
}

TEST(RdmaMetadata, RejectsBadRanges) {
  expect_invalid([](json& d) { d["descriptors"][0]["size"] = 0; }, "descriptors[0].size",
                 "greater than zero");
  expect_invalid([](json& d) { d["descriptors"][0]["ptr"] = 0; }, "descriptors[0].ptr",
                 "must not be null");
  expect_invalid([](json& d) { d["descriptors"][1]["size"] = 11; }, "descriptors[1].size",
                 "ptr + size overflows");
  expect_invalid([](json& d) { d["descriptors"] = json::array(); }, "descriptors", "at least one");
  expect_invalid(
      [](json& d) {
        // Each range fits, their sum does not.
        d["descriptors"][0]["ptr"] = 1;
        d["descriptors"][0]["size"] = std::numeric_limits<std::uint64_t>::max() - 1;
        d["descriptors"][1]["ptr"] = 1;
        d["descriptors"][1]["size"] = 2;
      },
      "descriptors[1].size", "total size overflows");
}

TEST(RdmaMetadata, RejectsBadDeviceKeyAndToken) {
  expect_invalid([](json& d) { d["descriptors"][0]["device"] = "gpu"; }, "descriptors[0].device",
                 "not one of");
  expect_invalid([](json& d) { d["notification_key"] = "123"; }, "notification_key",
                 "16 lowercase hex");
  expect_invalid([](json& d) { d["token"] = "00112233445566778899AABBCCDDEEFF"; }, "token",
                 "32 lowercase hex");
  expect_invalid([](json& d) { d["token"] = "0011"; }, "token", "32 lowercase hex");
  expect_invalid([](json& d) { d["endpoints"] = json::array(); }, "endpoints", "at least one");
  expect_invalid([](json& d) { d["endpoints"][0]["method"] = ""; }, "endpoints[0].method",
                 "must not be empty");
}

TEST(RdmaMetadata, ValidateChecksHandBuiltValues) {
  RdmaMetadata m = sample();
  EXPECT_NO_THROW(m.validate());
  m.descriptors[0].size = 0;
  try {
    m.validate();
    ADD_FAILURE() << "accepted a zero-size descriptor";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidMetadata);
    EXPECT_EQ(e.field(), "descriptors[0].size");
  }
}

TEST(RdmaMetadata, IgnoresUnknownExtraFieldsOfTheSameVersion) {
  json doc = json::parse(sample().to_json());
  doc["future_field"] = {1, 2, 3};
  EXPECT_EQ(RdmaMetadata::from_json(doc.dump()), sample());
}

}  // namespace
}  // namespace ferry
