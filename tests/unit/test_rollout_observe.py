"""What the planner reads from StatefulSets, pods and the rendezvous (operator/rollout/observe.py): objects as the
apiserver returns them, built here by hand."""
from __future__ import annotations

from typing import Any
from unittest.mock import ANY

import pytest

from disagg.operator.rollout.observe import ordinal, revision_state, role_state
from disagg.operator.rollout.planner import plan
from disagg.operator.rollout.state import Observed, RoleState, RolloutPolicy, Target
from disagg.operator.rollout.steps import Drain, Progress, ScaleUp, Waiting

NOW = 1_800_000_000.0
STARTUP = 600


def sts(name: str, replicas: int) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"replicas": replicas}}


def stamp(seconds_ago: float) -> str:
    import datetime as dt
    return dt.datetime.fromtimestamp(NOW - seconds_ago, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def pod(name: str, *, ready: bool = True, age: float = 60, terminating: bool = False,
        terminated_message: str | None = None, unschedulable: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "uid": f"uid-{name}", "creationTimestamp": stamp(age)}
    if terminating:
        meta["deletionTimestamp"] = stamp(0)
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    if unschedulable:
        conditions.append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                           "message": "0/3 nodes are available"})
    status: dict[str, Any] = {"conditions": conditions}
    if terminated_message is not None:
        status["containerStatuses"] = [{"name": "engine", "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                                        "lastState": {"terminated": {"exitCode": 1,
                                                                     "message": terminated_message}}}]
    return {"metadata": meta, "status": status}


def listed(*pods: dict[str, Any]) -> dict[str, str]:
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods}


@pytest.mark.parametrize(("name", "expected"), [("d-decode-r1-0", 0), ("d-decode-r1-12", 12), ("d-decode-r1-", None),
                                                ("d-decode-r1-x", None), ("d-decode-r2-0", None),
                                                ("d-decode-r1-0-1", None)])
def test_ordinal_is_read_only_from_this_statefulsets_pods(name, expected):
    assert ordinal(name, "d-decode-r1") == expected


def test_ready_advertised_and_starting_engines():
    pods = [pod("s-0"), pod("s-1"), pod("s-2", ready=False, age=5)]
    state = role_state(sts("s", 3), pods, listed(pods[0]), NOW, STARTUP)
    assert state == RoleState(replicas=3, ready=frozenset({0, 1}), advertised=frozenset({0}))
    assert (state.serving, state.starting) == (1, 2)


def test_an_entry_of_an_earlier_pod_of_the_same_name_does_not_count():
    old, new = pod("s-0"), pod("s-0")
    new["metadata"]["uid"] = "uid-replacement"
    assert role_state(sts("s", 1), [new], listed(old), NOW, STARTUP).advertised == frozenset()


def test_withdrawn_engines_drain_until_their_pods_are_gone():
    """Replicas lowered from 3 to 1: ordinals 1 and 2 still exist (terminating, or not yet deleted)."""
    pods = [pod("s-0"), pod("s-1", terminating=True), pod("s-2")]
    state = role_state(sts("s", 1), pods, listed(*pods), NOW, STARTUP)
    assert (state.replicas, state.live, state.draining, state.drained) == (3, 1, 2, 0)
    assert state.ready == state.advertised == frozenset({0})


def test_failed_engines_a_crash_loop_and_one_past_its_startup_budget():
    pods = [pod("s-0", ready=False, terminated_message="disagg preflight (decode): /dev/shm is too small"),
            pod("s-1", ready=False, age=STARTUP + 1), pod("s-2", ready=False, age=STARTUP - 1),
            pod("s-3", ready=False, age=STARTUP + 1, unschedulable=True), pod("s-4", ready=False, age=5,
                                                                            unschedulable=True)]
    state = role_state(sts("s", 5), pods, {}, NOW, STARTUP)
    assert state.failed == frozenset({0, 1, 3})  # unschedulable only counts once the startup budget is over
    assert state.starting == 2


def test_a_missing_statefulset_is_a_role_with_nothing():
    assert role_state(None, [pod("s-0")], {}, NOW, STARTUP) == RoleState()


def test_a_revision_observed_from_the_cluster_drives_the_planner():
    """A layout change of a 1P1D deployment, r1 to r2, read from objects: the planner creates r2, waits while its
    pods start, and drains r1 once r2's engines are Ready and advertised."""
    old_pods = [pod("d-prefill-r1-0"), pod("d-decode-r1-0")]
    new_pods = [pod("d-prefill-r2-0", ready=False, age=3), pod("d-decode-r2-0", ready=False, age=3)]
    everything = old_pods + new_pods

    def observed(pods: list[dict[str, Any]], new_replicas: int) -> Observed:
        ads = listed(*[p for p in pods if p["status"]["conditions"][0]["status"] == "True"])
        r1 = revision_state("r1", "k1", sts("d-prefill-r1", 1), sts("d-decode-r1", 1), pods, ads, NOW, STARTUP)
        r2 = revision_state("r2", "k2", sts("d-prefill-r2", new_replicas), sts("d-decode-r2", new_replicas), pods,
                            ads, NOW, STARTUP)
        return Observed(Target("r2", "k2", 1, 1), (r1, r2))

    policy = RolloutPolicy()
    assert plan(observed(old_pods, 0), policy) == Progress(ScaleUp("r2", 1, 1), reason=ANY)
    assert isinstance(plan(observed(everything, 1), policy), Waiting)  # new engines starting
    started = old_pods + [pod("d-prefill-r2-0"), pod("d-decode-r2-0")]
    result = plan(observed(started, 1), policy)
    assert isinstance(result, Progress) and result.step == Drain("r1", 0, 0), result
