// A downstream program: moves a small buffer between two connectors in this process using
// nothing but ferry's installed public API. Exit status 0 when the bytes arrived intact.
#include <ferry/ferry.hpp>

#include <chrono>
#include <cstddef>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

namespace {

constexpr auto kWait = std::chrono::seconds(60);

ferry::ConnectorOptions named(const char* name) {
  ferry::ConnectorOptions options;
  options.name = name;
  return options;
}

int run() {
  constexpr std::size_t kSize = 4096 + 13;
  std::vector<unsigned char> src(kSize);
  for (std::size_t i = 0; i < kSize; ++i) {
    src[i] = static_cast<unsigned char>((i * 131 + 7) % 251);
  }
  std::vector<unsigned char> dst(kSize, 0);

  ferry::Connector owner(named("downstream-owner"));
  ferry::Connector reader(named("downstream-reader"));

  ferry::ReadableOperation readable = owner.create_readable({ferry::Descriptor(src.data(), kSize)});
  // The metadata travels as JSON, as it would between processes.
  const std::string json = readable.metadata().to_json();
  const ferry::RdmaMetadata metadata = ferry::RdmaMetadata::from_json(json);

  // Two descriptors on this side: the stream is split differently from the owner's.
  ferry::ReadOperation read = reader.begin_read(
      metadata,
      {ferry::Descriptor(dst.data(), 100), ferry::Descriptor(dst.data() + 100, kSize - 100)});

  if (!read.wait_for_completion(kWait)) {
    std::fprintf(stderr, "read did not complete in time (status %s)\n",
                 std::string(ferry::to_string(read.status())).c_str());
    return 1;
  }
  if (!readable.wait_for_completion(kWait)) {
    std::fprintf(stderr, "readable did not complete in time (status %s)\n",
                 std::string(ferry::to_string(readable.status())).c_str());
    return 1;
  }
  if (read.status() != ferry::OperationStatus::complete ||
      readable.status() != ferry::OperationStatus::complete) {
    std::fprintf(stderr, "unexpected status: read %s, readable %s\n",
                 std::string(ferry::to_string(read.status())).c_str(),
                 std::string(ferry::to_string(readable.status())).c_str());
    return 1;
  }
  for (std::size_t i = 0; i < kSize; ++i) {
    if (dst[i] != src[i]) {
      std::fprintf(stderr, "byte %zu differs: got %u, want %u\n", i, unsigned{dst[i]},
                   unsigned{src[i]});
      return 1;
    }
  }
  std::printf("downstream: read %zu bytes from %s intact\n", kSize, metadata.owner.name.c_str());
  return 0;
}

}  // namespace

int main() {
  try {
    return run();
  } catch (const ferry::Error& e) {
    std::fprintf(stderr, "ferry error: %s\n", e.what());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
  }
  return 1;
}
