"""Names, labels and URLs derived from a DisaggregatedInference. Pure functions of the CR name and spec."""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from disagg.connector.wire import env as wire_env

if TYPE_CHECKING:
    from .api import DisaggregatedInferenceSpec

Key = tuple[str, str]
"""A DisaggregatedInference's (namespace, name): how the operator's loops, caches and metrics know a CR."""
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


LABEL_REVISION = "serving.disagg.io/revision"
"""On an engine StatefulSet, its selector and its pods: the revision (`revision_hash`) of the pod templates."""
LAYOUT_KEY_ANNOTATION = "serving.disagg.io/layout-key"
"""On an engine StatefulSet: the KV layout key its engines advertise (`layout_key`)."""
REVISION_CHARS = wire_env.REVISION_CHARS
_REVISION_RE = re.compile(f"^[0-9a-f]{{{REVISION_CHARS}}}$")


def engine_name(cr: str, role: str) -> str:
    """The headless Service and PodDisruptionBudget of one engine role (every revision's pods), and the
    StatefulSet of an operator release that predates revisions."""
    if role not in ENGINE_ROLES:
        raise ValueError(f"role must be one of {ENGINE_ROLES}, got {role!r}")
    return f"{cr}-{role}"


def role_object_name(cr: str, role: str) -> str:
    """The DisaggregatedRole of one engine role, whose /scale sets the role's count: `<cr>-<role>`."""
    return engine_name(cr, role)


def engine_statefulset_name(cr: str, role: str, revision: str) -> str:
    """The StatefulSet of one role of one revision: `<cr>-<role>-<revision>`."""
    if not _REVISION_RE.match(revision):
        raise ValueError(f"revision must be {REVISION_CHARS} hex characters, got {revision!r}")
    return f"{engine_name(cr, role)}-{revision}"


def revision_hash(material: object) -> str:
    """A revision's name: REVISION_CHARS hex characters of a hash of what it runs."""
    return hashlib.sha256(json.dumps(material, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[
        :REVISION_CHARS]


def engine_owner(statefulset: str) -> tuple[str, str] | None:
    """(CR name, role) of an engine StatefulSet name (`<cr>-<role>-<revision>`, or a pre-revision `<cr>-<role>`),
    or None when no CR would name a StatefulSet so."""
    base = statefulset
    head, _, tail = statefulset.rpartition("-")
    if head and _REVISION_RE.match(tail):
        base = head
    for role in ENGINE_ROLES:
        if base.endswith(f"-{role}") and len(base) > len(role) + 1:
            return base[: -len(role) - 1], role
    return None


def engine_pod_owner(pod: str) -> tuple[str, str] | None:
    """(CR name, role) of an engine pod name (`<statefulset>-<ordinal>`), or None when no CR would name a pod so."""
    head, _, ordinal = pod.rpartition("-")
    return engine_owner(head) if head and ordinal.isdigit() else None


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


def launch_configmap_name(cr: str, revision: str) -> str:
    """The launch scripts of one revision: its pods must keep their own scripts while another revision rolls."""
    return f"{cr}-launch-{revision}"


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


DEFAULT_RENDEZVOUS_TEMPLATE = rendezvous_url("{name}", "{namespace}")
"""Where the operator reads each deployment's rendezvous by default: its in-cluster Service, {name} and {namespace}
the CR's."""


def router_url(cr: str, namespace: str, port: int) -> str:
    return f"http://{router_name(cr)}.{namespace}.svc:{port}"


def layout_key(spec: DisaggregatedInferenceSpec) -> str:
    """16 hex chars identifying everything paired engines must agree on; the router pairs only equal keys."""
    material: list[object] = [spec.model.name, spec.model.dtype, spec.engine.block_size, spec.kv_transfer.mode,
                              spec.connector, spec.engine.image]
    if spec.engine.emulator is not None:  # never paired with real engines (and no change to a real CR's key)
        material.append(["emulator", spec.engine.emulator.profile])
    return hashlib.sha256(json.dumps(material, separators=(",", ":")).encode()).hexdigest()[:16]


# -- how long a CR name may be ------------------------------------------------------------------------------
DNS_LABEL_MAX = 63  # a DNS label (RFC 1123/1035) and a label value share this bound
LABEL_VALUE_MAX = 63
# A StatefulSet names its ControllerRevisions `<statefulset>-<hash>` and puts that whole name on every pod as the
# label `controller-revision-hash`. The hash is a 32-bit FNV hash in decimal, safe-encoded: at most 10 characters.
REVISION_HASH_MAX = 10
STATEFULSET_REVISION_LABEL = "controller-revision-hash"
# Children are Services (DNS-1035 labels: a letter first) and carry the name as a label value: lowercase letters,
# digits and '-', a letter first and no '-' last, is what all of them accept. (Kubernetes 1.36 relaxes Service
# names to DNS-1123 labels, which may start with a digit; older clusters do not.)
CR_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"

Rule = Literal["dns-1035-label", "dns-1123-label", "dns-1123-subdomain", "label-value", "path-segment"]
_RULES: dict[str, tuple[int, str]] = {
    "dns-1035-label": (DNS_LABEL_MAX, r"^[a-z]([-a-z0-9]*[a-z0-9])?$"),
    "dns-1123-label": (DNS_LABEL_MAX, r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"),
    "dns-1123-subdomain": (MAX_NAME, r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"),
    "label-value": (LABEL_VALUE_MAX, r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"),
    "path-segment": (MAX_NAME, r"^[^/%]+$"),
}


def valid(value: str, rule: Rule) -> bool:
    """Whether `value` is a valid name or label value of this kind, as the apiserver checks it."""
    limit, pattern = _RULES[rule]
    return len(value) <= limit and re.match(pattern, value) is not None and value not in (".", "..")


@dataclass(frozen=True)
class DerivedName:
    """A name or label value the operator, or a controller acting on its children, derives from the CR name."""

    what: str
    value: str
    rule: Rule

    @property
    def limit(self) -> int:
        return _RULES[self.rule][0]

    @property
    def valid(self) -> bool:
        return valid(self.value, self.rule)


def derived_names(cr: str, namespace: str, max_replicas: int) -> list[DerivedName]:
    """Every name and label value derived from CR `cr` that the apiserver validates: the children's names, the
    label values carrying the CR name, and what the StatefulSet controller derives from the engine StatefulSets
    (pod names up to ordinal `max_replicas - 1`, which are also pod hostnames and labels, and the
    controller-revision-hash label)."""
    out = [DerivedName("label app.kubernetes.io/instance", cr, "label-value"),
           DerivedName("rendezvous Service", rendezvous_name(cr), "dns-1035-label"),
           DerivedName("router Service", router_name(cr), "dns-1035-label"),
           DerivedName("router Deployment", router_name(cr), "dns-1123-subdomain"),
           DerivedName("rendezvous Deployment", rendezvous_name(cr), "dns-1123-subdomain"),
           DerivedName("rendezvous ServiceAccount", rendezvous_service_account(cr), "dns-1123-subdomain"),
           DerivedName("rendezvous token Secret", rendezvous_token_secret(cr), "dns-1123-subdomain"),
           DerivedName("rendezvous ClusterRoleBinding", rendezvous_binding_name(namespace, cr), "path-segment"),
           DerivedName("launch ConfigMap", launch_configmap_name(cr, "0" * REVISION_CHARS), "dns-1123-subdomain")]
    for role in ENGINE_ROLES:
        sts = engine_statefulset_name(cr, role, "0" * REVISION_CHARS)
        pod = f"{sts}-{max(max_replicas - 1, 0)}"
        out += [DerivedName(f"{role} StatefulSet", sts, "dns-1123-subdomain"),
                DerivedName(f"{role} PodDisruptionBudget", engine_name(cr, role), "dns-1123-subdomain"),
                DerivedName(f"{role} headless Service", engine_name(cr, role), "dns-1035-label"),
                DerivedName(f"{role} DisaggregatedRole", role_object_name(cr, role), "dns-1123-subdomain"),
                DerivedName(f"{role} pod name (its hostname)", pod, "dns-1123-label"),
                DerivedName(f"{role} pod label statefulset.kubernetes.io/pod-name", pod, "label-value"),
                DerivedName(f"{role} pod label {STATEFULSET_REVISION_LABEL}",
                            f"{sts}-{'0' * REVISION_HASH_MAX}", "label-value")]
    return out


@dataclass(frozen=True)
class NameLimit:
    """The longest CR name whose every derived name is valid, and the derived name that sets the bound."""

    length: int
    binding: DerivedName  # the derived name that is exactly at its limit when the CR name is `length` long


def max_cr_name_length(max_replicas: int) -> NameLimit:
    """The longest CR name (of allowed characters, in the longest namespace) for which every name in
    `derived_names` is valid. Derived, not assumed: the bound moves with any new child or suffix."""
    namespace = "n" * DNS_LABEL_MAX
    best = None
    for length in range(1, MAX_NAME + 1):
        if not all(d.valid for d in derived_names("a" * length, namespace, max_replicas)):
            break
        best = length
    if best is None:
        raise ValueError("no CR name is short enough for its children")
    binding = next(d for d in derived_names("a" * (best + 1), namespace, max_replicas) if not d.valid)
    at_limit = next(d for d in derived_names("a" * best, namespace, max_replicas) if d.what == binding.what)
    return NameLimit(best, at_limit)
