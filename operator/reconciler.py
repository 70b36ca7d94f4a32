"""Apply a DisaggregatedInference's children and publish its status.

The reconciler is the executor: the builders decide *what* should exist (pure), this module makes the
cluster match with server-side apply under one field manager, and writes status only when it changed.
Hard bounds it enforces:
- every write is a server-side apply with force, so a hand-edited field we own is put back;
- a no-op pass writes nothing (SSA of an unchanged object is not persisted; status is compared first);
- one pass per CR at a time (controller/queue.py).
"""
from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lightkube import AsyncClient, codecs
from lightkube.core.exceptions import ApiError
from lightkube.core.resource import GlobalResource
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Secret, ServiceAccount
from lightkube.resources.rbac_authorization_v1 import ClusterRoleBinding
from lightkube.types import PatchType

from . import api, metrics, names
from .bindings import BindingCollector, DinfResource, live_cr
from .builders import OperatorImages, build_children, engine_statefulset
from .engine_builders import Pinned, pinned_revision
from .meta import FIELD_MANAGER, object_meta
from .meta import cr_name as meta_name
from .meta import namespace_of as meta_namespace
from .names import Key
from .plan import Applied, ApplyPlan, ChildKey, child_key, child_marker, digest, plan_children
from .rollout import revisions
from .rollout.state import RevisionState, Role, RoleState
from .rollout_executor import EventFn, RolloutExecutor, RolloutFailed, summary
from .scale_executor import RoleScaler
from .status import (
    TRANSPORT_VERIFIED,
    RolloutView,
    TransportReport,
    condition,
    transport_event,
)


@dataclass
class ApplyOutcome:
    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unchanged: int = 0
    gone: bool = False  # the CR was found deleted before the first write: nothing was applied


class StillThere:
    """Whether the CR still exists, asked of the apiserver at most once per pass and only before a write.

    The watch index can lag a deletion; a write then would recreate children the garbage collector is removing
    (owned by a deleted UID). A pass that writes nothing needs no answer, so it costs no request."""

    def __init__(self, ask: Callable[[], Awaitable[bool]]) -> None:
        self._ask = ask
        self._answer: bool | None = None

    async def __call__(self) -> bool:
        if self._answer is None:
            self._answer = await self._ask()
        return self._answer


def owner_of(child: Mapping[str, Any]) -> Key:
    """The CR a child belongs to, from its labels (a cluster-scoped child names its CR's namespace in one)."""
    meta = child.get("metadata") or {}
    labels = meta.get("labels") or {}
    return (str(meta.get("namespace") or labels.get(names.LABEL_CR_NAMESPACE) or ""),
            str(labels.get(names.LABEL_INSTANCE) or ""))


class Reconciler:
    def __init__(self, client: AsyncClient, images: OperatorImages, logger: logging.Logger | None = None,
                 namespaces: list[str] | tuple[str, ...] | None = None):
        self.client = client
        self.images = images
        # The namespaces this operator serves (None: all). It removes only rendezvous bindings of CRs in them.
        self.namespaces = set(namespaces) if namespaces else None
        self.log = logger or logging.getLogger("disagg.operator")
        # What our last apply of each child sent and produced: a later event with the same marker is our own echo.
        self.applied: dict[ChildKey, Applied] = {}
        self._drifted: set[ChildKey] = set()  # children the watch saw change under us since we applied them
        self._watched: dict[ChildKey, str] = {}  # the marker of the latest watch event of each live child
        # Applies under way, with the markers the watch showed meanwhile: under load the echo of a write can be
        # handled before the write's own response, and must not be taken for drift.
        self._in_flight: dict[ChildKey, list[str]] = {}
        self._drift_owners: set[Key] = set()  # CRs with a child found drifted after its apply returned
        self._verify: set[Key] = set()  # CRs whose next pass the resync asked to be thorough
        self._token_secrets: set[str] = set()  # CR uids whose token Secret is known to exist
        self.bindings = BindingCollector(client, self.namespaces, self.log)
        self._transport_status: dict[Key, str] = {}  # TransportVerified status last published per CR
        self._apply_errors: dict[Key, str] = {}  # CRs whose last full pass had a child refused, and why
        # (uid, resourceVersion, each running revision's plugin image) -> the revision and its images
        self._revisions: dict[Key, tuple[tuple[str, str, tuple[tuple[str, str], ...]], Pinned]] = {}
        self.rollout = RolloutExecutor(client, self._apply_recorded, self.log)
        self.scale = RoleScaler(client, self.log)

    # -- children ----------------------------------------------------------------------------------------
    def still_there(self, namespace: str, name: str) -> StillThere:
        return StillThere(lambda: self.exists(namespace, name))

    async def apply_children(self, cr: api.DisaggregatedInference, statefulsets: list[dict[str, Any]],
                             thorough: bool = False, still_there: StillThere | None = None) -> ApplyOutcome:
        """Apply every child, unless `still_there` finds the CR deleted before the first write (`gone`); remember a
        refusal (`apply_error`) until a later pass applies them all. `statefulsets`: the CR's engine StatefulSets
        as the watch shows them, for the revision (`revision`)."""
        key = (meta_namespace(cr), meta_name(cr))
        self._drift_owners.discard(key)  # this pass applies whatever drifted
        try:
            outcome = await self._apply_children(cr, self.revision(cr, statefulsets), thorough,
                                                 still_there or self.still_there(*key))
        except ApplyFailed as e:
            self._apply_errors[key] = str(e)
            raise
        self._apply_errors.pop(key, None)
        return outcome

    def apply_error(self, key: Key) -> str | None:
        """Why the last full pass of this CR could not apply a child (the apiserver's message), or None."""
        return self._apply_errors.get(key)

    async def _apply_children(self, cr: api.DisaggregatedInference, pinned: Pinned, thorough: bool,
                              still_there: StillThere) -> ApplyOutcome:
        outcome = ApplyOutcome()
        children = build_children(cr, images=pinned.images, statefulsets=False, revision=pinned.revision)
        plan = plan_children(children, self.applied, self._drifted, thorough, self._watched)
        token = cr.spec.rendezvous.auth == "token"
        if (plan.to_apply or (token and self.token_secret_unverified(cr, thorough))) and not await still_there():
            outcome.gone = True
            return outcome
        if token:
            if await self.ensure_token_secret(cr, verify=thorough):
                outcome.created.append(f"Secret/{names.rendezvous_token_secret(meta_name(cr))}")
            binding = names.rendezvous_binding_name(meta_namespace(cr), meta_name(cr))
            if ("ClusterRoleBinding", "", binding) in self.applied:  # switched from kubernetes: revoke it now
                await self.collect_bindings(only=(meta_namespace(cr), meta_name(cr)))
        await self._apply_plan(plan, outcome)
        return outcome

    async def _apply_plan(self, plan: ApplyPlan, outcome: ApplyOutcome) -> None:
        outcome.unchanged += plan.skipped
        for step in plan.to_apply:
            kind, ns, name = step.key
            before = self.applied.get(step.key)
            metrics.CHILD_APPLIES.labels(kind=kind, why=step.why).inc()
            t0 = time.monotonic()
            try:
                after_obj, created = await self._apply_recorded(step.obj)
            except ApiError as e:
                self._drifted.add(step.key)  # still to be applied
                metrics.API_ERRORS.labels(kind=kind, verb="apply").inc()
                hint = ""
                if e.status.code == 403 and kind in ("ServiceAccount", "ClusterRoleBinding"):
                    hint = (" (spec.rendezvous.auth: kubernetes needs the operator to create the rendezvous' "
                            f"ServiceAccount and bind it to {names.AUTH_DELEGATOR}: the chart's rbac.tokenReview; "
                            "or set spec.rendezvous.auth: token)")
                raise ApplyFailed(f"applying {kind} {f'{ns}/' if ns else ''}{name}: {e.status.message}{hint}",
                                  status_code(e)) from e
            finally:
                metrics.API_SECONDS.labels(verb="apply").observe(time.monotonic() - t0)
            after = child_marker(after_obj)
            if created:
                outcome.created.append(f"{kind}/{name}")
            elif before is not None and before.marker != after:
                outcome.updated.append(f"{kind}/{name}")
            else:
                outcome.unchanged += 1

    # -- the engines' rollout ------------------------------------------------------------------------------
    async def advance_rollout(self, cr: api.DisaggregatedInference, statefulsets: list[dict[str, Any]],
                              pods: list[dict[str, Any]], report: TransportReport | None, event: EventFn,
                              thorough: bool = False, still_there: StillThere | None = None,
                              desired: tuple[int, int] | None = None) -> RolloutView | None:
        """Observe the engines' revisions, repair the current revision's StatefulSets if they drifted, and take
        at most one rollout step (rollout_executor.py) toward `desired` (prefill, decode): the roles' counts
        (scale_executor.py). Returns None when `still_there` finds the CR deleted before a write. Raises
        ApplyFailed when a write is refused."""
        key = (meta_namespace(cr), meta_name(cr))
        still_there = still_there or self.still_there(*key)
        pinned = self.revision(cr, statefulsets)
        revision = pinned.revision
        advertised: dict[str, str] | None = None
        if cr.spec.advertises:
            advertised = {} if report is None or report.error else {
                e.engine: e.pod_uid for e in report.engines if e.pod_uid}
        policy = revisions.policy(cr.spec)
        observed, sets = revisions.observe(cr.spec, revision, statefulsets, pods, advertised, time.time(), policy,
                                           desired)

        def build(role: Role, replicas: int) -> dict[str, Any]:
            return engine_statefulset(cr, role, pinned.images, revision, replicas)

        try:
            if self.rollout.caught_up(key, statefulsets) and \
                    not await self._repair_current(key, sets, revision, build, thorough, still_there):
                return None
            result = await self.rollout.advance(key, observed, sets, policy, build, statefulsets, event, still_there)
        except RolloutFailed as e:
            raise ApplyFailed(str(e), e.code) from e
        reason, message = summary(result.plan)
        unlisted = any(o < state.live and o not in state.advertised
                       for r in observed.revisions for state in (r.prefill, r.decode) for o in state.ready)
        return RolloutView(reason, message, revision, tuple(_revision_status(r, revision) for r in observed.revisions),
                           unlisted)

    def revision(self, cr: api.DisaggregatedInference, statefulsets: list[dict[str, Any]]) -> Pinned:
        """The revision the spec asks for and the images its engines run, with the plugin image of a running
        revision the spec still renders to (engine_builders.pinned_revision). Rendered once per version of the CR
        (its uid and resourceVersion) and of what runs (each revision's plugin image), not once per pass: the
        builders are pure functions of these and the images."""
        key = (meta_namespace(cr), meta_name(cr))
        running = tuple(revisions.plugin_images(revisions.group(statefulsets)))
        version = (str(cr.metadata.get("uid") or ""), str(cr.metadata.get("resourceVersion") or ""), running)
        known = self._revisions.get(key)
        if known is not None and known[0] == version and version[1]:
            return known[1]
        pinned = pinned_revision(cr, self.images, running)
        self._revisions[key] = (version, pinned)
        return pinned

    async def _repair_current(self, key: Key, sets: list[revisions.RevisionSets], revision: str,
                              build: Callable[[Role, int], dict[str, Any]], thorough: bool,
                              still_there: StillThere) -> bool:
        """Apply the current revision's StatefulSets at the replicas they have when this process has not applied
        them yet, they changed under it, or on a thorough pass: the planner only writes them to change
        replicas. Returns False when the CR was found deleted before the first write."""
        current = next((r for r in sets if r.name == revision), None)
        if current is None:
            return True
        desired = [build(role, int((sts.get("spec") or {}).get("replicas") or 0))
                   for role, sts in current.statefulsets.items()]
        plan = plan_children(desired, self.applied, self._drifted, thorough, self._watched)
        if plan.to_apply and not await still_there():
            return False
        await self._apply_plan(plan, ApplyOutcome())
        for step in plan.to_apply:
            self.rollout.expect(key, step.key[2], self.applied[step.key].marker)
        return True

    def token_secret_unverified(self, cr: api.DisaggregatedInference, verify: bool) -> bool:
        """Whether `ensure_token_secret` would send a request."""
        return verify or cr.metadata.get("uid", "") not in self._token_secrets

    async def ensure_token_secret(self, cr: api.DisaggregatedInference, verify: bool) -> bool:
        """Create the rendezvous token Secret once. Not server-side applied: its value is random and must
        survive every later pass, so only its absence is repaired (checked on the first pass for a CR and on
        every resync, so ordinary passes cost no request). Returns whether it was created."""
        uid = cr.metadata.get("uid", "")
        if not self.token_secret_unverified(cr, verify):
            return False
        meta = object_meta(cr, names.rendezvous_token_secret(meta_name(cr)), names.RENDEZVOUS)
        secret = Secret(metadata=codecs.from_dict({"apiVersion": "v1", "kind": "Secret", "metadata": meta}).metadata,
                        type="Opaque", stringData={names.RENDEZVOUS_TOKEN_KEY: secrets.token_urlsafe(32)})
        try:
            await self.client.create(secret)
        except ApiError as e:
            if e.status.code != 409:
                metrics.API_ERRORS.labels(kind="Secret", verb="create").inc()
                raise ApplyFailed(f"creating Secret {meta['name']}: {e.status.message}", status_code(e)) from e
            self._token_secrets.add(uid)
            return False
        self._token_secrets.add(uid)
        return True

    async def collect_bindings(self, only: Key | None = None,
                               needed: frozenset[Key] | set[Key] = frozenset()) -> list[str]:
        """Delete the rendezvous ClusterRoleBindings no CR needs any more (bindings.BindingCollector.collect) and
        forget having applied them. Returns the names deleted."""
        deleted = await self.bindings.collect(only=only, needed=needed)
        for name in deleted:
            self.applied.pop(("ClusterRoleBinding", "", name), None)
        return deleted

    async def _apply_recorded(self, obj: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """`_apply`, remembered: a later plan skips the child while it is unchanged, and the watch's echo of this
        write is not taken for drift. The plan's applies and the rollout's both go through here."""
        key = child_key(obj)
        self._drifted.discard(key)  # before the write: a change seen while it is under way is still drift
        self._in_flight[key] = []
        try:
            stored, created = await self._apply(obj)
        finally:
            seen = self._in_flight.pop(key)
        marker = child_marker(stored)
        self.applied[key] = Applied(digest(obj), marker)
        # The watch is ordered: markers seen before our write's echo are older states our write replaced; one seen
        # after it is a change under us. (An echo not seen yet arrives later and is matched as usual.)
        if marker in seen and seen[-1] != marker:
            self._drifted.add(key)
            self._drift_owners.add(owner_of(obj))
        return stored, created

    async def _apply(self, obj: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """Server-side apply with force. Returns what the apiserver stored and whether this apply created it."""
        resource = codecs.from_dict(obj)
        try:
            return await self._server_side_apply(resource)
        except ApiError as e:
            if e.status.code != 422:
                raise
        # Server-side apply merges list entries by key, so an entry someone else added by hand survives our
        # apply and can make the result invalid (two Service ports named "http"). A JSON merge patch replaces
        # lists wholesale: it puts our lists back, then the apply takes ownership again.
        self.log.info("apply of %s %s was invalid; repairing hand-edited lists with a merge patch",
                      obj["kind"], obj["metadata"]["name"])
        name = obj["metadata"]["name"]
        if isinstance(resource, GlobalResource):  # a ClusterRoleBinding: no namespace
            await self.client.patch(type(resource), name, obj, patch_type=PatchType.MERGE, field_manager=FIELD_MANAGER)
        else:
            await self.client.patch(type(resource), name, obj, namespace=obj["metadata"].get("namespace"),
                                    patch_type=PatchType.MERGE, field_manager=FIELD_MANAGER)
        return await self._server_side_apply(resource)

    async def _server_side_apply(self, resource: Any) -> tuple[dict[str, Any], bool]:
        """lightkube's apply, on its generic client (same connection, same credentials), keeping the one thing
        lightkube drops: the status code. An apply that creates the object answers 201 Created. The stored object
        is returned as the apiserver sent it: lightkube's model of it would only be turned back into a dict."""
        generic = self.client._client
        request = generic.prepare_request(
            "patch", res=type(resource), obj=resource, name=resource.metadata.name,
            namespace=getattr(resource.metadata, "namespace", None),
            headers={"Content-Type": PatchType.APPLY.value}, params={"force": "true", "fieldManager": FIELD_MANAGER})
        # What generic.send does (it is unannotated), on the httpx client it wraps.
        response = await generic._client.send(generic.build_adapter_request(request))
        if response.is_error:
            generic.handle_response("patch", response, request)  # raises the ApiError lightkube would
        stored: dict[str, Any] = response.json()
        return stored, response.status_code == 201

    async def exists(self, namespace: str, name: str) -> bool:
        """Ask the apiserver, not the watch cache: a deletion may not have reached our index yet."""
        return await live_cr(self.client, namespace, name) is not None

    async def observe_unwatched(self) -> None:
        """List the children no watch shows (the rendezvous' ServiceAccounts and ClusterRoleBindings, auth
        kubernetes) and note what the listing shows of each, as a watch event would: a thorough pass then
        confirms them against the listing instead of applying each one. A child we applied that the listing
        lacks is noted as unseen, so the pass applies it; a listing refused (403) leaves the notes as they were."""
        selector: dict[str, Any] = {names.LABEL_MANAGED_BY: names.MANAGED_BY, names.LABEL_COMPONENT: names.RENDEZVOUS}

        async def accounts() -> list[ObjectMeta | None]:
            scopes = sorted(self.namespaces) if self.namespaces else ["*"]
            return [sa.metadata for ns in scopes
                    async for sa in self.client.list(ServiceAccount, namespace=ns, labels=selector)]

        async def bindings() -> list[ObjectMeta | None]:
            return [b.metadata async for b in self.client.list(ClusterRoleBinding, labels=selector)]

        for kind, listing in (("ServiceAccount", accounts), ("ClusterRoleBinding", bindings)):
            t0 = time.monotonic()
            try:
                metas = await listing()
            except ApiError as e:
                if e.status.code != 403:
                    metrics.API_ERRORS.labels(kind=kind, verb="list").inc()
                    raise
                continue
            finally:
                metrics.API_SECONDS.labels(verb="list").observe(time.monotonic() - t0)
            seen = {(kind, m.namespace or "", m.name): child_marker(
                {"metadata": {"generation": m.generation, "resourceVersion": m.resourceVersion}})
                for m in metas if m is not None and m.name}
            for key in [k for k in self._watched if k[0] == kind and k not in seen]:
                del self._watched[key]
            self._watched.update(seen)

    def is_own_echo(self, kind: str, body: Mapping[str, Any]) -> bool:
        """Whether a watch event on a child shows exactly what our last apply of it produced."""
        meta = body.get("metadata", {})
        last = self.applied.get((kind, meta.get("namespace") or "", meta.get("name", "")))
        return last is not None and last.marker == child_marker(body)

    def child_changed(self, kind: str, body: Mapping[str, Any], deleted: bool = False) -> bool:
        """Note a child's watch event. Returns whether it changed under us (deleted, or not our own echo); such a
        child is applied by the next full pass even though its manifest did not change."""
        meta = body.get("metadata", {})
        key = (kind, meta.get("namespace") or "", meta.get("name", ""))
        if deleted:
            self._watched.pop(key, None)
        else:
            marker = self._watched[key] = child_marker(body)
            if key in self._in_flight:  # judged when the apply returns (_apply_recorded)
                self._in_flight[key].append(marker)
                return False
            if self.is_own_echo(kind, body):
                return False
        self._drifted.add(key)
        return True

    def verify_next(self, key: Key) -> None:
        """Make the next full pass of this CR thorough (plan.py): the resync asked for it."""
        self._verify.add(key)

    def take_verify(self, key: Key) -> bool:
        """Whether this pass must be thorough; asking consumes the request."""
        asked = key in self._verify
        self._verify.discard(key)
        return asked

    def drift_pending(self, key: Key) -> bool:
        """Whether a child of this CR was found changed under us once its apply returned: the next pass of the CR
        must be a full one, whatever triggered it."""
        return key in self._drift_owners

    # -- status ------------------------------------------------------------------------------------------
    async def publish_status(self, cr: api.DisaggregatedInference, status: api.DisaggregatedInferenceStatus
                             ) -> api.DisaggregatedInferenceStatus | None:
        """Write `status` if it differs from the one stored in `cr`. Returns it, or None when the CR is gone."""
        meta = cr.metadata
        metrics.CONDITIONS.record(meta["namespace"], meta["name"], status.conditions)
        if status == cr.status:
            return status
        body = status.dump()
        # status.autoscaling is the autoscaling executor's to write: a pass carries it over only to compare, since
        # its copy, read before the executor's last write, may be older (it would undo that write). When
        # spec.autoscaling is gone the pass deletes it (a merge patch deletes a key only by null).
        body.pop("autoscaling", None)
        if status.autoscaling is None and cr.status is not None and cr.status.autoscaling is not None:
            body["autoscaling"] = None
        try:
            await self.client.patch(DinfResource.Status, meta["name"], {"status": body},
                                    namespace=meta["namespace"], patch_type=PatchType.MERGE)
        except ApiError as e:
            metrics.API_ERRORS.labels(kind=api.KIND, verb="patch-status").inc()
            if e.status.code == 404:  # deleted meanwhile
                metrics.CONDITIONS.forget(meta["namespace"], meta["name"])
                return None
            raise
        metrics.STATUS_WRITES.inc()
        return status

    def transport_event(self, key: Key, previous: api.DisaggregatedInferenceStatus | None,
                        status: api.DisaggregatedInferenceStatus) -> tuple[str, str, str] | None:
        """The Event for a TransportVerified transition, once per transition. What this process last published
        beats the status it read, which can lag our own write; after a restart the stored status is the memory."""
        cond = condition(status, TRANSPORT_VERIFIED)
        if cond is None:
            return None
        stored = condition(previous, TRANSPORT_VERIFIED)
        before = self._transport_status.get(key, stored.status if stored else None)
        self._transport_status[key] = cond.status
        return transport_event(before, cond)

    def forget(self, key: Key) -> None:
        metrics.CONDITIONS.forget(*key)
        self._transport_status.pop(key, None)
        self._revisions.pop(key, None)
        self._apply_errors.pop(key, None)
        self._drift_owners.discard(key)
        self._verify.discard(key)
        self.rollout.forget(key)
        self.scale.forget(key)


def _revision_status(rev: RevisionState, current: str) -> api.RevisionStatus:
    def role(state: RoleState) -> api.RevisionRoleStatus:
        return api.RevisionRoleStatus(replicas=state.replicas, ready=sum(1 for o in state.ready if o < state.live),
                                      advertised=state.serving)

    return api.RevisionStatus(name=rev.name, layout_key=rev.layout_key, current=rev.name == current,
                              prefill=role(rev.prefill), decode=role(rev.decode))


def status_code(e: ApiError) -> int:
    """The HTTP status of the apiserver's refusal. Status.code is optional in the API's schema (lightkube types it
    int | None); when the Status body lacks it, the response's own status line still has it."""
    return e.status.code if e.status.code is not None else e.response.status_code


class ApplyFailed(RuntimeError):
    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code
