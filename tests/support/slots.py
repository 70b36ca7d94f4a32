"""Waiting on the operator's pass queue (disagg.operator.controller.queue) in unit tests."""
from __future__ import annotations

import asyncio

from disagg.operator.controller.queue import Slots


async def until_waiting(slots: Slots, waiting: tuple[int, int], turns: int = 100) -> None:
    """Until `slots.waiting()` is `waiting`: a task queues on its first step, so a few event-loop turns (no
    time passes) are enough; after `turns` of them, the tasks are not going to."""
    for _ in range(turns):
        if slots.waiting() == waiting:
            return
        await asyncio.sleep(0)  # one loop turn, not a delay: the queue has no event to await
    raise AssertionError(f"waiting {slots.waiting()}, expected {waiting}")
