#include "transport/kit/admission.hpp"

#include <sys/resource.h>

#include <algorithm>

namespace ferry::transport::kit {

namespace {

// Never accept so many connections that the process runs out of descriptors for everything
// else (NATS, client connections, the application's own files).
std::size_t within_descriptor_limit(std::size_t wanted) {
  rlimit nofile{};
  if (getrlimit(RLIMIT_NOFILE, &nofile) != 0 || nofile.rlim_cur == RLIM_INFINITY) return wanted;
  const auto reserve = std::min<rlim_t>(nofile.rlim_cur / 4, 256);
  const auto usable = static_cast<std::size_t>(nofile.rlim_cur - reserve);
  return std::max<std::size_t>(1, std::min(wanted, usable));
}

}  // namespace

Admission::Admission(uv_loop_t* loop, const ListenerOptions& bounds, Evict evict)
    : bounds_(bounds),
      max_connections_(within_descriptor_limit(bounds.max_connections)),
      evict_(std::move(evict)),
      sweep_(loop::Timer::timer(loop, this)) {}

bool Admission::admit() {
  if (!opened_.empty() && opened_.size() >= bounds_.max_unclaimed) {
    const std::uint64_t victim = !silent_.empty() ? *silent_.begin() : *greeted_.begin();
    const bool silent = !silent_.empty();
    closed(victim);
    evict_(victim, silent ? "too many connections that claim no operation (this one said nothing)"
                          : "too many connections that claim no operation");
  }
  return members_.size() < max_connections_;
}

void Admission::accepted(std::uint64_t id) {
  members_.insert(id);
  opened_.emplace(id, std::chrono::steady_clock::now());
  silent_.insert(id);
  if (opened_.size() == 1) arm();
}

void Admission::heard(std::uint64_t id) {
  if (silent_.erase(id) != 0) greeted_.insert(id);
}

void Admission::claimed(std::uint64_t id) {
  opened_.erase(id);
  silent_.erase(id);
  greeted_.erase(id);
}

void Admission::closed(std::uint64_t id) {
  claimed(id);
  members_.erase(id);
}

void Admission::stop() {
  sweep_.reset();
  members_.clear();
  opened_.clear();
  silent_.clear();
  greeted_.clear();
}

void Admission::arm() {
  if (!sweep_) return;
  uv_timer_start(
      sweep_.get(),
      [](uv_timer_t* t) {
        if (t->data != nullptr) static_cast<Admission*>(t->data)->sweep();
      },
      static_cast<std::uint64_t>(bounds_.unclaimed_timeout.count()), 0);
}

void Admission::sweep() {
  // Peers accepted before the cut-off that still claim nothing are closed. The timer runs only
  // while such peers exist.
  const auto cutoff = std::chrono::steady_clock::now() - bounds_.unclaimed_timeout;
  std::vector<std::uint64_t> stale;
  for (const auto& [id, at] : opened_)
    if (at <= cutoff) stale.push_back(id);
  const std::string why =
      "no operation claimed within " + std::to_string(bounds_.unclaimed_timeout.count()) + " ms";
  for (std::uint64_t id : stale) {
    closed(id);
    evict_(id, why);
  }
  if (!opened_.empty()) arm();
}

}  // namespace ferry::transport::kit
