// Errors, metadata and the other value types, bound as they are in C++ (ferry/__init__.py adds
// nixl_connect's names and Python enums on top).
#include <pybind11/stl.h>

#include <cmath>
#include <limits>

#include "binding.hpp"

namespace ferry::python {

namespace {

// The factory ferry/__init__.py registers; never destroyed (it may outlive the interpreter's
// teardown of this module).
py::object* error_factory = nullptr;

std::string device_string(const Device& d) { return d.to_string(); }

}  // namespace

py::object error_object(const Error& e) {
  if (error_factory == nullptr) {
    return py::reinterpret_steal<py::object>(PyObject_CallFunction(
        PyExc_RuntimeError, "s", e.what()));  // before ferry/__init__.py ran: a plain error
  }
  return (*error_factory)(static_cast<int>(e.code()), e.message(), e.field(), e.retryable(),
                          std::string(e.what()));
}

void raise_error(const Error& e) {
  py::object inst = error_object(e);
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(inst.ptr())), inst.ptr());
}

std::chrono::milliseconds to_ms(const py::object& seconds, const char* what) {
  if (seconds.is_none()) return std::chrono::milliseconds{0};
  double s = seconds.cast<double>();
  if (!std::isfinite(s) || s < 0 || s > 1e9) {
    throw Error(ErrorCode::InvalidArgument, std::string(what) +
                                                " must be a number of seconds >= 0, not " +
                                                py::str(seconds).cast<std::string>());
  }
  auto ms = std::chrono::milliseconds(static_cast<std::int64_t>(std::ceil(s * 1000.0)));
  return ms;
}

std::chrono::nanoseconds to_wait(const py::object& seconds) {
  if (seconds.is_none()) return std::chrono::nanoseconds::max();
  double s = seconds.cast<double>();
  if (std::isnan(s) || s < 0) {
    throw Error(ErrorCode::InvalidArgument,
                "timeout must be a number of seconds >= 0 or None, not " +
                    py::str(seconds).cast<std::string>());
  }
  if (s > 1e9) return std::chrono::nanoseconds::max();
  return std::chrono::nanoseconds(static_cast<std::int64_t>(s * 1e9));
}

bool may_release_gil() {
#if PY_VERSION_HEX >= 0x030D0000
  return !Py_IsFinalizing();
#else
  return !_Py_IsFinalizing();
#endif
}

void bind_values(py::module_& m) {
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      raise_error(e);
    }
  });
  m.def(
      "set_error_factory",
      [](py::object factory) {
        if (error_factory == nullptr) error_factory = new py::object();
        *error_factory = std::move(factory);
      },
      "Registers the callable that makes ferry.Error instances (code, message, field, "
      "retryable, what).");
  m.def(
      "error_code_name",
      [](int code) { return std::string(to_string(static_cast<ErrorCode>(code))); },
      "The C++ name of an ErrorCode value.");
  m.def(
      "is_retryable", [](int code) { return is_retryable(static_cast<ErrorCode>(code)); },
      "Whether retrying a request that failed with this code may succeed.");
  m.def(
      "raise_test_error",
      [](int code, const std::string& message, const std::string& field, py::object retryable) {
        Error e(static_cast<ErrorCode>(code), message, field);
        if (!retryable.is_none()) e.set_retryable(retryable.cast<bool>());
        throw e;
      },
      py::arg("code"), py::arg("message"), py::arg("field") = "", py::arg("retryable") = py::none(),
      "Throws a ferry::Error from C++ (for the binding's own tests).");

  py::class_<PeerIdentity>(m, "PeerIdentity", "Who owns (or claimed) an operation.")
      .def_readonly("name", &PeerIdentity::name)
      .def_readonly("id", &PeerIdentity::id)
      .def_readonly("host", &PeerIdentity::host)
      .def_readonly("pid", &PeerIdentity::pid)
      .def(
          "__eq__", [](const PeerIdentity& a, const PeerIdentity& b) { return a == b; },
          py::is_operator())
      .def("__repr__", [](const PeerIdentity& p) {
        return "PeerIdentity(name='" + p.name + "', id='" + p.id + "', host='" + p.host +
               "', pid=" + std::to_string(p.pid) + ")";
      });
  py::class_<Endpoint>(m, "Endpoint", "One way to reach an owner: method, address, info.")
      .def_readonly("method", &Endpoint::method)
      .def_readonly("address", &Endpoint::address)
      .def_readonly("info", &Endpoint::info)
      .def("__repr__", [](const Endpoint& e) {
        return "Endpoint(method='" + e.method + "', address='" + e.address + "')";
      });
  py::class_<RemoteDescriptor>(m, "RemoteDescriptor", "A range in the owner's address space.")
      .def_readonly("ptr", &RemoteDescriptor::ptr)
      .def_readonly("size", &RemoteDescriptor::size)
      .def_property_readonly("device",
                             [](const RemoteDescriptor& d) { return device_string(d.device); })
      .def("__repr__", [](const RemoteDescriptor& d) {
        return "RemoteDescriptor(ptr=" + std::to_string(d.ptr) +
               ", size=" + std::to_string(d.size) + ", device='" + d.device.to_string() + "')";
      });

  py::class_<RdmaMetadata>(m, "RdmaMetadata", R"(What a peer needs to act on a passive operation.

It is a credential: whoever holds it may touch the described memory until the operation
ends. Pass it to the peer by any channel as JSON (to_json / from_json); from_json checks it
strictly and raises ferry.InvalidMetadataError whose `field` names the first offending field.)")
      .def_static(
          "from_json", [](std::string_view json) { return RdmaMetadata::from_json(json); },
          py::arg("json"), "Parses and checks metadata JSON (str or bytes).")
      .def("to_json", &RdmaMetadata::to_json, "The versioned JSON form.")
      .def_readonly("version", &RdmaMetadata::version)
      .def_property_readonly(
          "operation_kind",
          [](const RdmaMetadata& md) { return static_cast<int>(md.operation_kind); })
      .def_readonly("notification_key", &RdmaMetadata::notification_key)
      .def_readonly("owner", &RdmaMetadata::owner)
      .def_readonly("endpoints", &RdmaMetadata::endpoints)
      .def_readonly("descriptors", &RdmaMetadata::descriptors)
      .def_readonly("token", &RdmaMetadata::token)
      .def_property_readonly("total_size", &RdmaMetadata::total_size)
      .def(
          "__eq__", [](const RdmaMetadata& a, const RdmaMetadata& b) { return a == b; },
          py::is_operator());

  py::class_<RegionMetadata>(m, "RegionMetadata", R"(What a peer needs to attach to a region.

A credential, as RdmaMetadata is; JSON in and out the same way ("kind": "ferry.region").)")
      .def_static(
          "from_json", [](std::string_view json) { return RegionMetadata::from_json(json); },
          py::arg("json"), "Parses and checks region metadata JSON (str or bytes).")
      .def("to_json", &RegionMetadata::to_json, "The versioned JSON form.")
      .def_readonly("version", &RegionMetadata::version)
      .def_readonly("region_id", &RegionMetadata::region_id)
      .def_readonly("owner", &RegionMetadata::owner)
      .def_readonly("endpoints", &RegionMetadata::endpoints)
      .def_readonly("descriptors", &RegionMetadata::descriptors)
      .def_readonly("token", &RegionMetadata::token)
      .def_property_readonly(
          "access", [](const RegionMetadata& md) { return std::string(to_string(md.access)); })
      .def_readonly("block_size", &RegionMetadata::block_size)
      .def_property_readonly("total_size", &RegionMetadata::total_size)
      .def_property_readonly("block_count", &RegionMetadata::block_count)
      .def(
          "__eq__", [](const RegionMetadata& a, const RegionMetadata& b) { return a == b; },
          py::is_operator());

  py::class_<MethodInfo>(m, "MethodInfo",
                         "A transfer method of this build, and whether it is offered.")
      .def_readonly("method", &MethodInfo::method)
      .def_readonly("rank", &MethodInfo::rank)
      .def_readonly("available", &MethodInfo::available)
      .def_readonly("detail", &MethodInfo::detail)
      .def_readonly("moves_cuda", &MethodInfo::moves_cuda)
      .def_readonly("moves_host", &MethodInfo::moves_host)
      .def("__repr__", [](const MethodInfo& i) {
        return "MethodInfo(method='" + i.method +
               "', available=" + (i.available ? "True" : "False") + ", detail='" + i.detail + "')";
      });
  m.def(
      "probe_methods",
      [](std::vector<std::string> transports) {
        ConnectorOptions o;
        o.transports = std::move(transports);
        py::gil_scoped_release unlocked;
        return probe_methods(o);
      },
      py::arg("transports") = std::vector<std::string>{},
      "The methods this build knows, best first, and whether a connector would offer each here.");
}

}  // namespace ferry::python
