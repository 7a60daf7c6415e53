#include <ferry/connector.hpp>

#include <unistd.h>

#include <climits>
#include <cstdio>
#include <limits>

#include "sdk/src/core.hpp"
#include "sdk/src/stream_match.hpp"
#include "transport/exposure_table.hpp"
#include "transport/tcp/tcp_transport.hpp"

namespace ferry {

namespace detail {

namespace {

std::string host_name() {
  char buf[HOST_NAME_MAX + 1] = {};
  if (gethostname(buf, sizeof buf - 1) != 0) return "unknown";
  return buf;
}

std::uint64_t random_u64() {
  transport::Token t = transport::random_token();
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = v << 8 | t[static_cast<std::size_t>(i)];
  return v;
}

transport::Access access_of(OperationKind kind) {
  return kind == OperationKind::read ? transport::Access::read : transport::Access::write;
}

}  // namespace

Core::Core(ConnectorOptions opts) : options(std::move(opts)), next_id_(random_u64() >> 16) {
  identity.name = options.name.empty() ? "ferry-" + std::to_string(::getpid()) : options.name;
  identity.id = hex16(random_u64());
  identity.host = host_name();
  identity.pid = ::getpid();
  if (options.peer_timeout.count() <= 0)
    throw Error(ErrorCode::InvalidArgument, "peer_timeout must be positive");
  if (options.default_timeout.count() < 0)
    throw Error(ErrorCode::InvalidArgument, "default_timeout must not be negative");
}

void Core::start() {
  loop = std::make_unique<sidechannel::EventLoop>(options.loop);
  try {
    loop->call([this] {
      transport::tcp::TcpTransport::Options tcp;
      tcp.bind_address = options.tcp.bind_address.empty() ? "127.0.0.1" : options.tcp.bind_address;
      tcp.port = options.tcp.port;
      tcp.advertise_address = options.tcp.advertise_address;
      tcp.chunk_size = options.tcp.chunk_size;
      tcp.window = options.tcp.window;
      tcp.max_request = options.tcp.max_request;
      tcp.peer_timeout = options.peer_timeout;
      tcp.local_name = identity.name;
      auto defer = [this](std::function<void()> task) { loop->defer(std::move(task)); };
      transports.push_back(
          std::make_unique<transport::tcp::TcpTransport>(loop->uv(), defer, std::move(tcp)));
      for (const auto& t : transports)
        for (auto& e : t->endpoints()) endpoints.push_back(std::move(e));
    });
  } catch (...) {
    loop->close([this] { transports.clear(); });
    throw;
  }
}

void Core::shutdown() noexcept {
  if (!loop) return;
  loop->close([this] {
    closed = true;
    std::vector<std::shared_ptr<OperationState>> ops;
    for (auto& [id, weak] : live)
      if (auto op = weak.lock()) ops.push_back(std::move(op));
    for (auto& op : ops)
      op->finish(OperationStatus::cancelled,
                 Error(ErrorCode::Cancelled, "the connector was closed"));
    for (auto& t : transports) t->close();
    transports.clear();
  });
}

std::chrono::milliseconds Core::effective_timeout(const OperationOptions& o) const {
  if (o.timeout.count() < 0)
    throw Error(ErrorCode::InvalidArgument, "OperationOptions::timeout must not be negative");
  return o.timeout.count() > 0 ? o.timeout : options.default_timeout;
}

std::pair<transport::Transport*, Endpoint> Core::choose_transport(
    const RdmaMetadata& remote) const {
  // The peer lists its endpoints best first; take the first one a transport here can serve.
  for (const Endpoint& e : remote.endpoints)
    for (const auto& t : transports)
      if (t->capabilities().method == e.method) return {t.get(), e};
  std::string offered;
  for (const Endpoint& e : remote.endpoints) offered += (offered.empty() ? "" : ", ") + e.method;
  std::string ours;
  for (const auto& t : transports) ours += (ours.empty() ? "" : ", ") + t->capabilities().method;
  throw Error(ErrorCode::NoCommonMethod, "peer '" + remote.owner.name + "' offers [" + offered +
                                             "]; this connector has [" + ours + "]");
}

std::shared_ptr<OperationState> Core::create_passive(OperationKind kind,
                                                     std::vector<Descriptor> local,
                                                     std::chrono::milliseconds timeout) {
  if (closed) throw Error(ErrorCode::InvalidState, "the connector is closed");
  const std::uint64_t id = next_id_++;
  auto op = std::make_shared<OperationState>(shared_from_this(), id, kind, true, std::move(local));
  transport::Exposure exposure;
  exposure.id = id;
  exposure.token = transport::random_token();
  exposure.access = access_of(kind);

  RdmaMetadata& m = op->metadata;
  m.operation_kind = kind;
  m.notification_key = op->id_hex;
  m.owner = identity;
  m.endpoints = endpoints;
  m.token = transport::token_to_hex(exposure.token);
  for (const Descriptor& d : op->local) {
    m.descriptors.push_back({reinterpret_cast<std::uint64_t>(d.ptr()), d.size(), d.device()});
    exposure.regions.push_back({d.bytes(), d.size()});
  }
  for (const auto& t : transports) {
    t->expose(exposure, *op);
    op->exposed_on.push_back(t.get());
  }
  op->set_status(OperationStatus::initialized);
  op->arm(timeout);
  return op;
}

std::shared_ptr<OperationState> Core::begin_active(const RdmaMetadata& remote,
                                                   std::vector<Descriptor> local,
                                                   std::chrono::milliseconds timeout) {
  if (closed) throw Error(ErrorCode::InvalidState, "the connector is closed");
  auto [transport, endpoint] = choose_transport(remote);
  const std::uint64_t id = next_id_++;
  auto op = std::make_shared<OperationState>(shared_from_this(), id, remote.operation_kind, false,
                                             std::move(local));
  transport::TransferSpec spec;
  spec.remote_id = std::stoull(remote.notification_key, nullptr, 16);
  transport::token_from_hex(remote.token, spec.token);
  spec.access = access_of(remote.operation_kind);
  spec.segments = match_streams(remote.descriptors, op->local);
  spec.endpoint = endpoint;
  spec.peer_name = remote.owner.name;
  op->set_status(OperationStatus::in_progress);
  op->transfer = transport->start(std::move(spec), *op);
  op->arm(timeout);
  return op;
}

}  // namespace detail

namespace {

void check_local(const std::vector<Descriptor>& local) {
  if (local.empty()) throw Error(ErrorCode::InvalidArgument, "the descriptor list is empty");
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < local.size(); ++i) {
    if (local[i].device().kind() != DeviceKind::host)
      throw Error(ErrorCode::Unsupported, "descriptor " + std::to_string(i) + " is on " +
                                              local[i].device().to_string() +
                                              "; this build moves host memory only");
    if (local[i].size() > std::numeric_limits<std::uint64_t>::max() - total)
      throw Error(ErrorCode::InvalidArgument, "the descriptors' total size overflows");
    total += local[i].size();
  }
}

std::uint64_t total_of(const std::vector<Descriptor>& local) {
  std::uint64_t total = 0;
  for (const auto& d : local) total += d.size();
  return total;
}

void check_pairing(const RdmaMetadata& remote, OperationKind wanted, const char* call,
                   const std::vector<Descriptor>& local) {
  remote.validate();
  if (remote.operation_kind != wanted) {
    const char* have = remote.operation_kind == OperationKind::read ? "readable" : "writable";
    const char* need = wanted == OperationKind::read ? "readable" : "writable";
    throw Error(ErrorCode::KindMismatch, std::string(call) + " needs the metadata of a " + need +
                                             " operation (kind " + std::string(to_string(wanted)) +
                                             "), got a " + have + "'s (kind " +
                                             std::string(to_string(remote.operation_kind)) + ")");
  }
  check_local(local);
  if (remote.total_size() != total_of(local))
    throw Error(ErrorCode::SizeMismatch,
                "the remote descriptors hold " + std::to_string(remote.total_size()) +
                    " bytes, the local ones " + std::to_string(total_of(local)));
}

}  // namespace

Connector::Connector(ConnectorOptions options)
    : core_(std::make_shared<detail::Core>(std::move(options))) {
  core_->start();
}

Connector::~Connector() { core_->shutdown(); }

const PeerIdentity& Connector::identity() const noexcept { return core_->identity; }

std::vector<Endpoint> Connector::endpoints() const { return core_->endpoints; }

ReadableOperation Connector::create_readable(std::vector<Descriptor> local,
                                             OperationOptions options) {
  check_local(local);
  auto timeout = core_->effective_timeout(options);
  return ReadableOperation(core_->loop->call(
      [&] { return core_->create_passive(OperationKind::read, std::move(local), timeout); }));
}

WritableOperation Connector::create_writable(std::vector<Descriptor> local,
                                             OperationOptions options) {
  check_local(local);
  auto timeout = core_->effective_timeout(options);
  return WritableOperation(core_->loop->call(
      [&] { return core_->create_passive(OperationKind::write, std::move(local), timeout); }));
}

ReadOperation Connector::begin_read(const RdmaMetadata& remote, std::vector<Descriptor> local,
                                    OperationOptions options) {
  check_pairing(remote, OperationKind::read, "begin_read", local);
  auto timeout = core_->effective_timeout(options);
  return ReadOperation(
      core_->loop->call([&] { return core_->begin_active(remote, std::move(local), timeout); }));
}

WriteOperation Connector::begin_write(std::vector<Descriptor> local, const RdmaMetadata& remote,
                                      OperationOptions options) {
  check_pairing(remote, OperationKind::write, "begin_write", local);
  auto timeout = core_->effective_timeout(options);
  return WriteOperation(
      core_->loop->call([&] { return core_->begin_active(remote, std::move(local), timeout); }));
}

}  // namespace ferry
