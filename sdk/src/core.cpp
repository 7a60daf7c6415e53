#include "sdk/src/core.hpp"

#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <functional>
#include <limits>

#include "loop/ids.hpp"
#include "sdk/src/active_operation.hpp"
#include "sdk/src/messaging.hpp"
#include "sdk/src/metrics.hpp"
#include "sdk/src/options.hpp"
#include "sdk/src/passive_operation.hpp"
#include "sdk/src/region_state.hpp"
#include "sdk/src/subject_pairing.hpp"
#include "sdk/src/transport_registry.hpp"
#include "transport/cuda/cuda_memory.hpp"
#include "transport/token.hpp"

namespace ferry::detail {

namespace {

constexpr const char* kLeftOut =
    "left out by the transports option (ConnectorOptions::transports or FERRY_TRANSPORTS)";

std::string host_name() {
  char buf[HOST_NAME_MAX + 1] = {};
  if (gethostname(buf, sizeof buf - 1) != 0) return "unknown";
  return loop::sanitized_utf8(buf);
}

std::uint64_t total_of(const std::vector<Descriptor>& local) {
  std::uint64_t total = 0;
  for (const auto& d : local) total += d.size();
  return total;
}

// Throws why descriptor `i` cannot be used as the CUDA memory it says it is.
void check_cuda(const Descriptor& d, std::size_t i) {
  const std::string what = "descriptor " + std::to_string(i) + " (" + d.device().to_string() + ")";
  if (auto e = transport::cuda::check_device_range(d.ptr(), d.size(), d.device().id()))
    throw Error(e->code(), what + ": " + e->message());
}

}  // namespace

transport::Region region_of(const Descriptor& d) {
  const bool cuda = d.device().kind() == DeviceKind::cuda;
  return {d.bytes(), d.size(), cuda ? transport::MemoryKind::cuda : transport::MemoryKind::host,
          cuda ? d.device().id() : -1};
}

std::uint8_t memory_kinds_of(const std::vector<Descriptor>& local) {
  std::uint8_t kinds = 0;
  for (const Descriptor& d : local)
    kinds |= transport::bit(d.device().kind() == DeviceKind::cuda ? transport::MemoryKind::cuda
                                                                  : transport::MemoryKind::host);
  return kinds;
}

void check_writable(const std::vector<Descriptor>& local, const char* call) {
  for (std::size_t i = 0; i < local.size(); ++i)
    if (local[i].is_read_only())
      throw Error(ErrorCode::InvalidArgument, std::string(call) + ": descriptor " +
                                                  std::to_string(i) +
                                                  " is read-only (made from const memory)");
}

void check_local(const std::vector<Descriptor>& local) {
  if (local.empty()) throw Error(ErrorCode::InvalidArgument, "the descriptor list is empty");
  if (local.size() > RdmaMetadata::kMaxDescriptors)
    throw Error(ErrorCode::InvalidArgument, "the list holds " + std::to_string(local.size()) +
                                                " descriptors; metadata carries at most " +
                                                std::to_string(RdmaMetadata::kMaxDescriptors));
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < local.size(); ++i) {
    if (local[i].device().kind() == DeviceKind::cuda) check_cuda(local[i], i);
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

Core::Core(ConnectorOptions opts)
    : options(std::move(opts)), allow(options.endpoint_allow), next_id_(loop::random_u64() >> 16) {
  identity.name = options.name.empty() ? "ferry-" + std::to_string(::getpid()) : options.name;
  identity.id = loop::hex16(loop::random_u64());
  identity.host = host_name();
  identity.pid = ::getpid();
  if (identity.name.size() > 256)
    throw Error(ErrorCode::InvalidArgument, "the connector's name is longer than 256 characters");
  check_text(identity.name, "the connector's name", 256);
  if (options.peer_timeout.count() <= 0)
    throw Error(ErrorCode::InvalidArgument, "peer_timeout must be positive");
  if (options.default_timeout.count() < 0)
    throw Error(ErrorCode::InvalidArgument, "default_timeout must not be negative");
  if (options.subject_timeout.count() < 0)
    throw Error(ErrorCode::InvalidArgument, "subject_timeout must not be negative");
}

void Core::start() {
  NatsOptions nats_options = resolve(options.nats, identity.name);
  const std::vector<std::string> wanted = resolve_transports(options);
  loop = std::make_unique<loop::EventLoop>(options.loop, resolve_log(options, identity.name));
  try {
    loop->call([&] {
      transport::Context context;
      context.loop = loop->uv();
      context.defer = [this](std::function<void()> task) { loop->defer(std::move(task)); };
      context.log = loop->log();
      context.local_name = identity.name;
      context.local_id = std::stoull(identity.id, nullptr, 16);
      context.peer_timeout = options.peer_timeout;
      context.listener = options.listener;
      context.cuda = transport::cuda::usable_driver();
      context.bind_address = options.tcp.bind_address;
      if (!nats_options.servers.empty()) {
        nats = std::make_unique<sidechannel::NatsChannel>(*loop, nats_options, identity.id);
        has_nats = true;
        nats_status = nats->status();
        nats_prefix = nats_options.prefix;
        // Peers reach us where the cluster reaches us: the NATS socket's own interface.
        if (context.bind_address.empty()) context.bind_address = nats->local_ip();
        nats->subscribe(nats->own_subject("notify." + identity.id), {},
                        [this](const sidechannel::Message& m) { pairing::on_notice(*this, m); });
      }
      if (context.bind_address.empty()) context.bind_address = "127.0.0.1";
      for (const transport::Method& method : detail::methods()) {
        MethodInfo info = describe(method);
        std::optional<Error> refused;
        if (!wanted.empty() && std::find(wanted.begin(), wanted.end(), method.name) == wanted.end())
          refused = Error(ErrorCode::Unsupported, kLeftOut);
        else if (method.unavailable)
          refused = method.unavailable(options);
        std::unique_ptr<transport::Transport> t;
        if (!refused) {
          try {
            t = method.make(context, options);
          } catch (const Error& e) {
            // This host cannot offer it (a socket refused, no device): the others still run.
            if (e.code() != ErrorCode::Unsupported) throw;
            refused = e;
          }
        }
        if (refused) {
          info.detail = refused->message();
          absent.emplace_back(method.name, info.detail);
          methods.push_back(std::move(info));
          continue;
        }
        info.available = true;
        info.detail = method.needs;
        methods.push_back(std::move(info));
        transports.push_back(std::move(t));
      }
      std::stable_sort(methods.begin(), methods.end(),
                       [](const MethodInfo& a, const MethodInfo& b) { return a.rank > b.rank; });
      // Best first, so that metadata lists its endpoints in the order a peer should try them.
      std::stable_sort(transports.begin(), transports.end(), [](const auto& a, const auto& b) {
        return a->capabilities().rank > b->capabilities().rank;
      });
      if (transports.empty()) {
        std::string why;
        for (const auto& [method, reason] : absent)
          why += (why.empty() ? "" : "; ") + method + ": " + reason;
        throw Error(ErrorCode::Unsupported, "no transfer method is available here (" + why + ")");
      }
      for (const auto& t : transports) {
        capabilities.push_back(t->capabilities());
        for (auto& e : t->endpoints()) endpoints.push_back(std::move(e));
      }
      refresh_gauges();
      if (nats && nats_options.answer_stats) {
        std::weak_ptr<Core> weak = shared_from_this();
        nats->serve(nats_prefix + ".stats", [weak](const std::string&) {
          auto self = weak.lock();
          return self ? self->stats_answer() : std::string();
        });
      }
    });
    std::string listen = options.metrics.listen;
    if (listen.empty() && options.use_environment)
      if (const char* v = std::getenv("FERRY_METRICS_LISTEN")) listen = v;
    if (!listen.empty()) metrics_endpoint = serve_metrics(shared_from_this(), listen);
  } catch (...) {
    loop->close([this] {
      for (auto& t : transports) t->close();
      transports.clear();
      nats.reset();
    });
    throw;
  }
}

void Core::shutdown() noexcept {
  if (!loop) return;
  // No scrape sees this connector from here on.
  metrics_endpoint.reset();
  loop->close([this] {
    closed = true;
    std::vector<std::shared_ptr<OperationState>> ops;
    for (auto& [id, weak] : live)
      if (auto op = weak.lock()) ops.push_back(std::move(op));
    for (auto& op : ops)
      op->finish(OperationStatus::cancelled,
                 Error(ErrorCode::Cancelled, "the connector was closed"));
    const Error closing(ErrorCode::Cancelled, "the connector was closed");
    std::vector<std::shared_ptr<AttachmentState>> attached;
    for (auto& [id, weak] : attachments)
      if (auto a = weak.lock()) attached.push_back(std::move(a));
    for (auto& a : attached) a->detach(closing);
    std::vector<std::shared_ptr<RegionState>> served;
    for (auto& [id, weak] : regions)
      if (auto r = weak.lock()) served.push_back(std::move(r));
    for (auto& r : served) r->end(closing);
    end_messaging(*this);
    for (auto& t : transports) t->close();
    transports.clear();
    // Last, and without blocking the loop: the cancelled operations' completion notices
    // still leave, then the connection closes.
    if (nats) sidechannel::NatsChannel::close(std::move(nats));
    if (nats_status) nats_status->set(SideChannelState::closed, "the connector is closed");
  });
}

void Core::require_open_side_channel(const char* what) const {
  if (!nats_status) return;
  if (SideChannelStatus now = nats_status->get(); now.state == SideChannelState::closed)
    throw Error(ErrorCode::SideChannel,
                std::string(what) + ": the NATS side channel is closed: " + now.detail);
}

std::string Core::nats_note() const {
  if (!nats_status) return {};
  SideChannelStatus now = nats_status->get();
  if (now.state == SideChannelState::connected) return {};
  return std::string("; NATS is not connected (") + to_string(now.state) + ": " + now.detail + ")";
}

std::chrono::milliseconds Core::effective_timeout(const OperationOptions& o) const {
  if (o.timeout.count() < 0)
    throw Error(ErrorCode::InvalidArgument, "OperationOptions::timeout must not be negative");
  return o.timeout.count() > 0 ? o.timeout : options.default_timeout;
}

std::vector<Endpoint> Core::reachable(const RdmaMetadata& remote) const {
  std::vector<Endpoint> out;
  std::string refused;
  for (const Endpoint& e : remote.endpoints) {
    if (allow.allows(e.address))
      out.push_back(e);
    else
      refused += (refused.empty() ? "" : ", ") + e.method + " " + e.address;
  }
  if (out.empty())
    throw Error(ErrorCode::AccessDenied, "peer '" + remote.owner.name +
                                             "' offers only endpoints "
                                             "outside ConnectorOptions::endpoint_allow (" +
                                             refused + ")");
  return out;
}

transport::MethodSelector::Needs Core::needs_of(const RdmaMetadata& remote,
                                                std::uint8_t local_kinds) const {
  transport::MethodSelector::Needs needs;
  // A method must move the memory of both sides (the peer offers only methods that move its
  // own, and a method that cannot move ours would refuse at set-up).
  needs.memory_kinds = local_kinds;
  for (const RemoteDescriptor& d : remote.descriptors)
    needs.memory_kinds |=
        transport::bit(d.device.kind() == DeviceKind::cuda ? transport::MemoryKind::cuda
                                                           : transport::MemoryKind::host);
  needs.peer = remote.owner.id;
  needs.peer_name = remote.owner.name;
  needs.same_host = remote.owner.host == identity.host;
  return needs;
}

std::vector<std::pair<transport::Transport*, Endpoint>> Core::choose(const RdmaMetadata& remote,
                                                                     std::uint8_t local_kinds) {
  const std::vector<Endpoint> endpoints_allowed = reachable(remote);
  transport::MethodSelector::Needs needs = needs_of(remote, local_kinds);
  for (const auto& t : transports) {
    const std::string& method = t->capabilities().method;
    for (const Endpoint& e : endpoints_allowed)
      if (e.method == method) {
        if (auto why = t->unreachable(e)) needs.unreachable.emplace(method, *why);
        break;
      }
  }
  std::vector<std::pair<transport::Transport*, Endpoint>> out;
  for (auto& c : selector.choose(capabilities, endpoints_allowed, needs))
    out.emplace_back(transports[c.local].get(), std::move(c.endpoint));
  return out;
}

void Core::precheck(const RdmaMetadata& remote, std::uint8_t local_kinds) const {
  const std::vector<Endpoint> endpoints_allowed = reachable(remote);
  const transport::MethodSelector::Needs needs = needs_of(remote, local_kinds);
  // A selector that remembers no failures: only what is fixed decides. Endpoints that a
  // usable method could not even parse make the metadata invalid.
  for (const auto& c : transport::MethodSelector().choose(capabilities, endpoints_allowed, needs))
    if (auto e = transports[c.local]->endpoint_error(c.endpoint)) throw *e;
}

std::shared_ptr<PassiveOperation> Core::create_passive(OperationKind kind,
                                                       std::vector<Descriptor> local,
                                                       std::chrono::milliseconds timeout,
                                                       const std::string& subject) {
  if (closed) throw Error(ErrorCode::InvalidState, "the connector is closed");
  auto op =
      std::make_shared<PassiveOperation>(shared_from_this(), next_id(), kind, std::move(local));
  op->expose(transport::random_token());
  if (!subject.empty()) {
    std::string document;
    try {
      document = pairing::document(*this, *op);
    } catch (const Error& e) {
      // Refused before anyone could see it: nothing stays exposed.
      op->finish(OperationStatus::errored, e);
      throw;
    }
    pairing::serve(*this, *op, subject, std::move(document));
  }
  op->set_status(OperationStatus::initialized);
  op->arm(timeout);
  if (!subject.empty() && timeout.count() <= 0) op->arm_pairing(options.subject_timeout);
  return op;
}

LoopStart::LoopStart(std::shared_ptr<OperationState> o, std::function<void(OperationState&)> s,
                     std::chrono::milliseconds t)
    : op(std::move(o)), start(std::move(s)), timeout(t) {}

LoopStart::~LoopStart() {
  if (!ran && op) op->abandon(Error(ErrorCode::Cancelled, "the connector was closed"));
}

void LoopStart::run() {
  ran = true;
  op->arm(timeout);
  if (op->core->closed) {
    op->finish(OperationStatus::cancelled, Error(ErrorCode::Cancelled, "the connector was closed"));
    return;
  }
  try {
    start(*op);
  } catch (const Error& e) {
    op->finish(OperationStatus::errored, e);
  }
}

void Core::launch(std::vector<std::shared_ptr<LoopStart>> starts) {
  for (auto& s : starts) s->op->set_status(OperationStatus::in_progress);
  if (loop::EventLoop::Hold hold; loop->enter(hold)) {
    if (closed) throw Error(ErrorCode::InvalidState, "the connector is closed");
    // At once, but as a posted start would: a set-up refusal is the operation's error, and
    // its callbacks run deferred, after the caller's stack has unwound. A caller learns of a
    // refusal the same way from every thread.
    for (auto& s : starts) s->run();
    return;
  }
  auto task = std::make_shared<std::vector<std::shared_ptr<LoopStart>>>(std::move(starts));
  if (!loop->post([task] {
        for (auto& s : *task) s->run();
      })) {
    for (auto& s : *task) s->ran = true;  // nothing to abandon: the caller gets the error
    throw Error(ErrorCode::InvalidState, "the connector is closed");
  }
}

std::shared_ptr<ActiveOperation> Core::launch(std::shared_ptr<ActiveOperation> op,
                                              std::function<void(ActiveOperation&)> start,
                                              std::chrono::milliseconds timeout) {
  launch({std::make_shared<LoopStart>(
      op,
      [start = std::move(start)](OperationState& o) { start(static_cast<ActiveOperation&>(o)); },
      timeout)});
  return op;
}

std::shared_ptr<ActiveOperation> Core::begin_active(const RdmaMetadata& remote,
                                                    std::vector<Descriptor> local,
                                                    std::chrono::milliseconds timeout) {
  precheck(remote, memory_kinds_of(local));
  auto op = std::make_shared<ActiveOperation>(shared_from_this(), next_id(), remote.operation_kind,
                                              std::move(local));
  return launch(
      std::move(op), [remote](ActiveOperation& o) { o.start(remote); }, timeout);
}

std::shared_ptr<ActiveOperation> Core::begin_by_subject(OperationKind kind,
                                                        const std::string& subject,
                                                        std::vector<Descriptor> local,
                                                        std::chrono::milliseconds timeout) {
  auto op =
      std::make_shared<ActiveOperation>(shared_from_this(), next_id(), kind, std::move(local));
  op->asking.emplace();
  op->asking->subject = subject;
  const std::chrono::milliseconds pairing =
      timeout.count() > 0 ? std::chrono::milliseconds(0) : options.subject_timeout;
  return launch(
      std::move(op),
      [pairing](ActiveOperation& o) {
        pairing::ask(o);
        o.arm_pairing(pairing);
      },
      timeout);
}

}  // namespace ferry::detail

namespace ferry {

std::vector<MethodInfo> probe_methods(const ConnectorOptions& options) {
  const std::vector<std::string> wanted = detail::resolve_transports(options);
  std::vector<MethodInfo> out;
  for (const transport::Method& m : detail::methods()) {
    MethodInfo info = detail::describe(m);
    if (!wanted.empty() && std::find(wanted.begin(), wanted.end(), m.name) == wanted.end()) {
      info.detail = detail::kLeftOut;
    } else {
      const std::optional<Error> why = m.unavailable ? m.unavailable(options) : std::nullopt;
      info.available = !why;
      info.detail = why ? why->message() : m.needs;
    }
    out.push_back(std::move(info));
  }
  std::stable_sort(out.begin(), out.end(),
                   [](const MethodInfo& a, const MethodInfo& b) { return a.rank > b.rank; });
  return out;
}

}  // namespace ferry
