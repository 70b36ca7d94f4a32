"""Keep the router's KV event subscriptions (kv_events_client.py) in step with the engines it may route to.

With `--policy prefix-aware`, every engine the pool may route to (`EnginePool.engines`: the rendezvous cache or the
static engines file, in the router's KV mode) that advertises `kv_events_endpoints` has one subscription feeding
the router's `KvIndex`. Each round (`KvFollower.sync`, every `interval` seconds):
- `streams` reads what the source advertises now, and `diff` compares it with what is subscribed (both pure);
- the follower acts on the difference: a withdrawn engine is unsubscribed and its blocks dropped from the index; a
  new one is added and subscribed; one re-advertised under the same id with other endpoints (or another role) is
  unsubscribed, dropped, then subscribed again from nothing (its blocks came from a stream that is gone).

Invariants after a round: the subscribed streams are exactly the advertised ones, less those past the index's bound
(`unindexed`: the first `max_engines` keys in sorted order are indexed, the rest wait for a slot and are retried
each round); the index holds no engine that is not subscribed. An engine restarted under the same id and endpoints
is the subscription's to notice (its seq goes back: kv_events_client.py resets it).

Data-parallel ranks: each rank has a cache and an event stream of its own, so each is an index entry of its own,
under the engine id when the engine has one rank and `<engine id>/dp<rank>` when it has several ("/" is never in
an engine id).
"""
from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields

from ..wire.advertisement import EngineAdvertisement
from .kv_events_client import DEFAULT_REPLAY_TIMEOUT, EngineSubscription, KvEventsClient, SubscriptionCounters
from .kv_index import KvIndex

log = logging.getLogger("disagg.router.kv_follow")
DEFAULT_INTERVAL = 1.0
"""Seconds between rounds: the engine probes' pace, so an engine is indexed within a second of being routable."""


@dataclass(frozen=True, order=True)
class Stream:
    """One event stream to subscribe to: an engine's, or one data-parallel rank's."""

    engine_id: str
    role: str
    endpoint: str
    replay_endpoint: str | None


def stream_key(engine_id: str, rank: int, ranks: int) -> str:
    """The index key of one rank's stream (the module docstring says why per rank)."""
    return engine_id if ranks == 1 else f"{engine_id}/dp{rank}"


def streams(engines: Iterable[EngineAdvertisement]) -> dict[str, Stream]:
    """Index key to stream, for every rank of every engine that advertises KV event endpoints."""
    out: dict[str, Stream] = {}
    for e in engines:
        if not e.kv_events_endpoints:
            continue
        replays = e.kv_events_replay_endpoints or []
        n = len(e.kv_events_endpoints)
        for rank, endpoint in enumerate(e.kv_events_endpoints):
            out[stream_key(e.engine_id, rank, n)] = Stream(e.engine_id, e.role, endpoint,
                                                           replays[rank] if rank < len(replays) else None)
    return out


@dataclass(frozen=True)
class Changes:
    stop: tuple[str, ...]
    """Keys to unsubscribe and drop from the index, first: withdrawn, or advertised otherwise now."""
    start: tuple[tuple[str, Stream], ...]
    """Then keys to add and subscribe: new, or advertised otherwise now. Both sorted by key."""

    def __bool__(self) -> bool:
        return bool(self.stop or self.start)


def diff(advertised: Mapping[str, Stream], subscribed: Mapping[str, Stream]) -> Changes:
    """What turns `subscribed` into `advertised`: a key subscribed to another stream than the one advertised under
    it is in both lists (stopped, then started again)."""
    return Changes(stop=tuple(sorted(k for k, s in subscribed.items() if advertised.get(k) != s)),
                   start=tuple(sorted((k, s) for k, s in advertised.items() if subscribed.get(k) != s)))


def _add(total: SubscriptionCounters, more: SubscriptionCounters) -> None:
    for f in fields(SubscriptionCounters):
        setattr(total, f.name, getattr(total, f.name) + getattr(more, f.name))


class KvFollower:
    """The subscriptions of one router: `run` follows `source` until cancelled; `close` ends every subscription."""

    def __init__(self, source: Callable[[], Iterable[EngineAdvertisement]], index: KvIndex, *,
                 interval: float = DEFAULT_INTERVAL, replay_timeout: float = DEFAULT_REPLAY_TIMEOUT) -> None:
        self.source, self.index, self.interval = source, index, interval
        self.subscribed: dict[str, Stream] = {}
        self.unindexed: set[str] = set()
        """Keys advertised but not indexed: the index was at max_engines when their turn came."""
        self.started = self.stopped = 0
        self._retired = SubscriptionCounters()  # of subscriptions stopped, so totals never go back
        self._replay_timeout = replay_timeout
        self._client: KvEventsClient | None = None
        self._round = asyncio.Lock()  # rounds never interleave: each acts on the subscriptions the last one left

    @property
    def client(self) -> KvEventsClient:
        """Made on first use, in the running loop (its ZMQ sockets are that loop's)."""
        if self._client is None:
            self._client = KvEventsClient(self.index, replay_timeout=self._replay_timeout)
        return self._client

    async def run(self) -> None:
        while True:
            try:
                await self.sync()
            except Exception:  # a bug in one round must not stop following for good
                log.exception("KV event subscriptions: a round failed")
            await asyncio.sleep(self.interval)

    async def sync(self) -> Changes:
        """One round: subscribe to what is advertised now, and to nothing else."""
        async with self._round:
            return await self._sync()

    async def _sync(self) -> Changes:
        advertised = streams(self.source())
        changes = diff(advertised, self.subscribed)
        for key in changes.stop:
            await self._stop(key)
        unindexed = set()
        for key, stream in changes.start:
            if len(self.subscribed) >= self.index.max_engines or self.client.start(
                    key, stream.endpoint, stream.replay_endpoint) is None:
                if key not in self.unindexed:
                    log.warning("KV index full (%d engines): %s %s is not indexed", self.index.max_engines,
                                stream.role, key)
                unindexed.add(key)
                continue
            self.subscribed[key] = stream
            self.started += 1
            log.info("KV events of %s %s: subscribed to %s (replay %s)", stream.role, key, stream.endpoint,
                     stream.replay_endpoint or "none")
        self.unindexed = unindexed
        return changes

    async def _stop(self, key: str) -> None:
        stream = self.subscribed.pop(key)
        sub = self.client.subscriptions.get(key)
        if sub is not None:
            _add(self._retired, sub.counters)
        await self.client.stop(key)
        self.stopped += 1
        log.info("KV events of %s %s: unsubscribed from %s; its blocks are dropped", stream.role, key,
                 stream.endpoint)

    async def close(self) -> None:
        async with self._round:
            for key in list(self.subscribed):
                await self._stop(key)
        if self._client is not None:
            await self._client.close()

    # -- what the metrics read ----------------------------------------------------------------------------------
    def subscription(self, key: str) -> EngineSubscription | None:
        return None if self._client is None else self._client.subscriptions.get(key)

    def counters(self) -> SubscriptionCounters:
        """Summed over every subscription this follower ever had, stopped ones included."""
        total = SubscriptionCounters()
        _add(total, self._retired)
        for key in self.subscribed:
            sub = self.subscription(key)
            if sub is not None:
                _add(total, sub.counters)
        return total

    def catching_up(self) -> int:
        """Subscriptions whose catch-up on what their engine published before (kv_events_client.py) is not done."""
        return sum(1 for key in self.subscribed if (sub := self.subscription(key)) is not None and not sub.synced)

    def by_role(self) -> tuple[Counter[str], Counter[str]]:
        """(streams subscribed, blocks held) per engine role."""
        engines: Counter[str] = Counter()
        blocks: Counter[str] = Counter()
        for key, stream in self.subscribed.items():
            engines[stream.role] += 1
            blocks[stream.role] += self.index.blocks_held(key)
        return engines, blocks
