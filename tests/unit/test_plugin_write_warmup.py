"""The WRITE-path warm-up refuses every layout it cannot address safely, before it touches the transport.

The plain layout (equal TP and block sizes) is exercised on real engines in tests/engines. A pair with other TP
or block sizes, or a hybrid SSM model, cannot be started on this 2-core CPU machine, so those refusals use a
named fake: `fake_worker()` has the attributes of vLLM's NIXL worker that the warm-up reads (through the plugin's
`WorkerShim`, unchecked), and a NIXL wrapper that records any transfer, so the test can prove that nothing was
written.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from disagg.connector.plugin.vllm_shim import WorkerShim
from disagg.connector.plugin.write_warmup import SkipWarmup, warm_write_path


class RecordingNixl:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str):
        return lambda *a, **k: self.calls.append(name)


class FakeTopology:
    def __init__(self, tp_ratio: int, block_size_ratio: int) -> None:
        self._tp, self._bs = tp_ratio, block_size_ratio

    def get_engine_info(self, engine_id: str):
        return SimpleNamespace(remote_tp_size=2, remote_block_size=16, remote_physical_blocks_per_logical=1)

    def tp_ratio(self, remote_tp_size: int) -> int:
        return self._tp

    def block_size_ratio(self, remote_block_size: int) -> int:
        return self._bs


def fake_worker(tp_ratio=1, block_size_ratio=1, has_mamba=False, layer_groups=()):
    """FAKE: stands in for vLLM's NIXL worker of a layout this machine cannot run."""
    return SimpleNamespace(transfer_topo=FakeTopology(tp_ratio, block_size_ratio), _has_mamba=has_mamba,
                           _transfer_layer_group_ids=layer_groups, nixl_wrapper=RecordingNixl())


@pytest.mark.parametrize("layout, reason", [
    (dict(tp_ratio=2), "TP sizes differ"),
    (dict(tp_ratio=-2), "TP sizes differ"),
    (dict(block_size_ratio=2), "block sizes differ"),
    (dict(has_mamba=True), "SSM state"),
    (dict(layer_groups=(0, 1)), "per-layer group routing"),
])
def test_other_layouts_are_skipped_before_any_transfer(layout, reason):
    worker = fake_worker(**layout)
    with pytest.raises(SkipWarmup, match=reason):
        warm_write_path(WorkerShim(worker), "decode-1")
    assert worker.nixl_wrapper.calls == []
