"""Names, labels and URLs derived from a DisaggregatedInference. Pure functions of the CR name and spec."""
from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

from disagg.connector.wire import env as wire_env

if TYPE_CHECKING:
    from .api import DisaggregatedInferenceSpec

ENGINE_ROLES = wire_env.ROLES
ROUTER = "router"
RENDEZVOUS = "rendezvous"

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_ROLE = "serving.disagg.io/role"
APP_NAME = "disagg"
MANAGED_BY = "disagg-operator"

RENDEZVOUS_PORT = wire_env.RENDEZVOUS_PORT
ROUTER_CONTAINER_PORT = 8000


def engine_name(cr: str, role: str) -> str:
    """StatefulSet, headless Service and PodDisruptionBudget of one engine role."""
    if role not in ENGINE_ROLES:
        raise ValueError(f"role must be one of {ENGINE_ROLES}, got {role!r}")
    return f"{cr}-{role}"


def router_name(cr: str) -> str:
    return f"{cr}-{ROUTER}"


def rendezvous_name(cr: str) -> str:
    return f"{cr}-{RENDEZVOUS}"


def rendezvous_token_secret(cr: str) -> str:
    """Secret with the shared token engines present to the rendezvous for writes (key `token`)."""
    return f"{cr}-rendezvous-token"


RENDEZVOUS_TOKEN_KEY = "token"

# spec.rendezvous.auth: kubernetes. Engines present a projected ServiceAccount token for this audience (so it is
# useless against the API server); the rendezvous, running as its own ServiceAccount, verifies it with a
# TokenReview, which system:auth-delegator allows.
RENDEZVOUS_AUDIENCE = wire_env.TOKEN_AUDIENCE
AUTH_DELEGATOR = "system:auth-delegator"
RENDEZVOUS_TOKEN_DIR = "/var/run/secrets/disagg/rendezvous"
RENDEZVOUS_TOKEN_PATH = "token"
RENDEZVOUS_TOKEN_SECONDS = 3600  # the kubelet rotates it at 80% of its life; the plugin re-reads the file
BINDING_PREFIX = "disagg-rendezvous"
# On the cluster-scoped ClusterRoleBinding, which cannot have the namespaced CR as owner: whose it is.
LABEL_CR_NAMESPACE = "serving.disagg.io/namespace"
OWNER_ANNOTATION = "serving.disagg.io/owner"  # <namespace>/<name> (a label value cannot hold a long name)
OWNER_UID_ANNOTATION = "serving.disagg.io/owner-uid"
MAX_NAME = 253


def rendezvous_service_account(cr: str) -> str:
    """The rendezvous' own ServiceAccount (auth kubernetes): the subject of its auth-delegator binding."""
    return f"{cr}-{RENDEZVOUS}"


def rendezvous_binding_name(namespace: str, cr: str) -> str:
    """The ClusterRoleBinding giving a deployment's rendezvous TokenReview: `disagg-rendezvous:<ns>:<cr>`.
    Colons appear in neither a namespace nor a CR name, so two deployments never share one; a name over 253
    characters keeps its head and ends in a hash of the whole."""
    name = f"{BINDING_PREFIX}:{namespace}:{cr}"
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha256(f"{namespace}/{cr}".encode()).hexdigest()[:10]
    return f"{name[:MAX_NAME - len(digest) - 1]}-{digest}"


def launch_configmap_name(cr: str) -> str:
    return f"{cr}-launch"


def launch_script_key(role: str) -> str:
    """Key of a role's script in the launch ConfigMap (mounted at /etc/disagg)."""
    return f"{role}.sh"


def selector_labels(cr: str, component: str) -> dict[str, str]:
    """The immutable subset used in selectors: never add keys here, selectors cannot change on update."""
    return {LABEL_INSTANCE: cr, LABEL_COMPONENT: component}


def labels(cr: str, component: str) -> dict[str, str]:
    out = {LABEL_NAME: APP_NAME, **selector_labels(cr, component), LABEL_MANAGED_BY: MANAGED_BY}
    if component in ENGINE_ROLES:
        out[LABEL_ROLE] = component
    return out


def rendezvous_url(cr: str, namespace: str) -> str:
    return f"http://{rendezvous_name(cr)}.{namespace}.svc:{RENDEZVOUS_PORT}"


def router_url(cr: str, namespace: str, port: int) -> str:
    return f"http://{router_name(cr)}.{namespace}.svc:{port}"


def layout_key(spec: DisaggregatedInferenceSpec) -> str:
    """16 hex chars identifying everything paired engines must agree on; the router pairs only equal keys."""
    material = [spec.model.name, spec.model.dtype, spec.engine.block_size, spec.kv_transfer.mode, spec.connector,
                spec.engine.image]
    return hashlib.sha256(json.dumps(material, separators=(",", ":")).encode()).hexdigest()[:16]
