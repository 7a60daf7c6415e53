#include "transport/method_selector.hpp"

#include <algorithm>

namespace ferry::transport {

namespace {

std::string kinds_text(std::uint8_t kinds) {
  std::string out;
  if ((kinds & bit(MemoryKind::host)) != 0) out += "host";
  if ((kinds & bit(MemoryKind::cuda)) != 0) out += out.empty() ? "cuda" : "+cuda";
  return out.empty() ? "none" : out;
}

}  // namespace

std::optional<std::string> MethodSelector::passed_over_because(const Capabilities& caps,
                                                               const Needs& needs) const {
  if ((caps.memory_kinds & needs.memory_kinds) != needs.memory_kinds)
    return "moves " + kinds_text(caps.memory_kinds) + " memory, this operation needs " +
           kinds_text(needs.memory_kinds);
  if (caps.same_host_only && !needs.same_host) return "works on one host only";
  if (auto u = needs.unreachable.find(caps.method); u != needs.unreachable.end())
    return u->second.message();
  if (auto f = failure(needs.peer, caps.method)) return f->message();
  return std::nullopt;
}

std::vector<MethodSelector::Choice> MethodSelector::choose(const std::vector<Capabilities>& local,
                                                           const std::vector<Endpoint>& remote,
                                                           const Needs& needs) const {
  std::vector<Choice> out;
  std::string passed_over;
  for (std::size_t i = 0; i < local.size(); ++i) {
    const Capabilities& caps = local[i];
    auto e = std::find_if(remote.begin(), remote.end(),
                          [&](const Endpoint& ep) { return ep.method == caps.method; });
    if (e == remote.end()) continue;
    if (auto why = passed_over_because(caps, needs)) {
      passed_over += "; " + caps.method + ": " + *why;
      continue;
    }
    out.push_back({i, *e});
  }
  std::stable_sort(out.begin(), out.end(), [&](const Choice& a, const Choice& b) {
    return local[a.local].rank > local[b.local].rank;
  });
  if (!out.empty()) return out;
  std::string offered;
  for (const Endpoint& e : remote) offered += (offered.empty() ? "" : ", ") + e.method;
  std::string ours;
  for (const Capabilities& c : local) ours += (ours.empty() ? "" : ", ") + c.method;
  throw Error(ErrorCode::NoCommonMethod, "peer '" + needs.peer_name + "' offers [" + offered +
                                             "]; this connector has [" + ours + "]" + passed_over);
}

void MethodSelector::failed(const std::string& peer, const std::string& method,
                            const Error& error) {
  failed_.insert_or_assign({peer, method}, Failure{error, std::chrono::steady_clock::now()});
}

std::optional<Error> MethodSelector::failure(const std::string& peer,
                                             const std::string& method) const {
  auto it = failed_.find({peer, method});
  if (it == failed_.end()) return std::nullopt;
  if (std::chrono::steady_clock::now() - it->second.at > remember_) return std::nullopt;
  const Error& e = it->second.error;
  Error before(e.code(), "failed before toward this peer (" + e.message() + ")");
  before.set_retryable(e.retryable());
  return before;
}

}  // namespace ferry::transport
