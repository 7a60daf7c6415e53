// libFuzzer target: RdmaMetadata::from_json on arbitrary text (docs/testing.md).
//
// Findings: anything but ferry::Error escaping from_json (a std::exception of the JSON
// library, a bad_alloc from an unchecked size); a document that parses but whose to_json does
// not parse back to an equal value; validate() throwing on a value from_json accepted; and
// whatever AddressSanitizer and UndefinedBehaviorSanitizer catch on the way. And: from_json's
// direct reading of to_json's own form disagreeing with the general reader (a different value,
// or a different error).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <string_view>

#include <ferry/ferry.hpp>

#include "sdk/src/metadata_json.hpp"

namespace {

[[noreturn]] void finding(const char* what, std::string_view detail) {
  std::fprintf(stderr, "fuzz_metadata: %s: %.*s\n", what, static_cast<int>(detail.size()),
               detail.data());
  std::abort();
}

// Runs `f`; a ferry::Error is an answer, anything else a finding.
template <class F>
bool only_ferry_errors(const char* call, F&& f) {
  try {
    f();
    return true;
  } catch (const ferry::Error& e) {
    if (e.code() != ferry::ErrorCode::InvalidMetadata)
      finding("an Error that is not InvalidMetadata", e.what());
    return false;
  } catch (const std::exception& e) {
    finding(call, std::string("threw a non-ferry exception: ") + e.what());
  } catch (...) {
    finding(call, "threw something that is not a std::exception");
  }
}

// The value or the error a reader gives, as text to compare.
template <class F>
std::string outcome(F&& read) {
  try {
    return "ok " + read().to_json();
  } catch (const ferry::Error& e) {
    return "error " + std::string(ferry::to_string(e.code())) + " " + e.field() + ": " +
           e.message();
  } catch (...) {
    return "other";  // only_ferry_errors below reports it
  }
}

}  // namespace

// A region's metadata (docs/regions.md): the same promises of from_json, validate and to_json.
void check_region(std::string_view text) {
  ferry::RegionMetadata parsed;
  if (!only_ferry_errors("region from_json",
                         [&] { parsed = ferry::RegionMetadata::from_json(text); }))
    return;
  if (!only_ferry_errors("region validate", [&] { parsed.validate(); }))
    finding("RegionMetadata::validate() refused a value that from_json accepted", text);
  std::string json;
  try {
    json = parsed.to_json();
  } catch (const std::exception& e) {
    finding("RegionMetadata::to_json threw on a value from_json accepted", e.what());
  }
  ferry::RegionMetadata again;
  if (!only_ferry_errors("region from_json of to_json",
                         [&] { again = ferry::RegionMetadata::from_json(json); }))
    finding("RegionMetadata::to_json wrote a document that from_json refuses", json);
  if (!(again == parsed)) finding("the round trip changed the region's metadata", json);
  // One document is never both kinds.
  try {
    (void)ferry::RdmaMetadata::from_json(text);
    finding("a document read as both a region's and an operation's metadata", text);
  } catch (const ferry::Error&) {
  }
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  check_region(text);

  if (outcome([&] { return ferry::RdmaMetadata::from_json(text); }) !=
      outcome([&] { return ferry::detail::metadata_from_json_general(text); }))
    finding("from_json and the general reader disagree", text);

  ferry::RdmaMetadata parsed;
  if (!only_ferry_errors("from_json", [&] { parsed = ferry::RdmaMetadata::from_json(text); }))
    return 0;

  // from_json validates: the value it returns must pass validate() as it is.
  if (!only_ferry_errors("validate", [&] { parsed.validate(); }))
    finding("validate() refused a value that from_json accepted", text);

  std::string json;
  try {
    json = parsed.to_json();
  } catch (const std::exception& e) {
    finding("to_json threw on a value from_json accepted", e.what());
  }
  ferry::RdmaMetadata again;
  if (!only_ferry_errors("from_json of to_json",
                         [&] { again = ferry::RdmaMetadata::from_json(json); }))
    finding("to_json wrote a document that from_json refuses", json);
  if (!(again == parsed)) finding("the round trip changed the metadata", json);
  // The serialized form is canonical: a second round trip writes the same text.
  if (again.to_json() != json) finding("to_json is not stable across a round trip", json);
  return 0;
}
