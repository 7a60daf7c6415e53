#pragma once

// What one sweep point is, as both processes of ferry-bench see it: the spec the initiator
// sends to the target, the buffers each side allocates for it, how an operation's descriptors
// lie in a buffer, and the byte pattern --check_consistency writes and verifies.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <ferry/ferry.hpp>
#include <nlohmann/json.hpp>

namespace ferry_bench {

using Clock = std::chrono::steady_clock;
using json = nlohmann::ordered_json;

/// Buffers one side may hold for one point; a point that needs more for its in-flight
/// operations is skipped.
inline constexpr std::size_t kBufferBudget = std::size_t{1} << 30;

/// One point of the sweep, as the initiator tells the target.
struct PointSpec {
  std::string method;  ///< "tcp", "cma", "verbs"
  bool write = true;   ///< WRITE (target holds writables) or READ (target holds readables)
  bool by_subject = false;
  bool kv = false;
  std::size_t block_size = 0;  ///< bytes per descriptor (the page size in KV mode)
  std::size_t batch_size = 1;  ///< descriptors per operation (pages in KV mode)
  unsigned inflight = 1;       ///< per initiator thread
  unsigned threads = 1;
  bool check = false;
  std::uint64_t seed = 0;     ///< of the consistency pattern
  std::uint64_t max_ops = 0;  ///< the most passive operations the target creates
  std::size_t pool = 0;       ///< target buffers, each under one live operation at a time
  std::string session;        ///< subjects are <session>.op.<n>

  std::size_t bytes_per_op() const { return block_size * batch_size; }
  /// A slot's buffer: the operation's bytes, twice that in KV mode (every other page used).
  std::size_t buffer_bytes() const { return kv ? 2 * bytes_per_op() : bytes_per_op(); }
  std::size_t slots() const { return std::size_t{inflight} * threads; }
  std::string op_type() const { return write ? "WRITE" : "READ"; }
  std::string subject(std::uint64_t n) const { return session + ".op." + std::to_string(n); }

  json to_json() const;
  static PointSpec from_json(const json& j);
};

/// Page-aligned memory, mapped and touched at once (no page faults while measuring).
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(std::size_t size);
  ~Buffer();
  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  std::byte* data() const { return data_; }
  std::size_t size() const { return size_; }

 private:
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

/// Where one operation's descriptors lie in a slot's buffer: `batch_size` blocks one after
/// the other; in KV mode `batch_size` pages of every other page of a pool twice as large, in a
/// fixed shuffled order (different per side), so that no two descriptors are adjacent.
struct Piece {
  std::size_t offset;
  std::size_t size;
};
enum class Side { initiator, target };
std::vector<Piece> layout(const PointSpec& spec, Side side);
std::vector<ferry::Descriptor> descriptors(const Buffer& buffer, const std::vector<Piece>& pieces);

/// The consistency pattern: the byte stream of operation `n` (its descriptors in order, as
/// ferry matches them) is a sequence of 64-bit words that depends on `seed`, `n` and the
/// word's offset, so that stale, shifted or missing bytes all differ from it.
void fill_pattern(const std::vector<ferry::Descriptor>& stream, std::uint64_t seed,
                  std::uint64_t n);
struct Mismatch {
  std::uint64_t bytes = 0;         ///< bytes that differ from the pattern
  std::uint64_t first_offset = 0;  ///< stream offset of the first one
};
Mismatch verify_pattern(const std::vector<ferry::Descriptor>& stream, std::uint64_t seed,
                        std::uint64_t n);

/// A connector restricted to `method`, with a side channel at `nats_url`, and cma offered
/// where Yama would hide it (ptracer_any): the benchmark wants every method it is asked for.
ferry::ConnectorOptions connector_options(const std::string& method, const std::string& nats_url,
                                          const std::string& name);
/// Empty when a connector made with connector_options(method) offers `method` here; else why
/// not, as ferry::probe_methods says.
std::string unavailable_reason(const std::string& method, const std::string& nats_url);

/// "4K" -> 4096 (K, M, G: powers of 1024). Throws std::invalid_argument.
std::size_t parse_size(const std::string& text);
/// 4096 -> "4K", 1536 -> "1536".
std::string format_size(std::size_t bytes);

}  // namespace ferry_bench
