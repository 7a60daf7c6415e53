#include "sdk/src/passive_operation.hpp"

#include <algorithm>

#include "loop/ids.hpp"
#include "sdk/src/core.hpp"
#include "sdk/src/subject_pairing.hpp"
#include "transport/token.hpp"

namespace ferry::detail {

PassiveOperation::PassiveOperation(std::shared_ptr<Core> core_, std::uint64_t id_,
                                   OperationKind kind_, std::vector<Descriptor> local_)
    : OperationState(std::move(core_), id_, kind_, true, std::move(local_)) {}

void PassiveOperation::expose(const transport::Token& token) {
  transport::Exposure exposure;
  exposure.id = id;
  exposure.token = token;
  exposure.access =
      kind == OperationKind::read ? transport::Access::read : transport::Access::write;
  RdmaMetadata& m = metadata;
  m.operation_kind = kind;
  m.notification_key = id_hex;
  m.owner = core->identity;
  m.token = transport::token_to_hex(token);
  for (const Descriptor& d : local) {
    m.descriptors.push_back({reinterpret_cast<std::uint64_t>(d.ptr()), d.size(), d.device()});
    exposure.regions.push_back(region_of(d));
  }
  // Offered only by the methods that move every kind of this memory.
  const std::uint8_t kinds = memory_kinds_of(local);
  auto moves = [kinds](const transport::Transport& t) {
    return (t.capabilities().memory_kinds & kinds) == kinds;
  };
  try {
    if (std::none_of(core->transports.begin(), core->transports.end(),
                     [&](const auto& t) { return moves(*t); })) {
      std::string methods;
      for (const auto& t : core->transports)
        methods += (methods.empty() ? "" : ", ") + t->capabilities().method;
      throw Error(ErrorCode::Unsupported,
                  "no method of this connector moves CUDA memory (it has [" + methods +
                      "], which move host memory only)");
    }
    std::string refusals;
    for (const auto& t : core->transports) {
      if (!moves(*t)) continue;
      const std::size_t before = registrations_.size();
      std::string info;
      try {
        for (const transport::Region& r : exposure.regions)
          registrations_.push_back(t->register_exposed(r));
        info = t->expose(exposure, *this);
      } catch (const Error& e) {
        // A method that cannot serve this particular memory (CUDA memory without an IPC
        // handle, or that an RDMA device cannot reach, say) is not offered; the others are.
        if (e.code() != ErrorCode::Unsupported) throw;
        registrations_.resize(before);
        refusals += (refusals.empty() ? "" : "; ") + e.message();
        continue;
      }
      exposed_on_.push_back(t.get());
      for (const Endpoint& e : t->endpoints()) {
        m.endpoints.push_back(e);
        m.endpoints.back().info = info;
      }
    }
    if (exposed_on_.empty())
      throw Error(ErrorCode::Unsupported,
                  "no method of this connector can serve this memory: " + refusals);
  } catch (...) {
    release(OperationStatus::errored, Error(ErrorCode::Cancelled, "the operation was refused"));
    throw;
  }
}

bool PassiveOperation::accepts_notice(const std::string& token_hex,
                                      const std::string& claim_hex) const {
  transport::Token presented{};
  transport::Token expected{};
  if (!transport::token_from_hex(token_hex, presented) ||
      !transport::token_from_hex(metadata.token, expected) ||
      !transport::tokens_equal(presented, expected))
    return false;
  // Whoever holds the metadata may send a notice while nobody has claimed the operation;
  // once a peer has, only a notice carrying the secret the owner handed to that claim.
  if (!claim_) return true;
  transport::Token claim{};
  return transport::token_from_hex(claim_hex, claim) &&
         transport::tokens_equal(claim, claim_->secret);
}

void PassiveOperation::release(OperationStatus, const Error& reason) {
  for (transport::Transport* t : exposed_on_) t->revoke(id, reason);
  exposed_on_.clear();
  registrations_.clear();
  pairing::stop_serving(*core, *this);
}

void PassiveOperation::on_claimed(const transport::Claim& claim) {
  // One peer per operation: the methods it was not claimed by stop serving it, so that no
  // other peer can claim it there. (A claim by another method in the very same loop turn is
  // dropped with its revoked exposure, after at most the request that claimed it.)
  const Error taken(ErrorCode::AccessDenied,
                    "the operation is claimed by another peer (" + claim.peer + ")");
  std::erase_if(exposed_on_, [&](transport::Transport* t) {
    if (t->capabilities().method == claim.method) return false;
    t->revoke(id, taken);
    return true;
  });
  set_method(claim.method);
  set_peer(PeerIdentity{claim.peer_name, claim.peer_id, {}, 0});
  claim_ = claim;
  if (!claimed_at_) claimed_at_ = std::chrono::steady_clock::now();
  if (status() == OperationStatus::initialized) set_status(OperationStatus::in_progress);
  paired();
}

std::string PassiveOperation::pairing_text(std::chrono::milliseconds timeout) const {
  return "served at subject '" + subject + "' for " + std::to_string(timeout.count()) +
         " ms: " + (asked ? "a peer asked for it but none claimed it" : "nobody asked for it") +
         core->nats_note() +
         " (ConnectorOptions::subject_timeout; give the operation a deadline of its own to wait "
         "longer)";
}

void PassiveOperation::on_peer_finished(const std::string&, const std::optional<Error>& error) {
  if (error)
    finish(OperationStatus::errored, *error);
  else
    finish(OperationStatus::complete, std::nullopt);
}

void PassiveOperation::on_peer_lost(const Error& error) { finish(OperationStatus::errored, error); }

}  // namespace ferry::detail
