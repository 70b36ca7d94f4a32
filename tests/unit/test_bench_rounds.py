"""bench/pd_serving.py's ABBA rounds: the running order, and one cell's rounds pooled into one summary."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def pd(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("pd_serving")


def cell_round(ttfts_ms: list[float | None], handoffs_ms: list[float | None], throughput: float) -> dict:
    """A round's cell summary as run_cell writes it; a TTFT of None is a failed request."""
    rows = [[i, t is not None, t, None, None if t is None else t + 100, 16, None if t is not None else "HTTP 502",
             1000.0 + i, h] for i, (t, h) in enumerate(zip(ttfts_ms, handoffs_ms, strict=True))]
    ok = [t for t in ttfts_ms if t is not None]
    return {"cell": "256tok@1/s", "prompt_tokens": 256, "rate_rps": 1.0, "planned": len(rows), "sent": len(rows),
            "ok": len(ok), "failed": len(rows) - len(ok), "timeouts": 0,
            "errors": ["HTTP 502"] if len(ok) < len(rows) else [], "ttft": {"p50_ms": sorted(ok)[len(ok) // 2]},
            "throughput_rps": throughput, "output_tokens_per_s": throughput * 16, "wall_s": 10.0,
            "arrival_span_s": 9.0, "cpu": {"foreign_cores": throughput / 10}, "requests": rows,
            "handoff": {"p50_ms": 1.0, "source": "our router's access log"}}


def test_abba_reverses_the_order_every_other_round(pd):
    assert [(r, a) for r, a in pd.abba(["a", "b", "c"], 4)] == [
        (0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a"),
        (2, "a"), (2, "b"), (2, "c"), (3, "c"), (3, "b"), (3, "a")]
    assert pd.abba(["a", "b"], 1) == [(0, "a"), (0, "b")]


def test_one_round_is_returned_unchanged(pd):
    only = cell_round([10.0, 20.0], [1.0, 2.0], 1.0)
    assert pd.merge_rounds([only]) is only


def test_rounds_pool_their_requests(pd):
    first = cell_round([10.0, 20.0, 30.0], [1.0, 2.0, 3.0], 1.0)
    second = cell_round([40.0, None, 60.0], [4.0, None, 6.0], 0.5)
    merged = pd.merge_rounds([first, second])
    assert (merged["planned"], merged["ok"], merged["failed"]) == (6, 5, 1)
    assert [row[0] for row in merged["requests"]] == [0, 1, 2, 3, 4, 5], "indices are unique across rounds"
    # The pooled median of 10, 20, 30, 40, 60 is neither round's own median (20 and 50).
    assert merged["ttft"]["p50_ms"] == 30.0 and merged["ttft"]["n"] == 5
    assert merged["handoff"]["p50_ms"] == 3.0 and merged["handoff"]["source"] == "our router's access log"
    assert merged["throughput_rps"] == 0.75 and merged["cpu"]["foreign_cores"] == 0.075
    assert merged["errors"] == ["HTTP 502"]
    assert [r["throughput_rps"] for r in merged["rounds"]] == [1.0, 0.5]
    assert all("requests" not in r for r in merged["rounds"])


def test_cluster_path_splits_ttft_into_the_routers_parts(pd):
    """Client TTFT 60 ms, router: prefill answered at 30 ms and first token relayed at 48 ms after its receipt."""
    cluster_path = importlib.import_module("cluster_path")
    rows = [[0, True, 60.0, None, 200.0, 16, None, 1.0, 18.0, 30.0, 48.0],
            [1, True, 80.0, None, 220.0, 16, None, 2.0, 20.0, None, None],  # no access-log record: left out
            [2, False, None, None, None, 0, "HTTP 502", 3.0, None, None, None]]
    arm = pd.ArmResult("a", "cluster", "d", cells=[{"cell": "256tok@1/s", "requests": rows}])
    assert cluster_path.breakdown(arm) == {"256tok@1/s": {
        "n": 1, "router_to_prefill_answered": 30.0, "handoff": 18.0, "client_router_path": 12.0}}


def test_tpot_is_the_time_per_token_after_the_first(pd):
    # cell_round's requests: 16 tokens, end-to-end = TTFT + 100 ms, so TPOT = 100 / 15 ms.
    merged = pd.merge_rounds([cell_round([10.0, 20.0], [1.0, 2.0], 1.0), cell_round([30.0], [3.0], 1.0)])
    assert merged["tpot"]["n"] == 3 and merged["tpot"]["p50_ms"] == round(100 / 15, 1)
    assert pd.per_request(merged, "tpot") == pytest.approx([100 / 15] * 3)
    assert pd.tpot(0.01, 0.5, 1) is None and pd.tpot(None, 0.5, 16) is None
    assert pd.tpot(0.1, 0.4, 4) == pytest.approx(0.1)


def test_push_and_pull_phases_alternate_abba_between_stub_and_mono(pd):
    assert pd.phase_schedule(["mono", "pull", "push", "stub"], 2) == [
        (0, "stub"), (0, "push"), (0, "pull"), (1, "pull"), (1, "push"), (0, "mono")]
    assert pd.phase_schedule(["pull"], 3) == [(0, "pull"), (1, "pull"), (2, "pull")]
    assert pd.phase_schedule(["stub", "mono"], 4) == [(0, "stub"), (0, "mono")]


def test_segments_of_one_arm_pool_per_cell_by_name(pd):
    a = cell_round([10.0, 20.0], [1.0, 2.0], 1.0)
    b = {**cell_round([30.0, 40.0], [3.0, 4.0], 1.0), "cell": "1024tok@1/s"}
    first = pd.ArmResult("router-pull", "pull", "d", warmup=[{"ok": True}], cells=[a, b])
    second = pd.ArmResult("router-pull", "pull", "d", warmup=[{"ok": False}], cells=[b, a],
                          skipped="aborted in 1024tok@1/s")
    merged = pd.merge_segments([first, second])
    assert [c["cell"] for c in merged.cells] == ["256tok@1/s", "1024tok@1/s"]
    assert [c["ok"] for c in merged.cells] == [4, 4]
    assert merged.cells[1]["ttft"]["p50_ms"] == 35.0
    assert merged.warmup == [{"ok": True}, {"ok": False}] and merged.skipped == "aborted in 1024tok@1/s"
    assert pd.merge_segments([first]).cells == [a, b]


def test_a_cell_pooled_over_phase_rounds_of_abba_rounds_is_judged_per_run(pd):
    """--rounds 2 --phase-rounds 2: each phase's two rounds are merged, then the phases' cells. The rate is
    sustained when each run kept up, whatever the nesting."""
    def run(throughput: float) -> dict:
        return {**cell_round([10.0] * 25, [1.0] * 25, throughput), "arrival_span_s": 24.0}

    kept = pd.merge_rounds([pd.merge_rounds([run(0.98), run(0.97)]), pd.merge_rounds([run(0.99), run(0.98)])])
    assert kept["planned"] == 100 and kept["runs"] == 4
    assert pd.sustained(kept)  # 0.98 req/s against 25 / (24 s + 0.11 s) = 1.04
    fell_behind = pd.merge_rounds([pd.merge_rounds([run(0.5), run(0.5)]), pd.merge_rounds([run(0.5), run(0.5)])])
    assert not pd.sustained(fell_behind)
