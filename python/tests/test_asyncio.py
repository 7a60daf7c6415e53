"""asyncio: awaits resolved from ferry's loop thread without polling, many at once; cancelling a
task, an operation, deadlines; handles collected mid-transfer; errors carrying code and
message."""

import asyncio
import gc
import threading
import time

import numpy as np
import pytest

import ferry
from conftest import pattern


def test_the_issue_example_shape(pair):
    a, b = pair
    local = np.zeros(1 << 16, dtype=np.uint8)
    sent = pattern(1 << 16, 11)

    async def main():
        to_peer = asyncio.Queue()

        async def peer():
            md = await to_peer.get()
            op = await b.begin_write(sent, md)  # nixl_connect awaits begin_write
            await op.wait_for_completion()

        task = asyncio.create_task(peer())
        descriptor = ferry.Descriptor(local)
        with a.create_writable(descriptor) as write_op:
            op_metadata = write_op.metadata()
            await to_peer.put(op_metadata)
            assert await write_op.wait_for_completion() is True
        await task

    asyncio.run(main())
    assert np.array_equal(local, sent)


def test_ten_thousand_concurrent_awaits_complete(pair):
    a, b = pair
    n = 10000
    src = [pattern(64, i % 251) for i in range(n)]
    dst = [np.zeros(64, dtype=np.uint8) for _ in range(n)]

    async def main():
        readables = [a.create_readable(s) for s in src]
        ops = [b.begin_read(r.metadata(), d) for r, d in zip(readables, dst)]
        waits = [op.wait_for_completion() for op in ops] + [r.wait_for_completion() for r in readables]
        results = await asyncio.wait_for(asyncio.gather(*waits), 120)
        assert all(x is True for x in results)

    asyncio.run(main())
    assert all(np.array_equal(s, d) for s, d in zip(src, dst))


def test_no_polling_an_idle_await_costs_no_cpu(pair):
    a, _ = pair

    async def main():
        r = a.create_readable(bytearray(64))
        waiter = asyncio.ensure_future(r.wait_for_completion())
        cpu = time.process_time()
        await asyncio.sleep(0.5)
        used = time.process_time() - cpu
        r.cancel()
        with pytest.raises(ferry.CancelledError):
            await waiter
        return used

    used = asyncio.run(main())
    # Half a second of waiting: a poll loop would burn most of it; waking on the fd costs ~0.
    assert used < 0.1, "the idle await used %.3f s of CPU" % used


def test_cancelling_the_task_leaves_the_operation_which_completes_later(pair):
    a, b = pair
    src = pattern(4096, 7)

    async def main():
        r = a.create_readable(src)
        task = asyncio.create_task(r.wait_for_completion())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert r.status == ferry.OperationStatus.INITIALIZED  # still waiting for its peer
        dst = bytearray(4096)
        await b.begin_read(r.metadata(), dst).wait_for_completion()
        assert await r.wait_for_completion() is True
        assert bytes(dst) == src.tobytes()
        # The cancelled waiter's entry is gone from the hub: nothing is kept for it.
        assert not ferry._hub(asyncio.get_running_loop())._waiting

    asyncio.run(main())


def test_cancelling_the_operation_raises_in_its_awaiters(pair):
    a, _ = pair

    async def main():
        r = a.create_readable(bytearray(64))
        waiters = [asyncio.ensure_future(r.wait_for_completion()) for _ in range(3)]
        await asyncio.sleep(0.01)
        r.cancel()
        for w in waiters:
            with pytest.raises(ferry.CancelledError) as info:
                await w
            assert info.value.code == ferry.ErrorCode.CANCELLED and "cancel" in str(info.value)

    asyncio.run(main())


def test_deadlines_and_bounded_awaits(pair):
    a, _ = pair

    async def main():
        r = a.create_readable(bytearray(64), timeout=0.3)
        assert await r.wait_for_completion(timeout=0.05) is False  # gave up; goes on
        t0 = time.monotonic()
        with pytest.raises(ferry.TimeoutError) as info:
            await r.wait_for_completion(timeout=5)  # the operation's deadline comes first
        assert time.monotonic() - t0 < 2
        assert info.value.retryable and info.value.code == ferry.ErrorCode.TIMEOUT
        # asyncio's own deadline: the awaiting task is cancelled, the operation goes on.
        r2 = a.create_readable(bytearray(8))
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(r2.wait_for_completion(), 0.05)
        assert r2.status == ferry.OperationStatus.INITIALIZED
        assert not ferry._hub(asyncio.get_running_loop())._waiting

    asyncio.run(main())


def test_async_with_cancels_unless_complete(pair):
    a, b = pair

    async def main():
        async with a.create_writable(bytearray(64)) as w:
            md = w.metadata()
        assert w.status == ferry.OperationStatus.CANCELLED
        op = b.begin_write(bytes(64), md)
        with pytest.raises(ferry.AccessDeniedError):
            await op.wait_for_completion()

    asyncio.run(main())


def test_collecting_handles_mid_transfer_cancels_cleanly(pair):
    """Both handles of a transfer in flight dropped: each cancels and waits until no transport
    touches its memory before its buffers go. The other side ends, and nothing crashes (this
    test runs under ASan-free CPython; the C++ side of this guarantee has its own tests)."""
    a, b = pair
    size = 64 << 20
    for round_ in range(3):
        src = np.full(size, round_, dtype=np.uint8)
        dst = np.zeros(size, dtype=np.uint8)
        r = a.create_readable(src)
        op = b.begin_read(r.metadata(), dst)
        keep = op if round_ == 0 else r  # drop one side, keep the other to see how it ends
        if round_ == 0:
            del r
        elif round_ == 1:
            del op
        else:
            del r, op
            keep = None
        del src, dst
        gc.collect()
        if keep is not None:
            status = keep.wait(10)
            assert status in (ferry.OperationStatus.COMPLETE, ferry.OperationStatus.CANCELLED,
                              ferry.OperationStatus.ERRORED)
    # The connectors still work.
    src = pattern(4096, 1)
    dst = bytearray(4096)
    with a.create_readable(src) as r:
        b.begin_read(r.metadata(), dst).wait_for_completion()
    assert bytes(dst) == src.tobytes()


def test_a_blocking_wait_in_a_thread_beside_asyncio(pair):
    a, b = pair
    src = pattern(1 << 20, 2)
    dst = bytearray(1 << 20)
    r = a.create_readable(src)
    done = []
    t = threading.Thread(target=lambda: done.append(r.wait_for_completion()))
    t.start()

    async def main():
        await asyncio.to_thread(lambda: None)
        await b.begin_read(r.metadata(), dst).wait_for_completion()

    asyncio.run(main())
    t.join(10)
    assert done == [True] and bytes(dst) == src.tobytes()


def test_one_connector_serves_two_event_loops(pair):
    a, b = pair
    results = []

    def run_loop(seed):
        async def main():
            src = pattern(4096, seed)
            dst = bytearray(4096)
            r = a.create_readable(src)
            await b.begin_read(r.metadata(), dst).wait_for_completion()
            await r.wait_for_completion()
            results.append(bytes(dst) == src.tobytes())

        asyncio.run(main())

    threads = [threading.Thread(target=run_loop, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == [True, True]


def test_waits_that_time_out_register_once(pair):
    a, _ = pair

    async def main():
        r = a.create_readable(bytearray(64))
        for _ in range(1000):
            assert await r.wait_for_completion(timeout=0) is False
        waiting = ferry._hub(asyncio.get_running_loop())._waiting
        assert len(waiting) == 1  # one registration for the operation, not one per wait
        r.cancel()
        with pytest.raises(ferry.CancelledError):
            await r.wait_for_completion()
        await asyncio.sleep(0.05)
        assert not waiting

    asyncio.run(main())
