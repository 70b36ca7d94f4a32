"""Every benchmark result records how it was made: the command, the commit and the machine (with its load), as
bench/result_file.py's provenance() gives them. The scripts are read as text, never imported or run."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
RESULTS = BENCH / "results"
PROVENANCE = ("command", "commit", "machine")
# Writes "command", "commit" and "machine" itself (its commit is dirty only for the files it fits from).
OWN_PROVENANCE = {"emulator_fit.py"}

# Made before results recorded their provenance. Re-running a benchmark replaces its file, and then the file must
# have it: the script that writes it merges result_file.provenance() into its result.
LEGACY = {
    "capacity.json",
    "kv_write.json",
    "operator_scale_1000.json",
    "pd_busy_decode.json",
    "pd_serving.json",
    "pd_serving_router_abba.json",
    "rollout.json",
    "router_stubs.json",
}


def writers() -> list[Path]:
    """The benchmarks that write a result file."""
    return sorted(p for p in BENCH.glob("*.py") if "result_file.write(" in p.read_text())


def test_every_benchmark_that_writes_a_result_records_its_provenance():
    found = writers()
    assert BENCH / "pd_serving.py" in found, "the search for result writers finds nothing: has result_file moved?"
    missing = [p.name for p in found
               if "result_file.provenance()" not in p.read_text() and p.name not in OWN_PROVENANCE]
    assert not missing, f"these write a result without result_file.provenance(): {missing}"


@pytest.mark.parametrize("name", sorted(OWN_PROVENANCE))
def test_a_benchmark_excused_from_provenance_writes_its_own(name):
    text = (BENCH / name).read_text()
    assert "result_file.write(" in text, f"{name} no longer writes a result: drop it from OWN_PROVENANCE"
    assert all(f'"{key}":' in text for key in PROVENANCE), f"{name} no longer writes {PROVENANCE} itself"


def test_every_result_file_records_its_provenance(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    missing = {}
    for name, result in importlib.import_module("result_file").results(RESULTS).items():
        lacks = [key for key in PROVENANCE if not isinstance(result, dict) or key not in result]
        if lacks and name not in LEGACY:
            missing[name] = lacks
    assert not missing, f"results without their provenance (write them with result_file.provenance()): {missing}"


def test_the_machine_names_its_cpu_and_the_features_that_set_an_engines_speed(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(BENCH))
    result_file = importlib.import_module("result_file")
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu avx2 avx512f avx512_bf16 sse\n\n"
                    "processor\t: 1\nmodel name\t: Some CPU\nflags\t\t: fpu avx2 avx512f avx512_bf16 sse\n")
    assert result_file.cpu(info) == {"model": "Some CPU", "flags": ["avx2", "avx512f", "avx512_bf16"]}
    assert result_file.cpu(tmp_path / "none") == {}
    assert result_file.provenance()["machine"]["cpu"] == result_file.cpu()


def test_the_legacy_list_names_only_files_still_without_provenance(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    results = importlib.import_module("result_file").results(RESULTS)
    recorded = sorted(name for name in LEGACY if isinstance(results.get(name), dict)
                      and all(key in results[name] for key in PROVENANCE))
    assert not recorded, f"re-run with their provenance: drop them from LEGACY: {recorded}"
