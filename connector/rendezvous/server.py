"""`disagg rendezvous`: where engines advertise themselves and routers watch them (aiohttp).

Soft state only: the registry lives in memory, entries live under leases that engines renew every heartbeat,
and a restarted rendezvous rebuilds itself from the next round of renewals. During the first two heartbeats
after a start it reports `warming: true`, so routers keep the engines they already know meanwhile.

HTTP API (JSON; every error is an `ErrorResponse` with a 4xx/5xx status, never a crash):

    PUT    /v1/engines/{engine_id}        register or update (body: EngineAdvertisement) -> 201/200 RegisterResponse
    POST   /v1/engines/{engine_id}/renew  extend the lease without resending the body -> 200, 404 if unknown
    DELETE /v1/engines/{engine_id}        deregister -> 204, 404 if unknown
    GET    /v1/engines[?role=&layout_key=]  -> EngineList
    GET    /v1/engines/{engine_id}        -> EngineAdvertisement, 404 if unknown
    GET    /v1/watch[?since=N&epoch=E]    newline-delimited WatchEvents, open-ended (see WatchEvent)
    GET    /health, GET /metrics

Writes (PUT, POST, DELETE) need `Authorization: Bearer <token>`: a shared token (`--auth token`), or a pod-bound
ServiceAccount token verified with a TokenReview (`--auth kubernetes`). Reads need none.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from pydantic import BaseModel, ValidationError

from ..wire import env as wire_env
from ..wire import strict_json
from ..wire.advertisement import (
    EngineAdvertisement,
    EngineList,
    ErrorResponse,
    RegisterResponse,
    WatchEvent,
    check_engine_id,
)
from ..wire.env import ROLES
from .auth import Authenticator, KubernetesAuth, NoAuth, TokenAuth, lightkube_reviewer
from .errors import HttpError, forbidden
from .registry import Conflict, NotFound, Registration, Registry, RegistryFull

log = logging.getLogger("disagg.rendezvous")

DEFAULT_PORT = wire_env.RENDEZVOUS_PORT
DEFAULT_HEARTBEAT = wire_env.DEFAULT_HEARTBEAT_SECONDS
MAX_BODY = 8 * 1024 * 1024  # a 4 MiB kv_metadata blob, JSON-escaped, plus the rest
MAX_DEPTH = 64  # of an advertisement, kv_metadata included (the plugin's kv_metadata nests 3 levels)
AUDIENCE_ENV = "DISAGG_RENDEZVOUS_AUDIENCE"
SA_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
EPOCH_HEADER = "X-Disagg-Epoch"
HEARTBEAT_HEADER = "X-Disagg-Heartbeat-Seconds"
NDJSON = "application/x-ndjson"


# ---- metrics -------------------------------------------------------------------------------------------------
class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        p = "disagg_rendezvous_"
        self.entries = Gauge(p + "entries", "Registered engines", ["role"], registry=r)
        self.registrations = Counter(p + "registrations", "New engines registered (ADDED)", registry=r)
        self.modifications = Counter(p + "modifications", "Re-registrations with changed content (MODIFIED)",
                                     registry=r)
        self.renewals = Counter(p + "renewals", "Lease renewals without a change", registry=r)
        self.expiries = Counter(p + "expiries", "Entries removed because their lease expired", registry=r)
        self.deregistrations = Counter(p + "deregistrations", "Entries removed by DELETE or replaced by a newer "
                                       "engine of the same pod", registry=r)
        self.watch_clients = Gauge(p + "watch_clients", "Open watch streams", registry=r)
        self.rejected = Counter(p + "rejected_requests", "Requests answered with an error", ["reason"], registry=r)
        self.version = Gauge(p + "version", "Registry version", registry=r)
        for role in ROLES:
            self.entries.labels(role).set(0)

    def update(self, registry: Registry) -> None:
        for role, n in registry.counts_by_role().items():
            self.entries.labels(role).set(n)
        self.version.set(registry.version)


# ---- the server ----------------------------------------------------------------------------------------------
def _json(model: BaseModel, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=model.model_dump_json(exclude_none=True).encode(),
                        content_type="application/json", headers=headers)


def _loc(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc) or "body"


def parse_advertisement(body: bytes) -> EngineAdvertisement:
    try:
        data = strict_json.loads(body, max_depth=MAX_DEPTH)
    except strict_json.InvalidJson as e:
        raise HttpError(400, "invalid_json", f"invalid JSON: {e}") from None
    if not isinstance(data, dict):
        raise HttpError(422, "invalid_body", f"body must be a JSON object (an EngineAdvertisement), got "
                        f"{type(data).__name__}")
    try:
        return EngineAdvertisement.model_validate(data)
    except ValidationError as e:
        details = [{"loc": _loc(err["loc"]), "msg": err["msg"], "type": err["type"]} for err in e.errors()[:20]]
        summary = "; ".join(f"{d['loc']}: {d['msg']}" for d in details[:5])
        raise HttpError(422, "invalid_body", f"invalid EngineAdvertisement: {summary}", details) from None
    except RecursionError:
        raise HttpError(422, "invalid_body", "invalid EngineAdvertisement: nested too deeply") from None


class RendezvousServer:
    """The rendezvous as an aiohttp application. `start()`/`stop()` serve it on a port (tests, tools); the
    command serves `app` with `web.run_app`."""

    def __init__(self, *, auth: Authenticator, heartbeat_seconds: float = DEFAULT_HEARTBEAT,
                 deployment: str | None = None, registry: Registry | None = None,
                 clock: Callable[[], float] = time.monotonic, expire_interval: float | None = None,
                 warmup_seconds: float | None = None, max_body: int = MAX_BODY, log_size: int = 1024,
                 max_engines: int = 4096) -> None:
        if heartbeat_seconds <= 0:
            raise ValueError("heartbeat_seconds must be > 0")
        self.auth = auth
        self.heartbeat_seconds = heartbeat_seconds
        self.deployment = deployment or None
        self.registry = registry if registry is not None else Registry(
            clock=clock, log_size=log_size, max_engines=max_engines,
            warmup_seconds=2 * heartbeat_seconds if warmup_seconds is None else warmup_seconds)
        # At least every second, and often enough that an expiry reaches watchers well within a heartbeat.
        self.expire_interval = expire_interval or min(1.0, heartbeat_seconds / 4)
        self.max_body = max_body
        self.metrics = Metrics()
        self.app = self._make_app()
        self._runner: web.AppRunner | None = None
        self.url: str | None = None

    # -- lifecycle --
    def _make_app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body, middlewares=[self._errors])
        app.add_routes([
            web.put("/v1/engines/{engine_id}", self.put_engine),
            web.post("/v1/engines/{engine_id}/renew", self.renew_engine),
            web.delete("/v1/engines/{engine_id}", self.delete_engine),
            web.get("/v1/engines", self.list_engines),
            web.get("/v1/engines/{engine_id}", self.get_engine),
            # No HEAD: a stream cannot answer one (aiohttp would send the events as a body no client expects).
            web.get("/v1/watch", self.watch, allow_head=False),
            web.get("/health", self.health),
            web.get("/metrics", self.metrics_handler),
        ])
        app.cleanup_ctx.append(self._background)
        app.on_shutdown.append(self._on_shutdown)
        return app

    async def _background(self, app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(self._expiry_loop(), name="rendezvous-expiry")
        yield
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        await self.auth.close()

    async def _on_shutdown(self, app: web.Application) -> None:
        self.registry.close()  # ends every watch stream

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on host:port (0: a free port); returns the base URL."""
        self._runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=2.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = self._runner.addresses[0]
        self.url = f"http://{host if ':' not in host else f'[{host}]'}:{bound[1]}"
        log.info("rendezvous listening on %s (auth %s, heartbeat %ss)", self.url, self.auth.mode,
                 self.heartbeat_seconds)
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- expiry --
    def expire_now(self) -> list[WatchEvent]:
        events = self.registry.expire()
        for ev in events:
            self.metrics.expiries.inc()
            assert ev.engine is not None  # EXPIRED events name their engine
            log.info("engine %s (%s) expired", ev.engine.engine_id, ev.engine.role)
        if events:
            self.metrics.update(self.registry)
        return events

    async def _expiry_loop(self) -> None:
        while True:
            try:
                self.expire_now()
            except Exception:  # never let the reaper die
                log.exception("expiry pass failed")
            delay = self.expire_interval
            deadline = self.registry.next_deadline()
            if deadline is not None:
                delay = min(delay, max(0.01, deadline - self.registry.clock()))
            await asyncio.sleep(delay)

    # -- middleware --
    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except HttpError as e:
            err = e
        except web.HTTPException as e:
            if e.status < 400:
                raise
            reason = {404: "not_found", 405: "not_allowed", 413: "too_large"}.get(e.status, "bad_request")
            message = e.text or e.reason
            if e.status == 413:
                message = f"request body is larger than client_max_size ({self.max_body} bytes)"
            passthrough = {k: v for k, v in e.headers.items() if k.lower() in ("allow", "www-authenticate")}
            err = HttpError(e.status, reason, message, headers=passthrough)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            log.exception("unexpected error in %s %s", request.method, request.path)
            err = HttpError(500, "internal", "internal error (see the rendezvous log)")
        self.metrics.rejected.labels(err.reason).inc()
        if err.status >= 500 or err.status in (401, 403, 409):
            log.info("%s %s -> %d %s", request.method, request.path, err.status, err.message)
        return _json(ErrorResponse(error=err.message, reason=err.reason, details=err.details), err.status, err.headers)

    # -- helpers --
    @staticmethod
    def _path_id(request: web.Request) -> str:
        engine_id = request.match_info["engine_id"]
        try:
            return check_engine_id(engine_id)
        except ValueError as e:
            raise HttpError(400, "bad_parameter", f"path: {e}") from None

    def _stored_or_404(self, engine_id: str) -> EngineAdvertisement:
        stored = self.registry.get(engine_id)
        if stored is None:
            raise HttpError(404, "not_found", f"engine {engine_id!r} is not registered")
        return stored

    def _response(self, reg: Registration) -> RegisterResponse:
        return RegisterResponse(version=reg.version, result=reg.result, engine=reg.engine,
                                expires_in=max(0.0, reg.expires_at - self.registry.clock()))

    # -- handlers --
    async def put_engine(self, request: web.Request) -> web.Response:
        engine_id = self._path_id(request)
        identity = await self.auth.authenticate(request)
        if request.content_length is not None and request.content_length > self.max_body:
            # Said by the header: refused before reading, or the read would wait for bytes that never come.
            raise HttpError(413, "too_large", f"request body is larger than client_max_size ({self.max_body} bytes)")
        adv = parse_advertisement(await request.read())
        if adv.engine_id != engine_id:
            raise HttpError(400, "id_mismatch", f"path engine id {engine_id!r} differs from the body's engine_id "
                            f"{adv.engine_id!r}")
        if self.deployment is not None and adv.deployment != self.deployment:
            raise forbidden(f"this rendezvous serves deployment {self.deployment!r}, not {adv.deployment!r}")
        self.auth.authorize_advertisement(identity, adv)
        try:
            reg = self.registry.register(adv)
        except Conflict as e:
            raise HttpError(409, "conflict", str(e)) from None
        except RegistryFull as e:
            raise HttpError(429, "registry_full", str(e), headers={"Retry-After": str(int(self.heartbeat_seconds))}) \
                from None
        for ev in reg.events:
            if ev.type == "DELETED":
                assert ev.engine is not None
                self.metrics.deregistrations.inc()
                log.info("engine %s replaced by %s (same pod %s)", ev.engine.engine_id, adv.engine_id, adv.pod_name)
        {"created": self.metrics.registrations, "modified": self.metrics.modifications,
         "renewed": self.metrics.renewals}[reg.result].inc()
        if reg.result != "renewed":
            log.info("engine %s %s: %s %s layout %s", adv.engine_id, reg.result, adv.role, adv.http_url, adv.layout_key)
            self.metrics.update(self.registry)
        return _json(self._response(reg), 201 if reg.result == "created" else 200)

    async def renew_engine(self, request: web.Request) -> web.Response:
        engine_id = self._path_id(request)
        identity = await self.auth.authenticate(request)
        self.auth.authorize_entry(identity, self._stored_or_404(engine_id))
        try:
            reg = self.registry.renew(engine_id)
        except NotFound as e:
            raise HttpError(404, "not_found", str(e)) from None
        self.metrics.renewals.inc()
        return _json(self._response(reg))

    async def delete_engine(self, request: web.Request) -> web.Response:
        engine_id = self._path_id(request)
        identity = await self.auth.authenticate(request)
        self.auth.authorize_entry(identity, self._stored_or_404(engine_id))
        self.registry.deregister(engine_id)
        self.metrics.deregistrations.inc()
        self.metrics.update(self.registry)
        log.info("engine %s deregistered", engine_id)
        return web.Response(status=204)

    async def get_engine(self, request: web.Request) -> web.Response:
        return _json(self._stored_or_404(self._path_id(request)))

    async def list_engines(self, request: web.Request) -> web.Response:
        role = request.query.get("role") or None
        if role is not None and role not in ROLES:
            raise HttpError(400, "bad_parameter", f"role must be one of {', '.join(ROLES)}, got {role!r}")
        engines = self.registry.engines(role=role, layout_key=request.query.get("layout_key") or None)
        return _json(EngineList(version=self.registry.version, epoch=self.registry.epoch,
                                warming=self.registry.warming(), engines=engines))

    async def health(self, request: web.Request) -> web.Response:
        r = self.registry
        return web.json_response({"status": "ok", "engines": len(r), "version": r.version, "epoch": r.epoch,
                                  "warming": r.warming(), "auth": self.auth.mode})

    async def metrics_handler(self, request: web.Request) -> web.Response:
        self.metrics.update(self.registry)
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def watch(self, request: web.Request) -> web.StreamResponse:
        raw_since = request.query.get("since")
        since: int | None = None
        if raw_since not in (None, ""):
            try:
                since = int(raw_since)
                if since < 0:
                    raise ValueError
            except ValueError:
                raise HttpError(400, "bad_parameter", f"since must be a non-negative integer, got {raw_since!r}") \
                    from None
        epoch = request.query.get("epoch") or None
        registry = self.registry
        resp = web.StreamResponse(headers={
            "Content-Type": NDJSON, "Cache-Control": "no-cache", EPOCH_HEADER: registry.epoch,
            HEARTBEAT_HEADER: str(self.heartbeat_seconds)})
        await resp.prepare(request)
        self.metrics.watch_clients.inc()
        loop = asyncio.get_running_loop()

        async def send(events: list[WatchEvent]) -> None:
            if events:
                await resp.write(b"".join(ev.model_dump_json(exclude_none=True).encode() + b"\n" for ev in events))

        try:
            changes = registry.changes_since(since, epoch)
            await send([*changes.events, registry.control("BOOKMARK")])
            last, last_bookmark = changes.version, loop.time()
            while True:  # until the registry closes (server shutdown)
                wait = max(0.0, last_bookmark + self.heartbeat_seconds - loop.time())
                await registry.wait(last, wait)
                if registry.closed:
                    break
                out: list[WatchEvent] = []
                reset = False
                if registry.version > last:
                    changes = registry.changes_since(last, registry.epoch)
                    out, last, reset = changes.events, changes.version, changes.reset
                if reset or loop.time() - last_bookmark >= self.heartbeat_seconds:
                    out.append(registry.control("BOOKMARK"))
                    last_bookmark = loop.time()
                await send(out)
        except (ConnectionResetError, ConnectionError) as e:
            log.debug("watch client went away: %s", e)
        finally:
            self.metrics.watch_clients.dec()
        return resp


# ---- command line (flags: cli/cli.py) ------------------------------------------------------------------------
def _namespace(explicit: str | None) -> str | None:
    if explicit:
        return explicit
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        return Path(SA_NAMESPACE_FILE).read_text().strip() or None
    except OSError:
        return None


def build_server(args: argparse.Namespace) -> RendezvousServer:
    """The server described by the command-line arguments; raises ValueError for an unusable combination."""
    deployment = args.deployment or os.environ.get(wire_env.DEPLOYMENT) or None
    if args.auth == "none":
        log.warning("--auth none: anyone who reaches this port can register engines")
        auth: Authenticator = NoAuth()
    elif args.auth == "token":
        auth = TokenAuth(args.token or os.environ.get(wire_env.RENDEZVOUS_TOKEN, ""))
    else:
        audience = args.audience if args.audience is not None else os.environ.get(AUDIENCE_ENV, wire_env.TOKEN_AUDIENCE)
        review, close = lightkube_reviewer(args.kubeconfig)
        auth = KubernetesAuth(deployment=deployment or "", namespace=_namespace(args.namespace) or "",
                              reviewer=review, close=close, audience=audience)
    return RendezvousServer(auth=auth, heartbeat_seconds=args.heartbeat_seconds, deployment=deployment)


def main(args: argparse.Namespace) -> None:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        server = build_server(args)
    except ValueError as e:
        raise SystemExit(f"disagg rendezvous: {e}") from None
    log.info("rendezvous on %s:%d, auth %s, deployment %s, heartbeat %ss", args.host, args.port, server.auth.mode,
             server.deployment or "(any)", server.heartbeat_seconds)
    web.run_app(server.app, host=args.host, port=args.port, access_log=None, shutdown_timeout=5, print=None)
