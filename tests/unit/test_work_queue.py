"""The operator's one work queue (controller/queue.py): one pass per CR at a time at the strongest level asked for,
a bound on passes at once with urgent passes first, and retries of refused passes."""
from __future__ import annotations

import asyncio

import pytest

from disagg.operator.builders import OperatorImages
from disagg.operator.controller.queue import Work, WorkQueue
from disagg.operator.reconciler import Reconciler
from support.slots import until_waiting


class Passes:
    """The queue's pass function, scripted: records (CR name, full, trigger) of every pass; a pass of a name in
    `hold` waits for `release` (once); `retry` gives a pass's retry delay by name, `fail` names passes that raise."""

    def __init__(self, hold: tuple[str, ...] = (), retry: dict[str, float] | None = None,
                 fail: tuple[str, ...] = ()) -> None:
        self.runs: list[tuple[str, bool, str]] = []
        self.hold, self.retry, self.fail = set(hold), dict(retry or {}), set(fail)
        self.holding, self.release = asyncio.Event(), asyncio.Event()
        self.done: dict[str, asyncio.Event] = {}
        self.running = self.peak = 0

    def ran(self, name: str) -> asyncio.Event:
        return self.done.setdefault(name, asyncio.Event())

    async def __call__(self, key: tuple[str, str], work: Work) -> float | None:
        name = key[1]
        self.runs.append((name, work.full, work.trigger))
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            if name in self.hold:
                self.hold.discard(name)
                self.holding.set()
                await self.release.wait()
            if name in self.fail:
                self.fail.discard(name)
                raise RuntimeError("the apiserver went away")
            return self.retry.pop(name, None)
        finally:
            self.running -= 1
            self.ran(name).set()


def key(name: str) -> tuple[str, str]:
    return ("ns", name)


def test_triggers_during_a_pass_make_one_more_pass_at_the_strongest_level():
    async def scenario():
        passes = Passes(hold=("a",))
        q = WorkQueue(passes)
        q.add(key("a"), full=False, trigger="pod-event")
        await passes.holding.wait()
        for full in (False, True, False):
            q.add(key("a"), full=full, trigger="child-event")
        passes.release.set()
        await q.run(key("a"), full=False, trigger="pod-event")
        return passes.runs

    assert asyncio.run(scenario()) == [("a", False, "pod-event"), ("a", True, "coalesced")]


def test_a_resync_that_joins_another_pass_still_gets_its_children_verified():
    """As the resync loop does: it asks the reconciler for a thorough pass, then queues one; whichever pass of the
    CR runs next takes the request, once."""
    async def scenario():
        r = Reconciler(None, OperatorImages())  # type: ignore[arg-type]
        k, runs, gate, started = key("a"), [], asyncio.Event(), asyncio.Event()

        async def one(_key, work: Work) -> None:
            thorough = r.take_verify(k)
            runs.append("thorough" if thorough else "full" if work.full else "status")
            started.set()
            if len(runs) == 1:
                await gate.wait()

        q = WorkQueue(one)
        q.add(k, full=False, trigger="pod-event")  # a status pass, running
        await started.wait()
        r.verify_next(k)
        resync = asyncio.create_task(q.run(k, full=True, trigger="resync"))  # queued behind it
        gate.set()
        await resync
        await q.run(k, full=True, trigger="update")  # a later change: full, not thorough
        r.verify_next(k)
        r.forget(k)  # the CR was deleted: nothing is left to verify
        return runs, r.take_verify(k)

    assert asyncio.run(scenario()) == (["status", "thorough", "full"], False)


def test_the_queue_bounds_the_passes_running_at_once():
    async def scenario():
        passes = Passes(hold=tuple(f"cr{i}" for i in range(5)))
        q = WorkQueue(passes, limit=2)
        for i in range(5):
            q.add(key(f"cr{i}"), full=True, trigger="create")
        await until_waiting(q.slots, (0, 3))
        running_while_full = passes.running
        passes.release.set()
        await asyncio.gather(*(q.run(key(f"cr{i}"), full=False, trigger="pod-event") for i in range(5)))
        return passes.peak, running_while_full, passes.running

    assert asyncio.run(scenario()) == (2, 2, 0)


def test_an_urgent_trigger_moves_a_waiting_pass_ahead_and_the_next_pass_keeps_its_urgency():
    async def scenario():
        passes = Passes(hold=("holder",))
        q = WorkQueue(passes, limit=1)
        q.add(key("holder"), full=True, trigger="create")
        await passes.holding.wait()
        for name in ("a", "b"):
            q.add(key(name), full=True, trigger="create")
        await until_waiting(q.slots, (0, 2))
        q.add(key("b"), full=False, trigger="pod-event", urgent=True)  # b's pods are ready: its waiting pass first
        q.add(key("holder"), full=False, trigger="pod-event", urgent=True)  # during holder's pass: its next is urgent
        promoted = q.slots.waiting()
        passes.release.set()
        for name in ("holder", "a", "b"):
            await q.run(key(name), full=False, trigger="pod-event")
        return promoted, passes.runs

    promoted, runs = asyncio.run(scenario())
    assert promoted == (1, 1)
    # b's status trigger joined its waiting full pass (no second pass); holder's, during its pass, made one more.
    assert [(name, full) for name, full, _ in runs[:4]] == [("holder", True), ("b", True), ("holder", False),
                                                           ("a", True)]


def test_a_trigger_for_a_pass_still_waiting_for_a_slot_joins_it_at_the_stronger_level():
    async def scenario():
        passes = Passes(hold=("holder",))
        q = WorkQueue(passes, limit=1)
        q.add(key("holder"), full=True, trigger="create")
        await passes.holding.wait()
        q.add(key("a"), full=False, trigger="pod-event")
        await until_waiting(q.slots, (0, 1))
        for full in (False, True, False):  # child events, one a hand edit, while a's status pass waits
            q.add(key("a"), full=full, trigger="child-event")
        passes.release.set()
        await passes.ran("a").wait()
        await q.run(key("holder"), full=False, trigger="pod-event")
        return [r for r in passes.runs if r[0] == "a"]

    assert asyncio.run(scenario()) == [("a", True, "pod-event")]


def test_a_refused_pass_runs_again_full_after_its_delay():
    async def scenario():
        passes = Passes(retry={"a": 0.01})
        q = WorkQueue(passes)
        q.add(key("a"), full=False, trigger="role-event")
        await passes.ran("a").wait()
        pending = q.pending_retries()
        passes.ran("a").clear()
        await passes.ran("a").wait()
        return pending, passes.runs, q.pending_retries()

    pending, runs, after = asyncio.run(scenario())
    assert pending == {key("a")}
    assert runs == [("a", False, "role-event"), ("a", True, "retry")]
    assert after == set()


def test_a_full_pass_supersedes_a_pending_retry_and_a_status_pass_does_not():
    async def scenario():
        passes = Passes(retry={"a": 60.0})
        q = WorkQueue(passes)
        await q.run(key("a"), full=True, trigger="create")
        after_refusal = q.pending_retries()
        await q.run(key("a"), full=False, trigger="pod-event")
        after_status = q.pending_retries()
        await q.run(key("a"), full=True, trigger="update")
        after_full = q.pending_retries()
        q.retry_later(key("a"), 60.0)
        q.cancel_retry(key("a"))  # the CR was deleted
        return after_refusal, after_status, after_full, q.pending_retries()

    assert asyncio.run(scenario()) == ({key("a")}, {key("a")}, set(), set())


def test_a_pass_that_raises_does_not_stop_the_queue():
    async def scenario():
        passes = Passes(fail=("a",))
        q = WorkQueue(passes, limit=1)
        await q.run(key("a"), full=True, trigger="create")
        await q.run(key("a"), full=False, trigger="pod-event")
        await q.run(key("b"), full=True, trigger="create")
        return passes.runs, q.slots.waiting()

    runs, waiting = asyncio.run(scenario())
    assert [r[:2] for r in runs] == [("a", True), ("a", False), ("b", True)]
    assert waiting == (0, 0)


def test_the_queue_refuses_a_bound_below_one():
    with pytest.raises(ValueError, match="at least 1"):
        WorkQueue(Passes(), limit=0)
