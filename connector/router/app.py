"""`disagg router`: the OpenAI-compatible endpoint in front of prefill and decode engines.

Push mode sends both legs at once: decode pre-registers its KV blocks with the prefill engine while the
prompt is still being computed, so prefill WRITEs the moment it finishes. That needs the prefill engine's
identity before it answers, which the rendezvous (or a static engine list) provides. Pull mode runs
prefill first, then hands its returned kv_transfer_params to decode unchanged. `--dispatch sequential`
runs push the slow way (decode after prefill), for benchmarks.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import gc
import json
import logging
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import aiohttp
import yaml
from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector
from pydantic import TypeAdapter, ValidationError

from ..wire.advertisement import EngineAdvertisement
from . import flags, kv_index
from . import pd_protocol as pd
from .access_log import AccessLog, Attempt, Prefix
from .admission import Admission, Legs, Overloaded
from .engine_pool import EnginePool
from .kv_scoring import Preference, Weights

if TYPE_CHECKING:
    from ..rendezvous.client import EngineCache, RendezvousClient
    from .kv_follow import KvFollower
    from .prefix_routing import PrefixRouting

log = logging.getLogger("disagg.router")
T = TypeVar("T")
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
PREFILL_HEADER, DECODE_HEADER = "X-Disagg-Prefill-Engine", "X-Disagg-Decode-Engine"
"""Response headers naming the engines that served a request (with X-Request-Id, the id both legs carried)."""
MAX_BODY = 16 << 20
"""The largest request body the router reads (a long prompt as token ids fits many times over)."""
_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("disagg_router_requests_total", "Requests by mode, endpoint and HTTP status",
                                ["mode", "endpoint", "status"], registry=r)
        self.ttft = Histogram("disagg_router_ttft_seconds", "Router receipt to the first token sent to the client",
                              ["mode"], buckets=_LATENCY, registry=r)
        self.handoff = Histogram("disagg_router_handoff_seconds",
                                 "Prefill finished to decode's first token (the KV handoff)", ["mode"],
                                 buckets=_LATENCY, registry=r)
        self.decode_early = Counter("disagg_router_decode_before_prefill_done_total",
                                    "Decode legs that reached their engine before prefill finished (what makes "
                                    "push fast)", ["mode"], registry=r)
        self.decode_legs = Counter("disagg_router_decode_legs_total", "Decode legs sent", ["mode"], registry=r)
        self.upstream_errors = Counter("disagg_router_upstream_errors_total", "Failed upstream calls",
                                       ["role", "kind"], registry=r)
        self.retries = Counter("disagg_router_prefill_retries_total", "Requests retried on another prefill",
                               registry=r)
        self.decode_retries = Counter("disagg_router_decode_retries_total",
                                      "Requests retried on another pair after their decode engine failed before "
                                      "answering (a stopping or dead decode)", registry=r)
        self.engines = Gauge("disagg_router_engines", "Engines known, by role and state", ["role", "state"],
                             registry=r)
        self.pair_waiting = Gauge("disagg_router_pair_waiting", "Requests held for a prefill/decode pair while none "
                                  "is available (up to --pair-wait-seconds): demand a fleet scaled to zero cannot "
                                  "serve yet", registry=r)


class AdmissionMetrics(Collector):
    """Overload protection's state, read at scrape time (the autoscaling planner reads these too)."""

    def __init__(self, admission: Admission) -> None:
        self.a = admission

    def collect(self) -> list[Metric]:
        a = self.a
        legs = GaugeMetricFamily("disagg_router_inflight_legs", "Legs in flight, summed over each role's engines "
                                 "(a prefill leg until prefill answers, a decode leg until its answer ends)",
                                 labels=["role"])
        for role, n in sorted(a.legs_by_role().items()):
            legs.add_metric([role], n)
        limits = GaugeMetricFamily("disagg_router_inflight_limit", "The bounds on requests in flight (total) and on "
                                   "legs in flight per engine (per_engine); 0 is no bound", labels=["scope"])
        limits.add_metric(["total"], a.max_inflight or 0)
        limits.add_metric(["per_engine"], a.max_per_engine or 0)
        rejected = CounterMetricFamily("disagg_router_rejected", "Requests refused with 429: the wait queue was "
                                       "full (queue_full) or no slot freed within its deadline (deadline)",
                                       labels=["reason"])
        for reason, n in a.rejected.items():
            rejected.add_metric([reason], n)
        return [
            GaugeMetricFamily("disagg_router_inflight_requests", "Requests admitted and not finished",
                              value=a.in_flight),
            legs, limits,
            GaugeMetricFamily("disagg_router_queue_length", "Requests waiting for a slot", value=a.waiting),
            GaugeMetricFamily("disagg_router_queue_limit", "The most new requests that wait for a slot",
                              value=a.max_queue),
            CounterMetricFamily("disagg_router_admitted", "Requests admitted, at once or after waiting",
                                value=a.admitted),
            CounterMetricFamily("disagg_router_queued", "Requests that waited for a slot (admitted or not)",
                                value=a.queued),
            rejected,
        ]


class UpstreamFailed(Exception):
    def __init__(self, role: str, engine_id: str, kind: str, detail: str, status: int | None = None,
                 body: Any = None, *, timeout: bool = False, refused: bool = False):
        super().__init__(f"{role} engine {engine_id}: {kind}: {detail}")
        self.role, self.engine_id, self.kind, self.status, self.body = role, engine_id, kind, status, body
        self.timeout, self.refused = timeout, refused

    @classmethod
    def of(cls, role: str, engine_id: str, e: BaseException) -> UpstreamFailed:
        """`timeout`: the engine took the connection and did not answer in time (aiohttp's read timeouts are
        TimeoutError subclasses; a connect timeout is not one of these). `refused`: no connection at all."""
        timeout = isinstance(e, TimeoutError) and not isinstance(e, aiohttp.ConnectionTimeoutError)
        refused = isinstance(e, aiohttp.ClientConnectorError)
        return cls(role, engine_id, type(e).__name__, str(e) or "timeout", timeout=timeout, refused=refused)

    @property
    def client_error(self) -> bool:
        """The request's own fault, passed on as is: a 4xx, except a 404 for a path (an engine without the
        endpoint, worth another pair), 408 and 429. vLLM's 404 for a model it does not serve names its `param`."""
        if self.status == 404:
            return _param(self.body) == "model"
        return self.status is not None and 400 <= self.status < 500 and self.status not in (408, 429)

    @property
    def retryable(self) -> bool:
        """Worth one more attempt on another pair: raised before the client got any of the answer (a failure
        after that ends the stream instead), and not a read timeout (the client has waited that long already).

        A decode that fails this early is usually stopping (vLLM answers 500 once its shutdown began, before its
        engine has left the rendezvous) or gone; the retry runs both legs again with a new request id, so
        nothing of the first attempt's KV is reused."""
        return not self.client_error and not self.timeout


@dataclass
class Settings:
    mode: str = "push"
    dispatch: str = "concurrent"
    connect_timeout: float = 5.0
    request_timeout: float = 300.0
    transfer_id: bool = False
    pair_wait: float = 0.0  # seconds a request waits for a pair when none is available
    # Overload protection (connector/router/admission.py); 0 is no bound.
    max_inflight: int = flags.DEFAULT_MAX_INFLIGHT
    max_inflight_per_engine: int = flags.DEFAULT_MAX_INFLIGHT_PER_ENGINE
    max_queue: int = flags.DEFAULT_MAX_QUEUE
    queue_wait: float = flags.DEFAULT_QUEUE_WAIT_SECONDS
    served_model_name: str | None = None
    """Listed by /v1/models when no decode engine answers it; None: a 503 then."""
    retry_elsewhere: float = 5.0
    """Seconds a retry waits for a pair without the engine that failed before it takes one with it (see
    `_retry_legs`)."""
    policy: str = "least-loaded"
    """prefix-aware follows every engine's KV events into an index (kv_follow.py) and routes by what each engine
    holds (prefix_routing.py, kv_scoring.py)."""
    prefix_weights: Weights = field(default_factory=Weights)
    kv_index_max_engines: int = kv_index.DEFAULT_MAX_ENGINES
    kv_index_max_blocks_per_engine: int = kv_index.DEFAULT_MAX_BLOCKS_PER_ENGINE


PAIR_POLL_SECONDS = 0.1
ERROR_KEY = web.ResponseKey("disagg_error", str)
"""Where an error response keeps its message for the access log."""


class Router:
    def __init__(self, pool: EnginePool, settings: Settings, metrics: Metrics | None = None,
                 synced: Callable[[], bool] = lambda: True, access_log: AccessLog | None = None):
        self.pool, self.s, self.m = pool, settings, metrics or Metrics()
        self.session: aiohttp.ClientSession | None = None
        self.synced = synced  # the engine source has been read once (the rendezvous' first snapshot)
        self.access_log = access_log
        self.started = int(time.time())
        self.stopping = False  # SIGTERM came: not ready, so load balancers stop sending new connections
        self.admission = Admission(pool, max_inflight=settings.max_inflight or None,
                                   max_per_engine=settings.max_inflight_per_engine or None,
                                   max_queue=settings.max_queue, queue_wait=settings.queue_wait)
        self.m.registry.register(AdmissionMetrics(self.admission))
        self.kv: KvFollower | None = None
        self.prefix: PrefixRouting | None = None
        if settings.policy == "prefix-aware":
            self.kv = _kv_follower(pool, settings, self.m)
            self.prefix = _prefix_routing(pool, self.kv, settings, self.m)

    async def _retry_legs(self, failed: AbstractSet[str], failed_at: float,
                          prefer: Preference | None) -> Legs | None:
        """The retry's pair, within `pair_wait`: one without the engines that failed; or, once `retry_elsewhere`
        seconds have passed and a probe sent after the failure has found each of them alive, any pair, theirs
        included. An engine that outlived the failure and is still advertised is then the only one of its role (as
        in a 1P1D deployment; a stopping engine has left the rendezvous): a second try on it beats waiting the whole
        pair wait for an engine that will not come, and a 502 at its end. An engine that does not answer (killed,
        its address gone) is never tried again this way."""
        elsewhere_until = time.monotonic() + min(self.s.retry_elsewhere, self.s.pair_wait)

        def exclude() -> AbstractSet[str]:
            if time.monotonic() < elsewhere_until or not all(self.pool.answered_since(e, failed_at) for e in failed):
                return failed
            return frozenset()

        return await self._await_pair(exclude, await self.admission.admit(failed, holding=True, prefer=prefer),
                                      prefer)

    async def _await_pair(self, exclude: AbstractSet[str] | Callable[[], AbstractSet[str]], legs: Legs | None,
                          prefer: Preference | None, seconds: float | None = None) -> Legs | None:
        """`legs`, or when admission found no pair at all, a pair within `seconds` (default `pair_wait`: an engine
        restarting, the rendezvous re-learning its engines after a restart), polled: pool changes come from several
        sources (the watch, probes, failures). The request holds its request slot meanwhile; a pair found full makes it
        wait in admission's queue (Overloaded when none frees in time)."""
        wait = self.s.pair_wait if seconds is None else seconds
        if legs is not None or wait <= 0:
            return legs
        deadline = time.monotonic() + wait
        self.m.pair_waiting.inc()
        try:
            while legs is None and time.monotonic() < deadline:
                await asyncio.sleep(PAIR_POLL_SECONDS)
                legs = await self.admission.admit(exclude() if callable(exclude) else exclude, holding=True,
                                                  prefer=prefer)
        finally:
            self.m.pair_waiting.dec()
        return legs

    def _timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=None, connect=self.s.connect_timeout, sock_read=self.s.request_timeout)

    # -- upstream legs -----------------------------------------------------------------------------------
    async def _post_json(self, role: str, engine: EngineAdvertisement, path: str, body: dict[str, Any],
                         rid: str) -> Any:
        assert self.session is not None
        try:
            async with self.session.post(f"{engine.http_url}{path}", json=body, headers={"X-Request-Id": rid},
                                         timeout=self._timeout()) as r:
                text = (await r.read()).decode("utf-8", errors="replace")
                if r.status != 200:
                    raise UpstreamFailed(role, engine.engine_id, "status", f"HTTP {r.status}: {text[:300]}",
                                         r.status, _json_or_text(text))
                return json.loads(text)
        except (TimeoutError, aiohttp.ClientError, ValueError) as e:  # ValueError: not JSON
            raise UpstreamFailed.of(role, engine.engine_id, e) from e

    async def _open_decode(self, engine: EngineAdvertisement, path: str, body: dict[str, Any], rid: str,
                           tl: Attempt) -> aiohttp.ClientResponse:
        assert self.session is not None
        try:
            tl.decode_sent = time.monotonic()
            resp = await self.session.post(f"{engine.http_url}{path}", json=body, headers={"X-Request-Id": rid},
                                           timeout=self._timeout())
        except (TimeoutError, aiohttp.ClientError) as e:
            raise UpstreamFailed.of("decode", engine.engine_id, e) from e
        if resp.status != 200:
            try:
                text = (await resp.read()).decode("utf-8", errors="replace")
            except (TimeoutError, aiohttp.ClientError) as e:
                text = f"(body unreadable: {type(e).__name__})"
            resp.release()
            raise UpstreamFailed("decode", engine.engine_id, "status", f"HTTP {resp.status}: {text[:300]}",
                                 resp.status, _json_or_text(text))
        return resp

    # -- one request -------------------------------------------------------------------------------------
    async def serve(self, request: web.Request, endpoint: pd.Endpoint) -> web.StreamResponse:
        """One client request, and its access-log record whatever the outcome."""
        if self.access_log is None:
            return await self._serve(request, endpoint, [])
        wall, received = time.time(), time.monotonic()
        attempts: list[Attempt] = []
        error: str | None
        status, error = 499, "client disconnected"  # nginx's code for a client that closed first
        try:
            resp = await self._serve(request, endpoint, attempts)
            status, error = resp.status, resp.get(ERROR_KEY)
            return resp
        finally:
            self.access_log.record(time=wall, received=received, done=time.monotonic(), endpoint=endpoint,
                                   mode=self.s.mode, status=status, attempts=len(attempts),
                                   last=attempts[-1] if attempts else None, error=error)

    async def _serve(self, request: web.Request, endpoint: pd.Endpoint,
                     attempts: list[Attempt]) -> web.StreamResponse:
        try:
            body = pd.validate_client_body(endpoint, pd.parse_client_json(await _read_body(request)))
        except pd.BadRequest as e:
            return self._error(endpoint, e.status, str(e))
        prefer = None
        if self.prefix is not None and self.session is not None:
            prefer = await self.prefix.preference(self.session, endpoint, body, uuid.uuid4().hex)
        try:
            legs = await self.admission.admit(prefer=prefer)
        except Overloaded as e:
            return self._overloaded(endpoint, e)
        try:
            return await self._attempts(request, endpoint, body, attempts, legs, prefer)
        except Overloaded as e:  # its retry found no pair with room in time
            return self._overloaded(endpoint, e)
        finally:
            self.admission.leave()

    async def _attempts(self, request: web.Request, endpoint: pd.Endpoint, body: dict[str, Any],
                        attempts: list[Attempt], legs: Legs | None, prefer: Preference | None) -> web.StreamResponse:
        """At most two attempts, the first on `legs` (what admission granted), each releasing its engine slots; the
        second on another pair when one comes soon enough (`_retry_legs`)."""
        tried: set[str] = set()
        failed_at = 0.0  # when the last attempt failed (time.monotonic())
        last: UpstreamFailed | None = None
        for i in range(2):
            legs = await (self._retry_legs(tried, failed_at, prefer) if i else self._await_pair(tried, legs, prefer))
            if legs is None:
                break
            try:
                prefill, decode = legs.prefill, legs.decode
                limit = self.pool.max_model_len.get(decode.engine_id)
                wanted = body.get("max_tokens") or body.get("max_completion_tokens")
                if limit and isinstance(wanted, int) and wanted > limit:
                    # Refused here, not by the engines: in push mode a decode leg rejected after prefill has
                    # started leaves vLLM 0.32's push state wedged for the next request.
                    return self._error(endpoint, 400,
                                       f"max_tokens={wanted} exceeds the model's max_model_len={limit}")
                if last is not None:
                    (self.m.retries if last.role == "prefill" else self.m.decode_retries).inc()
                attempt = Attempt(uuid.uuid4().hex, prefill.engine_id, decode.engine_id, time.monotonic())
                attempts.append(attempt)
                if prefer is not None:
                    return await self._prefixed(request, endpoint, body, legs, attempt, prefer)
                return await self._one(request, endpoint, body, legs, attempt)
            except UpstreamFailed as e:
                failed_at = time.monotonic()
                self.m.upstream_errors.labels(role=e.role, kind=e.kind).inc()
                log.warning("%s", e)
                last = e
                if e.client_error:
                    return self._error(endpoint, e.status or 400, _message(e.body) or str(e))
                if not e.retryable:
                    break
                tried.add(e.engine_id)
                if e.refused:
                    self.pool.refused(e.engine_id)
            finally:
                legs.release()
        if last is None:
            log.warning("no pair: engines %s, down %s", [(e.role, e.engine_id) for e in self.pool.engines()],
                        sorted(self.pool.down))
            return self._error(endpoint, 503, f"no healthy {self.s.mode}-mode prefill/decode pair with matching "
                                              "layout keys is available")
        return self._error(endpoint, 502, f"upstream failure: {last}")

    async def _prefixed(self, request: web.Request, endpoint: pd.Endpoint, body: dict[str, Any], legs: Legs,
                        tl: Attempt, prefer: Preference) -> web.StreamResponse:
        """An attempt routed by the index: on the pair, or on decode alone when it holds enough of the prompt
        (kv_scoring.py)."""
        assert self.prefix is not None
        decode = legs.decode
        alone = prefer.decode_only(decode.engine_id)
        tl.prefix = Prefix(prefer.prompt_tokens, None if alone else prefer.cached(legs.prefill.engine_id),
                           prefer.cached(decode.engine_id))
        self.prefix.chosen(prefer, None if alone else legs.prefill, decode)
        if not alone:
            return await self._one(request, endpoint, body, legs, tl)
        tl.prefill = None
        legs.prefill_answered()  # its slot: no prefill leg runs
        resp = await self._open_decode(decode, PATHS[endpoint], copy.deepcopy(body), tl.request_id, tl)
        self.m.decode_legs.labels(mode="decode-only").inc()
        served = {"X-Request-Id": tl.request_id, DECODE_HEADER: decode.engine_id}
        never: asyncio.Future[None] = asyncio.get_running_loop().create_future()  # no KV is owed by anyone
        return await self._relay(request, endpoint, resp, tl, served, (never, decode))

    async def _one(self, request: web.Request, endpoint: pd.Endpoint, body: dict[str, Any], legs: Legs,
                   tl: Attempt) -> web.StreamResponse:
        """One attempt on the pair of `legs`; the prefill slot is given back once prefill answers."""
        with self.pool.watch(legs.prefill) as prefill_gone:
            return await self._legs(request, endpoint, body, legs, tl, prefill_gone)

    async def _legs(self, request: web.Request, endpoint: pd.Endpoint, body: dict[str, Any], legs: Legs,
                    tl: Attempt, prefill_gone: asyncio.Future[None]) -> web.StreamResponse:
        rid, path, prefill, decode = tl.request_id, PATHS[endpoint], legs.prefill, legs.decode
        prefill_task: asyncio.Task[Any] | None = None
        decode_task: asyncio.Task[aiohttp.ClientResponse] | None = None
        relayed = False  # _relay owns the decode response from here on
        try:
            prefill_task = asyncio.create_task(
                self._post_json("prefill", prefill, path, pd.prefill_body(endpoint, body), rid))
            if self.s.mode == "pull" or self.s.dispatch == "sequential":
                pre = await _unless_gone(prefill_task, prefill_gone, prefill, "answered")
                pd.check_prefill_answer(pre)
                tl.prefill_done = time.monotonic()
                self._reported(tl, pre)
                legs.prefill_answered()
                params = pd.pull_decode_params(pre) if self.s.mode == "pull" else \
                    pd.push_decode_params(endpoint, rid, prefill, self.s.transfer_id)
                decode_task = asyncio.create_task(
                    self._open_decode(decode, path, pd.decode_body(body, params), rid, tl))
            else:
                params = pd.push_decode_params(endpoint, rid, prefill, self.s.transfer_id)
                decode_task = asyncio.create_task(
                    self._open_decode(decode, path, pd.decode_body(body, params), rid, tl))
                # A failed prefill means decode would wait for KV that never comes: cancel it, never let it hang.
                pre = await _unless_gone(prefill_task, prefill_gone, prefill, "answered")
                pd.check_prefill_answer(pre)
                tl.prefill_done = time.monotonic()
                self._reported(tl, pre)
                legs.prefill_answered()
            # Until decode's first token, its KV may still be owed by the prefill engine.
            resp = await _unless_gone(decode_task, prefill_gone, prefill, "sent decode its KV")
            self.m.decode_legs.labels(mode=self.s.mode).inc()
            if tl.decode_sent is not None and tl.decode_sent < tl.prefill_done:
                self.m.decode_early.labels(mode=self.s.mode).inc()
            served = {"X-Request-Id": rid, PREFILL_HEADER: prefill.engine_id, DECODE_HEADER: decode.engine_id}
            relayed = True
            return await self._relay(request, endpoint, resp, tl, served, (prefill_gone, prefill))
        except ValueError as e:  # prefill answered without usable transfer params
            raise UpstreamFailed("prefill", prefill.engine_id, "protocol", str(e)) from e
        finally:
            _settle(prefill_task, decode_task)
            if decode_task is not None and decode_task.done() and not decode_task.cancelled() \
                    and decode_task.exception() is None and not decode_task.result().closed and not relayed:
                # Decode answered (its stream is open, waiting for KV) but the request ends before its relay (the
                # client went away, or prefill failed): close that stream too, so vLLM aborts the decode leg now
                # rather than at its registration timeout.
                decode_task.result().close()

    async def _relay(self, request: web.Request, endpoint: str, resp: aiohttp.ClientResponse,
                     tl: Attempt, served: dict[str, str],
                     owed_by: tuple[asyncio.Future[None], EngineAdvertisement]) -> web.StreamResponse:
        """Decode's answer to the client. The client's response starts only with decode's first chunk (the whole
        answer, when not streamed): a decode that fails before it raises UpstreamFailed, and the request may be
        retried on another pair, since the client has nothing of it yet. A failure after it ends the stream with an
        error event, then the stream's proper end. vLLM sends its 200 and headers before the first token, so
        relaying them at once would commit the request to a decode that may still die before answering. Until
        that first chunk, the prefill engine found dead (`owed_by`) fails the attempt too: its KV will never come."""
        mode = self.s.mode
        out: web.StreamResponse | None = None
        gone, prefill = owed_by
        try:
            if not resp.headers.get("Content-Type", "").startswith("text/event-stream"):
                raw = await _read_unless_gone(resp.read(), resp, gone, prefill)
                tl.first_token = time.monotonic()
                self._observe(tl)
                if tl.prefix is not None and tl.prefix.decode_only:
                    self._reported(tl, _json_or_text(raw.decode("utf-8", errors="replace")))
                self.m.requests.labels(mode=mode, endpoint=endpoint, status="200").inc()
                return web.Response(body=raw, status=200, content_type="application/json", headers=served)
            chunk = await _read_unless_gone(resp.content.readany(), resp, gone, prefill)
            if not chunk:
                raise UpstreamFailed("decode", served[DECODE_HEADER], "empty", "stream ended before its first chunk")
            out = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream",
                                                          "Cache-Control": "no-cache", **served})
            await out.prepare(request)
            alone = tl.prefix is not None and tl.prefix.decode_only
            tail = b""  # decode alone: the stream's end, where its usage is when the client asked for it
            while chunk:
                if tl.first_token is None and b"data:" in chunk:
                    tl.first_token = time.monotonic()
                    self._observe(tl)
                if alone:
                    tail = (tail + chunk)[-pd.STREAM_TAIL_BYTES:]
                try:
                    await out.write(chunk)
                except ConnectionResetError:  # the client went away: no one to answer; release() aborts decode
                    return out
                chunk = await resp.content.readany()
            if alone:
                self._reported(tl, pd.stream_usage(tail))
            await out.write_eof()
            self.m.requests.labels(mode=mode, endpoint=endpoint, status="200").inc()
            return out
        except UpstreamFailed:
            resp.close()  # vLLM aborts the decode leg now, not at its registration timeout
            raise
        except (TimeoutError, aiohttp.ClientError) as e:
            failed = UpstreamFailed.of("decode", served[DECODE_HEADER], e)
            if out is None:
                raise failed from e
            # The client has the 200 and part of the stream: a second status line would corrupt it. End the
            # stream with an error event instead (as OpenAI's API does), then its proper end.
            self.m.upstream_errors.labels(role="decode", kind=failed.kind).inc()
            self.m.requests.labels(mode=mode, endpoint=endpoint, status="200").inc()
            log.warning("%s (mid-stream)", failed)
            error = {"error": {"message": f"upstream failure mid-stream: {failed}", "type": "upstream_error",
                               "code": 502}}
            with contextlib.suppress(ConnectionResetError):
                await out.write(b"data: " + json.dumps(error).encode() + b"\n\n")
                await out.write_eof()
            return out
        finally:
            resp.release()

    def _reported(self, tl: Attempt, answer: Any) -> None:
        """The cached tokens the engine that computed the prompt reported in `answer`, against the prediction."""
        if tl.prefix is None or self.prefix is None or (cached := pd.cached_tokens(answer)) is None:
            return
        tl.prefix.actual = cached
        predicted = tl.prefix.decode if tl.prefix.prefill is None else tl.prefix.prefill
        self.prefix.reported(predicted, cached)

    def _observe(self, tl: Attempt) -> None:
        assert tl.first_token is not None
        self.m.ttft.labels(mode=self.s.mode).observe(tl.first_token - tl.start)
        if tl.prefill_done is not None:
            self.m.handoff.labels(mode=self.s.mode).observe(max(0.0, tl.first_token - tl.prefill_done))

    def _error(self, endpoint: str, status: int, message: str) -> web.Response:
        self.m.requests.labels(mode=self.s.mode, endpoint=endpoint, status=str(status)).inc()
        resp = error_response(status, message)
        resp[ERROR_KEY] = message
        return resp

    def _overloaded(self, endpoint: str, e: Overloaded) -> web.Response:
        resp = self._error(endpoint, 429, str(e))
        resp.headers["Retry-After"] = str(self.admission.retry_after)
        return resp

    # -- the app -----------------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.serve(request, "completions")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self.serve(request, "chat")

    async def models(self, _request: web.Request) -> web.Response:
        assert self.session is not None
        for engine in self.pool.healthy("decode"):
            try:
                async with self.session.get(f"{engine.http_url}/v1/models", timeout=self._timeout()) as r:
                    if r.status == 200:
                        return web.json_response(json.loads(await r.read()))
            except (TimeoutError, aiohttp.ClientError) as e:  # ask the next engine
                log.warning("engine %s: /v1/models: %s", engine.engine_id, type(e).__name__)
                if isinstance(e, aiohttp.ClientConnectorError):
                    self.pool.refused(engine.engine_id)
            except ValueError:  # not JSON (or not UTF-8): ask the next engine
                log.warning("engine %s answered /v1/models with something other than JSON", engine.engine_id)
        if self.s.served_model_name is not None:
            return web.json_response(pd.model_list(self.s.served_model_name, self.started))
        return error_response(503, "no healthy decode engine")

    async def health(self, _request: web.Request) -> web.Response:
        pair = self.pool.choose()
        body = {"status": "ok" if pair else "no-engines", "engines": self.pool.snapshot()}
        return web.json_response(body, status=200 if pair else 503)

    async def readyz(self, _request: web.Request) -> web.Response:
        """Ready: the router knows the engines (it has read the rendezvous once), pair or not, and is not stopping.
        Requests that find no pair wait up to --pair-wait-seconds and then get a 503 that says why."""
        if self.stopping:
            return web.json_response({"status": "stopping"}, status=503)
        if self.synced():
            return web.json_response({"status": "ok"})
        return web.json_response({"status": "syncing"}, status=503)

    async def close_when_stopping(self, _request: web.Request, response: web.StreamResponse) -> None:
        """Once stopping, every answer closes its connection: a keep-alive client's next request opens a new one,
        which the Service sends to another router, instead of racing this router's close of idle connections."""
        if self.stopping:
            response.force_close()
            response.headers["Connection"] = "close"  # the hook runs after aiohttp has set its own headers

    async def livez(self, _request: web.Request) -> web.Response:
        """Alive: the event loop answers. Unlike /health it never depends on the engines, so a liveness probe on
        it does not restart a router while its engines start or fail over (which would not help them)."""
        return web.json_response({"status": "ok"})

    async def metrics(self, _request: web.Request) -> web.Response:
        for key, n in self.pool.snapshot().items():
            role, state = key.split("/")
            self.m.engines.labels(role=role, state=state).set(n)
        return web.Response(body=generate_latest(self.m.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    def app(self, freeze_gc: bool = False) -> web.Application:
        """`freeze_gc`: once started, exempt every object alive then from cycle collection (see
        `_freeze_when_started`); for the router process, not for an app embedded in another program."""
        app = web.Application(client_max_size=MAX_BODY, middlewares=[_errors])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/livez", self.livez)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/metrics", self.metrics)
        app.cleanup_ctx.append(self._lifecycle)
        if freeze_gc:
            app.on_startup.append(_freeze_when_started)
        return app

    async def _lifecycle(self, _app: web.Application) -> AsyncIterator[None]:
        # No aiohttp TraceConfig: a session with one awaits a signal for every response chunk of every leg.
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1024, limit_per_host=256))
        probe = asyncio.create_task(self.pool.probe_forever(self.session))
        follow = asyncio.create_task(self.kv.run()) if self.kv is not None else None
        yield
        probe.cancel()
        if follow is not None and self.kv is not None:
            follow.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follow
            await self.kv.close()
        await self.session.close()


def _kv_follower(pool: EnginePool, settings: Settings, metrics: Metrics) -> KvFollower:
    """The KV index and its subscriptions, to every engine the pool may route to; imported here so that a
    least-loaded router never loads ZMQ."""
    from .kv_follow import KvFollower
    from .kv_metrics import KvMetrics

    index = kv_index.KvIndex(max_engines=settings.kv_index_max_engines,
                             max_blocks_per_engine=settings.kv_index_max_blocks_per_engine)
    follower = KvFollower(pool.engines, index)
    metrics.registry.register(KvMetrics(follower))
    return follower


def _prefix_routing(pool: EnginePool, follower: KvFollower, settings: Settings, metrics: Metrics) -> PrefixRouting:
    from .prefix_routing import PrefixRouting

    return PrefixRouting(pool, follower.index, settings.prefix_weights, metrics.registry)


async def _freeze_when_started(_app: web.Application) -> None:
    """Move everything alive at start-up (modules, the app, the session: about 50,000 objects) out of the cycle
    collector's reach. A full collection otherwise walks them all and stops every request in flight for 15-30 ms
    on a small core, once every few thousand requests. What requests create is still collected. (on_startup runs
    after cleanup_ctx's start: the client session exists by now.)"""
    gc.collect()
    gc.freeze()


def error_response(status: int, message: str) -> web.Response:
    """An OpenAI-style error: every 4xx and 5xx of the router has this body."""
    kind = "overloaded_error" if status == 429 else "invalid_request_error" if status < 500 else \
        "upstream_error" if status in (502, 503, 504) else "internal_error"
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


async def _read_body(request: web.Request) -> bytes:
    """The raw body of a JSON request, refused early when it cannot be one (BadRequest with 413 or 415)."""
    content_type = request.headers.get("Content-Type", "")
    if content_type.strip() and not (request.content_type == "application/json"
                                     or request.content_type.endswith("+json")):
        raise pd.BadRequest(f"Content-Type must be application/json, got {content_type[:100]!r}", 415)
    too_large = f"request body is larger than {MAX_BODY} bytes"
    if request.content_length is not None and request.content_length > MAX_BODY:
        raise pd.BadRequest(too_large, 413)  # said by the header: refused before reading any of it
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise pd.BadRequest(too_large, 413) from None


_REASONS = {404: "no such endpoint", 405: "method not allowed here"}


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own refusals (unknown path, wrong method, oversized body) in the OpenAI error format, and a
    crash as a logged 500 in that format too, never a stack trace."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        message = f"{_REASONS.get(e.status, e.reason)}: {request.method} {request.path[:200]}"
        resp = error_response(e.status, message)
        if "Allow" in e.headers:
            resp.headers["Allow"] = e.headers["Allow"]
        return resp
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unexpected error in %s %s", request.method, request.path)
        return error_response(500, "internal error (see the router log)")


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _settle(*tasks: asyncio.Task[Any] | None) -> None:
    """An attempt's leg tasks at its end: cancel the ones still running (closing the upstream connection aborts
    the request in vLLM), and retrieve the outcome of the ones that ended, which the attempt may not have awaited
    (the client went away as a leg failed): asyncio logs an exception nobody retrieved as an error."""
    for task in tasks:
        if task is None:
            continue
        if not task.done():
            task.cancel()
        elif not task.cancelled():
            task.exception()


async def _unless_gone(task: asyncio.Future[T], gone: asyncio.Future[None], prefill: EngineAdvertisement,
                       what: str) -> T:
    """`task`'s result, unless the probes find the prefill engine dead first: then whatever it still owed (its
    answer, decode's KV) will never come, and the attempt fails before the client got anything, so it is retried.
    A stopping prefill drains what it holds first (it stays alive, and answers its probes, until it has)."""
    if not gone.done():
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        return task.result()
    task.cancel()
    raise _gone(prefill, what)


async def _read_unless_gone(read: Awaitable[bytes], resp: aiohttp.ClientResponse, gone: asyncio.Future[None],
                            prefill: EngineAdvertisement) -> bytes:
    """`_unless_gone` for a read of decode's answer: the prefill found dead closes the answer, which ends the read
    (no task per read: what is already buffered is returned as it arrived)."""
    def cut(_: object) -> None:
        resp.close()

    gone.add_done_callback(cut)
    try:
        data = await read
    except (TimeoutError, aiohttp.ClientError):
        if gone.done():
            raise _gone(prefill, "sent decode its KV") from None
        raise
    finally:
        gone.remove_done_callback(cut)
    if gone.done() and not data:
        raise _gone(prefill, "sent decode its KV")
    return data


def _gone(prefill: EngineAdvertisement, what: str) -> UpstreamFailed:
    return UpstreamFailed("prefill", prefill.engine_id, "gone", f"found dead before it {what}")


def _param(body: Any) -> str | None:
    err = body.get("error") if isinstance(body, dict) else None
    param = err.get("param") if isinstance(err, dict) else None
    return param if isinstance(param, str) else None


def _message(body: Any) -> str | None:
    if isinstance(body, dict):
        err = body.get("error", body)
        return err.get("message") if isinstance(err, dict) else str(err)
    return body if isinstance(body, str) else None


def load_static(path: Path) -> list[EngineAdvertisement]:
    data = yaml.safe_load(path.read_text())
    return TypeAdapter(list[EngineAdvertisement]).validate_python(data.get("engines", data)
                                                                   if isinstance(data, dict) else data)


def build(args: argparse.Namespace) -> tuple[Router, list[tuple[EngineCache, RendezvousClient]]]:
    tasks: list[tuple[EngineCache, RendezvousClient]] = []
    if args.engines_file:
        try:
            static = load_static(args.engines_file)
        except (OSError, ValidationError, yaml.YAMLError) as e:
            raise SystemExit(f"--engines-file {args.engines_file}: {e}") from None
        source = lambda: static  # noqa: E731
    else:
        from ..rendezvous.client import EngineCache, RendezvousClient

        cache, client = EngineCache(), RendezvousClient(args.rendezvous)
        tasks.append((cache, client))
        source = lambda: list(cache.engines.values())  # noqa: E731
    settings = Settings(mode=args.mode, dispatch=args.dispatch, connect_timeout=args.connect_timeout,
                        request_timeout=args.request_timeout, transfer_id=args.transfer_id,
                        pair_wait=args.pair_wait_seconds, max_inflight=args.max_inflight,
                        max_inflight_per_engine=args.max_inflight_per_engine, max_queue=args.max_queue,
                        queue_wait=args.queue_wait_seconds, served_model_name=args.served_model_name,
                        policy=args.policy, kv_index_max_engines=args.kv_index_max_engines,
                        kv_index_max_blocks_per_engine=args.kv_index_max_blocks_per_engine,
                        prefix_weights=Weights(args.prefill_hit_weight, args.decode_hit_weight,
                                               args.decode_only_share))
    synced = tasks[0][0].synced.is_set if tasks else lambda: True
    access_log = AccessLog.open(args.access_log) if args.access_log else None
    return Router(EnginePool(args.mode, source), settings, synced=synced, access_log=access_log), tasks


def event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop: the router's CPU per request is mostly the event loop and HTTP plumbing, which libuv does in C
    (bench/router_stubs.py measures it)."""
    import uvloop

    return uvloop.new_event_loop()


def main(args: argparse.Namespace) -> None:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    router, follows = build(args)
    app = router.app(freeze_gc=True)

    async def follow(_app: web.Application) -> AsyncIterator[None]:
        running = [asyncio.create_task(cache.follow(client)) for cache, client in follows]
        yield
        for t in running:
            t.cancel()
        for _cache, client in follows:
            await client.close()

    app.cleanup_ctx.append(follow)
    app.on_startup.append(_graceful_stop(router, args.stop_delay_seconds, args.drain_seconds))
    app.on_response_prepare.append(router.close_when_stopping)
    # Cancel a request's handler when its client disconnects, so both upstream legs are aborted too.
    # shutdown_timeout is half the drain: aiohttp waits that long for a handler in flight, then "cancels" its
    # request (only the request body, which a handler relaying an answer no longer reads) and waits as long again
    # before it cancels the handler. tests/unit/test_router_graceful_stop.py holds it to the whole drain.
    web.run_app(app, host=args.host, port=args.port, handler_cancellation=True, access_log=None, loop=event_loop(),
                shutdown_timeout=args.drain_seconds / 2,
                print=lambda *_: log.info("router (%s, %s, %s) on %s:%d", args.mode, args.dispatch, args.policy,
                                          args.host, args.port))


def _graceful_stop(router: Router, delay: float, drain: float) -> Callable[[web.Application], Awaitable[None]]:
    """SIGTERM: /readyz answers 503 at once, and the router serves as before (new connections too) for `delay`
    seconds, since a Kubernetes Service's endpoints lag the SIGTERM and still send it new connections. Then
    aiohttp's graceful stop (run_app's own, as on SIGINT): the listening socket closes (new connections are
    refused), idle keep-alive connections close, and requests in flight, streams included, have `drain` seconds to
    finish before they are cancelled. A second SIGTERM changes nothing."""

    async def install(app: web.Application) -> None:
        loop = asyncio.get_running_loop()

        def stop() -> None:
            if router.stopping:
                return
            router.stopping = True
            log.info("SIGTERM: not ready; serving %gs more, then draining requests in flight for at most %gs",
                     delay, drain)
            loop.call_later(delay, _graceful_exit)

        loop.add_signal_handler(signal.SIGTERM, stop)  # replaces run_app's, which stops at once

    return install


def _graceful_exit() -> None:
    log.info("stopped listening; draining")
    raise web.GracefulExit  # what run_app's own signal handler raises: the loop stops, and run_app cleans up
