"""A bound on the reconcile passes running at once, with a fast lane for passes that may turn a CR Ready.

Invariants:
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
progress (a pod scheduled, one of two replicas ready) keep their place in arrival order, where the coalescer
folds the triggers that arrive meanwhile into one pass. Serving those first too made 3x the status writes and
slowed the creates. Other passes cannot starve: the coalescer queues at most one pass per CR, so at most one
urgent pass per CR is ever ahead of them.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Hashable


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
        """A slot for `key`'s pass. One waiter per key at a time (the coalescer runs one pass per key)."""
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
