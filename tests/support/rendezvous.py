"""Helpers for rendezvous tests: valid advertisements, a manual clock, awaiting watch events, scoped tasks."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from disagg.connector.wire.advertisement import EngineAdvertisement, WatchEvent

LAYOUT = "0123456789abcdef"


def advert(engine_id: str = "qwen-prefill-0-uid0", **over: Any) -> EngineAdvertisement:
    fields: dict[str, Any] = dict(
        role="prefill", engine_id=engine_id, deployment="qwen", pod_name=None, pod_uid=None,
        http_url="http://10.0.0.5:8000", side_channel_host="10.0.0.5", side_channel_ports=[5600], tp_size=1,
        pp_size=1, dp_size=1, block_size=16, layout_key=LAYOUT, kv_mode="push", transport="UCX",
        lease_seconds=30.0)
    fields.update(over)
    return EngineAdvertisement(**fields)


def advert_json(engine_id: str = "qwen-prefill-0-uid0", **over: Any) -> dict[str, Any]:
    return advert(engine_id, **over).model_dump(mode="json")


class ManualClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


async def next_event(events: AsyncIterator[WatchEvent], *, skip: tuple[str, ...] = ("BOOKMARK",),
                     timeout: float = 5.0) -> WatchEvent:
    """The next watch event whose type is not in `skip`."""
    async with asyncio.timeout(timeout):
        async for ev in events:
            if ev.type not in skip:
                return ev
    raise AssertionError("watch ended")


@contextlib.asynccontextmanager
async def task(coro) -> AsyncIterator[asyncio.Task]:
    t = asyncio.create_task(coro)
    try:
        yield t
    finally:
        t.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await t
