"""bench/autoscale.py's pure parts: the trace it sends and how it judges an arm from its requests and samples
(start windows, replica-seconds, the reaction to the step, actions at steady load, pooled over rounds)."""
from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("autoscale")


def args(**kw: float) -> argparse.Namespace:
    base = {"base_rate": 1.0, "base_s": 100.0, "step_s": 100.0, "back_s": 200.0, "diurnal_s": 100.0,
            "settle_s": 50.0, "ttft_ms": 1000, "tpot_ms": 100}
    return argparse.Namespace(**{**base, **kw})


def test_arrivals_follow_each_phase_and_are_seeded(bench):
    phases = bench.trace(args())
    plan = bench.arrivals(phases, seed=1)
    assert plan == bench.arrivals(phases, seed=1) != bench.arrivals(phases, seed=2)
    per = {p.name: sum(1 for _, q in plan if q.name == p.name) for p in phases}
    assert 60 <= per["base"] <= 140 and 320 <= per["step"] <= 480 and per["back"] > per["base"]
    assert all(0 <= at < 500 for at, _ in plan) and [at for at, _ in plan] == sorted(at for at, _ in plan)


def sample(s: float, p: int, d: int, ready: tuple[int, int] | None = None) -> dict[str, float]:
    rp, rd = ready or (p, d)
    return {"s": s, "prefill_desired": p, "decode_desired": d, "prefill_pods": p, "decode_pods": d,
            "prefill_ready": rp, "decode_ready": rd}


def test_summary_counts_what_the_goals_read(bench):
    a = args()
    phases = bench.trace(a)
    samples = [sample(0, 1, 1), sample(100, 1, 1), sample(110, 2, 3, ready=(1, 1)), sample(115, 2, 3),
               sample(200, 2, 3), sample(230, 1, 1),  # following the drop: inside back's settle
               sample(300, 2, 1), sample(310, 1, 1),  # two actions in back's steady part
               sample(500, 1, 1)]
    reqs = [{"at": 50.0, "status": 200, "ttft": 0.5, "tpot": 0.05, "error": None},
            {"at": 112.0, "status": 200, "ttft": 5.0, "tpot": 0.05, "error": None},  # in a start window
            {"at": 150.0, "status": 200, "ttft": 2.0, "tpot": 0.05, "error": None},  # misses TTFT
            {"at": 320.0, "status": 503, "ttft": None, "tpot": None, "error": "refused"}]
    s = bench.summarize({"requests": reqs, "samples": samples}, phases, a)
    assert s["start_windows"] == [(110, 115), (300, 300), (110, 115)]
    assert s["outside_start_windows"] == 3 and s["slo_attainment"] == round(1 / 3, 4) and s["failed"] == 1
    assert s["reaction_s"] == 10.0
    assert s["replica_seconds"] == 2 * 100 + 2 * 10 + 5 * 5 + 5 * 85 + 5 * 30 + 2 * 70 + 3 * 10 + 2 * 190
    # steady: base 50-100, step 150-200, back 250-400 (the diurnal hump is never steady)
    assert s["steady_s"] == 250 and s["steady_actions"] == {"prefill": 2, "decode": 0}
    assert s["actions_per_role_per_10min"] == {"prefill": round(2 * 600 / 250, 2), "decode": 0.0}
    pooled = bench.pooled_actions([s, {**s, "steady_actions": {"prefill": 0, "decode": 0}}])
    assert pooled == {"prefill": round(2 * 600 / 500, 2), "decode": 0.0}
