"""What the dev cluster changes in a user's CR to run it on the real node. Pure: manifests in, manifests out.

Only the documented development shortcut: engines run the lean engine image with the host's vLLM environment
mounted read-only at the same paths (hostPath), instead of a 7 GB image per change. Nothing else of the CR changes.
"""
from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from disagg.operator.merge import deep_merge

ENGINE_CONTAINER = "engine"


def host_mounts_overlay(mounts: Sequence[Path]) -> dict[str, Any]:
    """A role's podTemplate that mounts each host path read-only at the same path in the engine container."""
    named = [(f"host-vllm-{i}", str(p)) for i, p in enumerate(mounts)]
    return {"spec": {
        "volumes": [{"name": n, "hostPath": {"path": p, "type": "Directory"}} for n, p in named],
        "containers": [{"name": ENGINE_CONTAINER, "volumeMounts": [
            {"name": n, "mountPath": p, "readOnly": True} for n, p in named]}],
    }}


def on_dev_node(cr: dict[str, Any], engine_image: str, mounts: Sequence[Path], *, name: str | None = None,
                mode: str | None = None) -> dict[str, Any]:
    """`cr` with the dev engine image and its host mounts on both roles (and, optionally, a new name or mode)."""
    out = copy.deepcopy(cr)
    spec = out["spec"]
    if name:
        out["metadata"]["name"] = name
    if mode:
        spec.setdefault("kvTransfer", {})["mode"] = mode
    spec.setdefault("engine", {})["image"] = engine_image
    for role in ("prefill", "decode"):
        role_spec = spec.setdefault(role, {})
        role_spec["podTemplate"] = deep_merge(role_spec.get("podTemplate") or {}, host_mounts_overlay(mounts))
    return out
