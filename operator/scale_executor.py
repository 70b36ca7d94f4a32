"""Keep each role's DisaggregatedRole as scale/counts.py decides, and publish its status.

Hard bounds:
- every write of a role object's spec is conditional on the object decided from: a create fails when it exists,
  an update (a JSON merge patch carrying the resourceVersion read) when it changed since; on such a conflict the
  object is read again and the decision made again, at most WRITE_ATTEMPTS times;
- nothing here deletes a role object (the garbage collector does, with its CR);
- a status is written only when it differs from the one the object has;
- a refused write never stops the pass: the role runs what counts.kept says, and the refusal is reported.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lightkube import AsyncClient, codecs
from lightkube.core.exceptions import ApiError
from lightkube.generic_resource import create_namespaced_resource
from lightkube.types import PatchType

from . import api, metrics, names, role_api
from .meta import FIELD_MANAGER, cr_name, namespace_of
from .names import Key
from .rollout.state import ROLES, Role
from .scale.counts import LiveRole, RoleScale, decide, kept, remembered
from .scale.objects import live_role, role_object, role_status, role_update

RoleResource = create_namespaced_resource(api.GROUP, api.VERSION, role_api.KIND, role_api.PLURAL)
WRITE_ATTEMPTS = 3


@dataclass
class RoleSync:
    """A pass's roles: what each runs, the role objects as last known, and what was written or refused."""

    scales: dict[Role, RoleScale] = field(default_factory=dict)
    live: dict[Role, LiveRole | None] = field(default_factory=dict)
    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    error: str | None = None
    code: int = 0
    gone: bool = False  # the CR was found deleted before a write

    def desired(self) -> tuple[int, int]:
        return self.scales["prefill"].desired, self.scales["decode"].desired


class RoleScaler:
    def __init__(self, client: AsyncClient, logger: logging.Logger | None = None) -> None:
        self.client = client
        self.log = logger or logging.getLogger("disagg.operator.scale")
        self._seen: dict[Key, int] = {}  # role object -> the generation last decided from (or written)

    async def sync(self, cr: api.DisaggregatedInference, live: Mapping[Role, LiveRole | None],
                   still_there: Callable[[], Awaitable[bool]]) -> RoleSync:
        """Decide each role's count from the role objects as the watch shows them (`live`) and make the objects
        say it."""
        out = RoleSync()
        for role in ROLES:
            scale, now = await self._sync_role(cr, role, live.get(role), still_there, out)
            if out.gone:
                return out
            out.scales[role], out.live[role] = scale, now
            if now is not None:
                self._seen[(namespace_of(cr), now.name)] = now.generation
        return out

    async def _sync_role(self, cr: api.DisaggregatedInference, role: Role, live: LiveRole | None,
                         still_there: Callable[[], Awaitable[bool]],
                         out: RoleSync) -> tuple[RoleScale, LiveRole | None]:
        asked = (cr.spec.prefill if role == "prefill" else cr.spec.decode).replicas
        memory = remembered(cr.status, role)
        uid = str(cr.metadata.get("uid") or "")
        name = names.role_object_name(cr_name(cr), role)
        for _ in range(WRITE_ATTEMPTS):
            scale = decide(role, asked, live, memory, uid)
            if scale.write is None:
                ours = live is not None and live.owner_uid in (None, uid)
                return scale, live if ours else None  # another object's is not ours to write a status on
            if not await still_there():
                out.gone = True
                return scale, live
            try:
                stored = await self._write(cr, scale)
            except Exception as e:
                refused = _refused(e)
                if refused is None:
                    raise
                code, message = refused
                if code == 409:  # it exists after all, or changed since we read it: read it, decide again
                    live = await self._read(namespace_of(cr), name)
                    continue
                verb = "create" if scale.write.resource_version is None else "patch"
                metrics.API_ERRORS.labels(kind=role_api.KIND, verb=verb).inc()
                hint = (" (is the DisaggregatedRole CRD installed? apply crds/ before upgrading the operator)"
                        if code == 404 and verb == "create" else "")
                out.error = out.error or f"{_VERBING[verb]} {role_api.KIND} {name}: {message}{hint}"
                out.code = out.code or code
                return kept(scale, live, memory), live
            now = live_role(stored)
            change = "created" if scale.write.resource_version is None else "updated"
            (out.created if change == "created" else out.updated).append(f"{role_api.KIND}/{name} ({scale.reason})")
            metrics.CHILD_WRITES.labels(kind=role_api.KIND, change=change).inc()
            self.log.info("%s/%s: %s %s: %s", namespace_of(cr), cr_name(cr), change, name, scale.reason)
            return scale, now
        out.error = out.error or f"updating {role_api.KIND} {name}: it kept changing under the operator"
        out.code = out.code or 409
        return kept(scale, live, memory), live

    async def _write(self, cr: api.DisaggregatedInference, scale: RoleScale) -> dict[str, Any]:
        write = scale.write
        assert write is not None
        ns, name = namespace_of(cr), names.role_object_name(cr_name(cr), scale.role)
        t0 = time.monotonic()
        try:
            if write.resource_version is None:
                created = await self.client.create(codecs.from_dict(role_object(cr, scale.role, write)),
                                                   field_manager=FIELD_MANAGER)
                return _dict(created)
            patched = await self.client.patch(RoleResource, name, role_update(cr, scale.role, write), namespace=ns,
                                              patch_type=PatchType.MERGE, field_manager=FIELD_MANAGER)
            return _dict(patched)
        finally:
            metrics.API_SECONDS.labels(verb="apply").observe(time.monotonic() - t0)

    async def _read(self, namespace: str, name: str) -> LiveRole | None:
        try:
            return live_role(_dict(await self.client.get(RoleResource, name, namespace=namespace)))
        except ApiError as e:
            if e.status.code == 404:
                return None
            raise

    async def publish(self, cr: api.DisaggregatedInference, sync: RoleSync,
                      revisions: list[api.RevisionStatus]) -> None:
        """Write each role object's status when it differs from the one it has. Best effort: a failure is logged,
        and the next pass writes it."""
        for role in ROLES:
            live = sync.live.get(role)
            if live is None:
                continue
            status = role_status(cr_name(cr), role, live.generation, revisions)
            if status == live.status:
                continue
            try:
                await self.client.patch(RoleResource.Status, live.name, {"status": status.dump()},
                                        namespace=namespace_of(cr), patch_type=PatchType.MERGE)
            except ApiError as e:
                if e.status.code != 404:  # deleted meanwhile: its recreation brings a status pass
                    metrics.API_ERRORS.labels(kind=role_api.KIND, verb="patch-status").inc()
                    self.log.warning("%s/%s: writing the status of %s failed: %s", namespace_of(cr), cr_name(cr),
                                     live.name, e.status.message)
                continue
            metrics.STATUS_WRITES.inc()

    def changed(self, namespace: str, body: Mapping[str, Any], deleted: bool) -> bool:
        """Whether a role object's watch event is news to the operator: deleted, or at a generation (a spec: a
        scale) it has not decided from. Our own status writes and the echoes of our own writes are not."""
        meta = body.get("metadata") or {}
        key = (namespace, str(meta.get("name") or ""))
        if deleted:
            self._seen.pop(key, None)
            return True
        return self._seen.get(key) != int(meta.get("generation") or 0)

    def forget(self, cr: Key) -> None:
        for role in ROLES:
            self._seen.pop((cr[0], names.role_object_name(cr[1], role)), None)


_VERBING = {"create": "creating", "patch": "updating"}


def _refused(e: Exception) -> tuple[int, str] | None:
    """(HTTP status, message) of a request the apiserver refused, or None for any other failure: an ApiError (the
    answer was a Status), or the plain HTTP error lightkube passes on when it was not (a 404 for a resource the
    apiserver does not serve: its CRD is not installed)."""
    if isinstance(e, ApiError):
        return e.status.code or e.response.status_code, e.status.message or ""
    response = getattr(e, "response", None)
    code = getattr(response, "status_code", None)
    if not isinstance(code, int):
        return None
    return code, str(getattr(response, "text", "") or "").strip() or f"HTTP {code}"


def _dict(obj: Any) -> dict[str, Any]:
    """A lightkube generic object as the plain dict the apiserver sent."""
    out: dict[str, Any] = obj.to_dict() if hasattr(obj, "to_dict") else dict(obj)
    return out
