"""Least privilege, proven: the operator runs outside the cluster as the chart's ServiceAccount (a bearer token
from the TokenRequest API) with only the RBAC the chart renders, and reconciles the examples. With one permission
taken away it reports which one, keeps running, and recovers once the permission is back."""
from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
import yaml
from lightkube import codecs
from lightkube.core.exceptions import ApiError
from lightkube.generic_resource import create_global_resource
from lightkube.resources.apps_v1 import Deployment, StatefulSet
from lightkube.resources.core_v1 import ConfigMap, Event
from lightkube.resources.rbac_authorization_v1 import ClusterRoleBinding
from lightkube.types import PatchType

from disagg.operator import crdgen
from disagg.operator.names import rendezvous_binding_name
from support.dinf import Dinf, cond, create, is_ready, revision, small
from support.kube import events_until, token_kubeconfig, watch_list_until, watch_until
from support.operator import OperatorProcess
from support.tools import ALL_OPTIONS, REPO, can_i, rules_of, template

RBAC_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")
# What kopf logs when it falls back for lack of a permission, or fails to post an Event.
PERMISSION_COMPLAINTS = ("Not enough permissions", "Failed to post an event", "forbidden", "Forbidden")


def example(name: str) -> dict:
    return yaml.safe_load((REPO / "manifests" / "examples" / name).read_text())


# -- offline: what the rules never grant -------------------------------------------------------------------
@pytest.mark.parametrize("args", [(), ("--set", "replicaCount=2"), ("--set", "watchNamespaces={a,b}"),
                                  ("-f", str(ALL_OPTIONS))], ids=["defaults", "peering", "namespaces", "all"])
def test_rules_never_grant_wildcards_deletion_or_reading_secrets(args):
    objs = template(*args)
    rules = rules_of(objs, "ClusterRole") + rules_of(objs, "Role")
    assert rules
    for rule in rules:
        for key in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[key], rule
        if "delete" in rule["verbs"]:
            # The one documented exception (rbac.tokenReview): the per-CR rendezvous ClusterRoleBindings are
            # cluster-scoped, so no garbage collection removes them; the operator deletes the ones it made.
            # And a rollout retiring an older revision: its StatefulSets and launch ConfigMap.
            assert rule in ({"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["clusterrolebindings"],
                             "verbs": ["list", "create", "patch", "delete"]},
                            {"apiGroups": ["apps"], "resources": ["statefulsets"], "verbs": ["delete"]},
                            {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["delete"]}), rule
            continue
        if "bind" in rule["verbs"]:
            # What those bindings grant: TokenReview (system:auth-delegator), and nothing else.
            assert rule == {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["clusterroles"],
                            "verbs": ["bind"], "resourceNames": ["system:auth-delegator"]}, rule
            continue
        assert set(rule["verbs"]) <= {"get", "list", "watch", "create", "patch", "update"}, rule
        assert not {"clusterroles", "roles", "clusterrolebindings", "rolebindings"} & set(rule["resources"]), rule
        if "secrets" in rule["resources"]:
            assert rule["resources"] == ["secrets"] and rule["verbs"] == ["create"], \
                "the operator creates the rendezvous token Secret and never reads Secrets"
        if "update" in rule["verbs"]:
            assert rule["resources"] == ["disaggregatedinferences/finalizers"], rule
        if "pods" in rule["resources"]:
            assert rule["verbs"] == ["list", "watch"], "the operator never writes pods"


# -- on the cluster ----------------------------------------------------------------------------------------
def rbac_objects(namespace: str, release: str, *args: str) -> list[dict]:
    """The chart's ServiceAccount and RBAC for a release in `namespace`, exactly as `helm template` renders them."""
    return [o for o in template(*args, release=release, namespace=namespace) if o["kind"] in RBAC_KINDS]


@pytest.fixture
def apply_rbac(cluster):
    """Apply RBAC objects; delete the cluster-scoped ones afterwards (the namespaced go with the namespace)."""
    applied: list[tuple[type, str]] = []

    def apply(objs: list[dict]) -> None:
        for o in objs:
            res = codecs.from_dict(o)
            cluster.client.apply(res, field_manager="test-rbac", force=True)
            if o["kind"] in ("ClusterRole", "ClusterRoleBinding"):
                applied.append((type(res), o["metadata"]["name"]))

    yield apply
    for res, name in applied:
        try:
            cluster.client.delete(res, name)
        except ApiError as e:
            if e.status.code != 404:
                raise


def complaints(op: OperatorProcess) -> list[str]:
    return [line for line in op.log.read_text(errors="replace").splitlines()
            if any(c in line for c in PERMISSION_COMPLAINTS)]


def healthy(op: OperatorProcess) -> bool:
    return urllib.request.urlopen(f"http://127.0.0.1:{op.health_port}/healthz", timeout=5).status == 200


def start_as(kubeconfig: Path, log: Path, *extra: str) -> OperatorProcess:
    return OperatorProcess(kubeconfig, log, resync_seconds=5, extra=list(extra)).start()


@pytest.mark.cluster
def test_examples_reconcile_as_the_charts_service_account(cluster, crd_installed, namespace, apply_rbac, tmp_path):
    release = f"lp-{namespace}"
    objs = rbac_objects(namespace, release)
    assert sorted(o["kind"] for o in objs) == ["ClusterRole", "ClusterRoleBinding", "ServiceAccount"]
    apply_rbac(objs)
    sa = next(o for o in objs if o["kind"] == "ServiceAccount")["metadata"]["name"]
    kubeconfig = token_kubeconfig(cluster, namespace, sa, tmp_path / "kubeconfig")
    assert can_i(kubeconfig, "patch", "statefulsets.apps", "-n", namespace)
    assert can_i(kubeconfig, "delete", "statefulsets.apps", "-n", namespace)  # retiring a revision
    for denied in (("get", "secrets"), ("list", "secrets"), ("delete", "deployments.apps"), ("create", "pods"),
                   ("update", "deployments.apps"), ("delete", "disaggregatedinferences.serving.disagg.io"),
                   ("create", "serviceaccounts", "--subresource=token"), ("delete", "serviceaccounts")):
        assert not can_i(kubeconfig, *denied, "-n", namespace), f"the chart's role must not allow {denied}"
    # auth kubernetes: the operator may bind system:auth-delegator and nothing else, and sends no TokenReview.
    assert can_i(kubeconfig, "bind", "clusterroles.rbac.authorization.k8s.io/system:auth-delegator")
    assert can_i(kubeconfig, "delete", "clusterrolebindings.rbac.authorization.k8s.io")  # the documented exception
    for denied in (("bind", "clusterroles.rbac.authorization.k8s.io/cluster-admin"),
                   ("escalate", "clusterroles.rbac.authorization.k8s.io"),
                   ("delete", "clusterroles.rbac.authorization.k8s.io"),
                   ("create", "tokenreviews.authentication.k8s.io")):
        assert not can_i(kubeconfig, *denied), f"the chart's role must not allow {denied}"

    op = start_as(kubeconfig, tmp_path / "operator.log")
    try:
        # One GPU and one Trainium example at once: they use different node types, so both fit the fleet.
        names = [create(cluster, namespace, example(f)) for f in ("qwen3-32b-p5en.yaml", "llama-trn2.yaml")]
        for name in names:
            watch_until(cluster, Dinf, name, is_ready, namespace=namespace, timeout=90, what="Ready")
            # The default auth kubernetes: the operator created the rendezvous' binding with exactly these rules
            # (the apiserver's escalation check passes through `bind` on system:auth-delegator).
            binding = cluster.client.get(ClusterRoleBinding, rendezvous_binding_name(namespace, name))
            assert binding.roleRef.name == "system:auth-delegator"
        # The operator posts Events with its own identity.
        events_until(cluster, namespace, names[0], "Created", bool, what="a Created Event")

        # A deleted child is noticed and recreated: the path that reads the CR (get) and creates again.
        launch_name = f"{names[0]}-launch-{revision(cluster, namespace, names[0])}"
        launch = cluster.client.get(ConfigMap, launch_name, namespace=namespace)
        cluster.client.delete(ConfigMap, launch_name, namespace=namespace)
        watch_until(cluster, ConfigMap, launch_name, lambda cm: cm.metadata.uid != launch.metadata.uid,
                    namespace=namespace, timeout=30, what="recreated")
        # A spec change rolls through: apply of existing children, then status.
        cluster.client.patch(Dinf, names[0], {"spec": {"decode": {"replicas": 2}}}, namespace=namespace,
                             patch_type=PatchType.MERGE)
        watch_until(cluster, Dinf, names[0], lambda d: is_ready(d) and d.status["decode"]["ready"] == 2,
                    namespace=namespace, timeout=60, what="2 decode engines ready")
        op.await_quiet()  # at least one full resync pass, under the same identity
        assert op.metric("disagg_operator_api_errors_total") == 0
        assert not complaints(op), "\n".join(complaints(op))
    finally:
        op.stop()


@pytest.mark.cluster
def test_namespaced_roles_suffice_for_a_namespace_scoped_operator(cluster, crd_installed, namespace, apply_rbac,
                                                                  tmp_path):
    release = f"lpns-{namespace}"
    objs = rbac_objects(namespace, release, "--set", f"watchNamespaces={{{namespace}}}")
    assert sorted(o["kind"] for o in objs) == ["ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
                                               "ServiceAccount"]
    apply_rbac(objs)
    sa = next(o for o in objs if o["kind"] == "ServiceAccount")["metadata"]["name"]
    kubeconfig = token_kubeconfig(cluster, namespace, sa, tmp_path / "kubeconfig")
    assert not can_i(kubeconfig, "list", "statefulsets.apps", "--all-namespaces"), "Roles grant one namespace only"

    op = start_as(kubeconfig, tmp_path / "operator.log", "--namespace", namespace)
    try:
        name = create(cluster, namespace, example("qwen3-32b-p5en.yaml"))
        watch_until(cluster, Dinf, name, is_ready, namespace=namespace, timeout=90, what="Ready")
        op.await_quiet()
        assert not complaints(op), "\n".join(complaints(op))
    finally:
        op.stop()


@pytest.mark.cluster
def test_peered_replicas_need_only_the_peering_rules(cluster, crd_installed, namespace, apply_rbac, tmp_path):
    """replicaCount > 1: the chart adds create/patch/list/watch on clusterkopfpeerings, and that is enough for the
    operator to create its peering object, keep its liveness record in it, and act."""
    for doc in yaml.safe_load_all(crdgen.render_peering()):
        try:
            cluster.client.create(codecs.from_dict(doc))
        except ApiError as e:
            if e.status.code != 409:
                raise
    release = f"lppeer-{namespace}"
    objs = rbac_objects(namespace, release, "--set", "replicaCount=2")
    apply_rbac(objs)
    sa = next(o for o in objs if o["kind"] == "ServiceAccount")["metadata"]["name"]
    kubeconfig = token_kubeconfig(cluster, namespace, sa, tmp_path / "kubeconfig")
    peering = create_global_resource("kopf.dev", "v1", "ClusterKopfPeering", "clusterkopfpeerings")
    op = start_as(kubeconfig, tmp_path / "operator.log", "--peering", release)
    try:
        op.await_log("Resuming operations")  # kopf found its peering object and no higher-priority peer
        name = create(cluster, namespace, small("peered"))
        watch_until(cluster, Dinf, name, is_ready, namespace=namespace, timeout=60, what="Ready")
        record = cluster.client.get(peering, release)
        assert record.get("status"), "the operator keeps its liveness record in the peering object"
        op.await_quiet()
        assert not complaints(op), "\n".join(complaints(op))
    finally:
        op.stop()
        cluster.client.delete(peering, release)


def _without_statefulset_writes(objs: list[dict]) -> list[dict]:
    """The chart's RBAC with `create` and `patch` on statefulsets taken away (list and watch kept)."""
    objs = json.loads(json.dumps(objs))
    role = next(o for o in objs if o["kind"] == "ClusterRole")
    rules = []
    for rule in role["rules"]:
        if "statefulsets" in rule["resources"]:
            if rule["resources"] != ["statefulsets"]:
                rules.append({**rule, "resources": [r for r in rule["resources"] if r != "statefulsets"]})
            if "list" in rule["verbs"]:
                rules.append({**rule, "resources": ["statefulsets"], "verbs": ["list", "watch"]})
        else:
            rules.append(rule)
    role["rules"] = rules
    return objs


@pytest.mark.cluster
def test_a_missing_permission_is_reported_and_the_operator_keeps_running(cluster, crd_installed, namespace,
                                                                         apply_rbac, tmp_path):
    release = f"lpmiss-{namespace}"
    full = rbac_objects(namespace, release)
    apply_rbac(_without_statefulset_writes(full))
    sa = next(o for o in full if o["kind"] == "ServiceAccount")["metadata"]["name"]
    kubeconfig = token_kubeconfig(cluster, namespace, sa, tmp_path / "kubeconfig")
    assert not can_i(kubeconfig, "patch", "statefulsets.apps", "-n", namespace)

    op = start_as(kubeconfig, tmp_path / "operator.log")
    try:
        name = create(cluster, namespace, small("denied"))
        event = watch_list_until(cluster, Event, lambda e: e.reason == "ApplyFailed", namespace=namespace,
                                 fields={"involvedObject.name": name}, timeout=60, what="an ApplyFailed Event")
        # The Event names the object, the verb, the resource and the identity that was refused.
        assert event.type == "Error"
        for part in (f"applying StatefulSet {namespace}/{name}-", "forbidden",
                     f'User "system:serviceaccount:{namespace}:{sa}" cannot patch resource "statefulsets" '
                     f'in API group "apps"'):
            assert part in event.message, event.message
        op.await_log('cannot patch resource "statefulsets"')
        assert any("statefulsets" in line and "forbidden" in line for line in complaints(op)), op.tail()
        assert op.metric("disagg_operator_api_errors_total", kind="StatefulSet", verb="apply") >= 1
        # Not a crash loop, not a silent stop: the process lives, answers its liveness probe, and what it may
        # create it did create (the launch ConfigMap comes before the StatefulSets).
        assert op.proc.poll() is None and healthy(op)
        launch = cluster.client.list(ConfigMap, namespace=namespace, labels={"app.kubernetes.io/instance": name})
        assert [cm.metadata.name.startswith(f"{name}-launch-") for cm in launch] == [True]
        assert not list(cluster.client.list(StatefulSet, namespace=namespace))
        dinf = cluster.client.get(Dinf, name, namespace=namespace)
        assert cond(dinf, "Ready") is None or cond(dinf, "Ready")["status"] != "True"

        # Grant the permission back: the next resync pass converges without a restart.
        apply_rbac(full)
        watch_until(cluster, Dinf, name, is_ready, namespace=namespace, timeout=60, what="Ready once allowed")
        assert op.proc.poll() is None
        cluster.client.get(Deployment, f"{name}-router", namespace=namespace)
    finally:
        op.stop()
