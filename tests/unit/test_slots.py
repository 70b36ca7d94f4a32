"""The pass bound: passes that may turn a CR Ready are served first, the rest in arrival order; no slot is lost,
nobody barges."""
from __future__ import annotations

import asyncio

import pytest

from disagg.operator.controller.queue import Slots
from support.slots import until_waiting


class Holder:
    """Holds one slot until released; `then` runs in the same loop turn as the release."""

    def __init__(self, slots: Slots, then=lambda: None) -> None:
        self.holding, self.release = asyncio.Event(), asyncio.Event()
        self.task = asyncio.create_task(self._hold(slots, then))

    async def _hold(self, slots: Slots, then) -> None:
        async with slots.take("holder", urgent=False):
            self.holding.set()
            await self.release.wait()
        then()


def queued(slots: Slots, order: list[str], passes) -> list[asyncio.Task]:
    """A task per (name, urgent) in `passes`: each takes a slot, records its name in `order` and frees the slot."""
    async def one(name: str, urgent: bool) -> None:
        async with slots.take(name, urgent=urgent):
            order.append(name)

    return [asyncio.create_task(one(name, urgent)) for name, urgent in passes]


def test_urgent_passes_go_first_and_the_others_keep_their_arrival_order():
    async def scenario():
        slots, order = Slots(1), []
        holder = Holder(slots)
        await holder.holding.wait()
        waiters = queued(slots, order, (("full-1", False), ("status-1", False), ("full-2", False),
                                        ("ready-1", True), ("ready-2", True)))
        await until_waiting(slots, (2, 3))
        holder.release.set()
        await asyncio.gather(holder.task, *waiters)
        return order

    assert asyncio.run(scenario()) == ["ready-1", "ready-2", "full-1", "status-1", "full-2"]


def test_a_waiting_pass_promoted_to_urgent_goes_after_the_urgent_already_waiting():
    async def scenario():
        slots, order = Slots(1), []
        holder = Holder(slots)
        await holder.holding.wait()
        waiters = queued(slots, order, (("a", False), ("b", False), ("c", True)))
        await until_waiting(slots, (1, 2))
        slots.promote("b")
        slots.promote("c")  # already urgent: stays where it is
        slots.promote("nobody")  # not waiting: nothing to do
        promoted = slots.waiting()
        holder.release.set()
        await asyncio.gather(holder.task, *waiters)
        return promoted, order

    assert asyncio.run(scenario()) == ((2, 1), ["c", "b", "a"])


def test_at_most_limit_run_and_a_newcomer_never_barges_past_waiters():
    async def scenario():
        slots, running, peak, order = Slots(2), [0], [0], []
        gate = asyncio.Event()

        async def one(name: str):
            async with slots.take(name, urgent=False):
                order.append(name)
                running[0] += 1
                peak[0] = max(peak[0], running[0])
                await gate.wait()
                running[0] -= 1

        first = [asyncio.create_task(one(f"p{i}")) for i in range(4)]
        await until_waiting(slots, (0, 2))
        gate.set()  # the two holders finish and hand their slots straight to the two waiters ...
        late = asyncio.create_task(one("late"))  # ... so this newcomer, arriving meanwhile, comes last
        await asyncio.gather(*first, late)
        return peak[0], order

    assert asyncio.run(scenario()) == (2, ["p0", "p1", "p2", "p3", "late"])


def test_a_waiter_cancelled_after_being_handed_a_slot_passes_it_on():
    async def scenario():
        slots, got, tasks = Slots(1), [], {}
        # The holder's release hands the slot to "doomed", which has not run since: cancel it in that same turn.
        holder = Holder(slots, then=lambda: tasks["doomed"].cancel())
        await holder.holding.wait()

        async def one(name: str):
            async with slots.take(name, urgent=True):
                got.append(name)

        tasks["doomed"], heir = asyncio.create_task(one("doomed")), asyncio.create_task(one("heir"))
        await until_waiting(slots, (2, 0))
        holder.release.set()
        await holder.task
        await asyncio.gather(tasks["doomed"], return_exceptions=True)
        await asyncio.wait_for(heir, 1)
        async with slots.take("after", urgent=False):  # and the slot is back: nothing leaked
            got.append("after")
        return got, tasks["doomed"].cancelled()

    assert asyncio.run(scenario()) == (["heir", "after"], True)


def test_a_waiter_cancelled_in_the_queue_leaves_it_and_no_backlog_behind():
    async def scenario():
        slots = Slots(1)
        holder = Holder(slots)
        await holder.holding.wait()

        async def wait():
            async with slots.take("w", urgent=False):
                pass

        waiter = asyncio.create_task(wait())
        await until_waiting(slots, (0, 1))
        drained = asyncio.create_task(slots.drained())
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        queued = slots.waiting()
        await asyncio.wait_for(drained, 1)  # nobody waits any more, though the holder still holds its slot
        holder.release.set()
        await holder.task
        return queued

    assert asyncio.run(scenario()) == (0, 0)


def test_unbounded_never_waits_and_a_bound_below_one_is_refused():
    async def scenario():
        slots, inside = Slots(None), []
        async with slots.take("a", urgent=False), slots.take("b", urgent=True):
            inside.append(slots.waiting())
        return inside

    assert asyncio.run(scenario()) == [(0, 0)]
    with pytest.raises(ValueError, match="at least 1"):
        Slots(0)


def test_drained_returns_once_no_pass_waits_for_a_slot():
    async def scenario():
        slots, events = Slots(1), []
        await asyncio.wait_for(slots.drained(), 1)  # nobody waits: at once
        holder = Holder(slots)
        await holder.holding.wait()
        await asyncio.wait_for(slots.drained(), 1)  # a pass holding its slot is not a backlog

        async def resync():
            await slots.drained()
            events.append("drained")

        passes = queued(slots, events, (("a", False), ("b", False)))
        await until_waiting(slots, (0, 2))
        waiter = asyncio.create_task(resync())
        holder.release.set()  # "a" gets the slot, "b" still waits
        await holder.task
        await asyncio.gather(*passes, waiter)
        return events

    # "drained" once "b" was handed the slot, whatever order the tasks then ran in; not before "a" was.
    events = asyncio.run(scenario())
    assert sorted(events) == ["a", "b", "drained"] and events.index("a") < events.index("drained")

