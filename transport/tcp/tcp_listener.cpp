#include "transport/tcp/tcp_listener.hpp"

#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "transport/cuda/stager.hpp"
#include "transport/wire/status.hpp"

namespace ferry::transport::tcp {

namespace {

using wire::FrameHeader;
using wire::FrameType;
using wire::StreamConnection;

int listen_on(const wire::SocketAddress& bind) {
  const int fd = ::socket(bind.family(), SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) throw Error(ErrorCode::Internal, "socket: " + wire::socket_error_text(errno));
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(fd, bind.get(), bind.length) != 0 || ::listen(fd, SOMAXCONN) != 0) {
    const int err = errno;
    ::close(fd);
    throw Error(ErrorCode::Internal,
                "cannot listen on " + bind.to_string() + ": " + wire::socket_error_text(err));
  }
  return fd;
}

// Whether every page of [p, p + n) is mapped: mincore() fails with ENOMEM for a range with a
// hole. Memory the owner freed while exposed would otherwise fail the send itself (EFAULT)
// half way through a frame, leaving the peer nothing to read but a closed connection.
bool mapped(const std::byte* p, std::size_t n) {
  static const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto first = reinterpret_cast<std::uintptr_t>(p) & ~(page - 1);
  const auto end = reinterpret_cast<std::uintptr_t>(p) + n;
  unsigned char vec[1024];
  for (std::uintptr_t at = first; at < end;) {
    const std::uintptr_t len = std::min<std::uintptr_t>(end - at, page * sizeof vec);
    if (::mincore(reinterpret_cast<void*>(at), len, vec) != 0 && errno == ENOMEM) return false;
    at += (len + page - 1) / page * page;
  }
  return true;
}

// Whether the host memory `entry` grants is mapped, looked at once per exposure, at its first
// read: one mincore() per span then, none per request after (a region's block lists stay as
// cheap as they were). Memory freed after that first read fails the send itself, which the
// owner then reports (EFAULT) and the reader sees as a closed connection.
bool memory_mapped(kit::Exposures::Entry& entry) {
  using Mapped = kit::Exposures::Entry::Mapped;
  if (entry.mapped == Mapped::unchecked) {
    entry.mapped = Mapped::yes;
    for (const Region& span : entry.spans) {
      if (span.kind == MemoryKind::host && !mapped(span.ptr, span.size)) {
        entry.mapped = Mapped::no;
        break;
      }
    }
  }
  return entry.mapped == Mapped::yes;
}

bool refuse_unmapped(kit::Exposures::Entry& entry, std::uint64_t len, std::string& why) {
  if (memory_mapped(entry)) return false;
  why = "read of " + std::to_string(len) +
        " bytes: the owner's memory is not mapped (freed while exposed?)";
  return true;
}

}  // namespace

TcpListener::TcpListener(const Context& ctx, const TcpOptions& options,
                         const wire::SocketAddress& bind)
    : ctx_(ctx),
      options_(options),
      exposures_("tcp", ctx.defer),
      conns_(ctx.defer),
      regions_("tcp", exposures_, ctx.defer) {
  socket_ = std::make_unique<kit::StreamListener>(
      ctx_.loop, listen_on(bind), "tcp", ctx_.listener,
      [this](std::uint64_t id, const std::string& why) {
        if (StreamConnection* conn = conns_.find(id)) wire::evict(*conn, why);
      },
      [this](int fd) { accept(fd); }, ctx_.log);
}

TcpListener::~TcpListener() { close(); }

wire::SocketAddress TcpListener::bound() const {
  wire::SocketAddress out;
  out.length = sizeof out.storage;
  getsockname(socket_->fd(), reinterpret_cast<sockaddr*>(&out.storage), &out.length);
  return out;
}

void TcpListener::close() {
  if (closed_) return;
  closed_ = true;
  // Copies in flight end first (waiting for them, without their completions).
  if (stager_) {
    for (const auto& [unit, s] : staged_) stager_->drop(s.op);
  }
  staged_.clear();
  receiving_.clear();
  waiting_reads_.clear();
  parked_done_.clear();
  socket_->close();
  ending_.clear();
  regions_.clear();
  exposures_.clear();
  conns_.clear([](StreamConnection& c) { c.close_gracefully(); });
  // Last: the connections above may have sent their last frames from staging chunks.
  stager_.reset();
}

void TcpListener::accept(int fd) {
  wire::apply_peer_options(fd, ctx_.peer_timeout);
  wire::SocketAddress peer;
  peer.length = sizeof peer.storage;
  getpeername(fd, reinterpret_cast<sockaddr*>(&peer.storage), &peer.length);
  const std::uint64_t id = next_conn_++;
  conns_.add(id, std::make_unique<StreamConnection>(
                     ctx_.loop, static_cast<StreamConnection::Handler&>(*this),
                     StreamConnection::Role::server, fd, id, peer.to_string(), ctx_.peer_timeout,
                     false, StreamConnection::Hello{ctx_.local_name, ctx_.local_id}, ctx_.log));
  socket_->admission().accepted(id);
}

std::optional<Error> TcpListener::on_hello(StreamConnection& conn, const FrameHeader&,
                                           FrameHeader&) {
  socket_->admission().heard(conn.id());
  return std::nullopt;
}

void TcpListener::expose(const Exposure& exposure, ExposureObserver& observer) {
  exposures_.add(exposure, observer);
}

void TcpListener::revoke(std::uint64_t id, const Error& reason) {
  if (StreamConnection* conn = end_claim(exposures_.revoke(id), id, reason)) {
    // The owner ended the operation (cancelled, deadline, shutdown): its claimant learns why
    // at once, instead of an access refusal for its next request.
    FrameHeader h;
    h.type = FrameType::status;
    h.op_id = id;
    h.status = wire::to_wire(reason.code());
    conn->send(h, std::string_view(reason.message()).substr(0, wire::kMaxMessage));
  }
}

StreamConnection* TcpListener::end_claim(std::uint64_t conn_id, std::uint64_t id,
                                         const Error& reason) {
  StreamConnection* conn = conn_id == 0 ? nullptr : conns_.find(conn_id);
  if (conn == nullptr) return nullptr;
  // The claim no longer waits for this peer (an attachment, idle between transfers, never did).
  if (!regions_.is_attachment(id)) conn->expect_answers(-1);
  // Read responses still queued become error answers that tell the claimant why (one partly
  // sent finishes from a copy); a payload being received is drained, not stored.
  auto replace = [&](FrameHeader& h, std::string& message) {
    h.type = FrameType::status;
    h.status = wire::to_wire(reason.code());
    message = reason.message().substr(0, wire::kMaxMessage);
  };
  conn->release(id, replace);
  conn->drop_sink(id);
  if (!staged_.empty() || !parked_done_.empty()) drop_staged(id, conn, replace);
  return conn;
}

void TcpListener::finish_exposure(std::uint64_t id, std::optional<Error> peer_error) {
  // Requests of this peer still queued (a peer that ended with an error may have left some)
  // must not read the memory once the operation is over.
  const Error reason =
      peer_error ? *peer_error : Error(ErrorCode::Cancelled, "the operation ended");
  end_claim(exposures_.finish(id, std::move(peer_error)), id, reason);
}

void TcpListener::claim(kit::Exposures::Entry& entry, StreamConnection& conn) {
  auto secret =
      exposures_.claim(entry, conn.id(), conn.peer_name(), conn.describe_peer(), conn.peer_id());
  if (!secret) return;
  socket_->admission().claimed(conn.id());
  // While it serves a claimed operation, the connection waits for its peer: a peer that goes
  // silent (stopped, or cut off without a reset) is dropped after peer_timeout, and the
  // operation errors, instead of waiting forever.
  conn.expect_answers(+1);
  // The claim's secret goes to the claimant alone, ahead of the answer to its request.
  FrameHeader h;
  h.type = FrameType::claimed;
  h.op_id = entry.exposure.id;
  h.token = *secret;
  conn.send(h);
}

wire::Sink TcpListener::on_frame(StreamConnection& conn, const FrameHeader& h,
                                 std::string message) {
  switch (h.type) {
    case FrameType::read:
      serve_read(conn, h);
      return {};
    case FrameType::read_ranges:
      return receive_read_ranges(conn, h);
    case FrameType::write:
      return serve_write(conn, h);
    case FrameType::done:
      serve_done(conn, h, message);
      return {};
    case FrameType::attach:
      serve_attach(conn, h);
      return {};
    case FrameType::ended:
      return receive_ended(conn, h, std::move(message));
    case FrameType::detach:
      serve_detach(conn, h);
      return {};
    default:
      return wire::fatal("unexpected frame type " + std::to_string(static_cast<int>(h.type)) +
                         " from a client");
  }
}

void TcpListener::serve_read(StreamConnection& conn, const FrameHeader& h) {
  if (h.len == 0 || h.len > options_.max_request) {
    const Error refused(ErrorCode::AccessDenied,
                        "read of " + std::to_string(h.len) + " bytes: requests take 1 to " +
                            std::to_string(options_.max_request) + " bytes");
    reply(conn, h.req_id, &refused);
    return;
  }
  auto v = exposures_.check(h.op_id, h.token, Access::read, h.addr, h.len, conn.id());
  if (!v.ok()) {
    const Error refused(v.code, v.message);
    reply(conn, h.req_id, &refused);
    return;
  }
  claim(*v.entry, conn);
  if (std::string why; refuse_unmapped(*v.entry, h.len, why)) {
    const Error gone(ErrorCode::AccessDenied, why);
    reply(conn, h.req_id, &gone);
    return;
  }
  answer_read(conn, h, *v.entry, v.ptr);
}

void TcpListener::answer_read(StreamConnection& conn, const FrameHeader& h,
                              const kit::Exposures::Entry& entry, std::byte* ptr) {
  if (const int ordinal = device_of(entry, ptr); ordinal >= 0) {
    serve_read_staged(conn, h, ptr, ordinal);
    return;
  }
  exposures_.sending(h.op_id);
  FrameHeader d;
  d.type = FrameType::data;
  d.req_id = h.req_id;
  d.addr = h.addr;
  d.len = h.len;
  conn.send(d, {}, ptr, h.op_id);
}

wire::Sink TcpListener::receive_read_ranges(StreamConnection& conn, const FrameHeader& h) {
  if (h.len == 0 || h.len % 16 != 0 || h.len > wire::kMaxReadRanges * 16)
    return wire::fatal("READ_RANGES of " + std::to_string(h.len) + " bytes of ranges");
  std::vector<std::byte>& list = asking_[conn.id()];
  list.resize(h.len);
  wire::Sink sink;
  sink.dest = list.data();
  return sink;
}

void TcpListener::serve_read_ranges(StreamConnection& conn, const FrameHeader& h,
                                    const std::vector<std::byte>& list) {
  // Every range is checked before any byte moves: one refusal answers the whole request.
  struct Piece {
    std::byte* ptr;
    std::uint64_t addr;
    std::uint64_t len;
  };
  std::vector<Piece> pieces;
  pieces.reserve(list.size() / 16);
  kit::Exposures::Entry* entry = nullptr;
  std::uint64_t total = 0;
  for (std::size_t at = 0; at < list.size(); at += 16) {
    std::uint64_t addr = 0;
    std::uint64_t len = 0;
    std::memcpy(&addr, list.data() + at, 8);
    std::memcpy(&len, list.data() + at + 8, 8);
    if (len == 0 || len > options_.max_request - total) {
      const Error refused(ErrorCode::AccessDenied,
                          "read of ranges: each takes 1 byte or more, all together at most " +
                              std::to_string(options_.max_request) + " bytes");
      reply(conn, h.req_id, &refused);
      return;
    }
    total += len;
    auto v = exposures_.check(h.op_id, h.token, Access::read, addr, len, conn.id());
    if (!v.ok()) {
      const Error refused(v.code, v.message);
      reply(conn, h.req_id, &refused);
      return;
    }
    entry = v.entry;
    pieces.push_back({v.ptr, addr, len});
  }
  if (std::string why; refuse_unmapped(*entry, total, why)) {
    const Error gone(ErrorCode::AccessDenied, why);
    reply(conn, h.req_id, &gone);
    return;
  }
  claim(*entry, conn);
  for (const Piece& p : pieces) {
    FrameHeader one = h;  // each range as the READ of it would be
    one.type = FrameType::read;
    one.addr = p.addr;
    one.len = p.len;
    answer_read(conn, one, *entry, p.ptr);
  }
}

wire::Sink TcpListener::serve_write(StreamConnection& conn, const FrameHeader& h) {
  // A write's payload follows its header; one too large to skip ends the connection.
  if (h.len > options_.max_request)
    return wire::fatal("write of " + std::to_string(h.len) + " bytes exceeds the limit of " +
                       std::to_string(options_.max_request));
  if (h.len == 0) return {};
  auto v = exposures_.check(h.op_id, h.token, Access::write, h.addr, h.len, conn.id());
  if (!v.ok()) return {};  // discarded; on_payload answers with the refusal
  claim(*v.entry, conn);
  if (const int ordinal = device_of(*v.entry, v.ptr); ordinal >= 0)
    return serve_write_staged(conn, h, v.ptr, ordinal);
  wire::Sink sink;
  sink.dest = v.ptr;
  sink.tag = h.op_id;
  return sink;
}

void TcpListener::on_payload(StreamConnection& conn, const FrameHeader& h, std::uint64_t,
                             bool intact) {
  if (h.type == FrameType::read_ranges) {
    auto it = asking_.find(conn.id());
    if (it == asking_.end()) return;
    const std::vector<std::byte> list = std::move(it->second);
    asking_.erase(it);
    if (intact) serve_read_ranges(conn, h, list);
    return;
  }
  if (h.type == FrameType::ended) {
    auto it = ending_.find(conn.id());
    if (it == ending_.end()) return;
    Ending e = std::move(it->second);
    ending_.erase(it);
    if (intact) serve_ended(conn, h, std::move(e.tag), std::move(e.ranges));
    return;
  }
  if (!receiving_.empty() && staged_payload(conn, h, intact)) return;
  // The end of a WRITE: answer it now that its bytes are in memory (or were refused).
  if (intact && exposures_.find(h.op_id) != nullptr) {
    exposures_.landed(h.op_id, h.addr, h.len);
    reply(conn, h.req_id, nullptr);
    return;
  }
  if (h.len == 0) {
    const Error refused(ErrorCode::AccessDenied, "empty write");
    reply(conn, h.req_id, &refused);
    return;
  }
  auto v = exposures_.check(h.op_id, h.token, Access::write, h.addr, h.len, conn.id());
  const Error refused = v.ok()
                            ? Error(ErrorCode::Cancelled, "the operation ended while bytes arrived")
                            : Error(v.code, v.message);
  reply(conn, h.req_id, &refused);
}

void TcpListener::serve_done(StreamConnection& conn, const FrameHeader& h,
                             const std::string& message) {
  if (regions_.is_attachment(h.op_id)) {
    // A transfer on an attachment ends with ENDED; the attachment with DETACH.
    const Error refused(ErrorCode::ProtocolError, "DONE names an attachment");
    reply(conn, h.req_id, &refused);
    return;
  }
  auto v = exposures_.check_done(h.op_id, h.token, h.flags, conn.id());
  if (!v.ok()) {
    const Error refused(v.code, v.message);
    reply(conn, h.req_id, &refused);
    return;
  }
  const auto access = static_cast<Access>(h.flags);
  claim(*v.entry, conn);
  if (h.status == 0 && access == Access::write && stager_ && stager_->copying(h.op_id)) {
    // Bytes of earlier WRITEs are still on their way into the device: answer once they are
    // all there (write_copied serves this DONE again).
    parked_done_.emplace(h.op_id, Parked{conn.id(), h, message, {}, ~std::uint64_t{0}});
    return;
  }
  if (h.status == 0 && access == Access::write) {
    // A writable is complete only when every byte it exposes was written at least once.
    if (auto short_of = exposures_.unwritten(h.op_id, conn.describe_peer())) {
      reply(conn, h.req_id, &*short_of);
      finish_exposure(h.op_id, *short_of);
      return;
    }
  }
  reply(conn, h.req_id, nullptr);
  if (h.status == 0) {
    // A readable is done only once every byte it queued has left its memory.
    if (access == Access::read && !exposures_.done_reading(h.op_id)) return;
    finish_exposure(h.op_id, std::nullopt);
    return;
  }
  finish_exposure(h.op_id, wire::ended_by_peer(h.status, message, conn.describe_peer()));
}

void TcpListener::on_sent(StreamConnection& conn, std::uint64_t tag) {
  if ((tag & kStagedTag) != 0) {
    // DATA sent from a staging chunk: the chunk is free again.
    const std::uint64_t unit = tag & ~kStagedTag;
    auto it = staged_.find(unit);
    if (it == staged_.end()) return;
    const std::uint64_t op = it->second.op;
    staged_.erase(it);
    stager_->close(unit);
    if (exposures_.sent(op)) finish_exposure(op, std::nullopt);
    return;
  }
  (void)conn;
  if (exposures_.sent(tag)) finish_exposure(tag, std::nullopt);
}

void TcpListener::on_closed(StreamConnection& conn, const std::string& reason) {
  ending_.erase(conn.id());
  asking_.erase(conn.id());
  drop_staged_conn(conn.id());
  exposures_.lose_connection(conn.id(), Error(ErrorCode::PeerLost, "peer " + conn.describe_peer() +
                                                                       " disconnected: " + reason));
  socket_->admission().closed(conn.id());
  conns_.bury(conn.id());
}

}  // namespace ferry::transport::tcp

namespace ferry::transport::tcp {

void TcpListener::serve_region(const RegionExposure& region, RegionObserver& observer) {
  regions_.add(region, observer);
}

void TcpListener::serve_attach(StreamConnection& conn, const FrameHeader& h) {
  auto v = regions_.attach(h.op_id, h.token, h.flags, conn.id(), conn.peer_name(),
                           conn.describe_peer(), conn.peer_id());
  if (!v.ok()) {
    const Error refused(v.code, v.message);
    reply(conn, h.req_id, &refused);
    return;
  }
  // An attached peer has proved its token: the listener's bounds for strangers let it be.
  socket_->admission().claimed(conn.id());
  FrameHeader a;
  a.type = FrameType::attached;
  a.req_id = h.req_id;
  a.op_id = v.attachment;
  a.token = v.secret;
  conn.send(a);
}

wire::Sink TcpListener::receive_ended(StreamConnection& conn, const FrameHeader& h,
                                      std::string tag) {
  if (h.len == 0 || h.len % 16 != 0 || h.len > kit::Regions::kMaxEndedBytes)
    return wire::fatal("ENDED of " + std::to_string(h.len) + " bytes of ranges");
  Ending& e = ending_[conn.id()];
  e.tag = std::move(tag);
  e.ranges.resize(h.len);
  wire::Sink sink;
  sink.dest = e.ranges.data();
  return sink;
}

void TcpListener::serve_ended(StreamConnection& conn, const FrameHeader& h, std::string tag,
                              std::vector<std::byte> ranges) {
  if (h.status == 0 && h.flags == static_cast<std::uint16_t>(Access::write) && stager_ &&
      regions_.holds(h.op_id, h.token, conn.id()) &&
      stager_->copying(h.op_id, stager_->last_unit())) {
    // Bytes of the WRITEs before it are still on their way into the device: the owner hears of
    // the transfer once they are there (write_copied serves this ENDED again). Only the
    // attachment's holder parks anything.
    parked_done_.emplace(
        h.op_id, Parked{conn.id(), h, std::move(tag), std::move(ranges), stager_->last_unit()});
    return;
  }
  std::optional<Error> outcome;
  if (h.status != 0) outcome = wire::ended_by_peer(h.status, {}, conn.describe_peer());
  auto v = regions_.ended(h.op_id, h.token, h.flags, std::move(outcome), std::move(tag),
                          ranges.data(), ranges.size(), conn.id());
  if (h.req_id == 0) return;  // a notice: nobody waits for the answer
  if (!v.ok()) {
    const Error refused(v.code, v.message);
    reply(conn, h.req_id, &refused);
    return;
  }
  reply(conn, h.req_id, nullptr);
}

void TcpListener::serve_detach(StreamConnection& conn, const FrameHeader& h) {
  if (!regions_.holds(h.op_id, h.token, conn.id())) return;
  const Error reason(ErrorCode::Cancelled, "the peer detached");
  // Its queued answers go before the attachment does (end_claim tells the two apart).
  end_claim(conn.id(), h.op_id, reason);
  regions_.detach(h.op_id, h.token, conn.id());
}

void TcpListener::end_attachment(std::uint64_t conn_id, std::uint64_t id, const Error& reason) {
  if (StreamConnection* conn = end_claim(conn_id, id, reason)) {
    FrameHeader h;
    h.type = FrameType::status;
    h.op_id = id;
    h.status = wire::to_wire(reason.code());
    conn->send(h, std::string_view(reason.message()).substr(0, wire::kMaxMessage));
  }
}

void TcpListener::revoke_attachment(std::uint64_t attachment, const Error& reason) {
  if (!regions_.is_attachment(attachment)) return;
  // Still an attachment while its answers are dropped (end_claim tells the two apart). Its
  // exposure may be gone already (the peer detached, or its connection was lost, and the owner
  // has not heard yet): then only the owner's pending event goes.
  if (const kit::Exposures::Entry* entry = exposures_.find(attachment))
    end_attachment(entry->bound_to, attachment, reason);
  regions_.revoke(attachment);
}

void TcpListener::end_region(std::uint64_t id, const Error& reason) {
  for (const auto& [attachment, conn] : regions_.attachments_of(id))
    end_attachment(conn, attachment, reason);
  regions_.end(id);
}

}  // namespace ferry::transport::tcp
