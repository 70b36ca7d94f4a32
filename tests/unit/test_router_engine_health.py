"""An engine leaves the router's rotation by its health (the pool's probes), not by one request that went wrong:
a read timeout is a slow request, a reset may be a client abort passed on. Only a refused connection takes an
engine out between probe rounds. A router on 127.0.0.1 in front of stand-in engines (tests/support/stub_engines.py)
with its probes running, as in the router process."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest

from disagg.connector.router.app import DECODE_HEADER, Router, Settings
from disagg.connector.router.engine_pool import EnginePool
from support.stub_engines import KvBoard, StubEngine, serving, stub_engines

BODY = {"model": "tiny", "prompt": "x", "max_tokens": 2}


@contextlib.asynccontextmanager
async def pair_and_spare(probe_interval: float = 0.05,
                         **settings: float) -> AsyncIterator[tuple[str, Router, StubEngine, StubEngine]]:
    """Prefill p-a, decodes d-1 and d-2 (d-1 is chosen first: same load, lower id); probes every 50 ms unless
    said, the first round as the app starts."""
    board = KvBoard()
    p_a = StubEngine("p-a", "prefill", board=board)
    d_1, d_2 = StubEngine("d-1", "decode", board=board), StubEngine("d-2", "decode", board=board)
    async with stub_engines(p_a, d_1, d_2):
        engines = [p_a.advertisement(), d_1.advertisement(), d_2.advertisement()]
        pool = EnginePool("push", lambda: engines, probe_interval=probe_interval, probe_timeout=1.0)
        router = Router(pool, Settings(mode="push", **settings))
        async with serving(router.app()) as url:
            yield url, router, d_1, d_2


async def post(url: str, stream: bool = False) -> tuple[int, str, bytes]:
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json={**BODY, "stream": stream}) as r:
        return r.status, r.headers.get(DECODE_HEADER, ""), await r.read()


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """The pool's state changes in its probe task, which has no event to await: look every 10 ms."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


def metric(router: Router, name: str, **labels: str) -> float:
    return router.m.registry.get_sample_value(name, labels) or 0.0


async def hang(_rid: str, _i: int) -> None:
    await asyncio.Event().wait()  # until the router gives up and closes the connection


@pytest.mark.timeout(30)
@pytest.mark.parametrize("stream", [False, True])
async def test_a_read_timeout_is_not_retried_and_leaves_the_engine_in_rotation(stream):
    """One request that read-times-out on d-1 (a decode waiting for KV that never comes) fails alone: 502, not
    retried (the client has waited that long already), and d-1 serves the next request. Before, aiohttp's read
    timeout (a TimeoutError subclass, not named TimeoutError) was retried and took d-1 out."""
    async with pair_and_spare(request_timeout=0.3) as (url, router, d_1, d_2):
        d_1.decode_hold = hang
        status, _, body = await post(url, stream)
        assert status == 502 and b"decode engine d-1: SocketTimeoutError" in body
        await d_1.wait_for(lambda: d_1.cancelled == [d_1.legs[0].request_id])
        assert d_2.legs == []
        assert metric(router, "disagg_router_decode_retries_total") == 0
        assert router.pool.down == set()

        d_1.decode_hold = None
        status, decode, body = await post(url, stream)
        assert (status, decode) == (200, "d-1"), body


@pytest.mark.timeout(30)
async def test_a_reset_is_retried_elsewhere_and_the_engine_leaves_only_by_its_probe():
    """d-1 drops its decode connections; its health is still good: the request is retried on d-2, and d-1 stays
    in rotation. Once its /health fails, the probes take it out, and requests go to d-2 from the first attempt."""
    async with pair_and_spare() as (url, router, d_1, d_2):
        d_1.decode_dies_after = 0
        status, decode, body = await post(url, stream=True)
        assert (status, decode) == (200, "d-2"), body
        assert metric(router, "disagg_router_decode_retries_total") == 1
        assert router.pool.down == set()

        d_1.health_status = 503
        await until(lambda: router.pool.down == {"d-1"})
        status, decode, _ = await post(url, stream=True)
        assert (status, decode) == (200, "d-2")
        assert len(d_1.legs) == 1 and metric(router, "disagg_router_decode_retries_total") == 1


@pytest.mark.timeout(30)
async def test_a_refused_connection_takes_the_engine_out_until_the_next_probe_round():
    """Nothing listens at d-1: the request that found out is retried on d-2, and no request tries d-1 again before
    a probe round has looked. The round decides: d-1 listening again is back in rotation."""
    async with pair_and_spare(probe_interval=3600) as (url, router, d_1, d_2):
        await until(lambda: len(router.pool.max_model_len) == 3)  # the start-up round has seen every engine
        assert d_1.url is not None
        port = int(d_1.url.rsplit(":", 1)[1])
        await d_1.stop()
        status, decode, _ = await post(url)
        assert (status, decode) == (200, "d-2")
        assert metric(router, "disagg_router_upstream_errors_total", role="decode", kind="ClientConnectorError") == 1
        assert router.pool.down == {"d-1"}
        status, decode, _ = await post(url)
        assert (status, decode) == (200, "d-2")
        assert metric(router, "disagg_router_upstream_errors_total", role="decode", kind="ClientConnectorError") == 1

        await d_1.start(port)
        assert router.session is not None
        await router.pool.probe_once(router.session)
        assert router.pool.down == set()
        status, decode, _ = await post(url)
        assert (status, decode) == (200, "d-1")
