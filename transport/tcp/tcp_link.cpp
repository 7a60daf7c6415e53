#include "transport/tcp/tcp_link.hpp"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "transport/cuda/stager.hpp"
#include "transport/kit/exposures.hpp"
#include "transport/tcp/tcp_transport.hpp"
#include "transport/wire/status.hpp"

namespace ferry::transport::tcp {

namespace {

using wire::FrameHeader;
using wire::FrameType;

}  // namespace

TcpLink::TcpLink(TcpTransport& owner, std::uint64_t id, const wire::SocketAddress& address,
                 const std::string& peer_name)
    : owner_(owner), pending_([this](std::uint64_t, int delta) { conn_->expect_answers(delta); }) {
  const Context& ctx = owner_.ctx_;
  const std::string who = "cannot connect to peer '" + peer_name + "' at " + address.to_string();
  int fd = -1;
  try {
    fd = wire::make_stream_socket(address.family(), ctx.peer_timeout);
  } catch (const Error& e) {
    throw Error(ErrorCode::PeerLost, who + ": " + e.message());
  }
  bool connecting = false;
  if (::connect(fd, address.get(), address.length) != 0) {
    if (errno != EINPROGRESS) {
      const int err = errno;
      ::close(fd);
      throw Error(ErrorCode::PeerLost, who + ": " + wire::socket_error_text(err));
    }
    connecting = true;
  }
  conn_ = std::make_unique<wire::StreamConnection>(
      ctx.loop, static_cast<wire::StreamConnection::Handler&>(*this),
      wire::StreamConnection::Role::client, fd, id, address.to_string(), ctx.peer_timeout,
      connecting, wire::StreamConnection::Hello{ctx.local_name, ctx.local_id}, ctx.log);
  conn_->set_peer_name(peer_name);
  if (!conn_->open()) throw Error(ErrorCode::PeerLost, who + ": the connection closed at once");
}

TcpLink::~TcpLink() = default;

TcpTransfer* TcpLink::live(std::uint64_t id) const {
  TcpTransfer* t = owner_.transfers_.find(id);
  return t == nullptr || t->finished() ? nullptr : t;
}

void TcpLink::attach(TcpTransfer& t) {
  t.link = this;
  transfers_.insert(t.id());
  owner_.links_.used(this);
  pump(t);
}

void TcpLink::detach(TcpTransfer& t) { transfers_.erase(t.id()); }

void TcpLink::release(TcpTransfer& t) {
  // The frames first: a READ_RANGES partly written still reads its request's list.
  conn_->release(t.id());
  conn_->drop_sink(t.id());
  for (std::uint64_t req : t.reqs) pending_.forget(req);
  t.reqs.clear();
}

void TcpLink::pump(TcpTransfer& t) {
  const bool writing = t.spec.access == Access::write;
  wire::StreamConnection::Cork cork(*conn_);
  while (!t.finished() && t.seg < t.spec.segments.size() && t.inflight < owner_.options_.window &&
         request(t)) {
  }
  // A write is announced done right behind its last chunk; the peer answers DONE only after
  // every chunk before it is in its memory, so that answer completes the transfer.
  if (writing && !t.finished() && !t.done_sent && t.seg == t.spec.segments.size() &&
      t.copying == 0) {
    t.done_sent = true;
    send_done(t, nullptr);
  }
}

bool TcpLink::request(TcpTransfer& t) {
  const bool writing = t.spec.access == Access::write;
  if (!writing && t.seg_off == 0 && request_ranges(t)) return true;
  const Segment& s = t.spec.segments[t.seg];
  const std::uint64_t len = std::min<std::uint64_t>(owner_.options_.chunk_size, s.len - t.seg_off);
  std::byte* local = s.local + t.seg_off;
  std::uint64_t unit = 0;
  if (s.cuda_device >= 0) {
    // CUDA memory goes through a staging chunk; none free: go on when one comes back.
    try {
      unit = owner_.stager().open(t.id(), {{local, len, s.cuda_device}});
    } catch (const Error& e) {
      owner_.staging_failed(t, e);
      return false;
    }
    if (unit == 0) {
      t.waiting_chunk = true;
      return false;
    }
  }
  const std::uint64_t req = pending_.add(
      conn_->id(),
      Request{t.id(), writing ? Kind::write_chunk : Kind::read_chunk, local, len, unit});
  t.reqs.insert(req);
  FrameHeader h;
  h.type = writing ? FrameType::write : FrameType::read;
  h.req_id = req;
  h.op_id = t.spec.remote_id;
  h.addr = s.remote_addr + t.seg_off;
  h.len = len;
  h.token = t.spec.token;
  t.inflight += len;
  t.seg_off += len;
  if (t.seg_off == s.len) {
    ++t.seg;
    t.seg_off = 0;
  }
  if (unit == 0) {
    conn_->send(h, {}, writing ? local : nullptr, writing ? t.id() : 0);
    return true;
  }
  if (!writing) {
    conn_->send(h);
    return true;
  }
  // The WRITE leaves once its bytes are out of the device.
  ++t.copying;
  try {
    owner_.stager().fill(unit, [this, id = t.id(), req, h](const std::optional<Error>& error) {
      if (TcpTransfer* tt = live(id)) {
        --tt->copying;
        if (error) {
          owner_.staging_failed(*tt, *error);
          return;
        }
        if (Request* r = pending_.find(req, conn_->id()))
          conn_->send(h, {}, owner_.stager().chunk(r->unit), id);
        pump(*tt);  // more chunks, or the DONE behind the last one
      }
    });
  } catch (const Error& e) {
    owner_.staging_failed(t, e);
    return false;
  }
  return true;
}

bool TcpLink::request_ranges(TcpTransfer& t) {
  // A block list goes in one request: the owner checks every range, then answers each with a
  // DATA naming its address. A chunk or more goes in READs as before.
  const std::vector<Segment>& segments = t.spec.segments;
  const std::uint64_t cap = owner_.options_.chunk_size;
  std::size_t end = t.seg;
  std::uint64_t total = 0;
  while (end < segments.size() && end - t.seg < wire::kMaxReadRanges) {
    const Segment& s = segments[end];
    if (s.cuda_device >= 0 || s.len == 0 || s.len > cap - total) break;
    total += s.len;
    ++end;
  }
  if (end - t.seg < 2) return false;
  Request r(t.id(), Kind::read_ranges, nullptr, total);
  r.left = end - t.seg;
  r.pieces.reserve(r.left);
  r.list.resize(r.left * 16);
  for (std::size_t i = t.seg; i < end; ++i) {
    const Segment& s = segments[i];
    std::byte* at = r.list.data() + (i - t.seg) * 16;
    std::memcpy(at, &s.remote_addr, 8);
    std::memcpy(at + 8, &s.len, 8);
    r.pieces.push_back(Piece{s.local, s.remote_addr, s.len, false});
  }
  const std::byte* list = r.list.data();
  FrameHeader h;
  h.type = FrameType::read_ranges;
  h.op_id = t.spec.remote_id;
  h.token = t.spec.token;
  h.len = r.list.size();
  h.req_id = pending_.add(conn_->id(), std::move(r));
  t.reqs.insert(h.req_id);
  t.inflight += total;
  t.seg = end;
  t.seg_off = 0;
  conn_->send(h, {}, list, t.id());
  return true;
}

wire::Sink TcpLink::piece_sink(Request& r, const FrameHeader& h) {
  // Pieces come in order unless the owner stages device memory; one naming a range twice is
  // filled twice, once per DATA.
  const std::size_t n = r.pieces.size();
  for (std::size_t k = 0; k < n; ++k) {
    const std::size_t i = (r.next + k) % n;
    Piece& p = r.pieces[i];
    if (p.arrived || p.remote != h.addr || p.len != h.len) continue;
    p.arrived = true;  // counted when its payload is in (on_payload)
    r.next = (i + 1) % n;
    wire::Sink sink;
    sink.dest = p.local;
    sink.tag = r.transfer;
    return sink;
  }
  return wire::fatal("DATA of " + std::to_string(h.len) + " bytes at " + std::to_string(h.addr) +
                     " matches no range of read request " + std::to_string(h.req_id));
}

void TcpLink::send_done(TcpTransfer& t, const Error* error) {
  if (!conn_->open()) return;
  // Only a successful write waits for the answer; the rest are notices.
  const bool awaited = error == nullptr && t.spec.access == Access::write;
  if (t.spec.region_tag) {
    send_ended(t, error, awaited);
    return;
  }
  const std::uint64_t req = pending_.add(conn_->id(), Request{awaited ? t.id() : 0, Kind::done});
  if (awaited) t.reqs.insert(req);
  FrameHeader h;
  h.type = FrameType::done;
  h.req_id = req;
  h.op_id = t.spec.remote_id;
  h.token = t.spec.token;
  h.flags = static_cast<std::uint16_t>(t.spec.access);
  std::string message;
  if (error != nullptr) {
    h.status = wire::to_wire(error->code());
    message = error->message().substr(0, wire::kMaxMessage);
  }
  // A write's DONE is tagged with the transfer: if the transfer is cancelled before it
  // leaves, it is dropped with the chunks ahead of it, and never claims success.
  conn_->send(h, message, nullptr, awaited ? t.id() : 0);
}

void TcpLink::send_ended(TcpTransfer& t, const Error* error, bool awaited) {
  // A transfer on an attachment ends with ENDED: its tag and ranges for the owner's notice.
  // A successful write's is awaited (its answer says the bytes are in) and tagged with the
  // transfer, so that a cancel drops it; the others are notices whose ranges the link keeps
  // until they leave.
  FrameHeader h;
  h.type = FrameType::ended;
  h.op_id = t.spec.remote_id;
  h.token = t.spec.token;
  h.flags = static_cast<std::uint16_t>(t.spec.access);
  if (error != nullptr) h.status = wire::to_wire(error->code());
  std::vector<std::byte> ranges = kit::claim_payload(t.spec.segments);
  h.len = ranges.size();
  const std::string& tag = *t.spec.region_tag;
  if (awaited) {
    h.req_id = pending_.add(conn_->id(), Request{t.id(), Kind::done});
    t.reqs.insert(h.req_id);
    t.ended_ranges = std::move(ranges);
    conn_->send(h, tag, t.ended_ranges.data(), t.id());
    return;
  }
  const std::uint64_t key = kNoticeTag | next_notice_++;
  auto& kept = notices_[key] = std::move(ranges);
  conn_->send(h, tag, kept.data(), key);
}

void TcpLink::attach_region(TcpRemoteRegion& region) {
  region.link = this;
  regions_[region.id()] = &region;
  owner_.links_.used(this);
  FrameHeader h;
  h.type = FrameType::attach;
  h.req_id = pending_.add(conn_->id(), Request{region.id(), Kind::attach});
  h.op_id = region.spec().region;
  h.token = region.spec().token;
  h.flags = static_cast<std::uint16_t>(region.spec().access);
  conn_->send(h);
}

void TcpLink::drop_region(TcpRemoteRegion& region, bool detach) {
  regions_.erase(region.id());
  if (!detach || !conn_->open()) return;
  FrameHeader h;
  h.type = FrameType::detach;
  h.op_id = region.attachment();
  h.token = region.secret();
  conn_->send(h);
}

wire::Sink TcpLink::on_frame(wire::StreamConnection& conn, const FrameHeader& h,
                             std::string message) {
  switch (h.type) {
    case FrameType::attached: {
      if (h.len != 0) return wire::fatal("ATTACHED with a payload from a tcp server");
      std::optional<Request> r = pending_.take(h.req_id, conn.id());
      if (!r || r->kind != Kind::attach) return wire::fatal("ATTACHED answers no ATTACH");
      if (auto it = regions_.find(r->transfer); it != regions_.end()) {
        it->second->granted(h.op_id, h.token);
      } else if (conn_->open()) {
        // Detached (or given up) while its ATTACH was on the way: end the attachment the owner
        // made for nobody.
        FrameHeader d;
        d.type = FrameType::detach;
        d.op_id = h.op_id;
        d.token = h.token;
        conn_->send(d);
      }
      return {};
    }
    case FrameType::claimed:
      if (h.len != 0) return wire::fatal("CLAIMED with a payload from a tcp server");
      // Meant for the transfer of this link toward that operation (one at most: the owner binds
      // an operation to one connection, and to one claim).
      for (std::uint64_t id : transfers_)
        if (TcpTransfer* t = live(id); t != nullptr && !t->secret && t->spec.remote_id == h.op_id) {
          t->secret = h.token;
          break;
        }
      return {};
    case FrameType::data: {
      Request* r = pending_.find(h.req_id, conn.id());
      if (r == nullptr) {
        // The answer to a request of a transfer since cancelled: drop its bytes.
        if (h.len >
            std::max<std::uint64_t>(owner_.options_.max_request, owner_.options_.chunk_size))
          return wire::fatal("DATA of " + std::to_string(h.len) + " bytes for no request");
        return {};
      }
      if (r->kind == Kind::read_ranges) return piece_sink(*r, h);
      if (r->kind != Kind::read_chunk || h.len != r->len)
        return wire::fatal("DATA does not match read request " + std::to_string(h.req_id));
      wire::Sink sink;
      sink.dest = r->unit != 0 ? owner_.stager().chunk(r->unit) : r->local;
      sink.tag = r->transfer;
      return sink;
    }
    case FrameType::status:
      return on_status(h, message);
    default:
      return wire::fatal("unexpected frame type " + std::to_string(static_cast<int>(h.type)) +
                         " from a server");
  }
}

wire::Sink TcpLink::on_status(const FrameHeader& h, const std::string& message) {
  if (h.req_id == 0 && h.op_id != 0) {
    // The owner ended operation op_id (cancelled, deadline, closed) and says why.
    const Error ended(wire::from_wire(h.status),
                      peer() + " ended the operation: " + wire::reason_of(h.status, message));
    // One transfer of an operation; every transfer of an attachment.
    std::vector<TcpTransfer*> hit;
    for (std::uint64_t id : transfers_)
      if (TcpTransfer* t = live(id); t != nullptr && t->spec.remote_id == h.op_id) hit.push_back(t);
    for (TcpTransfer* t : hit) owner_.transfers_.finish(*t, ended);
    for (auto& [id, region] : regions_)
      if (region->attachment() == h.op_id) region->on_ended(ended);
    return {};
  }
  if (h.req_id == 0) {
    // The server explains why it is about to close the connection.
    conn_->set_notice(h.status, message);
    return {};
  }
  // Answers count only from the connection the request went out on.
  std::optional<Request> r = pending_.take(h.req_id, conn_->id());
  if (!r) return {};
  if (r->kind == Kind::attach) {
    if (h.status == 0) return wire::fatal("an ATTACH was answered with success but no ATTACHED");
    const Error refused(wire::from_wire(h.status),
                        peer() + " refused: " + wire::reason_of(h.status, message));
    if (auto it = regions_.find(r->transfer); it != regions_.end()) it->second->on_refused(refused);
    return {};
  }
  TcpTransfer* t = live(r->transfer);
  if (t == nullptr) return {};
  t->reqs.erase(h.req_id);
  if (h.status != 0) {
    const Error refused(wire::from_wire(h.status),
                        peer() + " refused: " + wire::reason_of(h.status, message));
    owner_.transfers_.finish(*t, refused);
    // The passive side learns that this peer gave up, instead of waiting for its deadline (it
    // ignores the notice if the operation is another peer's, or over).
    if (r->kind != Kind::done) send_done(*t, &refused);
    return {};
  }
  switch (r->kind) {
    case Kind::write_chunk:
      answered(*t, h.req_id, *r);
      break;
    case Kind::done:
      // The server answers DONE only after every frame before it: success while chunks are
      // unanswered is a lie, and waiting for them would hang (nothing more is due).
      if (t->done == t->total)
        owner_.transfers_.finish(*t, std::nullopt);
      else
        owner_.transfers_.finish(
            *t, Error(ErrorCode::ProtocolError,
                      peer() + " answered DONE before the write's last chunk (" +
                          std::to_string(t->done) + " of " + std::to_string(t->total) +
                          " bytes acknowledged)"));
      break;
    case Kind::read_chunk:
    case Kind::read_ranges:
      return wire::fatal("a read request was answered with success but no data");
    case Kind::attach:
      break;  // answered above
  }
  return {};
}

void TcpLink::on_payload(wire::StreamConnection& conn, const FrameHeader& h, std::uint64_t,
                         bool intact) {
  // The end of a DATA frame: of a READ_RANGES, the request is done with its last piece.
  if (Request* ranges = pending_.find(h.req_id, conn.id());
      ranges != nullptr && ranges->kind == Kind::read_ranges && --ranges->left > 0)
    return;
  std::optional<Request> r = pending_.take(h.req_id, conn.id());
  if (!r) return;  // its transfer was cancelled; the bytes were dropped
  TcpTransfer* t = live(r->transfer);
  if (t == nullptr || !intact) return;
  if (r->unit == 0) {
    answered(*t, h.req_id, *r);
    return;
  }
  // The bytes are in a staging chunk: the request is done once they are in the device.
  try {
    owner_.stager().drain(
        r->unit, [this, id = t->id(), req = h.req_id, rr = *r](const std::optional<Error>& error) {
          TcpTransfer* tt = live(id);
          if (tt == nullptr) return;
          if (error)
            owner_.staging_failed(*tt, *error);
          else
            answered(*tt, req, rr);
        });
  } catch (const Error& e) {
    owner_.staging_failed(*t, e);
  }
}

void TcpLink::answered(TcpTransfer& t, std::uint64_t req, const Request& r) {
  t.reqs.erase(req);
  if (r.unit != 0) owner_.stager().close(r.unit);
  t.inflight -= r.len;
  t.done += r.len;
  if (t.done < t.total) {
    pump(t);
    return;
  }
  if (t.spec.access == Access::read) {
    // All bytes are here: the transfer is complete, and the peer learns it may let go.
    send_done(t, nullptr);
    owner_.transfers_.finish(t, std::nullopt);
  }
  // A write completes when the answer to its DONE arrives.
}

void TcpLink::on_closed(wire::StreamConnection& conn, const std::string& reason) {
  const std::string who = conn.describe_peer();
  // A server that explained itself before closing (a protocol error: a configuration
  // mismatch, say) has not been lost: retrying would fail the same way.
  // Nor has one that broke the protocol: its lie ends what it touched as a ProtocolError.
  const Error error =
      !conn.notice().empty() ? Error(wire::from_wire(conn.notice_status()),
                                     "peer " + who + " closed the connection: " + conn.notice())
      : conn.sent_notice_status() != 0
          ? Error(wire::from_wire(conn.sent_notice_status()),
                  "connection to peer " + who + " closed: " + reason)
          : Error(ErrorCode::PeerLost, "connection to peer " + who + " lost: " + reason);
  std::vector<TcpTransfer*> on_it;
  for (std::uint64_t id : transfers_)
    if (TcpTransfer* t = live(id)) on_it.push_back(t);
  pending_.drop_connection(conn.id());
  std::vector<TcpRemoteRegion*> regions;
  for (auto& [id, region] : regions_) regions.push_back(region);
  regions_.clear();
  for (TcpRemoteRegion* region : regions) {
    region->link = nullptr;  // this link is about to be destroyed
    region->on_lost(error, /*setup=*/!conn.greeted());
  }
  // Before the peer's HELLO, nothing of either side's memory was touched: another method may
  // still work.
  owner_.link_lost(*this, on_it, error, /*setup=*/!conn.greeted());
}

}  // namespace ferry::transport::tcp
