"""One reconcile pass of a CR, top to bottom: `reconcile` makes the children match the spec and decides the status
and Events; `write` publishes them, in one place.

A pass, in order:
1. read the CR from the index; a deleted CR is forgotten (owner references make the garbage collector remove its
   children), an unparsable one gets an InvalidSpec Event and nothing else;
2. full passes (the CR changed, a child changed under us, a resync, a retry) apply every child but the engines'
   StatefulSets (reconciler.py);
3. every pass decides each role's count and writes the role objects (scale_executor.py), then takes at most one
   rollout step toward those counts (rollout_executor.py): engines becoming Ready or leaving move a rollout on;
4. the status is computed from what the indexes show (observe.py, status.py); `write` publishes it if it changed,
   then the role objects' status, then the Events.

A refused write is reported in the status (Degraded) and as an ApplyFailed Event, and a full pass is retried
after 10 s (60 s when forbidden). Before its first write a pass asks the apiserver once whether the CR still
exists (reconciler.StillThere): the index can lag a deletion.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Literal

import kopf

from .. import api, metrics
from ..builders import endpoint_url
from ..meta import utc_now
from ..names import Key
from ..reconciler import ApplyFailed, Reconciler
from ..scale_executor import RoleSync
from ..status import RolloutView, TransportReport, compute_status, transport_behind
from ..transport import TransportPoller
from . import events
from .events import Event, Poster
from .indexes import Indexes
from .observe import observe

Result = Literal["ok", "error", "invalid", "gone"]
log = logging.getLogger("disagg.operator")


@dataclass
class Wanted:
    """What a pass wants written: the status (None: nothing, the CR is gone or invalid), the role objects' status
    (with the revisions the rollout saw), and the Events, in the order they happened."""

    result: Result
    body: kopf.Body | None = None
    cr: api.DisaggregatedInference | None = None
    status: api.DisaggregatedInferenceStatus | None = None
    roles: RoleSync | None = None
    revisions: list[api.RevisionStatus] | None = None
    events: list[Event] = field(default_factory=list)
    failed: ApplyFailed | None = None


@dataclass(frozen=True)
class Parts:
    """What a pass acts through."""

    indexes: Indexes
    reconciler: Reconciler
    transports: TransportPoller
    poster: Poster


def _being_terminated(e: ApplyFailed) -> bool:
    """The namespace is going away with the CR in it: nothing to converge to."""
    return e.code == 403 and "being terminated" in str(e)


def _writes(verb: str, refs: list[str]) -> list[Event]:
    return [events.normal(verb.capitalize(), f"{verb} " + ", ".join(refs))] if refs else []


async def reconcile(p: Parts, key: Key, full: bool) -> Wanted:
    entry = p.indexes.entry(key)
    if entry is None or entry.deleting:
        p.transports.forget(key)
        p.reconciler.forget(key)
        return Wanted("gone")
    body, cr = entry.body, entry.cr
    thorough = p.reconciler.take_verify(key)
    full = full or thorough or p.reconciler.drift_pending(key)
    if cr is None:
        return Wanted("invalid", body, events=[events.warning("InvalidSpec", str(entry.error))])
    wanted = Wanted("ok", body, cr)
    still_there = p.reconciler.still_there(*key)

    if full:
        try:
            applied = await p.reconciler.apply_children(cr, p.indexes.statefulsets(key), thorough=thorough,
                                                        still_there=still_there)
        except ApplyFailed as e:
            if _being_terminated(e):
                return Wanted("gone")
            wanted.failed = e
        else:
            if applied.gone:
                return Wanted("gone")
            for ref in applied.created:
                metrics.CHILD_WRITES.labels(kind=ref.split("/")[0], change="created").inc()
            for ref in applied.updated:
                metrics.CHILD_WRITES.labels(kind=ref.split("/")[0], change="updated").inc()
            wanted.events += _writes("created", applied.created) + _writes("updated", applied.updated)

    report: TransportReport | None = None
    if cr.spec.advertises:
        p.transports.request(key)  # in the background, when the cached answer is old or missing
        report = p.transports.report(key)

    roles = await p.reconciler.scale.sync(cr, p.indexes.live_roles(key), still_there)
    if roles.gone:
        return Wanted("gone")
    wanted.roles = roles
    wanted.events += _writes("created", roles.created) + _writes("updated", roles.updated)

    statefulsets = p.indexes.statefulsets(key)
    engine_pods = p.indexes.engine_pods(key)
    rollout: RolloutView | None = None
    if wanted.failed is None:
        try:
            rollout = await p.reconciler.advance_rollout(
                cr, statefulsets, engine_pods, report, lambda *e: wanted.events.append(events.from_kind(*e)),
                thorough=thorough, still_there=still_there, desired=roles.desired())
        except ApplyFailed as e:
            if _being_terminated(e):
                return Wanted("gone")
            wanted.failed = e
        else:
            if rollout is None:
                return Wanted("gone")
            wanted.revisions = list(rollout.revisions)

    # A refused role object is reported like a refused child; only a full pass is retried for it (the rollout
    # moved anyway, on the counts the roles run). A refused child stays in Degraded (reconciler.apply_error) until
    # a full pass applies every child.
    if full and wanted.failed is None and roles.error is not None:
        wanted.failed = ApplyFailed(roles.error, roles.code)
    refusal = p.reconciler.apply_error(key) or (str(wanted.failed) if wanted.failed else None) or roles.error
    # (rendering both templates costs: the rollout's revision when it has one)
    revision = rollout.revision if rollout else p.reconciler.revision(cr, statefulsets).revision
    observed = observe(p.indexes, key, revision, statefulsets, report, refusal, rollout, engine_pods, roles.scales)
    # Read the rendezvous again now, not at the next poll, when it lags the pods: its answer, if it changed,
    # triggers a status pass (on_change), which is also what moves a rollout waiting for engines.
    behind = transport_behind(observed.prefill.ready + observed.decode.ready, report)
    if cr.spec.advertises and (behind or (rollout is not None and rollout.unlisted)):
        p.transports.request(key, force=True)
    wanted.status = compute_status(cr.spec, int(cr.metadata.get("generation", 0)), observed, endpoint_url(cr),
                                   cr.status, utc_now())
    if wanted.failed is not None:
        wanted.result = "error"
    return wanted


async def write(p: Parts, key: Key, wanted: Wanted) -> None:
    """Publish what a pass decided: the status if it changed, the role objects' status, then the Events (with the
    TransportVerified transition's, once per transition)."""
    if wanted.body is None:
        return
    out = list(wanted.events)
    if wanted.cr is not None and wanted.status is not None:
        written = await p.reconciler.publish_status(wanted.cr, wanted.status)
        if wanted.roles is not None and wanted.revisions is not None:
            await p.reconciler.scale.publish(wanted.cr, wanted.roles, wanted.revisions)
        transition = p.reconciler.transport_event(key, wanted.cr.status, written) if written is not None else None
        if transition is not None:
            out.append(events.from_kind(*transition))
    if wanted.failed is not None:
        out.append(Event("Error", "ApplyFailed", str(wanted.failed)))
    p.poster.post(wanted.body, out)


async def run_pass(p: Parts, key: Key, full: bool, trigger: str) -> float | None:
    """One pass and its writes, counted by trigger and result. Returns the seconds after which to retry it (a pass
    that had a write refused, or failed; a status pass that failed otherwise is not retried: the next event's is
    its retry), or None."""
    t0 = time.monotonic()
    try:
        wanted = await reconcile(p, key, full)
        await write(p, key, wanted)
    except Exception:  # an API error, a timeout: one CR's failure never stops the queue
        _count(trigger, "error")
        log.exception("pass of %s/%s (%s) failed", *key, trigger)
        return 10.0 if full else None
    if wanted.result != "gone":
        _count(trigger, wanted.result)
    if wanted.result == "invalid":
        log.error("%s/%s: invalid spec: %s", *key, wanted.events[0].message)
    if wanted.failed is None:
        if wanted.result == "ok":
            metrics.RECONCILE_SECONDS.observe(time.monotonic() - t0)
        return None
    delay = 10.0 if wanted.failed.code != 403 else 60.0
    log.warning("%s/%s: %s; retrying in %.0fs", *key, wanted.failed, delay)
    return delay


def _count(trigger: str, result: str) -> None:
    metrics.RECONCILES.labels(trigger=trigger, result=result).inc()
    if result == "error":
        metrics.RECONCILE_ERRORS.inc()
