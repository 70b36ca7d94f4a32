"""From StatefulSets to revisions, and from planned steps to writes (rollout/revisions.py, rollout/actions.py), and
the executor's guard against acting on an observation older than its own last write."""
from __future__ import annotations

from disagg.operator import names
from disagg.operator.builders import build_children
from disagg.operator.rollout import actions, revisions
from disagg.operator.rollout.steps import Drain, Retire, ScaleUp
from disagg.operator.rollout_executor import RolloutExecutor
from support.crs import make_cr, statefulset

CR = make_cr({"prefill": {"replicas": 2}, "decode": {"replicas": 2}})
CHILDREN = build_children(CR)
REV = statefulset(CHILDREN, "prefill")["metadata"]["labels"][names.LABEL_REVISION]


def sts(role: str, replicas: int, *, rev: str | None = REV, created: str = "2026-01-01T00:00:00Z",
        layout: str | None = "abc", env_layout: str | None = None) -> dict:
    labels = {names.LABEL_INSTANCE: "qwen", names.LABEL_COMPONENT: role}
    if rev:
        labels[names.LABEL_REVISION] = rev
    meta = {"name": f"qwen-{role}-{rev}" if rev else f"qwen-{role}", "labels": labels, "creationTimestamp": created,
            "generation": 3, "annotations": {names.LAYOUT_KEY_ANNOTATION: layout} if layout else {}}
    env = [{"name": "DISAGG_LAYOUT_KEY", "value": env_layout}] if env_layout else []
    return {"metadata": meta, "spec": {"replicas": replicas, "template": {"spec": {"containers": [
        {"name": "engine", "env": env}]}}}}


def pod(statefulset_name: str, ordinal: int, ready: bool = True) -> dict:
    return {"metadata": {"name": f"{statefulset_name}-{ordinal}", "uid": f"u{ordinal}",
                         "creationTimestamp": "2026-01-01T00:00:00Z"},
            "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_statefulsets_made_before_revisions_are_one_older_revision_with_their_engines_layout_key():
    legacy = [sts("prefill", 2, rev=None, layout=None, env_layout="old-key"),
              sts("decode", 2, rev=None, layout=None, env_layout="old-key")]
    current = [sts("prefill", 1, created="2026-02-01T00:00:00Z"), sts("decode", 1, created="2026-02-01T00:00:00Z")]
    pods = [pod("qwen-prefill", 0), pod("qwen-prefill", 1), pod("qwen-decode", 0), pod("qwen-decode", 1),
            pod(f"qwen-prefill-{REV}", 0), pod(f"qwen-decode-{REV}", 0, ready=False)]
    advertised = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods}
    observed, sets = revisions.observe(CR.spec, REV, current + legacy, pods, advertised, now=1e10,
                                       rollout_policy=revisions.policy(CR.spec))
    assert [r.name for r in sets] == [revisions.LEGACY, REV], "oldest first"
    legacy_state, target_state = observed.revisions
    assert legacy_state.layout_key == "old-key"
    assert target_state.layout_key == names.layout_key(CR.spec), "the target's key is the spec's"
    assert (legacy_state.prefill.serving, legacy_state.decode.serving) == (2, 2)
    assert (target_state.prefill.serving, target_state.decode.serving) == (1, 0)
    assert observed.target.prefill == observed.target.decode == 2


def test_the_target_is_the_roles_counts_else_what_a_new_deployment_starts_at():
    spec = make_cr({"prefill": {"replicas": 2}}).spec
    assert (revisions.target(spec, REV).prefill, revisions.target(spec, REV).decode) == (2, 1), \
        "spec.decode.replicas unset: a new deployment's 1"
    observed, _ = revisions.observe(spec, REV, [], [], {}, 1e10, revisions.policy(spec), desired=(2, 5))
    assert (observed.target.prefill, observed.target.decode) == (2, 5), "what the role objects say (/scale)"


def test_without_the_plugin_ready_counts_as_advertised():
    spec = make_cr({"kvTransfer": {"connector": "LMCacheConnectorV1"}}).spec
    observed, _ = revisions.observe(spec, REV, [sts("prefill", 1), sts("decode", 1)],
                                    [pod(f"qwen-prefill-{REV}", 0), pod(f"qwen-decode-{REV}", 0)], None, 1e10,
                                    revisions.policy(spec))
    assert (observed.revisions[0].prefill.serving, observed.revisions[0].decode.serving) == (1, 1)


def test_policy_maps_the_spec_and_defaults_the_startup_budget_to_the_profiles():
    p = revisions.policy(make_cr({"rollout": {"maxSurge": 2, "maxUnavailable": 1, "minAvailablePairs": 3},
                                  "engine": {"drainSeconds": 7}}).spec)
    assert (p.max_surge, p.max_unavailable, p.min_available_pairs, p.drain_seconds) == (2, 1, 3, 7)
    assert p.startup_seconds == CR.spec.profile.startup_seconds
    assert revisions.policy(make_cr({"rollout": {"startupSeconds": 60}}).spec).startup_seconds == 60


def build(role, replicas):
    obj = statefulset(build_children(CR), role)
    obj["spec"]["replicas"] = replicas
    return obj


def test_a_scale_up_applies_the_target_whole_only_where_replicas_change():
    sets = revisions.group([sts("prefill", 2), sts("decode", 1)])
    writes = actions.actions(ScaleUp(REV, 2, 2), "qwen", sets, build)
    assert [type(w).__name__ for w in writes] == ["Apply"]
    assert writes[0].obj["metadata"]["name"] == f"qwen-decode-{REV}" and writes[0].obj["spec"]["replicas"] == 2
    created = actions.actions(ScaleUp(REV, 1, 1), "qwen", [], build)
    assert [w.obj["metadata"]["name"] for w in created] == [f"qwen-prefill-{REV}", f"qwen-decode-{REV}"]


def test_drains_change_only_replicas_and_retire_deletes_the_revision_with_its_launch_scripts():
    old = [sts("prefill", 3, rev="0a0a0a"), sts("decode", 3, rev="0a0a0a")]
    sets = revisions.group(old)
    assert actions.actions(Drain("0a0a0a", 2, 3), "qwen", sets, build) == [actions.Scale("qwen-prefill-0a0a0a", 2)]
    assert actions.actions(Retire("0a0a0a"), "qwen", sets, build) == [
        actions.Delete("StatefulSet", "qwen-prefill-0a0a0a"), actions.Delete("StatefulSet", "qwen-decode-0a0a0a"),
        actions.Delete("ConfigMap", "qwen-launch-0a0a0a")]
    legacy = revisions.group([sts("prefill", 0, rev=None)])
    assert actions.actions(Retire(revisions.LEGACY), "qwen", legacy, build)[-1] == \
        actions.Delete("ConfigMap", "qwen-launch")
    assert actions.describe(Drain("0a0a0a", 2, 3)) == "drain revision 0a0a0a to 2P3D"


def test_the_executor_waits_for_the_watch_to_show_its_own_writes():
    ex = RolloutExecutor(None, None)  # type: ignore[arg-type]
    key = ("ml", "qwen")
    ex.expect(key, f"qwen-prefill-{REV}", "g4")
    assert not ex.caught_up(key, [sts("prefill", 1)]), "generation 3 is older than the write that made 4"
    newer = sts("prefill", 1)
    newer["metadata"]["generation"] = 4
    assert ex.caught_up(key, [newer])
    ex.expect_deleted(key, f"qwen-prefill-{REV}")
    assert not ex.caught_up(key, [newer]), "a StatefulSet it deleted is still listed"
    assert ex.caught_up(key, [])


def test_no_write_once_the_cr_is_gone():
    """The watch can lag a CR's deletion: a step planned then must not recreate what the garbage collector removes."""
    import asyncio

    applied: list[dict] = []

    async def apply(obj):
        applied.append(obj)
        return obj, True

    async def gone() -> bool:
        return False

    ex = RolloutExecutor(None, apply)  # type: ignore[arg-type]
    observed, sets = revisions.observe(CR.spec, REV, [], [], {}, 1e10, revisions.policy(CR.spec))
    report = asyncio.run(ex.advance(("ml", "qwen"), observed, sets, revisions.policy(CR.spec), build, [],
                                    lambda *_: None, gone))
    assert report.plan is None and applied == []
