"""kopf's peering resources, so two operator replicas never both act.

kopf pauses an operator while a peer with a higher priority is alive, and freezes all peers that share a
priority. Replicas therefore start with a random priority (unless one is given): the highest one acts, the
others wait, and when it dies its peering record expires and the next one takes over.
"""
from __future__ import annotations

import secrets
import socket
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

GROUP, VERSION = "kopf.dev", "v1"


def own_identity(env: Mapping[str, str], now: datetime | None = None) -> str:
    """This replica's peering identity: its pod name (else the host name), start time and a random suffix, so a
    restarted pod never reuses its predecessor's record. Not kopf's default, which starts with the user name:
    the image runs as uid 65532, which has no passwd entry, so getpass.getuser() raises and the operator died at
    start-up in every pod."""
    host = env.get("POD_NAME") or socket.gethostname()
    stamp = (now or datetime.now(UTC)).strftime("%Y%m%d%H%M%S")
    return f"{host}/{stamp}/{secrets.token_hex(3)}"


def _crd(kind: str, plural: str, scope: str) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": scope,
            "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
            "versions": [{"name": VERSION, "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                "type": "object",
                "description": "kopf operator peering: which operator replicas are alive, with their priorities.",
                "properties": {"status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                                          "description": "Alive peers, keyed by peer id."}},
            }}}],
        },
    }


def crds() -> list[dict[str, Any]]:
    return [_crd("ClusterKopfPeering", "clusterkopfpeerings", "Cluster"),
            _crd("KopfPeering", "kopfpeerings", "Namespaced")]


def peering_object(name: str, namespace: str | None = None) -> dict[str, Any]:
    """The object the replicas meet on: ClusterKopfPeering when watching all namespaces, else KopfPeering."""
    if namespace is None:
        return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ClusterKopfPeering", "metadata": {"name": name}}
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "KopfPeering",
            "metadata": {"name": name, "namespace": namespace}}
