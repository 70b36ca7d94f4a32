"""A rollout and a scale step under steady traffic, on the real node, with no failed request.

A rollout surges a whole new revision before the old one drains, and a scale step adds an engine: more engines
than this host's two cores can run as vLLM engines. So the engine pods here run the engine emulator
(`spec.engine.emulator`, connector/emulator/: it speaks vLLM's protocols, advertises itself and takes the time of
the CPU engine it was fitted to), two prefills and two decodes, while everything else is real: the operator from
its chart, its planner and executor, the StatefulSets, the kubelet, the rendezvous, the router and the requests
through its Service. tests/node/test_push_e2e.py covers the real engines' own graceful stops.
"""
from __future__ import annotations

import time

import pytest
from lightkube.types import PatchType

from support.dinf import Dinf, create
from support.kube import watch_until
from support.traffic import Stream, routed_url, settled

pytestmark = [pytest.mark.cluster, pytest.mark.node]


@pytest.fixture(scope="module")
def emulated(cluster, real_node, operator_release, module_namespace):
    name = create(cluster, module_namespace, {
        "apiVersion": "serving.disagg.io/v1alpha1", "kind": "DisaggregatedInference",
        "metadata": {"name": "emulated"},
        "spec": {"model": {"name": "tiny"}, "accelerator": {"profile": "cpu"},
                 "engine": {"emulator": {"profile": "cpu-kv64k"}}, "kvTransfer": {"mode": "push"},
                 "router": {"pairWaitSeconds": 120}, "prefill": {"replicas": 2}, "decode": {"replicas": 2}}})
    watch_until(cluster, Dinf, name, settled(2, 2), namespace=module_namespace, timeout=300, what="settled")
    return name, routed_url(cluster, module_namespace, name)


def _patch(cluster, namespace: str, name: str, spec: dict) -> None:
    cluster.client.patch(Dinf, name, {"spec": spec}, namespace=namespace, patch_type=PatchType.MERGE)


def _revision_of(engine_id: str, name: str) -> str:
    """The revision in an engine's id: `<cr>-<role>-<revision>-<ordinal>-<pod uid>-<start>`."""
    return engine_id.removeprefix(f"{name}-decode-").split("-", 1)[0]


def test_a_rollout_under_steady_traffic_fails_no_request_and_both_revisions_serve(cluster, emulated,
                                                                                   module_namespace):
    name, url = emulated
    load = Stream(url).start()
    try:
        load.await_more(3)
        before = {_revision_of(d, name) for s, d in load.results if s == 200}
        _patch(cluster, module_namespace, name, {"engine": {"restartedAt": time.strftime("%Y-%m-%dT%H:%M:%S")}})
        watch_until(cluster, Dinf, name, lambda d: len((d.to_dict().get("status") or {}).get("revisions", [])) > 1,
                    namespace=module_namespace, timeout=60, what="a new revision")
        watch_until(cluster, Dinf, name, settled(2, 2), namespace=module_namespace, timeout=300, what="settled")
        load.await_more(5)
    finally:
        results = load.stop()
    assert [r for r in results if r[0] != 200] == []
    served = {_revision_of(d, name) for s, d in results if s == 200}
    assert len(before) == 1 and len(served) == 2 and before < served, served  # the old, then the new revision


def test_a_scale_step_up_and_down_under_steady_traffic_fails_no_request(cluster, emulated, module_namespace):
    """decode 2 -> 3 through the planner (the new engine ready and advertised before it counts), then 3 -> 2 (the
    engine drained before its pod goes)."""
    name, url = emulated
    load = Stream(url).start()
    try:
        load.await_more(3)
        for decode in (3, 2):
            _patch(cluster, module_namespace, name, {"decode": {"replicas": decode}})
            watch_until(cluster, Dinf, name, settled(2, decode), namespace=module_namespace, timeout=300,
                        what=f"settled at 2P{decode}D")
            load.await_more(5)
    finally:
        results = load.stop()
    assert [r for r in results if r[0] != 200] == []
