#include "transport/verbs/verbs_conn.hpp"

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "transport/wire/status.hpp"

namespace ferry::transport::verbs {

Conn::Conn(Owner& owner, const Context& ctx, const VerbsApi& api, const VerbsOptions& options,
           Counters& counters, std::uint64_t conn_id, bool is_active)
    : id(conn_id),
      active(is_active),
      owner_(owner),
      loop_(ctx.loop),
      log_(ctx.log),
      api_(api),
      queue_depth_(options.queue_depth),
      signal_every_(options.signal_every),
      counters_(counters),
      silence_(
          ctx.loop, ctx.peer_timeout,
          [this, ms = ctx.peer_timeout.count()] {
            owner_.conn_failed(*this, ErrorCode::PeerLost,
                               "the peer has not answered for " + std::to_string(ms) + " ms");
          },
          ctx.log) {}

Conn::~Conn() {
  silence_.stop();
  timer_.reset();
  if (qp != nullptr && cm != nullptr) api_.destroy_qp(cm);
  qp = nullptr;
  if (bufs_mr_ != nullptr) api_.dereg_mr(bufs_mr_);
  bufs_mr_ = nullptr;
  if (cm != nullptr) api_.destroy_id(cm);
  cm = nullptr;
}

void Conn::make_qp(Device& device) {
  dev = &device;
  ibv_qp_init_attr attr{};
  attr.send_cq = device.cq;
  attr.recv_cq = device.cq;
  attr.qp_type = IBV_QPT_RC;
  attr.sq_sig_all = 0;
  attr.cap.max_send_wr = queue_depth_;
  attr.cap.max_recv_wr = kRecvSlots;
  attr.cap.max_send_sge = static_cast<std::uint32_t>(device.max_sge);
  attr.cap.max_recv_sge = 1;
  if (api_.create_qp(cm, device.pd->pd, &attr) != 0)
    throw Error(ErrorCode::Internal, std::string("rdma_create_qp: ") + std::strerror(errno));
  qp = cm->qp;
  qp_num = qp->qp_num;
  bufs_.resize(static_cast<std::size_t>(kRecvSlots + kSendSlots) * kCtlBytes);
  bufs_mr_ = api_.reg_mr(device.pd->pd, bufs_.data(), bufs_.size(), IBV_ACCESS_LOCAL_WRITE);
  if (bufs_mr_ == nullptr)
    throw Error(ErrorCode::Internal,
                std::string("cannot register control buffers: ") + std::strerror(errno));
  for (std::uint32_t s = 0; s < kSendSlots; ++s) free_sends_.push_back(kSendSlots - 1 - s);
  for (std::uint32_t s = 0; s < kRecvSlots; ++s) post_recv(s);
}

void Conn::post_recv(std::uint32_t slot) {
  ibv_sge sge{};
  sge.addr = reinterpret_cast<std::uint64_t>(bufs_.data()) + std::uint64_t{slot} * kCtlBytes;
  sge.length = kCtlBytes;
  sge.lkey = bufs_mr_->lkey;
  ibv_recv_wr wr{};
  wr.wr_id = kRecvBit | slot;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  (void)api_.post_recv(qp, &wr, &bad);
}

std::string Conn::why_failed(ibv_wc_status status) const {
  std::string text = wc_status_text(status);
  if (status == IBV_WC_REM_ACCESS_ERR) return text;
  return text + port_down();
}

std::string Conn::port_down() const {
  if (dev == nullptr) return {};
  const std::uint8_t port = cm != nullptr && cm->port_num != 0 ? cm->port_num : 1;
  ibv_port_attr attr{};
  if (api_.query_port(dev->ctx, port, &attr) == 0 && attr.state != IBV_PORT_ACTIVE)
    return " (" + dev->name + " port " + std::to_string(port) + " is down)";
  return {};
}

void Conn::send_ctl(const wire::FrameHeader& h, std::string_view msg, std::string_view body) {
  wire::FrameHeader out = h;
  out.msg_len = static_cast<std::uint32_t>(std::min<std::size_t>(msg.size(), wire::kMaxMessage));
  out.len = body.size();
  const auto head = wire::encode(out);
  std::string bytes(reinterpret_cast<const char*>(head.data()), head.size());
  bytes.append(msg.substr(0, out.msg_len));
  bytes.append(body);
  for (std::size_t at = 0; at < bytes.size(); at += kCtlBytes) {
    CtlItem item;
    item.bytes = bytes.substr(at, kCtlBytes);
    outbox.push_back(std::move(item));
  }
  pump_ctl();
}

void Conn::pump_ctl() {
  if (state != State::up) return;
  while (!outbox.empty() && posted.size() < queue_depth_) {
    CtlItem& item = outbox.front();
    ibv_send_wr wr{};
    ibv_sge sge{};
    Posted p;
    p.seq = next_seq_;
    wr.wr_id = p.seq;
    if (item.mw != nullptr) {
      wr.opcode = IBV_WR_BIND_MW;
      wr.bind_mw.mw = item.mw;
      wr.bind_mw.rkey = item.rkey;
      wr.bind_mw.bind_info = item.bind;
      wr.send_flags = IBV_SEND_SIGNALED;
    } else {
      if (free_sends_.empty()) return;
      p.slot = static_cast<std::int32_t>(free_sends_.back());
      std::byte* buf =
          bufs_.data() + (std::size_t{kRecvSlots} + static_cast<std::size_t>(p.slot)) * kCtlBytes;
      std::memcpy(buf, item.bytes.data(), item.bytes.size());
      sge.addr = reinterpret_cast<std::uint64_t>(buf);
      sge.length = static_cast<std::uint32_t>(item.bytes.size());
      sge.lkey = bufs_mr_->lkey;
      wr.opcode = IBV_WR_SEND;
      wr.sg_list = &sge;
      wr.num_sge = 1;
      wr.send_flags = IBV_SEND_SIGNALED;
    }
    ibv_send_wr* bad = nullptr;
    if (api_.post_send(qp, &wr, &bad) != 0) {
      owner_.conn_failed(
          *this, ErrorCode::Internal,
          std::string("ibv_post_send of a control message: ") + std::strerror(errno));
      return;
    }
    if (p.slot >= 0) free_sends_.pop_back();
    ++next_seq_;
    posted.push_back(p);
    outbox.pop_front();
  }
  watch();
}

bool Conn::post_data(std::uint64_t transfer, Access access, std::uint64_t remote,
                     std::uint32_t rkey, ibv_sge* sges, std::size_t n, bool last,
                     std::uint64_t chunk) {
  ibv_send_wr wr{};
  Posted p;
  p.seq = next_seq_++;
  p.transfer = transfer;
  p.chunk = chunk;
  wr.wr_id = p.seq;
  wr.opcode = access == Access::read ? IBV_WR_RDMA_READ : IBV_WR_RDMA_WRITE;
  wr.sg_list = sges;
  wr.num_sge = static_cast<int>(n);
  wr.wr.rdma.remote_addr = remote;
  wr.wr.rdma.rkey = rkey;
  // Selective signalling: one in signal_every, the last of a transfer (or of a staging chunk),
  // and the one that fills the queue (so that some completion always comes back to make room).
  const bool signaled =
      ++since_signal_ >= signal_every_ || last || posted.size() + 1 >= queue_depth_;
  if (signaled) {
    wr.send_flags = IBV_SEND_SIGNALED;
    since_signal_ = 0;
    ++counters_.signaled_wrs;
  }
  p.signaled = signaled;
  ibv_send_wr* bad = nullptr;
  if (api_.post_send(qp, &wr, &bad) != 0) {
    owner_.conn_failed(*this, ErrorCode::Internal,
                       std::string("ibv_post_send: ") + std::strerror(errno));
    return false;
  }
  posted.push_back(p);
  ++counters_.data_wrs;
  watch();
  return true;
}

bool Conn::post_drain_marker() {
  if (qp == nullptr || posted.empty() || posted.back().signaled) return false;
  // A zero-length RDMA WRITE: a queue pair in error executes nothing, it flushes the work
  // request (IBV_WC_WR_FLUSH_ERR), which reports even where unsignalled ones did not.
  Posted p;
  p.seq = next_seq_;
  ibv_send_wr wr{};
  wr.wr_id = p.seq;
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.send_flags = IBV_SEND_SIGNALED;
  ibv_send_wr* bad = nullptr;
  if (api_.post_send(qp, &wr, &bad) != 0) return false;
  ++next_seq_;
  posted.push_back(p);
  return true;
}

std::vector<Posted> Conn::retire(const ibv_wc& wc) {
  // Work requests complete in order: one completion retires every unsignalled one before it.
  std::vector<Posted> out;
  while (!posted.empty() && posted.front().seq <= wc.wr_id) {
    out.push_back(posted.front());
    posted.pop_front();
    if (out.back().slot >= 0) free_sends_.push_back(static_cast<std::uint32_t>(out.back().slot));
  }
  if (wc.status == IBV_WC_SUCCESS) silence_.heard();
  watch();
  return out;
}

void Conn::received(const ibv_wc& wc) {
  const auto slot = static_cast<std::uint32_t>(wc.wr_id & ~kRecvBit);
  if (slot >= kRecvSlots || wc.byte_len > kCtlBytes) {
    owner_.conn_failed(*this, ErrorCode::ProtocolError, "a control message out of bounds");
    return;
  }
  silence_.heard();
  const std::byte* data = bufs_.data() + std::size_t{slot} * kCtlBytes;
  std::size_t left = wc.byte_len;
  // A message may span several SENDs, and a SEND end one message and start another.
  while (left > 0 && state != State::failed) {
    const std::span<std::byte> into = reader_.next();
    const std::size_t n = std::min(left, into.size());
    std::memcpy(into.data(), data, n);
    data += n;
    left -= n;
    if (auto bad = reader_.advance(n)) {
      owner_.conn_failed(*this, ErrorCode::ProtocolError, *bad);
      return;
    }
  }
  if (state != State::failed) post_recv(slot);
}

wire::Sink Conn::on_frame(const wire::FrameHeader& h, std::string message) {
  if (state == State::failed) return {};
  if (wire::has_payload(h.type) && h.len > kMaxCtlPayload)
    return wire::fatal("a control message too long");
  return owner_.ctl_frame(*this, h, std::move(message));
}

void Conn::on_payload(const wire::FrameHeader& h, std::uint64_t, bool intact) {
  if (state == State::failed) return;
  owner_.ctl_payload(*this, h, intact);
}

void Conn::expect_answers(int delta) noexcept {
  answers_ += delta;
  if (answers_ < 0) answers_ = 0;
  watch();
}

void Conn::watch() noexcept {
  const bool awaiting = state == State::up && (answers_ > 0 || !posted.empty());
  if (awaiting == awaiting_) return;
  awaiting_ = awaiting;
  silence_.expect(awaiting ? +1 : -1);
}

void Conn::arm_deadline(std::chrono::milliseconds limit) {
  timer_ = loop::Timer::timer(loop_, this);
  uv_timer_start(
      timer_.get(),
      [](uv_timer_t* t) {
        auto* self = static_cast<Conn*>(t->data);
        if (self == nullptr || self->state == State::up || self->state == State::failed) return;
        loop::guarded(self->log_, "a verbs connect deadline", [self] {
          self->owner_.conn_failed(*self, ErrorCode::PeerLost, "no connection within the deadline");
        });
      },
      static_cast<std::uint64_t>(limit.count()), 0);
}

void Conn::quiet() noexcept {
  awaiting_ = false;
  silence_.stop();
}

}  // namespace ferry::transport::verbs
