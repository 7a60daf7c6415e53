#pragma once

// The simulated CUDA driver (tests/support/fake_cuda/) from a test built with
// FERRY_FAKE_CUDA_PATH (its path): selecting it, and reaching its counters.

#include <dlfcn.h>

#include <cstdlib>

namespace ferry::test {

/// Selects the simulated driver (FERRY_CUDA_DRIVER) and, when `copy_us` is given, the delay of
/// each of its copies (FERRY_FAKE_CUDA_COPY_US), each unless already set: ctest sets both, this
/// is for running a binary by hand. Call it before main, from a static initializer.
inline bool use_simulated_driver(const char* copy_us = nullptr) {
  return ::setenv("FERRY_CUDA_DRIVER", FERRY_FAKE_CUDA_PATH, 0) == 0 &&
         (copy_us == nullptr || ::setenv("FERRY_FAKE_CUDA_COPY_US", copy_us, 0) == 0);
}

/// The simulated driver's function `name` (its counters: ferry_fake_cuda_*), as loaded in this
/// process; null when it is not loaded or has no such function.
template <class Fn>
Fn* simulated_function(const char* name) {
  void* lib = ::dlopen(FERRY_FAKE_CUDA_PATH, RTLD_NOW | RTLD_NOLOAD);
  if (lib == nullptr) return nullptr;
  void* fn = ::dlsym(lib, name);
  ::dlclose(lib);  // only the reference RTLD_NOLOAD took: the driver table keeps it loaded
  return reinterpret_cast<Fn*>(fn);
}

}  // namespace ferry::test
