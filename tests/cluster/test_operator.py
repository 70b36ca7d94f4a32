"""The operator reconciles DisaggregatedInference objects on the real local cluster."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml
from lightkube import codecs
from lightkube.resources.apps_v1 import Deployment, StatefulSet
from lightkube.resources.core_v1 import ConfigMap, Node, PersistentVolume, Pod, Service, ServiceAccount
from lightkube.resources.policy_v1 import PodDisruptionBudget
from lightkube.resources.rbac_authorization_v1 import ClusterRoleBinding
from lightkube.types import PatchType

from disagg.devcluster import fleet
from disagg.operator.controller.handlers import CHILD_KINDS as WATCHED_KINDS
from disagg.operator.names import rendezvous_binding_name
from disagg.operator.profiles import CPU_ENGINES_LABEL, CPU_ENGINES_TAINT, CPU_ENGINES_VALUE
from support.dinf import Dinf, cond, create, engine_pod_name, engine_sts, is_ready, revision, rollout_steps, small
from support.kube import events_until, watch_list_until, watch_until
from support.operator import OperatorProcess

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
CHILD_KINDS = (StatefulSet, Deployment, Service, ConfigMap, PodDisruptionBudget)
UNWATCHED_KINDS = ("ServiceAccount", "ClusterRoleBinding")


@pytest.fixture(scope="module")
def operator(cluster, crd_installed, tmp_path_factory):
    op = OperatorProcess(cluster.kubeconfig, tmp_path_factory.mktemp("operator") / "operator.log", resync_seconds=3)
    op.start()
    yield op
    op.stop()


def example(name: str) -> dict:
    return yaml.safe_load((REPO / "manifests" / "examples" / name).read_text())


def children(cluster, namespace: str, name: str) -> dict[tuple[str, str], str]:
    out = {}
    for kind in CHILD_KINDS:
        for obj in cluster.client.list(kind, namespace=namespace, labels={"app.kubernetes.io/instance": name}):
            out[(kind.__name__, obj.metadata.name)] = obj.metadata.resourceVersion
    return out


EXPECTED_CHILDREN = {("StatefulSet", "{n}-prefill-{r}"), ("StatefulSet", "{n}-decode-{r}"),
                     ("Deployment", "{n}-router"), ("Deployment", "{n}-rendezvous"), ("Service", "{n}-prefill"),
                     ("Service", "{n}-decode"), ("Service", "{n}-router"), ("Service", "{n}-rendezvous"),
                     ("ConfigMap", "{n}-launch-{r}"), ("PodDisruptionBudget", "{n}-prefill"),
                     ("PodDisruptionBudget", "{n}-decode")}


def expected(cluster, namespace: str, name: str) -> set[tuple[str, str]]:
    rev = revision(cluster, namespace, name)
    return {(k, n.format(n=name, r=rev)) for k, n in EXPECTED_CHILDREN}


@pytest.mark.parametrize("file, instance_type, accel, per_pod, efa, prefill, decode, backend", [
    ("qwen3-32b-p5en.yaml", "p5en.48xlarge", "nvidia.com/gpu", "4", "8", 1, 1, "LIBFABRIC"),
    ("qwen3-32b-p5en-2p1d.yaml", "p5en.48xlarge", "nvidia.com/gpu", "4", "8", 2, 1, "LIBFABRIC"),
    ("llama-trn2.yaml", "trn2.48xlarge", "aws.amazon.com/neuron", "8", "8", 1, 1, "LIBFABRIC"),
])
def test_examples_become_ready_on_the_right_nodes(cluster, operator, namespace, file, instance_type, accel,
                                                  per_pod, efa, prefill, decode, backend):
    name = create(cluster, namespace, example(file))
    dinf = watch_until(cluster, Dinf, name, is_ready, namespace=namespace, timeout=90, what="Ready")
    # specReplicas: spec.<role>.replicas as copied into the role's DisaggregatedRole (the examples set it).
    assert dinf.status["prefill"] == {"desired": prefill, "ready": prefill, "updated": prefill, "specReplicas": prefill}
    assert dinf.status["decode"] == {"desired": decode, "ready": decode, "updated": decode, "specReplicas": decode}
    assert dinf.status["backend"] == backend
    assert dinf.status["endpoint"].startswith(f"http://{name}-router.{namespace}.svc")
    assert children(cluster, namespace, name).keys() == expected(cluster, namespace, name)

    pods = list(cluster.client.list(Pod, namespace=namespace, labels={"app.kubernetes.io/instance": name}))
    engines = [p for p in pods if p.metadata.labels.get("serving.disagg.io/role")]
    assert len(engines) == prefill + decode
    zones = set()
    for pod in engines:
        node = cluster.client.get(Node, pod.spec.nodeName)
        assert node.metadata.labels["node.kubernetes.io/instance-type"] == instance_type
        zones.add(node.metadata.labels["topology.kubernetes.io/zone"])
        limits = pod.spec.containers[0].resources.limits
        assert limits[accel] == per_pod and limits["vpc.amazonaws.com/efa"] == efa
    assert len(zones) == 1, "prefill and decode share one zone: EFA does not cross zones"


@pytest.fixture
def cpu_engine_node(cluster, namespace):
    """A simulated 16-CPU node labelled and tainted for CPU engines, and the example's model PVC (bound to a
    hostPath PV kwok never mounts). Its own node, so the taint keeps no other test's pods off the fleet."""
    t = fleet.CATALOG["m7i.4xlarge"]
    node = fleet.build_node(t, 0, zone_index=0, global_index=250)
    name = node["metadata"]["name"] = node["metadata"]["labels"]["kubernetes.io/hostname"] = f"cpu-{namespace}"
    node["metadata"]["labels"][CPU_ENGINES_LABEL] = CPU_ENGINES_VALUE
    node["spec"]["taints"] = [CPU_ENGINES_TAINT]
    c = cluster.client
    c.create(codecs.from_dict(node))
    pv_name = f"models-{namespace}"
    c.create(codecs.from_dict({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv_name},
                               "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany"],
                                        "storageClassName": "", "hostPath": {"path": "/tmp/disagg-models"},
                                        "claimRef": {"namespace": namespace, "name": "disagg-models"}}}))
    c.create(codecs.from_dict({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                               "metadata": {"name": "disagg-models", "namespace": namespace},
                               "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "", "volumeName": pv_name,
                                        "resources": {"requests": {"storage": "1Gi"}}}}))
    yield name
    c.delete(Node, name)
    c.delete(PersistentVolume, pv_name)


def test_cpu_example_lands_engines_router_and_rendezvous_on_the_cpu_engine_node(cluster, operator, namespace,
                                                                                 cpu_engine_node):
    name = create(cluster, namespace, example("tiny-cpu.yaml"))
    dinf = watch_until(cluster, Dinf, name, is_ready, namespace=namespace, timeout=90, what="Ready")
    assert dinf.status["backend"] == "UCX"
    pods = list(cluster.client.list(Pod, namespace=namespace, labels={"app.kubernetes.io/instance": name}))
    components = sorted(p.metadata.labels["app.kubernetes.io/component"] for p in pods)
    assert components == ["decode", "prefill", "rendezvous", "router"]
    # The only node that selects and tolerates: the scheduler put every pod of the CR there.
    assert {p.spec.nodeName for p in pods} == {cpu_engine_node}
    for pod in pods:
        if pod.metadata.labels["app.kubernetes.io/component"] in ("prefill", "decode"):
            assert "cpu" not in (pod.spec.containers[0].resources.limits or {})
            assert [v.persistentVolumeClaim.claimName for v in pod.spec.volumes if v.persistentVolumeClaim] == [
                "disagg-models"]


def test_scaling_stays_in_the_revision(cluster, operator, namespace):
    name = create(cluster, namespace, small("scale"))
    watch_until(cluster, Dinf, name, is_ready, namespace=namespace, timeout=60)
    c = cluster.client
    rev = revision(cluster, namespace, name)
    before = engine_sts(cluster, namespace, name, "prefill")
    decode_gen = engine_sts(cluster, namespace, name, "decode").metadata.generation

    c.patch(Dinf, name, {"spec": {"prefill": {"replicas": 3}}}, namespace=namespace, patch_type=PatchType.MERGE)
    dinf = watch_until(cluster, Dinf, name, lambda d: is_ready(d) and d.status["prefill"]["ready"] == 3,
                       namespace=namespace, timeout=60, what="3 prefill ready")
    assert dinf.status["prefillReady"] == "3/3" and dinf.status["revision"] == rev
    after = engine_sts(cluster, namespace, name, "prefill")
    assert after.metadata.name == before.metadata.name and after.spec.replicas == 3
    assert after.status.updateRevision == before.status.updateRevision, "scaling must not roll the pods"
    assert engine_sts(cluster, namespace, name, "decode").metadata.generation == decode_gen
    # Back down: the rollout lowers replicas (the withdrawal), the pod above goes.
    c.patch(Dinf, name, {"spec": {"prefill": {"replicas": 1}}}, namespace=namespace, patch_type=PatchType.MERGE)
    watch_until(cluster, Dinf, name, lambda d: is_ready(d) and d.status["prefill"]["ready"] == 1,
                namespace=namespace, timeout=60, what="back to 1 prefill")
    assert engine_sts(cluster, namespace, name, "prefill").spec.replicas == 1


def test_hand_edited_children_are_put_back(cluster, operator, namespace):
    name = create(cluster, namespace, small("edited"))
    watch_until(cluster, Dinf, name, is_ready, namespace=namespace, timeout=60)
    c = cluster.client
    decode = engine_sts(cluster, namespace, name, "decode").metadata.name
    hash_key = "serving.disagg.io/launch-script-hash"
    ours = engine_sts(cluster, namespace, name, "decode").spec.template.metadata.annotations[hash_key]
    c.patch(StatefulSet, decode, {"spec": {"template": {"metadata": {"annotations": {hash_key: "edited"}}}}},
            namespace=namespace, patch_type=PatchType.STRATEGIC, field_manager="kubectl-edit")
    watch_until(cluster, StatefulSet, decode, lambda s: s.spec.template.metadata.annotations[hash_key] == ours,
                namespace=namespace, timeout=30, what="pod template put back")
    svc = c.get(Service, f"{name}-router", namespace=namespace)
    port = svc.spec.ports[0].port
    c.patch(Service, f"{name}-router", {"spec": {"ports": [{"name": "http", "port": port + 1, "targetPort": 8000}]}},
            namespace=namespace, patch_type=PatchType.MERGE, field_manager="kubectl-edit")
    watch_until(cluster, Service, f"{name}-router", lambda s: [p.port for p in s.spec.ports] == [port],
                namespace=namespace, timeout=30, what="router port put back")
    launch = f"{name}-launch-{revision(cluster, namespace, name)}"
    c.delete(ConfigMap, launch, namespace=namespace)
    watch_until(cluster, ConfigMap, launch, lambda cm: cm.metadata.deletionTimestamp is None,
                namespace=namespace, timeout=30, what="launch ConfigMap recreated")
    # (The rendezvous' token Secret and ClusterRoleBinding: tests/cluster/test_rendezvous_binding.py.)


def test_noop_resync_writes_nothing(cluster, operator, namespace):
    name = create(cluster, namespace, small("steady"))
    # Ready, and nothing for the rollout to do but wait for the engines to be advertised (kwok runs no engines,
    # and this operator reads no rendezvous): a world that stays as it is.
    watch_until(cluster, Dinf, name, lambda d: is_ready(d) and "advertised" in cond(d, "Progressing")["message"],
                namespace=namespace, timeout=60, what="settled")
    # Let the status pass that follows the last child event land before taking the snapshot.
    operator.await_quiet()
    before = children(cluster, namespace, name)
    cr_rv = cluster.client.get(Dinf, name, namespace=namespace).metadata.resourceVersion
    resyncs = operator.metric("disagg_operator_reconciles_total", trigger="resync", result="ok")
    def applies(kind: str) -> float:
        return operator.metric("disagg_operator_child_applies_total", kind=kind)
    kinds = (*WATCHED_KINDS, *UNWATCHED_KINDS)
    before_applies = {kind: applies(kind) for kind in kinds}
    operator.await_quiet(rounds=2)
    assert operator.metric("disagg_operator_reconciles_total", trigger="resync", result="ok") >= resyncs + 2
    assert children(cluster, namespace, name) == before
    # The watch already shows every watched child as our last apply left it, and each round's listing shows the
    # rendezvous' ServiceAccount and ClusterRoleBinding so: the resyncs apply nothing.
    assert {kind: applies(kind) for kind in kinds} == before_applies
    assert cluster.client.get(Dinf, name, namespace=namespace).metadata.resourceVersion == cr_rv


def test_the_resync_repairs_the_rendezvous_identity_its_listing_shows_changed(cluster, operator, namespace):
    """The ServiceAccount and ClusterRoleBinding are not watched: the resync lists them, and applies the ones
    the listing shows deleted or changed since our apply."""
    name = create(cluster, namespace, small("ident"))
    watch_until(cluster, Dinf, name, is_ready, namespace=namespace, timeout=60)
    account, binding = f"{name}-rendezvous", rendezvous_binding_name(namespace, name)
    watch_until(cluster, ClusterRoleBinding, binding, lambda b: True, timeout=30, what="binding")
    operator.await_quiet()
    old = cluster.client.get(ServiceAccount, account, namespace=namespace).metadata.uid
    cluster.client.delete(ServiceAccount, account, namespace=namespace)
    cluster.client.patch(ClusterRoleBinding, binding, {"subjects": [
        {"kind": "ServiceAccount", "name": "someone-else", "namespace": namespace}]}, patch_type=PatchType.MERGE)
    watch_until(cluster, ServiceAccount, account, lambda sa: sa.metadata.uid != old, namespace=namespace,
                timeout=30, what="ServiceAccount recreated by the resync")
    restored = watch_until(cluster, ClusterRoleBinding, binding, lambda b: b.subjects[0].name == account,
                           timeout=30, what="binding's subject put back by the resync")
    assert restored.subjects[0].namespace == namespace


def test_events_name_what_was_created(cluster, operator, namespace):
    name = create(cluster, namespace, small("events"))
    watch_until(cluster, Dinf, name, is_ready, namespace=namespace, timeout=60)
    rev = revision(cluster, namespace, name)
    launch = f"ConfigMap/events-launch-{rev}"
    events_until(cluster, namespace, name, "Created", lambda es: launch in " ".join(e.message for e in es),
                 what=f"a Created Event naming {launch}")
    assert rollout_steps(cluster, namespace, name, bool) == [f"scale up revision {rev} to 1P1D"]


def test_engine_preflight_failure_becomes_degraded(cluster, operator, namespace):
    """kwok runs no containers, so the failed container state is written into the pod status by the test:
    a FAKE of the one thing this machine cannot produce (an engine pod on a node without EFA userspace)."""
    name = create(cluster, namespace, small("noefa"))
    watch_until(cluster, Dinf, name, is_ready, namespace=namespace, timeout=60)
    pod = engine_pod_name(cluster, namespace, name, "prefill")
    reason = "preflight: EFA requested but the libfabric efa provider is missing (fi_info -p efa failed)"
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    cluster.client.patch(Pod.Status, pod, {"status": {
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": now},
                       {"type": "ContainersReady", "status": "False", "lastTransitionTime": now}],
        "containerStatuses": [{"name": "engine", "image": "x", "imageID": "", "ready": False, "restartCount": 1,
                               "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                               "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": reason,
                                                            "startedAt": now, "finishedAt": now}}}]}},
        namespace=namespace, patch_type=PatchType.STRATEGIC)
    dinf = watch_until(cluster, Dinf, name, lambda d: (cond(d, "Degraded") or {}).get("status") == "True",
                       namespace=namespace, timeout=30, what="Degraded")
    assert reason in cond(dinf, "Degraded")["message"] and pod in cond(dinf, "Degraded")["message"]
    assert cond(dinf, "Ready")["status"] == "False"


def test_deleting_the_cr_deletes_every_child(cluster, operator, namespace):
    name = create(cluster, namespace, small("gone"))
    watch_until(cluster, Dinf, name, is_ready, namespace=namespace, timeout=60)
    cluster.client.delete(Dinf, name, namespace=namespace)
    # A pass already under way when the CR went can still apply a child after the garbage collector removed
    # it; the collector then removes that one too (its owner UID is gone). What must hold: everything goes,
    # and stays gone through later resyncs.
    # (The garbage collector notices an owner's deletion only once it watches the CRD's resource, which can
    # take its discovery period after the CRD is installed, hence the generous deadline.)
    deadline = time.monotonic() + 120
    while (left := children(cluster, namespace, name)) and time.monotonic() < deadline:
        kind, child = next(iter(left))
        try:
            watch_until(cluster, {k.__name__: k for k in CHILD_KINDS}[kind], child, lambda o: False,
                        namespace=namespace, timeout=max(1.0, min(30.0, deadline - time.monotonic())),
                        what="deleted", gone_ok=True)
        except TimeoutError:
            continue
    assert children(cluster, namespace, name) == {}
    operator.await_quiet()
    assert children(cluster, namespace, name) == {}, "a resync recreated children of a deleted CR"


def test_killed_mid_reconcile_converges_without_duplicates(cluster, operator, namespace):
    name = create(cluster, namespace, small("crash"))
    # Kill the operator as soon as the first child exists: the pass is in flight.
    watch_list_until(cluster, ConfigMap, lambda cm: cm.metadata.name.startswith(f"{name}-launch-"),
                     namespace=namespace, timeout=30, what="the launch ConfigMap")
    operator.kill()
    partial = children(cluster, namespace, name)
    operator.start()
    watch_until(cluster, Dinf, name, is_ready, namespace=namespace, timeout=90, what="Ready after restart")
    assert children(cluster, namespace, name).keys() == expected(cluster, namespace, name)
    assert len(partial) <= len(expected(cluster, namespace, name))
    pods = cluster.client.list(Pod, namespace=namespace, labels={"app.kubernetes.io/instance": name})
    assert sorted(p.metadata.name for p in pods if p.metadata.labels.get("serving.disagg.io/role")) == \
        [engine_pod_name(cluster, namespace, name, "decode"), engine_pod_name(cluster, namespace, name, "prefill")]
