#include "bench/ferry_bench/point.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <new>
#include <random>
#include <stdexcept>
#include <utility>

namespace ferry_bench {

json PointSpec::to_json() const {
  return json{{"method", method},
              {"write", write},
              {"by_subject", by_subject},
              {"by_region", by_region},
              {"kv", kv},
              {"block_size", block_size},
              {"batch_size", batch_size},
              {"inflight", inflight},
              {"threads", threads},
              {"check", check},
              {"seed", seed},
              {"max_ops", max_ops},
              {"pool", pool},
              {"session", session},
              {"initiator_device", initiator_device},
              {"target_device", target_device}};
}

PointSpec PointSpec::from_json(const json& j) {
  PointSpec s;
  s.method = j.at("method").get<std::string>();
  s.write = j.at("write").get<bool>();
  s.by_subject = j.at("by_subject").get<bool>();
  s.by_region = j.at("by_region").get<bool>();
  s.kv = j.at("kv").get<bool>();
  s.block_size = j.at("block_size").get<std::size_t>();
  s.batch_size = j.at("batch_size").get<std::size_t>();
  s.inflight = j.at("inflight").get<unsigned>();
  s.threads = j.at("threads").get<unsigned>();
  s.check = j.at("check").get<bool>();
  s.seed = j.at("seed").get<std::uint64_t>();
  s.max_ops = j.at("max_ops").get<std::uint64_t>();
  s.pool = j.at("pool").get<std::size_t>();
  s.session = j.at("session").get<std::string>();
  s.initiator_device = j.value("initiator_device", -1);
  s.target_device = j.value("target_device", -1);
  if (s.block_size == 0 || s.batch_size == 0 || s.inflight == 0 || s.threads == 0 || s.pool == 0)
    throw std::invalid_argument("point spec with a zero size or count");
  return s;
}

Buffer::Buffer(std::size_t size, int device) : size_(size) {
  if (device >= 0) gpu_ = std::make_unique<ferry_samples::DeviceMemory>(device, size);
  // MAP_POPULATE: the pages are there before anything is timed.
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  data_ = static_cast<std::byte*>(p);
}

Buffer::~Buffer() {
  if (data_ != nullptr) ::munmap(data_, size_);
}

Buffer::Buffer(Buffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      gpu_(std::move(other.gpu_)) {}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) ::munmap(data_, size_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    gpu_ = std::move(other.gpu_);
  }
  return *this;
}

std::byte* Buffer::data() const { return gpu_ ? gpu_->data() : data_; }

void Buffer::push() {
  if (gpu_) gpu_->write(0, data_, size_);
}

void Buffer::pull() {
  if (gpu_) gpu_->read(0, data_, size_);
}

void check_device(int device) {
  if (device >= 0) ferry_samples::DeviceMemory probe(device, 4096);
}

std::vector<Piece> layout(const PointSpec& spec, Side side) {
  std::vector<Piece> pieces;
  pieces.reserve(spec.batch_size);
  if (!spec.kv) {
    for (std::size_t i = 0; i < spec.batch_size; ++i)
      pieces.push_back({i * spec.block_size, spec.block_size});
    return pieces;
  }
  std::vector<std::size_t> pages(spec.batch_size);
  for (std::size_t i = 0; i < pages.size(); ++i) pages[i] = 2 * i;
  // A fixed shuffle per side: the same every run, and the two sides' orders differ.
  std::mt19937_64 rng(side == Side::initiator ? 0x1f2e3d4c5b6a7988ULL : 0x8897a6b5c4d3e2f1ULL);
  std::shuffle(pages.begin(), pages.end(), rng);
  for (std::size_t page : pages) pieces.push_back({page * spec.block_size, spec.block_size});
  return pieces;
}

std::vector<ferry::Descriptor> descriptors(const Buffer& buffer, const std::vector<Piece>& pieces) {
  std::vector<ferry::Descriptor> out;
  out.reserve(pieces.size());
  for (const Piece& p : pieces) {
    if (buffer.device() < 0)
      out.emplace_back(buffer.data() + p.offset, p.size);
    else
      out.emplace_back(buffer.data() + p.offset, p.size, ferry::Device::cuda(buffer.device()));
  }
  return out;
}

std::vector<ferry::Descriptor> host_descriptors(const Buffer& buffer,
                                                const std::vector<Piece>& pieces) {
  std::vector<ferry::Descriptor> out;
  out.reserve(pieces.size());
  for (const Piece& p : pieces) out.emplace_back(buffer.host() + p.offset, p.size);
  return out;
}

namespace {

static_assert(std::endian::native == std::endian::little, "the pattern's byte order");

constexpr std::uint64_t kStep = 0x9e3779b97f4a7c15ULL;  // odd: words of one stream never repeat

std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// The stream's word k is base + k * kStep.
std::uint64_t base_of(std::uint64_t seed, std::uint64_t n) { return mix(seed ^ mix(n)); }

std::byte byte_at(std::uint64_t base, std::uint64_t offset) {
  const std::uint64_t word = base + (offset / 8) * kStep;
  return static_cast<std::byte>((word >> (8 * (offset % 8))) & 0xff);
}

// Walks the stream: `bytes(p, offset, count)` for runs not on a word boundary, `words(p,
// first_word, count)` for whole aligned words.
template <class Bytes, class Words>
void walk(const std::vector<ferry::Descriptor>& stream, Bytes&& bytes, Words&& words) {
  std::uint64_t offset = 0;
  for (const ferry::Descriptor& d : stream) {
    std::byte* p = d.bytes();
    std::size_t left = d.size();
    const std::size_t head = std::min<std::size_t>(left, (8 - offset % 8) % 8);
    if (head > 0) bytes(p, offset, head);
    p += head;
    offset += head;
    left -= head;
    const std::size_t whole = left / 8;
    if (whole > 0) words(p, offset / 8, whole);
    p += whole * 8;
    offset += whole * 8;
    left -= whole * 8;
    if (left > 0) bytes(p, offset, left);
    offset += left;
  }
}

}  // namespace

void fill_pattern(const std::vector<ferry::Descriptor>& stream, std::uint64_t seed,
                  std::uint64_t n) {
  const std::uint64_t base = base_of(seed, n);
  walk(
      stream,
      [&](std::byte* p, std::uint64_t offset, std::size_t count) {
        for (std::size_t i = 0; i < count; ++i) p[i] = byte_at(base, offset + i);
      },
      [&](std::byte* p, std::uint64_t first, std::size_t count) {
        std::uint64_t w = base + first * kStep;
        for (std::size_t i = 0; i < count; ++i, w += kStep) std::memcpy(p + 8 * i, &w, 8);
      });
}

Mismatch verify_pattern(const std::vector<ferry::Descriptor>& stream, std::uint64_t seed,
                        std::uint64_t n) {
  const std::uint64_t base = base_of(seed, n);
  Mismatch m;
  auto note = [&](std::uint64_t offset, std::uint64_t count) {
    if (m.bytes == 0) m.first_offset = offset;
    m.bytes += count;
  };
  walk(
      stream,
      [&](std::byte* p, std::uint64_t offset, std::size_t count) {
        for (std::size_t i = 0; i < count; ++i)
          if (p[i] != byte_at(base, offset + i)) note(offset + i, 1);
      },
      [&](std::byte* p, std::uint64_t first, std::size_t count) {
        std::uint64_t w = base + first * kStep;
        for (std::size_t i = 0; i < count; ++i, w += kStep) {
          std::uint64_t got;
          std::memcpy(&got, p + 8 * i, 8);
          if (got == w) continue;
          const std::uint64_t diff = got ^ w;
          for (unsigned b = 0; b < 8; ++b) {
            if (((diff >> (8 * b)) & 0xff) != 0) note((first + i) * 8 + b, 1);
          }
        }
      });
  return m;
}

ferry::ConnectorOptions connector_options(const std::string& method, const std::string& nats_url,
                                          const std::string& name, const std::string& metrics) {
  ferry::ConnectorOptions o;
  o.name = name;
  o.metrics.listen = metrics;
  o.transports = {method};
  o.cma.ptracer_any = true;
  o.nats.use_environment = false;
  o.nats.servers = {nats_url};
  return o;
}

std::string unavailable_reason(const std::string& method, const std::string& nats_url, int device,
                               bool exposed) {
  for (const ferry::MethodInfo& m :
       ferry::probe_methods(connector_options(method, nats_url, "ferry-bench"))) {
    if (m.method != method) continue;
    if (!m.available) return m.detail.empty() ? "not available here" : m.detail;
    // moves_cuda false (cma): CUDA memory on the initiator's side only, where the driver is
    // usable (else the point's device memory cannot be made, and says why).
    if (device >= 0 && !m.moves_cuda && exposed)
      return method + " does not expose CUDA memory (cuda:" + std::to_string(device) + ") here";
    // moves_host false (cuda_ipc): host memory on the initiator's side only.
    if (device < 0 && !m.moves_host && exposed) return method + " does not expose host memory";
    return {};
  }
  return "not built into this version of ferry";
}

std::size_t parse_size(const std::string& text) {
  std::size_t used = 0;
  unsigned long long value = 0;
  try {
    value = std::stoull(text, &used);
  } catch (const std::exception&) {
    throw std::invalid_argument("not a size: '" + text + "'");
  }
  std::string unit = text.substr(used);
  if (!unit.empty() && (unit.back() == 'B' || unit.back() == 'b')) unit.pop_back();
  if (unit.size() == 2 && (unit[1] == 'i' || unit[1] == 'I')) unit.pop_back();
  unsigned shift = 0;
  if (unit.empty()) {
    shift = 0;
  } else if (unit == "K" || unit == "k") {
    shift = 10;
  } else if (unit == "M" || unit == "m") {
    shift = 20;
  } else if (unit == "G" || unit == "g") {
    shift = 30;
  } else {
    throw std::invalid_argument("not a size: '" + text + "' (suffixes: K, M, G)");
  }
  if (value > (~0ULL >> shift)) throw std::invalid_argument("size too large: '" + text + "'");
  return static_cast<std::size_t>(value << shift);
}

std::string format_size(std::size_t bytes) {
  const char* units[] = {"", "K", "M", "G", "T"};
  unsigned u = 0;
  while (u < 4 && bytes >= 1024 && bytes % 1024 == 0) {
    bytes /= 1024;
    ++u;
  }
  return std::to_string(bytes) + units[u];
}

}  // namespace ferry_bench
