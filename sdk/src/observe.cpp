// What a connector shows of itself (docs/operations.md): the gauges its loop counts, stats()
// with them, and the answer to the well-known stats subject that ferry-top asks.
#include <future>
#include <memory>

#include <nlohmann/json.hpp>

#include "sdk/src/core.hpp"

namespace ferry::detail {

void Core::refresh_gauges() {
  std::vector<std::pair<std::string, std::uint64_t>> counted;
  counted.reserve(transports.size());
  for (const auto& t : transports) counted.emplace_back(t->capabilities().method, t->connections());
  // Regions and attachments leave their tables when they end: the sizes are the counts (this
  // runs at every operation's end, so nothing here walks a table).
  stats.set_gauges(std::move(counted), regions.size(), attachments.size());
}

ConnectorStats Core::stats_now() {
  if (loop && loop->in_loop_thread()) refresh_gauges();
  ConnectorStats s = stats.snapshot();
  if (nats_status) s.nats_reconnects = nats_status->reconnects();
  return s;
}

ConnectorStats Core::stats_fresh(std::chrono::milliseconds wait) {
  if (loop && !loop->in_loop_thread()) {
    // The loop counts; this thread waits a little for it, never the loop for this thread.
    auto counted = std::make_shared<std::promise<void>>();
    std::future<void> done = counted->get_future();
    std::weak_ptr<Core> weak = weak_from_this();
    if (loop->post([weak, counted] {
          if (auto self = weak.lock()) self->refresh_gauges();
          counted->set_value();
        }))
      done.wait_for(wait);
  }
  return stats_now();
}

std::string Core::stats_answer() {
  using namespace std::chrono_literals;
  const ConnectorStats s = stats_fresh(100ms);
  nlohmann::json j;
  j["version"] = 1;
  j["name"] = identity.name;
  j["id"] = identity.id;
  j["host"] = identity.host;
  j["pid"] = identity.pid;
  j["uptime_s"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - born).count();
  j["methods"] = nlohmann::json::array();
  for (const transport::Capabilities& c : capabilities) j["methods"].push_back(c.method);
  const SideChannelStatus side = nats_status ? nats_status->get() : SideChannelStatus{};
  j["nats"] = {
      {"state", to_string(side.state)}, {"detail", side.detail}, {"reconnects", s.nats_reconnects}};
  j["stats"] = nlohmann::json::parse(s.to_json());
  return j.dump();
}

}  // namespace ferry::detail
