"""Scheduler side of the plugin: advertise this engine to the rendezvous and keep its lease.

Runs in the engine-core process once the workers' KV caches are registered, because that is when the NIXL
handshake payloads exist. The payloads go into `kv_metadata` so a peer can load this engine's NIXL agent
without asking its side channel (`prewarm`).
"""
from __future__ import annotations

import json
import logging
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from types import FrameType

from ..rendezvous.client import EngineRegistration, RendezvousClient
from ..wire import env as wire_env
from ..wire import kv_metadata
from ..wire.advertisement import EngineAdvertisement
from ..wire.env import LEASE_HEARTBEATS
from .settings import PluginSettings

log = logging.getLogger("disagg.plugin")


def build_advertisement(s: PluginSettings, payloads: Mapping[tuple[int, int], bytes], compatibility_hash: str | None,
                        transport: str | None, side_channel_host: str, side_channel_port: int) -> EngineAdvertisement:
    ip = s.env.get(wire_env.POD_IP) or side_channel_host
    host = f"[{ip}]" if ":" in ip else ip
    if s.role is None:
        raise ValueError("cannot tell this engine's role: set $DISAGG_ROLE (kv_role is kv_both)")
    return EngineAdvertisement(
        role=s.role, engine_id=s.engine_id, deployment=s.deployment, pod_name=s.env.get(wire_env.POD_NAME) or None,
        pod_uid=s.env.get(wire_env.POD_UID) or None, http_url=f"http://{host}:{s.http_port}",
        side_channel_host=side_channel_host, side_channel_ports=list(range(side_channel_port,
                                                                           side_channel_port + s.dp_size)),
        tp_size=s.tp_size, pp_size=s.pp_size, dp_size=s.dp_size, block_size=s.block_size,
        layout_key=s.layout_key, kv_mode=s.kv_mode, transport=transport,
        kv_metadata=kv_metadata.encode(payloads, compatibility_hash) if payloads else None,
        lease_seconds=LEASE_HEARTBEATS * s.heartbeat_seconds,
        kv_events_endpoints=_per_rank(host, s.kv_events_port, s.dp_size),
        kv_events_replay_endpoints=_per_rank(host, s.kv_events_replay_port if s.kv_events_port else None, s.dp_size))


def _per_rank(host: str, port: int | None, dp_size: int) -> list[str] | None:
    """One `tcp://host:port` per data-parallel rank, as vLLM offsets each rank's KV event ports by its rank."""
    return None if port is None else [f"tcp://{host}:{port + rank}" for rank in range(dp_size)]


class EngineAdvertiser:
    """Register, renew every heartbeat, deregister on stop; in a thread of its own, never raising into vLLM."""

    def __init__(self, settings: PluginSettings, payloads: Mapping[tuple[int, int], bytes],
                 compatibility_hash: str | None, transport: str | None, side_channel_host: str,
                 side_channel_port: int) -> None:
        self.advertisement = build_advertisement(settings, payloads, compatibility_hash, transport,
                                                 side_channel_host, side_channel_port)
        self.url = settings.rendezvous_url
        self.settings = settings
        url, token, token_file = settings.rendezvous_url, settings.token, settings.token_file
        assert url is not None
        self.registration = EngineRegistration(
            None, self.advertisement, heartbeat_seconds=settings.heartbeat_seconds,
            client_factory=lambda: RendezvousClient(url, token=token, token_file=token_file, timeout=5.0))

    def start(self) -> None:
        """Advertise once the engine has served one request of its own (in the background; returns at once).

        Routers only send traffic to advertised engines, and prefill engines only pre-load advertised peers; a
        fresh vLLM process's first request is measurably slower than later ones (bench/cold_pair.py), so the
        engine pays that cost on a request of its own instead of a client's. `DISAGG_WARMUP=0` skips it."""
        self._stopping = threading.Event()
        self._deregister_on_sigterm()
        threading.Thread(target=self._warm_then_register, name="disagg-advertise", daemon=True).start()

    def _warm_then_register(self) -> None:
        if self.settings.env.get(wire_env.WARMUP, "1") != "0":
            warm_up(f"http://127.0.0.1:{self.settings.http_port}", self._stopping, self.settings.warmup_tokens())
        if self._stopping.is_set():
            return
        a = self.advertisement
        log.info("disagg plugin: advertising %s engine %s (transport %s, %d handshake payload(s)) to %s", a.role,
                 a.engine_id, a.transport, len((a.kv_metadata or {}).get("ranks", {})),  # type: ignore[union-attr]
                 self.url)
        self.registration.start_thread()

    def stop(self) -> None:
        self._stopping.set()
        self.registration.stop_thread(deregister=True)

    def _deregister_on_sigterm(self) -> None:
        """Leave the rendezvous the moment the engine is told to stop, before vLLM's own SIGTERM handling.

        vLLM's API server stops its engine core with SIGTERM and, by default (`--shutdown-timeout 0`), kills it
        right after, so the connector's shutdown() may never run; without this, routers would keep the engine
        until its lease ran out. The handler stops the renewals, sends one DELETE with a short timeout (blocking
        the stopping engine for at most that long), then calls the handler it replaced."""
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be installed from the main thread
        previous = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum: int, frame: FrameType | None) -> None:
            self._stopping.set()
            self.registration.request_stop(deregister=False)
            self.deregister_now()
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_DFL:
                signal.signal(signum, signal.SIG_DFL)
                signal.raise_signal(signum)

        signal.signal(signal.SIGTERM, on_sigterm)

    def deregister_now(self, timeout: float = 0.5) -> bool:
        """One synchronous DELETE of this engine's entry (no event loop: usable from a signal handler). Once:
        the engine core may get SIGTERM twice (from the API server and from its process group)."""
        if getattr(self, "_deregistered", False):
            return True
        self._deregistered = True
        s = self.settings
        token = s.token
        if token is None and s.token_file:
            try:
                token = Path(s.token_file).read_text().strip()
            except OSError:
                token = None
        req = urllib.request.Request(f"{self.url}/v1/engines/{self.advertisement.engine_id}", method="DELETE",
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
        try:
            with urllib.request.urlopen(req, timeout=timeout):
                return True
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return True  # already gone
            log.info("disagg plugin: deregistering on SIGTERM failed: %s", e)
            return False
        except Exception as e:  # the lease ends it anyway
            log.info("disagg plugin: deregistering on SIGTERM failed: %s", e)
            return False


def warm_up(base_url: str, stop: threading.Event, tokens: int, wait_s: float = 900.0) -> bool:
    """Wait for the engine's own OpenAI server, then send it the same text prompt twice. Never raises.

    Text, so the request takes a client's whole path through the server (tokenizing included: measured ~20 ms
    extra on a decode engine's first request when the warm-up skipped it); cut to `tokens` by the server. The
    first request runs a full prefill over several KV blocks (a prefill engine's work); the second finds the
    prompt's full blocks in the prefix cache and computes only the tail against them, the shape of a decode
    engine's first step after it received a request's KV."""
    deadline = time.monotonic() + wait_s
    t0 = time.monotonic()
    while not stop.is_set():
        try:
            with urllib.request.urlopen(base_url + "/v1/models", timeout=2) as r:
                model = json.load(r)["data"][0]["id"]
            break
        except Exception:
            if time.monotonic() > deadline:
                log.info("disagg plugin: no answer from %s/v1/models in %.0f s; advertising without a warm-up",
                         base_url, wait_s)
                return False
            stop.wait(0.5)  # the server starts after the engine core: nothing to await but polling
    else:
        return False
    body = json.dumps({"model": model, "prompt": "warm up " * tokens, "truncate_prompt_tokens": tokens,
                       "max_tokens": 4, "temperature": 0}).encode()
    try:
        for _ in range(2):
            req = urllib.request.Request(base_url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                r.read()
        log.info("disagg plugin: warmed up with two requests of its own (%d prompt tokens; %.1f s after KV "
                 "registration)", tokens, time.monotonic() - t0)
        return True
    except Exception as e:  # e.g. an --api-key server: advertise anyway
        log.info("disagg plugin: warm-up request failed (%s); advertising anyway", e)
        return False
