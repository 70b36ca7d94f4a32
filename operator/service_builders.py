"""The router and rendezvous: Deployments and Services running the operator's own image."""
from __future__ import annotations

from typing import Any

from . import names
from .api import PREFIX_AWARE, DisaggregatedInference
from .engine_builders import rendezvous_token_env
from .meta import OperatorImages, cr_name, http_probe, namespace_of, object_meta


def endpoint_url(cr: DisaggregatedInference) -> str:
    """In-cluster URL of the router: the deployment's OpenAI-compatible endpoint."""
    return names.router_url(cr_name(cr), namespace_of(cr), cr.spec.router.port)


def support_pod_placement(cr: DisaggregatedInference) -> dict[str, Any]:
    """The router's and rendezvous' nodeSelector and tolerations. cpu profile: the engines' own, so they can run
    on the CPU-engine nodes (on a small cluster those may be the only nodes that run containers). Accelerator
    profiles: none, so they stay off the tainted accelerator nodes."""
    profile = cr.spec.profile
    if not profile.cpu_only:
        return {}
    return {"nodeSelector": profile.node_selector(), "tolerations": profile.pod_tolerations()}


def _deployment(cr: DisaggregatedInference, component: str, name: str, replicas: int, command: list[str],
                port: int, image: str, strategy: dict[str, Any], env: list[dict[str, Any]] | None = None,
                pod_spec: dict[str, Any] | None = None, readiness_path: str = "/health",
                liveness_path: str = "/health") -> dict[str, Any]:
    container = {
        "name": component,
        "image": image,
        "command": command,
        **({"env": env} if env else {}),
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
        "readinessProbe": http_probe(readiness_path, "http", period=5, failures=3, timeout=2),
        "livenessProbe": http_probe(liveness_path, "http", period=10, failures=3, timeout=5),
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
                         "spec": {"enableServiceLinks": False, **(pod_spec or {}), **support_pod_placement(cr),
                                  "containers": [container]}},
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
    command = ["disagg", "rendezvous", "--port", str(names.RENDEZVOUS_PORT),
               "--heartbeat-seconds", str(cr.spec.rendezvous.heartbeat_seconds), "--auth", cr.spec.rendezvous.auth,
               "--deployment", name]
    if cr.spec.rendezvous.auth == "kubernetes":
        # Engines' pod-bound tokens, checked with TokenReviews sent as the rendezvous' own ServiceAccount (bound
        # to system:auth-delegator by rendezvous_binding); only this deployment's engine pods in this namespace
        # may write.
        env = [{"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}]
        pod_spec = {"serviceAccountName": names.rendezvous_service_account(name),
                    "automountServiceAccountToken": True}
    else:
        # A per-deployment shared token from a Secret the operator creates once.
        env, pod_spec = [rendezvous_token_env(name)], {"automountServiceAccountToken": False}
    # Recreate: the registry is in memory, and two pods behind one Service would each see half the heartbeats.
    return _deployment(cr, names.RENDEZVOUS, names.rendezvous_name(name), 1, command, names.RENDEZVOUS_PORT,
                       images.operator, {"type": "Recreate"}, env=env, pod_spec=pod_spec)


def rendezvous_service_account(cr: DisaggregatedInference) -> dict[str, Any]:
    """auth kubernetes: the identity the rendezvous sends TokenReviews as. Owned by the CR like every child."""
    return {"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": object_meta(cr, names.rendezvous_service_account(cr_name(cr)), names.RENDEZVOUS)}


def rendezvous_binding(cr: DisaggregatedInference) -> dict[str, Any]:
    """auth kubernetes: system:auth-delegator (TokenReview) for the rendezvous' ServiceAccount.

    Cluster-scoped, so it cannot be owned by the namespaced CR and the garbage collector never removes it: the
    operator does (bindings.BindingCollector), finding its bindings by the labels below and their CR by the
    annotations."""
    name, namespace = cr_name(cr), namespace_of(cr)
    labels = {**names.labels(name, names.RENDEZVOUS), names.LABEL_CR_NAMESPACE: namespace}
    annotations = {names.OWNER_ANNOTATION: f"{namespace}/{name}"}
    if cr.metadata.get("uid"):
        annotations[names.OWNER_UID_ANNOTATION] = str(cr.metadata["uid"])
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": names.rendezvous_binding_name(namespace, name), "labels": labels,
                     "annotations": annotations},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": names.AUTH_DELEGATOR},
        "subjects": [{"kind": "ServiceAccount", "name": names.rendezvous_service_account(name),
                      "namespace": namespace}],
    }


def rendezvous_service(cr: DisaggregatedInference) -> dict[str, Any]:
    return _service(cr, names.RENDEZVOUS, names.rendezvous_name(cr_name(cr)), "ClusterIP", names.RENDEZVOUS_PORT)


ROUTER_STOP_DELAY_SECONDS = 5
"""A stopping router serves this long before it stops listening: kube-proxy learns that the pod is terminating
after the kubelet has sent the SIGTERM, so new connections keep coming for a moment."""
ROUTER_DRAIN_SECONDS = 60
"""Then the requests in flight on it, streams included, have this long to finish."""
ROUTER_EXIT_SECONDS = 10
"""And the process this long to exit (aiohttp rounds its waits up to whole seconds) before the kubelet's SIGKILL."""


def router_deployment(cr: DisaggregatedInference, images: OperatorImages) -> dict[str, Any]:
    name, spec = cr_name(cr), cr.spec
    command = ["disagg", "router", "--mode", spec.kv_transfer.mode,
               "--rendezvous", names.rendezvous_url(name, namespace_of(cr)),
               "--port", str(names.ROUTER_CONTAINER_PORT), "--pair-wait-seconds", str(spec.router.pair_wait_seconds),
               "--stop-delay-seconds", str(ROUTER_STOP_DELAY_SECONDS), "--drain-seconds", str(ROUTER_DRAIN_SECONDS),
               "--max-inflight", str(spec.router.max_inflight),
               "--max-inflight-per-engine", str(spec.router.max_inflight_per_engine),
               "--max-queue", str(spec.router.max_queue), "--queue-wait-seconds", f"{spec.router.queue_wait_seconds:g}",
               "--served-model-name", spec.served_name]
    # Only when asked: a least-loaded CR's routers keep the command they had, so an operator upgrade rolls none.
    if spec.router.policy == PREFIX_AWARE:
        prefix = spec.router.prefix
        command += ["--policy", PREFIX_AWARE, "--prefill-hit-weight", f"{prefix.prefill_hit_weight:g}",
                    "--decode-hit-weight", f"{prefix.decode_hit_weight:g}",
                    "--decode-only-share", f"{prefix.decode_only_share:g}"]
    if spec.router.access_log:
        command += ["--access-log", "-"]
    # Ready once it has read the rendezvous, whether or not a pair is up: a router that is not Ready takes the
    # Service's only endpoint away, and clients get refused connections instead of waiting for the pair.
    # The router runs the operator's image, so an operator upgrade rolls it: one new router Ready before an old
    # one stops, whatever the replicas (Kubernetes' default, 25% unavailable, stops one of four first).
    return _deployment(cr, names.ROUTER, names.router_name(name), spec.router.replicas, command,
                       names.ROUTER_CONTAINER_PORT, images.operator,
                       {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
                       pod_spec={"terminationGracePeriodSeconds":
                                 ROUTER_STOP_DELAY_SECONDS + ROUTER_DRAIN_SECONDS + ROUTER_EXIT_SECONDS},
                       readiness_path="/readyz", liveness_path="/livez")


def router_service(cr: DisaggregatedInference) -> dict[str, Any]:
    router = cr.spec.router
    return _service(cr, names.ROUTER, names.router_name(cr_name(cr)), router.service_type, router.port)
