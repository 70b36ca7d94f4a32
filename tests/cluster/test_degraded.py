"""Children that fail for real on the real control plane make the CR Degraded, with the cluster's own words:
engine pods the scheduler cannot place (kwok's Trainium nodes have only so many Neuron devices), engine pods the
StatefulSet controller cannot create (a ResourceQuota refuses them), and a child the apiserver refuses to the
operator itself (a ResourceQuota on LoadBalancer Services). Each clears once the cause is gone. Then pods that
cannot start or keep failing (a volume not mounted, an image not pulled, a crash loop), with the kubelet's report
written by the test: kwok runs no kubelet."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml
from lightkube import codecs
from lightkube.resources.core_v1 import Pod, ResourceQuota
from lightkube.types import PatchType

from support.dinf import Dinf, cond, create, engine_pod_name, engine_sts, is_ready, small
from support.kube import pod_unschedulable, watch_until
from support.operator import OperatorProcess

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def operator(cluster, crd_installed, tmp_path_factory):
    op = OperatorProcess(cluster.kubeconfig, tmp_path_factory.mktemp("operator") / "operator.log", resync_seconds=5)
    op.start()
    yield op
    op.stop()


def degraded(reason: str):
    def check(d) -> bool:
        c = cond(d, "Degraded")
        return c is not None and c["status"] == "True" and c["reason"] == reason and \
            d.status.get("observedGeneration") == d.metadata.generation
    return check


def not_degraded(d) -> bool:
    return is_ready(d) and (cond(d, "Degraded") or {}).get("status") == "False"


def quota(cluster, namespace: str, name: str, hard: dict[str, str]) -> None:
    cluster.client.create(codecs.from_dict({"apiVersion": "v1", "kind": "ResourceQuota",
                                            "metadata": {"name": name, "namespace": namespace},
                                            "spec": {"hard": hard}}))
    # Admission enforces a quota once the controller-manager has counted its usage.
    watch_until(cluster, ResourceQuota, name, lambda q: bool(q.status and q.status.hard), namespace=namespace,
                timeout=30, what="counted")


def test_engine_pods_the_scheduler_cannot_place_make_the_cr_degraded(cluster, operator, namespace):
    manifest = yaml.safe_load((REPO / "manifests" / "examples" / "llama-trn2.yaml").read_text())
    manifest["spec"]["decode"]["replicas"] = 10  # 11 engine pods of 8 Trainium2 devices; the zone has one node of 16
    name = create(cluster, namespace, manifest)

    def unschedulable_pods() -> dict[str, str]:
        pods = cluster.client.list(Pod, namespace=namespace, labels={"app.kubernetes.io/instance": name})
        return {p.metadata.name: next(c.message for c in p.status.conditions if c.type == "PodScheduled")
                for p in pods if p.metadata.labels.get("serving.disagg.io/role") and pod_unschedulable(p)}

    def reports_every_unschedulable_pod(d) -> bool:
        if not degraded("Unschedulable")(d):
            return False
        pods = unschedulable_pods()
        # The StatefulSet controller creates pods in bursts and the scheduler rejects each in turn, so the
        # condition is consistent with every count on the way; await the count the zone forces.
        if len(pods) < 9:
            return False
        first = min(pods)
        return cond(d, "Degraded")["message"].startswith(f"{len(pods)} engine pods cannot be scheduled (") and \
            cond(d, "Degraded")["message"].endswith(f"; {first}: {' '.join(pods[first].split())}")

    dinf = watch_until(cluster, Dinf, name, reports_every_unschedulable_pod, namespace=namespace, timeout=90,
                       what="Degraded naming the 9+ pods the one trn2 node cannot hold")
    message = cond(dinf, "Degraded")["message"]
    assert "Insufficient aws.amazon.com/neuron" in message, message
    assert (cond(dinf, "Ready")["status"], cond(dinf, "Ready")["reason"]) == ("False", "ReplicasNotReady")

    cluster.client.patch(Dinf, name, {"spec": {"decode": {"replicas": 1}}}, namespace=namespace,
                         patch_type=PatchType.MERGE)
    watch_until(cluster, Dinf, name, not_degraded, namespace=namespace, timeout=90, what="Ready, not Degraded")


def test_engine_pods_the_statefulset_cannot_create_make_the_cr_degraded(cluster, operator, namespace):
    quota(cluster, namespace, "no-gpus", {"requests.nvidia.com/gpu": "0"})
    name = create(cluster, namespace, small("quota"))
    # Both StatefulSets fail; their Events arrive one after the other, so await the condition naming both.
    dinf = watch_until(cluster, Dinf, name, lambda d: degraded("FailedCreate")(d) and "prefill and decode" in
                       cond(d, "Degraded")["message"], namespace=namespace, timeout=60,
                       what="Degraded FailedCreate for both roles")
    message = cond(dinf, "Degraded")["message"]
    # The StatefulSet controller's own Event message: which pod, which StatefulSet, and the apiserver's refusal.
    sts = f"{name}-prefill-{dinf.status['revision']}"
    assert message.startswith("the prefill and decode StatefulSets cannot create their pods: Create Pod "
                              f"{sts}-0 in StatefulSet {sts} failed error: pods \"{sts}-0\" "
                              "is forbidden: exceeded quota: no-gpus"), message
    assert "exceeded quota: no-gpus" in message and "requests.nvidia.com/gpu" in message, message
    assert not list(cluster.client.list(Pod, namespace=namespace, labels={"serving.disagg.io/role": "prefill"}))

    cluster.client.delete(ResourceQuota, "no-gpus", namespace=namespace)
    # The StatefulSet controller retries with its own backoff; once the pods exist the failure is history.
    watch_until(cluster, Dinf, name, not_degraded, namespace=namespace, timeout=180, what="Ready, not Degraded")
    assert engine_sts(cluster, namespace, name, "prefill").status.replicas == 1


def test_a_child_the_apiserver_refuses_makes_the_cr_degraded(cluster, operator, namespace):
    quota(cluster, namespace, "no-load-balancers", {"services.loadbalancers": "0"})
    name = create(cluster, namespace, small("lb", router={"serviceType": "LoadBalancer"}))
    dinf = watch_until(cluster, Dinf, name, degraded("ApplyFailed"), namespace=namespace, timeout=60,
                       what="Degraded ApplyFailed")
    message = cond(dinf, "Degraded")["message"]
    assert message.startswith(f"applying Service {namespace}/{name}-router: services \"{name}-router\" is "
                              "forbidden: exceeded quota: no-load-balancers"), message
    assert "services.loadbalancers" in message, message

    cluster.client.patch(Dinf, name, {"spec": {"router": {"serviceType": "ClusterIP"}}}, namespace=namespace,
                         patch_type=PatchType.MERGE)
    watch_until(cluster, Dinf, name, not_degraded, namespace=namespace, timeout=90, what="Ready, not Degraded")


# -- pods that cannot start or keep failing. kwok runs no kubelet: each test writes the kubelet's report itself
# (the pod's status, or the Event the kubelet records), through the real apiserver, as the kubelet would. ------
def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def set_containers(cluster, namespace: str, pod: str, *, init: list[dict] | None = None,
                   containers: list[dict], ready: bool = False) -> None:
    """Write a pod's container statuses (a merge patch: the lists replace kwok's)."""
    status: dict = {"phase": "Running" if ready else "Pending", "containerStatuses": containers,
                    "conditions": [{"type": "Ready", "status": str(ready), "lastTransitionTime": now()},
                                   {"type": "ContainersReady", "status": str(ready), "lastTransitionTime": now()},
                                   {"type": "PodScheduled", "status": "True", "lastTransitionTime": now()}]}
    if init is not None:
        status["initContainerStatuses"] = init
    cluster.client.patch(Pod.Status, pod, {"status": status}, namespace=namespace, patch_type=PatchType.MERGE)


def container(name: str, state: dict, *, last: dict | None = None, ready: bool = False, restarts: int = 0) -> dict:
    return {"name": name, "image": "x", "imageID": "", "ready": ready, "restartCount": restarts, "state": state,
            **({"lastState": last} if last else {})}


def engine_running(ready: bool = True, last: dict | None = None) -> list[dict]:
    return [container("engine", {"running": {"startedAt": now()}}, ready=ready, last=last, restarts=1 if last else 0)]


def degraded_by(reason: str, message: str):
    def check(d) -> bool:
        c = cond(d, "Degraded")
        return degraded(reason)(d) and c["message"] == message
    return check


def test_a_volume_the_kubelet_cannot_mount_makes_the_cr_degraded_until_the_engine_starts(cluster, operator,
                                                                                         namespace):
    """The kubelet reports a volume it cannot mount only as an Event on the pod (reason FailedMount, repeated while
    it retries); the pod stays Pending with its containers waiting. The operator watches those Events (through
    events.k8s.io, field selector reason=FailedMount). Here the test writes the pod's status and the Event."""
    name = create(cluster, namespace, small("mount"))
    watch_until(cluster, Dinf, name, is_ready, namespace=namespace, timeout=60)
    pod = engine_pod_name(cluster, namespace, name, "prefill")
    obj = cluster.client.get(Pod, pod, namespace=namespace)
    initializing = {"waiting": {"reason": "PodInitializing"}}
    set_containers(cluster, namespace, pod, init=[container("install-plugin", initializing)],
                   containers=[container("engine", initializing)])
    message = f'MountVolume.SetUp failed for volume "launch" : configmap "{name}-launch-x" not found'
    cluster.client.create(codecs.from_dict({
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": f"{pod}.mount", "namespace": namespace},
        "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": pod, "namespace": namespace,
                           "uid": obj.metadata.uid},
        "reason": "FailedMount", "message": message, "type": "Warning", "count": 3,
        "source": {"component": "kubelet", "host": obj.spec.nodeName},
        "firstTimestamp": now(), "lastTimestamp": now(),
        "reportingComponent": "kubelet", "reportingInstance": obj.spec.nodeName}))
    dinf = watch_until(cluster, Dinf, name, degraded_by("FailedMount", f"prefill pod {pod}: {message}"),
                       namespace=namespace, timeout=30, what="Degraded FailedMount naming the pod")
    assert (cond(dinf, "Ready")["status"], cond(dinf, "Ready")["reason"]) == ("False", "EngineFailed")

    # Mounted at last: the containers start, and the Event (still there for an hour) is history.
    set_containers(cluster, namespace, pod, init=[container("install-plugin", {"terminated": {
        "exitCode": 0, "reason": "Completed", "startedAt": now(), "finishedAt": now()}}, ready=True)],
                   containers=engine_running(), ready=True)
    watch_until(cluster, Dinf, name, not_degraded, namespace=namespace, timeout=30, what="Ready, not Degraded")


def test_an_image_the_kubelet_cannot_pull_makes_the_cr_degraded_naming_pod_and_container(cluster, operator,
                                                                                          namespace):
    """The plugin's init container runs the operator's image: after an operator upgrade to an image the nodes
    cannot pull, a new engine pod waits in ImagePullBackOff. The test writes the kubelet's pod status."""
    name = create(cluster, namespace, small("pull"))
    watch_until(cluster, Dinf, name, is_ready, namespace=namespace, timeout=60)
    pod = engine_pod_name(cluster, namespace, name, "decode")
    pull = 'Back-off pulling image "registry.example/disagg:0.2.0"'
    set_containers(cluster, namespace, pod, init=[container("install-plugin", {"waiting": {
        "reason": "ImagePullBackOff", "message": pull}})],
                   containers=[container("engine", {"waiting": {"reason": "PodInitializing"}})])
    watch_until(cluster, Dinf, name,
                degraded_by("ImagePullBackOff", f"decode pod {pod}: init container install-plugin: {pull}"),
                namespace=namespace, timeout=30, what="Degraded ImagePullBackOff naming the pod and container")
    pulled = "rpc error: code = NotFound desc = failed to pull and unpack image"
    set_containers(cluster, namespace, pod, init=[container("install-plugin", {"terminated": {
        "exitCode": 0, "reason": "Completed", "startedAt": now(), "finishedAt": now()}}, ready=True)],
                   containers=[container("engine", {"waiting": {"reason": "ErrImagePull", "message": pulled}})])
    watch_until(cluster, Dinf, name, degraded_by("ErrImagePull", f"decode pod {pod}: {pulled}"),
                namespace=namespace, timeout=30, what="Degraded ErrImagePull for the engine's own image")


def test_a_crash_loop_is_degraded_until_the_engine_runs_ready_again(cluster, operator, namespace):
    """A crash-looping engine (here OOM-killed, no termination message) names the pod and why; once it runs and is
    Ready again, its last crash is history. The test writes the kubelet's pod status."""
    name = create(cluster, namespace, small("crash"))
    watch_until(cluster, Dinf, name, is_ready, namespace=namespace, timeout=60)
    pod = engine_pod_name(cluster, namespace, name, "prefill")
    oom = {"terminated": {"exitCode": 137, "reason": "OOMKilled", "startedAt": now(), "finishedAt": now()}}
    set_containers(cluster, namespace, pod, containers=[container("engine", {"waiting": {
        "reason": "CrashLoopBackOff", "message": "back-off 40s restarting failed container=engine"}}, last=oom,
        restarts=3)])
    dinf = watch_until(cluster, Dinf, name, degraded_by("EngineFailed", f"prefill pod {pod}: OOMKilled"),
                       namespace=namespace, timeout=30, what="Degraded naming the pod and OOMKilled")
    assert (cond(dinf, "Ready")["status"], cond(dinf, "Ready")["reason"]) == ("False", "EngineFailed")
    set_containers(cluster, namespace, pod, containers=engine_running(last=oom), ready=True)
    watch_until(cluster, Dinf, name, not_degraded, namespace=namespace, timeout=30,
                what="Ready, not Degraded, with the crash in lastState")
