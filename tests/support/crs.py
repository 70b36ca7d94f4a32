"""DisaggregatedInference objects for the pure (no cluster) tests."""
from __future__ import annotations

import json
from typing import Any

from disagg.operator.api import DisaggregatedInference
from disagg.operator.builders import engine_args
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


def child(children: list[dict], kind: str, name: str) -> dict:
    [obj] = [c for c in children if c["kind"] == kind and c["metadata"]["name"] == name]
    return obj

def statefulset(children: list[dict], role: str, cr: str = "qwen") -> dict:
    """The role's StatefulSet (the current revision's: build_children makes only that one)."""
    [obj] = [c for c in children if c["kind"] == "StatefulSet"
             and c["metadata"]["labels"]["app.kubernetes.io/instance"] == cr
             and c["metadata"]["labels"]["app.kubernetes.io/component"] == role]
    return obj

def launch_configmap(children: list[dict]) -> dict:
    [obj] = [c for c in children if c["kind"] == "ConfigMap"]
    return obj

def pod(children: list[dict], role: str, cr: str = "qwen") -> dict:
    return statefulset(children, role, cr)["spec"]["template"]

def engine(children: list[dict], role: str) -> dict:
    [c] = [c for c in pod(children, role)["spec"]["containers"] if c["name"] == "engine"]
    return c

def env_of(container: dict) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}

def kv_config(spec_cr: DisaggregatedInference, role: str) -> dict:
    args = engine_args(spec_cr.spec, role)
    return json.loads(args[args.index("--kv-transfer-config") + 1])
