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
