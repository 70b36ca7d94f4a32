"""The pure status function and the pass coalescer: the invariants the reconciler relies on."""
from __future__ import annotations

import asyncio

from disagg.operator.api import DisaggregatedInferenceSpec
from disagg.operator.reconciler import Coalescer
from disagg.operator.status import Observed, PodProblem, WorkloadState, compute_status, pod_problems, workload_state

SPEC = DisaggregatedInferenceSpec.model_validate({"model": {"name": "m"}, "accelerator": {"profile": "nvidia-h200"},
                                                  "prefill": {"replicas": 2}})
SETTLED = Observed(prefill=WorkloadState(2, 2, 2, 2, True, True), decode=WorkloadState(1, 1, 1, 1, True, True),
                   router=WorkloadState(1, 1, 1, 1, True, True))


def conds(status):
    return {c["type"]: c for c in status["conditions"]}


def test_ready_only_when_every_role_and_router_settled():
    ok = compute_status(SPEC, 3, SETTLED, "http://e", None, "t1")
    assert conds(ok)["Ready"]["status"] == "True" and conds(ok)["Progressing"]["status"] == "False"
    assert ok["prefill"] == {"desired": 2, "ready": 2, "updated": 2} and ok["prefillReady"] == "2/2"
    assert ok["observedGeneration"] == 3 and ok["connector"] == "NixlPushConnector" and ok["backend"] == "LIBFABRIC"
    half = Observed(prefill=WorkloadState(2, 2, 1, 2, True, True), decode=SETTLED.decode, router=SETTLED.router)
    st = compute_status(SPEC, 3, half, "http://e", None, "t1")
    assert conds(st)["Ready"]["status"] == "False"
    assert "prefill 1/2 ready" in conds(st)["Progressing"]["message"]
    missing = compute_status(SPEC, 3, Observed(), "http://e", None, "t1")
    assert "not created yet" in conds(missing)["Ready"]["message"]


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


def test_coalescer_runs_one_pass_at_a_time_at_the_strongest_level():
    async def scenario():
        c, runs, gate, started = Coalescer(), [], asyncio.Event(), asyncio.Event()

        async def fn(full):
            runs.append(full)
            started.set()
            if len(runs) == 1:
                await gate.wait()

        first = asyncio.create_task(c.run(("ns", "a"), False, fn))
        await started.wait()
        await c.run(("ns", "a"), False, fn)  # arrive during the pass: coalesced
        await c.run(("ns", "a"), True, fn)   # a full trigger upgrades the pending pass
        await c.run(("ns", "a"), False, fn)
        gate.set()
        await first
        return runs

    assert asyncio.run(scenario()) == [False, True]
