"""The apply plan (which children a full pass applies) and the echo detection that feeds it: a child event that
shows exactly what our last apply produced is our own echo; anything else is a change under us."""
from __future__ import annotations

import asyncio
import copy

import pytest

from disagg.operator.api import DisaggregatedInference
from disagg.operator.builders import build_children
from disagg.operator.meta import OperatorImages
from disagg.operator.plan import Applied, child_key, digest, plan_children
from disagg.operator.reconciler import Reconciler
from support.crs import launch_configmap, statefulset


def cr(**spec) -> DisaggregatedInference:
    return DisaggregatedInference.model_validate({"metadata": {"name": "m", "namespace": "ml", "uid": "u"}, "spec": {
        "model": {"name": "x"}, "accelerator": {"profile": "nvidia-h200"}, **spec}})


DESIRED = build_children(cr())


def applied_all(children) -> dict:
    return {child_key(o): Applied(digest(o), "g1") for o in children}


def test_plan_applies_what_is_new_changed_or_drifted_and_everything_when_thorough():
    plan = plan_children(DESIRED, {}, set(), thorough=False)
    assert [s.why for s in plan.steps] == ["new"] * len(DESIRED) and len(plan.to_apply) == len(DESIRED)
    assert [s.key for s in plan.steps] == [child_key(o) for o in DESIRED], "the builders' order is kept"

    known = applied_all(DESIRED)
    quiet = plan_children(DESIRED, known, set(), thorough=False)
    assert quiet.to_apply == () and quiet.skipped == len(DESIRED)
    assert {s.why for s in plan_children(DESIRED, known, set(), thorough=True).steps} == {"verify"}
    # A resync verifies only what the watch has not shown as our last apply left it.
    watched = {k: a.marker for k, a in known.items()}
    first, second = (child_key(o) for o in DESIRED[:2])
    watched[first] = "g2"  # the watch saw a later generation than the one we applied
    del watched[second]  # the watch has shown nothing since our apply
    resync = plan_children(DESIRED, known, set(), thorough=True, watched=watched)
    assert [s.key for s in resync.to_apply] == [first, second] and resync.skipped == len(DESIRED) - 2

    sts = child_key(statefulset(DESIRED, "decode", cr="m"))
    assert sts[2].startswith("m-decode-")
    drifted = plan_children(DESIRED, known, {sts}, thorough=False)
    assert [(s.key, s.why) for s in drifted.to_apply] == [(sts, "drifted")]

    scaled = build_children(cr(decode={"replicas": 3}))
    changed = plan_children(scaled, known, set(), thorough=False)
    assert [(s.key, s.why) for s in changed.to_apply] == [(sts, "changed")], \
        "only the decode StatefulSet changed: replicas are not part of the revision"


def test_digest_is_of_the_manifest_only():
    assert digest(DESIRED[0]) == digest(copy.deepcopy(DESIRED[0]))
    edited = copy.deepcopy(DESIRED[0])
    edited["metadata"]["labels"]["x"] = "y"
    assert digest(edited) != digest(DESIRED[0])


def reconciler_with(applied: dict) -> Reconciler:
    r = Reconciler(None, OperatorImages())  # type: ignore[arg-type]
    r.applied.update(applied)
    return r


def body(name: str, namespace: str | None = "ml", generation: int | None = None, rv: str = "100") -> dict:
    meta = {"name": name, "resourceVersion": rv}
    if namespace is not None:
        meta["namespace"] = namespace
    if generation is not None:
        meta["generation"] = generation
    return {"metadata": meta}


APPLIED = {("StatefulSet", "ml", "m-decode"): Applied("d", "g2"), ("Service", "ml", "m-router"): Applied("d", "rv100"),
           ("ClusterRoleBinding", "", "disagg-rendezvous:ml:m"): Applied("d", "rv7")}


@pytest.mark.parametrize("kind, event, own", [
    ("StatefulSet", body("m-decode", generation=2, rv="555"), True),   # its status moved: same generation
    ("StatefulSet", body("m-decode", generation=3, rv="556"), False),  # its spec was edited
    ("StatefulSet", body("m-prefill", generation=2), False),           # never applied by this process
    ("StatefulSet", body("m-decode", namespace="other", generation=2), False),
    ("Deployment", body("m-decode", generation=2), False),             # same name, another kind
    ("Service", body("m-router", rv="100"), True),                     # no generation: the resourceVersion
    ("Service", body("m-router", rv="101"), False),
    ("ClusterRoleBinding", body("disagg-rendezvous:ml:m", namespace=None, rv="7"), True),
    ("ClusterRoleBinding", body("disagg-rendezvous:ml:m", namespace=None, rv="8"), False),
], ids=["sts-status-only", "sts-spec-edited", "sts-unknown", "other-namespace", "other-kind", "svc-same-rv",
        "svc-new-rv", "cluster-scoped-same-rv", "cluster-scoped-new-rv"])
def test_is_own_echo(kind, event, own):
    r = reconciler_with(APPLIED)
    assert r.is_own_echo(kind, event) is own
    assert r.child_changed(kind, event) is not own
    key = (kind, event["metadata"].get("namespace") or "", event["metadata"]["name"])
    assert (key in r._drifted) is not own


def test_a_deleted_child_is_a_change_even_when_its_last_state_was_our_echo():
    r = reconciler_with(APPLIED)
    assert r.child_changed("Service", body("m-router", rv="100"), deleted=True)
    assert ("Service", "ml", "m-router") in r._drifted


async def still_there(namespace: str, name: str) -> bool:
    return True


def test_the_apiserver_is_asked_whether_the_cr_exists_once_per_pass_and_only_before_a_write():
    """The watch can lag a deletion, so a pass asks before writing; a pass that writes nothing asks nothing, and a
    CR found gone gets no write at all."""
    r = Reconciler(None, OperatorImages())  # type: ignore[arg-type]
    asked: list[str] = []
    applied: list[str] = []
    answer = True

    async def exists(namespace: str, name: str) -> bool:
        asked.append(name)
        return answer

    async def apply(obj):
        applied.append(obj["metadata"]["name"])
        return {**obj, "metadata": {**obj["metadata"], "generation": 1, "resourceVersion": "1"}}, True

    r.exists = exists  # type: ignore[method-assign]
    r._apply = apply  # type: ignore[method-assign]
    answer = False
    gone = asyncio.run(r.apply_children(cr(), []))
    assert gone.gone and applied == [] and asked == ["m"], "a CR found deleted gets no child"
    answer, asked[:] = True, []
    first = asyncio.run(r.apply_children(cr(), []))
    assert not first.gone and len(applied) == len(first.created) > 1 and asked == ["m"], "one question per pass"
    asked.clear()
    assert asyncio.run(r.apply_children(cr(), [])).unchanged and asked == [], "a pass that writes nothing asks nothing"


def test_apply_children_follows_the_plan_and_reports_creations_from_the_apiserver():
    """The executor with its one cluster call replaced: created is what the apiserver said (201), not a clock."""
    r = Reconciler(None, OperatorImages())  # type: ignore[arg-type]
    calls: list[str] = []
    stored: dict[tuple, tuple[dict, int]] = {}  # what the fake apiserver holds: manifest and generation
    echoes: list[dict] = []  # what its watch would deliver

    async def apply(obj):
        key = child_key(obj)
        calls.append(f"{key[0]}/{key[2]}")
        created = key not in stored
        before, generation = stored.get(key, (None, 0))
        generation += obj != before
        stored[key] = (obj, generation)
        answer = {**obj, "metadata": {**obj["metadata"], "generation": generation, "resourceVersion": "1"}}
        echoes.append(answer)
        return answer, created

    r._apply = apply  # type: ignore[method-assign]
    r.exists = still_there  # type: ignore[method-assign]
    support = build_children(cr(), statefulsets=False)  # the engine StatefulSets are the rollout's to write
    assert len(support) == len(DESIRED) - 2
    first = asyncio.run(r.apply_children(cr(), []))
    assert len(first.created) == len(calls) == len(support)
    calls.clear()
    again = asyncio.run(r.apply_children(cr(), []))
    assert calls == [] and again.created == again.updated == [] and again.unchanged == len(support)
    resync = asyncio.run(r.apply_children(cr(), [], thorough=True))
    assert len(calls) == len(support) and resync.created == resync.updated == []
    calls.clear()
    for echo in echoes:
        assert not r.child_changed(echo["kind"], echo)
    assert asyncio.run(r.apply_children(cr(), [], thorough=True)).unchanged == len(support) and calls == [], \
        "once the watch has shown every child as applied, a resync sends nothing"
    asyncio.run(r.apply_children(cr(decode={"replicas": 3}), []))
    assert calls == [], "replicas are the rollout's"
    changed = asyncio.run(r.apply_children(cr(decode={"args": ["--max-num-seqs", "8"]}), []))
    [launch] = [c for c in calls if c.startswith("ConfigMap/")]
    assert launch != f"ConfigMap/{launch_configmap(DESIRED)['metadata']['name']}" and changed.created == [launch], \
        "a new revision gets its own launch scripts; the old revision's stay"
    calls.clear()
    # A restarted operator knows nothing: it applies everything, and reports nothing as created.
    fresh = Reconciler(None, OperatorImages())  # type: ignore[arg-type]
    fresh._apply = apply  # type: ignore[method-assign]
    fresh.exists = still_there  # type: ignore[method-assign]
    assert asyncio.run(fresh.apply_children(cr(decode={"replicas": 3}), [])).created == []


def test_a_statefulset_the_rollout_created_is_neither_applied_again_nor_its_echo_taken_for_drift():
    r = Reconciler(None, OperatorImages())  # type: ignore[arg-type]
    sent: list[str] = []

    async def apply(obj):
        sent.append(obj["metadata"]["name"])
        return {**obj, "metadata": {**obj["metadata"], "generation": 1, "resourceVersion": "7"}}, True

    r._apply = apply  # type: ignore[method-assign]
    [sts, *_] = [o for o in DESIRED if o["kind"] == "StatefulSet"]
    stored, created = asyncio.run(r.rollout._apply(sts))
    assert created and sent == [sts["metadata"]["name"]]
    assert not r.child_changed("StatefulSet", stored), "the watch's echo of the rollout's own write"
    assert plan_children([sts], r.applied, r._drifted, thorough=True, watched=r._watched).to_apply == (), \
        "the repair of the current revision finds nothing to apply"


def _version(c: DisaggregatedInference, rv: str, **spec) -> DisaggregatedInference:
    data = c.model_dump(by_alias=True, exclude_none=True)
    data["metadata"]["resourceVersion"] = rv
    data["spec"].update(spec)
    return DisaggregatedInference.model_validate(data)


def test_the_revision_is_rendered_once_per_version_of_the_cr_and_of_what_runs(monkeypatch):
    from disagg.operator import engine_builders
    rec = Reconciler(None, OperatorImages())  # type: ignore[arg-type]  # revision() sends no request
    calls: list[str] = []
    real = engine_builders.engine_revision

    def counting(c, images):
        calls.append(c.metadata["resourceVersion"])
        return real(c, images)

    monkeypatch.setattr(engine_builders, "engine_revision", counting)
    v1 = _version(cr(), "1")
    first = rec.revision(v1, []).revision
    assert rec.revision(v1, []).revision == first and rec.revision(_version(cr(), "1"), []).revision == first
    assert calls == ["1"], "an unchanged version is not rendered again"
    v2 = _version(cr(), "2", engine={"image": "vllm/vllm-openai:v9"})
    second = rec.revision(v2, []).revision
    assert second != first and calls == ["1", "2"], "a new version is rendered"
    rec.forget(("ml", "m"))
    assert rec.revision(v2, []).revision == second and calls == ["1", "2", "2"], "forgotten, it is rendered again"
    sts = statefulset(build_children(cr(), images=OperatorImages("old:1")), "prefill", cr="m")
    assert rec.revision(v2, [sts]).revision == second and calls == ["1", "2", "2", "2", "2"], \
        "another revision running is a new question: the spec rendered with its plugin image too"


def _racing(r: Reconciler, during) -> list[str]:
    """Give `r` an apply whose watch events arrive before its response: `during(answer)` returns the bodies the
    watch shows while the request is under way, each handed to `child_changed` then."""
    sent: list[str] = []

    async def apply(obj):
        sent.append(obj["metadata"]["name"])
        answer = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(100 + len(sent))}}
        for body in during(answer):
            assert not r.child_changed(body["kind"], body), "judged only once the apply returns"
        return answer, False

    async def exists(*_):
        return True

    r._apply = apply  # type: ignore[method-assign]
    r.exists = exists  # type: ignore[method-assign]
    return sent


def _with_rv(obj, rv: str) -> dict:
    return {**obj, "metadata": {**obj["metadata"], "resourceVersion": rv}}


def test_the_echo_of_an_apply_seen_before_its_response_is_not_drift():
    r = Reconciler(None, OperatorImages())  # type: ignore[arg-type]
    _racing(r, lambda answer: [_with_rv(answer, "99"), answer])  # an older state, then our own write
    asyncio.run(r.apply_children(cr(), []))
    assert r._drifted == set() and not r.drift_pending(("ml", "m"))


def test_a_change_seen_after_the_echo_but_before_the_response_is_drift_and_makes_the_next_pass_full():
    r = Reconciler(None, OperatorImages())  # type: ignore[arg-type]
    foreign = {"ConfigMap"}

    def during(answer):
        return [answer, _with_rv(answer, "999")] if answer["kind"] in foreign else [answer]

    sent = _racing(r, during)
    asyncio.run(r.apply_children(cr(), []))
    [configmap] = [k for k in r._drifted]
    assert configmap[0] == "ConfigMap" and r.drift_pending(("ml", "m"))
    foreign.clear()
    sent.clear()
    asyncio.run(r.apply_children(cr(), []))
    assert sent == [configmap[2]], "the next full pass puts back what changed, and only that"
    assert r._drifted == set() and not r.drift_pending(("ml", "m"))
