"""DisaggregatedInference helpers shared by the operator's cluster tests."""
from __future__ import annotations

from lightkube import codecs
from lightkube.generic_resource import create_namespaced_resource

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
