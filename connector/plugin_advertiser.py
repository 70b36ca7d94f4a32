"""Scheduler side of the plugin: advertise this engine to the rendezvous and keep its lease.

Runs in the engine-core process once the workers' KV caches are registered, because that is when the NIXL
handshake payloads exist. The payloads go into `kv_metadata` so a peer can load this engine's NIXL agent
without asking its side channel (`plugin_prewarm`).
"""
from __future__ import annotations

import base64
import logging
import signal
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Mapping

from .advertisement import EngineAdvertisement
from .plugin_settings import KV_METADATA_FORMAT, PluginSettings
from .rendezvous_client import LEASE_HEARTBEATS, EngineRegistration, RendezvousClient

log = logging.getLogger("disagg.plugin")


def encode_kv_metadata(payloads: Mapping[tuple[int, int], bytes], compatibility_hash: str | None) -> dict[str, Any]:
    """Every (pp_rank, tp_rank)'s handshake payload: the msgpack bytes vLLM's side channel serves for GET_META."""
    return {"format": KV_METADATA_FORMAT, "compatibility_hash": compatibility_hash,
            "ranks": {f"{pp},{tp}": base64.b64encode(raw).decode() for (pp, tp), raw in sorted(payloads.items())}}


def decode_kv_metadata(kv_metadata: Any) -> dict[tuple[int, int], bytes] | None:
    """The inverse of `encode_kv_metadata`: {(pp, tp): payload bytes}, or None for anything else."""
    if not isinstance(kv_metadata, dict) or kv_metadata.get("format") != KV_METADATA_FORMAT:
        return None
    ranks = kv_metadata.get("ranks")
    if not isinstance(ranks, dict):
        return None
    out: dict[tuple[int, int], bytes] = {}
    try:
        for key, b64 in ranks.items():
            pp, tp = (int(x) for x in key.split(","))
            out[(pp, tp)] = base64.b64decode(b64, validate=True)
    except (ValueError, TypeError, AttributeError):
        return None
    return out


def build_advertisement(s: PluginSettings, payloads: Mapping[tuple[int, int], bytes], compatibility_hash: str | None,
                        transport: str | None, side_channel_host: str, side_channel_port: int) -> EngineAdvertisement:
    ip = s.env.get("POD_IP") or side_channel_host
    host = f"[{ip}]" if ":" in ip else ip
    if s.role is None:
        raise ValueError("cannot tell this engine's role: set $DISAGG_ROLE (kv_role is kv_both)")
    return EngineAdvertisement(
        role=s.role, engine_id=s.engine_id, deployment=s.deployment, pod_name=s.env.get("POD_NAME") or None,
        pod_uid=s.env.get("POD_UID") or None, http_url=f"http://{host}:{s.http_port}",
        side_channel_host=side_channel_host, side_channel_ports=list(range(side_channel_port,
                                                                           side_channel_port + s.dp_size)),
        tp_size=s.tp_size, pp_size=s.pp_size, dp_size=s.dp_size, block_size=s.block_size,
        layout_key=s.layout_key, kv_mode=s.kv_mode, transport=transport,
        kv_metadata=encode_kv_metadata(payloads, compatibility_hash) if payloads else None,
        lease_seconds=LEASE_HEARTBEATS * s.heartbeat_seconds)


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
        a = self.advertisement
        log.info("disagg plugin: advertising %s engine %s (transport %s, %d handshake payload(s)) to %s", a.role,
                 a.engine_id, a.transport, len((a.kv_metadata or {}).get("ranks", {})),  # type: ignore[union-attr]
                 self.url)
        self.registration.start_thread()
        self._deregister_on_sigterm()

    def stop(self) -> None:
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

        def on_sigterm(signum: int, frame: object) -> None:
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
