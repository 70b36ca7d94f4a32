"""DisaggregatedInference helpers shared by the operator's cluster tests."""
from __future__ import annotations

from collections.abc import Callable

from lightkube import codecs
from lightkube.generic_resource import create_namespaced_resource

from .kube import events_until

Dinf = create_namespaced_resource("serving.disagg.io", "v1alpha1", "DisaggregatedInference",
                                  "disaggregatedinferences")


def cond(obj, ctype: str) -> dict | None:
    return next((c for c in (obj.status or {}).get("conditions", []) if c["type"] == ctype), None)


def is_ready(dinf) -> bool:
    c = cond(dinf, "Ready")
    return c is not None and c["status"] == "True" and \
        dinf.status.get("observedGeneration") == dinf.metadata.generation


def create(cluster, namespace: str, manifest: dict) -> str:
    manifest = {**manifest, "metadata": {**manifest["metadata"], "namespace": namespace}}
    cluster.client.create(codecs.from_dict(manifest))
    return manifest["metadata"]["name"]


def small(name: str, **spec) -> dict:
    """The smallest valid CR: TP1 engines on p5en."""
    base = {"model": {"name": "tiny/llama"}, "accelerator": {"profile": "nvidia-h200"},
            "prefill": {"tensorParallelSize": 1}, "decode": {"tensorParallelSize": 1}}
    return {"apiVersion": "serving.disagg.io/v1alpha1", "kind": "DisaggregatedInference",
            "metadata": {"name": name}, "spec": {**base, **spec}}


def rollout_steps(cluster, namespace: str, name: str, until: Callable[[list[str]], bool], *,
                  timeout: float = 30) -> list[str]:
    """The rollout steps posted as RolloutStep Events on the CR (their descriptions, in the order they were
    recorded), once `until` holds for them: the Event of a step can trail the status its pass wrote."""
    def steps(events) -> list[str]:
        return [e.message.split(":")[0] for e in events]
    return steps(events_until(cluster, namespace, name, "RolloutStep", lambda es: until(steps(es)),
                              timeout=timeout, what="the rollout's steps"))


def ends_with(last: str) -> Callable[[list[str]], bool]:
    return lambda steps: bool(steps) and steps[-1].startswith(last)


def revision(cluster, namespace: str, name: str) -> str:
    """The revision the operator says the CR's spec asks for (status.revision)."""
    rev = (cluster.client.get(Dinf, name, namespace=namespace).status or {}).get("revision")
    assert rev, f"{namespace}/{name} reports no revision yet"
    return rev


def engine_sts(cluster, namespace: str, name: str, role: str, rev: str | None = None):
    """The role's StatefulSet of revision `rev` (default: the current one, status.revision)."""
    from lightkube.resources.apps_v1 import StatefulSet

    rev = rev or revision(cluster, namespace, name)
    [sts] = cluster.client.list(StatefulSet, namespace=namespace, labels={
        "app.kubernetes.io/instance": name, "app.kubernetes.io/component": role, "serving.disagg.io/revision": rev})
    return sts


def engine_pod_name(cluster, namespace: str, name: str, role: str, ordinal: int = 0) -> str:
    """An engine pod's name in the current revision: `<statefulset>-<ordinal>`."""
    return f"{engine_sts(cluster, namespace, name, role).metadata.name}-{ordinal}"
