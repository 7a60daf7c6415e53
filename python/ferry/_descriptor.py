"""Device and Descriptor: where memory lives, and a view of it made from what Python holds."""

import enum

from . import _ferry
from ._errors import InvalidArgumentError


class DeviceKind(enum.IntEnum):
    """Host memory or a CUDA device's (nixl_connect's DeviceKind, same values)."""

    UNSPECIFIED = 0
    HOST = 1
    CUDA = 2


class Device:
    """Where memory lives: Device("cpu") / Device("host"), Device("cuda") (device 0) or
    Device("cuda:N"); also Device(DeviceKind.CUDA, N), nixl_connect's Device((kind, N)) and
    torch.device objects.

    Attributes: kind (DeviceKind), id (the CUDA ordinal; 0 for host memory).
    """

    __slots__ = ("kind", "id")

    def __init__(self, spec="cpu", id=None):  # noqa: A002 (nixl_connect's name)
        if isinstance(spec, Device):
            self.kind, self.id = spec.kind, spec.id
            return
        if isinstance(spec, tuple) and len(spec) == 2 and id is None:  # nixl_connect's (kind, id)
            spec, id = spec
        if isinstance(spec, DeviceKind) or (isinstance(spec, int) and not isinstance(spec, bool)):
            try:
                kind = DeviceKind(spec)
            except ValueError:
                raise InvalidArgumentError("%r is not a DeviceKind" % (spec,)) from None
            if kind == DeviceKind.UNSPECIFIED:
                raise InvalidArgumentError("a Device is HOST or CUDA, not UNSPECIFIED")
            self.kind = kind
            self.id = 0 if kind == DeviceKind.HOST else _ordinal(0 if id is None else id)
            return
        # torch.device and the like: .type ("cpu", "cuda") and .index (None or int).
        if not isinstance(spec, str) and hasattr(spec, "type") and hasattr(spec, "index"):
            spec = spec.type if spec.index is None else "%s:%d" % (spec.type, spec.index)
        if not isinstance(spec, str):
            raise InvalidArgumentError(
                "a Device is 'cpu', 'host', 'cuda' or 'cuda:N', not %r" % (spec,)
            )
        text = spec.strip().lower()
        if text in ("cpu", "host"):
            self.kind, self.id = DeviceKind.HOST, 0
        elif text == "cuda":
            self.kind, self.id = DeviceKind.CUDA, _ordinal(0 if id is None else id)
        elif text.startswith("cuda:") and text[5:].isdigit():
            self.kind, self.id = DeviceKind.CUDA, _ordinal(int(text[5:]))
        else:
            raise InvalidArgumentError(
                "a Device is 'cpu', 'host', 'cuda' or 'cuda:N', not %r" % (spec,)
            )

    @property
    def cuda_ordinal(self):
        """The ordinal for CUDA memory, -1 for host memory."""
        return self.id if self.kind == DeviceKind.CUDA else -1

    def __str__(self):
        return "host" if self.kind == DeviceKind.HOST else "cuda:%d" % self.id

    def __repr__(self):
        return "Device(%r)" % str(self)

    def __eq__(self, other):
        if not isinstance(other, Device):
            try:
                other = Device(other)
            except InvalidArgumentError:
                return NotImplemented
        return self.kind == other.kind and self.id == other.id

    def __hash__(self):
        return hash((int(self.kind), self.id))


def _device_like(value):
    if isinstance(value, (str, Device, DeviceKind)):
        return True
    return hasattr(value, "type") and hasattr(value, "index")  # torch.device


def _ordinal(n):
    if not isinstance(n, int) or n < 0:
        raise InvalidArgumentError("a CUDA ordinal is an int >= 0, not %r" % (n,))
    return n


def _typestr_size(typestr):
    digits = "".join(ch for ch in typestr[2:] if ch.isdigit())
    if not digits:
        raise InvalidArgumentError("__cuda_array_interface__ typestr %r has no size" % typestr)
    return int(digits)


class Descriptor:
    """A view of memory to move: what an operation reads from or writes into.

    Made from what Python workers hold:
      - torch.Tensor, on the CPU or a CUDA device (pointer, bytes and device from the tensor;
        it must be contiguous);
      - objects with the buffer protocol: bytes, bytearray, memoryview, numpy arrays, array
        (contiguous; a read-only buffer gives a read-only descriptor);
      - objects with __cuda_array_interface__ (CuPy, Numba) or __dlpack__;
      - (ptr, size, device): raw memory, which the caller keeps valid;
      - (tensor_or_array, device): nixl_connect's form; the device must match the object's.

    The descriptor keeps its object alive, and every operation keeps its descriptors alive
    until it has ended and no transport touches the memory. A read-only descriptor can be read
    by a peer or written to a peer, never made writable or read into (InvalidArgumentError at
    that call). read_only=True makes any descriptor read-only.

    Attributes: ptr (int), size (bytes), device (Device), read_only (bool), data (the object).
    """

    __slots__ = ("_d", "device")

    def __init__(self, data, device=None, *, read_only=False):
        if isinstance(data, Descriptor):
            if device is not None and Device(device) != data.device:
                raise InvalidArgumentError(
                    "the descriptor lives on %s, not on the device given (%s)"
                    % (data.device, Device(device)))
            self._d = data._d if not read_only or data.read_only else _ferry.Descriptor.from_pointer(
                data.ptr, data.size, data.device.cuda_ordinal, True, data
            )
            self.device = data.device
            return
        if isinstance(data, tuple):
            if len(data) == 3:
                ptr, size, dev = data
                if not isinstance(ptr, int) or not isinstance(size, int):
                    raise InvalidArgumentError(
                        "a (ptr, size, device) descriptor takes ints, not %r" % (data,)
                    )
                if not (0 <= ptr < 2**64 and 0 <= size < 2**64):
                    raise InvalidArgumentError(
                        "ptr and size are 64-bit numbers >= 0, not %r" % (data,))
                dev = Device(dev)
                self._d = _ferry.Descriptor.from_pointer(ptr, size, dev.cuda_ordinal, read_only, None)
                self.device = dev
                return
            if len(data) == 2:
                if not _device_like(data[1]):
                    raise InvalidArgumentError(
                        "a 2-tuple descriptor is (tensor_or_array, device); pass a list for "
                        "several descriptors, not %r" % (data,))
                self.__init__(data[0], data[1], read_only=read_only)
                return
            raise InvalidArgumentError(
                "a tuple descriptor is (ptr, size, device) or (tensor, device), not %d items"
                % len(data)
            )
        want = None if device is None else Device(device)
        d, dev = _convert(data, want, read_only)
        if want is not None and want != dev:
            raise InvalidArgumentError(
                "the %s lives on %s, not on the device given (%s)"
                % (type(data).__name__, dev, want)
            )
        self._d, self.device = d, dev

    @property
    def ptr(self):
        return self._d.ptr

    @property
    def size(self):
        return self._d.size

    @property
    def read_only(self):
        return self._d.read_only

    @property
    def data(self):
        return self._d.owner

    def __len__(self):
        return self._d.size

    def __repr__(self):
        return "Descriptor(ptr=0x%x, size=%d, device=%r%s)" % (
            self.ptr,
            self.size,
            str(self.device),
            ", read_only=True" if self.read_only else "",
        )


def _is_torch_tensor(obj):
    t = type(obj)
    return t.__module__.startswith("torch") and hasattr(obj, "data_ptr") and hasattr(obj, "is_contiguous")


def _convert(data, want, read_only):
    if _is_torch_tensor(data):
        if not data.is_contiguous():
            raise InvalidArgumentError(
                "a Descriptor needs contiguous memory; this tensor is not contiguous "
                "(use tensor.contiguous())"
            )
        dev = Device(data.device)
        size = data.numel() * data.element_size()
        if size == 0:
            raise InvalidArgumentError("descriptor is empty (0 bytes): this tensor holds no memory")
        return (
            _ferry.Descriptor.from_pointer(data.data_ptr(), size, dev.cuda_ordinal, read_only, data),
            dev,
        )
    cai = getattr(data, "__cuda_array_interface__", None)
    if cai is not None:
        ptr, ro = cai["data"]
        shape = tuple(cai["shape"])
        itemsize = _typestr_size(cai["typestr"])
        count = 1
        for n in shape:
            count *= n
        strides = cai.get("strides")
        if strides is not None:
            expected = itemsize
            for n, s in zip(reversed(shape), reversed(tuple(strides))):
                if n != 1 and s != expected:
                    raise InvalidArgumentError(
                        "a Descriptor needs contiguous memory; this %s is not contiguous"
                        % type(data).__name__
                    )
                expected *= n
        if want is None:
            # CuPy arrays say their device; otherwise the caller must (device=...), or cuda:0.
            dev_obj = getattr(data, "device", None)
            ordinal = getattr(dev_obj, "id", None)
            want = Device("cuda", ordinal if isinstance(ordinal, int) else 0)
        if want.kind != DeviceKind.CUDA:
            raise InvalidArgumentError("__cuda_array_interface__ memory lives on a CUDA device")
        if count * itemsize == 0 or not ptr:
            raise InvalidArgumentError(
                "descriptor is empty (0 bytes): this %s holds no memory" % type(data).__name__
            )
        d = _ferry.Descriptor.from_pointer(ptr, count * itemsize, want.id, read_only or bool(ro), data)
        return d, want
    if isinstance(data, (bytes, bytearray, memoryview)) or _has_buffer(data):
        return _ferry.Descriptor.from_buffer(data, read_only), Device("cpu")
    dlpack = getattr(data, "__dlpack__", None)
    if dlpack is not None:
        d = _ferry.Descriptor.from_dlpack(data, dlpack(), read_only)
        return d, Device(d.device)
    # Lets the C++ side say what a Descriptor accepts.
    return _ferry.Descriptor.from_buffer(data, read_only), Device("cpu")


def _has_buffer(obj):
    try:
        memoryview(obj).release()
        return True
    except TypeError:
        return False


def as_descriptors(local):
    """A list of Descriptor from one descriptor-like object or a list of them."""
    if isinstance(local, Descriptor):
        return [local]
    if isinstance(local, list):
        if not local:
            raise InvalidArgumentError("the descriptor list is empty")
        return [x if isinstance(x, Descriptor) else Descriptor(x) for x in local]
    return [Descriptor(local)]
