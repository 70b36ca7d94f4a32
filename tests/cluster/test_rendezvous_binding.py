"""What the operator gives each deployment's rendezvous, per spec.rendezvous.auth, on the real apiserver.

kubernetes (the default): a ServiceAccount owned by the CR and a cluster-scoped ClusterRoleBinding to
system:auth-delegator. Nothing owns the binding (a namespaced CR cannot own a cluster-scoped object), and the
operator puts no finalizer on CRs, so the operator itself removes it: on the CR's DELETED event, and on every
resync round for what that missed (a CR deleted while the operator was down). token: a random Secret, created
once and repaired. That the binding really lets the rendezvous verify engines' tokens is in
test_rendezvous_auth.py.
"""
from __future__ import annotations

import pytest
from lightkube.core.exceptions import ApiError
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.models.rbac_v1 import RoleRef, Subject
from lightkube.resources.apps_v1 import Deployment, StatefulSet
from lightkube.resources.core_v1 import Secret, ServiceAccount
from lightkube.resources.rbac_authorization_v1 import ClusterRoleBinding
from lightkube.types import PatchType

from disagg.operator.names import rendezvous_binding_name
from support.dinf import Dinf, create, engine_sts, is_ready, small
from support.kube import watch_list_until, watch_until
from support.operator import OperatorProcess

pytestmark = pytest.mark.cluster


@pytest.fixture
def operator(request, cluster, crd_installed, tmp_path):
    """The operator; its resync interval is the indirect parameter, default 3 s."""
    op = OperatorProcess(cluster.kubeconfig, tmp_path / "operator.log", resync_seconds=getattr(request, "param", 3))
    op.start()
    yield op
    op.stop()


def _exists(obj) -> bool:
    return True


def _gone(obj) -> bool:
    return False  # with gone_ok, only the deletion ends the wait


def await_binding(cluster, namespace: str, name: str) -> ClusterRoleBinding:
    return watch_until(cluster, ClusterRoleBinding, rendezvous_binding_name(namespace, name), _exists, timeout=60,
                       what="created")


def await_no_binding(cluster, namespace: str, name: str, timeout: float = 60) -> None:
    watch_until(cluster, ClusterRoleBinding, rendezvous_binding_name(namespace, name), _gone, timeout=timeout,
                what="deleted", gone_ok=True)


def has_binding(cluster, name: str) -> bool:
    try:
        cluster.client.get(ClusterRoleBinding, name)
    except ApiError as e:
        if e.status.code == 404:
            return False
        raise
    return True


@pytest.mark.parametrize("operator", [3600], indirect=True, ids=["no-resync"])  # removal is the DELETED event's
def test_the_binding_is_created_for_a_cr_and_removed_when_the_cr_is_deleted(cluster, operator, namespace):
    name = create(cluster, namespace, small("ident"))
    dinf = watch_until(cluster, Dinf, name, is_ready, namespace=namespace, timeout=60, what="Ready")
    binding = await_binding(cluster, namespace, name)
    assert binding.roleRef == RoleRef(apiGroup="rbac.authorization.k8s.io", kind="ClusterRole",
                                      name="system:auth-delegator")
    assert binding.subjects == [Subject(kind="ServiceAccount", name=f"{name}-rendezvous", namespace=namespace)]
    assert binding.metadata.labels["app.kubernetes.io/managed-by"] == "disagg-operator"
    assert binding.metadata.labels["serving.disagg.io/namespace"] == namespace
    assert binding.metadata.annotations == {"serving.disagg.io/owner": f"{namespace}/{name}",
                                            "serving.disagg.io/owner-uid": dinf.metadata.uid}
    assert not binding.metadata.ownerReferences

    sa = cluster.client.get(ServiceAccount, f"{name}-rendezvous", namespace=namespace)
    assert sa.metadata.ownerReferences[0].uid == dinf.metadata.uid, "the garbage collector removes it with the CR"
    rendezvous = cluster.client.get(Deployment, f"{name}-rendezvous", namespace=namespace).spec.template.spec
    assert rendezvous.serviceAccountName == f"{name}-rendezvous"
    assert rendezvous.containers[0].command[-4:] == ["--auth", "kubernetes", "--deployment", name]
    engine = engine_sts(cluster, namespace, name, "decode").spec.template.spec
    [token] = [v for v in engine.volumes if v.name == "rendezvous-token"]
    assert token.projected.sources[0].serviceAccountToken.audience == "disagg-rendezvous"
    assert not list(cluster.client.list(Secret, namespace=namespace, labels={"app.kubernetes.io/instance": name})), \
        "no shared token in this mode"

    cluster.client.delete(Dinf, name, namespace=namespace)
    await_no_binding(cluster, namespace, name, timeout=30)  # the CR's DELETED event, not a resync
    # The test's watch can see the binding gone before the operator has counted its own delete: await the count.
    assert operator.await_metric("disagg_operator_child_changes_total", 1, timeout=10, kind="ClusterRoleBinding",
                                 change="deleted") == 1
    assert operator.metric("disagg_operator_resync_rounds_total") == 0


def test_a_binding_left_by_a_cr_deleted_while_the_operator_was_down_is_removed_by_the_resync(
        cluster, operator, namespace):
    name = create(cluster, namespace, small("orphan"))
    await_binding(cluster, namespace, name)
    # A look-alike that is not the operator's to delete: its labels and owner annotation for a CR that does not
    # exist, but another name and another role (it stays; the namespace fixture removes it).
    labels = {"app.kubernetes.io/managed-by": "disagg-operator", "app.kubernetes.io/component": "rendezvous",
              "app.kubernetes.io/instance": "ghost", "serving.disagg.io/namespace": namespace}
    decoy = ClusterRoleBinding(
        metadata=ObjectMeta(name=f"decoy-{namespace}", labels=labels,
                            annotations={"serving.disagg.io/owner": f"{namespace}/ghost"}),
        roleRef=RoleRef(apiGroup="rbac.authorization.k8s.io", kind="ClusterRole", name="view"),
        subjects=[Subject(kind="ServiceAccount", name="ghost-rendezvous", namespace=namespace)])
    cluster.client.create(decoy)

    operator.stop()
    try:
        cluster.client.delete(Dinf, name, namespace=namespace)
        watch_until(cluster, Dinf, name, _gone, namespace=namespace, timeout=30, what="deleted", gone_ok=True)
        assert has_binding(cluster, rendezvous_binding_name(namespace, name)), "nothing else removes it"
    finally:
        operator.start()
    await_no_binding(cluster, namespace, name)  # the first resync round after the start
    operator.await_quiet()
    assert has_binding(cluster, f"decoy-{namespace}"), "a binding the operator did not make is never deleted"


@pytest.fixture
def rolling_operator(cluster, crd_installed, rendezvous, tmp_path):
    """An operator that reads `rendezvous`, where the engines are advertised: an auth switch is a new revision,
    which rolls out only as new engines are advertised."""
    op = OperatorProcess(cluster.kubeconfig, tmp_path / "operator.log", resync_seconds=3,
                         extra=rendezvous.operator_args)
    op.start()
    yield op
    op.stop()


def test_switching_to_token_revokes_the_binding_and_uses_a_shared_secret(cluster, rolling_operator, namespace,
                                                                         advertised):
    name = create(cluster, namespace, small("switch"))
    watch_until(cluster, Dinf, name, is_ready, namespace=namespace, timeout=60, what="Ready")
    await_binding(cluster, namespace, name)

    cluster.client.patch(Dinf, name, {"spec": {"rendezvous": {"auth": "token"}}}, namespace=namespace,
                         patch_type=PatchType.MERGE)
    await_no_binding(cluster, namespace, name, timeout=30)
    token = watch_until(cluster, Secret, f"{name}-rendezvous-token", _exists, namespace=namespace, timeout=30,
                        what="created")
    assert token.metadata.ownerReferences[0].name == name and token.data["token"]
    # A new revision: the engines' pod template changed.
    engine = watch_list_until(cluster, StatefulSet,
                              lambda s: s.metadata.labels.get("app.kubernetes.io/component") == "prefill" and
                              "DISAGG_RENDEZVOUS_TOKEN" in [e.name for e in s.spec.template.spec.containers[0].env],
                              namespace=namespace, timeout=30, what="engines use the shared token")
    assert "rendezvous-token" not in [v.name for v in engine.spec.template.spec.volumes]
    watch_until(cluster, Dinf, name, is_ready, namespace=namespace, timeout=60, what="Ready after the switch")

    # The token is created once with a random value; a deleted one comes back on the next resync, with a new value.
    cluster.client.delete(Secret, f"{name}-rendezvous-token", namespace=namespace)
    back = watch_until(cluster, Secret, f"{name}-rendezvous-token", lambda s: s.metadata.uid != token.metadata.uid,
                       namespace=namespace, timeout=30, what="token Secret recreated")
    assert back.data["token"] != token.data["token"]
    rolling_operator.await_quiet()
    assert not has_binding(cluster, rendezvous_binding_name(namespace, name)), "a token-mode CR gets no binding back"
