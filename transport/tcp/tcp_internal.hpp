#pragma once

// Shared by the parts of the TCP transport (tcp_transport.cpp: listener and connections;
// tcp_server.cpp: serving exposures; tcp_client.cpp: active transfers). Not an interface.

#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "transport/tcp/tcp_transport.hpp"
#ifdef FERRY_WITH_CUDA
#include "transport/cuda/copy_engine.hpp"
#endif

namespace ferry::transport::tcp {

/// An active transfer: its segments are cut into requests of at most chunk_size bytes, with
/// at most `window` bytes requested and not yet done.
class TcpTransfer final : public Transfer {
 public:
  TcpTransfer(TcpTransport& transport, std::uint64_t transfer_id, TransferSpec what,
              TransferObserver& obs)
      : owner(&transport), id(transfer_id), spec(std::move(what)), observer(&obs) {
    for (const Segment& s : spec.segments) total += s.len;
  }
  ~TcpTransfer() override {
    if (owner != nullptr) owner->forget_transfer(*this);
  }
  void cancel(const Error& reason) override {
    if (owner != nullptr) owner->cancel_transfer(*this, reason);
  }
  std::optional<Token> claim_secret() const override { return secret; }

  TcpTransport* owner;  // null once the transport let go of it
  std::uint64_t id;
  TransferSpec spec;
  TransferObserver* observer;
  Connection* conn = nullptr;
  std::size_t seg = 0;
  std::uint64_t seg_off = 0;
  std::uint64_t inflight = 0;
  std::uint64_t done = 0;
  std::uint64_t total = 0;
  bool done_sent = false;
  bool finished = false;  // succeeded or failed; nothing more is sent or received for it
  bool notified = false;
  std::optional<Token> secret;             // the owner's claim secret, once it sent it
  std::unordered_set<std::uint64_t> reqs;  // requests awaiting an answer
  // CUDA memory, staged through pinned host chunks: the chunk each request holds, and the
  // copy between it and the device in flight (0: none).
  struct Staged {
    std::byte* chunk = nullptr;
    std::uint64_t copy = 0;
  };
  std::unordered_map<std::uint64_t, Staged> staged;  // by request
  std::uint64_t copying = 0;   // write chunks still being copied out of the device
  bool waiting_chunk = false;  // stopped pumping for want of a staging chunk
};

}  // namespace ferry::transport::tcp
