// Descriptors from what Python holds: the buffer protocol, DLPack capsules, and raw pointers
// (ferry/_descriptor.py picks one for each kind of object: torch tensors and
// __cuda_array_interface__ come here as pointers).
#include <cstring>

#include "binding.hpp"

namespace ferry::python {

namespace {

// DLPack's ABI (dlpack.h, version 0.x: the "dltensor" capsule every producer still offers).
struct DLDevice {
  std::int32_t device_type;
  std::int32_t device_id;
};
struct DLDataType {
  std::uint8_t code;
  std::uint8_t bits;
  std::uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  std::int32_t ndim;
  DLDataType dtype;
  std::int64_t* shape;
  std::int64_t* strides;
  std::uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};
constexpr std::int32_t kDLCPU = 1;
constexpr std::int32_t kDLCUDA = 2;
constexpr std::int32_t kDLCUDAHost = 3;
constexpr std::int32_t kDLCUDAManaged = 13;

std::string type_name(const py::handle& obj) {
  return py::str(py::type::handle_of(obj).attr("__name__")).cast<std::string>();
}

// Whether a DLPack tensor's elements lie without gaps, in row- or column-major order.
bool dl_compact(const DLTensor& t) {
  if (t.strides == nullptr) return true;
  auto compact = [&](bool row_major) {
    std::int64_t expected = 1;
    for (std::int32_t k = 0; k < t.ndim; ++k) {
      std::int32_t i = row_major ? t.ndim - 1 - k : k;
      if (t.shape[i] == 1) continue;
      if (t.strides[i] != expected) return false;
      expected *= t.shape[i];
    }
    return true;
  };
  return compact(true) || compact(false);
}

}  // namespace

PyDescriptor::PyDescriptor(Descriptor d, py::object owner)
    : d_(std::move(d)), owner_(std::move(owner)) {}

PyDescriptor::~PyDescriptor() {
  if (view_) PyBuffer_Release(view_.get());
  if (dl_ != nullptr) {
    auto* t = static_cast<DLManagedTensor*>(dl_);
    if (t->deleter != nullptr) t->deleter(t);
  }
}

std::unique_ptr<PyDescriptor> PyDescriptor::from_buffer(const py::object& obj, bool read_only) {
  if (!PyObject_CheckBuffer(obj.ptr())) {
    throw Error(ErrorCode::InvalidArgument,
                "a Descriptor needs memory: a buffer (bytes, bytearray, memoryview, numpy "
                "array), a torch.Tensor, an object with __cuda_array_interface__ or __dlpack__, "
                "or (ptr, size, device); got " +
                    type_name(obj));
  }
  auto view = std::make_unique<Py_buffer>();
  bool writable = false;
  if (!read_only &&
      PyObject_GetBuffer(obj.ptr(), view.get(), PyBUF_ANY_CONTIGUOUS | PyBUF_WRITABLE) == 0) {
    writable = true;
  } else {
    PyErr_Clear();
    if (PyObject_GetBuffer(obj.ptr(), view.get(), PyBUF_ANY_CONTIGUOUS) != 0) {
      PyErr_Clear();
      throw Error(ErrorCode::InvalidArgument,
                  "a Descriptor needs contiguous memory; this " + type_name(obj) +
                      " is not contiguous (make a contiguous copy first, e.g. "
                      "numpy.ascontiguousarray)");
    }
  }
  if (view->len == 0 || view->buf == nullptr) {
    PyBuffer_Release(view.get());
    throw Error(ErrorCode::InvalidArgument,
                "descriptor is empty (0 bytes): this " + type_name(obj) + " holds no memory");
  }
  Descriptor d = writable ? Descriptor(view->buf, static_cast<std::size_t>(view->len))
                          : Descriptor::read_only(view->buf, static_cast<std::size_t>(view->len));
  auto out = std::make_unique<PyDescriptor>(std::move(d), obj);
  out->view_ = std::move(view);
  return out;
}

std::unique_ptr<PyDescriptor> PyDescriptor::from_dlpack(const py::object& owner,
                                                        const py::capsule& capsule,
                                                        bool read_only) {
  if (std::strcmp(capsule.name(), "dltensor") != 0) {
    throw Error(ErrorCode::InvalidArgument,
                std::string("__dlpack__ gave a capsule named '") + capsule.name() +
                    "', not an unused 'dltensor' (was it consumed already?)");
  }
  auto* managed = capsule.get_pointer<DLManagedTensor>();
  const DLTensor& t = managed->dl_tensor;
  // Consumed from here on: the capsule no longer deletes the tensor, this descriptor does.
  if (PyCapsule_SetName(capsule.ptr(), "used_dltensor") != 0) throw py::error_already_set();
  struct Guard {
    DLManagedTensor* t;
    ~Guard() {
      if (t != nullptr && t->deleter != nullptr) t->deleter(t);
    }
  } guard{managed};

  Device device;
  switch (t.device.device_type) {
    case kDLCPU:
    case kDLCUDAHost:
      break;
    case kDLCUDA:
    case kDLCUDAManaged:
      device = Device::cuda(t.device.device_id);
      break;
    default:
      throw Error(ErrorCode::Unsupported, "a DLPack tensor on device type " +
                                              std::to_string(t.device.device_type) +
                                              ": ferry moves host and CUDA memory only");
  }
  if (!dl_compact(t)) {
    throw Error(ErrorCode::InvalidArgument, "a Descriptor needs contiguous memory; this " +
                                                type_name(owner) +
                                                " is not contiguous (DLPack strides leave gaps)");
  }
  std::uint64_t elements = 1;
  for (std::int32_t i = 0; i < t.ndim; ++i) {
    if (t.shape[i] < 0) throw Error(ErrorCode::InvalidArgument, "DLPack shape is negative");
    elements *= static_cast<std::uint64_t>(t.shape[i]);
  }
  std::uint64_t bytes = elements * ((t.dtype.bits * std::uint64_t{t.dtype.lanes} + 7) / 8);
  if (bytes == 0 || t.data == nullptr) {
    throw Error(ErrorCode::InvalidArgument,
                "descriptor is empty (0 bytes): this " + type_name(owner) + " holds no memory");
  }
  void* ptr = static_cast<std::byte*>(t.data) + t.byte_offset;
  Descriptor d =
      read_only ? Descriptor::read_only(ptr, bytes, device) : Descriptor(ptr, bytes, device);
  auto out = std::make_unique<PyDescriptor>(std::move(d), owner);
  out->dl_ = managed;
  guard.t = nullptr;
  return out;
}

std::vector<Descriptor> descriptors_of(const py::list& descriptors) {
  std::vector<Descriptor> out;
  out.reserve(descriptors.size());
  for (const py::handle& h : descriptors) out.push_back(h.cast<const PyDescriptor&>().get());
  return out;
}

void bind_descriptors(py::module_& m) {
  py::class_<PyDescriptor>(m, "Descriptor",
                           "A view of memory and what keeps it valid (ferry.Descriptor holds one).")
      .def_static("from_buffer", &PyDescriptor::from_buffer, py::arg("obj"),
                  py::arg("read_only") = false)
      .def_static("from_dlpack", &PyDescriptor::from_dlpack, py::arg("owner"), py::arg("capsule"),
                  py::arg("read_only") = false)
      .def_static(
          "from_pointer",
          [](std::uintptr_t ptr, std::size_t size, int cuda, bool read_only, py::object owner) {
            Device device = cuda < 0 ? Device::host() : Device::cuda(cuda);
            void* p = reinterpret_cast<void*>(ptr);
            Descriptor d =
                read_only ? Descriptor::read_only(p, size, device) : Descriptor(p, size, device);
            return std::make_unique<PyDescriptor>(std::move(d), std::move(owner));
          },
          py::arg("ptr"), py::arg("size"), py::arg("cuda"), py::arg("read_only"), py::arg("owner"))
      .def_property_readonly(
          "ptr",
          [](const PyDescriptor& d) { return reinterpret_cast<std::uintptr_t>(d.get().ptr()); })
      .def_property_readonly("size", [](const PyDescriptor& d) { return d.get().size(); })
      .def_property_readonly("device",
                             [](const PyDescriptor& d) { return d.get().device().to_string(); })
      .def_property_readonly("read_only",
                             [](const PyDescriptor& d) { return d.get().is_read_only(); })
      .def_property_readonly("owner", &PyDescriptor::owner);
}

}  // namespace ferry::python
