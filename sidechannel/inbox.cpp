#include "sidechannel/inbox.hpp"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <iterator>
#include <string_view>

#include <ferry/error.hpp>

#include "loop/ids.hpp"

namespace ferry::sidechannel {

namespace {

std::atomic<RandomSource> random_source{&loop::random_u64};

// A fresh non-zero id that `taken` does not know. A random 64-bit id is zero or taken with
// negligible odds, so a few draws that all are point at a broken source: the draws are
// bounded, never a loop. A source that fails throws (loop::random_u64: Error(Internal)).
template <class Taken>
std::uint64_t fresh_id(const Taken& taken) {
  constexpr int kDraws = 8;
  for (int draw = 0; draw < kDraws; ++draw)
    if (std::uint64_t id = random_source.load()(); id != 0 && !taken(id)) return id;
  throw Error(ErrorCode::Internal, "no fresh random id in " + std::to_string(kDraws) +
                                       " draws: the random source repeats itself");
}

// "<base>.<kind><id in hex>", as is_reply_inbox() expects it for requests.
std::string token_subject(const std::string& base, char kind, std::uint64_t id) {
  char token[24];
  std::snprintf(token, sizeof token, ".%c%llx", kind, static_cast<unsigned long long>(id));
  return base + token;
}

// An id as token_subject() writes it: 1 to 16 lowercase hex digits, no leading zero.
bool parse_id(std::string_view text, std::uint64_t& id) {
  if (text.size() > 16 || !loop::is_lower_hex(text) || text[0] == '0') return false;
  id = 0;
  for (char c : text) id = id << 4 | static_cast<std::uint64_t>(c <= '9' ? c - '0' : c - 'a' + 10);
  return true;
}

}  // namespace

RandomSource set_random_source_for_testing(RandomSource source) {
  return random_source.exchange(source != nullptr ? source : &loop::random_u64);
}

Inbox::Inbox(std::string subject, std::size_t max_open_requests, loop::Log log)
    : subject_(std::move(subject)), max_open_requests_(max_open_requests), log_(std::move(log)) {}

std::uint64_t Inbox::open_request(MessageHandler handler) {
  // Drawn first: a failure leaves the table as it was.
  const std::uint64_t id = fresh_id([this](std::uint64_t r) { return requests_.count(r) != 0; });
  if (requests_.size() >= max_open_requests_ && !order_.empty()) {
    // The oldest is the likeliest to have been forgotten by its caller; a caller that still
    // waits asks again (the connector does every request_timeout).
    requests_.erase(order_.front());
    order_.pop_front();
    if (!noted_cap_) {
      noted_cap_ = true;
      log_.warning("more than " + std::to_string(max_open_requests_) +
                   " NATS requests are open; dropping the oldest unanswered ones (does a "
                   "subscriber hold a subject without answering?)");
    }
  }
  order_.push_back(id);
  requests_.emplace(id, OpenRequest{std::move(handler), std::prev(order_.end())});
  return id;
}

std::string Inbox::request_subject(std::uint64_t id) const {
  return token_subject(subject_, 'r', id);
}

void Inbox::drop_request(std::uint64_t id) noexcept {
  auto it = requests_.find(id);
  if (it == requests_.end()) return;
  order_.erase(it->second.in_order);
  requests_.erase(it);
}

std::uint64_t Inbox::await_confirm(Confirmed done, std::string subscribed, std::uint64_t sub,
                                   Clock::time_point deadline) {
  const std::uint64_t id = fresh_id([this](std::uint64_t c) { return confirms_.count(c) != 0; });
  confirms_.emplace(id, Wait{std::move(done), std::move(subscribed), sub, deadline});
  return id;
}

std::string Inbox::confirm_subject(std::uint64_t id) const {
  return token_subject(subject_, 'c', id);
}

Inbox::Confirmed Inbox::take_confirm(std::uint64_t id) {
  auto it = confirms_.find(id);
  if (it == confirms_.end()) return {};
  Confirmed done = std::move(it->second.done);
  confirms_.erase(it);
  return done;
}

Inbox::Confirmed Inbox::take_confirm_of(std::uint64_t sub) {
  auto it = std::find_if(confirms_.begin(), confirms_.end(),
                         [sub](const auto& entry) { return entry.second.sub == sub; });
  if (it == confirms_.end()) return {};
  Confirmed done = std::move(it->second.done);
  confirms_.erase(it);
  return done;
}

std::vector<std::pair<Inbox::Confirmed, std::string>> Inbox::take_expired(
    Clock::time_point now, std::chrono::milliseconds timeout) {
  std::vector<std::pair<Confirmed, std::string>> expired;
  for (auto it = confirms_.begin(); it != confirms_.end();) {
    if (it->second.deadline > now) {
      ++it;
      continue;
    }
    expired.emplace_back(std::move(it->second.done),
                         "the NATS server did not confirm the subscription to '" +
                             it->second.subject + "' within " + std::to_string(timeout.count()) +
                             " ms");
    it = confirms_.erase(it);
  }
  return expired;
}

std::vector<Inbox::Confirmed> Inbox::take_all_confirms() {
  std::vector<Confirmed> all;
  for (auto& [id, wait] : confirms_) all.push_back(std::move(wait.done));
  confirms_.clear();
  return all;
}

std::vector<std::string> Inbox::restart_confirms(Clock::time_point deadline) {
  std::vector<std::string> subjects;
  for (auto& [id, wait] : confirms_) {
    wait.deadline = deadline;
    subjects.push_back(confirm_subject(id));
  }
  return subjects;
}

std::optional<Inbox::Clock::time_point> Inbox::earliest_deadline() const {
  std::optional<Clock::time_point> earliest;
  for (const auto& [id, wait] : confirms_)
    if (!earliest || wait.deadline < *earliest) earliest = wait.deadline;
  return earliest;
}

void Inbox::deliver(const Message& m) {
  // "<inbox>.r<id>" answers a request; "<inbox>.c<id>" confirms a subscription.
  const std::string_view subject = m.subject;
  if (subject.size() < subject_.size() + 3 || subject.substr(0, subject_.size()) != subject_ ||
      subject[subject_.size()] != '.')
    return;
  const char kind = subject[subject_.size() + 1];
  std::uint64_t id = 0;
  if (!parse_id(subject.substr(subject_.size() + 2), id)) return;
  if (kind == 'c') {
    if (Confirmed done = take_confirm(id)) done({});
    return;
  }
  if (kind != 'r') return;
  auto it = requests_.find(id);
  if (it == requests_.end()) return;  // answered already, cancelled or dropped
  MessageHandler handler = std::move(it->second.handler);
  order_.erase(it->second.in_order);
  requests_.erase(it);
  handler(m);
}

void Inbox::clear() noexcept {
  requests_.clear();
  order_.clear();
  confirms_.clear();
}

}  // namespace ferry::sidechannel
