"""Every child object of a DisaggregatedInference, as plain manifest dicts. Pure: no cluster access."""
from __future__ import annotations

import copy
from typing import Any

from . import names
from .api import DisaggregatedInference
from .engine_builders import (
    engine_args,
    engine_pdb,
    engine_revision,
    engine_service,
    engine_statefulset,
    launch_configmap,
    launch_script,
)
from .meta import DEFAULT_IMAGES, DEFAULT_OPERATOR_IMAGE, OperatorImages
from .service_builders import (
    endpoint_url,
    rendezvous_binding,
    rendezvous_deployment,
    rendezvous_service,
    rendezvous_service_account,
    router_deployment,
    router_service,
)

__all__ = ["DEFAULT_OPERATOR_IMAGE", "OperatorImages", "build_children", "endpoint_url", "engine_args",
           "engine_revision", "engine_statefulset", "launch_script"]


def build_children(cr: DisaggregatedInference, *, images: OperatorImages = DEFAULT_IMAGES,
                   statefulsets: bool = True, revision: str | None = None) -> list[dict[str, Any]]:
    """All children in apply order: the current revision's launch ConfigMap, rendezvous, engines per role, then
    the router. With `spec.rendezvous.auth: kubernetes` the rendezvous' ServiceAccount and its
    ClusterRoleBinding (cluster-scoped, so not owned by the CR) come before its Deployment; with `token` the
    operator adds the token Secret itself (reconciler.py: its random value is never server-side applied).

    The engine StatefulSets are the current revision's at the spec's replicas (what `disagg render` shows);
    `statefulsets=False` leaves them out for the operator, whose rollout decides their replicas and retires
    older revisions' (rollout/). `revision`, when given, must be `engine_revision(cr, images)`, already known."""
    revision = revision or engine_revision(cr, images)
    children: list[dict[str, Any]] = [launch_configmap(cr, revision), rendezvous_service(cr)]
    if cr.spec.rendezvous.auth == "kubernetes":
        children += [rendezvous_service_account(cr), rendezvous_binding(cr)]
    children.append(rendezvous_deployment(cr, images))
    for role in names.ENGINE_ROLES:
        children.append(engine_service(cr, role))
        if statefulsets:
            children.append(engine_statefulset(cr, role, images, revision))
        children.append(engine_pdb(cr, role))
    children += [router_service(cr), router_deployment(cr, images)]
    # No object shared between children: callers may mutate one without touching another.
    return copy.deepcopy(children)
