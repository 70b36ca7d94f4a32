"""The emulated KV side channel: how a prefill emulator and a decode emulator hand a request's KV over.

Real engines move KV with NIXL and talk over vLLM's ZMQ side channel and NIXL notifications. Emulators move
nothing: they exchange these small JSON messages over HTTP on the side-channel port they advertise, and the KV's
time on the link is `profile.transfer`. The messages follow the protocols an engine with the connector plugin
runs (vLLM's push and pull connectors, and the plugin's push cancel, connector/plugin/push_cancel.py):

push (decode registers, prefill WRITEs):
- decode → prefill `POST /emulator/v1/push/register`: decode holds blocks for the request and waits; the
  registration names the prefill's request by the id without vLLM's random suffix, as decode's params do;
- prefill → decode `POST /emulator/v1/push/written` once its prefill has finished and the WRITE has taken its
  time; registration and finish may come in either order;
- decode → prefill `POST /emulator/v1/push/cancel` when the decode request is aborted or its registration times
  out: the prefill drops the registration and refuses any later WRITE of it; its answer is the plugin's `ack`
  (no WRITE of the request is in flight any more), after which the decode frees the blocks.

pull (prefill answers, decode READs):
- decode → prefill `POST /emulator/v1/pull/read`: answered 200 once the READ has taken its time (the prefill then
  frees its blocks), 404 when the prefill no longer holds them (its lease ran out).

Every body is strict JSON of the models below; anything else is a 400, never a crash.
"""
from __future__ import annotations

import logging
from typing import Protocol

import aiohttp
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..wire import strict_json

log = logging.getLogger("disagg.emulator.side_channel")
PREFIX = "/emulator/v1"


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class PushRegistration(Message):
    remote_request_id: str = Field(min_length=1, max_length=1024)
    """The prefill's request, by the id without vLLM's random suffix (decode's `remote_request_id`)."""
    request_id: str = Field(min_length=1, max_length=1024)
    """The decode's own request id."""
    engine_id: str = Field(min_length=1, max_length=512)
    host: str = Field(min_length=1, max_length=253)
    port: int = Field(ge=1, le=65535)
    """Where the decode's side channel answers (`written`)."""
    tokens: int = Field(ge=0)
    """Prompt tokens the decode lacks (it has the rest in its prefix cache): what the WRITE moves."""
    deadline: float = Field(allow_inf_nan=False)
    """Wall-clock time after which the decode no longer waits (its registration timeout)."""


class PushWritten(Message):
    request_id: str = Field(min_length=1, max_length=1024)
    tokens: int = Field(ge=0)
    seconds: float = Field(ge=0, allow_inf_nan=False)
    """How long the WRITE took (for the decode's own log; vLLM counts transfer time on the side that drives it)."""


class PushCancel(Message):
    remote_request_id: str = Field(min_length=1, max_length=1024)
    request_id: str = Field(min_length=1, max_length=1024)


class PullRead(Message):
    remote_request_id: str = Field(min_length=1, max_length=1024)
    """The prefill's request id as its answer's kv_transfer_params named it (with vLLM's suffix)."""
    tokens: int = Field(ge=0)


class Peer(Protocol):
    """What the side channel asks of the engine behind it."""

    def push_register(self, reg: PushRegistration) -> None: ...

    async def push_cancel(self, msg: PushCancel) -> None: ...

    def push_written(self, msg: PushWritten) -> bool: ...

    async def pull_read(self, msg: PullRead) -> bool: ...


def app(peer: Peer) -> web.Application:
    async def parse(request: web.Request, model: type[Message]) -> Message:
        try:
            return model.model_validate(strict_json.loads(await request.read()))
        except (strict_json.InvalidJson, ValidationError) as e:
            raise web.HTTPBadRequest(text=f"not a {model.__name__}: {str(e)[:500]}") from None

    async def register(request: web.Request) -> web.Response:
        peer.push_register(await parse(request, PushRegistration))  # type: ignore[arg-type]
        return web.Response(status=202)

    async def cancel(request: web.Request) -> web.Response:
        await peer.push_cancel(await parse(request, PushCancel))  # type: ignore[arg-type]
        return web.Response(status=200)

    async def written(request: web.Request) -> web.Response:
        known = peer.push_written(await parse(request, PushWritten))  # type: ignore[arg-type]
        return web.Response(status=200 if known else 404)

    async def read(request: web.Request) -> web.Response:
        held = await peer.pull_read(await parse(request, PullRead))  # type: ignore[arg-type]
        return web.Response(status=200 if held else 404)

    a = web.Application(client_max_size=64 * 1024)
    a.router.add_post(f"{PREFIX}/push/register", register)
    a.router.add_post(f"{PREFIX}/push/cancel", cancel)
    a.router.add_post(f"{PREFIX}/push/written", written)
    a.router.add_post(f"{PREFIX}/pull/read", read)
    return a


class SideChannelError(Exception):
    """The peer could not be reached, or refused the message (status None when unreachable)."""

    def __init__(self, status: int | None, detail: str) -> None:
        super().__init__(f"{status or 'unreachable'}: {detail}")
        self.status = status


class Client:
    """Sends side-channel messages to other emulators (one pooled session)."""

    def __init__(self, timeout: float = 30.0) -> None:
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
        return self._session

    async def send(self, host: str, port: int, path: str, message: Message, timeout: float | None = None) -> int:
        """POST one message; its status. SideChannelError when unreachable or answered with a 4xx/5xx other
        than 404 (which callers read as "not held")."""
        netloc = f"[{host}]" if ":" in host else host
        try:
            async with self._http().post(f"http://{netloc}:{port}{PREFIX}{path}", data=message.model_dump_json(),
                                         headers={"Content-Type": "application/json"},
                                         timeout=aiohttp.ClientTimeout(total=timeout or self.timeout)) as r:
                body = await r.read()
                if r.status >= 400 and r.status != 404:
                    raise SideChannelError(r.status, body[:200].decode(errors="replace"))
                return r.status
        except (aiohttp.ClientError, TimeoutError) as e:
            raise SideChannelError(None, f"{type(e).__name__}: {e}") from e

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
