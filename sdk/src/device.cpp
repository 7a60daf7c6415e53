#include <ferry/device.hpp>
#include <ferry/error.hpp>

#include <charconv>

namespace ferry {

Device::Device(std::string_view spec) {
  if (spec == "host" || spec == "cpu") return;
  if (spec == "cuda") {
    kind_ = DeviceKind::cuda;
    return;
  }
  constexpr std::string_view prefix = "cuda:";
  if (spec.substr(0, prefix.size()) == prefix) {
    std::string_view digits = spec.substr(prefix.size());
    int ordinal = -1;
    auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), ordinal);
    if (!digits.empty() && ec == std::errc() && end == digits.data() + digits.size() &&
        ordinal >= 0) {
      kind_ = DeviceKind::cuda;
      id_ = ordinal;
      return;
    }
  }
  throw Error(ErrorCode::InvalidArgument,
              "device '" + std::string(spec) + "' is not one of host, cpu, cuda, cuda:N");
}

Device Device::cuda(int ordinal) {
  if (ordinal < 0)
    throw Error(ErrorCode::InvalidArgument, "CUDA ordinal " + std::to_string(ordinal) + " < 0");
  return Device(DeviceKind::cuda, ordinal);
}

std::string Device::to_string() const {
  if (kind_ == DeviceKind::cuda) return "cuda:" + std::to_string(id_);
  return "host";
}

}  // namespace ferry
