"""The Helm chart charts/disagg-operator: lint and template offline, then install, upgrade and uninstall on the real
local cluster with the built Helm 3.21.

That the chart's crds/ are byte-identical to the generated crds/ is tested in tests/unit/test_crd.py.
"""
from __future__ import annotations

import json
import time

import pytest
import yaml
from lightkube.core.exceptions import ApiError
from lightkube.resources.apiextensions_v1 import CustomResourceDefinition
from lightkube.resources.apps_v1 import Deployment
from lightkube.resources.core_v1 import Namespace, Pod, Service, ServiceAccount
from lightkube.resources.policy_v1 import PodDisruptionBudget
from lightkube.resources.rbac_authorization_v1 import ClusterRole, ClusterRoleBinding
from lightkube.types import PatchType

from disagg.operator import crdgen
from disagg.operator.meta import DEFAULT_OPERATOR_IMAGE
from support.kube import watch_until
from support.tools import ALL_OPTIONS, CHART, REPO, helm, rules_of, template


def chart_meta() -> dict:
    return yaml.safe_load((CHART / "Chart.yaml").read_text())


def by_kind(objs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for o in objs:
        out.setdefault(o["kind"], []).append(o)
    return out


def container(objs: list[dict]) -> dict:
    (deploy,) = by_kind(objs)["Deployment"]
    (c,) = deploy["spec"]["template"]["spec"]["containers"]
    return c


# -- offline: lint and template ------------------------------------------------------------------------------
@pytest.mark.parametrize("values", [None, ALL_OPTIONS], ids=["defaults", "all-options"])
def test_lint_passes(values):
    out = helm("lint", "--strict", str(CHART), *(["-f", str(values)] if values else []))
    assert "1 chart(s) linted, 0 chart(s) failed" in out.stdout, out.stdout
    assert "[ERROR]" not in out.stdout and "[WARNING]" not in out.stdout, out.stdout


def test_chart_version_matches_the_package_and_the_operator_default_image():
    meta = chart_meta()
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'version = "{meta["appVersion"]}"' in pyproject, "Chart.yaml appVersion must be the package version"
    # The operator's built-in default for its children's image is what the chart deploys by default.
    assert DEFAULT_OPERATOR_IMAGE == f"ghcr.io/disagg/disagg:{meta['appVersion']}"


def test_default_values_render_a_standalone_cluster_wide_operator():
    objs = template()
    kinds = by_kind(objs)
    assert sorted(kinds) == ["ClusterRole", "ClusterRoleBinding", "Deployment", "PodDisruptionBudget", "Service",
                             "ServiceAccount"], "ServiceMonitor is off by default; no Role without watchNamespaces"
    (deploy,) = kinds["Deployment"]
    c = container(objs)
    assert c["image"] == DEFAULT_OPERATOR_IMAGE
    assert c["command"] == ["disagg"] and c["args"][0] == "operator"
    assert "--all-namespaces" in c["args"]
    assert f"--operator-image={DEFAULT_OPERATOR_IMAGE}" in c["args"]
    assert "--metrics-port=8080" in c["args"] and "--liveness=http://0.0.0.0:8081/healthz" in c["args"]
    assert not any(a.startswith("--peering") for a in c["args"]), "one replica runs standalone"
    assert deploy["spec"]["strategy"] == {"type": "Recreate"}, "two standalone operators must never overlap"
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"metrics": 8080, "health": 8081}
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["runAsNonRoot"] is True
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
    pod = deploy["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["serviceAccountName"] == kinds["ServiceAccount"][0]["metadata"]["name"]
    (svc,) = kinds["Service"]
    assert svc["spec"]["ports"] == [{"name": "metrics", "port": 8080, "targetPort": "metrics", "protocol": "TCP"}]
    assert svc["spec"]["selector"] == deploy["spec"]["selector"]["matchLabels"]
    (pdb,) = kinds["PodDisruptionBudget"]
    assert pdb["spec"]["maxUnavailable"] == 1 and pdb["spec"]["selector"] == deploy["spec"]["selector"]
    (binding,) = kinds["ClusterRoleBinding"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"],
                                    "namespace": "disagg-system"}]


def _leaves(node, path=()):
    if isinstance(node, dict) and node:
        for k, v in node.items():
            yield from _leaves(v, path + (k,))
    else:
        yield path


def test_all_options_file_sets_every_value():
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    every = yaml.safe_load(ALL_OPTIONS.read_text())
    missing = []
    for path in _leaves(defaults):
        node = every
        for key in path:
            if not isinstance(node, dict) or key not in node:
                missing.append(".".join(path))
                break
            node = node[key]
    assert not missing, f"{ALL_OPTIONS.relative_to(REPO)} does not set {missing}"


def test_all_options_render_roles_per_namespace_peering_and_a_service_monitor():
    objs = template("-f", str(ALL_OPTIONS), release="plat", namespace="ops")
    kinds = by_kind(objs)
    assert {r["metadata"]["namespace"] for r in kinds["Role"]} == {"inference-a", "inference-b"}
    assert {b["metadata"]["namespace"] for b in kinds["RoleBinding"]} == {"inference-a", "inference-b"}
    for binding in kinds["RoleBinding"] + kinds["ClusterRoleBinding"]:
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "dinf-operator-sa", "namespace": "ops"}]
    role_resources = {res for r in rules_of(objs, "Role") for res in r["resources"]}
    assert {"disaggregatedinferences", "statefulsets", "kopfpeerings", "events"} <= role_resources
    cluster_resources = {res for r in rules_of(objs) for res in r["resources"]}
    assert cluster_resources == {"customresourcedefinitions", "namespaces"}, \
        "with a namespace list only what has no namespace is cluster-wide (tokenReview is off in this file)"

    c = container(objs)
    assert c["image"].startswith("registry.example.com:5000/mirror/disagg@sha256:"), "a digest wins over the tag"
    assert c["imagePullPolicy"] == "Always"
    args = c["args"]
    assert ["--namespace=inference-a", "--namespace=inference-b"] == [a for a in args if a.startswith("--namespace")]
    assert "--all-namespaces" not in args
    for arg in ("--peering=platform-dinf", "--verbose", "--priority=100", "--resync-seconds=120",
                "--autoscale-seconds=5", "--autoscale-window-seconds=15",
                "--metrics-port=9090", "--liveness=http://0.0.0.0:9081/healthz",
                "--operator-image=registry.example.com:5000/mirror/disagg-runtime:0.1.0-rc1"):
        assert arg in args
    (deploy,) = kinds["Deployment"]
    assert deploy["metadata"]["name"] == "platform-dinf-operator" and deploy["spec"]["replicas"] == 3
    assert deploy["spec"]["strategy"]["type"] == "RollingUpdate"
    pod = deploy["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == "system-cluster-critical"
    assert pod["imagePullSecrets"] == [{"name": "mirror-pull"}]
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "m7i.4xlarge"}
    assert pod["tolerations"][0]["key"] == "CriticalAddonsOnly" and pod["topologySpreadConstraints"]
    assert pod["affinity"]["podAntiAffinity"]
    assert {"name": "DISAGG_EXTRA", "value": "1"} in c["env"]
    (sm,) = kinds["ServiceMonitor"]
    assert sm["apiVersion"] == "monitoring.coreos.com/v1" and sm["metadata"]["namespace"] == "monitoring"
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert sm["spec"]["namespaceSelector"] == {"matchNames": ["ops"]}
    assert sm["spec"]["endpoints"][0]["port"] == "metrics" and sm["spec"]["endpoints"][0]["interval"] == "15s"
    (svc,) = kinds["Service"]
    assert svc["spec"]["type"] == "NodePort" and svc["spec"]["ports"][0]["port"] == 9091
    assert all(svc["metadata"]["labels"][k] == v for k, v in sm["spec"]["selector"]["matchLabels"].items())
    (pdb,) = kinds["PodDisruptionBudget"]
    assert pdb["spec"] == {"minAvailable": 2, "selector": deploy["spec"]["selector"]}


@pytest.mark.parametrize("args", [(), ("--set", "watchNamespaces={a,b}")], ids=["cluster-wide", "namespaces"])
def test_token_review_grants_exactly_what_auth_kubernetes_needs(args):
    """spec.rendezvous.auth: kubernetes (the default): per CR a ServiceAccount (namespaced) and a ClusterRoleBinding
    to system:auth-delegator (cluster-scoped, so always in the ClusterRole), which the operator also deletes."""
    objs = template(*args)
    cluster_rules = rules_of(objs)
    assert {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["clusterroles"], "verbs": ["bind"],
            "resourceNames": ["system:auth-delegator"]} in cluster_rules
    assert {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["clusterrolebindings"],
            "verbs": ["list", "create", "patch", "delete"]} in cluster_rules
    namespaced = rules_of(objs, "Role") if args else cluster_rules
    assert {"apiGroups": [""], "resources": ["serviceaccounts"], "verbs": ["list", "create", "patch"]} in namespaced
    assert not [r for r in cluster_rules + rules_of(objs, "Role") if "tokenreviews" in r["resources"]], \
        "the rendezvous sends TokenReviews as its own ServiceAccount, never the operator"

    off = template(*args, "--set", "rbac.tokenReview=false")
    granted = {res for r in rules_of(off) + rules_of(off, "Role") for res in r["resources"]}
    assert not granted & {"serviceaccounts", "clusterroles", "clusterrolebindings", "tokenreviews"}
    # What is left to delete: an older revision's engine StatefulSets and launch ConfigMap (a rollout retiring it).
    retire = [{"apiGroups": ["apps"], "resources": ["statefulsets"], "verbs": ["delete"]},
              {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["delete"]}]
    deletes = [r for r in rules_of(off) + rules_of(off, "Role") if "delete" in r["verbs"]]
    assert deletes and all(r in retire for r in deletes) and all(r in deletes for r in retire), deletes


def test_more_than_one_replica_turns_on_peering_with_the_release_name():
    objs = template("--set", "replicaCount=2", release="ha")
    args = container(objs)["args"]
    assert "--peering=ha" in args
    (deploy,) = by_kind(objs)["Deployment"]
    assert deploy["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    peering = [r for r in rules_of(objs) if r["apiGroups"] == ["kopf.dev"]]
    assert peering == [{"apiGroups": ["kopf.dev"], "resources": ["clusterkopfpeerings"],
                        "verbs": ["list", "watch", "create", "patch"]}]
    assert not [r for r in rules_of(template()) if r["apiGroups"] == ["kopf.dev"]], \
        "a standalone operator gets no peering permissions"


BAD_VALUES = [
    ({"replicaCount": 0}, "at '/replicaCount': minimum: got 0, want 1"),
    ({"replicas": 2}, "additional properties 'replicas' not allowed"),
    ({"watchNamespaces": ["Team_A"]}, "at '/watchNamespaces/0': 'Team_A' does not match pattern"),
    ({"watchNamespaces": ["a", "a"]}, "at '/watchNamespaces': items at 0 and 1 are equal"),
    ({"image": {"operator": {"pullPolicy": "Sometimes"}}},
     "at '/image/operator/pullPolicy': value must be one of 'Always', 'IfNotPresent', 'Never'"),
    ({"image": {"operator": {"digest": "sha256:abc"}}}, "at '/image/operator/digest'"),
    ({"operator": {"resyncSeconds": 0}}, "at '/operator/resyncSeconds': exclusiveMinimum"),
    ({"metrics": {"serviceMonitor": {"interval": "5 minutes"}}}, "at '/metrics/serviceMonitor/interval'"),
    ({"metrics": {"port": 70000}}, "at '/metrics/port': maximum: got 70,000, want 65,535"),
    # Cross-field rules the schema cannot say clearly: the templates fail with a sentence.
    ({"image": {"router": {"repository": "example.com/router"}}},
     "image.router (example.com/router:0.1.0), image.rendezvous (ghcr.io/disagg/disagg:0.1.0) and image.pluginInit "
     "(ghcr.io/disagg/disagg:0.1.0) must resolve to the same image"),
    ({"serviceAccount": {"create": False}}, "serviceAccount.name: required when serviceAccount.create is false"),
    ({"metrics": {"service": {"enabled": False}, "serviceMonitor": {"enabled": True}}},
     "metrics.serviceMonitor.enabled needs metrics.service.enabled"),
    ({"podDisruptionBudget": {"maxUnavailable": None}}, "podDisruptionBudget: set minAvailable or maxUnavailable"),
]


@pytest.mark.parametrize("values, message", BAD_VALUES, ids=[m.split(":")[0][:40] for _, m in BAD_VALUES])
def test_bad_values_fail_with_a_message_naming_the_value(tmp_path, values, message):
    bad = tmp_path / "bad-values.yaml"
    bad.write_text(yaml.safe_dump(values))
    out = helm("template", "x", str(CHART), "-f", str(bad), check=False)
    assert out.returncode != 0, f"{values} was accepted"
    assert message in out.stderr, out.stderr


def test_lint_rejects_a_schema_violation(tmp_path):
    bad = tmp_path / "bad-values.yaml"
    bad.write_text("replicaCount: 0\n")
    out = helm("lint", str(CHART), "-f", str(bad), check=False)
    assert out.returncode != 0 and "at '/replicaCount': minimum: got 0, want 1" in out.stdout


# -- on the local cluster ------------------------------------------------------------------------------------
def _gone(cluster, res, name: str, namespace: str | None = None) -> bool:
    try:
        cluster.client.get(res, name, namespace=namespace)
    except ApiError as e:
        return e.status.code == 404
    return False


def _available(replicas: int):
    return lambda d: (d.status is not None and d.status.readyReplicas == replicas
                      and d.status.updatedReplicas == replicas and d.status.observedGeneration == d.metadata.generation)


@pytest.mark.cluster
def test_install_upgrade_uninstall(cluster, crd_installed, namespace):
    # Pod Security "restricted" on the release namespace: the operator pod is admitted only if its security
    # context really is non-root, capability-free, without privilege escalation and with a seccomp profile.
    cluster.client.patch(Namespace, namespace, {"metadata": {"labels": {
        "pod-security.kubernetes.io/enforce": "restricted", "pod-security.kubernetes.io/enforce-version": "latest"}}},
        patch_type=PatchType.MERGE)
    release = f"disagg-operator-{namespace[2:]}"  # ClusterRoles are cluster-wide: one name per test
    t0 = time.monotonic()
    helm("install", release, str(CHART), "-n", namespace, "--wait", "--timeout", "2m", cluster=cluster)
    installed_s = time.monotonic() - t0
    deploy = cluster.client.get(Deployment, release, namespace=namespace)
    assert _available(1)(deploy), deploy.status
    (pod,) = cluster.client.list(Pod, namespace=namespace, labels={"app.kubernetes.io/instance": release})
    assert pod.spec.serviceAccountName == release and pod.spec.containers[0].args[:2] == ["operator",
                                                                                         "--all-namespaces"]
    for res in (ServiceAccount, Service, PodDisruptionBudget):
        assert cluster.client.list(res, namespace=namespace, labels={"app.kubernetes.io/instance": release})
    role = cluster.client.get(ClusterRole, release)
    assert not [r for r in role.rules if "clusterkopfpeerings" in r.resources]
    cluster.client.get(ClusterRoleBinding, release)
    for filename in crdgen.files():  # Helm installed (or found) every CRD of the chart's crds/
        for doc in yaml.safe_load_all((CHART / "crds" / filename).read_text()):
            cluster.client.get(CustomResourceDefinition, doc["metadata"]["name"])

    # Upgrade: two replicas turn on peering (a new argument, a new strategy, and the peering permission).
    generation = deploy.metadata.generation
    t0 = time.monotonic()
    helm("upgrade", release, str(CHART), "-n", namespace, "--reuse-values", "--set", "replicaCount=2",
         "--set", "operator.resyncSeconds=60", "--wait", "--timeout", "2m", cluster=cluster)
    upgraded_s = time.monotonic() - t0
    deploy = watch_until(cluster, Deployment, release, _available(2), namespace=namespace, timeout=60,
                         what="2 replicas available")
    assert deploy.metadata.generation > generation
    args = deploy.spec.template.spec.containers[0].args
    assert f"--peering={release}" in args and "--resync-seconds=60" in args
    assert deploy.spec.strategy.type == "RollingUpdate"
    role = cluster.client.get(ClusterRole, release)
    assert [r.verbs for r in role.rules if "clusterkopfpeerings" in r.resources] == [["list", "watch", "create",
                                                                                       "patch"]]
    status = json.loads(helm("status", release, "-n", namespace, "-o", "json", cluster=cluster).stdout)
    assert status["version"] == 2 and status["info"]["status"] == "deployed"

    # Uninstall: everything the release made is gone; CRDs stay (Helm never deletes CRDs, so CRs survive).
    t0 = time.monotonic()
    helm("uninstall", release, "-n", namespace, "--wait", "--timeout", "2m", cluster=cluster)
    uninstalled_s = time.monotonic() - t0
    assert _gone(cluster, Deployment, release, namespace)
    assert _gone(cluster, ServiceAccount, release, namespace)
    assert _gone(cluster, Service, f"{release}-metrics", namespace)
    assert _gone(cluster, PodDisruptionBudget, release, namespace)
    assert _gone(cluster, ClusterRole, release) and _gone(cluster, ClusterRoleBinding, release)
    for pod in cluster.client.list(Pod, namespace=namespace, labels={"app.kubernetes.io/instance": release}):
        watch_until(cluster, Pod, pod.metadata.name, lambda p: False, namespace=namespace, timeout=60,
                    what="deleted with its Deployment", gone_ok=True)
    cluster.client.get(CustomResourceDefinition, f"{crdgen.api.PLURAL}.{crdgen.api.GROUP}")
    print(f"\nhelm install {installed_s:.1f}s, upgrade {upgraded_s:.1f}s, uninstall {uninstalled_s:.1f}s")
