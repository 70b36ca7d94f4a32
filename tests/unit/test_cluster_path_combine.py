"""bench/cluster_path.py --combine: runs of the same code pool their requests per cell and arm; other code is
refused."""
from __future__ import annotations

import copy
import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("cluster_path"), importlib.import_module("result_file")


def runs(tmp_path: Path, result_file, commits: tuple[str, str]) -> list[Path]:
    recorded = result_file.load(BENCH / "results" / "cluster_path.json")
    paths = []
    for i, commit in enumerate(commits):
        run = copy.deepcopy(recorded)
        run["commit"], run["config"]["seed"] = commit, 13 + 10 * i
        paths.append(result_file.write(tmp_path / f"run{i}.json", run))
    return paths


def test_runs_of_the_same_code_pool_their_requests(bench, tmp_path):
    cluster_path, result_file = bench
    paths = runs(tmp_path, result_file, ("abc", "abc"))
    one = result_file.load(paths[0])
    pooled = cluster_path.combine(paths)
    head, single = pooled["headline"]["ttft_cluster_over_local"], one["headline"]["ttft_cluster_over_local"]
    for cell, entry in head["per_cell"].items():
        assert entry["n"] == {k: 2 * v for k, v in single["per_cell"][cell]["n"].items()}
        assert entry["p50"] == single["per_cell"][cell]["p50"], "the same requests twice: the same median"
    assert head["per_run"]["p99"] == [single["geomean_p99"]] * 2
    assert [r["seed"] for r in pooled["runs"]] == [13, 23]


def test_runs_of_other_code_are_refused(bench, tmp_path):
    cluster_path, result_file = bench
    with pytest.raises(SystemExit, match="only runs of the same code pool"):
        cluster_path.combine(runs(tmp_path, result_file, ("abc", "def")))
