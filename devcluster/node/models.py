"""The tiny model as a cluster volume: a `local` PersistentVolume on the real node, pre-bound to one claim, so a
DisaggregatedInference reads its model from a PVC as it would on a real cluster. Pure: returns manifests."""
from __future__ import annotations

from pathlib import Path
from typing import Any

STORAGE_CLASS = "disagg-local-models"
CLAIM = "disagg-models"


def model_volume(namespace: str, host_dir: Path, node: str, claim: str = CLAIM,
                 size: str = "1Gi") -> list[dict[str, Any]]:
    """A PersistentVolume of `host_dir` on `node` (read-only, retained) and the claim `claim` in `namespace`
    bound to it. One volume per claim: a PersistentVolume binds one claim for its life."""
    pv_name = f"{claim}-{namespace}"
    return [
        {"apiVersion": "v1", "kind": "PersistentVolume",
         "metadata": {"name": pv_name, "labels": {"serving.disagg.io/models-for": namespace}},
         "spec": {"capacity": {"storage": size}, "accessModes": ["ReadOnlyMany"],
                  "persistentVolumeReclaimPolicy": "Retain", "storageClassName": STORAGE_CLASS,
                  "local": {"path": str(host_dir)},
                  "claimRef": {"namespace": namespace, "name": claim},
                  "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                      {"key": "kubernetes.io/hostname", "operator": "In", "values": [node]}]}]}}}},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim, "namespace": namespace},
         "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": STORAGE_CLASS, "volumeName": pv_name,
                  "resources": {"requests": {"storage": size}}}},
    ]
