"""Regions from Python in one process: attach by metadata and by subject, block and range
transfers, the owner's events as an async iterator, revoke and close, bad ranges."""

import asyncio

import numpy as np
import pytest

import ferry
from conftest import pattern

BLOCK = 4096
BLOCKS = 32


def test_blocks_both_ways_and_the_events_in_order(nats_pair):
    a, b = nats_pair
    pool = np.zeros(BLOCK * BLOCKS, dtype=np.uint8)

    async def main():
        with a.create_region(pool, access="read_write", block_size=BLOCK) as region:
            md = ferry.RegionMetadata.from_json(region.metadata().to_json())
            assert md.block_count == BLOCKS and md.access == "read_write"
            with b.attach(md) as att:
                src = pattern(2 * BLOCK, 4)
                await att.write_blocks(src, [3, 17], tag="request-17").wait_for_completion()
                back = np.zeros(2 * BLOCK, dtype=np.uint8)
                await att.read_blocks([3, 17], back, tag="check").wait_for_completion()
                assert np.array_equal(back, src)
                assert att.state == "attached" and att.method in ("cma", "tcp")
            events = []
            async for event in region.events():
                events.append(event)
                if event.type == "detached":
                    break
        return events

    events = asyncio.run(main())
    assert [e.type for e in events] == ["attached", "transfer", "transfer", "detached"]
    write, read = events[1], events[2]
    assert write.kind == ferry.OperationKind.WRITE and write.blocks == [3, 17]
    assert write.tag == "request-17" and write.status == ferry.OperationStatus.COMPLETE
    assert write.ranges == [(3 * BLOCK, BLOCK), (17 * BLOCK, BLOCK)]
    assert read.kind == ferry.OperationKind.READ and read.tag == "check"
    assert np.array_equal(pool[3 * BLOCK:4 * BLOCK], pattern(2 * BLOCK, 4)[:BLOCK])


def test_attach_by_subject_and_ranges(nats_pair):
    a, b = nats_pair
    pool = pattern(BLOCK * BLOCKS, 8)
    with a.create_region(pool, block_size=BLOCK, subject="py.regions.by-subject"):
        att = b.attach(ferry.Subject("py.regions.by-subject"))
        out = np.zeros(300, dtype=np.uint8)
        # Either order, as for begin_read.
        att.read(out, [(10, 100), (BLOCK * 5, 200)]).wait_for_completion()
        assert np.array_equal(out[:100], pool[10:110])
        assert np.array_equal(out[100:], pool[BLOCK * 5:BLOCK * 5 + 200])
        att.wait_attached()
        assert att.metadata().block_size == BLOCK
        with pytest.raises(ferry.KindMismatchError, match="allows read"):  # a read region
            att.write_blocks(pattern(BLOCK, 1), [0]).wait_for_completion()
        att.detach()


def test_bad_ranges_are_refused_before_any_byte_moves(nats_pair):
    a, b = nats_pair
    pool = np.zeros(BLOCK * 4, dtype=np.uint8)
    with a.create_region(pool, access="write", block_size=BLOCK) as region:
        att = b.attach(region.metadata())
        for ranges in ([(BLOCK * 4, 1)], [(BLOCK * 3, BLOCK + 1)], [(2**64 - 1, 2)]):
            with pytest.raises(ferry.InvalidArgumentError):
                att.write(np.ones(sum(n for _, n in ranges) % (1 << 20) or 1, dtype=np.uint8),
                          ranges)
        with pytest.raises(ferry.InvalidArgumentError):
            att.write_blocks(np.ones(BLOCK, dtype=np.uint8), [4])
        with pytest.raises(ferry.InvalidArgumentError):
            att.read([("a", 1)], bytearray(1))
        assert not pool.any()


def test_revoke_and_close_end_the_peers_access(nats_pair):
    a, b = nats_pair
    pool = np.zeros(BLOCK * 8, dtype=np.uint8)
    region = a.create_region(pool, access="write", block_size=BLOCK)
    att1 = b.attach(region.metadata())
    att1.wait_attached()
    peers = region.peers()
    assert len(peers) == 1 and peers[0]["peer"] and peers[0]["access"] == "write"
    assert region.revoke(peers[0]["attachment"]) == 1
    with pytest.raises((ferry.AccessDeniedError, ferry.CancelledError, ferry.InvalidStateError)):
        att1.write_blocks(np.ones(BLOCK, dtype=np.uint8), [0]).wait_for_completion()
    region.close()
    assert not region.is_open and isinstance(region.error, ferry.CancelledError)
    late = b.attach(region.metadata())
    with pytest.raises(ferry.AccessDeniedError):
        late.wait_attached()
    assert not pool.any()


def test_event_iterator_ends_with_the_region(nats_pair):
    a, _ = nats_pair

    async def main():
        region = a.create_region(bytearray(BLOCK), block_size=BLOCK, timeout=0.2)
        seen = [e.type async for e in region.events()]
        return seen, region.error

    seen, error = asyncio.run(main())
    assert seen[-1] == "ended" and isinstance(error, ferry.TimeoutError)


def test_region_refusals(nats_pair):
    a, _ = nats_pair
    with pytest.raises(ferry.InvalidArgumentError):
        a.create_region(bytearray(BLOCK + 1), block_size=BLOCK)
    with pytest.raises(ferry.InvalidArgumentError):
        a.create_region(b"read only", access="write")
    with pytest.raises(ferry.InvalidArgumentError, match="access"):
        a.create_region(bytearray(8), access="everything")
    with pytest.raises(ferry.InvalidMetadataError):
        a.attach('{"kind": "ferry.region"}')


def test_next_event_none_waits_for_the_event(nats_pair):
    import threading
    import time

    a, b = nats_pair
    with a.create_region(bytearray(BLOCK), block_size=BLOCK) as region:
        md = region.metadata()
        t = threading.Timer(0.3, lambda: b.attach(md).wait_attached())
        t.start()
        t0 = time.monotonic()
        event = region.next_event(None)
        t.join()
        assert event is not None and event.type == "attached" and time.monotonic() - t0 >= 0.2
