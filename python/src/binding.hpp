// The pieces the binding's translation units share (python/src/*.cpp make one module,
// ferry._ferry; the package ferry/ builds nixl_connect's names on it).
//
// Threads: ferry's loop thread never takes the GIL. Everything it hands to Python (an
// operation's end, a region's events, a message) goes through a queue and an eventfd that the
// Python side drains (completions.cpp): a transfer never waits for the interpreter.
#pragma once

#include <pybind11/pybind11.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include <ferry/ferry.hpp>

namespace ferry::python {

namespace py = pybind11;

/// The Python exception for `e`: an instance of ferry.Error's subclass for its code, made by
/// the factory ferry/__init__.py registers (set_error_factory).
py::object error_object(const Error& e);
/// Raises `e` as error_object() in Python (for a pybind11 exception translator).
void raise_error(const Error& e);

/// Seconds as Python gives them (None or a float) to milliseconds; None and 0 are 0, and a
/// negative or non-finite value is InvalidArgument naming `what`.
std::chrono::milliseconds to_ms(const py::object& seconds, const char* what);
/// The same to nanoseconds for a wait: None waits forever.
std::chrono::nanoseconds to_wait(const py::object& seconds);

/// Whether the GIL may be released here: not while the interpreter finalizes (a thread state
/// released then may never come back).
bool may_release_gil();

/// Runs `fn` without the GIL (it waits for ferry's loop, which never takes the GIL), or with it
/// while the interpreter finalizes (may_release_gil()).
template <class F>
void without_gil(F&& fn) {
  if (may_release_gil()) {
    py::gil_scoped_release unlocked;
    fn();
  } else {
    fn();
  }
}

/// A descriptor and what keeps its memory valid: the Python object it came from, the buffer
/// it exported (released when the descriptor goes), or a DLPack tensor it consumed.
class PyDescriptor {
 public:
  PyDescriptor(Descriptor d, py::object owner);
  ~PyDescriptor();
  PyDescriptor(const PyDescriptor&) = delete;
  PyDescriptor& operator=(const PyDescriptor&) = delete;

  const Descriptor& get() const noexcept { return d_; }
  const py::object& owner() const noexcept { return owner_; }

  /// From an object with the buffer protocol: writable where the object allows it,
  /// read-only otherwise (or when `read_only`).
  static std::unique_ptr<PyDescriptor> from_buffer(const py::object& obj, bool read_only);
  /// From a DLPack capsule (obj.__dlpack__()), which it consumes.
  static std::unique_ptr<PyDescriptor> from_dlpack(const py::object& owner,
                                                   const py::capsule& capsule, bool read_only);

 private:
  Descriptor d_;
  py::object owner_;
  std::unique_ptr<Py_buffer> view_;  // held while the descriptor lives
  void* dl_ = nullptr;               // a DLManagedTensor, deleted when the descriptor goes
};

/// The descriptors of a Python list of PyDescriptor.
std::vector<Descriptor> descriptors_of(const py::list& descriptors);

class Notifier;

/// The connector a ferry.Connector holds. Every call holds its own reference for its duration
/// (get()), so that close() on another thread cannot destroy the connector under a call that
/// released the GIL; the last reference destroys it (cancelling what is left, waiting for the
/// loop). close() also wakes the iterators waiting on what the connector made (subscriptions).
struct PyConnector {
  std::shared_ptr<Connector> c;
  std::vector<std::weak_ptr<Notifier>> wake_on_close;
  ~PyConnector() { close(); }
  std::shared_ptr<Connector> get() const;
  void close();
};

void bind_values(py::module_& m);       // errors, metadata, stats: values.cpp
void bind_descriptors(py::module_& m);  // buffers.cpp
void bind_completions(py::module_& m);  // completions.cpp
void bind_connector(py::module_& m);    // connector.cpp
void bind_messaging(py::module_& m);    // messaging.cpp

/// What the Python side drains from a Completions queue: an operation that ended (key, status,
/// error), a message or a reply (messaging).
class Completions;
/// Registers `op`'s end in `queue` under `key` (completions.cpp).
void watch(Completions& queue, Operation& op, std::uint64_t key);

}  // namespace ferry::python
