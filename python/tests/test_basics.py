"""Descriptors, devices, errors, metadata and every operation kind between two connectors of one
process, blocking (no asyncio): the binding's shapes and its refusals of bad input."""

import array
import gc
import pickle

import numpy as np
import pytest

import ferry
from conftest import pattern


# -- descriptors --------------------------------------------------------------------------------


def test_descriptor_from_buffers_has_their_address_and_size():
    buf = bytearray(b"hello")
    d = ferry.Descriptor(buf)
    assert d.size == 5 and not d.read_only and d.device == ferry.Device("cpu")
    arr = np.zeros(100, dtype=np.float32)
    d = ferry.Descriptor(arr)
    assert d.ptr == arr.ctypes.data and d.size == 400
    assert ferry.Descriptor(memoryview(buf)).ptr == ferry.Descriptor(buf).ptr
    assert ferry.Descriptor(array.array("i", [1, 2, 3])).size == 12
    assert d.data is arr


def test_read_only_buffers_give_read_only_descriptors():
    assert ferry.Descriptor(b"abc").read_only
    frozen = np.arange(10, dtype=np.uint8)
    frozen.flags.writeable = False
    assert ferry.Descriptor(frozen).read_only
    assert ferry.Descriptor(bytearray(3), read_only=True).read_only


def test_non_contiguous_and_empty_buffers_are_refused():
    with pytest.raises(ferry.InvalidArgumentError, match="not contiguous"):
        ferry.Descriptor(np.zeros((4, 4))[:, 1])
    with pytest.raises(ferry.InvalidArgumentError, match="empty"):
        ferry.Descriptor(bytearray())
    with pytest.raises(ferry.InvalidArgumentError, match="empty"):
        ferry.Descriptor(np.zeros(0))


def test_wrong_types_are_refused_with_what_is_accepted():
    for bad in (3.5, object(), "text", None, {"a": 1}):
        with pytest.raises(ferry.InvalidArgumentError, match="Descriptor needs memory"):
            ferry.Descriptor(bad)
    with pytest.raises(ferry.InvalidArgumentError):
        ferry.Descriptor((1, 2, 3, 4))
    with pytest.raises(ferry.InvalidArgumentError):
        ferry.Descriptor(("x", 4, "cpu"))
    with pytest.raises(ferry.InvalidArgumentError, match="null"):
        ferry.Descriptor((0, 16, "cpu"))


def test_pointer_descriptors_and_nixl_tuple_form():
    arr = np.zeros(64, dtype=np.uint8)
    d = ferry.Descriptor((arr.ctypes.data, 64, "cpu"))
    assert d.ptr == arr.ctypes.data and d.size == 64
    d = ferry.Descriptor((arr, "cpu"))
    assert d.size == 64
    d = ferry.Descriptor((arr.ctypes.data, 64, ferry.Device("cuda:1")))
    assert d.device == ferry.Device("cuda", 1) and str(d.device) == "cuda:1"
    with pytest.raises(ferry.InvalidArgumentError, match="lives on host"):
        ferry.Descriptor(arr, "cuda:0")


def test_dlpack_producers_are_accepted_and_kept_alive():
    arr = np.arange(256, dtype=np.uint8)

    class Producer:  # only DLPack, no buffer protocol
        def __dlpack__(self, stream=None):
            return arr.__dlpack__()

        def __dlpack_device__(self):
            return arr.__dlpack_device__()

    d = ferry.Descriptor(Producer())
    assert d.ptr == arr.ctypes.data and d.size == 256 and d.device == ferry.Device("cpu")

    class Strided:
        def __dlpack__(self, stream=None):
            return np.zeros((8, 8), dtype=np.uint8)[:, ::2].__dlpack__()

    with pytest.raises(ferry.InvalidArgumentError, match="not contiguous"):
        ferry.Descriptor(Strided())


def test_cuda_array_interface_objects_are_cuda_descriptors():
    class FakeCuda:
        __cuda_array_interface__ = {
            "data": (0x7F0000001000, False), "shape": (16, 4), "typestr": "<f4",
            "strides": None, "version": 3,
        }

    d = ferry.Descriptor(FakeCuda())
    assert d.device == ferry.Device("cuda:0") and d.size == 256 and d.ptr == 0x7F0000001000
    assert ferry.Descriptor(FakeCuda(), "cuda:2").device.id == 2

    class Gaps:
        __cuda_array_interface__ = {
            "data": (0x7F0000001000, False), "shape": (16, 4), "typestr": "<f4",
            "strides": (32, 4), "version": 3,
        }

    with pytest.raises(ferry.InvalidArgumentError, match="not contiguous"):
        ferry.Descriptor(Gaps())


def test_descriptor_keeps_its_object_and_buffer_alive():
    buf = bytearray(1024)
    d = ferry.Descriptor(buf)
    with pytest.raises(BufferError):  # exported: cannot be resized under ferry
        buf.extend(b"x")
    del d
    gc.collect()
    buf.extend(b"x")  # released with the descriptor


def test_devices():
    assert ferry.Device("cpu") == ferry.Device("host") == ferry.Device(ferry.DeviceKind.HOST)
    assert ferry.Device("cuda").id == 0 and ferry.Device("cuda:3").kind == ferry.DeviceKind.CUDA
    assert ferry.Device((ferry.DeviceKind.CUDA, 2)) == ferry.Device("cuda:2")
    for bad in ("gpu", "cuda:-1", "cuda:x", 3.0):
        with pytest.raises(ferry.InvalidArgumentError):
            ferry.Device(bad)


# -- errors -------------------------------------------------------------------------------------


def test_every_code_has_its_exception_class_with_code_message_and_retryable():
    for code in ferry.ErrorCode:
        with pytest.raises(ferry.Error) as info:
            ferry._ferry.raise_test_error(int(code), "the message", "")
        e = info.value
        assert type(e) is ferry.error_class(code) and e.code == code
        assert e.message == "the message"
        assert str(e) == "%s: the message" % ferry._ferry.error_code_name(int(code))
        assert e.retryable == ferry._ferry.is_retryable(int(code))
    assert issubclass(ferry.TimeoutError, TimeoutError)
    assert issubclass(ferry.PeerLostError, ConnectionError)
    assert issubclass(ferry.InvalidArgumentError, ValueError)


def test_errors_keep_field_and_an_overridden_retryable_and_pickle():
    with pytest.raises(ferry.PeerLostError) as info:
        ferry._ferry.raise_test_error(int(ferry.ErrorCode.PEER_LOST), "gone", "", False)
    assert info.value.retryable is False
    with pytest.raises(ferry.InvalidMetadataError) as info:
        ferry.RdmaMetadata.from_json('{"version": 1}')
    assert info.value.field
    assert str(ferry.InvalidMetadataError("bad", field="descriptors[0].size")) == (
        "InvalidMetadata: descriptors[0].size: bad")  # as C++'s what()
    again = pickle.loads(pickle.dumps(info.value))
    assert type(again) is ferry.InvalidMetadataError and str(again) == str(info.value)
    assert again.field == info.value.field


# -- metadata -----------------------------------------------------------------------------------


def test_metadata_json_in_and_out(pair):
    a, _ = pair
    src = bytearray(pattern(4096, 1).tobytes())
    with a.create_readable(src) as r:
        md = r.metadata()
        assert md.operation_kind == ferry.OperationKind.READ and md.total_size == 4096
        assert ferry.RdmaMetadata.from_json(md.to_json()) == md
        assert ferry.RdmaMetadata.model_validate_json(md.model_dump_json().encode()) == md
        assert md.owner.name == "owner" and md.descriptors[0].size == 4096


def test_nixl_connect_metadata_is_named_and_plain_strings_are_not_subjects(pair):
    _, b = pair
    with pytest.raises(ferry.InvalidMetadataError, match="nixl_connect"):
        b.begin_read('{"nixl_metadata": "00ab", "notification_key": "k", "operation_kind": 1}',
                     bytearray(4))
    with pytest.raises(ferry.InvalidArgumentError, match="Subject"):
        b.begin_read("kv.17", bytearray(4))


# -- operations ---------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 4096, 3 << 20])
def test_read_a_readable(pair, size):
    a, b = pair
    src = pattern(size, 3)
    dst = np.zeros(size, dtype=np.uint8)
    with a.create_readable(src) as readable:
        op = b.begin_read(readable.metadata(), dst)
        assert op.wait_for_completion() is True
        assert readable.wait_for_completion(10) is True
    assert np.array_equal(src, dst)
    assert op.status == ferry.OperationStatus.COMPLETE
    assert op.peer.name == "owner" and op.method in ("cma", "tcp")
    assert readable.peer.name == "peer"


@pytest.mark.parametrize("size", [1, 65536, 3 << 20])
def test_write_a_writable(pair, size):
    a, b = pair
    dst = bytearray(size)
    src = pattern(size, 5)
    with a.create_writable(dst) as writable:
        op = b.begin_write(src.tobytes(), writable.metadata())  # bytes: read-only is fine to send
        op.wait_for_completion()
        writable.wait_for_completion(10)
    assert bytes(dst) == src.tobytes()


def test_either_argument_order_and_json_metadata(pair):
    a, b = pair
    src = pattern(1000, 9)
    for order in range(4):
        dst = bytearray(1000)
        with a.create_readable(src) as r:
            md = r.metadata() if order < 2 else r.metadata().to_json()
            op = b.begin_read(md, dst) if order % 2 == 0 else b.begin_read(dst, md)
            op.wait_for_completion()
        assert bytes(dst) == src.tobytes()


def test_scatter_gather_lists(pair):
    a, b = pair
    parts = [pattern(100, 1), pattern(300, 2), pattern(24, 3)]
    whole = bytearray(424)
    with a.create_readable([ferry.Descriptor(p) for p in parts]) as r:
        b.begin_read(r.metadata(), whole).wait_for_completion()
    assert bytes(whole) == b"".join(p.tobytes() for p in parts)


def test_kind_and_size_mismatches_and_read_only_targets(pair):
    a, b = pair
    with a.create_readable(bytearray(64)) as r:
        with pytest.raises(ferry.KindMismatchError):
            b.begin_write(bytes(64), r.metadata())
        with pytest.raises(ferry.SizeMismatchError):
            b.begin_read(r.metadata(), bytearray(65))
        with pytest.raises(ferry.InvalidArgumentError, match="read-only"):
            b.begin_read(r.metadata(), bytes(64))
    with pytest.raises(ferry.InvalidArgumentError, match="read-only"):
        a.create_writable(b"immutable")
    with pytest.raises(ferry.InvalidArgumentError, match="empty"):
        a.create_readable([])


def test_leaving_the_block_cancels_and_a_late_peer_is_refused(pair):
    a, b = pair
    with a.create_readable(bytearray(64)) as r:
        md = r.metadata()
    assert r.status == ferry.OperationStatus.CANCELLED
    assert isinstance(r.error, ferry.CancelledError)
    op = b.begin_read(md, bytearray(64))
    with pytest.raises(ferry.AccessDeniedError) as info:
        op.wait_for_completion()
    assert info.value.code == ferry.ErrorCode.ACCESS_DENIED and info.value.message
    assert op.wait() == ferry.OperationStatus.ERRORED  # wait() returns, never raises


def test_deadline_and_a_bounded_wait(pair):
    a, _ = pair
    r = a.create_readable(bytearray(64), timeout=0.2)
    assert r.wait_for_completion(0.01) is False  # the wait gave up; the operation goes on
    with pytest.raises(ferry.TimeoutError):
        r.wait_for_completion()
    assert r.error.retryable


def test_handles_are_made_by_the_connector_only():
    with pytest.raises(TypeError):
        ferry.ReadOperation()
    with pytest.raises(TypeError):
        ferry.Region()


def test_closed_connector_refuses_and_ends_its_operations():
    c = ferry.Connector(nats=False)
    r = c.create_readable(bytearray(64))
    c.close()
    assert r.status == ferry.OperationStatus.CANCELLED
    with pytest.raises(ferry.InvalidStateError, match="closed"):
        c.create_readable(bytearray(64))
    c.close()  # idempotent
    assert c.closed and "closed" in repr(c)


def test_bad_options_are_refused():
    with pytest.raises(ferry.InvalidArgumentError):
        ferry.Connector(nats=False, default_timeout=-1)
    with pytest.raises(ferry.InvalidArgumentError):
        ferry.Connector(nats=False, transports=["carrier-pigeon"])
    with pytest.raises(ferry.InvalidArgumentError):
        ferry.Connector(nats=False, default_timeout="soon")


def test_subjects_need_a_side_channel(pair):
    a, b = pair
    with pytest.raises(ferry.InvalidStateError):
        a.create_readable(bytearray(4), subject="kv.1")
    with pytest.raises(ferry.InvalidStateError):
        b.begin_read(ferry.Subject("kv.1"), bytearray(4))


def test_stats_and_methods(pair):
    a, _ = pair
    assert a.side_channel_state[0] == "none" and not a.has_side_channel
    stats = a.stats()
    assert "methods" in stats and stats["passive"] >= 1
    assert any(m.method == "tcp" and m.available for m in a.methods())
    assert "tcp" in [m.method for m in ferry.probe_methods()]


# -- the type stubs -----------------------------------------------------------------------------


def test_the_stubs_name_every_public_name_and_method():
    import ast
    import os

    stub = ast.parse(open(os.path.join(os.path.dirname(ferry.__file__), "__init__.pyi")).read())
    declared = {}
    for node in stub.body:
        if isinstance(node, ast.ClassDef):
            declared[node.name] = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))} | {
                n.target.id for n in node.body if isinstance(n, ast.AnnAssign)}
        elif isinstance(node, ast.FunctionDef):
            declared[node.name] = set()
    missing = [name for name in ferry.__all__ if name not in declared]
    assert not missing, "not in __init__.pyi: %s" % missing
    for cls in (ferry.Connector, ferry.Operation, ferry.ReadableOperation, ferry.Region,
                ferry.Attachment, ferry.Descriptor, ferry.Device, ferry.Message,
                ferry.Subscription):
        public = {n for n in vars(cls) if not n.startswith("_")}
        assert public <= declared[cls.__name__], "%s: not in __init__.pyi: %s" % (
            cls.__name__, sorted(public - declared[cls.__name__]))


# -- found by review ----------------------------------------------------------------------------


def test_close_racing_calls_on_other_threads_ends_them_all():
    import threading

    for _ in range(5):
        c = ferry.Connector(nats=False)
        ended = []

        def worker():
            try:
                while True:
                    c.create_readable(bytearray(64)).release()
            except ferry.InvalidStateError:
                ended.append(True)

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(3)]
        for t in threads:
            t.start()
        import time

        time.sleep(0.02)
        c.close()
        for t in threads:
            t.join(10)
        assert len(ended) == 3, "a call racing close() did not end"


def test_release_lets_go_of_the_buffers_and_keeps_id_and_kind(pair):
    a, _ = pair
    buf = bytearray(64)
    r = a.create_readable(buf)
    op_id = r.id
    r.release()
    buf.extend(b"x")  # no longer exported
    assert r.status == ferry.OperationStatus.UNINITIALIZED
    assert r.wait(0) == ferry.OperationStatus.UNINITIALIZED  # wait() never raises
    assert r.id == op_id and r.kind == ferry.OperationKind.READ and op_id in repr(r)
    r.release()  # idempotent


def test_descriptor_forms_that_are_mistakes_are_refused():
    d1, d2 = ferry.Descriptor(bytearray(16)), ferry.Descriptor(bytearray(32))
    with pytest.raises(ferry.InvalidArgumentError, match="pass a list"):
        ferry.Descriptor((d1, d2))
    with pytest.raises(ferry.InvalidArgumentError, match="lives on host"):
        ferry.Descriptor(d1, "cuda:0")
    with pytest.raises(ferry.InvalidArgumentError):
        ferry.Descriptor((d1.ptr, 16))
    with pytest.raises(ferry.InvalidArgumentError):
        ferry.Descriptor((2**64, 16, "cpu"))
    with pytest.raises(ferry.InvalidArgumentError):
        ferry.Device(7)


def test_metadata_compares_with_anything(pair):
    a, _ = pair
    with a.create_readable(bytearray(8)) as r:
        md = r.metadata()
        assert md != None and md != "x" and md in [None, md]  # noqa: E711
