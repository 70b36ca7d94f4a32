"""Overload protection: a bound on requests in flight, in total and per engine, and a short FIFO wait queue with a
deadline. Beyond the queue or the deadline a request is refused (`Overloaded`; the router answers 429 with
Retry-After), so an overloaded deployment keeps serving what it admitted at the latency of its saturation, and the
router's memory (and what its cycle collector walks) stays bounded.

What counts:
- requests: a request is in flight from its admission to its end, its retry on another pair included
  (`max_inflight`);
- per engine, legs: an attempt holds its decode engine's slot from admission to the end of its answer, and its
  prefill engine's slot until prefill answers (or the attempt ends, whichever comes first). In pull mode decode's
  slot is held while prefill runs: the request is committed to that decode (`max_per_engine`). These are the
  outstanding counts pairing reads (`EnginePool.outstanding`): pairing stays least outstanding first, among the
  pairs whose two engines both have room.

A request that cannot be admitted at once (every compatible pair has an engine at its bound, or the total is
reached) waits in a FIFO queue of at most `max_queue` requests for at most `queue_wait` seconds. A waiter is admitted
as soon as a slot frees (a leg answers, a request ends: no polling), and never after a later arrival. A retry
(its first attempt failed; it holds its request slot) waits for a pair ahead of new requests, with the same
deadline. Waiters are re-examined when anything is released and when a request arrives, so engines added to the
pool are used by the next release or arrival.

No pair at all (no engines, a role missing) is not overload: `admit` then hands out the request slot alone, and the
router waits for engines (`--pair-wait-seconds`) holding it, so those waits count toward `max_inflight` too.
"""
from __future__ import annotations

import asyncio
import enum
import math
from collections import deque
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Literal

from ..wire.advertisement import EngineAdvertisement
from .engine_pool import EnginePool
from .kv_scoring import Preference

Reason = Literal["queue_full", "deadline"]


class Overloaded(Exception):
    """The request was not admitted: the queue was full when it came (`queue_full`), or no slot freed within the
    queue's deadline (`deadline`)."""

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Legs:
    """The engine slots one attempt holds. Each slot is released once, whatever calls come after. `prefill_tokens`:
    the prompt tokens the prefill engine computes for it, when known (routed by the index); they count in
    `EnginePool.queued_tokens` while the prefill slot is held."""

    __slots__ = ("_admission", "prefill", "decode", "_prefill_held", "_decode_held", "_prefill_tokens")

    def __init__(self, admission: Admission, prefill: EngineAdvertisement, decode: EngineAdvertisement,
                 prefill_tokens: int | None = None) -> None:
        self._admission, self.prefill, self.decode = admission, prefill, decode
        pool = admission.pool
        out = pool.outstanding
        out[prefill.engine_id] = out.get(prefill.engine_id, 0) + 1
        out[decode.engine_id] = out.get(decode.engine_id, 0) + 1
        self._prefill_held = self._decode_held = True
        self._prefill_tokens = prefill_tokens
        if prefill_tokens is not None:
            legs, tokens = pool.queued_tokens.get(prefill.engine_id, (0, 0))
            pool.queued_tokens[prefill.engine_id] = (legs + 1, tokens + prefill_tokens)

    def prefill_answered(self) -> None:
        if self._prefill_held:
            self._release_prefill()
            self._admission._changed()

    def release(self) -> None:
        """Both slots, then one look at the queue: a waiter that needs the pair sees both free at once."""
        if self._prefill_held:
            self._release_prefill()
        if self._decode_held:
            self._decode_held = False
            self._admission._release_leg(self.decode.engine_id)
        self._admission._changed()

    def _release_prefill(self) -> None:
        self._prefill_held = False
        self._admission._release_leg(self.prefill.engine_id)
        if self._prefill_tokens is not None:
            queued = self._admission.pool.queued_tokens
            legs, tokens = queued[self.prefill.engine_id]
            if legs > 1:
                queued[self.prefill.engine_id] = (legs - 1, tokens - self._prefill_tokens)
            else:
                del queued[self.prefill.engine_id]


Grant = Legs | None
"""What admission hands out: an attempt's engine slots, or None when no compatible pair exists at all."""


class _Full(enum.Enum):
    FULL = "every compatible pair has an engine at its bound, or the total is reached"


@dataclass(eq=False)
class _Waiter:
    future: asyncio.Future[Grant]
    exclude: AbstractSet[str]
    holding: bool  # holds its request slot already (a retry): needs a pair only
    prefer: Preference | None
    timer: asyncio.TimerHandle | None = field(default=None)


class Admission:
    """Invariants, whatever the order of arrivals, releases, cancellations and deadlines:
    - `in_flight` <= `max_inflight`, and every engine's outstanding legs <= `max_per_engine` (None: no bound);
    - at most `max_queue` new requests wait; a new request is admitted before any later one; after any release or
      arrival, no new request waits that could be placed (only a retry's excluded engines may have room);
    - a waiter that leaves (deadline, client gone) takes nothing with it and leaves nothing behind; one cancelled
      just after it was admitted gives back what it was given;
    - with no request running or waiting, `in_flight` is 0, and `pool.outstanding` and `pool.queued_tokens` are
      empty."""

    def __init__(self, pool: EnginePool, *, max_inflight: int | None, max_per_engine: int | None, max_queue: int,
                 queue_wait: float) -> None:
        self.pool = pool
        self.max_inflight, self.max_per_engine = max_inflight, max_per_engine
        self.max_queue, self.queue_wait = max_queue, queue_wait
        self.in_flight = 0
        self._new: deque[_Waiter] = deque()
        self._retries: deque[_Waiter] = deque()
        # Plain counters, read at scrape time: nothing per request beyond an integer increment.
        self.admitted = self.queued = 0
        self.rejected: dict[Reason, int] = {"queue_full": 0, "deadline": 0}

    @property
    def waiting(self) -> int:
        return len(self._new) + len(self._retries)

    @property
    def retry_after(self) -> int:
        """Seconds a refused client should wait before it tries again (the Retry-After header): about one deadline,
        the time in which the queue turns over."""
        return max(1, math.ceil(self.queue_wait))

    async def admit(self, exclude: AbstractSet[str] = frozenset(), *, holding: bool = False,
                    prefer: Preference | None = None) -> Grant:
        """A request slot (unless `holding` one already) and a pair with room, avoiding `exclude`, chosen by
        `prefer` when given (`EnginePool.place`); at once or after waiting in the queue. None (the request slot
        alone): no compatible pair exists at all. Raises Overloaded."""
        self._changed()  # engines may have come since the queue was last examined
        # A new request still waiting now wants what this one wants, and it does not fit: no need to try.
        if not self._new or holding:
            got = self._try(exclude, holding, prefer)
            if got is not _Full.FULL:
                return got
        if not holding and len(self._new) >= self.max_queue:
            self.rejected["queue_full"] += 1
            raise Overloaded("queue_full", f"overloaded: {self.in_flight} requests in flight and {len(self._new)} "
                                           "waiting, the most this router holds; retry later")
        return await self._wait(exclude, holding, prefer)

    def leave(self) -> None:
        """A request admitted by `admit` (not `holding`) ended: its request slot."""
        self.in_flight -= 1
        self._changed()

    # -- internals ---------------------------------------------------------------------------------------------
    def _try(self, exclude: AbstractSet[str], holding: bool, prefer: Preference | None) -> Grant | _Full:
        if not holding and self.max_inflight is not None and self.in_flight >= self.max_inflight:
            return _Full.FULL
        pair, exists = self.pool.place(exclude, self.max_per_engine, prefer)
        if pair is None and exists:
            return _Full.FULL
        if not holding:
            self.in_flight += 1
            self.admitted += 1
        if pair is None:
            return None
        return Legs(self, *pair, prefill_tokens=None if prefer is None else prefer.uncached(pair[0].engine_id))

    async def _wait(self, exclude: AbstractSet[str], holding: bool, prefer: Preference | None) -> Grant:
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop.create_future(), exclude, holding, prefer)
        (self._retries if holding else self._new).append(waiter)
        if not holding:
            self.queued += 1
        waiter.timer = loop.call_later(self.queue_wait, self._expire, waiter)
        try:
            return await waiter.future
        except asyncio.CancelledError:
            self._abandon(waiter)
            raise

    def _expire(self, waiter: _Waiter) -> None:
        if waiter.future.done():
            return
        self._queue_of(waiter).remove(waiter)
        self.rejected["deadline"] += 1
        waiter.future.set_exception(Overloaded("deadline", f"overloaded: no slot freed within {self.queue_wait:g} s "
                                                           "of waiting; retry later"))

    def _abandon(self, waiter: _Waiter) -> None:
        """The waiting request is gone (its client closed): out of the queue, or, when it was admitted just before,
        its grant given back."""
        if waiter.timer is not None:
            waiter.timer.cancel()
        fut = waiter.future
        if not fut.done() or fut.cancelled():
            queue = self._queue_of(waiter)
            if waiter in queue:
                queue.remove(waiter)
            return
        if fut.exception() is not None:
            return  # refused: it held nothing
        grant = fut.result()
        if grant is not None:
            grant.release()
        if not waiter.holding:
            self.leave()

    def _queue_of(self, waiter: _Waiter) -> deque[_Waiter]:
        return self._retries if waiter.holding else self._new

    def _grant(self, waiter: _Waiter, grant: Grant) -> None:
        if waiter.timer is not None:
            waiter.timer.cancel()
        waiter.future.set_result(grant)

    def _dispatch(self) -> None:
        """Admit every waiter the state allows: retries first (each on its own: they avoid different engines), then
        new requests in arrival order, stopping at the first that does not fit (all of them want the same)."""
        for waiter in list(self._retries):
            if waiter.future.done():  # cancelled: its task has not run its clean-up yet
                self._retries.remove(waiter)
                continue
            got = self._try(waiter.exclude, True, waiter.prefer)
            if got is not _Full.FULL:
                self._retries.remove(waiter)
                self._grant(waiter, got)
        while self._new:
            if self._new[0].future.done():
                self._new.popleft()
                continue
            got = self._try(self._new[0].exclude, False, self._new[0].prefer)
            if got is _Full.FULL:
                break
            self._grant(self._new.popleft(), got)

    def _release_leg(self, engine_id: str) -> None:
        out = self.pool.outstanding
        n = out[engine_id] - 1
        if n:
            out[engine_id] = n
        else:
            del out[engine_id]  # engine ids change with every restart: keep no key for an idle one

    def _changed(self) -> None:
        if self._new or self._retries:
            self._dispatch()

    def legs_by_role(self) -> dict[str, int]:
        """Legs in flight per role, over the engines the pool knows (for /metrics)."""
        out = {"prefill": 0, "decode": 0}
        for e in self.pool.engines():
            out[e.role] = out.get(e.role, 0) + self.pool.outstanding.get(e.engine_id, 0)
        return out
