"""Python against C++ and against Python, each side in its own process: every operation kind
both ways, by metadata handed over a pipe and by NATS subject, and regions by subject."""

import asyncio
import itertools
import os

import numpy as np
import pytest

import ferry
from conftest import PY, pattern, python_child_env

HERE = os.path.dirname(os.path.abspath(__file__))
_subjects = itertools.count()


def peer_argv(kind, cpp_peer, *args):
    if kind == "cpp":
        return [cpp_peer, *map(str, args)]
    return [PY, os.path.join(HERE, "py_peer.py"), *map(str, args)]


@pytest.fixture(scope="module")
def connector(nats):
    c = ferry.Connector("py-test", nats=nats.url)
    yield c
    c.close()


SIZES = [1, 4096, 5 << 20]


@pytest.mark.parametrize("peer", ["cpp", "py"])
@pytest.mark.parametrize("size", SIZES)
def test_we_read_the_peers_readable(peer, size, connector, nats, cpp_peer, children):
    child = children(peer_argv(peer, cpp_peer, "readable", size, 21), python_child_env(nats.url))
    md = child.expect("metadata ")
    child.expect("ready")
    dst = np.zeros(size, dtype=np.uint8)
    op = connector.begin_read(ferry.RdmaMetadata.from_json(md), dst)
    assert op.wait_for_completion(30)
    assert np.array_equal(dst, pattern(size, 21))
    assert op.peer.name == ("cpp-peer" if peer == "cpp" else "py-peer")
    assert child.finish()[0] == 0


@pytest.mark.parametrize("peer", ["cpp", "py"])
@pytest.mark.parametrize("size", SIZES)
def test_we_write_the_peers_writable(peer, size, connector, nats, cpp_peer, children):
    child = children(peer_argv(peer, cpp_peer, "writable", size, 22), python_child_env(nats.url))
    md = child.expect("metadata ")
    child.expect("ready")
    op = connector.begin_write(pattern(size, 22), md)  # JSON text is metadata too
    assert op.wait_for_completion(30)
    code, out, _ = child.finish()
    assert code == 0 and "complete" in out


@pytest.mark.parametrize("peer", ["cpp", "py"])
@pytest.mark.parametrize("size", SIZES)
def test_the_peer_reads_our_readable(peer, size, connector, nats, cpp_peer, children):
    child = children(peer_argv(peer, cpp_peer, "read", size, 23), python_child_env(nats.url))

    async def main():
        async with connector.create_readable(pattern(size, 23)) as r:
            child.send(r.metadata().to_json())
            assert await r.wait_for_completion(timeout=30)

    asyncio.run(main())
    code, out, err = child.finish()
    assert code == 0 and "complete" in out, out + err


@pytest.mark.parametrize("peer", ["cpp", "py"])
@pytest.mark.parametrize("size", SIZES)
def test_the_peer_writes_our_writable(peer, size, connector, nats, cpp_peer, children):
    child = children(peer_argv(peer, cpp_peer, "write", size, 24), python_child_env(nats.url))
    dst = np.zeros(size, dtype=np.uint8)

    async def main():
        async with connector.create_writable(dst) as w:
            child.send(w.metadata().to_json())
            assert await w.wait_for_completion(timeout=30)

    asyncio.run(main())
    assert np.array_equal(dst, pattern(size, 24))
    assert child.finish()[0] == 0


@pytest.mark.parametrize("peer", ["cpp", "py"])
@pytest.mark.parametrize("role", ["readable", "writable", "read", "write"])
def test_pairing_by_subject(peer, role, connector, nats, cpp_peer, children):
    size = 1 << 20
    subject = "py.test.%s.%s.%d" % (peer, role, next(_subjects))
    child = children(peer_argv(peer, cpp_peer, role, size, 25, "--subject", subject),
                     python_child_env(nats.url))
    buf = pattern(size, 25) if role in ("read", "writable") else np.zeros(size, dtype=np.uint8)

    async def main():
        if role == "readable":
            child.expect("ready")
            op = connector.begin_read(ferry.Subject(subject), buf)
        elif role == "writable":
            child.expect("ready")
            op = connector.begin_write(buf, ferry.Subject(subject))
        elif role == "read":
            op = connector.create_readable(buf, subject=subject)
        else:
            op = connector.create_writable(buf, subject=subject)
        with op:
            assert await op.wait_for_completion(timeout=30)

    asyncio.run(main())
    if role in ("readable", "write"):
        assert np.array_equal(buf, pattern(size, 25))
    code, out, err = child.finish()
    assert code == 0 and "complete" in out, out + err


@pytest.mark.parametrize("peer", ["cpp", "py"])
def test_we_read_blocks_of_the_peers_region(peer, connector, nats, cpp_peer, children):
    block, blocks = 16384, 64
    subject = "py.test.region.read.%s.%d" % (peer, next(_subjects))
    child = children(
        peer_argv(peer, cpp_peer, "region-read", block * blocks, 26, block, 2, "--subject", subject),
        python_child_env(nats.url))
    child.expect("ready")
    want = pattern(block * blocks, 26).reshape(blocks, block)

    async def main():
        with connector.attach(ferry.Subject(subject)) as att:
            first = np.zeros((3, block), dtype=np.uint8)
            await att.read_blocks([5, 0, 63], first, tag="req-1").wait_for_completion()
            assert np.array_equal(first, want[[5, 0, 63]])
            ranged = np.zeros(100, dtype=np.uint8)
            await att.read([(block * 2 + 7, 100)], ranged, tag="req-2").wait_for_completion()
            assert np.array_equal(ranged, want.reshape(-1)[block * 2 + 7: block * 2 + 107])
            assert att.method in ("cma", "tcp")

    asyncio.run(main())
    out = child.expect("transfer read blocks=5,0,63 tag=req-1 complete")
    assert out == ""
    child.expect("transfer read blocks= tag=req-2 complete")
    assert child.finish()[0] == 0


@pytest.mark.parametrize("peer", ["cpp", "py"])
def test_we_write_blocks_of_the_peers_region_and_the_owner_hears_it(peer, connector, nats, cpp_peer,
                                                                    children):
    block, blocks = 8192, 32
    subject = "py.test.region.write.%s.%d" % (peer, next(_subjects))
    child = children(
        peer_argv(peer, cpp_peer, "region-write", block * blocks, 27, block, 2, "--subject", subject),
        python_child_env(nats.url))
    child.expect("ready")
    whole = pattern(block * blocks, 27).reshape(blocks, block)

    async def main():
        att = connector.attach(ferry.Subject(subject), access="write")
        ops = [att.write_blocks(np.ascontiguousarray(whole[[1, 4, 9]]), [1, 4, 9], tag="a"),
               att.write_blocks(whole[30], [30], tag="b")]
        await asyncio.gather(*(op.wait_for_completion() for op in ops))
        return att

    att = asyncio.run(main())
    lines = sorted([child.line(), child.line()])
    assert lines == ["transfer write blocks=1,4,9 tag=a complete",
                     "transfer write blocks=30 tag=b complete"]
    child.expect("verified 4 blocks")
    assert child.finish()[0] == 0
    att.detach()
