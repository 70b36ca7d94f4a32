"""A prefill engine that stops: the router waits for what it holds while it drains, and gives up on it only once
its probes find it dead; then whatever it still owed (its answer, or the KV a decode leg waits for) is retried on
another pair, before the client got anything. A router in front of stand-in engines (tests/support/stub_engines.py)
with its probes running, as in the router process; the prefill leaves the engine list first, as a stopping engine
leaves the rendezvous."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import pytest

from disagg.connector.router.app import DECODE_HEADER, PREFILL_HEADER, Router, Settings
from disagg.connector.router.engine_pool import EnginePool
from disagg.connector.wire.advertisement import EngineAdvertisement
from support.stub_engines import KvBoard, StubEngine, serving, stub_engines

BODY = {"model": "tiny", "prompt": "x", "max_tokens": 2}


@contextlib.asynccontextmanager
async def two_prefills() -> AsyncIterator[tuple[str, Router, list[EngineAdvertisement], StubEngine, StubEngine,
                                                StubEngine]]:
    """Prefills p-a (chosen first: same load, lower id) and p-b, decode d-1; probes every 50 ms. The engine list
    is the router's source: removing an entry is a withdrawal from the rendezvous."""
    board = KvBoard()
    p_a, p_b = StubEngine("p-a", "prefill", board=board), StubEngine("p-b", "prefill", board=board)
    d_1 = StubEngine("d-1", "decode", board=board)
    async with stub_engines(p_a, p_b, d_1):
        engines = [p_a.advertisement(), p_b.advertisement(), d_1.advertisement()]
        pool = EnginePool("push", lambda: list(engines), probe_interval=0.05, probe_timeout=1.0)
        router = Router(pool, Settings(mode="push"))
        async with serving(router.app()) as url:
            yield url, router, engines, p_a, p_b, d_1


async def post(url: str, stream: bool) -> tuple[int, dict[str, str], bytes]:
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json={**BODY, "stream": stream}) as r:
        return r.status, dict(r.headers), await r.read()


def metric(router: Router, name: str, **labels: str) -> float:
    return router.m.registry.get_sample_value(name, labels) or 0.0


def withdraw(engines: list[EngineAdvertisement], engine_id: str) -> None:
    engines[:] = [e for e in engines if e.engine_id != engine_id]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("stream", [False, True])
async def test_a_withdrawn_prefill_that_still_answers_its_probes_is_waited_for(stream):
    """Draining: it left the rendezvous but is alive. The router keeps probing it and takes its answer."""
    async with two_prefills() as (url, router, engines, p_a, p_b, d_1):
        release = asyncio.Event()

        async def until_released(_rid: str) -> None:
            await release.wait()

        p_a.hold = until_released
        request = asyncio.create_task(post(url, stream))
        await p_a.wait_for(lambda: len(p_a.legs) == 1)
        withdraw(engines, "p-a")
        seen = p_a.probes
        await p_a.wait_for(lambda: p_a.probes >= seen + 3)  # probed after it left, found alive
        assert not request.done()
        release.set()
        status, headers, body = await request
        assert (status, headers[PREFILL_HEADER], headers[DECODE_HEADER]) == (200, "p-a", "d-1"), body
        assert p_b.legs == [] and metric(router, "disagg_router_prefill_retries_total") == 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("stream", [False, True])
async def test_a_prefill_found_dead_before_it_answers_is_retried_on_another_pair(stream):
    """A stopping prefill that could not finish its queue before it was killed (vLLM then leaves its HTTP requests
    unanswered until their clients give up): once its probes fail, the request runs again on p-b, and the first
    attempt's decode leg is aborted at once rather than at its registration timeout."""
    async with two_prefills() as (url, router, engines, p_a, p_b, d_1):
        async def never(_rid: str) -> None:
            await asyncio.Event().wait()

        p_a.hold = never
        request = asyncio.create_task(post(url, stream))
        await p_a.wait_for(lambda: len(p_a.legs) == 1)
        first = p_a.legs[0].request_id
        withdraw(engines, "p-a")
        p_a.health_status = 503
        status, headers, body = await request
        assert (status, headers[PREFILL_HEADER]) == (200, "p-b"), body
        await d_1.wait_for(lambda: first in d_1.cancelled)
        await p_a.wait_for(lambda: first in p_a.cancelled)
        assert metric(router, "disagg_router_upstream_errors_total", role="prefill", kind="gone") == 1
        assert metric(router, "disagg_router_prefill_retries_total") == 1


@pytest.mark.timeout(30)
@pytest.mark.parametrize("stream", [False, True])
async def test_a_decode_waiting_for_kv_from_a_prefill_found_dead_is_retried_on_another_pair(stream):
    """p-a answered but never wrote the KV (it was killed before its WRITE): decode would wait until its
    registration timeout. Once p-a's probes fail, the request runs again on p-b."""
    async with two_prefills() as (url, router, engines, p_a, p_b, d_1):
        p_a.writes_kv = False
        request = asyncio.create_task(post(url, stream))
        await d_1.wait_for(lambda: len(d_1.legs) == 1)
        await p_a.wait_for(lambda: len(p_a.legs) == 1 and p_a.active == 0)  # answered
        first = d_1.legs[0].request_id
        withdraw(engines, "p-a")
        seen = p_a.probes
        await p_a.wait_for(lambda: p_a.probes >= seen + 2)
        assert not request.done()  # alive: its KV may still come
        p_a.health_status = 503
        status, headers, body = await request
        assert (status, headers[PREFILL_HEADER], headers[DECODE_HEADER]) == (200, "p-b", "d-1"), body
        await d_1.wait_for(lambda: first in d_1.cancelled)
        assert metric(router, "disagg_router_upstream_errors_total", role="prefill", kind="gone") == 1


@pytest.mark.timeout(30)
async def test_a_prefill_answer_for_an_aborted_request_is_retried_on_another_pair():
    """vLLM answers a request it aborted (a shutdown without drain) with finish_reason "abort": no KV was
    computed, so decode would wait for nothing."""
    async with two_prefills() as (url, router, engines, p_a, p_b, d_1):
        p_a.prefill_finish_reason = "abort"
        p_a.writes_kv = False
        status, headers, body = await post(url, stream=True)
        assert (status, headers[PREFILL_HEADER]) == (200, "p-b"), body
        await d_1.wait_for(lambda: d_1.legs[0].request_id in d_1.cancelled)
        assert metric(router, "disagg_router_upstream_errors_total", role="prefill", kind="protocol") == 1
