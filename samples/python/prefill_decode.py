"""Disaggregated prefill/decode in Python asyncio over NATS subjects, with ferry.

The same system, and the same NATS protocol, as the C++ sample samples/disagg (so either side
may be the C++ worker): a client asks "disagg.generate" (queue group "decode"); the decode
worker takes KV blocks from its pool and asks "disagg.prefill" (queue group "prefill"); the
prefill worker computes the prompt's KV cache and writes it into the decode worker's blocks:

  region  (default) the decode worker exposes its whole pool once, as a writable region served
          at a subject; the prefill worker attaches once and writes a request's blocks by id,
          tagged with the request id; the decode worker's region event for that tag says the
          bytes are in
  oneshot one writable operation per request over its blocks, served at a subject, written
          with begin_write(..., ferry.Subject(...))

The decode worker checks every byte, frees the blocks and answers the client.

    python3 samples/python/prefill_decode.py [--requests 100] [--mode region|oneshot]
        runs it all: a private nats-server (unless FERRY_NATS_URL is set), a decode worker and
        a prefill worker (each its own process), and the client; exit 0 only if every request
        was verified
    python3 samples/python/prefill_decode.py decode|prefill   one worker (FERRY_NATS_URL)

PYTHONPATH must find ferry (docs/python.md).
"""

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time

import numpy as np

import ferry

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import kv  # noqa: E402
from disagg_prefill import Prefill, start_nats, stop_all  # noqa: E402

LAYERS, TOKENS_PER_BLOCK, BYTES_PER_TOKEN, BLOCKS = 8, 16, 4096, 256


class Decode:
    def __init__(self, connector, name):
        self.connector = connector
        self.name = name
        self.block_bytes = TOKENS_PER_BLOCK * BYTES_PER_TOKEN
        self.pool = np.zeros((LAYERS, BLOCKS, self.block_bytes), dtype=np.uint8)
        self.free = list(range(BLOCKS))
        self.freed = asyncio.Condition()
        self.region = connector.create_region(
            self.pool, access="write", block_size=self.block_bytes,
            subject="disagg.kv." + name)
        self.waiting = {}  # request tag -> future of its region event

    async def events(self):
        async for event in self.region.events():
            fut = self.waiting.pop(event.tag, None) if event.type == "transfer" else None
            if fut is not None and not fut.done():
                fut.set_result(event)

    async def take(self, n):
        async with self.freed:
            await asyncio.wait_for(self.freed.wait_for(lambda: len(self.free) >= n), 20)
            taken, self.free = self.free[:n], self.free[n:]
            return taken

    async def give_back(self, blocks):
        async with self.freed:
            self.free.extend(blocks)
            self.freed.notify_all()

    async def generate(self, req):
        rid, prompt, tokens = req["id"], req["prompt"], req["tokens"]
        n = (tokens + TOKENS_PER_BLOCK - 1) // TOKENS_PER_BLOCK
        mode = req.get("mode", "region")
        reply = {"id": rid, "mode": mode, "decode": self.name}
        blocks = await self.take(n)
        try:
            ask = {"id": rid, "prompt": prompt, "tokens": tokens, "layers": LAYERS,
                   "tokens_per_block": TOKENS_PER_BLOCK, "bytes_per_token": BYTES_PER_TOKEN}
            loop = asyncio.get_running_loop()
            if mode == "region":
                ids = [layer * BLOCKS + b for layer in range(LAYERS) for b in blocks]
                arrived = self.waiting[str(rid)] = loop.create_future()
                ask.update(region_subject="disagg.kv." + self.name, blocks=ids)
                answer = await self.connector.request("disagg.prefill", json.dumps(ask), timeout=30)
                event = await asyncio.wait_for(arrived, 30)
                if event.status != ferry.OperationStatus.COMPLETE:
                    raise RuntimeError("the KV write failed: %s" % event.error)
                if sorted(event.blocks) != sorted(ids):
                    raise RuntimeError("the KV write reached other blocks than the request's")
            else:
                subject = "disagg.kv.%s.%d" % (self.name, rid)
                local = [self.pool[layer, b] for layer in range(LAYERS) for b in blocks]
                with self.connector.create_writable(local, subject=subject, timeout=30) as w:
                    ask["kv_subject"] = subject
                    answer = await self.connector.request("disagg.prefill", json.dumps(ask),
                                                          timeout=30)
                    await w.wait_for_completion()
            pre = answer.json()
            reply.update(prefill=pre.get("worker", "?"), method=pre.get("method", "?"))
            if not pre.get("ok"):
                raise RuntimeError("prefill %s: %s" % (pre.get("worker"), pre.get("error")))
            want = kv.blocks(kv.prompt_digest(prompt), LAYERS, n, self.block_bytes)
            got = self.pool[:, blocks].reshape(-1)  # layer by layer, the request's blocks
            if not np.array_equal(got, want):
                raise RuntimeError("the KV cache does not verify")
            reply.update(ok=True, bytes=int(want.nbytes))
        except Exception as e:
            reply.update(ok=False, error=str(e))
        finally:
            self.waiting.pop(str(rid), None)
            await self.give_back(blocks)
        return reply

    async def serve(self):
        events = asyncio.create_task(self.events())
        tasks = set()

        async def answer(msg):
            req = msg.json()
            if "id" not in req:  # the client's "are you there?"
                msg.respond(json.dumps({"pong": self.name}))
                return
            msg.respond(json.dumps(await self.generate(req)))

        async with self.connector.subscribe("disagg.generate", queue="decode") as sub:
            print("ready", flush=True)
            async for msg in sub:
                task = asyncio.create_task(answer(msg))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        events.cancel()


async def client(connector, requests, mode, concurrency=8):
    # Wait for a decode worker.
    for _ in range(100):
        try:
            await connector.request("disagg.generate", "{}", timeout=0.5)
            break
        except ferry.Error:
            await asyncio.sleep(0.1)
    rng = random.Random(7)
    todo = list(range(requests))
    results = []
    start = time.monotonic()

    async def one_worker():
        while todo:
            i = todo.pop(0)
            req = {"id": i, "prompt": "request %d: tell me about ferries" % i,
                   "tokens": rng.randint(128, 512), "mode": mode}
            t0 = time.monotonic()
            try:
                rep = (await connector.request("disagg.generate", json.dumps(req), timeout=30)).json()
            except ferry.Error as e:
                rep = {"ok": False, "error": str(e)}
            rep["ms"] = (time.monotonic() - t0) * 1000
            results.append(rep)

    await asyncio.gather(*(one_worker() for _ in range(concurrency)))
    took = time.monotonic() - start
    ok = [r for r in results if r.get("ok")]
    moved = sum(r["bytes"] for r in ok)
    methods = sorted({r.get("method", "?") for r in ok})
    lat = sorted(r["ms"] for r in ok) or [0]
    print("== ferry disaggregated prefill/decode in Python (%s mode) ==" % mode)
    print("requests     %d sent, %d verified, %d failed" % (len(results), len(ok), len(results) - len(ok)))
    print("bytes moved  %.1f MiB of KV cache, every byte verified by the decode worker" % (moved / 2**20))
    print("method       %s" % ", ".join(methods))
    print("latency ms   p50 %.2f  p99 %.2f" % (lat[len(lat) // 2], lat[int(len(lat) * 0.99)]))
    print("throughput   %.1f requests/s over %.2f s" % (len(ok) / took, took))
    for r in results:
        if not r.get("ok"):
            print("failed:", r.get("error"))
            break
    return len(ok) == requests


async def run(args):
    name = args.name or "%s-%d" % (args.role, os.getpid())
    connector = ferry.Connector(name)
    if not connector.has_side_channel:
        raise SystemExit("prefill_decode: set FERRY_NATS_URL to the workers' NATS server")
    if args.role == "decode":
        await Decode(connector, name).serve()
    elif args.role == "prefill":
        prefill = Prefill(connector, name)
        ready = asyncio.Event()
        task = asyncio.create_task(prefill.serve(ready))
        await ready.wait()
        print("ready", flush=True)
        await task
    return 0


async def run_all(args):
    started = []
    if not os.environ.get("FERRY_NATS_URL"):
        proc, url = start_nats()
        started.append(proc)
        os.environ["FERRY_NATS_URL"] = url
        print("nats-server  started privately at", url, flush=True)
    try:
        for role in ("prefill", "decode"):
            proc = subprocess.Popen([sys.executable, __file__, role], stdout=subprocess.PIPE,
                                    text=True)
            started.append(proc)
            if proc.stdout.readline().strip() != "ready":
                raise SystemExit("prefill_decode: the %s worker did not come up" % role)
        connector = ferry.Connector("client")
        ok = await client(connector, args.requests, args.mode)
        connector.close()
        return 0 if ok else 1
    finally:
        stop_all(started)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("role", nargs="?", default="all", choices=["all", "decode", "prefill"])
    parser.add_argument("--name")
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--mode", default="region", choices=["region", "oneshot"])
    args = parser.parse_args()
    return asyncio.run(run_all(args) if args.role == "all" else run(args))


if __name__ == "__main__":
    sys.exit(main())
