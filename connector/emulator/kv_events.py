"""Publish the emulated prefix cache's KV events as vLLM's ZmqEventPublisher does.

- PUB socket: one multipart message per engine step that changed the cache: `(topic, seq, payload)`, seq an
  8-byte big-endian counter from 0, payload a msgpack `KVEventBatch` (the framing and structs are
  connector/wire/kv_events.py, which the router decodes with);
- ROUTER socket (replay): a client sends `(b"", start_seq)` as 8 bytes big-endian; it gets `(b"", topic, seq,
  payload)` for every buffered batch from `start_seq` on, then `wire.REPLAY_END`. Only the last `buffer_steps`
  batches are kept, and a subscriber has no initial sync: exactly vLLM's limits.

PUB never blocks: with no subscriber, or one past its high-water mark, messages are dropped, as in vLLM.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque

import zmq
import zmq.asyncio

from ..wire import kv_events as wire
from . import kv_event_wire
from . import prefix_cache as pc

log = logging.getLogger("disagg.emulator.kv_events")


class KvEventPublisher:
    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: str = "", buffer_steps: int = 10_000,
                 hwm: int = 100_000) -> None:
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.set_hwm(hwm)
        self.pub.bind(endpoint)
        self.replay: zmq.asyncio.Socket | None = None
        if replay_endpoint:
            self.replay = self.ctx.socket(zmq.ROUTER)
            self.replay.bind(replay_endpoint)
        self.topic = topic.encode()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0
        self.published = 0
        self._task: asyncio.Task[None] | None = None

    @property
    def port(self) -> int:
        """The port the PUB socket is bound to (the one asked for, or the one picked for `tcp://...:*`)."""
        return _bound_port(self.pub)

    @property
    def replay_port(self) -> int | None:
        """The replay socket's bound port; None without one."""
        return None if self.replay is None else _bound_port(self.replay)

    def start(self) -> None:
        if self.replay is not None:
            self._task = asyncio.create_task(self._serve_replay(), name="kv-event-replay")

    def publish(self, events: list[pc.Event]) -> None:
        if not events:
            return
        payload = kv_event_wire.encode_batch(events)
        seq = self.seq
        self.seq += 1
        with contextlib.suppress(zmq.Again):
            self.pub.send_multipart((self.topic, wire.encode_seq(seq), payload), flags=zmq.NOBLOCK)
        self.buffer.append((seq, payload))
        self.published += len(events)

    async def _serve_replay(self) -> None:
        assert self.replay is not None
        while True:
            frames = await self.replay.recv_multipart()
            if len(frames) != 3:
                log.warning("ignoring a replay request of %d frames (want identity, empty, start seq)", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self.buffer):
                if seq >= first:
                    await self.replay.send_multipart((client, b"", self.topic, wire.encode_seq(seq), payload))
            await self.replay.send_multipart((client, *wire.REPLAY_END))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.pub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)
        self.ctx.term()


def _bound_port(socket: zmq.asyncio.Socket) -> int:
    endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT)  # e.g. tcp://0.0.0.0:5557, tcp://[::]:5557
    return int(endpoint.rsplit(":", 1)[1])
