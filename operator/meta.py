"""Metadata shared by every child object: namespace, labels, owner reference."""
from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from . import names
from .api import GROUP, KIND, VERSION, DisaggregatedInference

FIELD_MANAGER = "disagg-operator"
"""The field manager of every write the operator makes (server-side apply, patches)."""

DEFAULT_OPERATOR_IMAGE = "ghcr.io/disagg/disagg:0.1.0"
# Offline render of a CR without metadata.namespace: children (and the in-cluster URLs) use this.
DEFAULT_NAMESPACE = "default"


@dataclass(frozen=True)
class OperatorImages:
    """Images the operator gives its children: the router and rendezvous run `operator`, the engines' plugin init
    container `plugin_image`. The operator's own image by default; a revision made by an earlier operator keeps
    the plugin it was made with (engine_builders.pinned_revision), so an upgraded operator rolls no engine."""

    operator: str = DEFAULT_OPERATOR_IMAGE
    plugin: str | None = None
    """The plugin init container's image when it is not `operator`."""

    @property
    def plugin_image(self) -> str:
        return self.plugin or self.operator


DEFAULT_IMAGES = OperatorImages()


def utc_now() -> str:
    """Now, as the API's timestamps say it (RFC 3339, seconds, Z)."""
    return dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def timestamp(stamp: object) -> float | None:
    """A Kubernetes timestamp (RFC 3339, `Z` for UTC) as seconds since the epoch; None when absent or malformed."""
    if not isinstance(stamp, str) or not stamp:
        return None
    try:
        return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def cr_name(cr: DisaggregatedInference) -> str:
    name = cr.metadata.get("name")
    if not name:
        raise ValueError("metadata.name: required")
    return str(name)


def namespace_of(cr: DisaggregatedInference) -> str:
    return str(cr.metadata.get("namespace") or DEFAULT_NAMESPACE)


def owner_references(cr: DisaggregatedInference) -> list[dict[str, Any]]:
    uid = cr.metadata.get("uid")
    if not uid:
        return []
    return [{"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": cr_name(cr), "uid": str(uid),
             "controller": True, "blockOwnerDeletion": True}]


def object_meta(cr: DisaggregatedInference, name: str, component: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace_of(cr), "labels": names.labels(cr_name(cr), component)}
    refs = owner_references(cr)
    if refs:
        meta["ownerReferences"] = refs
    return meta


def http_probe(path: str, port: str, *, period: int, failures: int, timeout: int = 5) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period, "failureThreshold": failures,
            "timeoutSeconds": timeout}
