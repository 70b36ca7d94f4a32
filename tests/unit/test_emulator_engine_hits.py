"""The emulated engine's step, in process: requests admitted in one step each get the cached blocks the plan gave
them as their hit, even when another request's new blocks in the same step come from the cache's least recently
used end, where those hit blocks wait unheld. (An allocation that evicted them first left the step loop dead with a
KeyError, and the engine queued every request after it forever.)"""
from __future__ import annotations

import asyncio

from disagg.connector.emulator.engine import EmulatedEngine, new_request
from disagg.connector.emulator.metrics import EngineMetrics
from disagg.connector.emulator.profiles import CPU_KV64K, EmulatorProfile

BLOCK = 128
PROFILE = EmulatorProfile.model_validate(
    {**CPU_KV64K.model_dump(), "num_blocks": 6, "max_model_len": 4 * BLOCK}).scaled(0.001)
"""Six blocks, and steps a thousand times faster than the CPU engine's."""


def engine() -> EmulatedEngine:
    metrics = EngineMetrics("tiny", profile=PROFILE.name, role="decode", kv_mode="push",
                            max_model_len=PROFILE.max_model_len, block_size=BLOCK, num_blocks=PROFILE.num_blocks,
                            kv_bytes_per_token=PROFILE.kv_bytes_per_token)
    return EmulatedEngine(PROFILE, role="decode", kv_mode="push", engine_id="hits", side_channel_host="127.0.0.1",
                          side_channel_port=0, metrics=metrics)


async def finished(req) -> None:
    while (out := await req.queue.get()).finish is None:
        assert out.error is None, out.error


async def serve(e: EmulatedEngine, *reqs) -> None:
    """Queue `reqs` before the step loop runs (so one step may admit them all), then run it until all end; the
    step loop's own error if it dies first."""
    for r in reqs:
        await e.add(r)
    steps = asyncio.create_task(e.run())
    answers = asyncio.ensure_future(asyncio.gather(*(finished(r) for r in reqs)))
    await asyncio.wait({steps, answers}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
    if steps.done():
        answers.cancel()
        raise AssertionError("the step loop died") from steps.exception()
    assert answers.done(), "not answered within 10 s"
    steps.cancel()
    await asyncio.gather(steps, return_exceptions=True)


def test_a_step_that_admits_a_hit_and_an_eviction_gives_the_hit_its_blocks():
    async def go() -> None:
        e = engine()
        shared = list(range(2 * BLOCK))  # two full blocks
        await serve(e, new_request("x", shared, 1))
        await serve(e, new_request("y", [7] * (2 * BLOCK), 1))
        # The free queue now starts with x's blocks (released first): a new prompt of three blocks takes them
        # from there, unless the request with x's prefix, admitted in the same step, holds them first.
        fresh, reuse = new_request("a", [9] * (3 * BLOCK), 1), new_request("b", [*shared, *range(50)], 1)
        await serve(e, fresh, reuse)
        assert reuse.local_hit == 2 * BLOCK and fresh.local_hit == 0
        await e.close()

    asyncio.run(go())
