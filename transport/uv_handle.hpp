#pragma once

#include <uv.h>

namespace ferry::transport {

/// Closes a heap-allocated libuv handle and deletes it once libuv is done with it.
template <class Handle>
void close_and_delete(Handle* handle) {
  if (handle == nullptr) return;
  auto* h = reinterpret_cast<uv_handle_t*>(handle);
  if (uv_is_closing(h)) return;
  uv_close(h, [](uv_handle_t* closed) { delete reinterpret_cast<Handle*>(closed); });
}

}  // namespace ferry::transport
