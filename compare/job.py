"""The in-cluster side of `disagg compare`: a Job beside the router that runs `disagg compare-run`, with the
least it needs (a ServiceAccount whose Role reads and patches this one DisaggregatedInference, reads the router's
logs and writes the report's ConfigMap), and the user's workload in a ConfigMap. Pure: objects as dicts.

Every object carries the CR's instance label and `serving.disagg.io/compare: <run>`, so one label selector finds
a run's objects for cleanup.
"""
from __future__ import annotations

import base64
import gzip
from dataclasses import dataclass
from typing import Any

from disagg.operator import api, names, role_api

LABEL_RUN = "serving.disagg.io/compare"
WORKLOAD_KEY = "workload.jsonl.gz"
REPORT_KEY = "report.json.gz"
PLACEMENT = ("nodeSelector", "tolerations", "affinity", "imagePullSecrets", "priorityClassName")
CONFIGMAP_MAX_BYTES = 1_000_000
"""What one ConfigMap may hold (the apiserver refuses objects past about 1 MiB)."""


@dataclass(frozen=True, slots=True)
class CompareJob:
    """One `disagg compare` run against the CR `name` in `namespace`."""

    namespace: str
    name: str
    run: str
    """A short id of this run (lowercase letters and digits), part of every object's name."""
    image: str
    """The disagg image to run: the router's own, so the client speaks the deployment's version."""
    args: tuple[str, ...]
    """`disagg compare-run` arguments besides the CR, the workload file and the report ConfigMap."""
    workload_jsonl: bytes | None = None
    """The user's workload; None: the built-in synthetic one (its settings are in `args`)."""
    placement: tuple[tuple[str, Any], ...] = ()
    """Pod spec fields copied from the router's pod (PLACEMENT), so the Job runs where the router can: on the
    nodes it selects and tolerates, pulling with its secrets."""
    deadline_seconds: int = 3600

    @property
    def base(self) -> str:
        return f"{self.name}-compare-{self.run}"

    @property
    def report_configmap(self) -> str:
        return f"{self.base}-report"

    @property
    def workload_configmap(self) -> str:
        return f"{self.base}-workload"

    def labels(self) -> dict[str, str]:
        return {names.LABEL_INSTANCE: self.name, names.LABEL_COMPONENT: "compare", LABEL_RUN: self.run,
                names.LABEL_MANAGED_BY: "disagg-compare"}


def objects(job: CompareJob) -> list[dict[str, Any]]:
    """Everything the run needs, in the order to create them. Raises ValueError when the workload cannot fit a
    ConfigMap even compressed."""
    meta = {"namespace": job.namespace, "labels": job.labels()}
    out: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": job.base, **meta}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": job.base, **meta},
         "rules": [
             {"apiGroups": [api.GROUP], "resources": [api.PLURAL], "resourceNames": [job.name],
              "verbs": ["get", "patch"]},
             # A watch cannot be limited by resourceNames unless the client asks with a field selector on it,
             # which compare-run does; list is what a watch needs.
             {"apiGroups": [api.GROUP], "resources": [api.PLURAL], "verbs": ["list", "watch"]},
             # --switch recreate: each role to 0 and back through its /scale.
             {"apiGroups": [api.GROUP], "resources": [role_api.PLURAL], "verbs": ["get", "patch"],
              "resourceNames": [names.role_object_name(job.name, r) for r in ("prefill", "decode")]},
             {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
             {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
             {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create"]},
         ]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": job.base, **meta},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": job.base},
         "subjects": [{"kind": "ServiceAccount", "name": job.base, "namespace": job.namespace}]},
    ]
    args = ["compare-run", "--name", job.name, "--namespace", job.namespace,
            "--report-configmap", job.report_configmap, *job.args]
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    if job.workload_jsonl is not None:
        packed = gzip.compress(job.workload_jsonl, mtime=0)
        if len(packed) > CONFIGMAP_MAX_BYTES:
            raise ValueError(f"the workload is {len(packed)} bytes compressed; a ConfigMap holds at most "
                             f"{CONFIGMAP_MAX_BYTES}: replay fewer or shorter requests")
        out.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": job.workload_configmap, **meta},
                    "binaryData": {WORKLOAD_KEY: base64.b64encode(packed).decode()}})
        volumes.append({"name": "workload", "configMap": {"name": job.workload_configmap}})
        mounts.append({"name": "workload", "mountPath": "/workload", "readOnly": True})
        args += ["--workload", f"/workload/{WORKLOAD_KEY}"]
    container = {"name": "compare", "image": job.image, "command": ["disagg"], "args": args,
                 "volumeMounts": mounts,
                 "resources": {"requests": {"cpu": "500m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
                 "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}
    out.append({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": job.base, **meta},
                "spec": {"backoffLimit": 0, "activeDeadlineSeconds": job.deadline_seconds,
                         "ttlSecondsAfterFinished": 3600,
                         "template": {"metadata": {"labels": job.labels()},
                                      "spec": {**dict(job.placement), "serviceAccountName": job.base,
                                               "restartPolicy": "Never", "containers": [container],
                                               "volumes": volumes}}}})
    return out

