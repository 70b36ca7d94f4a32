"""Per-role /scale on the real local cluster: each role's DisaggregatedRole (`<cr>-prefill`, `<cr>-decode`), scaled by
`kubectl scale` and by the controller-manager's own HPA controller, moves that role through the rollout; applying the
user's manifest again (server-side, as Flux does, or client-side, as Argo CD does by default) keeps the scaled count,
and an edit of replicas in the manifest wins.

The rendezvous is a real `disagg rendezvous` process, and kwok runs no engines, so a stand-in for their plugin
advertises each Ready engine pod there (support/advertiser.py, a fake named as such): what a scale-up waits for
before it is Complete and a scale-down before it drains."""
from __future__ import annotations

import time

import pytest
import yaml
from lightkube import codecs
from lightkube.core.exceptions import ApiError
from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.apps_v1 import StatefulSet
from lightkube.resources.autoscaling_v2 import HorizontalPodAutoscaler
from lightkube.resources.core_v1 import Pod
from lightkube.types import PatchType

from disagg.operator.rollout import actions
from disagg.operator.rollout.simulate import compute_all_steps
from disagg.operator.rollout.state import Observed, RevisionState, RoleState, RolloutPolicy, Target
from support.dinf import Dinf, create, ends_with, engine_sts, is_ready, rollout_steps, small
from support.kube import events_until, watch_until
from support.operator import OperatorProcess
from support.tools import kubectl

pytestmark = pytest.mark.cluster

Drole = create_namespaced_resource("serving.disagg.io", "v1alpha1", "DisaggregatedRole", "disaggregatedroles")
FLUX = "kustomize-controller"  # the field manager of Flux's server-side apply


@pytest.fixture(scope="module")
def operator(cluster, crd_installed, rendezvous, tmp_path_factory):
    op = OperatorProcess(cluster.kubeconfig, tmp_path_factory.mktemp("operator") / "operator.log", resync_seconds=2,
                         extra=rendezvous.operator_args)
    op.start()
    yield op
    op.stop()


def manifest(name: str, namespace: str, decode: int | None = 1) -> str:
    """The user's manifest, as it sits in Git."""
    role = {"tensorParallelSize": 1} if decode is None else {"tensorParallelSize": 1, "replicas": decode}
    obj = small(name, decode=role)
    obj["metadata"]["namespace"] = namespace
    return yaml.safe_dump(obj)


def at(prefill: int, decode: int):
    """The CR Ready and its rollout Complete at these counts: one revision, every engine advertised."""
    def done(d) -> bool:
        st = d.status or {}
        return is_ready(d) and st.get("rollout") == "Complete" and len(st.get("revisions") or ()) == 1 and \
            (st["prefill"]["desired"], st["decode"]["desired"]) == (prefill, decode) and \
            (st["revisions"][0]["prefill"]["advertised"], st["revisions"][0]["decode"]["advertised"]) == (prefill,
                                                                                                         decode)
    return done


def predicted(rev: str, start: tuple[int, int], target: tuple[int, int]) -> list[str]:
    """The steps the rollout planner takes in a healthy world from `start` to `target` (prefill, decode)."""
    begin = RevisionState(rev, "layout", RoleState.counted(start[0]), RoleState.counted(start[1]))
    plan = compute_all_steps(Observed(Target(rev, "layout", *target), (begin,)), RolloutPolicy(),
                             deletes_withdrawn=True)
    return [actions.describe(s) for s in plan]


def role_of(cluster, namespace: str, name: str, role: str):
    return cluster.client.get(Drole, f"{name}-{role}", namespace=namespace)


def untouched(cluster, namespace: str, name: str) -> tuple:
    """What a write to the CR, a role object or an engine StatefulSet would change."""
    dinf = cluster.client.get(Dinf, name, namespace=namespace)
    roles = [role_of(cluster, namespace, name, r) for r in ("prefill", "decode")]
    sts = cluster.client.list(StatefulSet, namespace=namespace, labels={"app.kubernetes.io/instance": name})
    return ((dinf.metadata.generation, dinf.metadata.resourceVersion),
            [(r.metadata.generation, r.spec["replicas"]) for r in roles],
            sorted((s.metadata.name, s.metadata.generation, s.spec.replicas) for s in sts))


def test_kubectl_scale_moves_a_role_through_the_rollout_and_reapplying_the_manifest_keeps_it(
        cluster, operator, namespace, advertised):
    name = "scaled"
    text = manifest(name, namespace)
    kubectl("apply", "--server-side", f"--field-manager={FLUX}", "-f", "-", stdin=text, cluster=cluster)
    first = watch_until(cluster, Dinf, name, at(1, 1), namespace=namespace, timeout=90, what="1P1D")
    rev = first.status["revision"]

    # One role object per role, owned by the CR, at the manifest's counts.
    dinf_uid = first.metadata.uid
    for role in ("prefill", "decode"):
        obj = role_of(cluster, namespace, name, role)
        assert obj.spec == {"deployment": name, "role": role, "replicas": 1}
        assert [(o.kind, o.uid, o.controller) for o in obj.metadata.ownerReferences] == \
            [("DisaggregatedInference", dinf_uid, True)]
    listing = kubectl("get", "drole", "-n", namespace, cluster=cluster).stdout.splitlines()
    assert listing[0].split() == ["NAME", "CR", "ROLE", "DESIRED", "READY", "AGE"]
    assert listing[1].split()[:5] == [f"{name}-decode", name, "decode", "1", "1"]

    t0 = time.monotonic()
    kubectl("scale", f"drole/{name}-decode", "--replicas=3", "-n", namespace, cluster=cluster)
    scaled = watch_until(cluster, Dinf, name, at(1, 3), namespace=namespace, timeout=90, what="1P3D")
    print(f"\nkubectl scale 1 -> 3 decode: Complete (3 engines Ready and advertised) in {time.monotonic() - t0:.1f}s")
    assert scaled.status["decodeReady"] == "3/3" and scaled.status["decode"]["specReplicas"] == 1
    assert engine_sts(cluster, namespace, name, "decode").spec.replicas == 3
    expected = [f"scale up revision {rev} to 1P1D"] + predicted(rev, (1, 1), (1, 3))
    assert rollout_steps(cluster, namespace, name, ends_with(expected[-1])) == expected
    row = next(line for line in kubectl("get", "dinf", "-n", namespace, cluster=cluster).stdout.splitlines()
               if line.startswith(name))
    assert row.split()[2:4] == ["1/1", "3/3"], row

    # /scale as the HPA controller reads it: the count, the current pods and the selector of the role's pods.
    scale = cluster.client.get(Drole.Scale, f"{name}-decode", namespace=namespace)
    assert (scale.spec.replicas, scale.status.replicas) == (3, 3)
    selected = cluster.client.list(Pod, namespace=namespace, labels=dict(
        term.split("=") for term in scale.status.selector.split(",")))
    assert sorted(p.metadata.name for p in selected) == [f"{name}-decode-{rev}-{i}" for i in range(3)]
    assert role_of(cluster, namespace, name, "decode").status["readyReplicas"] == 3

    # The manifest applied again, unchanged, as a GitOps sync does: nothing is written, the count stays.
    operator.await_quiet()
    before = untouched(cluster, namespace, name)
    kubectl("apply", "--server-side", f"--field-manager={FLUX}", "-f", "-", stdin=text, cluster=cluster)
    operator.await_quiet()
    assert untouched(cluster, namespace, name) == before, "the apply or the operator changed a count"

    # An edit of spec.decode.replicas in the manifest wins; the scale-down drains before its pod goes.
    kubectl("apply", "--server-side", f"--field-manager={FLUX}", "-f", "-", stdin=manifest(name, namespace, 2),
            cluster=cluster)
    down = watch_until(cluster, Dinf, name, at(1, 2), namespace=namespace, timeout=90, what="1P2D")
    assert down.status["decode"]["specReplicas"] == 2
    decode = role_of(cluster, namespace, name, "decode")
    assert decode.spec["replicas"] == 2 and decode.metadata.annotations["serving.disagg.io/spec-replicas"] == "2"
    steps = rollout_steps(cluster, namespace, name, ends_with(f"drain revision {rev} to 1P2D"))
    assert steps[-len(predicted(rev, (1, 3), (1, 2))):] == predicted(rev, (1, 3), (1, 2))

    # Leaving replicas out of the manifest hands the count to the scalers: nothing is copied.
    kubectl("scale", f"drole/{name}-decode", "--replicas=3", "-n", namespace, cluster=cluster)
    watch_until(cluster, Dinf, name, at(1, 3), namespace=namespace, timeout=90, what="1P3D again")
    kubectl("apply", "--server-side", f"--field-manager={FLUX}", "-f", "-", stdin=manifest(name, namespace, None),
            cluster=cluster)
    unset = cluster.client.get(Dinf, name, namespace=namespace)
    assert "replicas" not in unset.spec["decode"], "the field left with the manifest's (no schema default)"
    operator.await_quiet()
    assert role_of(cluster, namespace, name, "decode").spec["replicas"] == 3
    assert engine_sts(cluster, namespace, name, "decode").spec.replicas == 3


def test_the_hpa_controller_drives_a_role_and_a_client_side_apply_keeps_its_count(cluster, operator, namespace,
                                                                                  advertised):
    """The controller-manager here runs the HPA controller but no metrics API: an HPA whose minReplicas is above the
    role's count scales it without metrics (GET and PUT of /scale, as it always does), and its metric then fails
    past the selector (FailedGetResourceMetric, not InvalidSelector): /scale gave it the role's pods."""
    name = "hpa"
    text = manifest(name, namespace)
    kubectl("apply", "-f", "-", stdin=text, cluster=cluster)  # Argo CD's default: client-side apply
    watch_until(cluster, Dinf, name, at(1, 1), namespace=namespace, timeout=90, what="1P1D")
    hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
           "metadata": {"name": f"{name}-decode", "namespace": namespace},
           "spec": {"scaleTargetRef": {"apiVersion": "serving.disagg.io/v1alpha1", "kind": "DisaggregatedRole",
                                       "name": f"{name}-decode"},
                    "minReplicas": 2, "maxReplicas": 4,
                    "metrics": [{"type": "Resource", "resource": {
                        "name": "cpu", "target": {"type": "Utilization", "averageUtilization": 50}}}]}}
    t0 = time.monotonic()
    cluster.client.create(codecs.from_dict(hpa))
    watch_until(cluster, Dinf, name, at(1, 2), namespace=namespace, timeout=120, what="1P2D by the HPA")
    print(f"\nHPA minReplicas 2: decode Complete at 2 in {time.monotonic() - t0:.1f}s")
    managers = {(f.manager, f.subresource) for f in role_of(cluster, namespace, name, "decode").metadata.managedFields}
    assert ("kube-controller-manager", "scale") in managers, managers
    rescaled = events_until(cluster, namespace, f"{name}-decode", "SuccessfulRescale", bool,
                            what="the HPA's rescale Event")
    assert rescaled and "New size: 2" in rescaled[0].message

    def metric_tried(h) -> bool:
        active = next((c for c in (h.status.conditions or []) if c.type == "ScalingActive"), None) if h.status else None
        return active is not None and active.status == "False"

    got = watch_until(cluster, HorizontalPodAutoscaler, f"{name}-decode", metric_tried, namespace=namespace,
                      timeout=90, what="the HPA's metric tried")
    active = next(c for c in got.status.conditions if c.type == "ScalingActive")
    assert active.reason == "FailedGetResourceMetric", (active.reason, active.message)
    assert got.status.currentReplicas == 2

    operator.await_quiet()
    before = untouched(cluster, namespace, name)
    out = kubectl("apply", "-f", "-", stdin=text, cluster=cluster).stdout
    assert "unchanged" in out, out
    operator.await_quiet()
    assert untouched(cluster, namespace, name) == before
    cluster.client.delete(HorizontalPodAutoscaler, f"{name}-decode", namespace=namespace)


def test_a_deleted_role_object_comes_back_at_its_last_count_and_a_role_may_scale_to_zero(cluster, operator,
                                                                                       namespace, advertised):
    name = create(cluster, namespace, small("back", decode={"tensorParallelSize": 1, "replicas": 1}))
    watch_until(cluster, Dinf, name, at(1, 1), namespace=namespace, timeout=90, what="1P1D")
    kubectl("scale", f"drole/{name}-decode", "--replicas=2", "-n", namespace, cluster=cluster)
    watch_until(cluster, Dinf, name, at(1, 2), namespace=namespace, timeout=90, what="1P2D")
    gone = role_of(cluster, namespace, name, "decode")
    sts = engine_sts(cluster, namespace, name, "decode")
    cluster.client.delete(Drole, f"{name}-decode", namespace=namespace)
    again = watch_until(cluster, Drole, f"{name}-decode", lambda r: r.metadata.uid != gone.metadata.uid,
                        namespace=namespace, timeout=30, what="recreated")
    assert again.spec["replicas"] == 2, "the last count, not the manifest's 1"
    operator.await_quiet()
    after = engine_sts(cluster, namespace, name, "decode")
    assert (after.metadata.generation, after.spec.replicas) == (sts.metadata.generation, 2), "nothing scaled down"

    # 0 is a count like any other (spec.<role>.replicas allows it too): the role's engines drain and go.
    kubectl("scale", f"drole/{name}-prefill", "--replicas=0", "-n", namespace, cluster=cluster)
    watch_until(cluster, StatefulSet, engine_sts(cluster, namespace, name, "prefill").metadata.name,
                lambda s: s.spec.replicas == 0 and not s.status.replicas, namespace=namespace, timeout=90,
                what="prefill at 0")
    dinf = watch_until(cluster, Dinf, name, lambda d: (d.status or {}).get("prefillReady") == "0/0",
                       namespace=namespace, timeout=30, what="status at 0 prefill")
    assert dinf.status["prefill"]["desired"] == 0


def test_the_apiserver_guards_a_role_objects_count_and_identity(cluster, crd_installed, namespace):
    obj = {"apiVersion": "serving.disagg.io/v1alpha1", "kind": "DisaggregatedRole",
           "metadata": {"name": "m-decode", "namespace": namespace},
           "spec": {"deployment": "m", "role": "decode", "replicas": 1}}
    cluster.client.create(codecs.from_dict(obj))

    def refused(call) -> str:
        with pytest.raises(ApiError) as e:
            call()
        assert e.value.status.code == 422
        return e.value.status.message

    # The request the HPA controller makes: PUT of the Scale it read.
    scale = cluster.client.get(Drole.Scale, "m-decode", namespace=namespace)
    scale.spec.replicas = -1
    assert "spec.replicas: Invalid value: -1: spec.replicas in body should be greater than or equal to 0" in \
        refused(lambda: cluster.client.replace(scale))
    too_many = {"spec": {"replicas": 1001}}
    assert "should be less than or equal to 1000" in refused(lambda: cluster.client.patch(
        Drole, "m-decode", too_many, namespace=namespace, patch_type=PatchType.MERGE))
    assert "role is immutable" in refused(lambda: cluster.client.patch(
        Drole, "m-decode", {"spec": {"role": "prefill"}}, namespace=namespace, patch_type=PatchType.MERGE))
    misnamed = {**obj, "metadata": {"name": "other-decode", "namespace": namespace}}
    assert "must be named <spec.deployment>-<spec.role>" in refused(
        lambda: cluster.client.create(codecs.from_dict(misnamed)))
    out = kubectl("explain", "drole.spec", cluster=cluster).stdout
    for field in ("deployment", "role", "replicas"):
        assert f"{field}\t" in out or f"  {field}" in out, out
    assert "applying the same manifest again keeps this count" in " ".join(
        kubectl("explain", "drole.spec.replicas", cluster=cluster).stdout.split())
