"""bench/autoscale_sim.py, the planner's whole-trace simulation: its fleet serves every request, a fixed fleet costs
its size, and the planner in the loop settles on a steady load (the hysteresis the planner's own tests state, here
over a whole trace of Poisson arrivals)."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def sim(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("autoscale_sim")


def test_a_fixed_fleet_serves_every_request_and_costs_its_size(sim):
    args = sim.parser().parse_args(["--seeds", "2"])
    runs, sims = sim.simulate(args, schedule=[(0.0, 3, 3)])
    for run, s in zip(runs, sims, strict=True):
        summary = run["summary"]
        assert summary["failed"] == 0 and summary["requests"] == len(s.reqs) > 200
        assert summary["replica_seconds"] == pytest.approx(6 * s.end, abs=6)
        # Three of each carry the 4x step: nearly every request within both targets.
        assert summary["slo_attainment"] >= 0.97


def test_the_planner_follows_the_step_and_settles_on_a_steady_load(sim):
    # A long steady tail after the step: from 90 s into it, at most one action per role.
    args = sim.parser().parse_args(["--seeds", "3", "--back-s", "600", "--diurnal-s", "0"])
    runs, _ = sim.simulate(args)
    for run in runs:
        summary = run["summary"]
        assert summary["failed"] == 0
        assert summary["reaction_s"] is not None and summary["reaction_s"] <= 30
        assert summary["peak_pods"]["prefill"] >= 2 and summary["peak_pods"]["decode"] >= 2
        assert all(n <= 1 for n in summary["steady_actions"].values()), summary["steady_actions"]
