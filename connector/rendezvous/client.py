"""Client of `disagg rendezvous`, for engines (the vLLM plugin) and routers. aiohttp only.

- `RendezvousClient`: one call per endpoint (`register`, `renew`, `deregister`, `get`, `list`, `health`) raising
  `RendezvousError`, plus `watch()`, an endless async iterator of `WatchEvent`s that reconnects, resumes from
  the last version it delivered, and treats ~3 heartbeats without a line as a dead server.
- `EngineRegistration`: the engine side. Registers, renews every heartbeat (cheap `renew` when nothing
  changed, a full PUT when the advertisement changed or the rendezvous forgot it), retries with backoff, and
  never raises into its caller. Runs as an asyncio task or in its own thread (vLLM's code is synchronous).
- `EngineCache`: the router side. Applies watch events to a dict of engines, keeping what it knows while the
  rendezvous is down or warming up after a restart.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp
from pydantic import ValidationError

from ..wire import env as wire_env
from ..wire.advertisement import EngineAdvertisement, EngineList, RegisterResponse, WatchEvent
from ..wire.env import DEFAULT_HEARTBEAT_SECONDS as DEFAULT_HEARTBEAT
from ..wire.env import LEASE_HEARTBEATS

log = logging.getLogger("disagg.rendezvous.client")

MAX_LINE = 16 * 1024 * 1024


class RendezvousError(Exception):
    """An error answer (status and the server's reason), or an unusable response (status None)."""

    def __init__(self, status: int | None, reason: str, message: str) -> None:
        super().__init__(f"{status or ''} {reason}: {message}".strip())
        self.status, self.reason, self.message = status, reason, message


class RendezvousClient:
    """HTTP client of one rendezvous. Create and use it inside one event loop; `close()` (or `async with`) at the end.

    The write token is `token`, else read from `token_file` on every request (kubelet rotates projected
    ServiceAccount tokens in place)."""

    def __init__(self, url: str, *, token: str | None = None, token_file: str | os.PathLike[str] | None = None,
                 timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.token_file = Path(token_file) if token_file else None
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ, **kwargs: Any) -> RendezvousClient:
        """From $DISAGG_RENDEZVOUS_URL and $DISAGG_RENDEZVOUS_TOKEN or $DISAGG_RENDEZVOUS_TOKEN_FILE."""
        if not env.get(wire_env.RENDEZVOUS_URL):
            raise KeyError(f"${wire_env.RENDEZVOUS_URL} is not set")
        return cls(env[wire_env.RENDEZVOUS_URL], token=env.get(wire_env.RENDEZVOUS_TOKEN) or None,
                   token_file=env.get(wire_env.RENDEZVOUS_TOKEN_FILE) or None,
                   **kwargs)

    async def __aenter__(self) -> RendezvousClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        """One connection per request, never pooled. A connection opened to a Service's address before kube-proxy
        programmed it reaches whatever the node's default route leads to (an egress proxy answers 404), and a
        pooled one would take every retry back there. The rendezvous sees a request every few seconds per engine
        and one long-lived watch per client, so keep-alive saves nothing worth that."""
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout),
                                                  connector=aiohttp.TCPConnector(force_close=True))
        return self._session

    def _auth(self) -> dict[str, str]:
        token = self.token
        if token is None and self.token_file is not None:
            token = self.token_file.read_text().strip()
        return {"Authorization": f"Bearer {token}"} if token else {}

    async def _call(self, method: str, path: str, *, body: bytes | None = None, auth: bool = False,
                    params: dict[str, str] | None = None, ok: tuple[int, ...] = (200,)) -> tuple[int, bytes]:
        headers = self._auth() if auth else {}
        if body is not None:
            headers["Content-Type"] = "application/json"
        async with self._http().request(method, self.url + path, data=body, headers=headers, params=params) as resp:
            data = await resp.read()
            if resp.status in ok:
                return resp.status, data
            try:
                err = json.loads(data) if data else {}
                reason, message = err.get("reason", "error"), err.get("error", _body_text(resp, data))
            except (ValueError, AttributeError):
                reason, message = "error", _body_text(resp, data)
            raise RendezvousError(resp.status, reason, message)

    async def register(self, adv: EngineAdvertisement) -> RegisterResponse:
        """PUT the advertisement (create, update or renew). Raises RendezvousError (409 conflict, 401/403 auth…)."""
        # Without its None fields: an older rendezvous, whose model lacks a newer optional field, accepts it.
        body = adv.model_dump_json(exclude_none=True).encode()
        _, data = await self._call("PUT", f"/v1/engines/{adv.engine_id}", body=body, auth=True, ok=(200, 201))
        return RegisterResponse.model_validate_json(data)

    async def renew(self, engine_id: str) -> RegisterResponse:
        """Extend the lease only. RendezvousError with status 404 means: register again (the rendezvous restarted)."""
        _, data = await self._call("POST", f"/v1/engines/{engine_id}/renew", auth=True)
        return RegisterResponse.model_validate_json(data)

    async def deregister(self, engine_id: str) -> bool:
        """True if it was removed, False if it was not registered."""
        try:
            await self._call("DELETE", f"/v1/engines/{engine_id}", auth=True, ok=(204,))
            return True
        except RendezvousError as e:
            if e.status == 404:
                return False
            raise

    async def get(self, engine_id: str) -> EngineAdvertisement | None:
        try:
            _, data = await self._call("GET", f"/v1/engines/{engine_id}")
        except RendezvousError as e:
            if e.status == 404:
                return None
            raise
        return EngineAdvertisement.model_validate_json(data)

    async def list(self, role: str | None = None, layout_key: str | None = None) -> EngineList:
        params = {k: v for k, v in (("role", role), ("layout_key", layout_key)) if v}
        _, data = await self._call("GET", "/v1/engines", params=params)
        return EngineList.model_validate_json(data)

    async def health(self) -> dict[str, Any]:
        _, data = await self._call("GET", "/health")
        health: dict[str, Any] = json.loads(data)
        return health

    async def watch(self, since: int | None = None, epoch: str | None = None, *,
                    heartbeat_timeout: float | None = None, min_backoff: float = 0.05,
                    max_backoff: float = 2.0) -> AsyncIterator[WatchEvent]:
        """Every change from `since` (of `epoch`) on, forever; without `since`, a snapshot first.

        Yields RESET and BOOKMARK lines too (see WatchEvent). On a closed connection, an error, or no line for
        `heartbeat_timeout` (default: 3 x the server's heartbeat), it reconnects with backoff and resumes from
        the last version delivered; the server answers with a snapshot (RESET) when it cannot resume (it
        restarted, or the client fell too far behind). A snapshot interrupted midway is asked for again.
        Stop by breaking out of the loop or cancelling the task."""
        backoff = min_backoff
        while True:
            params: dict[str, str] = {}
            if since is not None:
                params["since"] = str(since)
                if epoch:
                    params["epoch"] = epoch
            limit = heartbeat_timeout or LEASE_HEARTBEATS * DEFAULT_HEARTBEAT
            try:
                timeout = aiohttp.ClientTimeout(total=None, connect=self.timeout, sock_connect=self.timeout)
                async with self._http().get(self.url + "/v1/watch", params=params, timeout=timeout) as resp:
                    if resp.status != 200:
                        raise RendezvousError(resp.status, "watch", _body_text(resp, await resp.read()))
                    limit = heartbeat_timeout or LEASE_HEARTBEATS * float(
                        resp.headers.get("X-Disagg-Heartbeat-Seconds", DEFAULT_HEARTBEAT))
                    in_snapshot = False
                    async for line in _lines(resp.content, limit):
                        ev = WatchEvent.model_validate_json(line)
                        if ev.type == "RESET":
                            in_snapshot = True
                        elif ev.type == "BOOKMARK":
                            in_snapshot = False
                        # Resume from here only once a snapshot is complete (its closing BOOKMARK).
                        if not in_snapshot:
                            since, epoch = ev.version, ev.epoch or epoch
                        backoff = min_backoff
                        yield ev
                    log.info("watch stream from %s ended; reconnecting", self.url)
            except TimeoutError as e:
                if isinstance(e, aiohttp.ClientError):  # connect timeout
                    log.info("watch %s: cannot connect: %s; retrying in %.2fs", self.url, e, backoff)
                else:
                    log.warning("no line from %s/v1/watch for %.1fs: reconnecting", self.url, limit)
            except (aiohttp.ClientError, OSError, RendezvousError, ValidationError, ValueError) as e:
                log.info("watch %s: %s: %s; retrying in %.2fs", self.url, type(e).__name__, e, backoff)
            await asyncio.sleep(backoff * random.uniform(0.5, 1.0))
            backoff = min(max_backoff, backoff * 2)


def _body_text(resp: aiohttp.ClientResponse, data: bytes) -> str:
    """An answer that is not the rendezvous' JSON error, for a log line: its start, or who sent an empty one."""
    if data.strip():
        return data[:200].decode(errors="replace")
    return f"empty body from server {resp.headers.get('Server', 'unnamed')!r} (not a rendezvous answer)"


async def _lines(content: aiohttp.StreamReader, timeout: float) -> AsyncIterator[bytes]:
    """Non-empty lines of a stream; asyncio.TimeoutError when nothing arrives for `timeout` seconds."""
    buf = bytearray()
    while True:
        chunk = await asyncio.wait_for(content.readany(), timeout)
        if not chunk:
            return
        buf += chunk
        while (i := buf.find(b"\n")) >= 0:
            line = bytes(buf[:i])
            del buf[:i + 1]
            if line.strip():
                yield line
        if len(buf) > MAX_LINE:
            raise ValueError(f"watch line longer than {MAX_LINE} bytes")


# ---- engines -------------------------------------------------------------------------------------------------
Advertiser = EngineAdvertisement | Callable[[], EngineAdvertisement]


class EngineRegistration:
    """Keep one engine registered: register, renew every `heartbeat_seconds`, retry with backoff.

    `advertisement` may be a callable returning the current advertisement (e.g. once decode's KV metadata or
    the transport is known); a changed advertisement is PUT again, an unchanged one only renewed. The engine
    id must stay the same. Errors are logged and retried, never raised: `last_error` and `registered` tell
    the state. `start()` runs it as a task of the current loop, `start_thread()` in a thread of its own."""

    def __init__(self, client: RendezvousClient | None, advertisement: Advertiser, *,
                 heartbeat_seconds: float = DEFAULT_HEARTBEAT, min_backoff: float = 0.1,
                 client_factory: Callable[[], RendezvousClient] | None = None) -> None:
        if client is None and client_factory is None:
            raise ValueError("give a client or a client_factory")
        self._client, self._factory = client, client_factory
        self._advertiser = advertisement if callable(advertisement) else (lambda: advertisement)
        self.heartbeat_seconds = heartbeat_seconds
        # One attempt may not outlast half a heartbeat: a rendezvous that accepts connections but does not answer
        # yet (restarting, overloaded) would otherwise hold the renewal for the client's whole timeout, and with
        # it the re-registration, while the lease runs out. The retry comes with backoff instead.
        self.attempt_timeout = max(0.5, heartbeat_seconds / 2)
        self.min_backoff = min(min_backoff, heartbeat_seconds)
        self.registered = False
        self.last_error: str | None = None
        self.last_response: RegisterResponse | None = None
        self.successes = 0
        self._sent: EngineAdvertisement | None = None
        self._ok = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_requested: asyncio.Event | None = None
        self._deregister_on_stop = True

    @property
    def client(self) -> RendezvousClient:
        if self._client is None:
            self._client = self._factory()  # type: ignore[misc]
        return self._client

    async def step(self) -> bool:
        """One register-or-renew attempt, at most `attempt_timeout` seconds. True on success."""
        try:
            adv = self._advertiser()
            async with asyncio.timeout(self.attempt_timeout):
                if self.registered and self._sent == adv:
                    try:
                        resp = await self.client.renew(adv.engine_id)
                    except RendezvousError as e:
                        if e.status != 404:
                            raise
                        log.info("rendezvous forgot engine %s (restarted?): registering again", adv.engine_id)
                        resp = await self.client.register(adv)
                else:
                    resp = await self.client.register(adv)
            self._sent, self.last_response, self.last_error = adv, resp, None
            if not self.registered:
                log.info("engine %s registered with %s (version %d)", adv.engine_id, self.client.url, resp.version)
            self.registered = True
            self.successes += 1
            self._ok.set()
            return True
        except asyncio.CancelledError:
            raise
        except Exception as e:  # never into the engine
            self.registered = False
            message = (f"no answer within {self.attempt_timeout:g} s" if isinstance(e, TimeoutError)
                       else f"{type(e).__name__}: {e}")
            if message != self.last_error:
                log.warning("rendezvous registration failed: %s", message)
            self.last_error = message
            return False

    async def run(self) -> None:
        """Forever (until cancelled): renew every heartbeat, retry failures with backoff up to a heartbeat."""
        backoff = self.min_backoff
        while True:
            if await self.step():
                backoff = self.min_backoff
                delay = self.heartbeat_seconds * random.uniform(0.9, 1.0)
            else:
                delay = backoff * random.uniform(0.5, 1.0)
                backoff = min(self.heartbeat_seconds, backoff * 2)
            await asyncio.sleep(delay)

    async def wait_registered(self, timeout: float | None = None) -> bool:
        try:
            await asyncio.wait_for(self._ok.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def start(self) -> asyncio.Task[None]:
        self._task = asyncio.create_task(self.run(), name="rendezvous-registration")
        return self._task

    async def stop(self, deregister: bool = True, timeout: float = 2.0) -> None:
        """Stop renewing; with `deregister`, remove the entry (best effort) so routers drop it at once."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if deregister and self._sent is not None:
            try:
                await asyncio.wait_for(self.client.deregister(self._sent.engine_id), timeout)
            except Exception as e:
                log.info("deregistering %s failed: %s", self._sent.engine_id, e)
            self.registered = False
        if self._client is not None and self._factory is not None:
            await self._client.close()
            self._client = None

    # -- for synchronous callers (the vLLM plugin) --
    def start_thread(self) -> threading.Thread:
        """Run in a daemon thread with its own event loop (the client is created there, by client_factory)."""
        if self._factory is None:
            raise ValueError("start_thread needs client_factory (a client belongs to one event loop)")
        if self._thread is not None:
            raise RuntimeError("already started")
        started = threading.Event()
        self._deregister_on_stop = True

        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._ok = asyncio.Event()
            self._stop_requested = asyncio.Event()
            self.start()
            started.set()
            await self._stop_requested.wait()
            await self.stop(deregister=self._deregister_on_stop)

        self._thread = threading.Thread(target=asyncio.run, args=(main(),), name="disagg-rendezvous-registration",
                                        daemon=True)
        self._thread.start()
        started.wait()
        return self._thread

    def request_stop(self, deregister: bool = True) -> None:
        """Ask the thread of `start_thread` to stop (deregistering first, by default) without waiting: safe in a
        signal handler, since it only wakes the thread's own event loop."""
        if self._thread is None or self._loop is None or self._stop_requested is None or not self._thread.is_alive():
            return
        self._deregister_on_stop = deregister
        try:
            self._loop.call_soon_threadsafe(self._stop_requested.set)
        except RuntimeError:  # the loop closed between the check and the call: already stopped
            pass

    def stop_thread(self, deregister: bool = True, timeout: float = 5.0) -> None:
        """Stop the thread of `start_thread` (deregistering first, by default) and wait for it."""
        if self._thread is None or self._loop is None:
            return
        self.request_stop(deregister)
        self._thread.join(timeout)
        self._thread = None


# ---- routers -------------------------------------------------------------------------------------------------
class EngineCache:
    """The engines a router may use, kept current from `RendezvousClient.watch()` (`follow`) or fed by hand
    (`apply`). Rules:
    - ADDED/MODIFIED upsert, DELETED/EXPIRED remove.
    - On RESET (a snapshot follows) known engines are marked stale; those the snapshot re-adds are kept. At the
      next BOOKMARK with `warming` false, the still-stale ones are removed. While the rendezvous is warming
      (restarted less than two heartbeats ago, engines may not have renewed yet) stale engines stay.
    - While the rendezvous is unreachable nothing changes: the router keeps serving from the cache.
    `listeners` get every change, including removals of stale engines as synthetic DELETED events."""

    def __init__(self) -> None:
        self.engines: dict[str, EngineAdvertisement] = {}
        self.version: int | None = None
        self.epoch: str | None = None
        self.synced = asyncio.Event()
        """Set at the first BOOKMARK: the cache holds the rendezvous' state (not necessarily all of it while
        warming)."""
        self.listeners: list[Callable[[WatchEvent], None]] = []
        self._stale: set[str] | None = None

    def select(self, role: str | None = None, layout_key: str | None = None) -> list[EngineAdvertisement]:
        return [e for _, e in sorted(self.engines.items())
                if (role is None or e.role == role) and (layout_key is None or e.layout_key == layout_key)]

    def _emit(self, ev: WatchEvent) -> None:
        for fn in list(self.listeners):
            try:
                fn(ev)
            except Exception:
                log.exception("EngineCache listener failed")

    def apply(self, ev: WatchEvent) -> None:
        self.version = ev.version
        if ev.type == "RESET":
            self.epoch = ev.epoch
            self._stale = set(self.engines)
        elif ev.type in ("ADDED", "MODIFIED"):
            assert ev.engine is not None
            self.engines[ev.engine.engine_id] = ev.engine
            if self._stale is not None:
                self._stale.discard(ev.engine.engine_id)
            self._emit(ev)
        elif ev.type in ("DELETED", "EXPIRED"):
            assert ev.engine is not None
            self.engines.pop(ev.engine.engine_id, None)
            if self._stale is not None:
                self._stale.discard(ev.engine.engine_id)
            self._emit(ev)
        elif ev.type == "BOOKMARK":
            self.epoch = ev.epoch or self.epoch
            if self._stale is not None and not ev.warming:
                for engine_id in sorted(self._stale):
                    gone = self.engines.pop(engine_id, None)
                    if gone is not None:
                        self._emit(WatchEvent(version=ev.version, type="DELETED", engine=gone))
                self._stale = None
            self.synced.set()

    async def follow(self, client: RendezvousClient, **watch_kwargs: Any) -> None:
        """Apply the watch stream forever (run it as a task; cancel to stop)."""
        async for ev in client.watch(**watch_kwargs):
            self.apply(ev)
