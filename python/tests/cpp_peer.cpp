// ferry_py_peer: the C++ side of the Python binding's cross-language tests
// (python/tests/test_cpp_peer.py). One operation or region per run, with the byte pattern the
// Python tests use: byte i of a buffer is (i * 131 + seed) & 0xff.
//
//   ferry_py_peer readable SIZE SEED [--subject S]   exposes the pattern; prints its metadata
//   ferry_py_peer writable SIZE SEED [--subject S]   exposes SIZE zero bytes; checks the pattern
//   ferry_py_peer read SIZE SEED [--subject S]       reads (metadata: one line on stdin)
//   ferry_py_peer write SIZE SEED [--subject S]      writes the pattern
//   ferry_py_peer region-read SIZE SEED BLOCK COUNT --subject S
//       a readable region of the pattern; prints each transfer event; ends after COUNT
//       completed transfers
//   ferry_py_peer region-write SIZE SEED BLOCK COUNT --subject S
//       a writable region of zeros; after COUNT completed transfers, checks each written block
//       holds the pattern at its region offset and prints "verified N blocks"
//
// Passive roles print "metadata <json>" (without --subject) and then "ready"; every role ends
// with "complete" or "error <what>" and exits 0 only on success. NATS: FERRY_NATS_URL.
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <set>
#include <string>
#include <vector>

#include <ferry/ferry.hpp>

namespace {

std::uint8_t pattern(std::uint64_t i, unsigned seed) {
  return static_cast<std::uint8_t>((i * 131 + seed) & 0xff);
}

void fill(std::vector<std::uint8_t>& v, unsigned seed, std::uint64_t base = 0) {
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = pattern(base + i, seed);
}

bool check(const std::uint8_t* p, std::size_t n, unsigned seed, std::uint64_t base = 0) {
  for (std::size_t i = 0; i < n; ++i) {
    if (p[i] != pattern(base + i, seed)) {
      std::printf("error byte %zu is %u, not %u\n", static_cast<std::size_t>(base + i), p[i],
                  pattern(base + i, seed));
      return false;
    }
  }
  return true;
}

void say(const std::string& line) {
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

int finish(ferry::Operation& op) {
  try {
    op.wait_for_completion();
  } catch (const ferry::Error& e) {
    say(std::string("error ") + e.what());
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: ferry_py_peer ROLE SIZE SEED [...] [--subject S]\n");
    return 2;
  }
  std::string role = argv[1];
  std::size_t size = std::strtoull(argv[2], nullptr, 10);
  unsigned seed = static_cast<unsigned>(std::strtoul(argv[3], nullptr, 10));
  std::vector<std::string> rest(argv + 4, argv + argc);
  std::string subject;
  std::vector<std::string> positional;
  for (std::size_t i = 0; i < rest.size(); ++i) {
    if (rest[i] == "--subject" && i + 1 < rest.size()) {
      subject = rest[++i];
    } else {
      positional.push_back(rest[i]);
    }
  }
  try {
    ferry::ConnectorOptions options;
    options.name = "cpp-peer";
    ferry::Connector connector(options);
    std::vector<std::uint8_t> buffer(size);
    ferry::OperationOptions oo;
    oo.subject = subject;
    auto metadata_line = [&] {
      std::string line;
      if (!std::getline(std::cin, line))
        throw ferry::Error(ferry::ErrorCode::InvalidState, "no metadata on stdin");
      return ferry::RdmaMetadata::from_json(line);
    };
    if (role == "readable" || role == "writable") {
      if (role == "readable") fill(buffer, seed);
      ferry::Operation op;
      if (role == "readable") {
        auto r = connector.create_readable({ferry::Descriptor(buffer)}, oo);
        if (subject.empty()) say("metadata " + r.metadata().to_json());
        op = std::move(r);
      } else {
        auto w = connector.create_writable({ferry::Descriptor(buffer)}, oo);
        if (subject.empty()) say("metadata " + w.metadata().to_json());
        op = std::move(w);
      }
      say("ready");
      if (int rc = finish(op)) return rc;
      if (role == "writable" && !check(buffer.data(), buffer.size(), seed)) return 1;
      say("complete");
      return 0;
    }
    if (role == "read" || role == "write") {
      if (role == "write") fill(buffer, seed);
      ferry::Operation op;
      if (role == "read") {
        op = subject.empty()
                 ? connector.begin_read(metadata_line(), {ferry::Descriptor(buffer)})
                 : connector.begin_read(ferry::Subject(subject), {ferry::Descriptor(buffer)});
      } else {
        op = subject.empty()
                 ? connector.begin_write({ferry::Descriptor(buffer)}, metadata_line())
                 : connector.begin_write({ferry::Descriptor(buffer)}, ferry::Subject(subject));
      }
      if (int rc = finish(op)) return rc;
      if (role == "read" && !check(buffer.data(), buffer.size(), seed)) return 1;
      say("complete");
      return 0;
    }
    if ((role == "region-read" || role == "region-write") && !positional.empty()) {
      std::uint64_t block = std::strtoull(positional[0].c_str(), nullptr, 10);
      std::uint64_t count =
          positional.size() > 1 ? std::strtoull(positional[1].c_str(), nullptr, 10) : 0;
      bool reading = role == "region-read";
      if (reading) fill(buffer, seed);
      ferry::RegionOptions ro;
      ro.access = reading ? ferry::RegionAccess::read : ferry::RegionAccess::write;
      ro.block_size = block;
      ro.subject = subject;
      ferry::Region region = connector.create_region({ferry::Descriptor(buffer)}, ro);
      say("ready");
      std::set<std::uint64_t> written;
      std::uint64_t done = 0;
      while (reading || done < count) {
        auto e = region.next_event(std::chrono::seconds(30));
        if (!e) {
          say("error no event within 30 s");
          return 1;
        }
        if (e->type != ferry::RegionEvent::Type::transfer) continue;
        std::string blocks;
        for (auto b : e->blocks) blocks += (blocks.empty() ? "" : ",") + std::to_string(b);
        say("transfer " + std::string(ferry::to_string(e->kind)) + " blocks=" + blocks +
            " tag=" + e->tag + " " + std::string(ferry::to_string(e->status)));
        if (e->status != ferry::OperationStatus::complete) continue;
        ++done;
        written.insert(e->blocks.begin(), e->blocks.end());
        if (reading && done >= count && count > 0) break;
      }
      if (!reading) {
        for (auto b : written) {
          if (!check(buffer.data() + b * block, block, seed, b * block)) return 1;
        }
        say("verified " + std::to_string(written.size()) + " blocks");
      }
      say("complete");
      return 0;
    }
    std::fprintf(stderr, "ferry_py_peer: unknown role %s\n", role.c_str());
    return 2;
  } catch (const ferry::Error& e) {
    say(std::string("error ") + e.what());
    return 1;
  }
}
