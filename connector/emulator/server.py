"""The emulator's HTTP API: what the router, the operator and the tests use of vLLM's OpenAI server.

`/v1/completions` and `/v1/chat/completions` (streamed or not, either P/D leg), `/v1/models`, `/tokenize`,
`/health` and `/metrics`. A client that goes away aborts its request (the handler is cancelled), as in vLLM.
Bad input is a 4xx with vLLM's error body, never a crash; an unexpected error is a logged 500.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..wire import emulator as contract
from ..wire import strict_json
from . import openai_format as fmt
from .engine import EmulatedEngine, Output, RemotePrefill, Request, new_request

log = logging.getLogger("disagg.emulator.server")
MAX_BODY = 16 << 20
PUSH_DECODE_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size")
PULL_DECODE_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")


class EmulatorServer:
    def __init__(self, engine: EmulatedEngine, served_model_name: str) -> None:
        self.engine = engine
        self.profile = engine.profile
        self.model = served_model_name
        self.created = int(time.time())
        self.stopping = False
        self.fingerprint = f"{contract.OWNER}-{self.profile.name}"
        """vLLM's `system_fingerprint` names its version; the emulator's names what it is."""

    # -- the OpenAI API -----------------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.serve(request, "completions")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self.serve(request, "chat")

    def _parse(self, body: Any, endpoint: fmt.Endpoint) -> fmt.Parsed:
        return fmt.parse(endpoint, body, served_model_name=self.model, max_model_len=self.profile.max_model_len,
                         bytes_per_token=self.profile.bytes_per_token, vocab_size=self.profile.vocab_size)

    def _remote_prefill(self, params: dict[str, Any] | None) -> RemotePrefill | None:
        """A decode leg's params, checked: vLLM 0.32 dies on push params without remote_request_id; we refuse."""
        if not params or not params.get("do_remote_prefill"):
            return None
        keys = PUSH_DECODE_KEYS if self.engine.kv_mode == "push" else PULL_DECODE_KEYS
        missing = [k for k in keys if params.get(k) is None]
        if missing:
            raise fmt.BadRequest(f"kv_transfer_params with do_remote_prefill lack {', '.join(missing)}")
        host, port, rid, engine = (params["remote_host"], params["remote_port"], params["remote_request_id"],
                                   params["remote_engine_id"])
        if not (isinstance(host, str) and isinstance(rid, str) and isinstance(engine, str)
                and isinstance(port, int) and not isinstance(port, bool) and 1 <= port <= 65535):
            raise fmt.BadRequest("kv_transfer_params: remote_host, remote_request_id and remote_engine_id must be "
                                 "strings and remote_port a port number")
        return RemotePrefill(rid, host, port, engine)

    async def serve(self, request: web.Request, endpoint: fmt.Endpoint) -> web.StreamResponse:
        try:
            raw = await request.read()
            try:
                body = strict_json.loads(raw)
            except strict_json.InvalidJson as e:
                raise fmt.BadRequest(f"JSON decode error: {e}", kind="Bad Request", param="body") from None
            parsed = self._parse(body, endpoint)
            remote_prefill = self._remote_prefill(parsed.kv_transfer_params)
        except fmt.BadRequest as e:
            return error(e.status, str(e), e.kind, e.param)
        x_rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        params = parsed.kv_transfer_params or {}
        req = new_request(fmt.internal_id(endpoint, x_rid), parsed.prompt, parsed.max_tokens,
                          remote_decode=bool(params.get("do_remote_decode")), remote_prefill=remote_prefill)
        rid, created = fmt.response_id(endpoint, x_rid), int(time.time())
        try:
            await self.engine.add(req)
            if parsed.stream:
                return await self._stream(request, endpoint, parsed, req, rid, created)
            outputs: list[int] = []
            while True:
                out = await req.queue.get()
                if out.error is not None:
                    return error(500, "Internal server error", "InternalServerError")
                outputs += out.token_ids
                if out.finish is not None:
                    break
            return json_answer(fmt.completion(endpoint, self._answer(req, rid, created, outputs, out.finish)))
        finally:
            self.engine.abort(req)  # no-op once it is done; the client going away lands here too

    def _answer(self, req: Request, rid: str, created: int, outputs: list[int], finish: str | None) -> fmt.Answer:
        return fmt.Answer(rid, self.model, created, len(req.prompt), req.cached_tokens(self.engine.kv_mode),
                          req.created_blocks * self.profile.block_size, outputs, finish, req.kv_transfer_params,
                          self.fingerprint)

    async def _stream(self, request: web.Request, endpoint: fmt.Endpoint, parsed: fmt.Parsed, req: Request,
                      rid: str, created: int) -> web.StreamResponse:
        # vLLM sends its 200 and headers before the first token.
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        first = True
        outputs: list[int] = []
        while True:
            out: Output = await req.queue.get()
            if out.error is not None:
                await resp.write(fmt.sse(fmt.error_body("Internal server error", 500, "InternalServerError")))
                break
            if first and endpoint == "chat":
                await resp.write(fmt.role_chunk(rid, self.model, created))
            first = False
            outputs += out.token_ids
            await resp.write(fmt.chunk(endpoint, rid, self.model, created, out.token_ids, out.finish))
            if out.finish is not None:
                if parsed.include_usage:
                    await resp.write(fmt.usage_chunk(endpoint, self._answer(req, rid, created, outputs, out.finish)))
                break
        await resp.write(fmt.DONE)
        await resp.write_eof()
        return resp

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            body = strict_json.loads(await request.read())
        except strict_json.InvalidJson as e:
            return error(400, f"invalid JSON: {e}")
        if not isinstance(body, dict):
            return error(400, "the body must be an object")
        try:
            if "messages" in body:
                parsed = self._parse({**body, "max_tokens": 1}, "chat")
            else:
                parsed = self._parse({**body, "max_tokens": 1}, "completions")
        except fmt.BadRequest as e:
            return error(e.status, str(e), e.kind)
        return json_answer({"count": len(parsed.prompt), "max_model_len": self.profile.max_model_len,
                            "tokens": parsed.prompt, "token_strs": None})

    async def models(self, _request: web.Request) -> web.Response:
        return json_answer(fmt.models(self.model, self.profile.max_model_len, self.profile.name, self.created))

    async def health(self, _request: web.Request) -> web.Response:
        return web.Response(status=503 if self.stopping else 200)

    async def metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.engine.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY, middlewares=[_errors])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.on_response_prepare.append(_server_header)
        return app


def json_answer(obj: Any, status: int = 200) -> web.Response:
    """JSON as vLLM's server sends it (`application/json`, no charset parameter)."""
    return web.Response(body=json.dumps(obj, separators=(",", ":")).encode(), status=status,
                        content_type="application/json")


def error(status: int, message: str, kind: str = "BadRequestError", param: str | None = None) -> web.Response:
    return json_answer(fmt.error_body(message, status, kind, param), status)


async def _server_header(_request: web.Request, response: web.StreamResponse) -> None:
    response.headers["Server"] = contract.OWNER


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own refusals as JSON (FastAPI's `{"detail": ...}`, as vLLM answers them), a too-large body as a
    413, and a crash as a logged 500: never a stack trace to the client."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return json_answer({"detail": e.reason}, e.status)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("engine emulator: unexpected error in %s %s", request.method, request.path)
        return error(500, "Internal server error", "InternalServerError")
