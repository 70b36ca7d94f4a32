"""bench/cold_pair.py --combine: runs of the same code pool their pairs; runs of other code are refused."""
from __future__ import annotations

import copy
import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def cold_pair(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("cold_pair"), importlib.import_module("result_file")


def split_runs(tmp_path: Path, result_file, recorded: dict, commits: tuple[str, str]) -> list[Path]:
    """The recorded plugin pairs as two runs of their own, each summarized as the bench does."""
    cold_pair = importlib.import_module("cold_pair")
    pairs = recorded["arms"]["plugin"]["pairs"]
    fields = cold_pair.Config.__dataclass_fields__
    cfg = cold_pair.Config(**{k: v for k, v in recorded["config"].items() if k in fields})
    paths = []
    for i, (half, commit) in enumerate(zip((pairs[::2], pairs[1::2]), commits, strict=True)):
        run = copy.deepcopy(recorded)
        run["commit"], run["config"]["seed"] = commit, 5 + i
        summary = cold_pair.summarize(half, cfg)
        run["arms"] = {"plugin": {"arm": "plugin", "pairs": half, "summary": summary}}
        run["headline"] = {"plugin": {k: summary.get(k) for k in cold_pair.HEADLINE}}
        paths.append(result_file.write(tmp_path / f"run{i}.json", run))
    return paths


def test_runs_of_the_same_code_pool_their_pairs(cold_pair, tmp_path):
    bench, result_file = cold_pair
    recorded = result_file.load(BENCH / "results" / "cold_pair.json")
    paths = split_runs(tmp_path, result_file, recorded, ("abc", "abc"))
    pooled = bench.combine(paths)
    every = [p for path in paths for p in result_file.load(path)["arms"]["plugin"]["pairs"]]
    whole = bench.summarize(every, bench.Config(**{k: v for k, v in recorded["config"].items()
                                                   if k in bench.Config.__dataclass_fields__}))
    head = pooled["headline"]["plugin"]
    assert head["cold_over_warm_p50"] == whole["cold_over_warm_p50"]
    assert head["pairs_measured"] == len(every) == recorded["arms"]["plugin"]["summary"]["pairs_measured"]
    assert head["per_run"] == [result_file.load(p)["headline"]["plugin"]["cold_over_warm_p50"] for p in paths]
    assert [r["seed"] for r in pooled["runs"]] == [5, 6]


def test_runs_of_other_code_are_refused(cold_pair, tmp_path):
    bench, result_file = cold_pair
    recorded = result_file.load(BENCH / "results" / "cold_pair.json")
    with pytest.raises(SystemExit, match="only runs of the same code pool"):
        bench.combine(split_runs(tmp_path, result_file, recorded, ("abc", "def")))
