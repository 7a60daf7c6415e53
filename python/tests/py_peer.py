"""The Python twin of ferry_py_peer (cpp_peer.cpp): the same roles, arguments and lines, so that
the cross-process tests pair Python with Python exactly as they pair it with C++. Runs its
operations in asyncio."""

import asyncio
import sys

import numpy as np

import ferry


def pattern(size, seed, base=0):
    i = np.arange(base, base + size, dtype=np.uint64)
    return ((i * 131 + seed) & 0xFF).astype(np.uint8)


def say(line):
    print(line, flush=True)


async def main(argv):
    role, size, seed = argv[0], int(argv[1]), int(argv[2])
    rest = argv[3:]
    subject = None
    if "--subject" in rest:
        i = rest.index("--subject")
        subject = rest[i + 1]
        rest = rest[:i] + rest[i + 2:]
    connector = ferry.Connector("py-peer")
    loop = asyncio.get_running_loop()
    try:
        if role in ("readable", "writable"):
            buf = pattern(size, seed) if role == "readable" else np.zeros(size, dtype=np.uint8)
            make = connector.create_readable if role == "readable" else connector.create_writable
            with make(buf, subject=subject) as op:
                if subject is None:
                    say("metadata " + op.metadata().to_json())
                say("ready")
                await op.wait_for_completion()
            if role == "writable" and not np.array_equal(buf, pattern(size, seed)):
                say("error the bytes written differ from the pattern")
                return 1
        elif role in ("read", "write"):
            buf = np.zeros(size, dtype=np.uint8) if role == "read" else pattern(size, seed)
            if subject is None:
                line = await loop.run_in_executor(None, sys.stdin.readline)
                remote = ferry.RdmaMetadata.from_json(line)
            else:
                remote = ferry.Subject(subject)
            if role == "read":
                op = connector.begin_read(remote, buf)
            else:
                op = connector.begin_write(buf, remote)
            await op.wait_for_completion()
            if role == "read" and not np.array_equal(buf, pattern(size, seed)):
                say("error the bytes read differ from the pattern")
                return 1
        elif role in ("region-read", "region-write"):
            block, count = int(rest[0]), int(rest[1]) if len(rest) > 1 else 0
            reading = role == "region-read"
            buf = pattern(size, seed) if reading else np.zeros(size, dtype=np.uint8)
            written = set()
            done = 0
            with connector.create_region(buf, access="read" if reading else "write",
                                         block_size=block, subject=subject) as region:
                say("ready")
                async for event in region.events():
                    if event.type != "transfer":
                        continue
                    say("transfer %s blocks=%s tag=%s %s" % (
                        event.kind.name.lower(), ",".join(map(str, event.blocks)), event.tag,
                        event.status.name.lower()))
                    if event.status != ferry.OperationStatus.COMPLETE:
                        continue
                    done += 1
                    written.update(event.blocks)
                    if done >= count:
                        break
            if not reading:
                for b in sorted(written):
                    got = buf[b * block:(b + 1) * block]
                    if not np.array_equal(got, pattern(block, seed, b * block)):
                        say("error block %d differs from the pattern" % b)
                        return 1
                say("verified %d blocks" % len(written))
        else:
            print("py_peer: unknown role " + role, file=sys.stderr)
            return 2
    except ferry.Error as e:
        say("error " + str(e))
        return 1
    finally:
        connector.close()
    say("complete")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
