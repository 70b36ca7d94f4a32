"""The pure status function: the invariants the reconciler relies on."""
from __future__ import annotations

import pytest

from disagg.operator.api import (
    AutoscalingSpec,
    AutoscalingStatus,
    Condition,
    DisaggregatedInferenceSpec,
    DisaggregatedInferenceStatus,
    RoleAutoscalingStatus,
    RoleStatus,
)
from disagg.operator.builders import OperatorImages
from disagg.operator.reconciler import Reconciler
from disagg.operator.scale.counts import RoleScale
from disagg.operator.status import (
    CreateFailure,
    EngineTransport,
    Observed,
    PodCreateEvent,
    PodEvent,
    PodProblem,
    TransportReport,
    WorkloadState,
    compute_status,
    condition,
    create_failure,
    mount_failure,
    pod_problems,
    ready_may_flip,
    transport_event,
    transport_verdict,
    workload_state,
)

SPEC = DisaggregatedInferenceSpec.model_validate({"model": {"name": "m"}, "accelerator": {"profile": "nvidia-h200"},
                                                  "prefill": {"replicas": 2}})
SETTLED = Observed(prefill=WorkloadState(2, 2, 2, 2, True, True), decode=WorkloadState(1, 1, 1, 1, True, True),
                   router=WorkloadState(1, 1, 1, 1, True, True))


def conds(status):
    """The typed status's conditions by type, as the dicts the apiserver stores."""
    return {c.type: c.dump() for c in status.conditions}


def test_ready_only_when_every_role_and_router_settled():
    ok = compute_status(SPEC, 3, SETTLED, "http://e", None, "t1")
    assert conds(ok)["Ready"]["status"] == "True" and conds(ok)["Progressing"]["status"] == "False"
    assert ok.prefill == RoleStatus(desired=2, ready=2, updated=2) and ok.prefill_ready == "2/2"
    assert ok.observed_generation == 3 and ok.connector == "NixlPushConnector" and ok.backend == "LIBFABRIC"
    assert ok.dump()["prefill"] == {"desired": 2, "ready": 2, "updated": 2} and ok.dump()["prefillReady"] == "2/2"
    half = Observed(prefill=WorkloadState(2, 2, 1, 2, True, True), decode=SETTLED.decode, router=SETTLED.router)
    st = compute_status(SPEC, 3, half, "http://e", None, "t1")
    assert conds(st)["Ready"]["status"] == "False"
    assert "prefill 1/2 ready" in conds(st)["Progressing"]["message"]
    missing = compute_status(SPEC, 3, Observed(), "http://e", None, "t1")
    assert "not created yet" in conds(missing)["Ready"]["message"]


def test_each_role_is_desired_at_its_role_objects_count_not_the_specs():
    """spec.prefill.replicas says 2; /scale set prefill's role object to 3 (scale/counts.py decided it)."""
    scales = {"prefill": RoleScale("prefill", 3, 2), "decode": RoleScale("decode", 1, None)}
    short = Observed(prefill=SETTLED.prefill, decode=SETTLED.decode, router=SETTLED.router, scales=scales)
    st = compute_status(SPEC, 3, short, "e", None, "t")
    assert st.prefill == RoleStatus(desired=3, ready=2, updated=2, spec_replicas=2) and st.prefill_ready == "2/3"
    assert st.decode.spec_replicas is None and st.decode_ready == "1/1"
    assert conds(st)["Ready"]["status"] == "False" and "prefill 2/3 ready" in conds(st)["Ready"]["message"]
    grown = Observed(prefill=WorkloadState(3, 3, 3, 3, True, True), decode=SETTLED.decode, router=SETTLED.router,
                     scales=scales)
    assert conds(compute_status(SPEC, 3, grown, "e", None, "t"))["Ready"]["status"] == "True"


def test_stale_observed_generation_is_not_settled():
    stale = Observed(prefill=WorkloadState(2, 2, 2, 2, False, True), decode=SETTLED.decode, router=SETTLED.router)
    assert conds(compute_status(SPEC, 1, stale, "e", None, "t"))["Ready"]["status"] == "False"


def test_unchanged_world_gives_identical_status():
    first = compute_status(SPEC, 1, SETTLED, "e", None, "t1")
    again = compute_status(SPEC, 1, SETTLED, "e", first, "t2")
    assert again == first, "lastTransitionTime moves only when a condition's status changes"
    broken = Observed(prefill=SETTLED.prefill, decode=SETTLED.decode, router=SETTLED.router,
                      problems=(PodProblem("p-0", "prefill", "EngineFailed", "no EFA"),))
    changed = compute_status(SPEC, 1, broken, "e", first, "t3")
    assert conds(changed)["Degraded"]["lastTransitionTime"] == "t3"
    assert conds(changed)["Degraded"]["message"] == "prefill pod p-0: no EFA"
    assert conds(changed)["Progressing"]["lastTransitionTime"] == "t1"


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 1, 0), (1, 2, 0)])
def test_failed_engines_are_named_prefill_first_whatever_order_they_were_observed_in(order):
    """The watch delivers pods' events in any order; the Degraded message must not change with it."""
    found = [PodProblem("m-decode-0", "decode", "EngineFailed", "no shm"),
             PodProblem("m-prefill-1", "prefill", "EngineFailed", "no shm"),
             PodProblem("m-prefill-0", "prefill", "EngineFailed", "no EFA")]
    broken = Observed(prefill=SETTLED.prefill, decode=SETTLED.decode, router=SETTLED.router,
                      problems=tuple(found[i] for i in order))
    assert conds(compute_status(SPEC, 1, broken, "e", None, "t"))["Degraded"]["message"] == \
        "prefill pod m-prefill-0: no EFA (+2 more)"


def test_termination_message_beats_crashloop_reason():
    pod = {"metadata": {"name": "x-0", "labels": {"serving.disagg.io/role": "decode"}},
           "status": {"containerStatuses": [{
               "state": {"waiting": {"reason": "CrashLoopBackOff"}},
               "lastState": {"terminated": {"exitCode": 1, "message": "preflight: no EFA\nmore"}}}]}}
    assert pod_problems(pod) == [PodProblem("x-0", "decode", "EngineFailed", "preflight: no EFA")]
    healthy = {"metadata": {"name": "y"}, "status": {"containerStatuses": [{"state": {"running": {}}}]}}
    assert pod_problems(healthy) == []


def test_workload_state_reads_statefulset_status():
    st = workload_state({"metadata": {"generation": 4}, "spec": {"replicas": 3},
                         "status": {"observedGeneration": 4, "replicas": 3, "readyReplicas": 2, "updatedReplicas": 3}})
    assert st == WorkloadState(3, 3, 2, 3, True, True) and not st.settled


def test_a_pass_is_urgent_when_the_children_settled_and_ready_disagree():
    settled, starting = WorkloadState(1, 1, 1, 1, True, True), WorkloadState(1, 1, 0, 1, True, True)
    ready = DisaggregatedInferenceStatus(conditions=[Condition(type="Ready", status="True", reason="r")])
    not_ready = DisaggregatedInferenceStatus(conditions=[Condition(type="Ready", status="False", reason="r")])
    assert ready_may_flip(not_ready, [settled, settled], settled)  # will turn Ready
    assert ready_may_flip(None, [settled, settled], None)  # no status yet, no router wanted
    assert ready_may_flip(ready, [settled, starting], settled)  # an engine went away: will turn not Ready
    assert not ready_may_flip(not_ready, [settled, starting], settled)  # still coming up: progress only
    assert not ready_may_flip(not_ready, [settled, settled], WorkloadState())  # its router is not there yet
    assert not ready_may_flip(ready, [settled, settled], settled)  # nothing to tell
    assert not ready_may_flip(None, [], None)  # no engine workload exists yet


# ---- TransportVerified -------------------------------------------------------------------------------------
EFA_SPEC = SPEC  # nvidia-h200 with efa auto: LIBFABRIC requested
TCP_SPEC = DisaggregatedInferenceSpec.model_validate({"model": {"name": "m"}, "accelerator": {
    "profile": "nvidia-h200", "efa": "off"}})
URL = "http://127.0.0.1:9/"


def report(*engines: tuple[str, str, str | None]) -> TransportReport:
    return TransportReport(url=URL, engines=tuple(EngineTransport(n, r, t) for n, r, t in engines))


def with_transport(rep: TransportReport | None) -> Observed:
    return Observed(prefill=SETTLED.prefill, decode=SETTLED.decode, router=SETTLED.router, transport=rep)


def test_libfabric_requested_ucx_reported_is_a_mismatch_that_says_tcp():
    assert EFA_SPEC.backend == "LIBFABRIC"
    st = compute_status(EFA_SPEC, 1, with_transport(report(("m-prefill-0", "prefill", "UCX"),
                                                            ("m-decode-0", "decode", "UCX"))), "e", None, "t1")
    t = conds(st)["TransportVerified"]
    assert (t["status"], t["reason"]) == ("False", "TransportMismatch")
    assert t["message"].startswith("engines m-decode-0, m-prefill-0 report UCX, but LIBFABRIC was requested")
    assert "KV moves over TCP instead of EFA" in t["message"]
    # Serving still works, only not as requested: Degraded says so, Ready does not change.
    assert conds(st)["Degraded"]["status"] == "True" and conds(st)["Degraded"]["reason"] == "TransportMismatch"
    assert conds(st)["Degraded"]["message"] == t["message"]
    assert conds(st)["Ready"]["status"] == "True"


def test_every_engine_reporting_the_requested_backend_verifies():
    st = compute_status(EFA_SPEC, 1, with_transport(report(("a-0", "prefill", "LIBFABRIC"),
                                                            ("b-0", "decode", "LIBFABRIC"))), "e", None, "t1")
    t = conds(st)["TransportVerified"]
    assert (t["status"], t["reason"]) == ("True", "TransportMatches")
    assert t["message"] == "all 2 advertised engines report LIBFABRIC, as requested"
    assert conds(st)["Degraded"]["status"] == "False"
    tcp = transport_verdict(TCP_SPEC, report(("a-0", "prefill", "UCX")))
    assert tcp == ("True", "TransportMatches", "the advertised engine reports UCX, as requested")


def test_mismatch_messages_group_engines_by_what_they_report():
    status, reason, message = transport_verdict(TCP_SPEC, report(("a-0", "prefill", "LIBFABRIC"),
                                                                 ("b-0", "decode", "UCX")))
    assert (status, reason) == ("False", "TransportMismatch")
    assert message == "engine a-0 reports LIBFABRIC, but UCX was requested", "the TCP warning is for EFA only"
    # Exactly the requested backend: an engine that also runs another may move KV over that one.
    _, _, extra = transport_verdict(EFA_SPEC, report(("a-0", "prefill", "UCX+LIBFABRIC")))
    assert extra == "engine a-0 reports UCX+LIBFABRIC, but LIBFABRIC was requested: KV may move over UCX instead"
    many = [(f"p-{i}", "prefill", "UCX") for i in range(6)] + [("d-0", "decode", "LIBFABRIC"), ("d-1", "decode", None)]
    status, _, message = transport_verdict(EFA_SPEC, report(*many))
    assert status == "False", "a mismatch outweighs engines that have not reported"
    assert message.startswith("engines p-0, p-1, p-2, p-3 and 2 more report UCX, but LIBFABRIC was requested")


def test_transport_unknown_until_something_is_known():
    def verdict(spec, rep):
        return transport_verdict(spec, rep)[:2]

    assert verdict(EFA_SPEC, None) == ("Unknown", "AwaitingRendezvous")
    unreachable = TransportReport(url=URL, error="connection failed")
    status, reason, message = transport_verdict(EFA_SPEC, unreachable)
    assert (status, reason) == ("Unknown", "RendezvousUnreachable")
    assert URL in message and "connection failed" in message
    assert verdict(EFA_SPEC, report()) == ("Unknown", "NoEnginesReported")
    status, reason, message = transport_verdict(EFA_SPEC, report(("a-0", "prefill", "LIBFABRIC"),
                                                                 ("b-0", "decode", None)))
    assert (status, reason) == ("Unknown", "TransportNotReported")
    assert message == "engine b-0 has not reported a transport yet (requested LIBFABRIC)"
    vendor = DisaggregatedInferenceSpec.model_validate({"model": {"name": "m"}, "accelerator": {"profile": "trainium2"},
                                                        "kvTransfer": {"mode": "pull",
                                                                       "connector": "NeuronNixlConnector"}})
    assert verdict(vendor, report(("a-0", "prefill", "UCX"))) == ("Unknown", "PluginNotUsed")
    st = compute_status(EFA_SPEC, 1, with_transport(unreachable), "e", None, "t")
    assert conds(st)["Degraded"]["status"] == "False", "not knowing is not degraded"


def test_transport_condition_is_stable_and_events_fire_once_per_transition():
    ucx = with_transport(report(("a-0", "prefill", "UCX")))
    first = compute_status(EFA_SPEC, 1, ucx, "e", None, "t1")
    assert compute_status(EFA_SPEC, 1, ucx, "e", first, "t2") == first
    fixed = compute_status(EFA_SPEC, 1, with_transport(report(("a-0", "prefill", "LIBFABRIC"))), "e", first, "t3")
    assert conds(fixed)["TransportVerified"]["lastTransitionTime"] == "t3"
    assert conds(fixed)["Degraded"]["lastTransitionTime"] == "t3"

    bad, good = condition(first, "TransportVerified"), condition(fixed, "TransportVerified")
    assert transport_event(None, bad) == ("Warning", "TransportMismatch", bad.message)
    assert transport_event("Unknown", bad)[0] == "Warning"
    assert transport_event("False", bad) is None
    assert transport_event("False", good) == ("Normal", "TransportMatches", good.message)
    assert transport_event("True", Condition(type="TransportVerified", status="Unknown",
                                             reason="RendezvousUnreachable")) is None

    # The reconciler remembers what it published: a second pass reading a status that lags its own write must
    # not repeat the Warning; a restarted operator takes the stored status as its memory.
    rec = Reconciler(None, OperatorImages())  # type: ignore[arg-type]
    key = ("ns", "m")
    unknown = compute_status(EFA_SPEC, 1, with_transport(None), "e", None, "t0")
    assert rec.transport_event(key, unknown, first)[0] == "Warning"
    assert rec.transport_event(key, unknown, first) is None
    assert rec.transport_event(key, first, fixed)[0] == "Normal"
    assert Reconciler(None, OperatorImages()).transport_event(key, first, first) is None  # type: ignore[arg-type]


# ---- Degraded: refused children, pods that cannot be created or placed ------------------------------------
SCHED_MSG = ("0/9 nodes are available: 2 Insufficient aws.amazon.com/neuron, 7 node(s) didn't match Pod's node "
             "affinity/selector. preemption: 0/9 nodes are available: 2 No preemption victims found for incoming "
             "pod, 7 Preemption is not helpful for scheduling.")


def pending_pod(name: str, role: str, reason: str = "Unschedulable") -> dict:
    return {"metadata": {"name": name, "labels": {"serving.disagg.io/role": role}},
            "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False",
                                                           "reason": reason, "message": SCHED_MSG}]}}


def test_unschedulable_pods_make_the_cr_degraded_with_their_count_and_the_schedulers_message():
    assert pod_problems(pending_pod("m-decode-3", "decode")) == [
        PodProblem("m-decode-3", "decode", "Unschedulable", SCHED_MSG)]
    assert pod_problems(pending_pod("m-decode-3", "decode", reason="SchedulingGated")) == []
    problems = tuple(p for i in range(8) for p in pod_problems(pending_pod(f"m-decode-{i}", "decode"))) + \
        tuple(p for i in range(3) for p in pod_problems(pending_pod(f"m-prefill-{i}", "prefill")))
    rolling = Observed(prefill=WorkloadState(3, 3, 0, 3, True, True), decode=WorkloadState(8, 8, 0, 8, True, True),
                       router=SETTLED.router, problems=problems)
    st = conds(compute_status(SPEC, 1, rolling, "e", None, "t"))
    assert (st["Degraded"]["status"], st["Degraded"]["reason"]) == ("True", "Unschedulable")
    assert st["Degraded"]["message"] == \
        f"11 engine pods cannot be scheduled (3 prefill, 8 decode); m-decode-0: {SCHED_MSG}"
    # Not an engine failure: Ready says replicas are not ready, and the rollout is still what Progressing reports.
    assert (st["Ready"]["status"], st["Ready"]["reason"]) == ("False", "ReplicasNotReady")
    assert (st["Progressing"]["status"], st["Progressing"]["reason"]) == ("True", "RollingOut")


def event(uid: str, reason: str, at: float, message: str = "") -> PodCreateEvent:
    return PodCreateEvent(uid, reason, message or f"{reason} at {at}", at)


FAILED = ("Create Pod m-prefill-1 in StatefulSet m-prefill failed error: pods \"m-prefill-1\" is forbidden: "
          "exceeded quota")
SHORT = WorkloadState(desired=2, replicas=1, ready=1, updated=1, exists=True, uid="u1")


@pytest.mark.parametrize("state, events, expected", [
    (SHORT, [], None),
    (SHORT, [event("u1", "FailedCreate", 10, FAILED)], FAILED),
    (SHORT, [event("u1", "SuccessfulCreate", 9), event("u1", "FailedCreate", 10, FAILED)], FAILED),
    # One-second resolution: a failure in the same second as a success still counts (its pod is missing).
    (SHORT, [event("u1", "SuccessfulCreate", 10), event("u1", "FailedCreate", 10, FAILED)], FAILED),
    (SHORT, [event("u1", "FailedCreate", 10, FAILED), event("u1", "SuccessfulCreate", 11)], None),
    (SHORT, [event("old-uid", "FailedCreate", 10, FAILED)], None),
    (WorkloadState(2, 2, 2, 2, True, True, "u1"), [event("u1", "FailedCreate", 10, FAILED)], None),
    (WorkloadState(), [event("u1", "FailedCreate", 10, FAILED)], None),
], ids=["no-events", "failed", "failed-after-success", "same-second", "success-after-failure", "other-statefulset",
        "all-pods-exist", "no-statefulset"])
def test_create_failure_is_the_latest_failed_creation_of_a_statefulset_short_of_pods(state, events, expected):
    assert create_failure(state, events) == expected


def test_failed_creation_and_refused_children_make_the_cr_degraded():
    short = Observed(prefill=SHORT, decode=SETTLED.decode, router=SETTLED.router,
                     create_failures=(CreateFailure("prefill", FAILED),))
    st = conds(compute_status(SPEC, 1, short, "e", None, "t"))
    assert (st["Degraded"]["status"], st["Degraded"]["reason"]) == ("True", "FailedCreate")
    assert st["Degraded"]["message"] == f"the prefill StatefulSet cannot create its pods: {FAILED}"
    both = Observed(prefill=SHORT, decode=SHORT, router=SETTLED.router,
                    create_failures=(CreateFailure("prefill", FAILED), CreateFailure("decode", "d")))
    assert conds(compute_status(SPEC, 1, both, "e", None, "t"))["Degraded"]["message"] == \
        f"the prefill and decode StatefulSets cannot create their pods: {FAILED}"

    refused = "applying Service ns/m-router: services \"m-router\" is forbidden: exceeded quota: lb"
    st = conds(compute_status(SPEC, 1, Observed(prefill=SETTLED.prefill, decode=SETTLED.decode, router=SETTLED.router,
                                                apply_error=refused), "e", None, "t"))
    assert (st["Degraded"]["status"], st["Degraded"]["reason"], st["Degraded"]["message"]) == \
        ("True", "ApplyFailed", refused)

    # Several at once: the most severe is the reason, the others are named.
    both = Observed(prefill=SHORT, decode=SETTLED.decode, router=SETTLED.router,
                    problems=(PodProblem("m-decode-0", "decode", "EngineFailed", "no EFA"),),
                    create_failures=(CreateFailure("prefill", FAILED),), apply_error=refused,
                    transport=report(("a-0", "prefill", "UCX")))
    st = conds(compute_status(SPEC, 1, both, "e", None, "t"))
    assert st["Degraded"]["reason"] == "EngineFailed"
    assert st["Degraded"]["message"] == \
        "decode pod m-decode-0: no EFA (also: ApplyFailed, FailedCreate, TransportMismatch)"
    assert (st["Ready"]["reason"], st["Ready"]["message"]) == ("EngineFailed", "decode pod m-decode-0: no EFA")


def test_transport_is_read_again_when_more_engines_are_ready_than_it_listed():
    from disagg.operator.status import EngineTransport, TransportReport, transport_behind

    one = TransportReport("http://r", engines=(EngineTransport("tiny-prefill-0", "prefill", "UCX"),))
    assert transport_behind(2, TransportReport("http://r"))  # Ready pods, an answer from before they advertised
    assert transport_behind(2, one)
    assert not transport_behind(1, one)
    assert not transport_behind(2, None)  # never asked: the regular request asks
    assert not transport_behind(2, TransportReport("http://r", error="connection failed"))  # the poll retries


def _revision(name: str, current: bool, replicas: int = 1):
    from disagg.operator.api import RevisionRoleStatus, RevisionStatus

    role = RevisionRoleStatus(replicas=replicas, ready=replicas, advertised=replicas)
    return RevisionStatus(name=name, layout_key="k", current=current, prefill=role, decode=role)


def test_the_rollout_sets_progressing_and_an_older_revision_keeps_ready_false():
    from dataclasses import replace

    from disagg.operator.status import RolloutView

    old, new = _revision("aaaaaa", False), _revision("bbbbbb", True)
    rolling = replace(SETTLED, rollout=RolloutView("RollingOut", "drain revision aaaaaa to 0P0D: replaced",
                                                   "bbbbbb", (old, new)))
    st = compute_status(SPEC, 1, rolling, "e", None, "t1")
    assert (conds(st)["Progressing"]["status"], conds(st)["Progressing"]["reason"]) == ("True", "RollingOut")
    assert "revision aaaaaa still runs 1P1D" in conds(st)["Ready"]["message"]
    assert conds(st)["Ready"]["status"] == "False" and st.rollout == "RollingOut" and st.revision == "bbbbbb"
    assert [r.name for r in st.revisions] == ["aaaaaa", "bbbbbb"]

    blocked = replace(rolling, rollout=RolloutView("Blocked", "engines of bbbbbb failed", "bbbbbb", (old, new)))
    st = compute_status(SPEC, 1, blocked, "e", st, "t2")
    assert (conds(st)["Progressing"]["status"], conds(st)["Progressing"]["reason"]) == ("False", "Blocked")
    assert conds(st)["Progressing"]["message"] == "engines of bbbbbb failed" and st.rollout == "Blocked"

    # Only the current revision, its engines advertised: the rollout is over and Ready holds.
    done = replace(SETTLED, rollout=RolloutView("Complete", "every engine runs the current revision", "bbbbbb",
                                                (new,)))
    st = compute_status(SPEC, 1, done, "e", st, "t3")
    assert (conds(st)["Progressing"]["status"], conds(st)["Progressing"]["reason"]) == ("False", "Complete")
    assert conds(st)["Ready"]["status"] == "True" and st.rollout == "Complete"
    # Ready engines the rollout still waits to see advertised: Ready (pods), yet still progressing.
    waiting = replace(done, rollout=RolloutView("RollingOut", "waiting for 1 decode engines of bbbbbb to be "
                                                "advertised", "bbbbbb", (new,)))
    st = compute_status(SPEC, 1, waiting, "e", st, "t4")
    assert conds(st)["Ready"]["status"] == "True" and conds(st)["Progressing"]["status"] == "True"


# ---- Degraded: pods that cannot start or keep failing -----------------------------------------------------
PULL = 'Back-off pulling image "registry.example/disagg:0.2.0"'


def engine_pod(name: str, role: str, *, init: list[dict] | None = None, containers: list[dict] | None = None,
               uid: str = "u1", **meta) -> dict:
    status: dict = {"phase": "Pending"}
    if init is not None:
        status["initContainerStatuses"] = init
    if containers is not None:
        status["containerStatuses"] = containers
    return {"metadata": {"name": name, "uid": uid, "labels": {"serving.disagg.io/role": role,
                                                              "app.kubernetes.io/component": role}, **meta},
            "status": status}


def waiting(name: str, reason: str, message: str = "") -> dict:
    return {"name": name, "ready": False, "state": {"waiting": {"reason": reason, "message": message}}}


def test_an_image_the_kubelet_cannot_pull_names_the_pod_container_and_reason():
    plugin = engine_pod("m-prefill-0", "prefill", init=[waiting("install-plugin", "ImagePullBackOff", PULL)],
                        containers=[waiting("engine", "PodInitializing")])
    assert pod_problems(plugin) == [PodProblem("m-prefill-0", "prefill", "ImagePullBackOff",
                                               f"init container install-plugin: {PULL}")]
    engine = engine_pod("m-decode-0", "decode",
                        containers=[waiting("engine", "ErrImagePull", "rpc error:\n  not found")])
    assert pod_problems(engine) == [PodProblem("m-decode-0", "decode", "ErrImagePull", "rpc error:")]
    starting = engine_pod("m-decode-0", "decode", containers=[waiting("engine", "ContainerCreating")])
    assert pod_problems(starting) == [], "a start under way is not a problem"
    st = conds(compute_status(SPEC, 1, Observed(prefill=SETTLED.prefill, decode=SETTLED.decode, router=SETTLED.router,
                                                problems=tuple(pod_problems(plugin))), "e", None, "t"))
    assert (st["Degraded"]["reason"], st["Degraded"]["message"]) == \
        ("ImagePullBackOff", f"prefill pod m-prefill-0: init container install-plugin: {PULL}")
    assert (st["Ready"]["status"], st["Ready"]["reason"]) == ("False", "EngineFailed")


def test_a_crash_loop_is_reported_until_the_container_runs_ready_again():
    crashed = {"exitCode": 137, "reason": "OOMKilled"}
    looping = engine_pod("m-decode-0", "decode", containers=[{**waiting("engine", "CrashLoopBackOff"),
                                                             "lastState": {"terminated": crashed}}])
    assert pod_problems(looping) == [PodProblem("m-decode-0", "decode", "EngineFailed", "OOMKilled")]
    restarting = engine_pod("m-decode-0", "decode", containers=[{"name": "engine", "ready": False, "state": {
        "running": {}}, "lastState": {"terminated": crashed}}])
    assert pod_problems(restarting) == pod_problems(looping), "restarted, not ready yet: the crash still tells why"
    recovered = engine_pod("m-decode-0", "decode", containers=[{"name": "engine", "ready": True, "state": {
        "running": {}}, "lastState": {"terminated": crashed}}])
    assert pod_problems(recovered) == [], "a crash the engine recovered from is history"
    clean_exits = engine_pod("m-decode-0", "decode", containers=[{**waiting("engine", "CrashLoopBackOff", "back-off"),
                                                                 "lastState": {"terminated": {"exitCode": 0}}}])
    assert pod_problems(clean_exits) == [PodProblem("m-decode-0", "decode", "CrashLoopBackOff", "back-off")]
    plugin = engine_pod("m-decode-0", "decode", init=[{**waiting("install-plugin", "CrashLoopBackOff"), "lastState": {
        "terminated": {"exitCode": 1, "message": "disagg install-plugin: /opt/disagg is not writable"}}}])
    assert pod_problems(plugin) == [PodProblem("m-decode-0", "decode", "EngineFailed",
                                               "init container install-plugin: disagg install-plugin: /opt/disagg "
                                               "is not writable")]
    plugin["status"]["initContainerStatuses"] = [{"name": "install-plugin", "ready": True, "state": {
        "terminated": {"exitCode": 0}}, "lastState": {"terminated": {"exitCode": 1}}}]
    assert pod_problems(plugin) == [], "an init container that completed since"


def test_a_router_pod_that_fails_is_degraded_but_not_an_engine_failure():
    router = engine_pod("m-router-7f9c-x2", "router", containers=[waiting("router", "ImagePullBackOff", PULL)])
    del router["metadata"]["labels"]["serving.disagg.io/role"]
    [problem] = pod_problems(router)
    assert problem == PodProblem("m-router-7f9c-x2", "router", "ImagePullBackOff", f"container router: {PULL}")
    st = conds(compute_status(SPEC, 1, Observed(prefill=SETTLED.prefill, decode=SETTLED.decode, router=SETTLED.router,
                                                problems=(problem,)), "e", None, "t"))
    assert (st["Degraded"]["reason"], st["Degraded"]["message"]) == \
        ("ImagePullBackOff", f"router pod m-router-7f9c-x2: container router: {PULL}")
    assert st["Ready"]["status"] == "True", "the router's counts say whether it serves (the old pod does)"
    engine = PodProblem("m-decode-1", "decode", "EngineFailed", "no EFA")
    st = conds(compute_status(SPEC, 1, Observed(prefill=SETTLED.prefill, decode=SETTLED.decode, router=SETTLED.router,
                                                problems=(problem, engine)), "e", None, "t"))
    assert st["Degraded"]["message"] == "decode pod m-decode-1: no EFA (+1 more)", "engine pods first"


MOUNT = 'MountVolume.SetUp failed for volume "models" : persistentvolumeclaim "weights" not found'


def test_a_volume_the_kubelet_cannot_mount_holds_until_a_container_starts():
    pod = engine_pod("m-prefill-0", "prefill", init=[waiting("install-plugin", "PodInitializing")],
                     containers=[waiting("engine", "PodInitializing")])
    events = (PodEvent("u1", "FailedMount", "an older one", 10), PodEvent("u1", "FailedMount", MOUNT + "\n", 20),
              PodEvent("earlier-pod", "FailedMount", "another pod of the same name", 30))
    assert mount_failure(pod, events) == PodProblem("m-prefill-0", "prefill", "FailedMount", MOUNT)
    assert mount_failure(pod, events[2:]) is None, "an earlier pod of the same name"
    assert mount_failure(pod, ()) is None
    started = engine_pod("m-prefill-0", "prefill", init=[{"name": "install-plugin", "state": {
        "terminated": {"exitCode": 0}}}], containers=[waiting("engine", "PodInitializing")])
    assert mount_failure(started, events) is None, "a container started: every volume was mounted"
    assert mount_failure(engine_pod("m-prefill-0", "prefill", deletionTimestamp="2026-05-04T10:00:00Z"),
                         events) is None
    stuck = Observed(prefill=SETTLED.prefill, decode=SETTLED.decode, router=SETTLED.router,
                     problems=(PodProblem("m-decode-0", "decode", "CrashLoopBackOff", "back-off"),
                               mount_failure(pod, events)))  # type: ignore[arg-type]
    st = conds(compute_status(SPEC, 1, stuck, "e", None, "t"))
    assert (st["Degraded"]["reason"], st["Degraded"]["message"]) == \
        ("FailedMount", f"prefill pod m-prefill-0: {MOUNT} (+1 more)")
    assert st["Ready"]["reason"] == "EngineFailed"


def test_a_pod_that_recovered_leaves_the_problem_index():
    """kopf keeps what an indexer returned for an object before when it now returns None; `{}` clears it."""
    import kopf

    from disagg.operator.controller.indexes import pod_problem_index

    labels = {"app.kubernetes.io/instance": "m", "serving.disagg.io/role": "decode"}
    failing = engine_pod("m-decode-0", "decode", containers=[waiting("engine", "ImagePullBackOff", PULL)])
    found = pod_problem_index(namespace="ml", labels=labels, body=kopf.Body(failing))
    assert found == {("ml", "m"): (PodProblem("m-decode-0", "decode", "ImagePullBackOff", PULL),)}
    healthy = engine_pod("m-decode-0", "decode", containers=engine_running_ready())
    assert pod_problem_index(namespace="ml", labels=labels, body=kopf.Body(healthy)) == {}


def engine_running_ready() -> list[dict]:
    return [{"name": "engine", "ready": True, "state": {"running": {}}}]


def test_a_pass_keeps_the_planners_status_while_spec_autoscaling_is_set_and_drops_it_after():
    planner = AutoscalingStatus(decision="Steady", prefill=RoleAutoscalingStatus(desired=2, reason="steady"))
    previous = compute_status(SPEC, 3, SETTLED, "e", None, "t").model_copy(update={"autoscaling": planner})
    scaled = SPEC.model_copy(update={"autoscaling": AutoscalingSpec.model_validate(
        {"prefill": {"maxReplicas": 4}, "decode": {"maxReplicas": 4}})})
    assert compute_status(scaled, 3, SETTLED, "e", previous, "t").autoscaling == planner
    assert compute_status(SPEC, 3, SETTLED, "e", previous, "t").autoscaling is None
