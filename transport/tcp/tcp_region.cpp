#include "transport/tcp/tcp_region.hpp"

#include "transport/tcp/tcp_link.hpp"
#include "transport/tcp/tcp_transport.hpp"

namespace ferry::transport::tcp {

TcpRemoteRegion::TcpRemoteRegion(TcpTransport& owner, std::uint64_t id, AttachSpec spec,
                                 AttachObserver& observer)
    : RemoteRegionBase(owner.ctx_.defer, std::move(spec), observer), owner_(owner), id_(id) {}

TcpRemoteRegion::~TcpRemoteRegion() { owner_.forget_region(*this, /*detach=*/attached()); }

std::unique_ptr<Transfer> TcpRemoteRegion::start(TransferSpec spec, TransferObserver& observer) {
  check_attached();
  if (auto refused = refuse_outside(spec, observer)) return refused;
  spec.remote_id = attachment_;
  spec.token = secret_;
  spec.endpoint = this->spec().endpoint;
  spec.peer_name = this->spec().peer_name;
  if (!spec.region_tag) spec.region_tag = std::string();
  return owner_.start_on(*link, std::move(spec), observer);
}

void TcpRemoteRegion::granted(std::uint64_t attachment, const Token& secret) {
  if (attached()) return;
  attachment_ = attachment;
  secret_ = secret;
  on_attach();
}

}  // namespace ferry::transport::tcp
