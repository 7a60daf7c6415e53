"""A Python prefill worker for the C++ disaggregated sample (samples/disagg, ferry-disagg).

It speaks ferry-disagg's protocol exactly as the C++ prefill worker does: it serves NATS
requests at "disagg.prefill" in queue group "prefill" (on the connector's own NATS connection),
computes the prompt's KV cache (samples/python/kv.py: the bytes kv.hpp computes) and writes it
into the decode worker's memory: by block ids into its region (attached once per decode
worker, by subject, the request id as tag), or into a one-shot writable served at a subject.
The C++ decode worker verifies every byte.

    # beside running C++ workers (FERRY_NATS_URL names their server):
    python3 samples/python/disagg_prefill.py [--name N]

    # the whole system, verified: a private nats-server, the C++ decode worker, this worker as
    # the only prefill worker, and the C++ client in both modes (exit 0 only if every request
    # was verified):
    python3 samples/python/disagg_prefill.py --with-cpp build/samples/disagg/ferry-disagg \\
        [--requests 100]

PYTHONPATH must find ferry (docs/python.md): the build tree's python/ directory, or an install.
"""

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import numpy as np

import ferry

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kv  # noqa: E402


class Prefill:
    def __init__(self, connector, name):
        self.connector = connector
        self.name = name
        self.attachments = {}  # region subject -> Attachment
        self.served = 0

    def attachment(self, subject):
        att = self.attachments.get(subject)
        if att is None or att.state == "detached":
            att = self.attachments[subject] = self.connector.attach(ferry.Subject(subject))
        return att

    async def handle(self, msg):
        reply = {"worker": self.name}
        try:
            req = msg.json()
            layers, tpb, bpt = req["layers"], req["tokens_per_block"], req["bytes_per_token"]
            count = (req["tokens"] + tpb - 1) // tpb
            block_bytes = tpb * bpt
            # "Prefill", off the event loop: numpy releases the GIL for the arithmetic.
            cache = await asyncio.get_running_loop().run_in_executor(
                None, kv.blocks, kv.prompt_digest(req["prompt"]), layers, count, block_bytes)
            if "region_subject" in req:
                op = self.attachment(req["region_subject"]).write_blocks(
                    cache, req["blocks"], tag=str(req["id"]))
            else:
                op = self.connector.begin_write(cache, ferry.Subject(req["kv_subject"]))
            await op.wait_for_completion()
            reply.update(ok=True, method=op.method, bytes=int(cache.nbytes))
        except Exception as e:  # the decode worker reports it with the request
            reply.update(ok=False, error=str(e))
        self.served += 1
        msg.respond(json.dumps(reply))

    async def serve(self, ready=None):
        tasks = set()
        async with self.connector.subscribe("disagg.prefill", queue="prefill") as sub:
            if ready is not None:
                ready.set()
            async for msg in sub:
                task = asyncio.create_task(self.handle(msg))
                tasks.add(task)
                task.add_done_callback(tasks.discard)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_nats():
    server = shutil.which("nats-server") or "/usr/sbin/nats-server"
    port = free_port()
    proc = subprocess.Popen([server, "-a", "127.0.0.1", "-p", str(port), "-l", "/dev/null"])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, "nats://127.0.0.1:%d" % port
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("disagg_prefill: nats-server did not start")


def stop_all(started):
    """Stops the processes `started`, the last started first (workers before their server)."""
    for proc in reversed(started):
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


async def with_cpp(args):
    """The whole system: private nats-server, C++ decode, this prefill, C++ client."""
    started = []
    url = os.environ.get("FERRY_NATS_URL")
    if not url:
        proc, url = start_nats()
        started.append(proc)
        os.environ["FERRY_NATS_URL"] = url
        print("nats-server  started privately at", url, flush=True)
    try:
        connector = ferry.Connector(args.name, nats=url)
        prefill = Prefill(connector, args.name)
        ready = asyncio.Event()
        server = asyncio.create_task(prefill.serve(ready))
        await ready.wait()
        decode = subprocess.Popen([args.with_cpp, "decode", "--name", "decode-0"],
                                  stdout=subprocess.DEVNULL)
        started.append(decode)
        rc = 0
        for mode in ("region", "oneshot"):
            client = await asyncio.create_subprocess_exec(
                args.with_cpp, "client", "--requests", str(args.requests), "--mode", mode)
            rc = rc or await client.wait()
        print("python prefill %s: served %d requests" % (args.name, prefill.served), flush=True)
        server.cancel()
        connector.close()
        return rc
    finally:
        stop_all(started)


async def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", default="py-prefill-%d" % os.getpid())
    parser.add_argument("--with-cpp", metavar="FERRY_DISAGG",
                        help="run the whole system with this ferry-disagg binary, and verify it")
    parser.add_argument("--requests", type=int, default=100)
    args = parser.parse_args()
    if args.with_cpp:
        return await with_cpp(args)
    connector = ferry.Connector(args.name)
    if not connector.has_side_channel:
        raise SystemExit("disagg_prefill: set FERRY_NATS_URL to the workers' NATS server")
    print("ready", flush=True)
    await Prefill(connector, args.name).serve()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
