"""Stand-ins for vLLM prefill and decode engines, served in process on 127.0.0.1 (real HTTP, no model).

They are not engines: they compute nothing and only speak the part of vLLM's HTTP API the router uses
(`/health`, `/v1/models`, `/v1/completions`, `/v1/chat/completions`), like bench/stub_engine.py, plus what the
router's own logic needs to be observed: every leg they received (its `X-Request-Id` and body), every leg
whose connection the router closed before the answer (`cancelled`), and failure switches. A shared `KvBoard`
stands in for the KV handoff: a prefill stand-in posts its request there when it answers, and a decode
stand-in waits for it before its first token, as a push-mode decode waits for prefill's WRITE.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from disagg.connector.router import pd_protocol as pd
from disagg.connector.wire.advertisement import EngineAdvertisement
from support.rendezvous import advert

PATHS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


class KvBoard:
    """Which requests' KV a prefill stand-in has "written" (by vLLM's internal request id, as decode names it)."""

    def __init__(self) -> None:
        self.ready: set[str] = set()
        self._changed = asyncio.Condition()

    async def post(self, internal_id: str) -> None:
        async with self._changed:
            self.ready.add(internal_id)
            self._changed.notify_all()

    async def wait(self, internal_id: str) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: internal_id in self.ready)


@dataclass
class Leg:
    request_id: str
    path: str
    body: Any

    @property
    def params(self) -> dict[str, Any]:
        p = self.body.get("kv_transfer_params") if isinstance(self.body, dict) else None
        return p if isinstance(p, dict) else {}


class StubEngine:
    """One stand-in engine. `fail_status`: answer prefill legs with this HTTP status (after `hold(request_id)`
    returns, if set), its error naming `fail_param` when set (as vLLM names `model` in a 404 for a model it does
    not serve). `board`: decode legs wait for their KV there; without one they answer at once.
    `decode_status`: answer decode legs with this status; a streamed decode leg sends its 200 and headers at once
    (as vLLM does, before any token), then `tokens` chunks: `decode_hold(request_id, i)`, if set, is awaited before
    chunk i (before the answer, i = 0, when not streamed); `decode_dies_after`: drop the connection before that
    chunk. `writes_kv`: False makes a prefill answer without writing its KV (a prefill that stops before its
    WRITE); `prefill_finish_reason`: the finish_reason of its answer ("abort": vLLM aborted the request).
    `health_status`, `health_hangs`: what /health does, `probes`: /health calls so far; `models_body`: what
    /v1/models answers. `active`:
    legs being answered now (from the request's arrival to its handler's end; `wait_for` wakes on arrivals, not on
    ends), `peak`: the most at once."""

    def __init__(self, engine_id: str, role: str, *, mode: str = "push", board: KvBoard | None = None,
                 max_model_len: int = 8192, layout_key: str | None = None, block_size: int = 16) -> None:
        self.engine_id, self.role, self.mode, self.board = engine_id, role, mode, board
        self.max_model_len, self.layout_key, self.block_size = max_model_len, layout_key, block_size
        self.fail_status: int | None = None
        self.fail_param: str | None = None
        self.decode_status = 200
        self.decode_failures = 0
        """The next this many decode legs are answered with a 500, whatever `decode_status` says (a decode that
        fails once and then serves)."""
        self.decode_dies_after: int | None = None
        self.decode_hold: Callable[[str, int], Awaitable[None]] | None = None
        self.tokens = ["b", "c"]
        self.writes_kv = True
        self.prefill_finish_reason = "length"
        self.health_status = 200
        self.health_hangs = False
        self.probes = 0
        self.models_body: bytes | None = None
        self.hold: Callable[[str], Awaitable[None]] | None = None
        self.legs: list[Leg] = []
        self.cancelled: list[str] = []
        self.active = 0  # legs being answered now
        self.peak = 0  # the most legs ever answered at once
        self.url: str | None = None
        self._runner: web.AppRunner | None = None
        self._changed = asyncio.Condition()

    # -- what the router sees --
    def advertisement(self) -> EngineAdvertisement:
        assert self.url is not None, "start() first"
        extra = {"layout_key": self.layout_key} if self.layout_key else {}
        return advert(self.engine_id, role=self.role, kv_mode=self.mode, http_url=self.url,
                      block_size=self.block_size, **extra)

    async def start(self, port: int = 0) -> str:
        """Serve on `port` (0: a free one); an engine started again at its old port is back at its address."""
        app = web.Application(client_max_size=64 << 20)
        for path in PATHS:
            app.router.add_post(path, self._generate)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        # Cancel a handler when the router closes its connection: that is how the router aborts a leg.
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- what tests await --
    async def wait_for(self, predicate: Callable[[], bool], timeout: float = 5.0) -> None:
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(predicate)

    def received(self, request_id: str) -> bool:
        return any(leg.request_id == request_id for leg in self.legs)

    async def _note(self, fn: Callable[[], None]) -> None:
        async with self._changed:
            fn()
            self._changed.notify_all()

    # -- the API --
    async def _health(self, _request: web.Request) -> web.Response:
        await self._note(lambda: setattr(self, "probes", self.probes + 1))
        if self.health_hangs:
            await asyncio.Event().wait()  # until the prober gives up and closes the connection
        return web.Response(status=self.health_status, text="")

    async def _models(self, _request: web.Request) -> web.Response:
        if self.models_body is not None:
            return web.Response(body=self.models_body, content_type="application/json")
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model",
                                                              "max_model_len": self.max_model_len}]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        rid = request.headers.get("X-Request-Id", "")
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            return web.json_response({"error": {"message": "not JSON", "code": 400}}, status=400)
        leg = Leg(rid, request.path, body)

        def arrived() -> None:
            self.legs.append(leg)
            self.active += 1
            self.peak = max(self.peak, self.active)

        await self._note(arrived)
        try:
            if leg.params.get("do_remote_decode"):
                return await self._prefill(leg)
            return await self._decode(request, leg)
        except asyncio.CancelledError:
            await asyncio.shield(self._note(lambda: self.cancelled.append(rid)))
            raise
        finally:
            # Not noted (no await): with an await here, a stand-in that drops its connection mid-stream lost the
            # chunk it had written before (test_router_retry's mid-stream death).
            self.active -= 1

    async def _prefill(self, leg: Leg) -> web.Response:
        internal = pd.internal_request_id(PATHS[leg.path], leg.request_id)
        if self.hold is not None:
            await self.hold(leg.request_id)
        if self.fail_status is not None:
            return web.json_response({"error": {"message": f"stand-in {self.engine_id} fails", "code":
                                                self.fail_status, "param": self.fail_param}},
                                     status=self.fail_status)
        if self.board is not None and self.writes_kv:
            await self.board.post(internal)
        return web.json_response({
            "id": internal, "object": "text_completion", "model": "tiny",
            "choices": [{"index": 0, "text": "a", "finish_reason": self.prefill_finish_reason}],
            "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False,
                                   "remote_request_id": internal, "remote_engine_id": self.engine_id,
                                   "remote_block_ids": [1, 2], "remote_host": "127.0.0.1", "remote_port": 5600,
                                   "tp_size": 1}})

    async def _decode(self, request: web.Request, leg: Leg) -> web.StreamResponse:
        status = self.decode_status
        if self.decode_failures > 0:
            self.decode_failures -= 1
            status = 500
        if status != 200:
            return web.json_response({"error": {"message": f"stand-in {self.engine_id} fails", "code":
                                                status}}, status=status)
        streamed = isinstance(leg.body, dict) and leg.body.get("stream") is True
        if streamed:
            # vLLM answers a streamed request with its 200 and headers at once, before its KV has come.
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            await out.write(b"")  # aiohttp holds the headers back until the first chunk; vLLM's server does not
        waits_for = leg.params.get("remote_request_id")
        if self.board is not None and isinstance(waits_for, str):
            await self.board.wait(waits_for)  # the KV handoff: prefill's WRITE (push) or READ (pull)
        if not streamed:
            if self.decode_hold is not None:
                await self.decode_hold(leg.request_id, 0)
            return web.json_response({"id": leg.request_id, "object": "text_completion", "model": "tiny",
                                      "choices": [{"index": 0, "text": "".join(self.tokens),
                                                   "finish_reason": "length"}]})
        for i, t in enumerate(self.tokens):
            if self.decode_hold is not None:
                await self.decode_hold(leg.request_id, i)
            if i == self.decode_dies_after:
                assert request.transport is not None
                request.transport.abort()  # the engine dies mid-stream
                return out
            await out.write(b"data: " + json.dumps({"choices": [{"index": 0, "text": t}]}).encode() + b"\n\n")
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out


@contextlib.asynccontextmanager
async def stub_engines(*engines: StubEngine) -> AsyncIterator[tuple[StubEngine, ...]]:
    try:
        for e in engines:
            await e.start()
        yield engines
    finally:
        for e in engines:
            await e.stop()


@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    """Serve an aiohttp app (the router) on a free port of 127.0.0.1; its base URL."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()
