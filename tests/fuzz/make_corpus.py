#!/usr/bin/env python3
"""Writes the hand-made seed inputs of tests/fuzz/corpus/ (docs/testing.md).

The seeds of fuzz_tcp_frames follow the byte grammar that fuzz_tcp_frames.cpp reads, so that a
short run starts from complete exchanges (a whole read, a whole write, refused requests, a
peer that stops midway) instead of having to discover the frame layout first. Run it after
changing that grammar:

    tests/fuzz/make_corpus.py            # rewrites tests/fuzz/corpus/*/seed-*
"""
import json
import pathlib
import struct

HERE = pathlib.Path(__file__).resolve().parent

# Frame types and the picks fuzz_tcp_frames.cpp maps them from.
READ, WRITE, DONE, HELLO, DATA, STATUS = "READ", "WRITE", "DONE", "HELLO", "DATA", "STATUS"
READ_RANGES = "READ_RANGES"
SERVER_PICK = {READ: 0, WRITE: 3, DONE: 6, HELLO: 8, DATA: 9, STATUS: 10, "RAW": 11, "UNKNOWN": 12,
               READ_RANGES: 15}  # READ_RANGES: region mode only
READABLE, WRITABLE = 0, 1
WRITABLE_A, WRITABLE_GAP, WRITABLE_B = 1536, 64, 2560
MAX_REQUEST = 16 << 10


class Out:
    def __init__(self):
        self.b = bytearray()

    def u8(self, v):
        self.b += struct.pack("<B", v & 0xFF)
        return self

    def u16(self, v):
        self.b += struct.pack("<H", v & 0xFFFF)
        return self

    def u32(self, v):
        self.b += struct.pack("<I", v & 0xFFFFFFFF)
        return self

    def u64(self, v):
        self.b += struct.pack("<Q", v & 0xFFFFFFFFFFFFFFFF)
        return self

    def raw(self, data):
        self.b += data
        return self


# ---- server side: a raw client against the owner's readable and writable ----

def server(hello=True, frames=(), ending=0, region=False):
    # region: first byte 2 puts a readable region in the readable's place; the client attaches
    # (ATTACH request 405: 200 plus the byte 205; read access) before the frames, which then
    # name the attachment.
    o = Out().u8(2 if region else 0)
    if hello:
        o.u8(0).u64(0).u8(len(b"raw-client")).raw(b"raw-client")
    else:
        o.u8(6)
    if region:
        o.u8(205).u8(0)
    o.u8(len(frames))
    for f in frames:
        f(o)
    o.u8(ending)  # 0: probe and read to the end, 2: reset, 3: half-close
    return bytes(o.b)


def frame(kind, target=READABLE, cred="real", addr=("off", 0), length=("small", 0), req=1,
          flags=0, status=0, msg=b"", mutation=None, fill=0x41, truncate_to=0, pump=True,
          ranges=()):
    def write(o):
        o.u8(SERVER_PICK[kind]).u8(target)
        c = {"real": 0, "flipped": 2, "other": 3, "made-up": 3}[cred] << 1
        c |= {"off": 0, "before": 3, "near-end": 4, "any": 5, "gap": 6, "zero": 7}[addr[0]] << 3
        c |= {"small": 0, "max": 2, "any": 3}[length[0]] << 6
        o.u8(c)
        if cred == "flipped":
            o.u8(3).u8(5)
        elif cred == "other":
            o.u8(0)
        elif cred == "made-up":
            o.u8(1).u64(0x1234).raw(bytes(16))
        kind_addr = addr[0]
        if kind_addr == "off":
            o.u16(addr[1])
        elif kind_addr in ("before", "near-end"):
            o.u8(addr[1])
        elif kind_addr == "any":
            o.u64(addr[1])
        elif kind_addr == "gap" and target == WRITABLE:
            o.u8(addr[1])
        if length[0] == "small":
            o.u16(length[1])
        elif length[0] == "max":
            o.u8(length[1])  # max_request + (v % 3) - 1
        else:
            o.u64(length[1])
        o.u8(req)
        if kind == "RAW":
            o.u8(len(msg)).raw(msg)
            return
        if kind == "UNKNOWN":
            o.u8(0)
        if kind == DONE:
            o.u8(flags)
            if status:
                o.u8(0).u8(status)
            else:
                o.u8(1)
        if kind == STATUS:
            o.u8(status)
        if kind == READ_RANGES:
            # (offset, length) pairs in the target (at most 4); the list's length as sent.
            o.u8(len(ranges))
            for off, n in ranges:
                o.u16(off).u16(n).u8(1)
            o.u8(1)
        o.u8(len(msg)).raw(msg)
        m = {None: 4, "magic": 0, "version": 1, "msg_len": 2, "truncate": 3}[mutation]
        o.u8(m)
        if mutation == "magic":
            o.u8(7)
        elif mutation == "version":
            o.u8(0)
        elif mutation == "msg_len":
            o.u16(0)
        closes = mutation in ("magic", "version", "msg_len") or kind == "UNKNOWN"
        size = {"small": length[1], "max": MAX_REQUEST + length[1] % 3 - 1, "any": length[1]}[length[0]]
        if kind == READ_RANGES:
            size = 16 * len(ranges)
        if kind in (WRITE, DATA, READ_RANGES) and not closes and size <= MAX_REQUEST:
            o.u8(fill)
            if mutation == "truncate":
                o.u16(truncate_to)
        o.u8(0 if pump else 1)
    return write


def server_seeds():
    whole_read = [frame(READ, req=1, addr=("off", 0), length=("small", 2048)),
                  frame(READ, req=2, addr=("off", 2048), length=("small", 2048)),
                  frame(DONE, flags=1, req=3)]
    whole_write = [frame(WRITE, WRITABLE, req=1, addr=("off", 0), length=("small", WRITABLE_A)),
                   frame(WRITE, WRITABLE, req=2, addr=("off", WRITABLE_A + WRITABLE_GAP),
                         length=("small", WRITABLE_B)),
                   frame(DONE, WRITABLE, flags=2, req=3)]
    return {
        "read-whole": server(frames=whole_read),
        "region-read-whole": server(frames=whole_read[:2], region=True),
        "region-refused-write": server(frames=[frame(WRITE, req=1, addr=("off", 0),
                                                     length=("small", 100))], region=True),
        "region-read-ranges": server(frames=[frame(READ_RANGES, req=1,
                                                   ranges=[(0, 512), (2048, 1024), (0, 512)])],
                                     region=True),
        "region-read-ranges-refused": server(frames=[frame(READ_RANGES, req=1,
                                                           ranges=[(0, 512), (4000, 200)])],
                                             region=True),
        "write-whole": server(frames=whole_write),
        "read-then-reset": server(frames=whole_read[:2], ending=2),
        "write-then-half-close": server(frames=whole_write[:1], ending=3),
        "refused-reads": server(frames=[
            frame(READ, cred="flipped", length=("small", 16)),
            frame(READ, cred="made-up", length=("small", 16), req=2),
            frame(READ, cred="other", length=("small", 16), req=3),
            frame(READ, addr=("before", 0), length=("small", 16), req=4),
            frame(READ, addr=("near-end", 8), length=("small", 16), req=5),
            frame(READ, addr=("any", (1 << 64) - 8), length=("small", 16), req=6),
            frame(READ, length=("max", 2), req=7),
            frame(READ, length=("small", 0), req=8),
            frame(READ, WRITABLE, length=("small", 16), req=9),
        ]),
        "refused-writes": server(frames=[
            frame(WRITE, WRITABLE, addr=("gap", 0), length=("small", 32), req=1),
            frame(WRITE, WRITABLE, addr=("off", WRITABLE_A - 8), length=("small", 16), req=2),
            frame(WRITE, WRITABLE, cred="flipped", length=("small", 16), req=3),
            frame(WRITE, READABLE, length=("small", 16), req=4),
            frame(DONE, WRITABLE, flags=2, req=5),
            frame(DONE, WRITABLE, flags=0, req=6),
        ]),
        "failed-done": server(frames=[frame(READ, length=("small", 100)),
                                      frame(DONE, flags=1, status=7, msg=b"gave up", req=2)]),
        "no-hello": server(hello=False, frames=[frame(READ, length=("small", 16))]),
        "write-too-large": server(frames=[frame(WRITE, WRITABLE, length=("max", 2))]),
        "write-truncated": server(frames=[frame(WRITE, WRITABLE, length=("small", 1000),
                                                mutation="truncate", truncate_to=500)]),
        "bad-magic": server(frames=[frame(READ, length=("small", 16), mutation="magic")]),
        "long-text": server(frames=[frame(STATUS, mutation="msg_len")]),
        "server-types": server(frames=[frame(DATA, length=("small", 8)), frame(HELLO, req=2)]),
    }


# ---- client side: the connector against a fake server ----

def client(writing, total, answers, ending=0, split=None, remote=(), opening="hello"):
    """remote: sizes of the remote descriptors but the last, each followed by a gap or 0."""
    o = Out().u8(1).u8(1 if writing else 0).u16(total - 1)
    if total > 1:
        if split is None:
            o.u8(0)
        else:
            o.u8(1).u16(split - 1)
    o.u8(len(remote))  # count - 1
    o.u32(0x7F00)
    left = total
    for size, gap in remote:
        o.u16(size - 1)
        left -= size
        o.u8(1).u8(gap - 1) if gap else o.u8(0)
    o.u8(0)  # the last one: adjacent
    o.u64(0x0123456789ABCDEF).raw(bytes(range(16))).u64(0xFEDCBA9876543210)
    if opening == "hello":
        o.u8(0).u8(len(b"fake-owner")).raw(b"fake-owner")
    elif opening == "refuse":
        o.u8(6).u8(6).u8(0)
    else:
        o.u8(7)
    o.u8(len(answers))
    for a in answers:
        a(o)
    o.u8(ending)  # 0 close, 1 reset, 2 silent, 3 half-close
    return bytes(o.b)


def answer(kind, index=0, length="asked", status=0, fill=0x5A, msg=b"", mutation=None,
           truncate_to=0):
    def write(o):
        o.u8({DATA: 0, STATUS: 4, HELLO: 7, READ: 8, "RAW": 9}[kind])
        o.u8(index << 2)  # the index-th request seen
        if kind == DATA:
            if length == "asked":
                o.u8(0)
            else:
                o.u8(3).u8(0).u16(length)
        elif kind == STATUS:
            if status:
                o.u8(0).u8(status)
            else:
                o.u8(1)
        elif kind == READ:
            o.u8(0).u16(8)
        elif kind == "RAW":
            o.u8(len(msg)).raw(msg)
            return
        o.u8(len(msg)).raw(msg)
        o.u8({None: 4, "magic": 0, "truncate": 3}[mutation])
        if mutation == "magic":
            o.u8(1)
        if kind == DATA:
            o.u8(fill)
            if mutation == "truncate":
                o.u16(truncate_to)
    return write


def client_seeds():
    return {
        "read-whole": client(False, 3000, [answer(DATA, 0), answer(DATA, 1), answer(DATA, 2)]),
        "read-scattered": client(False, 2500, [answer(DATA, i) for i in range(3)], split=700,
                                 remote=[(1000, 16), (500, 0)]),
        "write-whole": client(True, 2048, [answer(STATUS, 0), answer(STATUS, 1),
                                           answer(STATUS, 2)], ending=2),
        "write-refused": client(True, 1500, [answer(STATUS, 0, status=6, msg=b"no")]),
        "read-refused": client(False, 100, [answer(STATUS, 0, status=6, msg=b"denied")]),
        "read-wrong-length": client(False, 100, [answer(DATA, 0, length=50)]),
        "read-truncated": client(False, 1000, [answer(DATA, 0, mutation="truncate",
                                                      truncate_to=10)], ending=2),
        "silent": client(False, 100, [], ending=2),
        "no-hello": client(False, 100, [answer(DATA, 0)], opening="none"),
        "refused-connection": client(True, 100, [], opening="refuse"),
        "client-type": client(False, 100, [answer(READ, 0)]),
        "bad-magic": client(False, 100, [answer(DATA, 0, mutation="magic")], ending=1),
    }


METADATA = {
    "version": 1,
    "operation_kind": "read",
    "notification_key": "0123456789abcdef",
    "owner": {"name": "decode-0", "id": "00000000deadbeef", "host": "host-a", "pid": 4242},
    "endpoints": [{"method": "tcp", "address": "127.0.0.1:4000"},
                  {"method": "tcp", "address": "[::1]:4000"}],
    "descriptors": [{"device": "host", "ptr": 140737488351232, "size": 4096},
                    {"device": "cuda:3", "ptr": 18446744073709551605, "size": 10}],
    "token": "00112233445566778899aabbccddeeff",
}


def metadata_seeds():
    one = dict(METADATA, operation_kind="write",
               descriptors=[{"device": "cpu", "ptr": 1, "size": 1}])
    many = dict(METADATA, descriptors=[{"device": "cuda", "ptr": 4096 * (i + 1), "size": 4096}
                                       for i in range(8)])
    bad = dict(METADATA, version=2)
    # A region's metadata (docs/regions.md): the shared fields, its kind, access and blocks.
    region = {k: v for k, v in METADATA.items() if k not in ("operation_kind", "notification_key")}
    region.update(kind="ferry.region", region_id="0123456789abcdef", access="read_write",
                  block_size=4096, descriptors=[{"device": "cpu", "ptr": 4096, "size": 16384}])
    return {
        "region": json.dumps(region).encode(),
        "region-ragged-blocks": json.dumps(dict(region, block_size=3000)).encode(),
        "valid": json.dumps(METADATA).encode(),
        "one-descriptor": json.dumps(one, indent=1).encode(),
        "many-descriptors": json.dumps(many).encode(),
        "unknown-version": json.dumps(bad).encode(),
        "overflow": json.dumps(dict(METADATA, descriptors=[
            {"device": "host", "ptr": 18446744073709551615, "size": 1}])).encode(),
    }


def main():
    for target, seeds in (("fuzz_metadata", metadata_seeds()),
                          ("fuzz_tcp_frames", {**{"server-" + k: v for k, v in server_seeds().items()},
                                               **{"client-" + k: v for k, v in client_seeds().items()}})):
        out = HERE / "corpus" / target
        out.mkdir(parents=True, exist_ok=True)
        for old in out.glob("seed-*"):
            old.unlink()
        for name, data in seeds.items():
            (out / ("seed-" + name)).write_bytes(data)
        print(f"{out.relative_to(HERE.parent.parent)}: {len(seeds)} seeds")


if __name__ == "__main__":
    main()
