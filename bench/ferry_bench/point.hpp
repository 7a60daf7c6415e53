#pragma once

// What one sweep point is, as both processes of ferry-bench see it: the spec the initiator
// sends to the target, the buffers each side allocates for it, how an operation's descriptors
// lie in a buffer, and the byte pattern --check_consistency writes and verifies.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ferry/ferry.hpp>
#include <nlohmann/json.hpp>

#include "samples/support/device_memory.hpp"

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
  bool by_region = false;  ///< one region over the target's buffers, attached once
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
  int initiator_device = -1;  ///< the CUDA device of the initiator's buffers; -1: host memory
  int target_device = -1;     ///< the CUDA device of the target's buffers; -1: host memory

  std::size_t bytes_per_op() const { return block_size * batch_size; }
  /// A slot's buffer: the operation's bytes, twice that in KV mode (every other page used).
  std::size_t buffer_bytes() const { return kv ? 2 * bytes_per_op() : bytes_per_op(); }
  std::size_t slots() const { return std::size_t{inflight} * threads; }
  std::string op_type() const { return write ? "WRITE" : "READ"; }
  std::string subject(std::uint64_t n) const { return session + ".op." + std::to_string(n); }

  json to_json() const;
  static PointSpec from_json(const json& j);
};

/// Page-aligned memory, mapped and touched at once (no page faults while measuring); or, for
/// `device` >= 0, memory of that CUDA device with such host memory beside it, its host copy:
/// the CPU writes and reads the host copy, push() and pull() copy it to and from the device
/// through the driver (device memory is never touched by the CPU). Throws, saying why, when
/// CUDA cannot be used.
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(std::size_t size, int device = -1);
  ~Buffer();
  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  /// The memory ferry moves: host memory, or the device address.
  std::byte* data() const;
  std::size_t size() const { return size_; }
  int device() const { return gpu_ ? gpu_->ordinal() : -1; }
  /// Where the CPU writes and reads the bytes: the memory itself, or its host copy.
  std::byte* host() const { return data_; }
  /// Host copy to device, and back; nothing for host memory.
  void push();
  void pull();

 private:
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
  std::unique_ptr<ferry_samples::DeviceMemory> gpu_;
};

/// Throws std::runtime_error saying why when `device` (>= 0) cannot hold buffers here.
void check_device(int device);

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
/// The same pieces over the buffer's host() side, for fill_pattern and verify_pattern.
std::vector<ferry::Descriptor> host_descriptors(const Buffer& buffer,
                                                const std::vector<Piece>& pieces);

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
/// `metrics`: where it serves its Prometheus metrics (--metrics), or "".
ferry::ConnectorOptions connector_options(const std::string& method, const std::string& nats_url,
                                          const std::string& name, const std::string& metrics = {});
/// Empty when a connector made with connector_options(method) offers `method` here and it moves
/// memory of `device` (-1: host memory, else cuda:N) on that side (`exposed`: the target's,
/// which a peer reaches; else the initiator's); else why not, as ferry::probe_methods says (a
/// method that does not move such memory would refuse the point's operations).
std::string unavailable_reason(const std::string& method, const std::string& nats_url, int device,
                               bool exposed);

/// "4K" -> 4096 (K, M, G: powers of 1024). Throws std::invalid_argument.
std::size_t parse_size(const std::string& text);
/// 4096 -> "4K", 1536 -> "1536".
std::string format_size(std::size_t bytes);

}  // namespace ferry_bench
