"""The disagg KV connector plugin for vLLM: vLLM's own NIXL connectors, plus advertisement and peer pre-warming.

vLLM loads it through `kv_transfer_config.kv_connector_module_path = "disagg.connector.plugin"`. The classes
keep vLLM's names (`NixlPushConnector`, `NixlConnector`, `NixlPullConnector`) on purpose: vLLM checks connector
*names* in several places (`has_connector("NixlConnector")`), and an engine with the plugin must behave exactly
like one without it. Everything the plugin adds is beside the transfer path, never in it:

- scheduler side (the engine-core process): once the workers have registered their KV caches, advertise this
  engine to the rendezvous (`advertiser`), including every rank's NIXL handshake payload, and renew
  the lease until shutdown;
- worker side (each worker process): watch the rendezvous and load compatible peers' NIXL agents before any
  request needs them (`prewarm`), and drop them when the peer's entry goes away;
- push decode: a request whose prefill's KV does not come within `push_registration_timeout` is failed (vLLM's
  watchdog only drops its registration), so the client gets an error instead of waiting indefinitely;
- push decode: a WRITE that lands is reported at the end of the engine step it landed in, not one step later
  (`push_notify`);
- CPU engines: a step's KV work starts before its forward, not after it (`bind_connector_metadata`);
- worker side, where `$DISAGG_NIXL_PROGRESS_DELAY_US` is set: NIXL's progress thread sleeps in poll() instead of
  spinning a core (`nixl_progress`). It concerns NIXL, not vLLM, so it holds even where the plugin steps aside.

A rendezvous that is missing, slow or down never blocks or fails the engine: both sides run in their own
threads, and vLLM's lazy side-channel handshake stays the fallback. Every access to vLLM's internals goes
through `vllm_shim`, which checks them first; on a vLLM it does not know, the plugin steps aside.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import connector as nixl
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlHandshakePayload

from ..wire import env as wire_env
from . import vllm_shim
from .advertiser import EngineAdvertiser
from .cpu_amx import request_amx
from .nixl_progress import delay_from_env, progress_delay
from .prewarm import PeerPrewarmer
from .push_cancel import WAKE_SECONDS, Address, CancelOrder, DecodeCancels, Mailbox, PrefillCancels
from .settings import PluginSettings
from .vllm_shim import SchedulerShim, WorkerShim

log = logging.getLogger("disagg.plugin")


def _log_like_vllm() -> None:
    """Send the plugin's (and its rendezvous client's) `disagg.*` log records through vLLM's handlers, so they
    land in the engine log in vLLM's format. vLLM configures only its own `vllm` logger."""
    ours, theirs = logging.getLogger("disagg"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(logging.INFO)
    ours.propagate = False


_log_like_vllm()  # vLLM configures its logger on import, before it imports connector modules
vllm_shim.check_vllm()  # once per process: a vLLM other than the one the plugin knows makes it step aside


@dataclasses.dataclass
class _PayloadWithTransport(NixlHandshakePayload):
    """What a worker hands its scheduler: vLLM's handshake payload plus the NIXL backends the worker really
    instantiated and, if the plugin stepped aside in the worker's process, why (only the worker process knows
    either). The scheduler strips the extra fields before vLLM serves the payload to peers, so the wire format
    stays vLLM's."""

    transport: str | None = None
    stepped_aside: str | None = None


class _DisaggMixin:
    """The plugin's additions, shared by the push and pull connectors. Requires a NixlBaseConnector.

    Each addition runs only while the plugin is active in its process (`vllm_shim`): with the plugin stepped
    aside, every method below is vLLM's own."""

    def _disagg_init(self, vllm_config: Any, role: KVConnectorRole) -> None:
        self._disagg = PluginSettings.from_vllm(vllm_config)
        self._advertiser: EngineAdvertiser | None = None
        self._prewarmer: PeerPrewarmer | None = None
        self._worker_shim: WorkerShim | None = None
        self._started: Any = None  # the metadata whose KV work started at bind time (bind_connector_metadata)
        self._scheduler_shim: SchedulerShim | None = None
        # Push decode, scheduler side: each registered request's prefill, and the cancels for the next step.
        self._push_prefills: dict[str, Address] = {}
        self._cancel_orders: list[CancelOrder] = []
        # Push, worker side (push_cancel).
        self._decode_cancels: DecodeCancels | None = None
        self._prefill_cancels: PrefillCancels | None = None
        self._control_stop = threading.Event()
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler_shim = SchedulerShim.attach(vllm_shim.connector_scheduler(self),
                                                        push=self._disagg.kv_mode == "push")
            if self._disagg.rendezvous_url is None:
                log.info("disagg plugin: no $DISAGG_RENDEZVOUS_URL; not advertising, peers handshake lazily")

    # -- worker side --------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Any) -> None:
        super().register_kv_caches(kv_caches)  # type: ignore[misc]
        # After vLLM's registration: the worker's layout attributes exist only from here on.
        self._worker_shim = shim = WorkerShim.attach(vllm_shim.connector_worker(self))
        if shim is None:
            return
        if self._disagg.cpu_engine:
            import torch

            said = request_amx(torch.cpu)
            if said is not None:
                log.info("disagg plugin: %s", said)
        self._disagg.transport = "+".join(shim.backends()) or None
        if self._disagg.kv_mode == "push":
            self._start_push_control(shim)
        if self._disagg.start_loads_at_bind:
            log.info("disagg plugin: a step's KV transfers start before its forward (a CPU forward is synchronous)")
        if self._disagg.kv_mode == "push" and self._disagg.role == "decode" and self._disagg.push_notify_on_step \
                and shim.notify_on_step() is not None:
            log.info("disagg plugin: push decode has its writer read NIXL notifications at the end of every "
                     "engine step")
        if self._disagg.rendezvous_url is not None and self._prewarmer is None:
            self._prewarmer = PeerPrewarmer(shim, self._disagg)
            if self._prefill_cancels is not None:
                self._prewarmer.writing_to = self._prefill_cancels.writing_to
            self._prewarmer.start()

    def _start_push_control(self, shim: WorkerShim) -> None:
        """Carry push cancels between this worker and its peers (`push_cancel`)."""
        if (problem := shim.push_control_problem()) is not None:
            log.info("disagg plugin: push cancels off in this worker (vLLM's push worker %s); a cancelled request's "
                     "blocks wait for its registration deadline", problem)
            return
        s = self._disagg
        me = Address(s.engine_id, s.env.get(wire_env.SIDE_CHANNEL_HOST, ""),
                     int(s.env.get(wire_env.SIDE_CHANNEL_PORT) or 0), s.tp_size, s.pp_size, (0, shim.tp_rank))
        mailbox = Mailbox(shim.wake_writer)
        prefill = PrefillCancels(me, mailbox, shim.base_request_id) if s.role == "prefill" else None
        self._prefill_cancels = prefill
        if s.role == "decode":
            self._decode_cancels = DecodeCancels(me, mailbox, shim.fail_receive, shim.has_receive)
        shim.hook_push_control(mailbox, self._decode_cancels, prefill, self._control_stop, WAKE_SECONDS)
        log.info("disagg plugin: push %s carries cancels: %s", s.role,
                 "a cancelled request's blocks are freed once its prefill answers" if s.role == "decode" else
                 "a cancelled registration is dropped, and its prefill's blocks are released at once")

    def get_handshake_metadata(self) -> Any:
        payload = super().get_handshake_metadata()  # type: ignore[misc]
        if isinstance(payload, NixlHandshakePayload):
            return _PayloadWithTransport(payload.compatibility_hash, payload.agent_metadata_bytes,
                                         transport=self._disagg.transport,
                                         stepped_aside=None if self._worker_shim is not None
                                         else vllm_shim.stepped_aside() or "the worker was not checked")
        return payload

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        """vLLM binds a step's metadata before its forward, and starts the step's KV work (pull READs, push
        registrations, push WRITEs of finished prefills) right after the forward's launch: on an accelerator the
        launch returns at once and the transfers overlap the step. A CPU forward runs to its end before it
        returns, so there vLLM's order would hold every transfer back by a whole step. With
        `start_loads_at_bind`, the step's KV work starts here instead, before the forward, as on a GPU; by then
        vLLM has zeroed the step's new blocks (synchronously, on CPU), so no transfer lands before that."""
        super().bind_connector_metadata(connector_metadata)  # type: ignore[misc]
        if self._disagg.start_loads_at_bind and self._worker_shim is not None:
            self.start_load_kv(None)
            self._started = connector_metadata

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._started is not None and self._started is vllm_shim.connector_metadata(self):
            return  # started when it was bound
        super().start_load_kv(forward_context, **kwargs)  # type: ignore[misc]
        if self._prewarmer is not None:
            # The engine's main thread, where vLLM itself releases peers; after this step's receives are recorded,
            # so a request registering with a departing prefill keeps its agent.
            self._prewarmer.release_departed()
        if self._worker_shim is not None:
            meta = vllm_shim.connector_metadata(self)
            for request_id in vllm_shim.failed_receives(meta):
                if self._worker_shim.fail_receive(request_id):
                    log.warning("disagg plugin: request %s: no KV from its prefill engine within the registration "
                                "timeout; failing it", request_id)
            for order in vllm_shim.cancels(meta):
                self._cancel(order)

    def _cancel(self, order: CancelOrder) -> None:
        """A push decode request that will not take its KV (worker main thread)."""
        assert self._worker_shim is not None
        if not order.holds_blocks:
            self._worker_shim.drop_empty_receive(order.request_id)
        if self._decode_cancels is not None:
            log.info("disagg plugin: request %s %s; telling prefill engine %s", order.request_id, order.reason,
                     order.prefill.engine_id)
            self._decode_cancels.cancel(order)
        elif order.holds_blocks and self._worker_shim.fail_receive(order.request_id):
            # No cancels in this worker: free the blocks now, as vLLM would at the timeout (the prefill may
            # still WRITE them: vllm#55470).
            log.warning("disagg plugin: request %s %s; failing its receive", order.request_id, order.reason)

    # -- scheduler side ------------------------------------------------------------------------------------
    def _push_decode_scheduler(self) -> SchedulerShim | None:
        shim = self._scheduler_shim
        return shim if shim is not None and shim.push and self._disagg.role == "decode" else None

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)  # type: ignore[misc]
        shim = self._push_decode_scheduler()
        rid = vllm_shim.request_id(request)
        if shim is not None and shim.registration_deadline(rid) is not None and rid not in self._push_prefills:
            if (prefill := _prefill_address(vllm_shim.request_params(request))) is not None:
                self._push_prefills[rid] = prefill

    def request_finished(self, request: Any, block_ids: Any) -> Any:
        self._cancel_if_waiting(request)
        return super().request_finished(request, block_ids)  # type: ignore[misc]

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> Any:
        self._cancel_if_waiting(request)
        return super().request_finished_all_groups(request, block_ids)  # type: ignore[misc]

    def _cancel_if_waiting(self, request: Any) -> None:
        """A push decode request finishing before its KV came (its client went away): tell its prefill.

        Registered (its blocks are allocated and the prefill knows them): vLLM's scheduler holds the blocks until
        the worker reports the receive done, which the prefill's answer now brings. Never allocated: nothing is
        held here, but the prefill may hold the finished prefill's blocks for it."""
        shim = self._push_decode_scheduler()
        if shim is None:
            return
        rid = vllm_shim.request_id(request)
        prefill = self._push_prefills.pop(rid, None)
        deadline = shim.registration_deadline(rid)
        if prefill is not None and deadline is not None:
            self._cancel_orders.append(CancelOrder(rid, prefill, deadline, holds_blocks=True))
            return
        params = vllm_shim.request_params(request)
        if params is not None and params.get("do_remote_prefill") and \
                (prefill := _prefill_address(params)) is not None:
            timeout = shim.registration_timeout() or 0.0
            self._cancel_orders.append(CancelOrder(rid, prefill, time.time() + timeout, holds_blocks=False))

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)  # type: ignore[misc]
        for rid in getattr(connector_output, "finished_recving", None) or ():
            self._push_prefills.pop(rid, None)

    def has_pending_push_work(self) -> bool:
        # Keep stepping until the cancels reach the workers (an idle engine builds no metadata).
        return bool(self._cancel_orders) or bool(super().has_pending_push_work())  # type: ignore[misc]

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        """vLLM's metadata for this step, plus the push decode requests to cancel: those whose client went away
        (`_cancel_if_waiting`) and those whose registration vLLM's watchdog just dropped
        (`push_registration_timeout` passed without their KV). vLLM only drops the registration, and the request
        would wait on; the workers cancel it with its prefill instead and then fail its receive, so the scheduler
        finishes it with an error (vLLM's default `kv_load_failure_policy: fail`) and the client gets an answer.
        Outgoing registrations get their wall-clock deadline, past which their prefill must not WRITE them."""
        shim = self._scheduler_shim
        if shim is None or not shim.push:
            return super().build_connector_meta(scheduler_output)  # type: ignore[misc]
        watched = shim.watched_registrations()
        meta = super().build_connector_meta(scheduler_output)  # type: ignore[misc]
        # Within this call only vLLM's watchdog removes deadlines, so the difference is exactly its expiries.
        if expired := watched - shim.watched_registrations():
            log.warning("disagg plugin: push registration of request(s) %s timed out after %.1f s; failing them",
                        sorted(expired), shim.registration_timeout())
            unknown = set()
            for rid in sorted(expired):
                if (prefill := self._push_prefills.pop(rid, None)) is None:
                    unknown.add(rid)
                else:
                    self._cancel_orders.append(CancelOrder(rid, prefill, time.time(), holds_blocks=True,
                                                           reason="timed out"))
            if unknown:
                vllm_shim.mark_failed_receives(meta, unknown)
        shim.stamp_deadlines(meta)
        if self._cancel_orders:
            vllm_shim.carry_cancels(meta, self._cancel_orders)
            self._cancel_orders = []
        return meta

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        transports = {m.transport for m in metadata.values() if isinstance(m, _PayloadWithTransport)}
        aside = {rank: m.stepped_aside if isinstance(m, _PayloadWithTransport) else "no plugin payload"
                 for rank, m in metadata.items()}
        plain = {rank: NixlHandshakePayload(m.compatibility_hash, m.agent_metadata_bytes)
                 if isinstance(m, NixlHandshakePayload) else m for rank, m in metadata.items()}
        super().set_xfer_handshake_metadata_pp_aware(plain)  # type: ignore[misc]
        if self._disagg.rendezvous_url is None or self._advertiser is not None or self._scheduler_shim is None:
            return
        if reasons := {f"{rank}: {why}" for rank, why in aside.items() if why}:
            vllm_shim.step_aside(f"worker rank(s) stepped aside ({'; '.join(sorted(reasons))})")
            return
        transport = "+".join(sorted(t for t in transports if t)) or None
        try:
            encoded = {rank: msgspec.msgpack.encode(m) for rank, m in plain.items()}
            hashes = {m.compatibility_hash for m in plain.values()}
            host, port = self._scheduler_shim.side_channel()
            self._advertiser = EngineAdvertiser(self._disagg, encoded, hashes.pop() if len(hashes) == 1 else None,
                                                transport, host, port)
            self._advertiser.start()
        except Exception:  # a broken advertisement must not take the engine down: peers fall back to lazy
            log.exception("disagg plugin: cannot advertise this engine; peers will handshake lazily")

    # -- both ----------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        self._control_stop.set()
        for part in (self._advertiser, self._prewarmer):
            if part is not None:
                try:
                    part.stop()
                except Exception:
                    log.exception("disagg plugin: stopping %s failed", type(part).__name__)
        self._advertiser = self._prewarmer = None
        super().shutdown()  # type: ignore[misc]


def _prefill_address(params: dict[str, Any] | None) -> Address | None:
    """The prefill engine a push decode request registers with, from its kv_transfer_params (the router's)."""
    try:
        assert params is not None
        return Address(str(params["remote_engine_id"]), str(params["remote_host"]), int(params["remote_port"]),
                       int(params["tp_size"]), int(params.get("pp_size") or 1))
    except (AssertionError, KeyError, TypeError, ValueError):
        return None


class _KeepCpuAffinity:
    """Undo the CPU-affinity change vLLM's NIXL worker makes on CPU platforms.

    On a CPU device, vLLM's NIXL worker moves the calling thread to the last core of each NUMA node ("reserve
    cores for KV transfer"). The calling thread is the worker's main thread, which is also the thread that runs
    the model (OpenMP thread 0), so the engine's `VLLM_CPU_OMP_THREADS_BIND` pinning is silently replaced:
    on a 2-core machine both engines' model threads end up on core 1 while NIXL's progress thread (created
    just before, so still on the engine's own core) spins alone on core 0. Measured here: prefills of a few
    hundred tokens stalled 10-40 s and push requests timed out. Restoring the engine's binding keeps each
    engine on its own cores. A no-op wherever vLLM leaves the affinity alone (GPU and Neuron devices)."""

    def __enter__(self) -> None:
        self.before = os.sched_getaffinity(0)

    def __exit__(self, *exc: object) -> None:
        after = os.sched_getaffinity(0)
        if after != self.before:
            os.sched_setaffinity(0, self.before)
            log.info("disagg plugin: vLLM's NIXL worker moved the model thread to CPUs %s; restored the engine's "
                     "own binding %s", sorted(after), sorted(self.before))


class NixlPushConnector(_DisaggMixin, nixl.NixlPushConnector):
    """vLLM's push (WRITE) NIXL connector with the disagg plugin."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        with _KeepCpuAffinity(), progress_delay(delay_from_env(os.environ)):
            super().__init__(vllm_config, role, kv_cache_config)
        self._disagg_init(vllm_config, role)


class NixlPullConnector(_DisaggMixin, nixl.NixlPullConnector):
    """vLLM's pull (READ) NIXL connector with the disagg plugin."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        with _KeepCpuAffinity(), progress_delay(delay_from_env(os.environ)):
            super().__init__(vllm_config, role, kv_cache_config)
        self._disagg_init(vllm_config, role)


NixlConnector = NixlPullConnector  # vLLM's own alias, kept for the same reason as the names

__all__ = ["NixlConnector", "NixlPullConnector", "NixlPushConnector"]
