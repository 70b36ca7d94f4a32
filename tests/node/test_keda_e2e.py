"""KEDA drives each role's /scale from the planner's metric, on the real node: the path for users who already run
KEDA or an HPA.

The CR's planner runs in `Recommend` mode: it decides and publishes `disagg_planner_needed_replicas` on the
operator's metrics Service, and writes no count. One KEDA ScaledObject per role reads that series with KEDA's
`metrics-api` scaler (Prometheus text) and targets the role's DisaggregatedRole; KEDA's HPA, run by the real
kube-controller-manager on KEDA's external metrics API (served through the apiserver's aggregation layer), writes
the role's /scale, and the rollout machinery brings the engines up and drains them. KEDA is built from Go modules
and runs beside the control plane (devcluster/keda.py).

The engines are the engine emulator, as in test_autoscale_e2e.py and for the same reason (more engines than two
cores run), with the same per-engine throughputs set far below an engine's so that a few clients ask for each
role's maximum: what is under test is KEDA's loop from the operator's metric to ready, advertised engines.
"""
from __future__ import annotations

import sys

import pytest
from lightkube import codecs
from lightkube.resources.autoscaling_v2 import HorizontalPodAutoscaler
from lightkube.resources.core_v1 import Event, Service

from disagg.devcluster import keda
from disagg.devcluster.keda import ScaledObject
from disagg.operator import names
from disagg.operator.scale_executor import RoleResource
from support.dinf import Dinf
from support.kube import watch_until
from support.tools import kubectl
from support.traffic import Stream, emulated_autoscaled, settled

pytestmark = [pytest.mark.cluster, pytest.mark.node]

CLIENTS = 4
MAX = {"prefill": 3, "decode": 2}
AUTOSCALING = {
    "mode": "Recommend",
    "prefill": {"minReplicas": 1, "maxReplicas": MAX["prefill"], "inputTokensPerSecond": 20},
    "decode": {"minReplicas": 1, "maxReplicas": MAX["decode"], "outputTokensPerSecond": 2},
    "slo": {"ttftMilliseconds": 60000, "tpotMilliseconds": 10000},  # only the throughput floor moves the counts
}


@pytest.fixture(scope="module")
def keda_running(cluster, real_node):
    procs = cluster.local.start_keda(progress=lambda m: print(m, file=sys.stderr, flush=True))
    yield
    cluster.local.stop_keda(procs)
    # Later modules install and upgrade with helm, whose discovery fails on an aggregated API nobody serves.
    assert "external.metrics.k8s.io/v1beta1" not in kubectl("api-versions", cluster=cluster).stdout


def scaled_object(namespace: str, cr: str, role: str, metrics_url: str) -> dict:
    """What a user writes: KEDA's metrics-api scaler on the operator's metrics Service, one engine per needed
    engine (AverageValue 1), no stabilization window (a test waits for the count, not for HPA defaults)."""
    series = f'disagg_planner_needed_replicas{{namespace="{namespace}",name="{cr}",role="{role}"}}'
    no_window = {"stabilizationWindowSeconds": 0}
    return keda.scaled_object(namespace, f"{cr}-{role}", names.role_object_name(cr, role), metrics_url, series, 1,
                              max_replicas=MAX[role], pollingInterval=5, advanced={
                                  "horizontalPodAutoscalerConfig": {"behavior": {"scaleUp": no_window,
                                                                                 "scaleDown": no_window}}})


@pytest.fixture(scope="module")
def keda_driven(cluster, real_node, operator_release, keda_running, module_namespace):
    name = "keda"
    router_url = emulated_autoscaled(cluster, module_namespace, name, AUTOSCALING)
    metrics = cluster.client.get(Service, f"{operator_release.name}-disagg-operator-metrics",
                                 namespace=operator_release.namespace)
    url = f"http://{metrics.spec.clusterIP}:{metrics.spec.ports[0].port}/metrics"
    for role in MAX:
        cluster.client.create(codecs.from_dict(scaled_object(module_namespace, name, role, url)))
    yield name, router_url
    # While KEDA runs: it holds a finalizer on each ScaledObject, which would keep the namespace from going.
    for role in MAX:
        cluster.client.delete(ScaledObject, f"{name}-{role}", namespace=module_namespace)
        watch_until(cluster, ScaledObject, f"{name}-{role}", lambda _so: False, namespace=module_namespace,
                    timeout=60, what="deleted", gone_ok=True)


def _ready(so) -> bool:
    conds = {c["type"]: c["status"] for c in (so.status or {}).get("conditions", [])}
    return conds.get("Ready") == "True"


def test_keda_scales_both_roles_from_the_planners_metric_and_back_with_no_failed_request(
        cluster, keda_driven, module_namespace):
    name, url = keda_driven
    for role in MAX:
        watch_until(cluster, ScaledObject, f"{name}-{role}", _ready, namespace=module_namespace, timeout=120,
                    what="the ScaledObject Ready (its metric read)")
    clients = [Stream(url).start() for _ in range(CLIENTS)]
    try:
        watch_until(cluster, Dinf, name, settled(MAX["prefill"], MAX["decode"]), namespace=module_namespace,
                    timeout=300, what="scaled up to 3P2D by KEDA")
        planner = (cluster.client.get(Dinf, name, namespace=module_namespace).status or {})["autoscaling"]
        for c in clients:
            c.await_more(3)  # served at 3P2D too
    finally:
        results = [r for c in clients for r in c.stop()]
    assert [r for r in results if r[0] != 200] == []
    assert all(planner[role]["needed"] >= n for role, n in MAX.items()), planner

    for role in MAX:
        role_object = cluster.client.get(RoleResource, names.role_object_name(name, role), namespace=module_namespace)
        managers = {(f.manager, f.subresource) for f in role_object.metadata.managedFields}
        assert ("kube-controller-manager", "scale") in managers, (role, managers)
        hpa = cluster.client.get(HorizontalPodAutoscaler, f"keda-hpa-{name}-{role}", namespace=module_namespace)
        assert [m.type for m in hpa.spec.metrics] == ["External"], hpa.spec.metrics
    events = [e for e in cluster.client.list(Event, namespace=module_namespace,
                                             fields={"involvedObject.name": name})
              if e.reason in ("Scaled", "ScaledToZero", "WokeFromZero")]
    assert events == [], "the planner in Recommend mode posts no scaling event: KEDA scaled"

    watch_until(cluster, Dinf, name, settled(1, 1), namespace=module_namespace, timeout=300,
                what="scaled back down to 1P1D by KEDA once the load ended")
