#pragma once

#include <uv.h>

namespace ferry::sidechannel {

/// Closes a heap-allocated libuv handle and deletes it once libuv is done with it. For every
/// layer that owns handles on a connector's loop (the loop itself, the side channel, the
/// transports, the operations).
template <class Handle>
void close_and_delete(Handle* handle) {
  if (handle == nullptr) return;
  auto* h = reinterpret_cast<uv_handle_t*>(handle);
  if (uv_is_closing(h)) return;
  uv_close(h, [](uv_handle_t* closed) { delete reinterpret_cast<Handle*>(closed); });
}

}  // namespace ferry::sidechannel
