"""An upgraded operator rolls no engine (operator/engine_builders.py, pinned_revision): a running revision keeps the
plugin image it was made with as long as the spec still renders to it, and only a new revision (a change of what
the engines run, or `spec.engine.restartedAt`) takes the operator's current image."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from disagg.operator.api import DisaggregatedInference
from disagg.operator.builders import OperatorImages, build_children, engine_revision
from disagg.operator.engine_builders import (
    RESTARTED_AT_ANNOTATION,
    engine_statefulset,
    pinned_revision,
    plugin_image_of,
)
from disagg.operator.rollout import revisions
from support.crs import child, make_cr, statefulset

A, B = OperatorImages("registry.example/disagg:a"), OperatorImages("registry.example/disagg:b")
EXAMPLES = Path(__file__).resolve().parents[2] / "manifests" / "examples"


def running_under(images: OperatorImages, *crs: DisaggregatedInference) -> list[tuple[str, str]]:
    """(revision, plugin image) of each CR's revision as an operator running `images` made it, newest first."""
    out = []
    for cr in reversed(crs):
        rev = engine_revision(cr, images)
        plugin = plugin_image_of(engine_statefulset(cr, "prefill", images, rev))
        assert plugin is not None
        out.append((rev, plugin))
    return out


def test_a_new_operator_image_keeps_the_running_revision_and_its_plugin():
    cr = make_cr()
    old = engine_revision(cr, A)
    assert engine_revision(cr, B) != old, "the plugin image is part of the pod template, so of the revision"
    pinned = pinned_revision(cr, B, running_under(A, cr))
    assert pinned.revision == old and pinned.images == OperatorImages(B.operator, plugin=A.operator)
    for role in ("prefill", "decode"):
        assert engine_statefulset(cr, role, pinned.images, pinned.revision) == \
            engine_statefulset(cr, role, A, old), "not one field of the engines' StatefulSets changes"
    children = build_children(cr, images=pinned.images, revision=pinned.revision)
    for deployment in ("qwen-router", "qwen-rendezvous"):
        [container] = child(children, "Deployment", deployment)["spec"]["template"]["spec"]["containers"]
        assert container["image"] == B.operator, "the router and rendezvous move with the operator"


def test_a_change_of_what_the_engines_run_takes_the_operators_current_plugin():
    before, after = make_cr(), make_cr({"engine": {"args": ["--max-num-seqs", "8"]}})
    pinned = pinned_revision(after, B, running_under(A, before))
    assert pinned.revision == engine_revision(after, B) and pinned.images == B
    sts = engine_statefulset(after, "decode", pinned.images, pinned.revision)
    assert plugin_image_of(sts) == B.operator


def test_restarted_at_is_the_users_ask_for_a_new_revision_with_the_current_plugin():
    cr = make_cr()
    template = statefulset(build_children(cr), "prefill")["spec"]["template"]
    assert RESTARTED_AT_ANNOTATION not in template["metadata"]["annotations"], \
        "a CR that never asked keeps the revision it had before the field existed"
    restarted = make_cr({"engine": {"restartedAt": "2026-05-04T10:00:00Z"}})
    pinned = pinned_revision(restarted, B, running_under(A, cr))
    assert pinned.revision not in (engine_revision(cr, A), engine_revision(cr, B))
    assert pinned.images == B
    for role in ("prefill", "decode"):
        sts = engine_statefulset(restarted, role, pinned.images, pinned.revision)
        assert sts["spec"]["template"]["metadata"]["annotations"][RESTARTED_AT_ANNOTATION] == "2026-05-04T10:00:00Z"
    again = make_cr({"engine": {"restartedAt": "2026-05-04T11:00:00Z"}})
    assert pinned_revision(again, B, running_under(B, restarted)).revision != pinned.revision, \
        "every new value is a new revision, as kubectl rollout restart's is"


def test_the_previous_spec_applied_again_finds_its_revision_and_plugin_mid_rollout():
    old, new = make_cr(), make_cr({"engine": {"image": "vllm/vllm-openai:v0.33.0"}})
    running = running_under(B, new) + running_under(A, old)  # newest first: B's rollout of `new` under way
    back = pinned_revision(old, B, running)
    assert back.revision == engine_revision(old, A) and back.images.plugin_image == A.operator
    assert pinned_revision(new, B, running).revision == engine_revision(new, B)


def test_where_two_revisions_match_the_one_this_operator_renders_wins_then_the_newest():
    cr = make_cr()
    c = OperatorImages("registry.example/disagg:c")
    both = running_under(A, cr) + running_under(B, cr)
    assert pinned_revision(cr, B, both).images == B
    assert pinned_revision(cr, c, both).images.plugin_image == A.operator
    assert pinned_revision(cr, c, list(reversed(both))).images.plugin_image == B.operator


def test_a_vendor_connector_has_no_plugin_and_no_image_in_its_revision():
    cr = make_cr({"kvTransfer": {"mode": "pull", "connector": "NeuronNixlConnector"}})
    assert engine_revision(cr, A) == engine_revision(cr, B)
    sts = engine_statefulset(cr, "prefill", A, engine_revision(cr, A))
    assert plugin_image_of(sts) is None
    assert pinned_revision(cr, B, []).images == B


def test_each_revisions_plugin_is_read_from_its_statefulsets_newest_first():
    old, new = make_cr(), make_cr({"engine": {"blockSize": 64}})
    sets = []
    for i, (cr, images) in enumerate(((old, A), (new, B))):
        rev = engine_revision(cr, images)
        for role in ("prefill", "decode"):
            sts = engine_statefulset(cr, role, images, rev)
            sts["metadata"]["creationTimestamp"] = f"2026-05-04T10:0{i}:00Z"
            sets.append(sts)
    assert revisions.plugin_images(revisions.group(sets)) == [
        (engine_revision(new, B), B.operator), (engine_revision(old, A), A.operator)]


# What each example renders to under the default images. Changing how the builders render an engine's pod template
# changes these, and then an upgrade to that operator rolls every deployment in the cluster once (safely, through
# the rollout planner, but all at once): make such a change on purpose, and say so in the release notes.
EXAMPLE_REVISIONS = {
    "llama-trn2.yaml": "27563b",
    "qwen3-32b-p5en-2p1d.yaml": "5fb00e",
    "qwen3-32b-p5en.yaml": "266ca2",
    "tiny-cpu.yaml": "5e3db6",
}


@pytest.mark.parametrize("example", sorted(EXAMPLE_REVISIONS))
def test_the_examples_revisions_change_only_on_purpose(example):
    manifest = yaml.safe_load((EXAMPLES / example).read_text())
    manifest["metadata"]["namespace"] = "default"
    cr = DisaggregatedInference.model_validate(manifest)
    assert engine_revision(cr, OperatorImages()) == EXAMPLE_REVISIONS[example], \
        "the engines' pod templates render differently: every deployment rolls when the operator is upgraded"
