"""Feed the router's KV index (kv_index.py) from each engine's KV event stream: a ZMQ SUB socket on the engine's
PUB endpoint and, to fill gaps, requests to its replay endpoint (connector/wire/kv_events.py has the framing).

Per engine (`EngineSubscription`), first a catch-up: once its SUB socket is connected, it asks the replay socket
for every batch from seq 0 and applies what the engine still has (`synced` once done), so the index knows what the
engine held before the router started, and a router's start-up costs it no CPU in its first requests. Then frames
from the live stream apply in order (`KvIndex.apply`; those the catch-up already applied are duplicates):
- a gap (a seq later than expected: frames dropped at a high-water mark, or a subscriber that joined late, since
  vLLM has no initial sync) asks the replay socket for every batch from the expected seq on, applies them, then
  the live batch. If the replay cannot fill it (its buffer starts past the expected seq, it answers nothing within
  `replay_timeout`, or the engine advertises no replay endpoint), the engine's index is reset and rebuilt from what
  the replay still had and the live stream: it then holds a subset of the engine's cache (kv_index.py says why).
- a live seq not above the previous live one is a restarted publisher (a PUB stream from one process only goes
  up; ZMQ reconnects a SUB to whatever binds the endpoint again): reset, expecting seq 0 again.
- a frame that does not decode is reset past: a replay would return the same bytes.
Replays are served one at a time per engine, while live frames queue in the SUB socket (up to `rcvhwm`; past it
they are dropped, which is one more gap).

`KvEventsClient` starts and stops one subscription per engine, adding it to the index and removing it (an engine
withdrawn). It does not follow the rendezvous itself: the router calls it for each engine that advertises events.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from ..wire import kv_events as wire
from .kv_index import KvIndex, Outcome

log = logging.getLogger("disagg.router.kv_events")
DEFAULT_REPLAY_TIMEOUT = 2.0
DEFAULT_RCVHWM = 10_000
"""Live frames a subscription queues while it replays or the loop is busy (ZMQ's default is 1000)."""


@dataclass
class SubscriptionCounters:
    frames: int = 0
    """Live frames received."""
    gaps_filled: int = 0
    gaps_unfilled: int = 0
    """Gaps the replay could not fill: each reset the engine's index."""
    restarts: int = 0
    bad_frames: int = 0


class EngineSubscription:
    """One engine's KV events into `index` under `engine_id`, which must be added to the index already."""

    def __init__(self, index: KvIndex, engine_id: str, endpoint: str, replay_endpoint: str | None, *,
                 ctx: zmq.asyncio.Context, topic: bytes = b"", replay_timeout: float = DEFAULT_REPLAY_TIMEOUT,
                 rcvhwm: int = DEFAULT_RCVHWM) -> None:
        self.index, self.engine_id = index, engine_id
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.replay_timeout = replay_timeout
        self.counters = SubscriptionCounters()
        self._ctx = ctx
        self._sub = ctx.socket(zmq.SUB)
        self._sub.set_hwm(rcvhwm)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic)
        self._sub.connect(endpoint)
        self._last_live: int | None = None
        self.synced = False
        """The catch-up is done: the index holds what the engine's replay buffer had when the subscription began."""
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"kv-events-{self.engine_id}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._sub.close(linger=0)

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Return once `predicate()` holds, checking it after every live frame handled (its gap filled included).
        Bound it with asyncio.timeout."""
        async with self._changed:
            await self._changed.wait_for(predicate)

    async def _run(self) -> None:
        try:
            await self._catch_up()
        except Exception:  # as for a live frame: forget what may now be wrong, and follow the live stream
            log.exception("engine %s: catching up on its KV events failed; resetting its index", self.engine_id)
            self.index.reset(self.engine_id)
        self.synced = True
        async with self._changed:
            self._changed.notify_all()
        while True:
            frames = await self._sub.recv_multipart()
            try:
                await self._on_live(frames)
            except Exception:  # a bug must not end the subscription: forget what may now be wrong and go on
                log.exception("engine %s: KV event frame failed; resetting its index", self.engine_id)
                self.index.reset(self.engine_id)
            async with self._changed:
                self._changed.notify_all()

    async def _on_live(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self.counters.bad_frames += 1
            log.warning("engine %s: ignoring a KV event message of %d frames", self.engine_id, len(frames))
            return
        _, seq_frame, payload = frames
        try:
            seq = wire.decode_seq(seq_frame)
        except ValueError:
            self.counters.bad_frames += 1
            log.warning("engine %s: ignoring a KV event message with a %d-byte seq", self.engine_id, len(seq_frame))
            return
        self.counters.frames += 1
        if self._last_live is not None and seq <= self._last_live:
            self.counters.restarts += 1
            log.info("engine %s: KV event seq went from %d to %d: the engine restarted; resetting its index",
                     self.engine_id, self._last_live, seq)
            self.index.reset(self.engine_id, expect=0)
        self._last_live = seq
        batch = self._decode(seq, payload)
        if batch is not None and self.index.apply(self.engine_id, seq, batch) is Outcome.GAP:
            await self._fill(seq, batch)

    async def _catch_up(self) -> None:
        """Apply what the replay still has from the seq the index expects (0 for an engine just added). If its buffer
        no longer starts there, the engine's index is reset first and holds a subset (kv_index.py)."""
        start = self.index.expected_seq(self.engine_id)
        if start is None:
            return
        first = True
        async with contextlib.aclosing(self._replay(start)) as replay:
            async for seq, payload in replay:
                if first and seq != start:
                    self.index.reset(self.engine_id)
                first = False
                batch = self._decode(seq, payload)
                if batch is not None:
                    self._apply_or_reset(seq, batch)

    def _decode(self, seq: int, payload: bytes) -> wire.KVEventBatch | None:
        """The batch, or None after resetting past it when it does not decode."""
        try:
            return wire.decode_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.counters.bad_frames += 1
            log.warning("engine %s: KV event batch %d does not decode (%s); resetting its index", self.engine_id,
                        seq, e)
            self.index.reset(self.engine_id, expect=seq + 1)
            return None

    async def _fill(self, seq: int, batch: wire.KVEventBatch) -> None:
        """Replay from the expected seq to `seq`, then apply the live batch itself; reset if that leaves a hole."""
        start = self.index.expected_seq(self.engine_id)
        assert start is not None  # a gap has an expected seq
        filled: bool | None = None
        # aclosing: a stop mid-replay closes its socket at once (a context ends only once its sockets are closed).
        async with contextlib.aclosing(self._replay(start)) as replay:
            async for replayed_seq, payload in replay:
                if filled is None:
                    filled = replayed_seq == start
                    if not filled:
                        self.index.reset(self.engine_id)
                replayed = self._decode(replayed_seq, payload)
                if replayed is not None:
                    filled = self._apply_or_reset(replayed_seq, replayed) and filled
        filled = self._apply_or_reset(seq, batch) and bool(filled)
        if filled:
            self.counters.gaps_filled += 1
        else:
            self.counters.gaps_unfilled += 1
            log.info("engine %s: the replay could not fill KV events %d to %d; its index restarts from seq %s",
                     self.engine_id, start, seq - 1, self.index.expected_seq(self.engine_id))

    def _apply_or_reset(self, seq: int, batch: wire.KVEventBatch) -> bool:
        """Apply a batch; if a gap remains before it, reset and apply it anyway. False if it reset."""
        if self.index.apply(self.engine_id, seq, batch) is not Outcome.GAP:
            return True
        self.index.reset(self.engine_id)
        self.index.apply(self.engine_id, seq, batch)
        return False

    async def _replay(self, start: int) -> AsyncGenerator[tuple[int, bytes], None]:
        """(seq, payload) of each batch the replay socket still has from `start` on, until its end marker; nothing
        more once it is silent for `replay_timeout`, or without a replay endpoint."""
        if not self.replay_endpoint:
            return
        sock = self._ctx.socket(zmq.DEALER)
        try:
            sock.connect(self.replay_endpoint)
            await sock.send_multipart((b"", wire.encode_seq(start)))
            while True:
                if not await sock.poll(int(self.replay_timeout * 1000)):
                    log.warning("engine %s: its replay socket %s was silent for %.1fs", self.engine_id,
                                self.replay_endpoint, self.replay_timeout)
                    return
                frames = await sock.recv_multipart()
                if len(frames) != 4:
                    continue
                seq = wire.decode_seq(frames[2])
                if seq < 0:
                    return
                yield seq, frames[3]
        finally:
            sock.close(linger=0)


class KvEventsClient:
    """One `EngineSubscription` per engine, all into one index."""

    def __init__(self, index: KvIndex, *, ctx: zmq.asyncio.Context | None = None, topic: bytes = b"",
                 replay_timeout: float = DEFAULT_REPLAY_TIMEOUT) -> None:
        self.index, self.topic, self.replay_timeout = index, topic, replay_timeout
        self._own_ctx = ctx is None
        self._ctx = zmq.asyncio.Context() if ctx is None else ctx
        self.subscriptions: dict[str, EngineSubscription] = {}

    def start(self, engine_id: str, endpoint: str, replay_endpoint: str | None) -> EngineSubscription | None:
        """Subscribe to an engine's events (the same subscription if it has one); None when the index refuses
        another engine."""
        if engine_id in self.subscriptions:
            return self.subscriptions[engine_id]
        if not self.index.add_engine(engine_id):
            log.warning("KV index full (%d engines): engine %s is not indexed", self.index.max_engines, engine_id)
            return None
        sub = EngineSubscription(self.index, engine_id, endpoint, replay_endpoint, ctx=self._ctx, topic=self.topic,
                                 replay_timeout=self.replay_timeout)
        sub.start()
        self.subscriptions[engine_id] = sub
        return sub

    async def stop(self, engine_id: str) -> None:
        """Unsubscribe and forget what the engine held (withdrawn, or restarted under a new id)."""
        sub = self.subscriptions.pop(engine_id, None)
        if sub is not None:
            await sub.stop()
        self.index.remove_engine(engine_id)

    async def close(self) -> None:
        for engine_id in list(self.subscriptions):
            await self.stop(engine_id)
        if self._own_ctx:
            self._ctx.term()
