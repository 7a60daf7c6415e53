// The CUDA component of a build without CUDA (FERRY_WITH_CUDA=OFF, or no cuda.h): the same
// declarations, answering that CUDA memory cannot be used. Nothing else changes shape.

#include <string>

#include "transport/cuda/cuda_memory.hpp"
#include "transport/cuda/stager.hpp"

namespace ferry::transport::cuda {

namespace {

constexpr const char* kAbsent =
    "this ferry was built without CUDA (FERRY_WITH_CUDA=OFF, or no cuda.h)";

}  // namespace

bool built() noexcept { return false; }

const CudaApi* usable_driver() { return nullptr; }

std::optional<Error> unavailable() { return Error(ErrorCode::Unsupported, kAbsent); }

std::optional<Error> check_device_range(const void*, std::size_t, int) {
  return Error(ErrorCode::Unsupported, kAbsent);
}

DriverInfo describe() { throw Error(ErrorCode::Unsupported, kAbsent); }

struct Stager::Impl {};

Stager::Stager(uv_loop_s*, const CudaApi&, Defer, std::size_t, std::size_t, loop::Log) {
  throw Error(ErrorCode::Unsupported, kAbsent);
}
Stager::~Stager() = default;
std::size_t Stager::chunk_size() const noexcept { return 0; }
void Stager::set_wake(Wake) {}
std::uint64_t Stager::open(std::uint64_t, std::vector<Piece>, bool) {
  throw Error(ErrorCode::Unsupported, kAbsent);
}
std::byte* Stager::chunk(std::uint64_t) const { return nullptr; }
std::uint64_t Stager::bytes(std::uint64_t) const { return 0; }
void Stager::fill(std::uint64_t, Done) { throw Error(ErrorCode::Unsupported, kAbsent); }
void Stager::drain(std::uint64_t, Done) { throw Error(ErrorCode::Unsupported, kAbsent); }
void Stager::close(std::uint64_t) {}
void Stager::drop(std::uint64_t) {}
bool Stager::copying(std::uint64_t, std::uint64_t) const { return false; }
std::uint64_t Stager::last_unit() const noexcept { return 0; }
std::size_t Stager::held() const noexcept { return 0; }

}  // namespace ferry::transport::cuda
