"""The worker's own NATS messages on the connector's connection: publish, subscribe (queue
groups, wildcards), request/reply in asyncio and blocking, and how each ends."""

import asyncio
import itertools

import pytest

import ferry

_n = itertools.count()


def subject(stem):
    return "py.msg.%s.%d" % (stem, next(_n))


def test_publish_and_subscribe_with_wildcards(nats_pair):
    a, b = nats_pair
    assert a.side_channel_state[0] == "connected"
    base = subject("pubsub")
    with a.subscribe(base + ".>") as sub:
        b.publish(base + ".one", b"\x00bytes\xff")
        b.publish(base + ".two.deep", "text", reply="somewhere.else")
        first, second = sub.next_message(5), sub.next_message(5)
        assert (first.subject, first.data) == (base + ".one", b"\x00bytes\xff")
        assert (second.subject, second.reply, second.data) == (base + ".two.deep", "somewhere.else", b"text")
        assert sub.next_message(0.05) is None


def test_queue_group_members_share_the_messages(nats_pair):
    a, b = nats_pair
    s = subject("queue")
    n = 200
    with a.subscribe(s, queue="workers") as one, b.subscribe(s, queue="workers") as two:
        for i in range(n):
            a.publish(s, str(i))
        got = []
        for sub in (one, two):
            while True:
                msg = sub.next_message(0.3)
                if msg is None:
                    break
                got.append(int(msg.data))
        assert sorted(got) == list(range(n))  # each message to exactly one member
        assert one.queue == "workers"


def test_request_reply_in_asyncio_and_blocking(nats_pair):
    a, b = nats_pair
    s = subject("service")

    async def main():
        sub = a.subscribe(s)

        async def serve():
            async for msg in sub:
                msg.respond(b"re:" + msg.data)

        server = asyncio.create_task(serve())
        replies = await asyncio.gather(*(b.request(s, "q%d" % i, timeout=5) for i in range(50)))
        assert sorted(r.data for r in replies) == sorted(b"re:q%d" % i for i in range(50))
        server.cancel()
        return sub

    sub = asyncio.run(main())
    # Blocking (no running loop): served from a thread here.
    import threading

    def serve_one():
        msg = sub.next_message(5)
        a.respond(msg, msg.json()["x"] * 2 * "y")

    t = threading.Thread(target=serve_one)
    t.start()
    assert b.request(s, '{"x": 2}', timeout=5).data == b"yyyy"
    t.join(5)
    sub.unsubscribe()


def test_request_errors_name_the_subject(nats_pair):
    _, b = nats_pair

    async def main():
        with pytest.raises(ferry.PeerLostError, match="no responders"):
            await b.request(subject("nobody"), "x", timeout=2)
        s = subject("silent")
        with b.subscribe(s):  # subscribed, never answers
            with pytest.raises(ferry.TimeoutError) as info:
                await b.request(s, "x", timeout=0.2)
            assert s in str(info.value) and info.value.retryable

    asyncio.run(main())
    with pytest.raises(ferry.InvalidArgumentError):
        b.request(subject("x"), "x", timeout=0)


def test_unsubscribe_stops_delivery_and_ends_the_iterator(nats_pair):
    a, b = nats_pair
    s = subject("unsub")
    sub = a.subscribe(s)

    async def main():
        b.publish(s, "before")
        it = sub.__aiter__()
        assert (await asyncio.wait_for(it.__anext__(), 5)).data == b"before"
        sub.unsubscribe()
        assert not sub.active
        b.publish(s, "after")
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(it.__anext__(), 5)

    asyncio.run(main())
    assert sub.next_message(0.1) is None


def test_the_queue_is_bounded(nats_pair):
    a, b = nats_pair
    s = subject("bounded")
    with a.subscribe(s, max_pending=10) as sub, a.subscribe(s + ".fence") as fence:
        for i in range(50):
            b.publish(s, str(i))
        b.publish(s + ".fence", "")
        # One publisher's messages reach a connection in order: once the fence is in, so is
        # every message before it.
        assert fence.next_message(5) is not None
        got = [int(sub.next_message(1).data) for _ in range(10)]
        assert got == list(range(40, 50)) and sub.dropped == 40
        assert sub.next_message(0) is None


def test_refusals(nats_pair, nats):
    a, _ = nats_pair
    with pytest.raises(ferry.InvalidArgumentError):
        a.publish("ferry.forged", b"x")  # ferry's own namespace
    with pytest.raises(ferry.InvalidArgumentError):
        a.subscribe(">")  # would see ferry's own control messages
    with pytest.raises(ferry.InvalidArgumentError):
        a.publish("a.*", b"x")
    with pytest.raises(ferry.InvalidArgumentError):
        a.publish("fine", 12)
    with ferry.Connector(nats=False) as lonely:
        with pytest.raises(ferry.InvalidStateError):
            lonely.publish("x", b"")


def test_closing_the_connector_ends_subscriptions_and_requests(nats):
    c = ferry.Connector("closing", nats=nats.url)
    s = subject("closing")
    sub = c.subscribe(s)
    silent = c.subscribe(s + ".silent")

    async def main():
        pending = asyncio.ensure_future(c.request(s + ".silent", "x", timeout=30))
        await asyncio.sleep(0.1)
        c.close()
        with pytest.raises(ferry.CancelledError):
            await asyncio.wait_for(pending, 5)
        assert [m async for m in sub] == []  # ended: the iterator stops

    asyncio.run(main())
    assert not sub.active and isinstance(sub.error, ferry.CancelledError)
    silent.unsubscribe()


def test_a_fast_stream_never_stalls_the_iterator(nats_pair):
    """Messages pushed by ferry's loop thread while the iterator clears its wake-up fd: none
    may be left waiting for a wake-up that never comes (the order inside Notifier.clear())."""
    a, b = nats_pair
    s = subject("stream")
    n = 5000

    async def main():
        got = 0
        with a.subscribe(s) as sub:
            async def produce():
                for i in range(n):
                    b.publish(s, b"x")
                    if i % 7 == 0:
                        await asyncio.sleep(0)

            producer = asyncio.create_task(produce())
            async for _ in sub:
                got += 1
                if got == n:
                    break
                if got % 3 == 0:
                    await asyncio.sleep(0)
            await producer
        return got

    assert asyncio.run(asyncio.wait_for(main(), 60)) == n


def test_a_waiting_iterator_ends_on_unsubscribe_and_on_close(nats):
    import threading

    c = ferry.Connector("ending", nats=nats.url)

    async def main():
        sub = c.subscribe(subject("end-unsub"))
        task = asyncio.create_task(asyncio.wait_for(sub.__anext__(), 10))
        await asyncio.sleep(0.1)  # the iterator is waiting
        sub.unsubscribe()
        with pytest.raises(StopAsyncIteration):
            await task
        sub2 = c.subscribe(subject("end-close"))
        task2 = asyncio.create_task(asyncio.wait_for(sub2.__anext__(), 10))
        await asyncio.sleep(0.1)
        c.close()
        with pytest.raises(StopAsyncIteration):
            await task2

    asyncio.run(main())
    with ferry.Connector("ending-2", nats=nats.url) as d:
        sub = d.subscribe(subject("end-blocking"))
        got = []
        t = threading.Thread(target=lambda: got.append(sub.next_message(10)))
        t.start()
        import time

        time.sleep(0.1)
        sub.unsubscribe()
        t.join(5)
        assert got == [None] and not t.is_alive()


def test_two_tasks_on_one_subscription_both_get_messages(nats_pair):
    a, b = nats_pair
    s = subject("two-readers")

    async def main():
        counts = [0, 0]
        with a.subscribe(s) as sub:
            async def reader(i, delay):
                async for _ in sub:
                    counts[i] += 1
                    await asyncio.sleep(delay)

            tasks = [asyncio.create_task(reader(0, 0)), asyncio.create_task(reader(1, 0.05))]
            await asyncio.sleep(0.05)
            for _ in range(20):
                b.publish(s, "x")
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            for t in tasks:
                t.cancel()
        return counts

    counts = asyncio.run(main())
    assert sum(counts) == 20 and counts[0] > 0, counts
