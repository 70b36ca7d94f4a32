"""The measuring P/D client shared by the benchmarks: one streamed completion through a router or a plain
engine, or both legs sent by this client itself with the router's protocol functions (connector/router/pd_protocol.py),
timed from send to first token; and the statistics and CPU accounting of those timings."""
from __future__ import annotations

import asyncio
import os
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from disagg.compare.replay import data_events as sse_events
from disagg.compare.stats import quantile, ratio_ci
from disagg.connector.router import pd_protocol as pd
from disagg.connector.wire.advertisement import EngineAdvertisement
from disagg.devcluster.engines import LocalEngine

LAYOUT = "tiny-bf16-128"
ALPHABET = "abcdefghijklmnopqrstuvwxyz     "


# -- one request -----------------------------------------------------------------------------------------------
@dataclass
class Result:
    idx: int
    ok: bool
    error: str | None = None
    sent: float = 0.0  # monotonic
    ttft: float | None = None
    e2e: float | None = None
    tokens: int = 0
    handoff: float | None = None  # direct arms (the client's) and our router's (its access log)
    request_id: str | None = None  # the X-Request-Id a router answered with
    prefill: float | None = None  # direct arms only: send -> prefill response
    router_ms: dict | None = None  # our router's access-log times for it (ms from the router's receipt)


def completion_body(prompt: str, max_tokens: int) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


async def read_stream(resp: aiohttp.ClientResponse, res: Result) -> None:
    """First SSE data chunk with a choice = the first token (what the router's TTFT metric also counts)."""
    chunks, usage = 0, None
    async for data in sse_events(resp):
        if data.get("choices"):
            if res.ttft is None:
                res.ttft = time.monotonic() - res.sent
            chunks += 1
        if data.get("usage"):
            usage = data["usage"].get("completion_tokens")
    if res.ttft is None:
        raise RuntimeError("stream ended without a token")
    res.tokens = usage if isinstance(usage, int) else chunks


async def _check(resp: aiohttp.ClientResponse, what: str) -> None:
    if resp.status != 200:
        raise RuntimeError(f"{what} HTTP {resp.status}: {(await resp.text())[:200]}")


Sender = Callable[[aiohttp.ClientSession, dict, Result], Awaitable[None]]


def via(url: str) -> Sender:
    """A router or a plain engine: one streamed request."""
    async def send(session: aiohttp.ClientSession, body: dict, res: Result) -> None:
        async with session.post(url + "/v1/completions", json=body) as resp:
            res.request_id = resp.headers.get("X-Request-Id")
            await _check(resp, "completion")
            await read_stream(resp, res)
    return send


def direct_push(prefill_url: str, decode_url: str, prefill_adv: EngineAdvertisement) -> Sender:
    """Both legs at once with one X-Request-Id, as `disagg router --mode push` sends them, without the hop."""
    async def send(session: aiohttp.ClientSession, body: dict, res: Result) -> None:
        rid = uuid.uuid4().hex
        hdr = {"X-Request-Id": rid}
        params = pd.push_decode_params("completions", rid, prefill_adv)
        prefill_done: list[float] = []

        async def prefill() -> None:
            async with session.post(prefill_url + "/v1/completions", json=pd.prefill_body("completions", body),
                                    headers=hdr) as resp:
                await _check(resp, "prefill")
                await resp.read()
            prefill_done.append(time.monotonic())

        async def decode() -> None:
            async with session.post(decode_url + "/v1/completions", json=pd.decode_body(body, params),
                                    headers=hdr) as resp:
                await _check(resp, "decode")
                await read_stream(resp, res)

        p, d = asyncio.create_task(prefill()), asyncio.create_task(decode())
        try:
            await p  # as the router does: a failed prefill cancels decode instead of letting it wait for KV
            await d
        finally:
            p.cancel()
            d.cancel()
        res.prefill = prefill_done[0] - res.sent
        res.handoff = max(0.0, res.ttft - res.prefill)
    return send


def direct_pull(prefill_url: str, decode_url: str) -> Sender:
    """Prefill, then decode with prefill's kv_transfer_params unchanged, as `disagg router --mode pull` does."""
    async def send(session: aiohttp.ClientSession, body: dict, res: Result) -> None:
        hdr = {"X-Request-Id": uuid.uuid4().hex}
        async with session.post(prefill_url + "/v1/completions", json=pd.prefill_body("completions", body),
                                headers=hdr) as resp:
            await _check(resp, "prefill")
            pre = await resp.json()
        res.prefill = time.monotonic() - res.sent
        async with session.post(decode_url + "/v1/completions",
                                json=pd.decode_body(body, pd.pull_decode_params(pre)), headers=hdr) as resp:
            await _check(resp, "decode")
            await read_stream(resp, res)
        res.handoff = max(0.0, res.ttft - res.prefill)
    return send


async def one(session: aiohttp.ClientSession, send: Sender, req_idx: int, prompt: str, max_tokens: int,
              timeout: float) -> Result:
    res = Result(req_idx, ok=False, sent=time.monotonic())
    try:
        await asyncio.wait_for(send(session, completion_body(prompt, max_tokens), res), timeout)
        res.ok = True
    except TimeoutError:
        res.error = f"timeout after {timeout:g}s"
    except Exception as e:  # noqa: BLE001 - every failure is counted, none may end the run
        res.error = f"{type(e).__name__}: {e}"[:300]
    res.e2e = time.monotonic() - res.sent
    return res


def advertisement(engine: LocalEngine, mode: str) -> EngineAdvertisement:
    """What direct_push builds its decode leg from when no rendezvous holds the prefill's own."""
    s = engine.spec
    return EngineAdvertisement(role=s.role, engine_id=s.engine_id, deployment="bench", pod_name=s.name,
                               http_url=engine.url, side_channel_host="127.0.0.1",
                               side_channel_ports=[s.side_channel_port], tp_size=1, pp_size=1, dp_size=1,
                               block_size=s.block_size, layout_key=LAYOUT, kv_mode=mode, transport="UCX")


# -- statistics ------------------------------------------------------------------------------------------------
def ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000, 1)


def dist(values: list[float]) -> dict:
    return {"p50_ms": ms(quantile(values, 0.5)), "p99_ms": ms(quantile(values, 0.99)),
            "mean_ms": ms(sum(values) / len(values)) if values else None, "n": len(values)}


def percentile_ratio_ci(num: list[float], den: list[float], q: float, rng: random.Random,
                        n: int = 2000) -> list[float] | None:
    """90% bootstrap interval of quantile_q(num) / quantile_q(den), resampling requests with replacement."""
    ci = ratio_ci(num, den, q, rng, n)
    return None if ci is None else list(ci)


def cpu_sample() -> tuple[float, float]:
    """(busy CPU-seconds of the whole machine, CPU-seconds of this process and its descendants), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    busy = (sum(fields[:8]) - fields[3] - fields[4]) / tick  # all but idle and iowait
    parent, cpu = {}, {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(d.name)] = int(stat[1])
        cpu[int(d.name)] = (int(stat[11]) + int(stat[12])) / tick
    me, ours = os.getpid(), 0.0
    for pid, c in cpu.items():
        p, hops = pid, 0
        while p > 1 and p != me and hops < 64:
            p, hops = parent.get(p, 0), hops + 1
        if p == me:
            ours += c
    return busy, ours
