"""The router names the engines that served each request in response headers (stub engines, real sockets)."""
from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from disagg.connector.router.app import DECODE_HEADER, PREFILL_HEADER, Router, Settings
from disagg.connector.router.engine_pool import EnginePool
from support.rendezvous import advert


async def _completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if not body.get("stream"):  # the prefill leg, or a non-streamed decode leg
        return web.json_response({"choices": [{"index": 0, "text": "a", "finish_reason": "length"}]})
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    await out.write(b"data: " + json.dumps({"choices": [{"index": 0, "text": "hi"}]}).encode() + b"\n\n")
    await out.write(b"data: [DONE]\n\n")
    await out.write_eof()
    return out


async def _health(_request: web.Request) -> web.Response:
    return web.json_response({})


async def _models(_request: web.Request) -> web.Response:
    return web.json_response({"data": [{"id": "tiny", "max_model_len": 64}]})


@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@pytest.mark.timeout(20)
async def test_responses_name_the_prefill_and_decode_engine_and_the_request_id():
    stub = web.Application()
    stub.router.add_post("/v1/completions", _completions)
    stub.router.add_get("/health", _health)  # the router's probes
    stub.router.add_get("/v1/models", _models)
    async with serving(stub) as engine_url:
        engines = [advert("p-1", role="prefill", http_url=engine_url),
                   advert("d-1", role="decode", http_url=engine_url)]
        router = Router(EnginePool("push", lambda: engines), Settings(mode="push"))
        async with serving(router.app()) as url, aiohttp.ClientSession() as s:
            body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
            for stream in (False, True):
                async with s.post(url + "/v1/completions", json={**body, "stream": stream}) as r:
                    assert r.status == 200, await r.text()
                    await r.read()
                    assert (r.headers[PREFILL_HEADER], r.headers[DECODE_HEADER]) == ("p-1", "d-1")
                    assert len(r.headers["X-Request-Id"]) == 32
