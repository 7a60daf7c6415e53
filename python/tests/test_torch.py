"""torch tensors as descriptors (Debian's python3-torch, CPU): pointer, bytes and device taken
from the tensor, contiguity checked, tensors kept alive by their operations. Every test here
skips, saying why, where torch cannot be imported; ctest then reports this file as skipped."""

import asyncio
import gc

import pytest

import ferry

torch = pytest.importorskip("torch", reason="torch is not installed (Debian: python3-torch)")


def test_tensor_descriptor_takes_pointer_bytes_and_device():
    t = torch.arange(1000, dtype=torch.float32)
    d = ferry.Descriptor(t)
    assert d.ptr == t.data_ptr() and d.size == 4000 and d.device == ferry.Device("cpu")
    assert d.data is t
    assert ferry.Descriptor((t, "cpu")).size == 4000
    with pytest.raises(ferry.InvalidArgumentError, match="lives on host"):
        ferry.Descriptor(t, "cuda:0")


def test_non_contiguous_and_empty_tensors_are_refused():
    with pytest.raises(ferry.InvalidArgumentError, match="tensor is not contiguous"):
        ferry.Descriptor(torch.zeros(8, 8).t())
    with pytest.raises(ferry.InvalidArgumentError, match="empty"):
        ferry.Descriptor(torch.zeros(0))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int64])
def test_read_and_write_tensors(pair, dtype):
    a, b = pair
    src = (torch.arange(4096) % 100).to(dtype).reshape(64, 64)
    dst = torch.zeros_like(src)

    async def main():
        with a.create_readable(src) as r:
            await b.begin_read(r.metadata(), dst).wait_for_completion()
        out = torch.zeros_like(src)
        with a.create_writable(out) as w:
            await b.begin_write(src, w.metadata()).wait_for_completion()
            await w.wait_for_completion()
        return out

    out = asyncio.run(main())
    assert torch.equal(dst, src) and torch.equal(out, src)


def test_an_operation_keeps_its_tensor_alive(pair):
    a, b = pair
    src = torch.full((1 << 20,), 7, dtype=torch.uint8)
    r = a.create_readable(src)
    md = r.metadata()
    del src
    gc.collect()
    dst = torch.zeros(1 << 20, dtype=torch.uint8)
    b.begin_read(md, dst).wait_for_completion()
    assert bool((dst == 7).all())
    r.wait_for_completion(5)


def test_dlpack_from_a_tensor(pair):
    t = torch.arange(16, dtype=torch.int32)

    class Producer:
        def __dlpack__(self, stream=None):
            return t.__dlpack__()

    d = ferry.Descriptor(Producer())
    assert d.ptr == t.data_ptr() and d.size == 64
