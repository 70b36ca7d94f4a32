"""DisaggregatedInference objects for the pure (no cluster) tests."""
from __future__ import annotations

from typing import Any

from disagg.operator.api import DisaggregatedInference
from disagg.operator.merge import deep_merge

UID = "8d2c1f3e-0000-4000-8000-000000000001"


def make_cr(spec: dict[str, Any] | None = None, *, uid: str | None = UID, profile: str = "nvidia-h200",
            name: str = "qwen", namespace: str = "ml") -> DisaggregatedInference:
    base = {"model": {"name": "Qwen/Qwen3-32B"}, "accelerator": {"profile": profile},
            "prefill": {"tensorParallelSize": 4}, "decode": {"tensorParallelSize": 4}}
    metadata = {"name": name, "namespace": namespace}
    if uid:
        metadata["uid"] = uid
    return DisaggregatedInference.model_validate({"apiVersion": "serving.disagg.io/v1alpha1",
                                                  "kind": "DisaggregatedInference", "metadata": metadata,
                                                  "spec": deep_merge(base, spec or {})})
