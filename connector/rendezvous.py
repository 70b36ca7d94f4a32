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
import hashlib
import hmac
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from pydantic import ValidationError

from .advertisement import (ROLES, EngineAdvertisement, EngineList, ErrorResponse, RegisterResponse, WatchEvent,
                            check_engine_id)
from .registry import Conflict, NotFound, Registration, Registry, RegistryFull

log = logging.getLogger("disagg.rendezvous")

DEFAULT_PORT = 8080
DEFAULT_HEARTBEAT = 5.0
DEFAULT_AUDIENCE = "disagg-rendezvous"
MAX_BODY = 8 * 1024 * 1024  # a 4 MiB kv_metadata blob, JSON-escaped, plus the rest
TOKEN_ENV = "DISAGG_RENDEZVOUS_TOKEN"
AUDIENCE_ENV = "DISAGG_RENDEZVOUS_AUDIENCE"
SA_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"
POD_UID_EXTRA = "authentication.kubernetes.io/pod-uid"
EPOCH_HEADER = "X-Disagg-Epoch"
HEARTBEAT_HEADER = "X-Disagg-Heartbeat-Seconds"
NDJSON = "application/x-ndjson"


class HttpError(Exception):
    """A rejected request: rendered as an ErrorResponse and counted under rejected_requests_total{reason}."""

    def __init__(self, status: int, reason: str, message: str, details: list[dict[str, Any]] | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.reason, self.message, self.details, self.headers = status, reason, message, details, headers


def _unauthenticated(message: str) -> HttpError:
    return HttpError(401, "unauthenticated", message, headers={"WWW-Authenticate": 'Bearer realm="disagg-rendezvous"'})


def _forbidden(message: str) -> HttpError:
    return HttpError(403, "forbidden", message)


# ---- authentication ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Identity:
    """Who sent a write. Pod fields are set only by the Kubernetes authenticator (from the token's claims)."""

    subject: str
    pod_name: str | None = None
    pod_uid: str | None = None


def bearer_token(request: web.Request) -> str:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if not header:
        raise _unauthenticated("missing Authorization: Bearer <token> header (writes need a token)")
    if scheme.lower() != "bearer" or not token.strip():
        raise _unauthenticated("Authorization header must be 'Bearer <token>'")
    return token.strip()


class Authenticator:
    mode = "base"

    async def authenticate(self, request: web.Request) -> Identity:
        raise NotImplementedError

    def authorize_advertisement(self, identity: Identity, adv: EngineAdvertisement) -> None:
        """Raise 403 unless `identity` may publish `adv`."""

    def authorize_entry(self, identity: Identity, stored: EngineAdvertisement) -> None:
        """Raise 403 unless `identity` may renew or delete the stored entry."""

    async def close(self) -> None:
        pass


class NoAuth(Authenticator):
    """Anyone may write. Only when chosen explicitly (`--auth none`, e.g. for benchmarks)."""

    mode = "none"

    async def authenticate(self, request: web.Request) -> Identity:
        return Identity("anonymous")


class TokenAuth(Authenticator):
    """One shared secret for every writer (local runs)."""

    mode = "token"

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("--auth token needs a non-empty token (--token or $" + TOKEN_ENV + ")")
        self._token = token.encode()

    async def authenticate(self, request: web.Request) -> Identity:
        if not hmac.compare_digest(bearer_token(request).encode(), self._token):
            raise _unauthenticated("invalid token")
        return Identity("token")


TokenReviewer = Callable[[str, list[str] | None], Awaitable[dict[str, Any]]]
"""(token, audiences) -> TokenReview status as a dict: authenticated, user{username, extra}, audiences, error."""


def lightkube_reviewer(kubeconfig: str | os.PathLike | None = None) -> tuple[TokenReviewer, Callable[[], Awaitable[None]]]:
    """A TokenReviewer posting authentication.k8s.io/v1 TokenReviews with lightkube's AsyncClient (in-cluster
    config, else `kubeconfig`, else $KUBECONFIG), and a coroutine that closes the client."""
    state: dict[str, Any] = {}

    def client():
        if "client" not in state:
            from lightkube import AsyncClient, KubeConfig

            config = KubeConfig.from_file(kubeconfig) if kubeconfig else KubeConfig.from_env()
            state["client"] = AsyncClient(config)
        return state["client"]

    async def review(token: str, audiences: list[str] | None) -> dict[str, Any]:
        from lightkube.models.authentication_v1 import TokenReviewSpec
        from lightkube.resources.authentication_v1 import TokenReview

        result = await client().create(TokenReview(spec=TokenReviewSpec(token=token, audiences=audiences)))
        return result.status.to_dict() if result.status is not None else {}

    async def close() -> None:
        if "client" in state:
            await state.pop("client").close()

    return review, close


def pod_name_pattern(deployment: str) -> re.Pattern[str]:
    """Pods of a deployment's engine StatefulSets: <deployment>-<role>-<ordinal> (or -<group>-<worker>)."""
    return re.compile(rf"^{re.escape(deployment)}-(?P<role>prefill|decode)-\d+(-\d+)?$")


class KubernetesAuth(Authenticator):
    """A pod-bound ServiceAccount token, verified with a TokenReview.

    Accepted when: the review says authenticated (for `audience`, if set); the user is a ServiceAccount of
    `namespace`; the token is bound to a pod (user.extra pod-name and pod-uid) named
    <deployment>-(prefill|decode)-<ordinal>; and the advertisement names that same pod, role and deployment.
    Results are cached by token hash (success for `cache_seconds`, rejections for `negative_cache_seconds`) so
    renewals cost no API call."""

    mode = "kubernetes"

    def __init__(self, *, deployment: str, namespace: str, reviewer: TokenReviewer,
                 close: Callable[[], Awaitable[None]] | None = None, audience: str | None = DEFAULT_AUDIENCE,
                 cache_seconds: float = 60.0, negative_cache_seconds: float = 5.0, cache_size: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not deployment or not namespace:
            raise ValueError("--auth kubernetes needs the deployment (--deployment or $DISAGG_DEPLOYMENT) and the "
                             "namespace (--namespace, $POD_NAMESPACE or the in-cluster ServiceAccount)")
        self.deployment, self.namespace, self.audience = deployment, namespace, audience or None
        self._review, self._close = reviewer, close
        self._pods = pod_name_pattern(deployment)
        self._sa_prefix = f"system:serviceaccount:{namespace}:"
        self.cache_seconds, self.negative_cache_seconds, self.cache_size = cache_seconds, negative_cache_seconds, cache_size
        self.clock = clock
        self._cache: dict[str, tuple[float, Identity | HttpError]] = {}
        self.reviews = 0  # TokenReviews sent (tests, debugging)

    def _remember(self, key: str, value: Identity | HttpError, ttl: float) -> None:
        now = self.clock()
        if len(self._cache) >= self.cache_size:
            for k in [k for k, (exp, _) in self._cache.items() if exp <= now]:
                del self._cache[k]
            while len(self._cache) >= self.cache_size:
                del self._cache[next(iter(self._cache))]
        self._cache[key] = (now + ttl, value)

    async def authenticate(self, request: web.Request) -> Identity:
        token = bearer_token(request)
        key = hashlib.sha256(token.encode()).hexdigest()
        hit = self._cache.get(key)
        if hit is not None and hit[0] > self.clock():
            if isinstance(hit[1], HttpError):
                raise hit[1]
            return hit[1]
        try:
            self.reviews += 1
            status = await self._review(token, [self.audience] if self.audience else None)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the apiserver is down or refuses us: not the caller's fault, so not a 401
            log.warning("TokenReview failed: %s", e)
            raise HttpError(503, "auth_unavailable", f"cannot verify the token now (TokenReview failed: "
                            f"{type(e).__name__}); retry later", headers={"Retry-After": "1"}) from None
        try:
            identity = self._identity(status)
        except HttpError as e:
            self._remember(key, e, self.negative_cache_seconds)
            raise
        self._remember(key, identity, self.cache_seconds)
        return identity

    def _identity(self, status: dict[str, Any]) -> Identity:
        if not status.get("authenticated"):
            raise _unauthenticated("token not authenticated by the Kubernetes API"
                                   + (f" (audience {self.audience})" if self.audience else ""))
        if self.audience and self.audience not in (status.get("audiences") or []):
            raise _unauthenticated(f"token is not valid for audience {self.audience!r}")
        user = status.get("user") or {}
        username = user.get("username") or ""
        if not username.startswith("system:serviceaccount:"):
            raise _forbidden(f"user {username!r} is not a ServiceAccount")
        if not username.startswith(self._sa_prefix):
            raise _forbidden(f"ServiceAccount {username!r} is not in namespace {self.namespace!r}")
        extra = user.get("extra") or {}
        pod_names, pod_uids = extra.get(POD_NAME_EXTRA) or [], extra.get(POD_UID_EXTRA) or []
        if len(pod_names) != 1 or len(pod_uids) != 1:
            raise _forbidden("token is not bound to a pod (use the pod's projected ServiceAccount token)")
        pod_name, pod_uid = pod_names[0], pod_uids[0]
        if not self._pods.match(pod_name):
            raise _forbidden(f"pod {pod_name!r} is not an engine of deployment {self.deployment!r} "
                             f"(expected {self.deployment}-prefill-N or {self.deployment}-decode-N)")
        return Identity(username, pod_name, pod_uid)

    def authorize_advertisement(self, identity: Identity, adv: EngineAdvertisement) -> None:
        if adv.pod_name != identity.pod_name or adv.pod_uid != identity.pod_uid:
            raise _forbidden(f"the token belongs to pod {identity.pod_name} (uid {identity.pod_uid}), the "
                             f"advertisement names pod {adv.pod_name} (uid {adv.pod_uid})")
        match = self._pods.match(identity.pod_name or "")
        if match is None or match["role"] != adv.role:
            raise _forbidden(f"pod {identity.pod_name} may not advertise a {adv.role} engine")

    def authorize_entry(self, identity: Identity, stored: EngineAdvertisement) -> None:
        if stored.pod_name != identity.pod_name or stored.pod_uid != identity.pod_uid:
            raise _forbidden(f"engine {stored.engine_id} belongs to pod {stored.pod_name}, not {identity.pod_name}")

    async def close(self) -> None:
        if self._close is not None:
            await self._close()


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
def _json(model, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=model.model_dump_json(exclude_none=True).encode(),
                        content_type="application/json", headers=headers)


def _loc(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc) or "body"


def parse_advertisement(body: bytes) -> EngineAdvertisement:
    try:
        data = json.loads(body)
    except RecursionError:
        raise HttpError(400, "invalid_json", "invalid JSON: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
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
            web.get("/v1/watch", self.watch),
            web.get("/health", self.health),
            web.get("/metrics", self.metrics_handler),
        ])
        app.cleanup_ctx.append(self._background)
        app.on_shutdown.append(self._on_shutdown)
        return app

    async def _background(self, app: web.Application):
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
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
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
        adv = parse_advertisement(await request.read())
        if adv.engine_id != engine_id:
            raise HttpError(400, "id_mismatch", f"path engine id {engine_id!r} differs from the body's engine_id "
                            f"{adv.engine_id!r}")
        if self.deployment is not None and adv.deployment != self.deployment:
            raise _forbidden(f"this rendezvous serves deployment {self.deployment!r}, not {adv.deployment!r}")
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
        ev = self.registry.deregister(engine_id)
        self.metrics.deregistrations.inc()
        self.metrics.update(self.registry)
        log.info("engine %s deregistered", ev.engine.engine_id)
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
            while not registry.closed:
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
    deployment = args.deployment or os.environ.get("DISAGG_DEPLOYMENT") or None
    if args.auth == "none":
        log.warning("--auth none: anyone who reaches this port can register engines")
        auth: Authenticator = NoAuth()
    elif args.auth == "token":
        auth = TokenAuth(args.token or os.environ.get(TOKEN_ENV, ""))
    else:
        audience = args.audience if args.audience is not None else os.environ.get(AUDIENCE_ENV, DEFAULT_AUDIENCE)
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
