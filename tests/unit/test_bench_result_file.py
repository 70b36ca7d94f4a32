"""bench/result_file.py: result files keep each request row on one line and read back unchanged; a result past the
bound is stored gzipped instead, under either name, and every committed result is stored the way its size says."""
from __future__ import annotations

import gzip
import importlib
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
RESULTS = BENCH / "results"


@pytest.fixture
def result_file(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("result_file")


def test_rows_stay_on_one_line_and_the_file_reads_back_equal(result_file):
    result = {"cells": [{"requests": [[0, True, 48.2, None, "a \"b\""], [1, False, None, None, "x"]],
                         "ttft": {"p50_ms": 1.5, "ci": [0.9, 1.1]}, "empty": [], "none": {}}], "n": 3}
    text = result_file.dumps(result)
    assert json.loads(text) == result
    lines = [line.strip() for line in text.splitlines()]
    assert '[0, true, 48.2, null, "a \\"b\\""],' in lines
    assert '"ci": [0.9, 1.1]' in lines
    assert len(lines) == 17


def test_a_result_past_the_bound_is_gzipped_and_reads_back_under_either_name(result_file, tmp_path):
    small, large = {"rows": [[0, 1.5]]}, {"rows": [[i, i * 1.5, "ok"] for i in range(200)]}
    bound = len(result_file.dumps(small)) + 1
    plain = tmp_path / "x.json"
    assert result_file.write(plain, small, bound) == plain and plain.read_text() == result_file.dumps(small) + "\n"
    assert result_file.load(plain) == result_file.load(tmp_path / "x.json.gz") == small
    packed = result_file.write(plain, large, bound)
    assert packed == tmp_path / "x.json.gz" and not plain.exists(), "the stale plain form is removed"
    assert gzip.decompress(packed.read_bytes()).decode() == result_file.dumps(large) + "\n"
    assert result_file.load(plain) == result_file.load(packed) == large
    first = packed.read_bytes()
    assert first[4:8] == bytes(4), "no timestamp in the gzip header"
    assert result_file.write(packed, large, bound) == packed and packed.read_bytes() == first, "same result, same bytes"
    assert result_file.write(packed, small, bound) == plain and not packed.exists(), "the stale gzipped form is removed"
    assert result_file.results(tmp_path) == {"x.json": small}
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"], "no temporary file left"


def test_a_result_stored_both_ways_is_refused(result_file, tmp_path):
    (tmp_path / "x.json").write_text("{}\n")
    (tmp_path / "x.json.gz").write_bytes(gzip.compress(b"{}\n"))
    with pytest.raises(ValueError, match="x.json"):
        result_file.results(tmp_path)


def test_every_committed_result_is_plain_under_the_bound_or_gzipped_over_it(result_file):
    stored = {p.name: p.stat().st_size for p in RESULTS.iterdir() if p.name.endswith((".json", ".json.gz"))}
    for name, size in stored.items():
        if name.endswith(".gz"):
            size = len(gzip.decompress((RESULTS / name).read_bytes()))
            assert size > result_file.MAX_PLAIN_BYTES, f"{name} is {size} bytes unpacked: small enough to store plain"
        else:
            assert size <= result_file.MAX_PLAIN_BYTES, f"{name} is {size} bytes: write it with result_file.write"
    assert set(result_file.results(RESULTS)) == {name.removesuffix(".gz") for name in stored}
