"""disagg compare's pure parts: the workload it replays, the ABBA order, the statistics, the verdict table and the
report (JSON model, markdown, SVG)."""
from __future__ import annotations

import random
import xml.etree.ElementTree as ET

import pytest

from disagg.compare import report, schedule, stats, workload
from disagg.compare.verdict import Ratio, decide


# -- workload ------------------------------------------------------------------------------------------------------
def test_a_jsonl_workload_reads_prompts_chats_and_the_common_names_of_the_output_length():
    text = "\n".join([
        '{"prompt": "hello", "max_tokens": 8, "id": "ignored"}',
        "",
        '{"messages": [{"role": "user", "content": "hi"}], "output_tokens": 4}',
        '{"prompt": "x", "output_len": 2}'])
    reqs = workload.parse_jsonl(text, "mine.jsonl")
    assert [r.max_tokens for r in reqs] == [8, 4, 2]
    assert [r.path for r in reqs] == ["/v1/completions", "/v1/chat/completions", "/v1/completions"]
    body = reqs[1].body("tiny")
    assert body["messages"] == [{"role": "user", "content": "hi"}] and body["stream"] and body["ignore_eos"]
    assert body["model"] == "tiny" and "prompt" not in body


@pytest.mark.parametrize(("text", "message"), [
    ('{"prompt": "a", "max_tokens": 1}\n{"prompt": "b"}', "mine.jsonl:2: max_tokens: Field required"),
    ('{"prompt": "a", "max_tokens": 0}', "mine.jsonl:1: max_tokens: Input should be greater than or equal to 1"),
    ('{"max_tokens": 3}', "mine.jsonl:1: line: Value error, give exactly one of prompt and messages"),
    ('{"prompt": "a", "messages": [{"role": "user", "content": "b"}], "max_tokens": 3}',
     "give exactly one of prompt and messages"),
    ('{"prompt": "", "max_tokens": 3}', "prompt is empty"),
    ('{"messages": [{"role": "robot", "content": "b"}], "max_tokens": 3}', "mine.jsonl:1: messages.0.role:"),
    ('{"prompt": "a", "max_tokens": 3', "mine.jsonl:1: not JSON"),
    ('[1, 2]', "mine.jsonl:1: a line must be a JSON object, got list"),
    ("\n\n", "mine.jsonl: no requests"),
])
def test_a_bad_workload_line_is_named_with_its_field(text, message):
    with pytest.raises(workload.WorkloadError) as e:
        workload.parse_jsonl(text, "mine.jsonl")
    assert message in str(e.value)


def test_synthetic_workloads_and_arrivals_are_seeded():
    a = workload.synthetic(20, 16, 8, seed=1)
    assert a == workload.synthetic(20, 16, 8, seed=1) != workload.synthetic(20, 16, 8, seed=2)
    assert all(len(r.prompt.split()) == 16 and r.max_tokens == 8 for r in a if r.prompt)
    assert len({r.prompt for r in a}) == 20
    t = workload.arrivals(2000, 4.0, seed=3)
    assert t == workload.arrivals(2000, 4.0, seed=3) and t == sorted(t)
    assert 2000 / t[-1] == pytest.approx(4.0, rel=0.1)
    with pytest.raises(workload.WorkloadError, match="from 1 to"):
        workload.synthetic(3, 4, 0, seed=1)
    with pytest.raises(workload.WorkloadError, match="rate must be positive"):
        workload.arrivals(3, 0.0, seed=1)


# -- schedule ------------------------------------------------------------------------------------------------------
def test_abba_serves_each_mode_once_per_round_in_mirrored_pairs():
    assert schedule.abba(1) == ["push", "pull"]
    assert schedule.abba(2) == ["push", "pull", "pull", "push"]
    assert schedule.abba(3, first="pull") == ["pull", "push", "push", "pull", "pull", "push"]
    assert schedule.switches(schedule.abba(2), current="push") == 2  # to pull once, and back once
    assert schedule.switches(schedule.abba(1), current="push") == 2
    with pytest.raises(ValueError):
        schedule.abba(0)


# -- stats ---------------------------------------------------------------------------------------------------------
def test_quantiles_and_bootstrap_intervals():
    assert stats.quantile([], 0.5) is None
    assert stats.quantile([3, 1, 2], 0.5) == 2 and stats.quantile([1, 2], 0.5) == 1.5
    rng = random.Random(0)
    slow, fast = [100.0 + i % 7 for i in range(200)], [50.0 + i % 7 for i in range(200)]
    lo, hi = stats.ratio_ci(fast, slow, 0.5, rng, n=300)
    assert lo <= 53 / 103 <= hi < 1
    lo, hi = stats.quantile_ci(slow, 0.5, rng, n=300)
    assert lo <= 103 <= hi
    assert stats.ratio_ci([], slow, 0.5, rng) is None


# -- verdict -------------------------------------------------------------------------------------------------------
NOISE, FASTER, SLOWER = Ratio(0.98, (0.9, 1.05)), Ratio(0.5, (0.4, 0.6)), Ratio(1.5, (1.3, 1.8))
SENT = {"push": 100, "pull": 100}
NONE_FAILED = {"push": 0, "pull": 0}


@pytest.mark.parametrize(("ttft", "tpot", "failed", "prefer", "mode", "noise", "words"), [
    (NOISE, NOISE, NONE_FAILED, "ttft", None, True, "inside the noise"),
    (FASTER, NOISE, NONE_FAILED, "ttft", "push", False, "push is faster"),
    (NOISE, SLOWER, NONE_FAILED, "ttft", "pull", False, "pull is faster"),
    (FASTER, FASTER, NONE_FAILED, "ttft", "push", False, "push is faster"),
    (FASTER, SLOWER, NONE_FAILED, "ttft", "push", False, "trade-off"),
    (FASTER, SLOWER, NONE_FAILED, "tpot", "pull", False, "trade-off"),
    (FASTER, FASTER, {"push": 3, "pull": 0}, "ttft", "pull", False, "push failed 3 of 100"),
    (NOISE, NOISE, {"push": 1, "pull": 5}, "ttft", "push", False, "pull failed 5 of 100"),
    (FASTER, NOISE, {"push": 3, "pull": 2}, "ttft", "push", False, "push is faster"),  # alike: not decisive
    (Ratio(None, None), NOISE, NONE_FAILED, "ttft", None, True, "no sample on one side"),
])
def test_the_verdict_table(ttft, tpot, failed, prefer, mode, noise, words):
    v = decide({"ttft": ttft, "tpot": tpot}, failed, SENT, prefer)
    assert (v.mode, v.within_noise) == (mode, noise)
    assert words in v.reason


# -- report --------------------------------------------------------------------------------------------------------
def timings(mode: str, segment: int, ttft: float, n: int, failed: int = 0) -> list[report.RequestTiming]:
    out = [report.RequestTiming(mode=mode, segment=segment, sent_s=i * 0.5, ok=True, ttft_ms=ttft + i % 5,
                                tpot_ms=20.0 + i % 3, handoff_ms=5.0 if mode == "push" else 9.0, served_mode=mode)
           for i in range(n)]
    out += [report.RequestTiming(mode=mode, segment=segment, sent_s=99.0, ok=False, error="HTTP 502")
            for _ in range(failed)]
    return out


def test_a_report_summarises_each_mode_and_recommends_with_its_reason():
    reqs = (timings("push", 0, 100, 40) + timings("pull", 1, 200, 40, failed=0) + timings("pull", 2, 200, 40)
            + timings("push", 3, 100, 40))
    w = report.Workload(source="synthetic", requests=40, rate=2.0, seed=1)
    r = report.build("ns/demo", w, ["push", "pull", "pull", "push"], reqs, seed=1, resamples=200)
    assert r == report.build("ns/demo", w, ["push", "pull", "pull", "push"], reqs, seed=1, resamples=200)
    assert r.sent == {"push": 80, "pull": 80} and r.failed == {"push": 0, "pull": 0}
    assert r.summary["push"]["ttft"].p50_ms == 102.0 and r.summary["pull"]["ttft"].n == 80
    assert r.ratios["ttft"].p50 == pytest.approx(0.51, abs=0.01)
    assert r.ratios["handoff"].p50 == pytest.approx(5 / 9, abs=0.01)
    assert r.verdict.mode == "push" and not r.verdict.within_noise
    assert report.CompareReport.model_validate_json(r.model_dump_json()) == r
    md = report.markdown(r)
    assert "**Recommendation: push**" in md and "| TTFT | 102.0 (" in md and "Failed requests: push 0 of 80" in md
    assert "by the routers' logs: push 80 of 80, pull 80 of 80" in md
    root = ET.fromstring(report.svg(r))
    assert root.tag.endswith("svg") and len(root.findall("{http://www.w3.org/2000/svg}polyline")) == 2


def test_failed_requests_count_against_their_mode_and_are_left_out_of_the_timings():
    reqs = timings("push", 0, 100, 30, failed=4) + timings("pull", 1, 100, 30)
    r = report.build("ns/demo", report.Workload(source="x.jsonl", requests=34, rate=1.0, seed=0), ["push", "pull"],
                     reqs, resamples=100)
    assert r.failed == {"push": 4, "pull": 0} and r.summary["push"]["ttft"].n == 30
    assert r.verdict.mode == "pull" and "push failed 4 of 34" in r.verdict.reason
    assert "**Recommendation: pull**" in report.markdown(r)


def test_a_segment_the_router_served_in_the_other_mode_voids_the_comparison():
    """The proof that each segment ran in its mode is the router's own log: a rollout that had not finished would
    put one mode's requests into the other's figures."""
    wrong = [r.model_copy(update={"served_mode": "push"}) for r in timings("pull", 1, 200, 3)]
    unlogged = [r.model_copy(update={"served_mode": None}) for r in timings("push", 0, 100, 2)]
    reqs = timings("push", 0, 100, 40) + unlogged + timings("pull", 1, 200, 37) + wrong
    r = report.build("ns/demo", report.Workload(source="x", requests=42, rate=1.0, seed=0), ["push", "pull"], reqs,
                     resamples=100)
    assert r.served_in_other_mode == {"push": 0, "pull": 3} and r.unlogged == {"push": 2, "pull": 0}
    assert r.verdict.mode is None and not r.verdict.within_noise
    assert "3 requests of the pull segments were served in the other mode" in r.verdict.reason
    assert "push 40 of 42, pull 37 of 40" in report.markdown(r)
