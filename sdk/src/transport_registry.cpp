#include "sdk/src/transport_registry.hpp"

#include <algorithm>
#include <mutex>

#include "transport/cuda/cuda_memory.hpp"

namespace ferry::detail {

namespace {

std::mutex added_mu;
std::vector<transport::Method>& added() {
  static std::vector<transport::Method> list;
  return list;
}

}  // namespace

std::vector<transport::Method> methods() {
  std::vector<transport::Method> out;
  for (const transport::Method* m : transport::builtin_methods()) out.push_back(*m);
  std::lock_guard lock(added_mu);
  for (const auto& m : added()) {
    std::erase_if(out, [&](const transport::Method& b) { return b.name == m.name; });
    out.push_back(m);
  }
  return out;
}

void add_method(transport::Method method) {
  std::lock_guard lock(added_mu);
  std::erase_if(added(), [&](const transport::Method& m) { return m.name == method.name; });
  added().push_back(std::move(method));
}

void remove_method(const std::string& name) {
  std::lock_guard lock(added_mu);
  std::erase_if(added(), [&](const transport::Method& m) { return m.name == name; });
}

MethodInfo describe(const transport::Method& m) {
  MethodInfo info;
  info.method = m.name;
  info.rank = m.rank;
  info.moves_cuda = transport::cuda::built() && m.moves_cuda_both_ways();
  info.moves_host = (m.serves & transport::bit(transport::MemoryKind::host)) != 0;
  return info;
}

}  // namespace ferry::detail
