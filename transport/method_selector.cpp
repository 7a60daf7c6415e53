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
    std::string why;
    if ((caps.memory_kinds & needs.memory_kinds) != needs.memory_kinds)
      why = "moves " + kinds_text(caps.memory_kinds) + " memory, this operation needs " +
            kinds_text(needs.memory_kinds);
    else if (caps.same_host_only && !needs.same_host)
      why = "works on one host only";
    else if (auto u = needs.unreachable.find(caps.method); u != needs.unreachable.end())
      why = u->second.message();
    else
      why = failure(needs.peer, caps.method);
    if (!why.empty()) {
      passed_over += "; " + caps.method + ": " + why;
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
                            const std::string& why) {
  failed_[{peer, method}] = Failure{why, std::chrono::steady_clock::now()};
}

std::string MethodSelector::failure(const std::string& peer, const std::string& method) const {
  auto it = failed_.find({peer, method});
  if (it == failed_.end()) return {};
  if (std::chrono::steady_clock::now() - it->second.at > remember_) return {};
  return "failed before toward this peer (" + it->second.why + ")";
}

}  // namespace ferry::transport
