"""Rollouts on the real local cluster: the operator's executor drives revisions of StatefulSets on kwok nodes.

The rendezvous is a real `disagg rendezvous` process, which the operator reads (--rendezvous-url-template). kwok
runs no engines, so a stand-in for their plugin advertises each Ready engine pod there (support/advertiser.py, a
fake named as such): what a rollout waits for before it drains old engines.
"""
from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest
from lightkube.resources.apps_v1 import StatefulSet
from lightkube.types import PatchType

from disagg.connector.rendezvous.client import EngineCache, RendezvousClient
from disagg.operator.rollout import actions
from disagg.operator.rollout.simulate import compute_all_steps
from disagg.operator.rollout.state import Observed, RevisionState, RoleState, RolloutPolicy, Target
from support.dinf import Dinf, cond, create, ends_with, is_ready, rollout_steps, small
from support.kube import events_until, watch_until
from support.operator import OperatorProcess

pytestmark = pytest.mark.cluster

@pytest.fixture(scope="module")
def operator(cluster, crd_installed, rendezvous, tmp_path_factory):
    op = OperatorProcess(cluster.kubeconfig, tmp_path_factory.mktemp("operator") / "operator.log", resync_seconds=2,
                         extra=rendezvous.operator_args)
    op.start()
    yield op
    op.stop()


def complete(d) -> bool:
    return is_ready(d) and (d.status or {}).get("rollout") == "Complete" and len(d.status["revisions"]) == 1


def merged(steps: list[str]) -> list[str]:
    """Consecutive steps of one kind on one revision as the last of them. The planner takes the step the world
    allows when it looks: when one role's withdrawn engines are gone before the other's, it grows that role
    first (2P1D, then 2P2D) where a world that settles all at once grows both in one step."""
    out: list[str] = []
    for step in steps:
        if out and out[-1].rsplit(" to ", 1)[0] == step.rsplit(" to ", 1)[0] and " to " in step:
            out[-1] = step
        else:
            out.append(step)
    return out


def compatible_pairs(listed, name: str) -> int:
    """Prefill/decode pairs of deployment `name` the router could make: per layout key, the fewer role."""
    mine = [e for e in listed if e.deployment == name]
    return sum(min(sum(1 for e in mine if e.layout_key == k and e.role == r) for r in ("prefill", "decode"))
               for k in {e.layout_key for e in mine})


def engines(url: str, name: str) -> list[tuple[str, str]]:
    async def read() -> list[tuple[str, str]]:
        async with RendezvousClient(url) as client:
            return [(e.role, e.layout_key) for e in (await client.list()).engines if e.deployment == name]
    return asyncio.run(read())


def four_by_four(name: str, **spec) -> dict:
    return small(name, prefill={"tensorParallelSize": 1, "replicas": 4},
                 decode={"tensorParallelSize": 1, "replicas": 4}, **spec)


def test_a_layout_change_rolls_4p4d_in_the_planned_steps_and_keeps_four_pairs(cluster, operator, rendezvous,
                                                                               namespace, advertised):
    name = create(cluster, namespace, four_by_four("roll"))
    first = watch_until(cluster, Dinf, name, complete, namespace=namespace, timeout=90, what="the first revision")
    old = first.status["revision"]
    assert [r["name"] for r in first.status["revisions"]] == [old]
    assert first.status["revisions"][0]["prefill"] == {"replicas": 4, "ready": 4, "advertised": 4}

    pairs: list[int] = []
    cache = EngineCache()  # what a router sees: every change of the rendezvous, from its watch
    # Counted from the end of the watch's first snapshot on (while it fills, the cache is not yet the state).
    cache.listeners.append(lambda _ev: cache.synced.is_set() and pairs.append(compatible_pairs(cache.select(), name)))
    loop = asyncio.new_event_loop()
    client = RendezvousClient(rendezvous.url)
    follow = loop.create_task(cache.follow(client))

    def run() -> None:
        with contextlib.suppress(asyncio.CancelledError):
            loop.run_until_complete(follow)

    watcher = threading.Thread(target=run, daemon=True)
    watcher.start()
    asyncio.run_coroutine_threadsafe(cache.synced.wait(), loop).result(timeout=10)
    pairs.append(compatible_pairs(cache.select(), name))
    try:
        # A block-size change is a KV layout change: new engines cannot pair with old ones.
        cluster.client.patch(Dinf, name, {"spec": {"engine": {"blockSize": 64}}}, namespace=namespace,
                             patch_type=PatchType.MERGE)
        done = watch_until(cluster, Dinf, name, lambda d: complete(d) and d.status["revision"] != old,
                           namespace=namespace, timeout=240, what="the rollout complete")
    finally:
        loop.call_soon_threadsafe(follow.cancel)
        watcher.join(timeout=10)
        loop.run_until_complete(client.close())
    new = done.status["revision"]
    # What the planner predicts for a healthy world: the cluster must have taken exactly these steps.
    start = RevisionState(old, "old layout", RoleState.counted(4), RoleState.counted(4))
    plan = compute_all_steps(Observed(Target(new, "new layout", 4, 4), (start,)), RolloutPolicy(),
                             deletes_withdrawn=True)
    expected = [f"scale up revision {old} to 4P4D"] + [actions.describe(s) for s in plan]
    taken = rollout_steps(cluster, namespace, name, ends_with(expected[-1]))
    assert merged(taken) == merged(expected), f"\ntaken:    {taken}\nexpected: {expected}"
    assert pairs and min(pairs) >= 4, f"fewer than 4 compatible pairs were advertised during the rollout: {min(pairs)}"
    assert {k for _, k in engines(rendezvous.url, name)} == {done.status["revisions"][0]["layoutKey"]}
    assert [s.metadata.name for s in cluster.client.list(StatefulSet, namespace=namespace)] == \
        sorted([f"{name}-decode-{new}", f"{name}-prefill-{new}"])


def test_new_engines_that_never_become_ready_block_the_rollout_and_a_rollback_completes(cluster, operator,
                                                                                     namespace, advertised):
    name = create(cluster, namespace, small("blocked", rollout={"startupSeconds": 10}))
    good = watch_until(cluster, Dinf, name, complete, namespace=namespace, timeout=90, what="the first revision")
    old = good.status["revision"]
    # No node has this label: the new revision's pods stay Pending past their startup budget.
    nowhere = {"nodeSelector": {"disagg.test/nowhere": "true"}}
    cluster.client.patch(Dinf, name, {"spec": {"prefill": nowhere, "decode": nowhere}}, namespace=namespace,
                         patch_type=PatchType.MERGE)
    blocked = watch_until(cluster, Dinf, name, lambda d: (cond(d, "Progressing") or {}).get("reason") == "Blocked",
                          namespace=namespace, timeout=90, what="Blocked")
    progressing = cond(blocked, "Progressing")
    assert progressing["status"] == "False" and "failed" in progressing["message"], progressing
    assert blocked.status["rollout"] == "Blocked"
    by_name = {r["name"]: r for r in blocked.status["revisions"]}
    assert by_name[old]["prefill"] == by_name[old]["decode"] == {"replicas": 1, "ready": 1, "advertised": 1}, \
        "the old revision serves in full"
    warnings = events_until(cluster, namespace, name, "RolloutBlocked", bool, what="a RolloutBlocked Event")
    assert len(warnings) == 1 and warnings[0].type == "Warning"

    # Rolling back is applying the previous spec: the old revision is the target again, the failed one goes.
    cluster.client.patch(Dinf, name, {"spec": {"prefill": {"nodeSelector": None}, "decode": {"nodeSelector": None}}},
                         namespace=namespace, patch_type=PatchType.MERGE)
    back = watch_until(cluster, Dinf, name, complete, namespace=namespace, timeout=90, what="rolled back")
    assert back.status["revision"] == old
    failed = next(r for r in by_name if r != old)
    steps = rollout_steps(cluster, namespace, name, ends_with(f"retire revision {failed}"))
    assert steps[0] == f"scale up revision {old} to 1P1D"
    assert all(failed in s for s in steps[1:]), f"only the failed revision was touched after the first: {steps}"
    assert steps[-1] == f"retire revision {failed}"
