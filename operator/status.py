"""Pure status computation: observed children in, the CR's status out.

Invariants:
- `Ready` is True only when every role has all desired replicas ready and updated in the current revision, no
  older revision runs engines, and the router is ready. A role's desired replicas are its DisaggregatedRole's
  count (`Observed.scales`, scale/counts.py), which spec.<role>.replicas sets only when it changes.
- `Progressing` is True (RollingOut) while the rollout moves, any role or the router is not settled; False with
  reason Blocked when the rollout cannot move (its message says why), False with reason Complete otherwise.
- `Degraded` is True, with the first of these that holds as its reason and the others named after its message:
  a pod that cannot start or keeps failing (it names the pod; prefill pods before decode pods, then the
  router's and rendezvous', then by name, whatever order they were observed in): a container that failed, a
  preflight check among them (`EngineFailed`, its one-line termination message copied here), one waiting in a
  crash loop or for an image it cannot pull (`CrashLoopBackOff`, `ImagePullBackOff`, `ErrImagePull`, ...: the
  kubelet's reason and message), a volume the kubelet cannot mount (`FailedMount`, the kubelet's Event);
  a child the apiserver refused (`ApplyFailed`, the apiserver's message); an
  engine StatefulSet whose pods cannot be created (`FailedCreate`, the controller's message); engine pods the
  scheduler cannot place (`Unschedulable`, their count and the scheduler's message); `TransportVerified` False:
  the deployment serves, but KV does not move over the transport asked for. Only engine pods' failures change
  `Ready` (Degraded means "not as requested"; missing pods keep `Ready` False by their counts anyway).
- `TransportVerified` compares the NIXL backend every advertised engine of the deployment reports (from its
  rendezvous) with the one requested (`spec.backend`): True when all match, False naming the engines that
  differ, Unknown while nothing is known (no engines yet, transport not reported yet, rendezvous unreachable,
  or a vendor connector without the plugin).
- A condition's lastTransitionTime changes only when its status changes, so an unchanged world yields an
  identical status and the operator writes nothing.
- `compute_status` returns the typed status (`api.DisaggregatedInferenceStatus`, the model the CRD's status
  schema is generated from), so what the operator writes always fits the schema; it compares that model with
  the stored one, parsed by the same model, and writes its `dump()` only when they differ.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .api import Condition, DisaggregatedInferenceSpec, DisaggregatedInferenceStatus, RevisionStatus, RoleStatus
from .scale.counts import RoleScale


@dataclass(frozen=True)
class WorkloadState:
    """What the operator reads from one StatefulSet or Deployment."""

    desired: int = 0
    replicas: int = 0  # pods created (a StatefulSet's status.replicas)
    ready: int = 0
    updated: int = 0
    observed_current: bool = True  # status.observedGeneration caught up with metadata.generation
    exists: bool = False
    uid: str = ""

    @property
    def settled(self) -> bool:
        return self.exists and self.observed_current and self.ready == self.desired == self.updated \
            and self.replicas == self.desired


@dataclass(frozen=True)
class PodProblem:
    pod: str
    role: str  # prefill or decode; for the router's and rendezvous' pods their component
    reason: str  # EngineFailed, a container's waiting reason (CrashLoopBackOff, ...), FailedMount or Unschedulable
    message: str


UNSCHEDULABLE = "Unschedulable"
ENGINE_FAILED = "EngineFailed"
FAILED_MOUNT = "FailedMount"
STUCK_WAITING = frozenset({"CrashLoopBackOff", "CreateContainerConfigError", "CreateContainerError",
                           "ImagePullBackOff", "ErrImagePull", "InvalidImageName"})
"""Waiting reasons of a container that will not start by itself: a crash loop, an image it cannot pull, a
container the runtime cannot create. (ContainerCreating and PodInitializing are a start under way.)"""
ENGINE_ROLES = ("prefill", "decode")
FAILED_CREATE = "FailedCreate"
SUCCESSFUL_CREATE = "SuccessfulCreate"
APPLY_FAILED = "ApplyFailed"


@dataclass(frozen=True)
class PodCreateEvent:
    """An Event the StatefulSet controller recorded on a StatefulSet when it created a pod, or failed to
    (`FailedCreate`: `create Pod <pod> in StatefulSet <sts> failed error: <the apiserver's refusal>`). StatefulSet
    status has no condition for a failed creation; these Events are the only record of it."""

    statefulset_uid: str
    reason: str  # FailedCreate or SuccessfulCreate
    message: str
    at: float  # when it last happened (seconds since the epoch)


@dataclass(frozen=True)
class CreateFailure:
    role: str
    message: str


@dataclass(frozen=True)
class EngineTransport:
    """One advertised engine's reported NIXL backend(s): "UCX", "LIBFABRIC", several joined by "+", or None."""

    engine: str  # its pod name, else its engine id
    role: str
    transport: str | None
    pod_uid: str | None = None  # its pod's UID, when it reports one


@dataclass(frozen=True)
class TransportReport:
    """The operator's last answer from a deployment's rendezvous: the engines advertised there, or why the
    rendezvous could not be read (`error`, a short stable text: the condition message must not churn)."""

    url: str
    engines: tuple[EngineTransport, ...] = ()
    error: str | None = None


def transport_behind(ready_engines: int, report: TransportReport | None) -> bool:
    """The rendezvous answer is older than what the pods show: more engines are Ready than it listed. Engines
    advertise before their API server is up, so by the time a pod is Ready a fresh read lists it; reading again
    then, instead of at the next periodic poll, keeps TransportVerified from lagging Ready by a poll interval."""
    return report is not None and report.error is None and len(report.engines) < ready_engines


ROLLING_OUT, BLOCKED, COMPLETE = "RollingOut", "Blocked", "Complete"


@dataclass(frozen=True)
class RolloutView:
    """The rollout as the executor last saw it: the Progressing reason it calls for (RollingOut, Blocked or
    Complete), why, and every revision still running."""

    reason: str
    message: str
    revision: str
    revisions: tuple[RevisionStatus, ...] = ()
    unlisted: bool = False  # some live, Ready engine is not advertised yet: the rendezvous answer may be old


@dataclass(frozen=True)
class Observed:
    """`prefill` and `decode` are the current revision's StatefulSets."""

    prefill: WorkloadState = field(default_factory=WorkloadState)
    decode: WorkloadState = field(default_factory=WorkloadState)
    router: WorkloadState = field(default_factory=WorkloadState)
    problems: tuple[PodProblem, ...] = ()
    transport: TransportReport | None = None  # None: the rendezvous has not been asked yet
    create_failures: tuple[CreateFailure, ...] = ()
    apply_error: str | None = None  # the apiserver's refusal of a child in the last full pass, if it failed
    rollout: RolloutView | None = None  # None: not observed in this pass (status keeps what it said)
    # What each role runs, from its DisaggregatedRole (scale/counts.py); a role missing here runs the count a new
    # deployment starts at.
    scales: Mapping[str, RoleScale] = field(default_factory=dict)


def workload_state(obj: dict[str, Any] | None) -> WorkloadState:
    if not obj:
        return WorkloadState()
    spec, st, meta = obj.get("spec", {}), obj.get("status", {}) or {}, obj.get("metadata", {})
    return WorkloadState(
        desired=int(spec.get("replicas", 1) if spec.get("replicas") is not None else 1),
        replicas=int(st.get("replicas", 0) or 0),
        ready=int(st.get("readyReplicas", 0) or 0),
        updated=int(st.get("updatedReplicas", 0) or 0),
        observed_current=int(st.get("observedGeneration", 0) or 0) >= int(meta.get("generation", 0) or 0),
        exists=True,
        uid=str(meta.get("uid") or ""),
    )


def create_failure(state: WorkloadState, events: list[PodCreateEvent] | tuple[PodCreateEvent, ...]) -> str | None:
    """The StatefulSet controller's message when it is failing to create this StatefulSet's pods now, else None.

    Failing now: the StatefulSet has fewer pods than it wants, and its latest FailedCreate Event is no older than
    its latest SuccessfulCreate (Event times have one-second resolution: a tie counts as failing, as the pod that
    failed is still missing). Events of an earlier StatefulSet of the same name (another UID) do not count."""
    if not state.exists or state.replicas >= state.desired:
        return None
    own = [e for e in events if e.statefulset_uid == state.uid]
    failed = max((e for e in own if e.reason == FAILED_CREATE), key=lambda e: e.at, default=None)
    created = max((e for e in own if e.reason == SUCCESSFUL_CREATE), key=lambda e: e.at, default=None)
    if failed is None or (created is not None and created.at > failed.at):
        return None
    return failed.message


def _role(pod: dict[str, Any]) -> str:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return str(labels.get("serving.disagg.io/role") or labels.get("app.kubernetes.io/component") or "?")


def _one_line(text: str) -> str:
    return " ".join(text.strip().splitlines()[0].split()) if text.strip() else ""


def pod_problems(pod: dict[str, Any]) -> list[PodProblem]:
    """What keeps a pod from serving, from its status alone (a FailedMount is an Event: `mount_failure`):
    - a container (an init container, such as the plugin's, too) that failed: its non-zero termination, now or the
      last one, with its termination message (a preflight's one-line reason), unless it runs and is ready again
      (a crash long ago is history) or, an init container, completed since;
    - a container waiting for good: a crash loop, an image it cannot pull, one the runtime cannot create
      (STUCK_WAITING), with the kubelet's message;
    - a pod the scheduler cannot place: its condition PodScheduled False, reason Unschedulable, with the
      scheduler's message.
    Init containers first, then the pod's containers; a container not named `engine` is named in the message."""
    name = pod.get("metadata", {}).get("name", "?")
    role = _role(pod)
    status = pod.get("status", {}) or {}
    out = []
    for c in status.get("conditions", []) or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == UNSCHEDULABLE:
            out.append(PodProblem(name, role, UNSCHEDULABLE, " ".join((c.get("message") or UNSCHEDULABLE).split())))
    for kind, key in (("init container", "initContainerStatuses"), ("container", "containerStatuses")):
        for cs in status.get(key, []) or []:
            state, last = cs.get("state", {}) or {}, cs.get("lastState", {}) or {}
            done = state.get("terminated") or {}
            if ("running" in state and cs.get("ready")) or (done and done.get("exitCode", 0) == 0):
                continue
            # The termination message (the preflight's one-line reason) beats the generic waiting reason that a
            # crash-looping container shows meanwhile.
            term = next((st["terminated"] for st in (state, last) if st.get("terminated")
                         and st["terminated"].get("exitCode", 0) != 0), None)
            waiting = (state.get("waiting") or {}).get("reason")
            where = "" if cs.get("name") in ("engine", None) else f"{kind} {cs['name']}: "
            if term:
                msg = _one_line(term.get("message") or term.get("reason") or f"exit code {term.get('exitCode')}")
                out.append(PodProblem(name, role, ENGINE_FAILED, where + (msg or "failed")))
            elif waiting in STUCK_WAITING:
                msg = _one_line(state["waiting"].get("message") or "") or waiting
                out.append(PodProblem(name, role, waiting, where + msg))
    return out


@dataclass(frozen=True)
class PodEvent:
    """An Event the kubelet recorded on a pod for what its status does not show: a volume it cannot mount
    (`FailedMount`, e.g. `MountVolume.SetUp failed for volume "models" : ...`)."""

    pod_uid: str
    reason: str
    message: str
    at: float  # when it last happened (seconds since the epoch)


def _started(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    return any(st.get("running") or st.get("terminated")
               for cs in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]
               for st in (cs.get("state") or {}, cs.get("lastState") or {}))


def mount_failure(pod: dict[str, Any], events: list[PodEvent] | tuple[PodEvent, ...]) -> PodProblem | None:
    """The pod's FailedMount while it holds, else None: the latest FailedMount Event of this pod (by UID: not
    an earlier pod of the same name) while no container of the pod has started, now or before (the kubelet
    mounts every volume before it starts the first init container) and the pod is not being deleted."""
    meta = pod.get("metadata") or {}
    if meta.get("deletionTimestamp") or _started(pod):
        return None
    own = [e for e in events if e.reason == FAILED_MOUNT and e.pod_uid == meta.get("uid")]
    latest = max(own, key=lambda e: e.at, default=None)
    if latest is None:
        return None
    return PodProblem(str(meta.get("name", "?")), _role(pod), FAILED_MOUNT, _one_line(latest.message) or FAILED_MOUNT)


def _cond(ctype: str, ok: bool | str, reason: str, message: str, generation: int,
          previous: dict[str, Condition], now: str) -> Condition:
    status = ok if isinstance(ok, str) else ("True" if ok else "False")
    prev = previous.get(ctype)
    since = prev.last_transition_time if prev and prev.status == status and prev.last_transition_time else now
    return Condition(type=ctype, status=status, reason=reason, message=message, last_transition_time=since,
                     observed_generation=generation)


def condition(status: DisaggregatedInferenceStatus | None, ctype: str) -> Condition | None:
    return next((c for c in status.conditions if c.type == ctype), None) if status else None


def ready_may_flip(published: DisaggregatedInferenceStatus | None, engines: list[WorkloadState],
                   router: WorkloadState | None) -> bool:
    """Whether a status pass now may turn the CR Ready, or not Ready: its engine workloads (every revision's) and
    its router (None: it has none) are all settled while the published Ready is not True, or the reverse. A hint
    for the order of passes (slots.Slots), never for what status says: it ignores the spec's replica counts,
    failures and the rollout, which compute_status weighs."""
    settled = bool(engines) and all(e.settled for e in engines) and (router is None or router.settled)
    ready = condition(published, "Ready")
    return settled != (ready is not None and ready.status == "True")


TRANSPORT_VERIFIED = "TransportVerified"
MAX_NAMED_ENGINES = 4


def _engines(items: list[EngineTransport]) -> str:
    names = sorted(e.engine for e in items)
    shown = ", ".join(names[:MAX_NAMED_ENGINES])
    more = f" and {len(names) - MAX_NAMED_ENGINES} more" if len(names) > MAX_NAMED_ENGINES else ""
    return f"engine{'s' if len(names) > 1 else ''} {shown}{more}"


def backends_of(transport: str) -> frozenset[str]:
    """The set of backends in an advertised transport ("UCX", "LIBFABRIC+UCX", ...), case as reported."""
    return frozenset(t for t in transport.split("+") if t)


def transport_verdict(spec: DisaggregatedInferenceSpec, report: TransportReport | None) -> tuple[str, str, str]:
    """(status, reason, message) of the TransportVerified condition. Pure: the report is what the operator last
    read from the deployment's rendezvous.

    An engine matches when the backends it reports are exactly the requested one (`spec.backend`): an engine
    that also runs another backend may move KV over that one. Any mismatch makes the condition False; else
    any engine not reporting yet makes it Unknown; True needs at least one engine, all matching."""
    expected = spec.backend
    if not spec.advertises:
        return ("Unknown", "PluginNotUsed", f"connector {spec.connector} is not one the disagg plugin wraps, so its "
                "engines do not report their transport")
    if report is None:
        return "Unknown", "AwaitingRendezvous", "the deployment's rendezvous has not been asked yet"
    if report.error is not None:
        return ("Unknown", "RendezvousUnreachable",
                f"cannot read the engines' transport from the rendezvous at {report.url}: {report.error}")
    if not report.engines:
        return ("Unknown", "NoEnginesReported",
                f"no engine of this deployment is advertised in its rendezvous yet (requested {expected})")
    by_transport: dict[str, list[EngineTransport]] = {}
    unreported: list[EngineTransport] = []
    for e in report.engines:
        if e.transport is None or not backends_of(e.transport):
            unreported.append(e)
        elif backends_of(e.transport) != {expected}:
            by_transport.setdefault(e.transport, []).append(e)
    if by_transport:
        parts = []
        for transport, engines in sorted(by_transport.items()):
            verb = "reports" if len(engines) == 1 else "report"
            part = f"{_engines(engines)} {verb} {transport}, but {expected} was requested"
            got = backends_of(transport)
            if expected == "LIBFABRIC" and "LIBFABRIC" not in got and "UCX" in got:
                part += (": KV moves over TCP instead of EFA (NIXL falls back to UCX silently when its LIBFABRIC "
                         "backend cannot start)")
            elif expected in got:
                part += f": KV may move over {'+'.join(sorted(got - {expected}))} instead"
            parts.append(part)
        return "False", "TransportMismatch", "; ".join(parts)
    if unreported:
        return ("Unknown", "TransportNotReported",
                f"{_engines(unreported)} {'has' if len(unreported) == 1 else 'have'} not reported a transport yet "
                f"(requested {expected})")
    n = len(report.engines)
    return ("True", "TransportMatches",
            f"{'the' if n == 1 else f'all {n}'} advertised engine{'s' if n > 1 else ''} report{'s' if n == 1 else ''} "
            f"{expected}, as requested")


def transport_event(before: str | None, after: Condition) -> tuple[str, str, str] | None:
    """The Event to record when TransportVerified goes from status `before` to `after`: a Warning on every
    transition to False, a Normal event on every transition to True, nothing otherwise (Unknown is no news)."""
    if after.status == before or after.status == "Unknown":
        return None
    return ("Warning" if after.status == "False" else "Normal"), after.reason, after.message


def degradations(observed: Observed, failures: list[PodProblem]) -> list[tuple[str, str]]:
    """(reason, message) of everything that makes the deployment Degraded apart from its transport, most
    severe first: engine failures, a refused child, pods that cannot be created, pods that cannot be placed."""
    out = []
    if failures:
        p = failures[0]
        more = f" (+{len(failures) - 1} more)" if len(failures) > 1 else ""
        out.append((p.reason, f"{p.role} pod {p.pod}: {p.message}{more}"))
    if observed.apply_error:
        out.append((APPLY_FAILED, observed.apply_error))
    if observed.create_failures:
        roles = " and ".join(f.role for f in observed.create_failures)
        several = len(observed.create_failures) > 1
        out.append((FAILED_CREATE, f"the {roles} StatefulSet{'s' if several else ''} cannot create "
                                   f"{'their' if several else 'its'} pods: {observed.create_failures[0].message}"))
    unschedulable = sorted((p for p in observed.problems if p.reason == UNSCHEDULABLE), key=lambda p: p.pod)
    if unschedulable:
        n = len(unschedulable)
        per_role = ", ".join(f"{sum(p.role == r for p in unschedulable)} {r}" for r in ("prefill", "decode")
                             if any(p.role == r for p in unschedulable))
        first = unschedulable[0]
        out.append((UNSCHEDULABLE, f"{n} engine pod{'s' if n > 1 else ''} cannot be scheduled ({per_role}); "
                                   f"{first.pod}: {first.message}"))
    return out


def compute_status(spec: DisaggregatedInferenceSpec, generation: int, observed: Observed, endpoint: str,
                   previous: DisaggregatedInferenceStatus | None, now: str) -> DisaggregatedInferenceStatus:
    prev_conds = {c.type: c for c in previous.conditions} if previous else {}
    def desired(role: str) -> int:
        scale = observed.scales.get(role)
        return scale.desired if scale else (spec.prefill if role == "prefill" else spec.decode).initial_replicas

    roles = {"prefill": (desired("prefill"), observed.prefill), "decode": (desired("decode"), observed.decode)}

    pending = []
    for role, (want, st) in roles.items():
        if not st.exists:
            pending.append(f"{role} StatefulSet not created yet")
        elif not st.settled or st.desired != want:
            pending.append(f"{role} {st.ready}/{want} ready, {st.updated} updated")
    if spec.router.replicas and not observed.router.settled:
        pending.append(f"router {observed.router.ready}/{spec.router.replicas} ready")
    rollout = observed.rollout
    for rev in rollout.revisions if rollout else ():
        if not rev.current and (rev.prefill.replicas or rev.decode.replicas):
            pending.append(f"revision {rev.name} still runs {rev.prefill.replicas}P{rev.decode.replicas}D")
    # Ready is about pods; the rollout's own progress (engines advertised, drains) is what Progressing adds.
    moving = list(pending)
    if rollout is not None and rollout.reason != COMPLETE:
        moving.append(f"rollout: {rollout.message}")

    t_status, t_reason, t_message = transport_verdict(spec, observed.transport)
    transport = _cond(TRANSPORT_VERIFIED, t_status, t_reason, t_message, generation, prev_conds, now)
    # Ordered by role, then pod, not as the watch delivered them: the message must not change between passes
    # (each change is a status write) only because the pods' events arrived in another order.
    failures = sorted((p for p in observed.problems if p.reason != UNSCHEDULABLE),
                      key=lambda p: (p.role != "prefill", p.role, p.pod))
    findings = degradations(observed, failures)
    if t_status == "False":
        findings.append((t_reason, t_message))
    if findings:
        reason, message = findings[0]
        if len(findings) > 1:
            message += f" (also: {', '.join(r for r, _ in findings[1:])})"
        degraded = _cond("Degraded", True, reason, message, generation, prev_conds, now)
    else:
        degraded = _cond("Degraded", False, "AsExpected", "no engine failures observed", generation, prev_conds, now)
    if rollout is not None and rollout.reason == BLOCKED:
        progressing = _cond("Progressing", False, BLOCKED, rollout.message, generation, prev_conds, now)
    else:
        progressing = _cond("Progressing", bool(moving), ROLLING_OUT if moving else COMPLETE,
                            "; ".join(moving) if moving else "all replicas updated and ready", generation,
                            prev_conds, now)
    # A router or rendezvous pod that fails (an upgrade to an image it cannot pull) is Degraded, not an engine
    # failure: Ready follows the router's counts, and the old router pod serves meanwhile.
    engine_failed = any(p.role in ENGINE_ROLES for p in failures)
    ready_ok = not pending and not engine_failed
    ready = _cond("Ready", ready_ok, "AllReplicasReady" if ready_ok else (ENGINE_FAILED if engine_failed
                                                                         else "ReplicasNotReady"),
                  f"serving {spec.served_name} at {endpoint}" if ready_ok else
                  (findings[0][1] if engine_failed else "; ".join(pending)), generation, prev_conds, now)

    def role_status(role: str) -> RoleStatus:
        want, st = roles[role]
        scale = observed.scales.get(role)
        return RoleStatus(desired=want, ready=st.ready, updated=st.updated,
                          spec_replicas=scale.spec_replicas if scale else None)

    return DisaggregatedInferenceStatus(
        observed_generation=generation,
        conditions=[ready, progressing, degraded, transport],
        prefill=role_status("prefill"),
        decode=role_status("decode"),
        prefill_ready=f"{observed.prefill.ready}/{roles['prefill'][0]}",
        decode_ready=f"{observed.decode.ready}/{roles['decode'][0]}",
        endpoint=endpoint,
        connector=spec.connector,
        backend=spec.backend,
        mode=spec.kv_transfer.mode,
        revision=rollout.revision if rollout else (previous.revision if previous else None),
        revisions=list(rollout.revisions) if rollout else (list(previous.revisions) if previous else []),
        rollout=progressing.reason,
        # The autoscaling executor writes its own part; a pass keeps it while spec.autoscaling is set.
        autoscaling=previous.autoscaling if previous is not None and spec.autoscaling is not None else None,
    )
