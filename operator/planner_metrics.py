"""The autoscaling planner's decisions as Prometheus metrics (served with the operator's own, on --metrics-port), so
an HPA or KEDA can act on them instead of the operator (issue 35: "export the decisions").

One series per CR and role, labelled `namespace`, `name` and `role`:
- `disagg_planner_desired_replicas`: the count the planner decided (what the operator applies when it drives the
  role itself);
- `disagg_planner_needed_replicas`: what the load calls for before cooldowns, step limits and [min, max]: the
  value for an external autoscaler that applies its own;
- the estimates behind them: `disagg_planner_demand_tokens_per_second`, `disagg_planner_throughput_floor_replicas`
  and `disagg_planner_slo_latency_seconds` (absent when the policy gives no throughput, or nothing reached that
  point in the window), `disagg_planner_kv_usage` (engines' worth), `disagg_planner_waiting_requests`,
  `disagg_planner_running_requests`;
and per CR `disagg_planner_decision{kind}`: 1 for the kind of the last decision (Rescale, Steady, Limited,
Waiting), 0 for the others.

Invariant: the series are exactly the last decision recorded for each CR still known (`record`, `forget`); a CR
forgotten leaves no series behind. Read at scrape time, so a scrape never sees half of a decision.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from .autoscaling.decision import Decision, Limited, Rescale, Steady, Waiting
from .names import Key
from .rollout.state import ROLES

KINDS = (Rescale, Steady, Limited, Waiting)


_ROLE_FAMILIES = {
    "desired": ("disagg_planner_desired_replicas", "Engines the autoscaling planner decided for the role"),
    "needed": ("disagg_planner_needed_replicas", "Engines the role's load calls for before cooldowns, step limits "
               "and minReplicas/maxReplicas (for an HPA or KEDA)"),
    "demand": ("disagg_planner_demand_tokens_per_second", "Offered load in the role's tokens (prefill: prompt "
               "tokens, decode: output tokens) per second"),
    "floor": ("disagg_planner_throughput_floor_replicas", "Engines the demand needs at the policy's per-engine "
              "throughput (absent without one)"),
    "latency": ("disagg_planner_slo_latency_seconds", "The role's SLO latency at the policy's percentile (prefill: "
                "TTFT, decode: TPOT; absent with no sample)"),
    "kv": ("disagg_planner_kv_usage", "KV cache in use over the role's engines, in engines' worth"),
    "waiting": ("disagg_planner_waiting_requests", "Requests waiting in the role's engines"),
    "running": ("disagg_planner_running_requests", "Sequences running in the role's engines"),
}
"""Per-role series: key -> (metric name, help)."""


class PlannerDecisions(Collector):
    def __init__(self) -> None:
        self._last: dict[Key, Decision] = {}
        self._lock = threading.Lock()  # recorded by the operator's loop, read by the metrics server's thread

    def record(self, namespace: str, name: str, decision: Decision) -> None:
        with self._lock:
            self._last[(namespace, name)] = decision

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._last.pop((namespace, name), None)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            last = dict(self._last)
        labels = ["namespace", "name", "role"]
        families = {key: GaugeMetricFamily(name, doc, labels=labels) for key, (name, doc) in _ROLE_FAMILIES.items()}
        kinds = GaugeMetricFamily("disagg_planner_decision", "1 for the kind of the planner's last decision for the "
                                  "CR (Rescale, Steady, Limited, Waiting), 0 for the others",
                                  labels=["namespace", "name", "kind"])
        for (namespace, name), decision in sorted(last.items()):
            for kind in KINDS:
                kinds.add_metric([namespace, name, kind.__name__], 1.0 if isinstance(decision, kind) else 0.0)
            for role in ROLES:
                d = decision.role(role)
                e, at = d.estimate, [namespace, name, role]
                families["desired"].add_metric(at, d.desired)
                families["needed"].add_metric(at, e.needed)
                families["demand"].add_metric(at, e.demand_tokens_per_second)
                if e.throughput_floor is not None:
                    families["floor"].add_metric(at, e.throughput_floor)
                if e.latency_ms is not None:
                    families["latency"].add_metric(at, e.latency_ms / 1000)
                families["kv"].add_metric(at, e.kv_usage)
                families["waiting"].add_metric(at, e.waiting)
                families["running"].add_metric(at, e.running)
        yield from families.values()
        yield kinds
