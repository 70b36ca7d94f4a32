"""The router's KV event subscriptions (connector/router/kv_events_client.py) against the engine emulator's own
publisher and replay socket (connector/emulator/kv_events.py), in process, over real ZMQ on 127.0.0.1.

Frames are lost on a `LossyLink`: a real ZMQ hop (SUB to the emulator's PUB, XPUB to the router) that forwards
what it is told to and drops the rest, as a high-water mark or a late subscription would. Every wait is on a
condition (a frame through the link, a subscription arriving, a seq applied), bounded by a timeout."""
from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio

from disagg.connector.emulator import prefix_cache as pc
from disagg.connector.emulator.kv_events import KvEventPublisher
from disagg.connector.router.kv_events_client import EngineSubscription, KvEventsClient
from disagg.connector.router.kv_index import KvIndex
from disagg.connector.wire import kv_events as wire

BS = 4
WAIT = 10.0
LOCAL = "tcp://127.0.0.1:*"


def prompt(*blocks: int) -> list[int]:
    return [b * 10 + i for b in blocks for i in range(BS)]


def stored(*blocks: int) -> list[pc.Event]:
    """One step of the emulated engine storing a prompt of these blocks."""
    tokens = prompt(*blocks)
    return [pc.Stored(tuple(pc.chain_hashes(tokens, BS)), None, tuple(tokens), BS)]


PROBE = 999


def endpoint(sock: zmq.asyncio.Socket) -> str:
    return sock.getsockopt(zmq.LAST_ENDPOINT).decode()


class LossyLink:
    """A ZMQ hop from a publisher to the router that forwards seqs from `forward_from` on, except those in `drop`."""

    def __init__(self, ctx: zmq.asyncio.Context, upstream: str) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(upstream)
        self.xpub = ctx.socket(zmq.XPUB)
        self.xpub.bind(LOCAL)
        self.endpoint = endpoint(self.xpub)
        self.forward_from: float = math.inf
        self.drop: set[int] = set()
        self.received = 0
        self.changed = asyncio.Condition()
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            frames = await self.sub.recv_multipart()
            seq = wire.decode_seq(frames[1])
            if seq >= self.forward_from and seq not in self.drop:
                await self.xpub.send_multipart(frames)
            self.received += 1
            async with self.changed:
                self.changed.notify_all()

    async def join(self, publisher: KvEventPublisher) -> None:
        """Publish probes until one comes through: a SUB's subscription reaches a PUB when it does, unannounced."""
        while True:
            before = self.received
            publisher.publish(stored(PROBE))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.2), self.changed:
                    await self.changed.wait_for(lambda before=before: self.received > before)
                return

    async def subscriber_joined(self) -> None:
        """An XPUB hears each subscription: past this, what the link forwards reaches the router."""
        async with asyncio.timeout(WAIT):
            assert await self.xpub.recv() == b"\x01"

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.sub.close(linger=0)
        self.xpub.close(linger=0)


@contextlib.asynccontextmanager
async def bed(buffer_steps: int = 10_000, replay: bool = True
              ) -> AsyncIterator[tuple[KvEventPublisher, LossyLink, KvIndex, EngineSubscription]]:
    """An emulator publisher, a lossy link joined to it, and the router's subscription of engine "e" through it;
    the link forwards from the next seq published."""
    publisher = KvEventPublisher(LOCAL, LOCAL, buffer_steps=buffer_steps)
    publisher.start()
    ctx = zmq.asyncio.Context()
    link = LossyLink(ctx, endpoint(publisher.pub))
    index = KvIndex()
    client = KvEventsClient(index)
    try:
        await link.join(publisher)
        replay_endpoint = endpoint(publisher.replay) if replay and publisher.replay is not None else None
        sub = client.start("e", link.endpoint, replay_endpoint)
        assert sub is not None
        await link.subscriber_joined()
        async with asyncio.timeout(WAIT):
            await sub.wait_for(lambda: sub.synced)
        yield publisher, link, index, sub
    finally:
        await client.close()
        await link.close()
        ctx.term()
        await publisher.close()


async def applied_through(sub: EngineSubscription, seq: int) -> None:
    async with asyncio.timeout(WAIT):
        await sub.wait_for(lambda: sub.index.expected_seq(sub.engine_id) == seq + 1)


def matched(index: KvIndex, *blocks: int) -> int:
    return index.matched_tokens("e", prompt(*blocks)) // BS


async def test_what_the_engine_published_before_the_subscription_is_known_before_its_next_event():
    async with bed() as (publisher, link, index, sub):
        probes = publisher.seq  # all published before the subscription began, none forwarded to it
        assert matched(index, PROBE) == 1 and index.expected_seq("e") == probes
        assert sub.counters.frames == 0 and index.counters.gaps == 0 and index.counters.resets == 0
        link.forward_from = probes
        publisher.publish(stored(1, 2))
        await applied_through(sub, probes)
        assert matched(index, 1, 2) == 2 and index.counters.gaps == 0


async def test_dropped_frames_are_filled_from_the_replay():
    async with bed() as (publisher, link, index, sub):
        probes = publisher.seq
        link.forward_from = probes
        link.drop = {probes, probes + 1}
        publisher.publish(stored(1, 2, 3))
        publisher.publish(stored(5))
        publisher.publish(stored(6))  # the only one of three that arrives
        await applied_through(sub, probes + 2)
        assert [matched(index, 1, 2, 3), matched(index, 5), matched(index, 6)] == [3, 1, 1]
        assert (sub.counters.gaps_filled, sub.counters.gaps_unfilled, index.counters.resets) == (1, 0, 0)
        assert sub.counters.frames == 1 and index.counters.batches_applied == probes + 3


async def test_a_gap_the_replay_no_longer_holds_resets_the_engine_and_keeps_what_the_replay_had():
    async with bed(buffer_steps=3) as (publisher, link, index, sub):
        old, resets = publisher.seq, index.counters.resets  # a catch-up past 3 probes has reset once already
        for blocks in ((1,), (2,), (3,), (4,)):  # seqs old..old+3: the buffer of 3 keeps the last three
            publisher.publish(stored(*blocks))
        link.forward_from = old + 4
        publisher.publish(stored(5))
        await applied_through(sub, old + 4)
        assert [matched(index, b) for b in (PROBE, 1, 2, 3, 4, 5)] == [0, 0, 0, 1, 1, 1]
        assert (sub.counters.gaps_unfilled, index.counters.resets - resets) == (1, 1)

        link.drop = set(range(old + 5, old + 9))
        for blocks in ((6,), (7,), (8,), (9,), (10,)):  # seqs old+5..old+9: only the last arrives
            publisher.publish(stored(*blocks))
        await applied_through(sub, old + 9)
        assert [matched(index, b) for b in (3, 4, 5, 6, 7, 8, 9, 10)] == [0, 0, 0, 0, 0, 1, 1, 1]
        assert (sub.counters.gaps_filled, sub.counters.gaps_unfilled, index.counters.resets - resets) == (0, 2, 2)


async def test_without_a_replay_endpoint_a_gap_resets_and_the_live_stream_goes_on():
    async with bed(replay=False) as (publisher, link, index, sub):
        first = publisher.seq
        link.forward_from = first
        publisher.publish(stored(1))
        await applied_through(sub, first)
        assert (matched(index, PROBE), matched(index, 1)) == (0, 1)
        assert (sub.counters.gaps_unfilled, index.counters.resets) == (1, 1)


async def test_a_restarted_publisher_resets_the_engine_and_is_replayed_from_seq_0():
    async with bed() as (publisher, link, index, sub):
        link.forward_from = publisher.seq
        for b in range(100):  # a long first life, so the restarted engine's first seqs are far below its last
            publisher.publish(stored(1000 + b))
        last = publisher.seq - 1
        await applied_through(sub, last)
        assert matched(index, 1000) == 1

        pub_endpoint, replay_endpoint = endpoint(publisher.pub), endpoint(publisher.replay)
        link.forward_from = math.inf
        await publisher.close()
        restarted = KvEventPublisher(pub_endpoint, replay_endpoint)  # the same endpoints, counting from 0
        restarted.start()
        try:
            await link.join(restarted)  # the link's SUB reconnects by itself
            first = restarted.seq
            assert first <= last, "the restarted publisher's probes overtook the first life's seqs"
            link.forward_from = first
            restarted.publish(stored(7, 8))
            await applied_through(sub, first)
            assert sub.counters.restarts == 1 and index.counters.resets == 1
            assert (matched(index, 1000), matched(index, 7, 8), matched(index, PROBE)) == (0, 2, 1)
        finally:
            await restarted.close()  # the first life's publisher is closed again by the bed: a no-op


async def test_stopping_an_engine_forgets_it_and_the_index_bound_refuses_more_engines():
    index = KvIndex(max_engines=1)
    client = KvEventsClient(index)
    try:
        first = client.start("a", "tcp://127.0.0.1:9", None)
        assert first is not None and client.start("a", "tcp://127.0.0.1:9", None) is first
        assert client.start("b", "tcp://127.0.0.1:9", None) is None and index.counters.engines_refused == 1
        await client.stop("a")
        assert "a" not in index and not client.subscriptions
        assert client.start("b", "tcp://127.0.0.1:9", None) is not None
    finally:
        await client.close()
