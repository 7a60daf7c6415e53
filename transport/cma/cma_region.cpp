#include "transport/cma/cma_region.hpp"

#include "transport/cma/cma_transport.hpp"

namespace ferry::transport::cma {

CmaRemoteRegion::CmaRemoteRegion(CmaTransport& owner, std::uint64_t key, AttachSpec spec,
                                 AttachObserver& observer)
    : RemoteRegionBase(owner.ctx_.defer, std::move(spec), observer), owner_(owner), key_(key) {
  attach.region = this->spec().region;
  attach.token = this->spec().token;
  attach.access = this->spec().access;
}

CmaRemoteRegion::~CmaRemoteRegion() { owner_.forget_region(*this); }

std::unique_ptr<Transfer> CmaRemoteRegion::start(TransferSpec spec, TransferObserver& observer) {
  check_attached();
  spec.remote_id = attach.attachment;
  spec.token = attach.secret;
  spec.endpoint = this->spec().endpoint;
  spec.peer_name = this->spec().peer_name;
  if (!spec.region_tag) spec.region_tag = std::string();
  return owner_.start_attached(*this, std::move(spec), observer);
}

}  // namespace ferry::transport::cma
