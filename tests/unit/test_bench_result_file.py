"""bench/result_file.py: result files keep each request row on one line and read back unchanged."""
from __future__ import annotations

import importlib
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_rows_stay_on_one_line_and_the_file_reads_back_equal(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    result_file = importlib.import_module("result_file")
    result = {"cells": [{"requests": [[0, True, 48.2, None, "a \"b\""], [1, False, None, None, "x"]],
                         "ttft": {"p50_ms": 1.5, "ci": [0.9, 1.1]}, "empty": [], "none": {}}], "n": 3}
    text = result_file.dumps(result)
    assert json.loads(text) == result
    lines = [line.strip() for line in text.splitlines()]
    assert '[0, true, 48.2, null, "a \\"b\\""],' in lines
    assert '"ci": [0.9, 1.1]' in lines
    assert len(lines) == 17
