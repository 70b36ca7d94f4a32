"""The DisaggregatedRole objects: built from a CR and a decided write, read back from the apiserver, and their
status from the rollout's view of the engines. Pure."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import ValidationError

from .. import names
from ..api import GROUP, VERSION, DisaggregatedInference, RevisionStatus
from ..meta import cr_name, object_meta, owner_references
from ..role_api import KIND, SPEC_REPLICAS_ANNOTATION, DisaggregatedRoleStatus
from ..rollout.state import Role
from .counts import LiveRole, RoleWrite


def selector(cr: str, role: Role) -> str:
    """The label selector of the role's engine pods in every revision, as /scale reports it (a string)."""
    return ",".join(f"{k}={v}" for k, v in sorted(names.selector_labels(cr, role).items()))


def _record(spec_replicas: int | None) -> dict[str, str]:
    return {} if spec_replicas is None else {SPEC_REPLICAS_ANNOTATION: str(spec_replicas)}


def role_object(cr: DisaggregatedInference, role: Role, write: RoleWrite) -> dict[str, Any]:
    """The role object to create: owned by the CR (the garbage collector deletes it with the CR)."""
    meta = object_meta(cr, names.role_object_name(cr_name(cr), role), role)
    if annotations := _record(write.spec_replicas):
        meta["annotations"] = annotations
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "metadata": meta,
            "spec": {"deployment": cr_name(cr), "role": role, "replicas": write.replicas}}


def role_update(cr: DisaggregatedInference, role: Role, write: RoleWrite) -> dict[str, Any]:
    """A JSON merge patch that makes an existing role object say `write`, refused by the apiserver (409) unless the
    object is still at `write.resource_version`. It makes the CR the object's owner (adopting one a user made)."""
    return {"metadata": {"resourceVersion": write.resource_version,
                         "labels": names.labels(cr_name(cr), role),
                         "annotations": {SPEC_REPLICAS_ANNOTATION: None, **_record(write.spec_replicas)},
                         "ownerReferences": owner_references(cr)},
            "spec": {"replicas": write.replicas}}


def _int(value: object) -> int | None:
    try:
        return int(str(value))
    except ValueError:
        return None


def live_role(obj: Mapping[str, Any]) -> LiveRole:
    """A role object as the apiserver sent it (a watch event, a read, a write's answer)."""
    meta = obj.get("metadata") or {}
    controller = next((o for o in meta.get("ownerReferences") or () if o.get("controller")), None)
    try:
        status = DisaggregatedRoleStatus.model_validate(obj.get("status") or {})
    except ValidationError:
        status = None  # rewritten by the next status write
    return LiveRole(
        name=str(meta.get("name") or ""),
        replicas=int((obj.get("spec") or {}).get("replicas") or 0),
        spec_replicas=_int((meta.get("annotations") or {}).get(SPEC_REPLICAS_ANNOTATION)),
        resource_version=str(meta.get("resourceVersion") or ""),
        generation=int(meta.get("generation") or 0),
        owner_uid=str(controller.get("uid")) if controller else None,
        status=status)


def role_status(cr: str, role: Role, generation: int, revisions: Iterable[RevisionStatus]) -> DisaggregatedRoleStatus:
    """The role object's status: the role's engines over every revision, from the rollout's view of them."""
    counts = [r.prefill if role == "prefill" else r.decode for r in revisions]
    return DisaggregatedRoleStatus(observed_generation=generation, replicas=sum(c.replicas for c in counts),
                                   ready_replicas=sum(c.ready for c in counts), selector=selector(cr, role))
