"""bench/kv_routing.py's pure parts: the workloads it sends, the order of its arms, and how its headline judges
issue 36's goals (an arm whose router applied no KV events does not count)."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def kv(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("kv_routing")


def test_workloads_are_seeded_and_shaped_as_the_docstring_says(kv):
    shape = kv.Shape(system_prompts=3, system_tokens=256, question_tokens=16, conversations=4, turns=3,
                     context_tokens=128, message_tokens=32)
    shared = kv.workload("shared", shape, 20, 5, seed=1)
    assert shared == kv.workload("shared", shape, 20, 5, seed=1) != kv.workload("shared", shape, 20, 5, seed=2)
    assert len({r.prompt[:256] for r in shared}) <= 3 and len({r.prompt for r in shared}) == len(shared)
    assert all(b.arrival >= a.arrival for a, b in zip(shared, shared[1:], strict=False))
    unique = kv.workload("unique", shape, 20, 5, seed=1)
    assert len({r.prompt[:128] for r in unique}) == len(unique)
    turns = kv.workload("conversation", shape, 20, 5, seed=1)
    assert [t.turn.slot for t in turns[:8]] == [0, 1, 2, 3, 0, 1, 2, 3]
    # Each slot opens a conversation, goes on for `turns` turns, then opens the next.
    assert [t.turn.first for t in turns if t.turn.slot == 0][:7] == [True, False, False, True, False, False, True]
    assert all(len(t.turn.context) == 128 for t in turns if t.turn.first)


def test_arms_rotate_and_reverse_from_round_to_round(kv):
    assert [kv.arm_order(list("ABC"), r) for r in range(4)] == [list("ABC"), list("CBA"), list("BCA"),
                                                                 list("ACB")]
    assert kv.tag("push", "a", 0, "shared") != kv.tag("push", "b", 0, "shared") != kv.tag("pull", "a", 0, "shared")


def segment(kv, arm: str, workload: str, ttft: float, events: float = 10.0, cpu: float = 1.0) -> dict:
    rows = [[i * 0.1, 200, ttft, i * 0.1 + 0.5, 16, 1000, 500, 500, 0, 0.0] for i in range(20)]
    ours = arm != kv.PEER
    return {"arm": arm, "workload": workload, "valid": events > 0 or arm not in kv.PREFIX_ARMS,
            "requests": rows, "wall_s": 2.5, "router_cpu_s": cpu, "ok": 20,
            "kv_events_applied": events if ours else None,
            "prefix": {"predicted_sum": 10000, "actual_sum": 10000, "decode_only": 0} if ours else None,
            "tokenize": {"requests": 20 if arm in kv.PREFIX_ARMS else 0, "wall_s": 0.04},
            "prompt_tokens_computed_per_request": 500.0}


def test_the_headline_judges_each_goal_and_leaves_out_arms_without_events(kv):
    segs = []
    for w in kv.WORKLOADS:
        segs += [segment(kv, "least-loaded", w, 100.0), segment(kv, "prefix-aware", w, 40.0 if w != "unique" else 101.0,
                                                                cpu=1.2),
                 segment(kv, "prefix-aware-decode-only", w, 30.0, events=0.0), segment(kv, kv.PEER, w, 60.0)]
    head = kv.headline({"pull": {"segments": segs}}, boot=50, seed=0)
    goals = {(g["workload"], g["measure"]): g for g in head["goals"]}
    assert goals[("shared", "prefix-aware / least-loaded TTFT p50")]["value"] == 0.4
    assert goals[("shared", "prefix-aware / least-loaded TTFT p50")]["met"] is True
    assert goals[("conversation", "prefix-aware / vllm-router cache_aware TTFT p50")]["met"] is True  # 0.667
    assert goals[("unique", "prefix-aware / least-loaded TTFT p50")]["met"] is True  # 1.01
    assert goals[("all", "prefix-aware / least-loaded router CPU per request")]["value"] == 1.2
    assert goals[("all", "prefix-aware: predicted / reported cached tokens")]["met"] is True
    # No events: no valid segment, so no figure and no verdict.
    assert goals[("shared", "prefix-aware-decode-only / least-loaded TTFT p50")]["value"] is None
    assert goals[("shared", "prefix-aware-decode-only / least-loaded TTFT p50")]["met"] is None


def test_the_results_table_reads_the_headlines_goals(kv):
    table = importlib.import_module("results_table")
    segs = [segment(kv, a, w, 50.0) for a in ("least-loaded", "prefix-aware") for w in kv.WORKLOADS]
    result = {"benchmark": "kv_routing", "headline": kv.headline({"push": {"segments": segs}}, boot=20, seed=0)}
    rows = table.rows({"kv_routing.json": result})
    assert len(rows) == len(result["headline"]["goals"]) > 0
    assert all(r.goal is not None for r in rows)


def test_a_real_engine_runs_rows_say_so(kv):
    table = importlib.import_module("results_table")
    segs = [segment(kv, a, w, 50.0) for a in ("least-loaded", "prefix-aware") for w in kv.WORKLOADS]
    head = kv.headline({"push": {"segments": segs}}, boot=20, seed=0)
    real = table.rows({"kv_routing_real.json": {"benchmark": "kv_routing", "config": {"engines": "real"},
                                                 "headline": head}})
    emulated = table.rows({"kv_routing.json": {"benchmark": "kv_routing", "config": {"engines": "emulated"},
                                                "headline": head}})
    assert [r.measure for r in real] == [f"real 1P1D, {r.measure}" for r in emulated]
