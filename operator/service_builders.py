"""The router and rendezvous: Deployments and Services running the operator's own image."""
from __future__ import annotations

from typing import Any

from . import names
from .api import DisaggregatedInference
from .engine_builders import rendezvous_token_env
from .meta import OperatorImages, cr_name, http_probe, namespace_of, object_meta



def endpoint_url(cr: DisaggregatedInference) -> str:
    """In-cluster URL of the router: the deployment's OpenAI-compatible endpoint."""
    return names.router_url(cr_name(cr), namespace_of(cr), cr.spec.router.port)


def _deployment(cr: DisaggregatedInference, component: str, name: str, replicas: int, command: list[str],
                port: int, image: str, strategy: dict[str, Any],
                env: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    container = {
        "name": component,
        "image": image,
        "command": command,
        **({"env": env} if env else {}),
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
        "readinessProbe": http_probe("/health", "http", period=5, failures=3, timeout=2),
        "livenessProbe": http_probe("/health", "http", period=10, failures=3, timeout=5),
        "securityContext": {"allowPrivilegeEscalation": False},
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    selector = names.selector_labels(cr_name(cr), component)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_meta(cr, name, component),
        "spec": {
            "replicas": replicas,
            "strategy": strategy,
            "selector": {"matchLabels": selector},
            "template": {"metadata": {"labels": names.labels(cr_name(cr), component)},
                         "spec": {"enableServiceLinks": False, "containers": [container]}},
        },
    }


def _service(cr: DisaggregatedInference, component: str, name: str, service_type: str, port: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(cr, name, component),
        "spec": {"type": service_type, "selector": names.selector_labels(cr_name(cr), component),
                 "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}]},
    }


def rendezvous_deployment(cr: DisaggregatedInference, images: OperatorImages) -> dict[str, Any]:
    name = cr_name(cr)
    # Writes are authenticated with a per-deployment shared token from a Secret the operator creates once.
    # (Pod-bound ServiceAccount tokens with TokenReview, `--auth kubernetes`, also need a cluster-scoped
    # auth-delegator binding per deployment; not wired yet.)
    command = ["disagg", "rendezvous", "--port", str(names.RENDEZVOUS_PORT),
               "--heartbeat-seconds", str(cr.spec.rendezvous.heartbeat_seconds), "--auth", "token",
               "--deployment", name]
    # Recreate: the registry is in memory, and two pods behind one Service would each see half the heartbeats.
    return _deployment(cr, names.RENDEZVOUS, names.rendezvous_name(name), 1, command, names.RENDEZVOUS_PORT,
                       images.operator, {"type": "Recreate"}, env=[rendezvous_token_env(name)])


def rendezvous_service(cr: DisaggregatedInference) -> dict[str, Any]:
    return _service(cr, names.RENDEZVOUS, names.rendezvous_name(cr_name(cr)), "ClusterIP", names.RENDEZVOUS_PORT)


def router_deployment(cr: DisaggregatedInference, images: OperatorImages) -> dict[str, Any]:
    name, spec = cr_name(cr), cr.spec
    command = ["disagg", "router", "--mode", spec.kv_transfer.mode,
               "--rendezvous", names.rendezvous_url(name, namespace_of(cr)),
               "--port", str(names.ROUTER_CONTAINER_PORT)]
    return _deployment(cr, names.ROUTER, names.router_name(name), spec.router.replicas, command,
                       names.ROUTER_CONTAINER_PORT, images.operator, {"type": "RollingUpdate"})


def router_service(cr: DisaggregatedInference) -> dict[str, Any]:
    router = cr.spec.router
    return _service(cr, names.ROUTER, names.router_name(cr_name(cr)), router.service_type, router.port)
