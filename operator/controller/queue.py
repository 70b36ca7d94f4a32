"""The operator's one work queue: which CR's reconcile pass runs next, and when a refused one runs again.

Invariants:
- at most one pass per CR runs or waits at a time. A trigger for a CR whose pass waits for a slot joins that
  pass (it has read nothing yet); triggers that arrive while it runs collapse into one more pass. Either way at
  the strongest level asked for: full if any trigger wanted one, else a status pass; urgent if any trigger was;
- at most `limit` passes run at once over all CRs (Slots below); the rest wait their turn, urgent ones first;
- a pass that asks to be retried (its writes were refused) runs again, full, after the delay it gives, unless a
  full pass of the CR starts first (it supersedes the retry) or the CR is forgotten; at most one retry per CR is
  pending;
- a pass that raises is logged and counted; it never stops the queue.

The bound is what keeps a burst of CRs converging: unbounded, a thousand concurrent passes flood the apiserver
and their requests time out.

The slots (Slots):
- at most `limit` holders at a time;
- a freed slot goes to the longest-waiting urgent pass if any waits, else to the longest-waiting other pass (in
  arrival order, full and status passes alike), else back to the pool; a newcomer never takes a slot while
  anyone waits (no barging);
- a waiter can be promoted to the urgent lane while it waits (`promote`), keeping its place among the urgent;
- a waiter cancelled after being handed a slot gives it on, so no slot is ever lost;
- `drained()` returns once no pass waits for a slot (at once when none does).

Why a fast lane: in a burst of creates, each full pass makes a dozen applies. A status pass that finds a CR's
children all ready, and turns it Ready, is one status write; behind the creates in arrival order, every CR
turns Ready only once the last create is applied. Only such passes are urgent: status passes for intermediate
progress (a pod scheduled, one of two replicas ready) keep their place in arrival order, where the queue
folds the triggers that arrive meanwhile into one pass. Serving those first too made 3x the status writes and
slowed the creates. Other passes cannot starve: the queue holds at most one pass per CR, so at most one
urgent pass per CR is ever ahead of them.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from dataclasses import dataclass

from ..names import Key

log = logging.getLogger("disagg.operator.queue")


class Slots:
    def __init__(self, limit: int | None) -> None:
        """`limit` None: unbounded."""
        if limit is not None and limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        self._free = limit
        self._urgent: deque[Hashable] = deque()
        self._other: deque[Hashable] = deque()
        self._waiters: dict[Hashable, asyncio.Future[None]] = {}
        self._empty = asyncio.Event()
        self._empty.set()

    def waiting(self) -> tuple[int, int]:
        """(urgent passes, other passes) waiting for a slot."""
        return len(self._urgent), len(self._other)

    async def drained(self) -> None:
        """Return once no pass waits for a slot: the backlog of a burst has been served."""
        await self._empty.wait()

    def promote(self, key: Hashable) -> None:
        """Move `key`'s waiting pass, if it waits in the other lane, to the end of the urgent lane."""
        if key in self._waiters and key in self._other:
            self._other.remove(key)
            self._urgent.append(key)

    @contextlib.asynccontextmanager
    async def take(self, key: Hashable, *, urgent: bool) -> AsyncIterator[None]:
        """A slot for `key`'s pass. One waiter per key at a time (the queue runs one pass per key)."""
        if self._free is None:
            yield
            return
        if self._free > 0 and not self._urgent and not self._other:
            self._free -= 1
        else:
            if key in self._waiters:
                raise RuntimeError(f"{key!r} already waits for a slot")
            handed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters[key] = handed
            (self._urgent if urgent else self._other).append(key)
            self._empty.clear()
            try:
                await handed
            except asyncio.CancelledError:
                if handed.done() and not handed.cancelled():
                    self._release()  # handed a slot, then cancelled before using it: pass it on
                else:
                    self._forget(key)
                raise
        try:
            yield
        finally:
            self._release()

    def _forget(self, key: Hashable) -> None:
        self._waiters.pop(key, None)
        for lane in (self._urgent, self._other):
            if key in lane:
                lane.remove(key)
        self._note_empty()

    def _release(self) -> None:
        for lane in (self._urgent, self._other):
            if lane:
                key = lane.popleft()
                self._waiters.pop(key).set_result(None)  # the slot passes straight to this waiter
                self._note_empty()
                return
        assert self._free is not None
        self._free += 1

    def _note_empty(self) -> None:
        if not self._urgent and not self._other:
            self._empty.set()


@dataclass(frozen=True)
class Work:
    """One pass to run: `trigger` names what asked for it ("coalesced" for a pass that triggers arriving during
    the one before asked for)."""

    full: bool
    trigger: str


PassFn = Callable[[Key, Work], Awaitable["float | None"]]
"""Runs one pass of a CR; returns the seconds after which to retry it (its writes were refused), or None."""


class WorkQueue:
    def __init__(self, run_pass: PassFn, limit: int | None = None) -> None:
        self._run_pass = run_pass
        self.slots = Slots(limit)
        self._workers: dict[Key, asyncio.Task[None]] = {}  # a pass waiting for a slot, or running
        self._waiting: dict[Key, Work] = {}  # CRs whose pass waits for a slot: what it is to be
        self._again: dict[Key, Work] = {}  # CRs triggered while their pass runs: the pass after it
        self._urgent: dict[Key, bool] = {}  # whether the waiting or next pass is urgent
        self._retries: dict[Key, asyncio.TimerHandle] = {}

    def add(self, key: Key, *, full: bool, trigger: str, urgent: bool = False) -> None:
        """Queue a pass of `key`, or fold this trigger into the one already queued."""
        if key in self._waiting:
            self._waiting[key] = Work(self._waiting[key].full or full, self._waiting[key].trigger)
            if key in self._urgent:  # its worker has not asked for a slot yet
                self._urgent[key] = self._urgent[key] or urgent
            elif urgent:
                self.slots.promote(key)
            return
        if key in self._workers:
            again = self._again.get(key)
            self._again[key] = Work((again is not None and again.full) or full, "coalesced")
            self._urgent[key] = self._urgent.get(key, False) or urgent
            return
        self._waiting[key] = Work(full, trigger)
        self._urgent[key] = urgent
        task = asyncio.get_running_loop().create_task(self._work(key))
        self._workers[key] = task

    async def run(self, key: Key, *, full: bool, trigger: str, urgent: bool = False) -> None:
        """`add`, then wait until `key` has no pass queued or running: the pass this trigger asked for is done."""
        self.add(key, full=full, trigger=trigger, urgent=urgent)
        worker = self._workers.get(key)
        if worker is not None:
            await asyncio.shield(worker)

    def retry_later(self, key: Key, delay: float) -> None:
        self.cancel_retry(key)
        self._retries[key] = asyncio.get_running_loop().call_later(delay, self._retry, key)

    def cancel_retry(self, key: Key) -> None:
        timer = self._retries.pop(key, None)
        if timer is not None:
            timer.cancel()

    def pending_retries(self) -> set[Key]:
        return set(self._retries)

    async def close(self) -> None:
        for key in list(self._retries):
            self.cancel_retry(key)
        workers = list(self._workers.values())
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)

    def _retry(self, key: Key) -> None:
        self._retries.pop(key, None)
        self.add(key, full=True, trigger="retry")

    async def _work(self, key: Key) -> None:
        try:
            while True:
                async with self.slots.take(key, urgent=self._urgent.pop(key, False)):
                    work = self._waiting.pop(key)
                    if work.full:
                        self.cancel_retry(key)  # this pass applies everything a pending retry would
                    try:
                        delay = await self._run_pass(key, work)
                    except Exception:
                        log.exception("pass of %s/%s (%s) failed", *key, work.trigger)
                        delay = None
                    if delay is not None:
                        self.retry_later(key, delay)
                again = self._again.pop(key, None)
                if again is None:
                    return
                self._waiting[key] = again
        finally:
            self._workers.pop(key, None)
            self._waiting.pop(key, None)
            self._again.pop(key, None)
            self._urgent.pop(key, None)
