// Regions by verbs, the active side (docs/regions.md): ATTACH on the connection to the owner,
// transfers under the attachment's keys, each ending with an ENDED SEND behind its data.

#include <algorithm>
#include <cstring>

#include "transport/kit/exposures.hpp"
#include "transport/verbs/verbs_transport.hpp"
#include "transport/wire/status.hpp"

namespace ferry::transport::verbs {

using wire::FrameHeader;
using wire::FrameType;

VerbsRemoteRegion::~VerbsRemoteRegion() {
  if (client_ != nullptr) client_->forget_region(*this);
}

std::unique_ptr<Transfer> VerbsRemoteRegion::start(TransferSpec spec, TransferObserver& observer) {
  if (client_ == nullptr) throw Error(ErrorCode::InvalidState, "the verbs transport is closed");
  check_attached();
  if (auto refused = refuse_outside(spec, observer)) return refused;
  spec.remote_id = attachment;
  spec.token = secret;
  spec.endpoint = this->spec().endpoint;
  spec.peer_name = this->spec().peer_name;
  if (!spec.region_tag) spec.region_tag = std::string();
  return client_->start_attached(*this, std::move(spec), observer);
}

std::unique_ptr<RemoteRegion> VerbsClient::attach(AttachSpec spec, AttachObserver& observer) {
  // An endpoint that does not parse is bad metadata: thrown, not a set-up failure.
  const wire::SocketAddress dst = wire::endpoint_address(spec.endpoint);
  const std::uint64_t key = next_region_++;
  auto region =
      std::make_unique<VerbsRemoteRegion>(*this, t_.ctx_.defer, key, std::move(spec), observer);
  regions_[key] = region.get();
  std::shared_ptr<Conn> conn;
  try {
    conn = t_.link_to(dst);
  } catch (const Error& e) {
    region->on_lost(Error(ErrorCode::PeerLost,
                          "verbs cannot reach peer '" + region->spec().peer_name + "' at " +
                              region->spec().endpoint.address + ": " + e.message()),
                    /*setup=*/true);
    return region;
  }
  region->conn = conn->id;
  if (conn->state == Conn::State::up) send_attach(*conn, *region);
  return region;
}

void VerbsClient::send_attach(Conn& conn, VerbsRemoteRegion& region) {
  region.sent = true;
  Pending p;
  p.region = region.key;
  p.op = region.spec().region;
  FrameHeader h;
  h.type = FrameType::attach;
  h.req_id = pending_.add(conn.id, p);
  h.op_id = region.spec().region;
  h.token = region.spec().token;
  h.flags = static_cast<std::uint16_t>(region.spec().access);
  conn.send_ctl(h, {});
}

void VerbsClient::attach_answered(Conn& conn, VerbsRemoteRegion& region, const FrameHeader& h,
                                  const std::string& msg, const std::string& payload) {
  const std::string who = "peer '" + region.spec().peer_name + "'";
  if (h.type == FrameType::status) {
    region.on_refused(Error(h.status == 0 ? ErrorCode::ProtocolError : wire::from_wire(h.status),
                            who + " refused: " + wire::reason_of(h.status, msg)));
    return;
  }
  if (payload.empty() || payload.size() % 24 != 0) {
    region.on_refused(Error(ErrorCode::ProtocolError, who + " answered ATTACH with no keys"));
    return;
  }
  region.attachment = h.op_id;
  region.secret = h.token;
  region.windows = windows_of(payload);
  (void)conn;
  region.on_attach();
}

std::unique_ptr<Transfer> VerbsClient::start_attached(VerbsRemoteRegion& region, TransferSpec spec,
                                                      TransferObserver& observer) {
  auto handle = transfers_.make(std::move(spec), observer);
  auto* t = &handle->get();
  Conn* conn = region.conn == 0 ? nullptr : t_.conn_of(region.conn);
  if (conn == nullptr || conn->state != Conn::State::up) {
    transfers_.finish(*t, Error(ErrorCode::PeerLost, "the attachment's connection is gone"));
    return handle;
  }
  try {
    for (const Segment& s : t->spec.segments) {
      const MemoryKind kind = s.cuda_device >= 0 ? MemoryKind::cuda : MemoryKind::host;
      t->regs.push_back(s.len == 0 ? nullptr : t_.acquire({s.local, s.len, kind, s.cuda_device}));
    }
  } catch (const Error& e) {
    transfers_.finish(*t, e);
    return handle;
  }
  // Keyed already: the attachment's keys cover every transfer on it.
  t->conn = conn->id;
  t->secret = region.secret;
  t->windows = region.windows;
  if (t->total == 0) {
    t->all_posted = true;
    maybe_done(*conn, *t);
    return handle;
  }
  conn->ready.push_back(t->id());
  pump(*conn);
  return handle;
}

void VerbsClient::send_ended(Conn& conn, const VerbsTransfer& t,
                             const std::optional<Error>& error) {
  FrameHeader h;
  h.type = FrameType::ended;
  h.op_id = t.spec.remote_id;
  h.token = t.spec.token;
  h.flags = static_cast<std::uint16_t>(t.spec.access);
  if (error) h.status = wire::to_wire(error->code());
  const std::vector<std::byte> ranges = kit::claim_payload(t.spec.segments);
  conn.send_ctl(h, *t.spec.region_tag,
                std::string_view(reinterpret_cast<const char*>(ranges.data()), ranges.size()));
}

void VerbsClient::forget_region(VerbsRemoteRegion& region) {
  regions_.erase(region.key);
  Conn* conn = region.conn == 0 ? nullptr : t_.conn_of(region.conn);
  if (conn == nullptr || conn->state != Conn::State::up || !region.attached()) return;
  FrameHeader h;
  h.type = FrameType::detach;
  h.op_id = region.attachment;
  h.token = region.secret;
  conn->send_ctl(h, {});
}

}  // namespace ferry::transport::verbs
