#include <ferry/connector.hpp>

#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <limits>

#include "sdk/src/core.hpp"
#include "sdk/src/stream_match.hpp"
#include "sidechannel/pairing.hpp"
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

std::uint64_t total_of(const std::vector<Descriptor>& local) {
  std::uint64_t total = 0;
  for (const auto& d : local) total += d.size();
  return total;
}

// Fills what the caller left empty from FERRY_NATS_* (docs/sidechannel.md).
NatsOptions resolve(NatsOptions o, const std::string& connector_name) {
  if (o.use_environment) {
    auto fill = [](std::string& field, const char* var) {
      if (!field.empty()) return;
      if (const char* v = std::getenv(var)) field = v;
    };
    if (o.servers.empty()) {
      std::string list;
      fill(list, "FERRY_NATS_URL");
      std::size_t start = 0;
      while (start <= list.size()) {
        std::size_t comma = list.find(',', start);
        std::string url =
            list.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
        url.erase(0, url.find_first_not_of(" \t"));
        url.erase(url.find_last_not_of(" \t") + 1);
        if (!url.empty()) o.servers.push_back(url);
        if (comma == std::string::npos) break;
        start = comma + 1;
      }
    }
    fill(o.user, "FERRY_NATS_USER");
    fill(o.password, "FERRY_NATS_PASSWORD");
    fill(o.token, "FERRY_NATS_TOKEN");
    fill(o.nkey_public, "FERRY_NATS_NKEY");
    fill(o.nkey_seed_file, "FERRY_NATS_NKEY_SEED_FILE");
    fill(o.creds_file, "FERRY_NATS_CREDS");
    fill(o.tls_ca_file, "FERRY_NATS_TLS_CA");
    fill(o.tls_cert_file, "FERRY_NATS_TLS_CERT");
    fill(o.tls_key_file, "FERRY_NATS_TLS_KEY");
    fill(o.connection_name, "FERRY_NATS_NAME");
    fill(o.prefix, "FERRY_NATS_PREFIX");
  }
  if (o.connection_name.empty()) o.connection_name = connector_name;
  if (o.prefix.empty()) o.prefix = "ferry";
  if (o.connect_timeout.count() <= 0 || o.request_timeout.count() <= 0 ||
      o.reconnect_wait.count() < 0)
    throw Error(ErrorCode::InvalidArgument,
                "nats: connect_timeout and request_timeout must be positive, reconnect_wait "
                "not negative");
  return o;
}

void check_subject(const std::string& subject, const std::string& prefix) {
  if (auto why = sidechannel::subject_problem(subject); !why.empty())
    throw Error(ErrorCode::InvalidArgument, "subject '" + subject + "' " + why);
  if (subject.rfind(prefix + ".", 0) == 0)
    throw Error(ErrorCode::InvalidArgument,
                "subject '" + subject + "' is in ferry's own namespace '" + prefix + ".'");
}

}  // namespace

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

void check_remote(const RdmaMetadata& remote, OperationKind wanted,
                  const std::vector<Descriptor>& local) {
  remote.validate();
  if (remote.operation_kind != wanted) {
    const char* call = wanted == OperationKind::read ? "begin_read" : "begin_write";
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

RdmaMetadata coalesced(const RdmaMetadata& m) {
  RdmaMetadata out = m;
  out.descriptors.clear();
  for (const RemoteDescriptor& d : m.descriptors) {
    if (!out.descriptors.empty()) {
      RemoteDescriptor& last = out.descriptors.back();
      if (last.device == d.device && last.ptr + last.size == d.ptr) {
        last.size += d.size;
        continue;
      }
    }
    out.descriptors.push_back(d);
  }
  return out;
}

Core::Core(ConnectorOptions opts) : options(std::move(opts)), next_id_(random_u64() >> 16) {
  identity.name = options.name.empty() ? "ferry-" + std::to_string(::getpid()) : options.name;
  identity.id = hex16(random_u64());
  identity.host = host_name();
  identity.pid = ::getpid();
  if (identity.name.size() > 256)
    throw Error(ErrorCode::InvalidArgument, "the connector's name is longer than 256 characters");
  if (options.peer_timeout.count() <= 0)
    throw Error(ErrorCode::InvalidArgument, "peer_timeout must be positive");
  if (options.default_timeout.count() < 0)
    throw Error(ErrorCode::InvalidArgument, "default_timeout must not be negative");
}

void Core::start() {
  NatsOptions nats_options = resolve(options.nats, identity.name);
  loop = std::make_unique<loop::EventLoop>(options.loop);
  try {
    loop->call([&] {
      std::string bind = options.tcp.bind_address;
      if (!nats_options.servers.empty()) {
        nats = std::make_unique<sidechannel::NatsChannel>(*loop, nats_options, identity.id);
        has_nats = true;
        nats_prefix = nats_options.prefix;
        // Peers reach us where the cluster reaches us: the NATS socket's own interface.
        if (bind.empty()) bind = nats->local_ip();
        nats->subscribe(nats->own_subject("notify." + identity.id), {},
                        [this](const sidechannel::Message& m) { on_notice(m); });
      }
      transport::tcp::TcpTransport::Options tcp;
      tcp.bind_address = bind.empty() ? "127.0.0.1" : bind;
      tcp.port = options.tcp.port;
      tcp.advertise_address = options.tcp.advertise_address;
      tcp.chunk_size = options.tcp.chunk_size;
      tcp.window = options.tcp.window;
      tcp.max_request = options.tcp.max_request;
      tcp.peer_timeout = options.peer_timeout;
      tcp.local_name = identity.name;
      tcp.local_id = std::stoull(identity.id, nullptr, 16);
      auto defer = [this](std::function<void()> task) { loop->defer(std::move(task)); };
      transports.push_back(
          std::make_unique<transport::tcp::TcpTransport>(loop->uv(), defer, std::move(tcp)));
      for (const auto& t : transports)
        for (auto& e : t->endpoints()) endpoints.push_back(std::move(e));
    });
  } catch (...) {
    loop->close([this] {
      transports.clear();
      nats.reset();
    });
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
    // Last, and without blocking the loop: the cancelled operations' completion notices
    // still leave, then the connection closes.
    if (nats) sidechannel::NatsChannel::close(std::move(nats));
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
                                                     std::chrono::milliseconds timeout,
                                                     const std::string& subject) {
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

  std::string served;
  if (!subject.empty()) {
    // Checked before anything is exposed, so that a refusal leaves nothing behind.
    served = m.to_json();
    const auto limit = static_cast<std::uint64_t>(nats->max_payload());
    if (served.size() > limit) {
      RdmaMetadata merged = coalesced(m);
      served = merged.to_json();
      if (served.size() > limit)
        throw Error(ErrorCode::InvalidArgument,
                    "the metadata of " + std::to_string(served.size()) + " bytes (" +
                        std::to_string(merged.descriptors.size()) +
                        " descriptors after merging adjacent ones) exceeds the NATS server's "
                        "max_payload of " +
                        std::to_string(limit) + " bytes");
    }
  }
  for (const auto& t : transports) {
    t->expose(exposure, *op);
    op->exposed_on.push_back(t.get());
  }
  if (!subject.empty()) {
    auto registered = std::make_shared<std::promise<void>>();
    op->served = registered->get_future().share();
    std::weak_ptr<OperationState> weak = op;
    op->serving = nats->subscribe(
        subject, {},
        [this, served](const sidechannel::Message& msg) {
          if (!msg.reply.empty()) nats->publish(msg.reply, served);
        },
        [registered, weak](const std::string& error) {
          // A subject that cannot be served fails the operation: nobody could ever pair.
          if (auto o = weak.lock(); o && !error.empty())
            o->finish(OperationStatus::errored, Error(ErrorCode::SideChannel, error));
          registered->set_value();
        });
  }
  op->set_status(OperationStatus::initialized);
  op->arm(timeout);
  return op;
}

void Core::start_transfer(OperationState& op, const RdmaMetadata& remote) {
  auto [transport, endpoint] = choose_transport(remote);
  transport::TransferSpec spec;
  spec.remote_id = std::stoull(remote.notification_key, nullptr, 16);
  transport::token_from_hex(remote.token, spec.token);
  spec.access = access_of(remote.operation_kind);
  spec.segments = match_streams(remote.descriptors, op.local);
  spec.endpoint = endpoint;
  spec.peer_name = remote.owner.name;
  op.transfer = transport->start(std::move(spec), op);
  op.set_method(transport->capabilities().method);
}

std::shared_ptr<OperationState> Core::begin_active(const RdmaMetadata& remote,
                                                   std::vector<Descriptor> local,
                                                   std::chrono::milliseconds timeout) {
  if (closed) throw Error(ErrorCode::InvalidState, "the connector is closed");
  auto op = std::make_shared<OperationState>(shared_from_this(), next_id_++, remote.operation_kind,
                                             false, std::move(local));
  op->set_status(OperationStatus::in_progress);
  start_transfer(*op, remote);
  op->arm(timeout);
  return op;
}

std::shared_ptr<OperationState> Core::begin_by_subject(OperationKind kind,
                                                       const std::string& subject,
                                                       std::vector<Descriptor> local,
                                                       std::chrono::milliseconds timeout) {
  if (closed) throw Error(ErrorCode::InvalidState, "the connector is closed");
  auto op = std::make_shared<OperationState>(shared_from_this(), next_id_++, kind, false,
                                             std::move(local));
  op->subject = subject;
  op->set_status(OperationStatus::in_progress);
  op->arm(timeout);
  op->request_metadata();
  return op;
}

void Core::on_notice(const sidechannel::Message& message) {
  auto notice = sidechannel::decode_notice(message.data);
  if (!notice || notice->key.size() != 16) return;
  auto it = live.find(std::strtoull(notice->key.c_str(), nullptr, 16));
  if (it == live.end()) return;
  auto op = it->second.lock();
  transport::Token presented{};
  transport::Token expected{};
  // Only failures count: every transport reports a completed transfer itself (TCP's DONE),
  // and a "complete" from the side channel could end an operation nobody wrote. Only for
  // operations served at a subject, whose peers may never reach them by a transport.
  if (!notice->error) return;
  if (!op || !op->passive || op->serving == 0 ||
      !transport::token_from_hex(notice->token, presented) ||
      !transport::token_from_hex(op->metadata.token, expected) ||
      !transport::tokens_equal(presented, expected))
    return;
  // Whoever holds the metadata may send a notice while nobody has claimed the operation;
  // once a peer has, only that peer's (a claimant that gave no id: nobody's).
  if (op->status() != OperationStatus::initialized &&
      (op->claimant.empty() || op->claimant != notice->from_id))
    return;
  op->finish(OperationStatus::errored,
             Error(notice->error->code(),
                   "peer '" + notice->from + "' ended the transfer: " + notice->error->message()));
}

}  // namespace detail

Connector::Connector(ConnectorOptions options)
    : core_(std::make_shared<detail::Core>(std::move(options))) {
  core_->start();
}

Connector::~Connector() { core_->shutdown(); }

const PeerIdentity& Connector::identity() const noexcept { return core_->identity; }

std::vector<Endpoint> Connector::endpoints() const { return core_->endpoints; }

bool Connector::has_side_channel() const noexcept { return core_->has_nats; }

namespace {

// Common front of create_readable / create_writable.
std::shared_ptr<detail::OperationState> create(detail::Core& core, OperationKind kind,
                                               std::vector<Descriptor> local,
                                               const OperationOptions& options) {
  detail::check_local(local);
  auto timeout = core.effective_timeout(options);
  if (!options.subject.empty()) {
    detail::check_subject(options.subject, core.nats_prefix);
    if (!core.has_nats)
      throw Error(ErrorCode::InvalidState,
                  "serving at a subject needs the NATS side channel (NatsOptions::servers or "
                  "FERRY_NATS_URL)");
  }
  auto op = core.loop->call(
      [&] { return core.create_passive(kind, std::move(local), timeout, options.subject); });
  // Off the loop, return only once the server has the subscription (or request_timeout has
  // passed): a peer told right after this call finds the subject served. (On the loop thread
  // this cannot wait; a peer that asks too early is answered "no responders" and asks again
  // at once.)
  if (op->served.valid() && !core.loop->in_loop_thread())
    op->served.wait_for(core.options.nats.request_timeout);
  return op;
}

std::shared_ptr<detail::OperationState> begin(detail::Core& core, OperationKind kind,
                                              const Subject& subject, std::vector<Descriptor> local,
                                              const OperationOptions& options) {
  detail::check_subject(subject.name, core.nats_prefix);
  if (!core.has_nats)
    throw Error(ErrorCode::InvalidState,
                "pairing by subject needs the NATS side channel (NatsOptions::servers or "
                "FERRY_NATS_URL)");
  detail::check_local(local);
  auto timeout = core.effective_timeout(options);
  return core.loop->call(
      [&] { return core.begin_by_subject(kind, subject.name, std::move(local), timeout); });
}

}  // namespace

ReadableOperation Connector::create_readable(std::vector<Descriptor> local,
                                             OperationOptions options) {
  return ReadableOperation(create(*core_, OperationKind::read, std::move(local), options));
}

WritableOperation Connector::create_writable(std::vector<Descriptor> local,
                                             OperationOptions options) {
  return WritableOperation(create(*core_, OperationKind::write, std::move(local), options));
}

ReadOperation Connector::begin_read(const RdmaMetadata& remote, std::vector<Descriptor> local,
                                    OperationOptions options) {
  detail::check_remote(remote, OperationKind::read, local);
  auto timeout = core_->effective_timeout(options);
  return ReadOperation(
      core_->loop->call([&] { return core_->begin_active(remote, std::move(local), timeout); }));
}

WriteOperation Connector::begin_write(std::vector<Descriptor> local, const RdmaMetadata& remote,
                                      OperationOptions options) {
  detail::check_remote(remote, OperationKind::write, local);
  auto timeout = core_->effective_timeout(options);
  return WriteOperation(
      core_->loop->call([&] { return core_->begin_active(remote, std::move(local), timeout); }));
}

ReadOperation Connector::begin_read(const Subject& subject, std::vector<Descriptor> local,
                                    OperationOptions options) {
  return ReadOperation(begin(*core_, OperationKind::read, subject, std::move(local), options));
}

WriteOperation Connector::begin_write(std::vector<Descriptor> local, const Subject& subject,
                                      OperationOptions options) {
  return WriteOperation(begin(*core_, OperationKind::write, subject, std::move(local), options));
}

}  // namespace ferry
