"""Worker side of the plugin: load compatible peers' NIXL agents before a request needs them.

vLLM meets a peer lazily: the first request between two engines asks the peer's side channel for its NIXL
metadata (GET_META), loads it, then transfers. That costs from milliseconds to seconds, lands on the first
request's critical path, and on a busy 2-core machine it can stall long enough for the request to time out.
Here each worker follows the rendezvous and, for every compatible peer, runs vLLM's own `_ensure_handshake`
ahead of time:

- push mode: prefill loads each decode engine's agent with its KV descriptors (what a WRITE needs), and decode
  loads each prefill engine's agent for notifications only (what PUSH_REG needs) — both straight from the
  handshake payloads the peer advertised, without a side-channel round trip; then prefill warms the pair's
  WRITE path with one empty transfer (`write_warmup`);
- pull mode: decode handshakes with each prefill over the side channel in the background (pull needs the
  peer's clock offset, which only that round trip measures);
- a peer whose entry is deleted or expires is released on the engine's main thread, like vLLM releases peers,
  once it has been gone for `DEPARTED_GRACE` seconds and no KV crosses with it any more.

The one hook into vLLM: the worker's `_nixl_handshake` is replaced on the instance by `_handshake`, which uses
the advertised payload when there is one and calls vLLM's original otherwise. Everything else (futures, locks,
agent bookkeeping, the single handshake thread) is vLLM's. Every touch of the worker goes through its
`vllm_shim.WorkerShim`.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from ..rendezvous.client import EngineCache, RendezvousClient
from ..wire import kv_metadata
from ..wire.advertisement import EngineAdvertisement, WatchEvent
from .settings import PluginSettings
from .vllm_shim import Agents, MissingRank, WorkerShim
from .write_warmup import SkipWarmup, warm_write_path

log = logging.getLogger("disagg.plugin")
EMPTY_HEARTBEAT = b"HB:"
"""vLLM's heartbeat notification with no request ids: every NIXL worker accepts it and changes nothing."""
DEPARTED_GRACE = 10.0
"""Seconds a departed peer's agent is kept even when nothing this worker tracks uses it. A stopping engine leaves
the rendezvous first and drains after, and between its leaving and this worker's bookkeeping a request's KV can be
where no check sees it: its registration still in NIXL's notification queue, or popped by vLLM's writer thread and
not yet posted as a WRITE. Each of those lasts milliseconds; releasing the agent in one fails that request."""


class PeerPrewarmer:
    def __init__(self, shim: WorkerShim, settings: PluginSettings,
                 writing_to: Callable[[str], bool] = lambda engine_id: False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`writing_to(engine_id)`: a WRITE of this worker's to that engine is in flight (any thread)."""
        self.shim = shim
        self.settings = settings
        self.writing_to = writing_to
        self.clock = clock
        self.peers: dict[str, EngineAdvertisement] = {}
        self.counts = {"from_advertisement": 0, "side_channel": 0, "released": 0, "failed": 0, "write_warmed": 0}
        self._lock = threading.Lock()
        self._departed: queue.SimpleQueue[tuple[str, float]] = queue.SimpleQueue()  # (engine id, when it left)
        self._side_channel_handshake = shim.hook_handshake(self._handshake)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None

    # -- following the rendezvous (own thread, own event loop) --------------------------------------------
    def start(self) -> None:
        ready = threading.Event()

        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            s = self.settings
            client = RendezvousClient(s.rendezvous_url or "", token=s.token, token_file=s.token_file, timeout=5.0)
            cache = EngineCache()
            cache.listeners.append(self._on_event)
            self._task = asyncio.current_task()
            ready.set()
            try:
                await cache.follow(client)
            finally:
                await client.close()

        def run() -> None:
            try:
                asyncio.run(main())
            except asyncio.CancelledError:
                pass
            except Exception:  # the engine keeps serving on lazy handshakes
                log.exception("disagg plugin: rendezvous watch ended")

        self._thread = threading.Thread(target=run, name="disagg-peer-prewarm", daemon=True)
        self._thread.start()
        ready.wait(5)
        log.info("disagg plugin: %s engine %s follows %s for %s peers", self.settings.role,
                 self.settings.engine_id, self.settings.rendezvous_url, self._peer_role())

    def stop(self) -> None:
        if self._loop is not None and self._task is not None:
            self._loop.call_soon_threadsafe(self._task.cancel)
        if self._thread is not None:
            self._thread.join(5)

    def _peer_role(self) -> str:
        return "decode" if self.settings.role == "prefill" else "prefill"

    def _on_event(self, ev: WatchEvent) -> None:
        adv = ev.engine
        if adv is None or not self.settings.compatible_peer(adv):
            return
        if ev.type in ("ADDED", "MODIFIED"):
            with self._lock:
                self.peers[adv.engine_id] = adv
            self._prewarm(adv)
        else:
            with self._lock:
                self.peers.pop(adv.engine_id, None)
            self._departed.put((adv.engine_id, self.clock()))

    def _prewarm(self, adv: EngineAdvertisement) -> None:
        s = self.settings
        if s.kv_mode == "pull" and s.role != "decode":
            return  # a pull prefill never loads its readers' agents
        notif_only = s.kv_mode == "push" and s.role == "decode"
        t0 = time.perf_counter()
        fut = self.shim.ensure_handshake(adv.engine_id, adv.side_channel_host, adv.side_channel_port, adv.tp_size,
                                         pp_size=adv.pp_size, notif_agents_only=notif_only)
        if fut is None:
            return  # already loaded

        def done(f: Any) -> None:
            if f.exception() is not None:
                self.counts["failed"] += 1
                log.warning("disagg plugin: pre-warming %s engine %s failed (lazy handshake stays the fallback): "
                            "%s", adv.role, adv.engine_id, f.exception())
            else:
                log.info("disagg plugin: pre-warmed %s engine %s in %.1f ms", adv.role, adv.engine_id,
                         (time.perf_counter() - t0) * 1000)
        fut.add_done_callback(done)

    # -- the hook: runs on vLLM's handshake thread ---------------------------------------------------------
    def _handshake(self, host: str, port: int, remote_tp_size: int, expected_engine_id: str,
                   remote_dcp_size: int = 1, remote_pp_size: int = 1,
                   notif_agents_only: bool = False) -> tuple[Agents, float]:
        with self._lock:
            adv = self.peers.get(expected_engine_id)
        payloads = kv_metadata.decode(adv.kv_metadata) if adv is not None and self.settings.kv_mode == "push" \
            else None
        if payloads is not None:
            try:
                agents = self._load_advertised(payloads, remote_tp_size, expected_engine_id, remote_dcp_size,
                                               remote_pp_size, notif_agents_only)
                self.counts["from_advertisement"] += 1
                log.info("disagg plugin: loaded %s engine %s's NIXL agent from its advertisement (%d rank(s), "
                         "no side-channel handshake)", adv.role, expected_engine_id, len(agents))  # type: ignore
                # Push never reads the clock offset (pull's is measured by the side-channel round trip).
                return agents, 0.0
            except MissingRank as e:
                log.info("disagg plugin: %s; using the side channel", e)
        self.counts["side_channel"] += 1
        log.info("disagg plugin: side-channel handshake with engine %s at %s:%d", expected_engine_id, host, port)
        return self._side_channel_handshake(host, port, remote_tp_size, expected_engine_id, remote_dcp_size,
                                            remote_pp_size, notif_agents_only)

    def _load_advertised(self, payloads: dict[tuple[int, int], bytes], remote_tp_size: int, engine_id: str,
                         remote_dcp_size: int, remote_pp_size: int, notif_agents_only: bool) -> Agents:
        """vLLM's `_nixl_handshake` with the payloads taken from the advertisement instead of GET_META, then one
        message over each new connection and, for a push prefill, the WRITE warm-up."""
        agents = self.shim.load_agents(payloads, remote_tp_size, engine_id, remote_dcp_size, remote_pp_size,
                                       notif_agents_only)
        for name in agents.values():
            try:
                # Set up the transport endpoint now rather than on the first transfer, and carry one message over
                # it: an empty vLLM heartbeat, which the peer reads as extending no lease. Without it the first
                # message of the pair's first request (decode's PUSH_REG, or prefill's completion) rode a
                # connection never used before, and now and then arrived ~100 ms late (bench/cold_pair.py).
                self.shim.connect(name, EMPTY_HEARTBEAT)
            except Exception as e:
                log.info("disagg plugin: connecting to %s ahead of time failed: %s (connects on first use)", name, e)
        if not notif_agents_only and self.settings.write_warmup:
            self._warm_write_path(engine_id)
        return agents

    def _warm_write_path(self, engine_id: str) -> None:
        try:
            done = warm_write_path(self.shim, engine_id)
        except SkipWarmup as e:
            log.info("disagg plugin: not warming the WRITE path to decode engine %s: %s", engine_id, e)
        except Exception as e:  # the first request sets the transport up instead, as without the plugin
            self.counts["failed"] += 1
            log.warning("disagg plugin: warming the WRITE path to decode engine %s failed: %s", engine_id, e)
        else:
            self.counts["write_warmed"] += 1
            log.info("disagg plugin: warmed the WRITE path to decode engine %s in %.1f ms: null block, rank(s) %s, "
                     "remote descriptors %s, local descriptors %s", engine_id, done.seconds * 1000,
                     list(done.ranks), list(done.remote_desc_ids), list(done.local_desc_ids))

    # -- releasing departed peers: the engine's main thread ------------------------------------------------
    def release_departed(self) -> None:
        """Release the agents of engines that left the rendezvous at least `DEPARTED_GRACE` seconds ago, except
        those this worker still exchanges KV with: a stopping engine leaves first and drains after, and its
        requests' KV must still cross."""
        later = []
        now = self.clock()
        while True:
            try:
                engine_id, left = self._departed.get_nowait()
            except queue.Empty:
                break
            with self._lock:
                if engine_id in self.peers:
                    continue  # it came back
            if now - left < DEPARTED_GRACE or self.shim.busy_with(engine_id) or self.writing_to(engine_id):
                later.append((engine_id, left))
                continue
            t0 = time.perf_counter()
            if self.shim.release_if_loaded(engine_id):
                self.counts["released"] += 1
                log.info("disagg plugin: released NIXL agent of departed engine %s in %.1f ms", engine_id,
                         (time.perf_counter() - t0) * 1000)
        for entry in later:
            self._departed.put(entry)  # looked at again next step

