"""Day-2 operations on the real local cluster change nothing they should not: an operator upgraded to a new image or
restarted with other flags rolls no engine (a revision keeps the plugin it was made with, until the user asks
with `spec.engine.restartedAt`), and a CR applied again unchanged writes nothing.

Each test runs its own operators, one at a time (an upgrade is one process stopping and another starting). The
rollout test uses a real rendezvous, and kwok runs no engines, so a stand-in for their plugin advertises each Ready
engine pod there (support/advertiser.py, a fake named as such): what a rollout waits for before it drains."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from lightkube.resources.apps_v1 import Deployment, StatefulSet
from lightkube.resources.core_v1 import ConfigMap, Pod, Service
from lightkube.resources.policy_v1 import PodDisruptionBudget
from lightkube.types import PatchType

from disagg.operator.engine_builders import PLUGIN_CONTAINER, RESTARTED_AT_ANNOTATION
from support.dinf import Dinf, cond, create, is_ready, small
from support.kube import watch_until
from support.operator import OperatorProcess
from support.tools import kubectl

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
IMAGE_A, IMAGE_B = "registry.example/disagg:0.1.0", "registry.example/disagg:0.2.0"
CHILD_KINDS = (StatefulSet, Deployment, Service, ConfigMap, PodDisruptionBudget, Pod)


@pytest.fixture
def operators(cluster, crd_installed, tmp_path):
    """Start an operator (`image`, then its flags); every one started is stopped at the end."""
    started: list[OperatorProcess] = []

    def start(image: str, *flags: str, resync_seconds: float = 2) -> OperatorProcess:
        op = OperatorProcess(cluster.kubeconfig, tmp_path / f"operator-{len(started)}.log",
                             resync_seconds=resync_seconds, extra=["--operator-image", image, *flags])
        started.append(op)
        return op.start()

    yield start
    for op in started:
        op.stop()


def children(cluster, namespace: str, name: str) -> dict[tuple[str, str], str]:
    """Every child and engine pod of the CR, with its resourceVersion: any write to one changes it."""
    return {(kind.__name__, obj.metadata.name): obj.metadata.resourceVersion
            for kind in CHILD_KINDS
            for obj in cluster.client.list(kind, namespace=namespace, labels={"app.kubernetes.io/instance": name})}


def engines(cluster, namespace: str, name: str) -> dict[str, tuple[int, dict]]:
    """Each engine StatefulSet's generation and pod template."""
    return {s.metadata.name: (s.metadata.generation, s.spec.template.to_dict())
            for s in cluster.client.list(StatefulSet, namespace=namespace,
                                         labels={"app.kubernetes.io/instance": name})}


def engine_pods(cluster, namespace: str, name: str) -> dict[str, str]:
    return {p.metadata.name: p.metadata.uid for p in cluster.client.list(Pod, namespace=namespace, labels={
        "app.kubernetes.io/instance": name}) if p.metadata.labels.get("serving.disagg.io/role")}


def plugin_image(sts: dict) -> str:
    [init] = [c for c in sts[1]["spec"]["initContainers"] if c["name"] == PLUGIN_CONTAINER]
    return init["image"]


def complete(d) -> bool:
    return is_ready(d) and (d.status or {}).get("rollout") == "Complete" and len(d.status["revisions"]) == 1


def settled(d) -> bool:
    """Ready, with nothing for the rollout to do but wait for the engines to be advertised (no rendezvous is read:
    kwok runs no engines): a world that stays as it is."""
    return is_ready(d) and "advertised" in cond(d, "Progressing")["message"]


def runs(cluster, namespace: str, deployment: str, image: str) -> None:
    watch_until(cluster, Deployment, deployment, lambda d: d.spec.template.spec.containers[0].image == image,
                namespace=namespace, timeout=30, what=f"running {image}")


def test_an_upgraded_operator_rolls_no_engine_until_the_user_asks(cluster, namespace, operators, rendezvous,
                                                                   advertised):
    a = operators(IMAGE_A, *rendezvous.operator_args)
    name = create(cluster, namespace, small("upgrade", prefill={"tensorParallelSize": 1, "replicas": 2}))
    first = watch_until(cluster, Dinf, name, complete, namespace=namespace, timeout=90, what="Ready under A")
    rev = first.status["revision"]
    before, pods = engines(cluster, namespace, name), engine_pods(cluster, namespace, name)
    assert sorted(before) == [f"{name}-decode-{rev}", f"{name}-prefill-{rev}"] and len(pods) == 3
    assert {plugin_image(s) for s in before.values()} == {IMAGE_A}
    a.stop()

    b = operators(IMAGE_B, *rendezvous.operator_args)
    # The router and rendezvous move with the operator (stateless, or soft state its engines' renewals rebuild):
    # that B has reconciled the CR. Then two resync rounds: B has also verified every child it would touch.
    runs(cluster, namespace, f"{name}-router", IMAGE_B)
    runs(cluster, namespace, f"{name}-rendezvous", IMAGE_B)
    b.await_quiet(rounds=2)
    assert engines(cluster, namespace, name) == before, "an engine StatefulSet changed with the operator's image"
    assert engine_pods(cluster, namespace, name) == pods, "an engine pod was replaced"
    dinf = cluster.client.get(Dinf, name, namespace=namespace)
    assert complete(dinf) and dinf.status["revision"] == rev, dinf.status
    assert [c.metadata.name for c in cluster.client.list(ConfigMap, namespace=namespace, labels={
        "app.kubernetes.io/instance": name})] == [f"{name}-launch-{rev}"], "no launch scripts of a new revision"

    # The user's ask, as `kubectl rollout restart` asks a Deployment: a new revision, with B's plugin.
    cluster.client.patch(Dinf, name, {"spec": {"engine": {"restartedAt": "2026-05-04T10:00:00Z"}}},
                         namespace=namespace, patch_type=PatchType.MERGE)
    done = watch_until(cluster, Dinf, name, lambda d: complete(d) and d.status["revision"] != rev,
                       namespace=namespace, timeout=120, what="the restart rolled out")
    new = done.status["revision"]
    after = engines(cluster, namespace, name)
    assert sorted(after) == [f"{name}-decode-{new}", f"{name}-prefill-{new}"], "the old revision is retired"
    assert {plugin_image(s) for s in after.values()} == {IMAGE_B}
    assert {s[1]["metadata"]["annotations"][RESTARTED_AT_ANNOTATION] for s in after.values()} == \
        {"2026-05-04T10:00:00Z"}
    assert not set(engine_pods(cluster, namespace, name)) & set(pods), "every engine was replaced"


def test_an_operator_restarted_with_other_flags_changes_no_child(cluster, namespace, operators):
    a = operators(IMAGE_A)
    name = create(cluster, namespace, small("flags"))
    watch_until(cluster, Dinf, name, settled, namespace=namespace, timeout=60, what="settled")
    a.await_quiet()  # the status pass after the last child event has landed
    before = children(cluster, namespace, name)
    generation = cluster.client.get(Dinf, name, namespace=namespace).metadata.generation
    a.stop()

    b = operators(IMAGE_A, "--namespace", namespace, "--max-concurrent-passes", "2", "--transport-poll-seconds",
                  "5", "--rendezvous-timeout", "1", "--verbose", resync_seconds=1)
    b.await_quiet(rounds=2)  # thorough passes: B applied (or confirmed) every child
    assert b.metric("disagg_operator_reconciles_total", trigger="resync", result="ok") >= 2
    assert children(cluster, namespace, name) == before
    dinf = cluster.client.get(Dinf, name, namespace=namespace)
    assert dinf.metadata.generation == generation and is_ready(dinf)


def test_applying_an_unchanged_cr_again_changes_nothing(cluster, namespace, operators):
    op = operators(IMAGE_A)
    manifest = yaml.safe_load((REPO / "manifests" / "examples" / "qwen3-32b-p5en.yaml").read_text())
    manifest["metadata"]["namespace"] = namespace
    text, name = yaml.safe_dump(manifest), manifest["metadata"]["name"]
    kubectl("apply", "--server-side", "-f", "-", stdin=text, cluster=cluster)
    watch_until(cluster, Dinf, name, settled, namespace=namespace, timeout=90, what="settled")
    op.await_quiet()
    before = cluster.client.get(Dinf, name, namespace=namespace)
    kids = children(cluster, namespace, name)

    out = kubectl("apply", "--server-side", "-f", "-", stdin=text, cluster=cluster).stdout
    assert "serverside-applied" in out, out
    again = cluster.client.get(Dinf, name, namespace=namespace)
    assert (again.metadata.generation, again.metadata.resourceVersion) == \
        (before.metadata.generation, before.metadata.resourceVersion), "the apply itself wrote the CR"
    op.await_quiet()  # a thorough pass after the apply: the operator has looked at everything again
    after = cluster.client.get(Dinf, name, namespace=namespace)
    assert after.status["observedGeneration"] == after.metadata.generation == before.metadata.generation
    assert after.metadata.resourceVersion == before.metadata.resourceVersion, "the operator wrote the CR"
    assert children(cluster, namespace, name) == kids
