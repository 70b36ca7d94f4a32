"""The generated results sections (the full table in docs/results.md, its headline rows in the README) are what
bench/results/ says (bench/report.py), and the table judges goals by the figures, not by hand."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("report"), importlib.import_module("results_table")


@pytest.mark.parametrize("generated", ["README.md", "docs/results.md"])
def test_each_generated_section_is_what_the_committed_results_say(bench, generated):
    report, _ = bench
    path = report.ROOT / generated
    assert path in report.sections(report.load()), f"bench/report.py no longer generates {generated}"
    assert report.current(path.read_text()) == report.sections(report.load())[path], \
        f"{generated}'s results section drifted from bench/results/: run .venv/bin/python bench/report.py"


def test_a_drifted_or_unmarked_file_is_caught(bench, tmp_path):
    report, _ = bench
    fresh, stale, unmarked = (tmp_path / f"{n}.md" for n in ("fresh", "stale", "unmarked"))
    fresh.write_text(f"intro\n{report.BEGIN}\n| row | 1 |\n{report.END}\n")
    stale.write_text(f"intro\n{report.BEGIN}\n| row | 2 |\n{report.END}\n")
    unmarked.write_text("| row | 1 |\n")
    expected = {p: "| row | 1 |\n" for p in (fresh, stale, unmarked, tmp_path / "missing.md")}
    assert report.drifted(expected) == [stale, unmarked, tmp_path / "missing.md"]


def test_the_readme_shows_headline_rows_of_the_full_table_and_links_to_it(bench):
    report, table = bench
    results = report.load()
    full, excerpt = report.section(results), report.headline_section(results)
    rows = [line for line in excerpt.splitlines() if line.startswith("| `")]
    assert len(rows) == len(table.HEADLINE)
    assert set(rows) <= set(full.splitlines()), "a headline row the full table does not have"
    assert "[docs/results.md](docs/results.md)" in excerpt


def test_a_headline_row_the_results_no_longer_give_is_an_error(bench):
    report, table = bench
    rows = table.rows(report.load())
    assert table.headline(rows) == [next(r for r in rows if (r.source, r.measure) == key) for key in table.HEADLINE]
    with pytest.raises(ValueError, match="headline rows not in the results"):
        table.headline([r for r in rows if r.source != "soak.json"])


def rollout_result(failed: int) -> dict:
    return {"benchmark": "rollout", "headline": {
        "failed_requests": failed, "requests": 100,
        "changes": {"block-size": {"failed": failed, "requests": 30, "rollout_s": 90.0, "steps": 4,
                                   "ttft_p99_over_steady": 2.5, "ttft_p99_over_steady_ci90": [1.5, 3.1]}}}}


def test_a_failed_request_fails_the_rollout_goal(bench):
    _, table = bench
    ok, bad = (table.rows({"rollout.json": rollout_result(n)}) for n in (0, 1))
    assert [r.met for r in ok if r.goal] == [True]
    assert [r.met for r in bad if r.goal] == [False]
    assert "**no**" in table.markdown(bad, {"rollout.json": "today"})
    during = next(r for r in ok if r.measure.startswith("block-size"))
    assert (during.value, during.ci90, during.goal) == (2.5, (1.5, 3.1), None)


def test_histogram_interpolated_ratios_are_never_rows(bench):
    report, table = bench
    rows = table.rows({"pd_serving.json": report.load()["pd_serving.json"]})
    assert rows and not [r for r in rows if "handoff" in r.measure and "exact" not in r.measure]


def test_a_result_nobody_can_read_is_an_error(bench):
    _, table = bench
    with pytest.raises(ValueError, match="no table rows for benchmark 'mystery'"):
        table.rows({"mystery.json": {"benchmark": "mystery"}})


def test_the_section_is_replaced_between_its_markers_and_nowhere_else(bench):
    report, _ = bench
    text = f"intro\n{report.BEGIN}\nold\n{report.END}\noutro\n"
    assert report.replaced(text, "new\n") == f"intro\n{report.BEGIN}\nnew\n{report.END}\noutro\n"
    with pytest.raises(ValueError, match="markers"):
        report.replaced("no markers here", "new\n")


def capacity_result(poll_rps: float, spin_rps: float) -> dict:
    steps = {"256tok@1/s": {"p50": 0.8, "p50_ci90": [0.6, 0.9], "p99": 0.7, "p99_ci90": [0.5, 1.1]}}
    return {"benchmark": "capacity", "config": {"rates": [1.0, 2.0], "requests_per_step": 40, "idle_s": 5.0},
            "headline": {"saturation_rps": {"push-poll": poll_rps, "push-spin": spin_rps},
                         "idle_engine_cores": {"push-poll": 0.05, "push-spin": 1.6},
                         "push_poll_over_spin": {"saturation": round(poll_rps / spin_rps, 3), "ttft": steps}}}


def test_polling_must_not_lose_capacity_against_spinning(bench):
    _, table = bench
    better, worse = (table.rows({"capacity.json": capacity_result(p, 2.0)}) for p in (3.0, 1.5))
    assert [r.met for r in better if r.goal] == [True]
    assert [r.met for r in worse if r.goal] == [False]
    ttft = next(r for r in better if r.measure.startswith("push: TTFT p50"))
    assert (ttft.value, ttft.ci90) == (0.8, (0.6, 0.9))


def test_a_run_of_some_arms_gives_rows_for_those_only(bench):
    """A pull-only run (pd_serving --arms ...) has no push ratios: they are null, not rows, and not a crash."""
    _, table = bench
    ratio = {"per_cell": {"256tok@2/s": {"p50": 0.99}}, "geomean_p50": 0.99, "geomean_p99": 0.94,
             "geomean_p50_ci90": [0.96, 1.03]}
    result = {"benchmark": "pd_serving", "config": {"cells": ["256tok@2/s"], "requests_per_cell": 25, "rounds": 4},
              "headline": {"ttft_router_pull_over_vllm_router_pull": ratio, "ttft_push_concurrent_over_pull": None,
                           "failures": {}}}
    rows = table.rows({"pull_only.json": result})
    assert {r.measure for r in rows if "TTFT" in r.measure} == {
        "our router / vllm-router TTFT (pull pair), p50", "our router / vllm-router TTFT (pull pair), p99"}
    assert all("100 requests (4 ABBA rounds)" in r.n for r in rows if "TTFT" in r.measure)


def busy_kv_result(cells: dict[str, dict]) -> dict:
    return {"benchmark": "pd_serving", "config": {"kv_bytes_per_token": 64 * 1024, "max_tokens": 128,
                                                  "cells": list(cells), "requests_per_cell": 50, "phase_rounds": 2},
            "headline": {"handoff_direct_push_over_direct_pull": {"per_cell": cells},
                         "ttft_direct_push_over_direct_pull": {"per_cell": cells}}}


def test_kv_realistic_busy_decode_goals_are_judged_cell_by_cell_on_sustained_rates_only(bench):
    _, table = bench
    rows = table.rows({"busy.json": busy_kv_result({
        "256tok@1/s": {"p50": 0.4, "p99": 0.7, "p50_ci90": [0.3, 0.5], "sustained": True},
        "256tok@3/s": {"p50": 2.0, "p99": 3.0, "sustained": False}})})
    handoff = {r.measure: r for r in rows if "handoff" in r.measure}
    assert handoff["push / pull handoff (exact, no router), 256tok@1/s, p50"].met is True
    assert handoff["push / pull handoff (exact, no router), 256tok@1/s, p50"].ci90 == (0.3, 0.5)
    assert handoff["push / pull handoff (exact, no router), 256tok@1/s, p99"].met is False
    unsustained = [r for r in rows if "256tok@3/s" in r.measure]
    assert unsustained and all(r.goal is None and "not sustained" in r.n for r in unsustained)
    ttft = next(r for r in rows if r.measure == "push / pull TTFT, decode busy (no router), 256tok@1/s, p50")
    assert (ttft.met, ttft.n) == (True, "100 requests")


def test_each_direct_arms_handoff_is_also_counted_in_its_requests_own_decode_steps(bench):
    _, table = bench

    def request(ttft: float, e2e: float, handoff: float | None, ok: bool = True) -> list:
        return [0, ok, ttft, 50.0, e2e, 11, None, 0.0, handoff]  # 11 tokens: TPOT = (e2e - ttft) / 10

    result = busy_kv_result({"256tok@1/s": {"p50": 0.6}, "256tok@2/s": {"p50": 0.6}})
    result["arms"] = {
        "direct-push": {"cells": [
            {"cell": "256tok@2/s", "requests": [request(100, 400, 60), request(100, 300, 40)]},  # 2 steps each
            {"cell": "256tok@1/s", "requests": [request(100, 300, 20), request(100, 300, 20),
                                                request(100, 300, 900, ok=False)]}]},  # 1 step; a failure is left out
        "direct-pull": {"cells": [{"cell": "256tok@1/s", "requests": [request(100, 300, 60), request(100, 100, 5)]}]},
    }
    rows = {r.measure: r for r in table.rows({"busy.json": result})}
    push = rows["push handoff in decode steps (handoff / the request's TPOT), p50"]
    assert (push.value, push.unit, push.n) == (1.41, "steps", "geomean over cells: 256tok@1/s 1.00, 256tok@2/s 2.00")
    pull = rows["pull handoff in decode steps (handoff / the request's TPOT), p50"]  # e2e == ttft: no TPOT, left out
    assert pull.value == 3.0


def operator_scale_result(crs: int, ready: int) -> dict:
    return {"benchmark": "operator_scale", "crs": crs, "nodes": 2 * crs, "solo_crs": 0,
            "children_exist_seconds": {"p99": 50.0}, "ready_seconds": {"p50": 60.0}, "ready_crs": ready,
            "timeout_seconds": 600.0,
            "all_ready_seconds": 100.0 if ready == crs else None, "created_all_seconds": 20.0,
            "create_concurrency": 8, "operator_peak_rss_mib": 200}


def test_a_burst_the_bench_gave_up_on_fails_its_ready_goal(bench):
    _, table = bench
    done, given_up = (table.rows({"operator_scale.json": operator_scale_result(1000, n)}) for n in (1000, 990))
    ready = next(r for r in done if r.measure == "all CRs Ready")
    assert (ready.value, ready.met) == (100.0, True), "1,000 CRs have 120 s"
    median = next(r for r in given_up if r.measure == "burst: create to Ready, p50")
    assert (median.value, median.n) == (60.0, "990 CRs Ready of 1000")
    gave_up = next(r for r in given_up if r.measure == "CRs Ready when the bench gave up")
    assert (gave_up.value, gave_up.met) == (990, False)
    assert not any(r.measure == "all CRs Ready" for r in given_up)


def test_a_floor_run_shows_the_control_plane_alone_beside_the_operator(bench):
    _, table = bench
    result = {**operator_scale_result(1000, 1000),
              "burst_control_plane_cpu_seconds": {"kube-apiserver": 300.0, "etcd": 50.0},
              "floor": {"apply_concurrency": 8, "all_ready_seconds": 80.0,
                        "control_plane_cpu_seconds": {"kube-apiserver": 200.0, "etcd": 40.5}}}
    rows = {r.measure: r for r in table.rows({"operator_scale.json": result})}
    assert rows["control plane alone: all Ready"].value == 80.0
    assert rows["control plane alone: its CPU"].value == 240.5
    assert rows["control plane's CPU with the operator"].value == 350.0
    assert rows["all Ready: with the operator / control plane alone"].value == 1.25
    without = {r.measure for r in table.rows({"operator_scale.json": operator_scale_result(1000, 1000)})}
    assert not any(m.startswith("control plane") for m in without)


def test_the_idle_goal_judges_the_operators_writes_not_the_controllers(bench):
    _, table = bench
    result = {**operator_scale_result(1000, 1000), "idle_objects_watched": 12000, "idle_objects_changed": 599,
              "idle_objects_changed_by_operator": 0}
    rows = {r.measure: r for r in table.rows({"operator_scale.json": result})}
    assert rows["objects the operator changed in an idle resync"].met is True
    anyone = rows["objects anyone changed in that window"]
    assert (anyone.value, anyone.goal) == (599, None)
    del result["idle_objects_changed_by_operator"]  # a result from before the audit log named the writer
    older = {r.measure: r for r in table.rows({"operator_scale.json": result})}
    assert older["objects changed by an idle resync"].met is False


def overload_result(p99: float, failed: int, rss: float) -> dict:
    arms = {"sent": 1000, "ok": 800, "refused_429": 200 - failed, "failed": failed, "refused_share": 0.2,
            "served_rps_mean": 30.0, "router_cpu_s_per_arm": 1.0}
    return {"benchmark": "overload", "config": {"factor": 5, "unbounded_s": 20}, "runs": [{}, {}, {}], "beds": {
        "emulator": {"saturation_rps": [30, 32, 30], "per_run": [{"overload_over_saturation_p99": p99}] * 3,
                     "headline": {"saturation": arms, "overload": arms, "unbounded": arms,
                                  "overload_over_saturation_p99": p99, "overload_over_saturation_p99_ci90": [1.1, 1.9],
                                  "overload_over_saturation_p50": 1.2, "overload_over_saturation_p50_ci90": None,
                                  "overload_served_over_saturation_served": 0.97,
                                  "bounded_rss_after_over_before": rss, "bounded_rss_max_kib": 80 * 1024,
                                  "unbounded_over_saturation_p99": 30.0, "unbounded_rss_max_over_first": 1.8}}}}


def test_overload_goals_are_the_admitted_p99_no_failures_but_429s_and_a_flat_rss(bench):
    _, table = bench
    good = table.rows({"overload.json": overload_result(1.5, 0, 1.02)})
    assert [(r.measure, r.met) for r in good if r.goal] == [
        ("emulator: admitted TTFT p99 at 5x saturation / at saturation", True),
        ("emulator: failed requests other than 429", True),
        ("emulator: router RSS after / before the 5x arms", True)]
    assert next(r for r in good if r.goal).ci90 == (1.1, 1.9)
    bad = table.rows({"overload.json": overload_result(2.5, 1, 1.3)})
    assert [r.met for r in bad if r.goal] == [False, False, False]
    # The router without bounds is shown beside it, judged by nothing.
    assert [r.goal for r in good if "no bounds" in r.measure] == [None, None]


def autoscale_result(slo: float, reaction: float, actions: float, ratio: float, failed: int = 0,
                     replica_seconds: int = 100) -> dict:
    def arm(s: float, r: float | None, a: float, rs: int = 100) -> dict:
        return {"failed": failed, "slo_attainment": [s, 0.999], "replica_seconds": [rs, rs + 10],
                "reaction_s": [r, 12.0], "actions_per_role_per_10min": [{"prefill": a, "decode": 0.0}] * 2}
    return {"benchmark": "autoscale", "headline": {
        "planner": arm(slo, reaction, actions, replica_seconds), "static": arm(1.0, None, 0.0),
        "keda": arm(0.99, 80.0, 3.0), "planner_over_static_replica_seconds": ratio,
        "keda_over_static_replica_seconds": 0.7}}


def test_autoscale_judges_the_planner_and_shows_keda_and_the_static_fleet_beside_it(bench):
    _, table = bench
    good = table.rows({"autoscale.json": autoscale_result(0.995, 20.0, 0.5, 0.55, replica_seconds=90)})
    judged = [(r.measure, r.met) for r in good if r.goal]
    assert judged == [("planner: SLO attainment outside engine starts, worst round", True),
                      ("planner: failed requests", True),
                      ("planner: step to the first rise of a desired count, slowest round", True),
                      ("planner: scaling actions per role per 10 min at steady load, most", True),
                      ("planner / static fleet sized for the peak: replica-seconds", True),
                      ("planner - KEDA arm: SLO attainment, mean of rounds", True),
                      ("planner / KEDA arm: replica-seconds", True)]
    assert not [r for r in good if r.goal and not r.measure.startswith("planner")]
    assert any(r.measure.startswith("keda / static") for r in good)
    # worse than KEDA's SLO attainment at more replica-seconds: the "matches or beats" fails twice
    bad = table.rows({"autoscale.json": autoscale_result(0.98, 45.0, 2.0, 0.8, failed=3, replica_seconds=200)})
    assert [r.met for r in bad if r.goal] == [False] * 7


def test_repeated_runs_are_judged_on_their_median_and_a_baseline_shows_as_ratios(bench, monkeypatch):
    _, table = bench
    monkeypatch.syspath_prepend(str(Path(table.__file__).parent))
    scale = importlib.import_module("operator_scale")
    assert scale.abba(["current", "baseline"], 3) == ["current", "baseline", "baseline", "current", "current",
                                                      "baseline"]
    runs = [{**operator_scale_result(100, 100), "arm": "current", "all_ready_seconds": s,
             "children_exist_seconds": {"p50": 1.0, "p99": p99}} for s, p99 in ((25.0, 3.0), (33.0, 9.0), (27.0, 4.0))]
    merged = scale.median_of(runs)
    assert (merged["all_ready_seconds"], merged["children_exist_seconds"]["p99"]) == (27.0, 4.0)
    assert merged["all_ready_seconds_runs"] == [25.0, 33.0, 27.0]
    short = scale.median_of([*runs, {**operator_scale_result(100, 97), "arm": "current"}])
    assert (short["ready_crs"], short["all_ready_seconds"]) == (97, None), "one run short of Ready: not met"
    baseline = [{**r, "arm": "baseline", "all_ready_seconds": 2 * r["all_ready_seconds"]} for r in runs]
    result = {**merged, "runs_per_arm": 3, "baseline": scale.compare_arms(runs, baseline), "baseline_commit": "ae93f66"}
    rows = {r.measure: r for r in table.rows({"operator_scale.json": result})}
    assert (rows["all CRs Ready"].value, rows["all CRs Ready"].met) == (27.0, True)
    assert rows["all CRs Ready"].n.endswith("median of 3 runs")
    assert rows["all CRs Ready: this operator / the baseline"].value == 0.5
    assert "ae93f66" in rows["all CRs Ready: this operator / the baseline"].n
