"""Sending one segment of a workload to the router and timing every request as a client sees it: open loop (each
request at its arrival time, whatever is still running), streamed, TTFT from send to the first chunk with a
choice, TPOT over the tokens after the first."""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from .workload import WorkloadRequest


@dataclass
class Timed:
    """One request's fate. Times in seconds; sent_s from the segment's start."""

    sent_s: float
    ok: bool = False
    ttft_s: float | None = None
    tpot_s: float | None = None
    tokens: int = 0
    request_id: str | None = None
    error: str | None = None


async def data_events(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """Each `data:` event of a server-sent event stream, parsed, as it arrives (`[DONE]` and other lines skipped)."""
    buf = b""
    async for chunk in resp.content.iter_any():
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            line = line.strip()
            if line.startswith(b"data:") and line != b"data: [DONE]":
                yield json.loads(line[5:])


async def _one(session: aiohttp.ClientSession, url: str, body: dict[str, Any], t: Timed, timeout: float) -> None:
    start = time.monotonic()
    first = last = None
    chunks, usage = 0, None
    try:
        async with asyncio.timeout(timeout):
            async with session.post(url, json=body) as resp:
                t.request_id = resp.headers.get("X-Request-Id")
                if resp.status != 200:
                    t.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    return
                async for data in data_events(resp):
                    if "error" in data:
                        t.error = f"error in stream: {json.dumps(data['error'])[:200]}"
                        return
                    if data.get("choices"):
                        last = time.monotonic()
                        first = first or last
                        chunks += 1
                    if data.get("usage"):
                        usage = data["usage"].get("completion_tokens")
    except TimeoutError:
        t.error = f"no answer in {timeout:g} s"
        return
    except (aiohttp.ClientError, json.JSONDecodeError) as e:
        t.error = f"{type(e).__name__}: {e}"[:300]
        return
    if first is None or last is None:
        t.error = "the stream ended without a token"
        return
    t.tokens = usage if isinstance(usage, int) else chunks
    t.ok, t.ttft_s = True, first - start
    t.tpot_s = (last - first) / (t.tokens - 1) if t.tokens > 1 else None


async def replay(session: aiohttp.ClientSession, base_url: str, model: str, requests: list[WorkloadRequest],
                 arrivals: list[float], timeout: float,
                 progress: Callable[[int, int], None] | None = None) -> list[Timed]:
    """Every request of `requests` sent at its arrival (seconds from now), each bounded by `timeout`; their timings
    in the same order. `progress(done, total)` after each answer."""
    if len(requests) != len(arrivals):
        raise ValueError(f"{len(requests)} requests but {len(arrivals)} arrivals")
    t0 = time.monotonic()
    out = [Timed(sent_s=a) for a in arrivals]
    done = 0

    async def send(r: WorkloadRequest, t: Timed) -> None:
        nonlocal done
        await asyncio.sleep(max(0.0, t0 + t.sent_s - time.monotonic()))  # the arrival schedule
        await _one(session, base_url.rstrip("/") + r.path, r.body(model), t, timeout)
        done += 1
        if progress is not None:
            progress(done, len(out))

    await asyncio.gather(*(send(r, t) for r, t in zip(requests, out, strict=True)))
    return out
