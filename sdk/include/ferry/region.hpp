#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <ferry/descriptor.hpp>
#include <ferry/error.hpp>
#include <ferry/operation.hpp>
#include <ferry/rdma_metadata.hpp>

namespace ferry {

namespace detail {
class RegionState;
class AttachmentState;
}  // namespace detail

/// What the peers of a region may do to its memory.
enum class RegionAccess : std::uint8_t { read = 1, write = 2, read_write = 3 };

/// "read", "write" or "read_write".
const char* to_string(RegionAccess access) noexcept;

/// `length` bytes from byte `offset` of a region, its descriptors taken as one byte stream
/// (the first descriptor's bytes, then the second's, ...).
struct RegionRange {
  std::uint64_t offset = 0;
  std::uint64_t length = 0;
  friend bool operator==(const RegionRange&, const RegionRange&) = default;
};

/// What a peer needs to attach to a region. It is a credential: whoever holds it may attach
/// and touch the region's memory, within `access`, until the region ends or revokes that peer.
/// A value type.
///
/// Its JSON form (`to_json`, `from_json`) is versioned (`"kind": "ferry.region"`) and checked
/// as strictly as RdmaMetadata's: from_json throws Error(InvalidMetadata) whose field() names
/// the first offending field.
struct RegionMetadata {
  static constexpr int kVersion = 1;
  int version = kVersion;
  /// The region's id at its owner: 16 lowercase hex digits.
  std::string region_id;
  PeerIdentity owner;
  std::vector<Endpoint> endpoints;
  std::vector<RemoteDescriptor> descriptors;
  /// The attach token: 32 lowercase hex digits (128 random bits).
  std::string token;
  RegionAccess access = RegionAccess::read;
  /// Bytes per block; 0: no block layout. When set, the region's size is a multiple of it.
  std::uint64_t block_size = 0;

  std::uint64_t total_size() const noexcept;
  /// total_size() / block_size; 0 without a block layout.
  std::uint64_t block_count() const noexcept;
  std::string to_json() const;
  /// Throws Error(InvalidMetadata) naming the field.
  static RegionMetadata from_json(std::string_view json);
  /// Applies from_json's checks to this value; throws as from_json does.
  void validate() const;

  friend bool operator==(const RegionMetadata&, const RegionMetadata&) = default;
};

/// What a region's owner learns, in the order it happened.
struct RegionEvent {
  enum class Type : std::uint8_t {
    attached,  ///< a peer attached
    transfer,  ///< a transfer of a peer ended (status says how)
    detached,  ///< a peer detached (no error), was lost (error) or was revoked by the owner
    ended,     ///< the region ended (closed, deadline, connector closed): the last event
  };
  Type type = Type::attached;
  /// The attachment's id at the owner (16 hex digits); empty for `ended`.
  std::string attachment;
  std::string peer;     ///< the peer, described for messages
  std::string peer_id;  ///< its connector id (16 hex digits), when known
  std::string method;   ///< the method it attached by
  /// transfer: `read` (the peer read the region) or `write` (it wrote into it).
  OperationKind kind = OperationKind::unspecified;
  /// transfer: the ranges it reached, as region offsets.
  std::vector<RegionRange> ranges;
  /// transfer, with a block layout: the blocks of `ranges`, when they are whole blocks.
  std::vector<std::uint64_t> blocks;
  /// transfer: the tag its peer gave it (e.g. a request id).
  std::string tag;
  /// transfer: complete or errored; a write counts as complete only once its bytes are in
  /// the region's memory.
  OperationStatus status = OperationStatus::complete;
  std::optional<Error> error;
};

/// Called on the connector's loop thread, for every event of a region, in order. It must not
/// block; it may call into the region (revoke, say) and the connector. It runs after the event
/// is queued (with queue_events on): a thread it wakes finds the event in next_event().
using RegionCallback = std::function<void(const RegionEvent& event)>;

struct RegionOptions {
  RegionAccess access = RegionAccess::read;
  /// Bytes per block: peers may name blocks by index. 0: none. The region's size must be a
  /// multiple of it.
  std::uint64_t block_size = 0;
  /// A NATS subject at which to serve the metadata while the region lives (peers attach by
  /// Subject). Needs the connector's side channel.
  std::string subject;
  /// Deadline from creation: the region then ends as close() does, with ErrorCode::Timeout.
  /// Zero: none (a region lives until closed; the connector's default_timeout does not apply).
  std::chrono::milliseconds timeout{0};
  /// Events pushed on the loop thread (set here, so that none is missed).
  RegionCallback on_event;
  /// Events also kept for next_event(), at most `max_queued_events` (the oldest dropped
  /// beyond, counted by events_dropped()). Off: only on_event hears them.
  bool queue_events = true;
  std::size_t max_queued_events = 65536;
};

/// A live attachment, as the owner sees it.
struct RegionPeer {
  std::string attachment;
  std::string peer;
  std::string peer_id;
  std::string method;
  RegionAccess access = RegionAccess::read;
};

/// The owner's side of a region: memory exposed once, for any number of peers that attach
/// and transfer at once, until the owner closes it. Move-only.
///
/// Destructor: closes the region (see close()).
class Region {
 public:
  Region() noexcept;
  Region(Region&&) noexcept;
  Region& operator=(Region&& other) noexcept;
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;
  ~Region();

  explicit operator bool() const noexcept { return state_ != nullptr; }

  /// What peers need to attach; pass it by any channel (to_json). Any thread.
  const RegionMetadata& metadata() const;
  /// The region's id (16 hex digits). Any thread.
  const std::string& id() const;
  const std::vector<Descriptor>& descriptors() const;
  /// Until close(), the deadline or the connector's end. Any thread.
  bool is_open() const noexcept;
  /// Why it ended (Cancelled for close(), Timeout for the deadline); empty while open.
  std::optional<Error> error() const;

  /// The next event, waiting up to `timeout`; none when it passed (or queue_events is off,
  /// or the region ended and every event was taken). Any thread but the loop thread, where it
  /// does not wait.
  std::optional<RegionEvent> next_event(
      std::chrono::nanoseconds timeout = std::chrono::nanoseconds::zero());
  /// Events the queue dropped for want of room.
  std::uint64_t events_dropped() const;

  /// The peers attached now. Any thread (waits for the loop).
  std::vector<RegionPeer> peers() const;
  /// Ends one peer's access: `who` is an attachment id, or a peer's connector id (every
  /// attachment of it). When it returns, that peer's transfers touch the memory no more (they
  /// end Cancelled, naming the owner) and its next request is refused AccessDenied; the
  /// others go on. Returns how many attachments it ended. Any thread (waits for the loop).
  std::size_t revoke(const std::string& who);
  /// Ends the region: when it returns, no peer touches the memory again, transfers under way
  /// end Cancelled at their peers, later attaches are refused. Idempotent. Any thread.
  void close();

 private:
  friend class Connector;
  explicit Region(std::shared_ptr<detail::RegionState> state) noexcept;
  const detail::RegionState& state() const;
  std::shared_ptr<detail::RegionState> state_;
};

/// Per-transfer settings on an attachment.
struct TransferOptions {
  /// Deadline from the call; zero takes the connector's default_timeout.
  std::chrono::milliseconds timeout{0};
  /// Shown to the region's owner with the transfer's event (a request id, say): UTF-8 text of
  /// at most 256 bytes.
  std::string tag;
};

struct AttachOptions {
  /// What this attachment will do; unset: everything the region allows.
  std::optional<RegionAccess> access;
  /// Deadline for attaching (asking at a subject included); zero takes the connector's
  /// default_timeout, and 30 s when that is zero too.
  std::chrono::milliseconds timeout{0};
};

/// One peer's attachment to a region: attached once (method, connection, credential), then
/// any number of transfers, each an operation with the usual contract. Move-only.
///
/// Transfers may start before the attachment is made: they wait for it (and fail with its
/// error). Destructor: detaches (see detach()).
class Attachment {
 public:
  enum class State : std::uint8_t { attaching, attached, detached };
  /// Most separate (non-adjacent) ranges of the region one transfer reaches.
  static constexpr std::size_t kMaxRanges = 4096;

  Attachment() noexcept;
  Attachment(Attachment&&) noexcept;
  Attachment& operator=(Attachment&& other) noexcept;
  Attachment(const Attachment&) = delete;
  Attachment& operator=(const Attachment&) = delete;
  ~Attachment();

  explicit operator bool() const noexcept { return state_ != nullptr; }

  /// The region's metadata (known once attached, when attaching by subject). Any thread.
  RegionMetadata metadata() const;
  State state() const noexcept;
  /// The method it attached by; empty until attached.
  std::string method() const;
  /// Why it failed to attach, or ended (revoked, region closed, peer lost).
  std::optional<Error> error() const;
  /// Waits until attached; throws the error if it could not attach or has ended. Not on the
  /// loop thread (Error(WrongThread)).
  void wait_attached() const;

  /// Reads `remote` (ranges of the region, as one byte stream) into `local`; the totals must
  /// match. Throws InvalidArgument for ranges outside the region (before any byte moves),
  /// InvalidState when detached or the region is not readable; the rest is the operation's
  /// error. Any thread.
  [[nodiscard("dropping the handle cancels the operation")]] ReadOperation read(
      std::vector<RegionRange> remote, std::vector<Descriptor> local, TransferOptions options = {});
  /// Writes `local` into `remote`.
  [[nodiscard("dropping the handle cancels the operation")]] WriteOperation write(
      std::vector<Descriptor> local, std::vector<RegionRange> remote, TransferOptions options = {});
  /// The same by block index (the region needs a block layout): block i is the range
  /// [i * block_size, (i + 1) * block_size).
  [[nodiscard("dropping the handle cancels the operation")]] ReadOperation read_blocks(
      const std::vector<std::uint64_t>& blocks, std::vector<Descriptor> local,
      TransferOptions options = {});
  [[nodiscard("dropping the handle cancels the operation")]] WriteOperation write_blocks(
      std::vector<Descriptor> local, const std::vector<std::uint64_t>& blocks,
      TransferOptions options = {});

  /// One transfer of a batch.
  struct Transfer {
    OperationKind kind = OperationKind::read;
    std::vector<RegionRange> remote;
    std::vector<Descriptor> local;
    TransferOptions options;
  };
  /// Starts every transfer of `batch` with one hand-over to the loop; checks them all first
  /// (and throws, starting none, for the first that is refused).
  [[nodiscard("dropping the handles cancels the operations")]] std::vector<Operation> submit(
      std::vector<Transfer> batch);

  /// Ends the attachment: transfers under way are cancelled (they return when no transport
  /// touches their memory), and the owner hears of it. Idempotent. Any thread.
  void detach();

 private:
  friend class Connector;
  explicit Attachment(std::shared_ptr<detail::AttachmentState> state) noexcept;
  std::shared_ptr<detail::AttachmentState> state_;
};

}  // namespace ferry
