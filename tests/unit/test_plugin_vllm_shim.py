"""The plugin uses vLLM's internals only through `vllm_shim`, and steps aside when they are not what it knows.

vLLM is not installed here. The real worker passes the check on real engines (tests/engines: no engine logs
"stepping aside"); a vLLM release that renames an attribute cannot be produced on this machine, so that case
uses named fakes: `CompleteWorker` has every attribute `NixlWorker` declares, `WorkerMissingAttribute` lacks
one, `WorkerRaisingOnAccess` raises while being checked.
"""
from __future__ import annotations

import logging
import queue
import sys
import threading
import types

import pytest

from disagg.connector.plugin import vllm_shim
from disagg.connector.plugin.vllm_shim import (
    NixlPushScheduler,
    NixlWorker,
    SchedulerShim,
    WorkerShim,
    missing_attributes,
    required_attributes,
    version_problem,
)


@pytest.fixture(autouse=True)
def active_plugin(monkeypatch):
    """Each test starts in a process where the plugin has not stepped aside (the state is per process)."""
    monkeypatch.setattr(vllm_shim, "_aside_reason", None)


class FakeNixlWrapper:
    backends = ["UCX"]

    def make_connection(self, agent_name): ...
    def send_notif(self, agent_name, notif_msg): ...
    def make_prepped_xfer(self, *args): ...
    def transfer(self, handle): ...
    def check_xfer_state(self, handle): ...
    def release_xfer_handle(self, handle): ...


class FakeTopology:
    def handshake_target_ranks(self, remote_tp_size, remote_dcp_size): ...
    def get_engine_info(self, engine_id): ...
    def tp_ratio(self, remote_tp_size): ...
    def block_size_ratio(self, remote_block_size): ...


class CompleteWorker:
    """FAKE: every attribute of vLLM 0.32's NIXL worker that the plugin uses, and nothing behind them."""

    def __init__(self) -> None:
        self.nixl_wrapper, self.transfer_topo = FakeNixlWrapper(), FakeTopology()
        self.engine_id, self.use_host_buffer, self.device_id = "decode-1", False, 0
        self.enforce_compat_hash, self.compat_hash = True, "abc"
        self.region_group_ids, self.dst_num_blocks, self.dst_region_num_blocks = [], {}, {}
        self.dst_region_group_ids, self.dst_uses_region_group_mapping = {}, {}
        self.src_xfer_handles_by_block_size, self.dst_xfer_side_handles = {}, {}
        self._is_csa_linear = self._has_mamba = self._uses_region_group_mapping = False
        self._transfer_layer_group_ids, self._group_spec_types = (), ()
        self._physical_blocks_per_logical_kv_block = 1
        self._handshake_lock, self._remote_agents, self._handshake_futures = threading.Lock(), {}, {}
        self._recving_metadata: dict = {}
        self._failed_recv_reqs: queue.Queue[str] = queue.Queue()

    def _nixl_handshake(self, *args, **kwargs): ...
    def _ensure_handshake(self, *args, **kwargs): ...
    def _validate_csa_linear_tp_layout(self, remote_tp_size): ...
    def _validate_remote_parallel_config(self, meta): ...
    def _add_notif_only_remote_agent(self, *args): ...
    def add_remote_agent(self, *args): ...
    def _cleanup_remote_engine(self, engine_id, *, log_eviction=True): ...
    def _compute_desc_ids(self, *args, **kwargs): ...
    def _logical_to_kernel_block_ids(self, block_ids, ratio): ...


class WorkerMissingAttribute(CompleteWorker):
    """FAKE: a NIXL worker of a vLLM that renamed one of the attributes the plugin uses."""

    def __init__(self) -> None:
        super().__init__()
        del self._handshake_futures


class WorkerRaisingOnAccess(CompleteWorker):
    """FAKE: a NIXL worker whose attribute raises something other than AttributeError when read."""

    @property
    def transfer_topo(self):
        raise RuntimeError("not registered yet")

    @transfer_topo.setter
    def transfer_topo(self, value): ...


def stepping_aside(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "stepping aside" in r.getMessage()]


@pytest.mark.parametrize("version, ok", [("0.32.0", True), ("0.32.1", True), ("0.32.0+cpu", True),
                                         ("0.33.0", False), ("0.31.2", False), ("1.32.0", False),
                                         ("dev", False)])
def test_only_the_vllm_it_is_built_against_is_used(version, ok):
    assert (version_problem(version) is None) is ok


def test_the_protocol_lists_what_the_plugin_uses_including_nested_calls():
    names = required_attributes(NixlWorker)
    for name in ("_nixl_handshake", "_ensure_handshake", "_remote_agents", "_failed_recv_reqs",
                 "nixl_wrapper", "nixl_wrapper.send_notif", "transfer_topo.get_engine_info"):
        assert name in names
    assert len(names) == len(set(names))
    assert {"side_channel_host", "_push_registration_deadlines"} <= set(required_attributes(NixlPushScheduler))


def test_a_complete_worker_gets_a_shim_and_the_plugin_stays(caplog):
    assert missing_attributes(CompleteWorker(), NixlWorker) == []
    assert isinstance(WorkerShim.attach(CompleteWorker()), WorkerShim)
    assert vllm_shim.stepped_aside() is None and stepping_aside(caplog) == []


def test_a_worker_missing_an_attribute_makes_the_plugin_step_aside_once(caplog):
    caplog.set_level(logging.WARNING, logger="disagg.plugin")
    assert WorkerShim.attach(WorkerMissingAttribute()) is None
    assert "_handshake_futures" in vllm_shim.stepped_aside()
    # From then on nothing of vLLM's is touched in this process, even for a worker that would pass.
    assert WorkerShim.attach(CompleteWorker()) is None
    assert SchedulerShim.attach(object(), push=True) is None
    [line] = stepping_aside(caplog)
    assert "WorkerMissingAttribute" in line and "lacks _handshake_futures" in line


def test_a_method_that_is_no_longer_callable_counts_as_missing():
    worker = CompleteWorker()
    worker._ensure_handshake = None
    worker.nixl_wrapper = type("Wrapper", (), {"backends": [], "send_notif": "renamed"})()
    missing = missing_attributes(worker, NixlWorker)
    assert "_ensure_handshake" in missing and "nixl_wrapper.send_notif" in missing
    assert "nixl_wrapper.make_connection" in missing and "nixl_wrapper.backends" not in missing


def test_an_exception_while_checking_makes_the_plugin_step_aside(caplog):
    caplog.set_level(logging.WARNING, logger="disagg.plugin")
    assert WorkerShim.attach(WorkerRaisingOnAccess()) is None
    assert "not registered yet" in vllm_shim.stepped_aside()
    assert len(stepping_aside(caplog)) == 1


def test_a_push_scheduler_without_the_watchdog_is_refused_but_a_pull_one_needs_none():
    class PullScheduler:
        side_channel_host, side_channel_port = "127.0.0.1", 5600

    assert SchedulerShim.attach(PullScheduler(), push=False).side_channel() == ("127.0.0.1", 5600)
    assert SchedulerShim.attach(PullScheduler(), push=True) is None
    assert "_push_registration_deadlines" in vllm_shim.stepped_aside()


def test_a_failed_receive_goes_through_vllms_own_queue_only_for_a_receive_the_worker_waits_for():
    worker = CompleteWorker()
    worker._recving_metadata["req-1"] = object()
    shim = WorkerShim(worker)
    assert shim.fail_receive("req-1") and not shim.fail_receive("req-unknown")
    assert worker._failed_recv_reqs.get_nowait() == "req-1" and worker._failed_recv_reqs.empty()


def test_expired_registrations_travel_in_the_step_metadata():
    class Metadata:  # vLLM's NixlConnectorMetadata is a plain object
        pass

    meta = Metadata()
    assert vllm_shim.failed_receives(meta) == frozenset()
    vllm_shim.mark_failed_receives(meta, {"a", "b"})
    assert vllm_shim.failed_receives(meta) == {"a", "b"}


def fake_vllm(version: str) -> types.ModuleType:
    """FAKE: a `vllm` module that has only a version (vLLM is not installed here)."""
    module = types.ModuleType("vllm")
    module.__version__ = version
    return module


def test_another_vllm_version_makes_the_plugin_step_aside_before_touching_anything(monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="disagg.plugin")
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm("0.33.1"))
    assert "vLLM 0.33.1 is not the 0.32.x" in vllm_shim.check_vllm()
    assert WorkerShim.attach(CompleteWorker()) is None
    assert len(stepping_aside(caplog)) == 1


def test_the_supported_vllm_version_keeps_the_plugin(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm("0.32.0"))
    assert vllm_shim.check_vllm() is None and vllm_shim.stepped_aside() is None


def test_a_worker_is_busy_with_an_engine_whose_kv_it_still_exchanges():
    """A departed engine's agent stays while a receive of this worker waits for its KV (decode) or a registration
    of its waits for this worker's prefill (prefill): a stopping engine leaves the rendezvous first, drains after."""
    w = CompleteWorker()
    shim = WorkerShim.attach(w)
    assert shim is not None
    w._recving_metadata["r1"] = types.SimpleNamespace(remote=types.SimpleNamespace(engine_id="prefill-a"))
    w._recving_metadata["r2"] = types.SimpleNamespace(remote=None)
    w._pending_d_registrations = {"r3": {"decode_engine_id": "decode-b"}}
    assert shim.busy_with("prefill-a") and shim.busy_with("decode-b")
    assert not shim.busy_with("prefill-c")
    del w._recving_metadata["r1"]
    assert not shim.busy_with("prefill-a")
