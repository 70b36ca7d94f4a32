"""The planner's decisions as the metrics an HPA or KEDA reads: real decisions of the pure planner, exported by the
collector and read back through Prometheus' own text format and parser."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from disagg.operator.autoscaling.planner import decide
from disagg.operator.planner_metrics import PlannerDecisions
from support.autoscaling import NO_THROUGHPUT, POLICY, observe


def scraped(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def at(name: str, cr: str, role: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return name, (("name", cr), ("namespace", "ns"), ("role", role))


def test_a_decision_is_exported_per_role_with_the_estimates_behind_it():
    registry, decisions = CollectorRegistry(), PlannerDecisions()
    registry.register(decisions)
    step = decide(observe(1, 1, rps=5, isl=1600, osl=200, ttft=300, tpot=40, kv=(0.2, 0.4), waiting=(1, 0),
                          running=(2, 9)), POLICY)
    decisions.record("ns", "llama", step)
    got = scraped(registry)
    # prefill: the 8000 tokens/s offered and the waiting request's 1600 within the 1-s TTFT target, at 2000 each
    assert got[at("disagg_planner_desired_replicas", "llama", "prefill")] == step.prefill.desired == 5
    assert got[at("disagg_planner_desired_replicas", "llama", "decode")] == step.decode.desired == 2
    assert got[at("disagg_planner_needed_replicas", "llama", "prefill")] == 5
    assert got[at("disagg_planner_throughput_floor_replicas", "llama", "prefill")] == 4
    assert got[at("disagg_planner_demand_tokens_per_second", "llama", "prefill")] == 8000
    assert got[at("disagg_planner_throughput_floor_replicas", "llama", "decode")] == 2
    assert got[at("disagg_planner_slo_latency_seconds", "llama", "prefill")] == 0.3
    assert got[at("disagg_planner_slo_latency_seconds", "llama", "decode")] == 0.04
    assert (got[at("disagg_planner_kv_usage", "llama", "decode")], got[at("disagg_planner_running_requests", "llama",
                                                                          "decode")]) == (0.4, 9)
    kinds = {dict(labels)["kind"]: v for (n, labels), v in got.items() if n == "disagg_planner_decision"}
    assert kinds == {"Rescale": 1, "Steady": 0, "Limited": 0, "Waiting": 0}


def test_estimates_that_do_not_exist_are_absent_not_zero_and_a_forgotten_cr_leaves_nothing():
    registry, decisions = CollectorRegistry(), PlannerDecisions()
    registry.register(decisions)
    decisions.record("ns", "a", decide(observe(1, 1, rps=5, isl=1600, ttft=300, tpot=40), NO_THROUGHPUT))
    decisions.record("ns", "b", decide(observe(2, 2, rps=1, ttft=400, tpot=50), POLICY))
    got = scraped(registry)
    assert at("disagg_planner_throughput_floor_replicas", "a", "prefill") not in got  # no per-engine throughput
    assert at("disagg_planner_throughput_floor_replicas", "b", "prefill") in got
    decisions.forget("ns", "a")
    assert {dict(labels)["name"] for (_, labels), _ in scraped(registry).items()} == {"b"}
    decisions.record("ns", "b", decide(observe(4, 4, rps=0.1, isl=1000, osl=100, ttft=200, tpot=30, since=100),
                                       POLICY))
    got = scraped(registry)
    assert got[("disagg_planner_decision", (("kind", "Steady"), ("name", "b"), ("namespace", "ns")))] == 1
    assert got[at("disagg_planner_desired_replicas", "b", "prefill")] == 4
