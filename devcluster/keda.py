"""KEDA beside the local control plane: its operator and its external-metrics adapter, built from Go modules
(devcluster/gobuild-keda) and run as host processes like the rest of the control plane, so that a cluster test can
drive a DisaggregatedRole's /scale from the planner's metric the way a user who already runs KEDA does.

The pieces, as KEDA's own manifests set them up, minus the pods:
- KEDA's CRDs, from the KEDA module's config/crd/bases;
- the adapter serving `external.metrics.k8s.io/v1beta1` through the apiserver's aggregation layer: an APIService
  backed by a selectorless Service whose EndpointSlice points at this host (the apiserver routes to endpoints);
- the operator's gRPC metrics service, which the adapter asks for each metric, on mutual TLS;
- both on the admin kubeconfig (KEDA's RBAC is KEDA's business, not what the tests prove).

Pure: what to write and run (and the ScaledObjects that drive a role: scaled_object). LocalCluster.start_keda
does it.
"""
from __future__ import annotations

import base64
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from lightkube.generic_resource import create_namespaced_resource

from disagg.operator import api, role_api

from .build import KEDA_DIR

NAMESPACE = "keda"
ADAPTER_SERVICE = "keda-metrics-apiserver"
OPERATOR_SERVICE = "keda-operator"
API_SERVICE = "v1beta1.external.metrics.k8s.io"
MODULE = "github.com/kedacore/keda/v2"
ScaledObject = create_namespaced_resource("keda.sh", "v1alpha1", "ScaledObject", "scaledobjects")


def module_dir() -> Path:
    """Where the Go module cache holds the KEDA source the binaries were built from (its CRDs)."""
    out = subprocess.run(["go", "list", "-m", "-f", "{{.Dir}}", MODULE], cwd=KEDA_DIR, capture_output=True,
                         text=True, check=True)
    return Path(out.stdout.strip())


def crds(source: Path) -> list[dict[str, Any]]:
    return [yaml.safe_load(p.read_text()) for p in sorted((source / "config" / "crd" / "bases").glob("*.yaml"))]


def serving_names() -> tuple[str, ...]:
    """DNS names KEDA's certificate must carry: the aggregator verifies `<service>.<namespace>.svc`."""
    return tuple(f"{svc}.{NAMESPACE}.svc{suffix}" for svc in (ADAPTER_SERVICE, OPERATOR_SERVICE)
                 for suffix in ("", ".cluster.local")) + ("localhost",)


@dataclass(frozen=True)
class Ports:
    adapter: int  # the external metrics API (TLS)
    adapter_metrics: int
    grpc: int  # the operator's metrics service, which the adapter calls
    operator_metrics: int
    operator_health: int


def api_objects(host_ip: str, ports: Ports, ca_bundle: bytes) -> list[dict[str, Any]]:
    """Namespace, the adapter's Service and EndpointSlice (this host), and the APIService that routes
    external.metrics.k8s.io to it."""
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": ADAPTER_SERVICE, "namespace": NAMESPACE},
         "spec": {"ports": [{"name": "https", "port": 443, "targetPort": ports.adapter, "protocol": "TCP"}]}},
        {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
         "metadata": {"name": f"{ADAPTER_SERVICE}-host", "namespace": NAMESPACE,
                      "labels": {"kubernetes.io/service-name": ADAPTER_SERVICE}},
         "addressType": "IPv6" if ":" in host_ip else "IPv4",
         "endpoints": [{"addresses": [host_ip], "conditions": {"ready": True}}],
         "ports": [{"name": "https", "port": ports.adapter, "protocol": "TCP"}]},
        {"apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService", "metadata": {"name": API_SERVICE},
         "spec": {"service": {"name": ADAPTER_SERVICE, "namespace": NAMESPACE, "port": 443},
                  "group": "external.metrics.k8s.io", "version": "v1beta1",
                  "caBundle": base64.b64encode(ca_bundle).decode(),
                  "groupPriorityMinimum": 100, "versionPriority": 100}},
    ]


def env(kubeconfig: Path) -> dict[str, str]:
    """What KEDA reads from its pod's environment: every namespace watched, its own namespace, the kubeconfig."""
    return {"KUBECONFIG": str(kubeconfig), "WATCH_NAMESPACE": "", "POD_NAMESPACE": NAMESPACE,
            "KEDA_CLUSTER_OBJECT_NAMESPACE": NAMESPACE}


def operator_argv(binary: Path, cert_dir: Path, ports: Ports) -> list[str]:
    """The operator with the certificates given (ca.crt, tls.crt, tls.key in cert_dir), not rotated by itself:
    its rotation writes a Secret and patches the APIService for the pods' mounts. Its scalers trust the CAs in
    cert_dir/ca (the cluster's), besides the system's."""
    return [str(binary), "--leader-elect=false", "--enable-cert-rotation=false", f"--cert-dir={cert_dir}",
            f"--metrics-bind-address=127.0.0.1:{ports.operator_metrics}",
            f"--health-probe-bind-address=127.0.0.1:{ports.operator_health}",
            f"--metrics-service-bind-address=127.0.0.1:{ports.grpc}", f"--ca-dir={cert_dir / 'ca'}",
            "--zap-log-level=info", "--zap-encoder=console"]


def adapter_argv(binary: Path, cert_dir: Path, kubeconfig: Path, ports: Ports) -> list[str]:
    """The adapter serving on every address (the apiserver reaches it on the host's), calling the operator on
    loopback; it authenticates and authorizes the apiserver's proxied requests through the apiserver."""
    kc = str(kubeconfig)
    return [str(binary), f"--secure-port={ports.adapter}", f"--cert-dir={cert_dir}",
            f"--tls-cert-file={cert_dir / 'tls.crt'}", f"--tls-private-key-file={cert_dir / 'tls.key'}",
            f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}", f"--lister-kubeconfig={kc}",
            f"--metrics-service-address=127.0.0.1:{ports.grpc}", f"--port={ports.adapter_metrics}", "--v=0"]


def scaled_object(namespace: str, name: str, role_object: str, url: str, value_location: str, target: float, *,
                  max_replicas: int, metadata: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    """A ScaledObject driving one DisaggregatedRole's /scale from one series of a Prometheus text endpoint (KEDA's
    metrics-api scaler): ceil(value / `target`) engines, within 1 and `max_replicas`. `metadata`: more of the
    trigger's; `spec`: more of the ScaledObject's (pollingInterval, advanced, ...)."""
    return {
        "apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"scaleTargetRef": {"apiVersion": f"{api.GROUP}/{api.VERSION}", "kind": role_api.KIND,
                                    "name": role_object},
                 "minReplicaCount": 1, "maxReplicaCount": max_replicas, **spec,
                 "triggers": [{"type": "metrics-api", "metricType": "AverageValue", "metadata": {
                     "url": url, "format": "prometheus", "valueLocation": value_location,
                     "targetValue": f"{target:g}", **(metadata or {})}}]},
    }
