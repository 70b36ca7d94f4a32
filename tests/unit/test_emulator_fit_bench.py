"""bench/emulator_fit.py's judgement: at which rates the emulator's latency is held to the real pair's."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def fit(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("emulator_fit")


@pytest.mark.parametrize(("rate", "sustained", "judged"), [
    (3.0, True, True),     # under the saturation throughput, sustained in every run
    (3.5, True, False),    # a short step passed for sustained past the knee
    (3.0, False, False),   # a run did not sustain it
])
def test_latency_is_judged_only_below_the_real_pairs_saturation(fit, rate, sustained, judged):
    assert fit.judged(rate, sustained, real_saturation_rps=3.38) is judged
