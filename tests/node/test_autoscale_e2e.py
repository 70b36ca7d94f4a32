"""The built-in autoscaling planner on the real node: load through the router's Service scales both roles up, its
end scales them down, an idle deployment goes to zero and the first request after that is held and served, with
no failed request anywhere.

The engines are the engine emulator (`spec.engine.emulator`): three prefills and two decodes are more vLLM engines
than this host's two cores run. Everything else is real: the operator from its chart, its planner ticks scraping
the router's and the engines' /metrics over the pod network, the DisaggregatedRole writes, the rollout machinery,
the kubelet, the rendezvous and the router. The per-engine throughputs in the CR are set far below what an engine
does, so that a few clients are load enough for the throughput floor to ask for each role's maximum: what is under
test is the loop from the metrics to ready, advertised engines and back, not the planner's arithmetic (its tables
and properties are unit tests).
"""
from __future__ import annotations

import time

import pytest
from lightkube.resources.core_v1 import Pod
from lightkube.types import PatchType

from disagg.operator import names
from support.dinf import Dinf
from support.kube import watch_until
from support.traffic import Stream, emulated_autoscaled, settled

pytestmark = [pytest.mark.cluster, pytest.mark.node]

CLIENTS = 4
AUTOSCALING = {
    "prefill": {"minReplicas": 1, "maxReplicas": 3, "inputTokensPerSecond": 20},
    "decode": {"minReplicas": 1, "maxReplicas": 2, "outputTokensPerSecond": 2},
    "slo": {"ttftMilliseconds": 60000, "tpotMilliseconds": 10000},  # only the throughput floor moves the counts
    "scaleUp": {"cooldownSeconds": 0},
    "scaleDown": {"cooldownSeconds": 0, "maxStep": 4},
}


@pytest.fixture(scope="module")
def autoscaled(cluster, real_node, operator_release, module_namespace):
    return "autoscaled", emulated_autoscaled(cluster, module_namespace, "autoscaled", AUTOSCALING)


def _status(dinf: object) -> dict:
    d = dinf.to_dict() if hasattr(dinf, "to_dict") else dinf  # type: ignore[union-attr]
    return d.get("status") or {}


def test_load_scales_both_roles_up_to_their_maximum_and_its_end_back_down_with_no_failed_request(
        cluster, autoscaled, module_namespace):
    name, url = autoscaled
    clients = [Stream(url).start() for _ in range(CLIENTS)]
    try:
        watch_until(cluster, Dinf, name, settled(3, 2), namespace=module_namespace, timeout=300,
                    what="scaled up to 3P2D")
        since = [len(c.results) for c in clients]
        for c in clients:
            c.await_more(3)
        served = {d for c, n in zip(clients, since, strict=True) for s, d in c.results[n:] if s == 200}
    finally:
        results = [r for c in clients for r in c.stop()]
    assert [r for r in results if r[0] != 200] == []
    status = _status(cluster.client.get(Dinf, name, namespace=module_namespace))
    planner = status["autoscaling"]
    assert (planner["prefill"]["desired"], planner["decode"]["desired"]) == (3, 2), planner
    assert planner["prefill"]["lastScaleTime"] and planner["decode"]["lastScaleTime"]
    assert len(served) == 2, f"both decode engines serve once scaled up: {served}"

    watch_until(cluster, Dinf, name, settled(1, 1), namespace=module_namespace, timeout=300,
                what="scaled back down to 1P1D once the load ended")
    planner = _status(cluster.client.get(Dinf, name, namespace=module_namespace))["autoscaling"]
    assert (planner["prefill"]["desired"], planner["decode"]["desired"]) == (1, 1), planner


def test_an_idle_deployment_scales_to_zero_and_its_first_request_is_held_until_a_pair_is_up(
        cluster, autoscaled, module_namespace):
    name, url = autoscaled
    cluster.client.patch(Dinf, name, {"spec": {"autoscaling": {"scaleToZero": {"idleSeconds": 60}}}},
                         namespace=module_namespace, patch_type=PatchType.MERGE)

    def at_zero(dinf: object) -> bool:
        s = _status(dinf)
        return (s.get("prefill", {}).get("desired"), s.get("decode", {}).get("desired")) == (0, 0)

    watch_until(cluster, Dinf, name, at_zero, namespace=module_namespace, timeout=240, what="scaled to zero")
    engines = {"app.kubernetes.io/instance": name}
    watch_until_no_engine_pods(cluster, module_namespace, engines)

    first = Stream(url)
    t0 = time.monotonic()
    first.start()
    try:
        first.await_more(1, timeout=200)
        waited = time.monotonic() - t0
    finally:
        results = first.stop()
    assert results and all(s == 200 for s, _ in results), results
    planner = _status(cluster.client.get(Dinf, name, namespace=module_namespace))["autoscaling"]
    assert (planner["prefill"]["desired"], planner["decode"]["desired"]) == (1, 1), planner
    print(f"the first request after scale to zero waited {waited:.1f} s")


def watch_until_no_engine_pods(cluster, namespace: str, labels: dict[str, str], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while True:
        pods = [p for p in cluster.client.list(Pod, namespace=namespace, labels=labels)
                if (p.metadata.labels or {}).get(names.LABEL_COMPONENT) in names.ENGINE_ROLES]
        if not pods:
            return
        assert time.monotonic() < deadline, f"engine pods still there: {[p.metadata.name for p in pods]}"
        watch_until(cluster, Pod, pods[0].metadata.name, lambda p: False, namespace=namespace, timeout=timeout,
                    what="deleted", gone_ok=True)
