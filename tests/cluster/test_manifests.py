"""Plain manifests and GitOps: the kustomize install base and the example overlays apply with server-side dry-run
and then for real on the local apiserver (built kubectl 1.36 with its bundled kustomize), and `disagg render`
shows a pipeline the exact children of an overlay's CRs."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from lightkube.core.exceptions import ApiError
from lightkube.resources.apiextensions_v1 import CustomResourceDefinition
from lightkube.resources.apps_v1 import Deployment
from lightkube.resources.core_v1 import Namespace, Pod
from lightkube.resources.rbac_authorization_v1 import ClusterRole, ClusterRoleBinding

from support.dinf import Dinf
from support.kube import watch_until
from support.tools import REPO, docs, kubectl

INSTALL = REPO / "manifests" / "install"
INSTALL_NAMESPACE = "disagg-system"


def build(path: Path) -> list[dict]:
    return docs(kubectl("kustomize", str(path)).stdout)


def applied_lines(out: str, dry_run: bool) -> list[str]:
    suffix = "serverside-applied (server dry run)" if dry_run else "serverside-applied"
    return [line for line in out.splitlines() if line.endswith(suffix)]


@pytest.fixture
def install_cleanup(cluster):
    """Remove what the install base creates, except the CRDs (other tests' objects depend on them)."""
    yield
    for res, name in ((ClusterRoleBinding, "disagg-operator"), (ClusterRole, "disagg-operator"),
                      (Namespace, INSTALL_NAMESPACE)):
        try:
            cluster.client.delete(res, name)
        except ApiError as e:
            if e.status.code != 404:
                raise
    watch_until(cluster, Namespace, INSTALL_NAMESPACE, lambda ns: False, timeout=120, what="deleted", gone_ok=True)


@pytest.mark.cluster
def test_install_base_applies_and_runs_the_operator(cluster, crd_installed, install_cleanup):
    objs = build(INSTALL)
    kinds = sorted(o["kind"] for o in objs)
    assert kinds == sorted(["CustomResourceDefinition"] * 4 + ["Namespace", "ServiceAccount", "ClusterRole",
                                                               "ClusterRoleBinding", "Service",
                                                               "PodDisruptionBudget", "Deployment"])
    assert [o["kind"] for o in objs][:5].count("CustomResourceDefinition") + \
        [o["kind"] for o in objs][:5].count("Namespace") == 5, "kustomize orders Namespace and CRDs first"

    # A server-side dry run cannot create the namespace it then validates objects in, so GitOps tools create the
    # namespace first (Argo CD: CreateNamespace=true or a sync wave; Flux: the Namespace in an earlier
    # Kustomization). The same order here: the Namespace, then a dry run of everything, then the real apply.
    # --force-conflicts: this session created the CRD earlier with another field manager (as `helm install` or
    # `kubectl create` would), and server-side apply reports a conflict on the atomic .spec.versions even when the
    # content is identical. Taking ownership is what Argo CD's ServerSideApply does (it always forces).
    kubectl("apply", "--server-side", "-f", str(INSTALL / "namespace.yaml"), cluster=cluster)
    dry = kubectl("apply", "--server-side", "--force-conflicts", "--dry-run=server", "-k", str(INSTALL),
                  cluster=cluster)
    assert len(applied_lines(dry.stdout, dry_run=True)) == len(objs), dry.stdout
    with pytest.raises(ApiError):
        cluster.client.get(Deployment, "disagg-operator", namespace=INSTALL_NAMESPACE)  # the dry run persisted nothing

    real = kubectl("apply", "--server-side", "--force-conflicts", "-k", str(INSTALL), cluster=cluster)
    assert len(applied_lines(real.stdout, dry_run=False)) == len(objs), real.stdout
    for doc in (o for o in objs if o["kind"] == "CustomResourceDefinition"):
        cluster.client.get(CustomResourceDefinition, doc["metadata"]["name"])
    # The namespace enforces Pod Security "restricted"; the operator pod is admitted and (kwok) becomes Ready.
    assert cluster.client.get(Namespace, INSTALL_NAMESPACE).metadata.labels[
        "pod-security.kubernetes.io/enforce"] == "restricted"
    watch_until(cluster, Deployment, "disagg-operator",
                lambda d: d.status is not None and d.status.readyReplicas == 1,
                namespace=INSTALL_NAMESPACE, timeout=60, what="operator pod ready")
    (pod,) = cluster.client.list(Pod, namespace=INSTALL_NAMESPACE)
    assert pod.spec.serviceAccountName == "disagg-operator"

    again = kubectl("apply", "--server-side", "--force-conflicts", "-k", str(INSTALL), cluster=cluster)
    assert len(applied_lines(again.stdout, dry_run=False)) == len(objs), "re-applying is idempotent"


OVERLAYS = {
    "examples": {"qwen3-32b": (1, 1, 4, "Qwen/Qwen3-32B"), "qwen3-32b-2p1d": (2, 1, 4, "Qwen/Qwen3-32B"),
                 "llama-trn2": (1, 1, 32, "meta-llama/Llama-3.1-8B-Instruct"), "tiny-cpu": (1, 1, 1, "tiny")},
    "overlays/staging": {"qwen3-8b": (1, 1, 1, "Qwen/Qwen3-8B"), "qwen3-32b-2p1d": (1, 1, 4, "Qwen/Qwen3-32B"),
                         "llama-trn2": (1, 1, 32, "meta-llama/Llama-3.1-8B-Instruct")},
    "overlays/production": {"qwen3-32b": (2, 2, 4, "Qwen/Qwen3-32B"), "qwen3-32b-2p1d": (4, 2, 4, "Qwen/Qwen3-32B"),
                            "llama-trn2": (1, 1, 32, "meta-llama/Llama-3.1-8B-Instruct")},
}


@pytest.mark.cluster
@pytest.mark.parametrize("path", sorted(OVERLAYS))
def test_examples_and_overlays_apply(cluster, crd_installed, namespace, path):
    """(prefill replicas, decode replicas, TP, model) per object: the patches land, and admission (schema and
    CEL) accepts every patched spec."""
    directory = REPO / "manifests" / path
    expected = OVERLAYS[path]
    dry = kubectl("apply", "--server-side", "--dry-run=server", "-k", str(directory), "-n", namespace,
                  cluster=cluster)
    assert len(applied_lines(dry.stdout, dry_run=True)) == len(expected), dry.stdout
    assert not list(cluster.client.list(Dinf, namespace=namespace))

    kubectl("apply", "--server-side", "-k", str(directory), "-n", namespace, cluster=cluster)
    got = {d.metadata.name: d for d in cluster.client.list(Dinf, namespace=namespace)}
    assert set(got) == set(expected)
    for name, (prefill, decode, tp, model) in expected.items():
        spec = got[name].spec
        assert (spec["prefill"]["replicas"], spec["decode"]["replicas"], spec["prefill"]["tensorParallelSize"],
                spec["model"]["name"]) == (prefill, decode, tp, model), name
    environment = path.split("/")[-1] if path.startswith("overlays/") else None
    assert {d.metadata.labels.get("environment") if d.metadata.labels else None for d in got.values()} == {environment}
    if path == "overlays/production":
        assert got["qwen3-32b"].spec["router"]["replicas"] == 2


@pytest.mark.cluster
def test_render_shows_an_overlays_children_and_they_pass_a_server_dry_run(cluster, crd_installed, namespace):
    """A pipeline without the operator: kustomize build | disagg render | kubectl apply --dry-run=server."""
    crs = kubectl("kustomize", str(REPO / "manifests" / "overlays" / "staging")).stdout
    disagg = Path(sys.executable).parent / "disagg"
    rendered = subprocess.run([str(disagg), "render", "-f", "-"], input=crs, capture_output=True, text=True,
                              check=True, timeout=60).stdout
    children = docs(rendered)
    small = [c for c in children if c["kind"] == "StatefulSet" and c["metadata"]["name"].startswith("qwen3-8b-")]
    assert sorted(c["metadata"]["name"].rsplit("-", 1)[0] for c in small) == ["qwen3-8b-decode", "qwen3-8b-prefill"]
    for sts in small:
        assert sts["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    # Rendered without a namespace they target `default`; rebase them on the test namespace for the dry run.
    for c in children:
        c["metadata"]["namespace"] = namespace
    dry = kubectl("apply", "--server-side", "--dry-run=server", "-f", "-", cluster=cluster,
                  stdin=yaml.safe_dump_all(children))
    assert len(applied_lines(dry.stdout, dry_run=True)) == len(children), dry.stdout


@pytest.mark.cluster
def test_the_cpu_examples_children_pass_a_server_dry_run(cluster, crd_installed, namespace):
    """The cpu profile's pods (no device, unprivileged, cpu-engine selector and toleration) are valid objects."""
    disagg = Path(sys.executable).parent / "disagg"
    rendered = subprocess.run([str(disagg), "render", "-f", str(REPO / "manifests" / "examples" / "tiny-cpu.yaml")],
                              capture_output=True, text=True, check=True, timeout=60).stdout
    children = docs(rendered)
    for c in children:
        c["metadata"]["namespace"] = namespace
    engines = [c for c in children if c["kind"] == "StatefulSet"]
    assert len(engines) == 2 and all(
        c["spec"]["template"]["spec"]["nodeSelector"] == {"serving.disagg.io/cpu-engines": "true"} for c in engines)
    dry = kubectl("apply", "--server-side", "--dry-run=server", "-f", "-", cluster=cluster,
                  stdin=yaml.safe_dump_all(children))
    assert len(applied_lines(dry.stdout, dry_run=True)) == len(children), dry.stdout
