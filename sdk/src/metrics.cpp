// A connector's figures for Prometheus (docs/operations.md), through prometheus-cpp: its text
// format, and its HTTP server (one per listen address and process, shared by the connectors
// that name it, kept until the process ends). The figures are taken at each scrape from stats():
// nothing is counted twice, and an idle connector is not woken but by the scrape itself (its loop
// counts connections).
#include <prometheus/collectable.h>
#include <prometheus/exposer.h>
#include <prometheus/metric_family.h>
#include <prometheus/text_serializer.h>

#include <array>
#include <chrono>
#include <limits>
#include <map>
#include <mutex>

#include <ferry/error.hpp>

#include "sdk/src/core.hpp"
#include "sdk/src/metrics.hpp"
#include "sdk/src/stats_names.hpp"

namespace ferry::detail {

namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;
using Labels = std::vector<ClientMetric::Label>;

// Latency buckets, in seconds: 10 us to 60 s.
constexpr std::array<double, 19> kBuckets = {10e-6,  25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3,
                                             2.5e-3, 5e-3,  10e-3, 25e-3,  50e-3,  100e-3, 250e-3,
                                             500e-3, 1.0,   2.5,   10.0,   60.0};

// The families of one scrape, each made once and filled by connector and label set.
class Families {
 public:
  explicit Families(Labels base) : base_(std::move(base)) {}

  void counter(const std::string& name, const std::string& help, Labels labels, double value) {
    ClientMetric& m = add(name, help, MetricType::Counter, std::move(labels));
    m.counter.value = value;
  }
  void gauge(const std::string& name, const std::string& help, Labels labels, double value) {
    ClientMetric& m = add(name, help, MetricType::Gauge, std::move(labels));
    m.gauge.value = value;
  }
  void histogram(const std::string& name, const std::string& help, Labels labels,
                 const LatencyHistogram& h) {
    ClientMetric& m = add(name, help, MetricType::Histogram, std::move(labels));
    m.histogram.sample_count = h.count();
    m.histogram.sample_sum = h.sum_seconds();
    for (double le : kBuckets)
      m.histogram.bucket.push_back(
          {h.count_at_most(std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::duration<double>(le))),
           le});
    m.histogram.bucket.push_back({h.count(), std::numeric_limits<double>::infinity()});
  }
  std::vector<MetricFamily> take() {
    std::vector<MetricFamily> out;
    out.reserve(order_.size());
    for (const std::string& name : order_) out.push_back(std::move(by_name_[name]));
    return out;
  }

 private:
  ClientMetric& add(const std::string& name, const std::string& help, MetricType type,
                    Labels labels) {
    auto [it, fresh] = by_name_.try_emplace(name);
    if (fresh) {
      it->second.name = name;
      it->second.help = help;
      it->second.type = type;
      order_.push_back(name);
    }
    ClientMetric m;
    m.label = base_;
    for (auto& l : labels) m.label.push_back(std::move(l));
    it->second.metric.push_back(std::move(m));
    return it->second.metric.back();
  }

  Labels base_;
  std::map<std::string, MetricFamily> by_name_;
  std::vector<std::string> order_;
};

std::vector<MetricFamily> collect(Core& core) {
  using namespace std::chrono_literals;
  const ConnectorStats s = core.stats_fresh(100ms);
  Families f({{"connector", core.identity.name}, {"connector_id", core.identity.id}});
  std::string methods;
  for (const transport::Capabilities& c : core.capabilities)
    methods += (methods.empty() ? "" : ",") + c.method;
  f.gauge("ferry_connector_info", "A connector of this process (always 1): its host and methods.",
          {{"host", core.identity.host}, {"methods", methods}}, 1);
  f.counter("ferry_operations_started_total", "Operations begun (active) or created (passive).",
            {{"role", "active"}}, static_cast<double>(s.active));
  f.counter("ferry_operations_started_total", "Operations begun (active) or created (passive).",
            {{"role", "passive"}}, static_cast<double>(s.passive));
  f.gauge("ferry_operations_live", "Operations not ended yet.", {}, static_cast<double>(s.live));
  for (const MethodStats& m : s.methods) {
    for (const OperationCount& c : m.counts) {
      Labels l = {{"method", m.method},
                  {"kind", kind_name(c.kind)},
                  {"role", c.passive ? "passive" : "active"},
                  {"outcome", outcome_name(c.outcome)}};
      f.counter("ferry_operations_total",
                "Operations that ended, by method, kind, role and outcome.", l,
                static_cast<double>(c.operations));
      f.counter("ferry_operation_bytes_total",
                "Bytes the ended operations covered (their local descriptors), by method, kind, "
                "role and outcome.",
                std::move(l), static_cast<double>(c.bytes));
    }
    f.counter("ferry_transferred_bytes_total",
              "Bytes of completed operations that came into this process's memory (in) or went "
              "out of it (out).",
              {{"method", m.method}, {"direction", "in"}}, static_cast<double>(m.bytes_in));
    f.counter("ferry_transferred_bytes_total",
              "Bytes of completed operations that came into this process's memory (in) or went "
              "out of it (out).",
              {{"method", m.method}, {"direction", "out"}}, static_cast<double>(m.bytes_out));
    for (const ErrorCount& e : m.errors)
      f.counter("ferry_operation_errors_total",
                "Operations that did not complete, by method and error code.",
                {{"method", m.method}, {"code", std::string(to_string(e.code))}},
                static_cast<double>(e.operations));
    f.counter("ferry_setup_fallbacks_total",
              "Set-ups of a method that failed before a byte moved, after which the operation "
              "fell back to its next method (or ended).",
              {{"method", m.method}}, static_cast<double>(m.fallbacks));
    f.histogram("ferry_operation_latency_seconds",
                "Completed operations, from the call that made them to their completion.",
                {{"method", m.method}}, m.latency);
    f.histogram("ferry_operation_transfer_seconds",
                "Completed operations, from the peer's claim (passive) or the call (active) to "
                "completion.",
                {{"method", m.method}}, m.transfer);
    f.histogram("ferry_operation_wait_seconds",
                "Completed passive operations, from their creation to their peer's claim.",
                {{"method", m.method}}, m.wait);
  }
  for (const auto& [method, n] : s.connections)
    f.gauge("ferry_connections", "Connections open now, both ways, by method.",
            {{"method", method}}, static_cast<double>(n));
  f.gauge("ferry_regions", "Regions served here that have not ended.", {},
          static_cast<double>(s.regions));
  f.gauge("ferry_attachments", "Attachments to peers' regions made here that have not ended.", {},
          static_cast<double>(s.attachments));
  for (const PeerStats& p : s.peers) {
    f.counter("ferry_peer_transferred_bytes_total",
              "Bytes of completed operations with each of the busiest peers, by direction.",
              {{"peer", p.name}, {"peer_id", p.id}, {"direction", "in"}},
              static_cast<double>(p.bytes_in));
    f.counter("ferry_peer_transferred_bytes_total",
              "Bytes of completed operations with each of the busiest peers, by direction.",
              {{"peer", p.name}, {"peer_id", p.id}, {"direction", "out"}},
              static_cast<double>(p.bytes_out));
  }
  if (core.nats_status) {
    const SideChannelStatus side = core.nats_status->get();
    f.gauge("ferry_nats_connected", "1 while the NATS side channel is connected, else 0.", {},
            side.state == SideChannelState::connected ? 1 : 0);
    f.counter("ferry_nats_reconnects_total",
              "Times the NATS side channel reconnected after losing its server.", {},
              static_cast<double>(s.nats_reconnects));
  }
  return f.take();
}

// What the HTTP server asks at each scrape; the connector may be gone meanwhile.
class Collector : public prometheus::Collectable {
 public:
  explicit Collector(std::weak_ptr<Core> core) : core_(std::move(core)) {}
  std::vector<MetricFamily> Collect() const override {
    auto core = core_.lock();
    if (!core) return {};
    try {
      return collect(*core);
    } catch (const std::exception&) {
      return {};
    }
  }

 private:
  std::weak_ptr<Core> core_;
};

// One HTTP server per listen address in the process, from the first connector that names it
// until the process ends. Stopping one takes up to 2 s (its thread polls at that pace), which
// the destructor of the last connector to use it would otherwise wait; and a connector made
// later at the same address finds it again.
struct Servers {
  std::mutex mu;
  std::map<std::string, std::shared_ptr<prometheus::Exposer>> by_address;
};

Servers& servers() {
  static Servers* s = new Servers;  // never destroyed: connectors may end during exit
  return *s;
}

struct Registration {
  std::shared_ptr<prometheus::Exposer> server;
  std::shared_ptr<Collector> collector;
  ~Registration() { server->RemoveCollectable(collector); }
};

}  // namespace

std::shared_ptr<void> serve_metrics(const std::shared_ptr<Core>& core, const std::string& listen) {
  std::shared_ptr<prometheus::Exposer> server;
  {
    Servers& all = servers();
    std::lock_guard lock(all.mu);
    server = all.by_address[listen];
    if (!server) {
      try {
        server = std::make_shared<prometheus::Exposer>(listen, 1);
      } catch (const std::exception& e) {
        throw Error(ErrorCode::InvalidArgument, "cannot serve metrics at '" + listen +
                                                    "' (ConnectorOptions::metrics.listen " +
                                                    "or FERRY_METRICS_LISTEN): " + e.what());
      }
      all.by_address[listen] = server;
    }
  }
  auto r = std::make_shared<Registration>();
  r->server = std::move(server);
  r->collector = std::make_shared<Collector>(core);
  r->server->RegisterCollectable(r->collector);
  return r;
}

std::string metrics_text(Core& core) {
  return prometheus::TextSerializer().Serialize(collect(core));
}

}  // namespace ferry::detail
