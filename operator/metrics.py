"""Prometheus metrics of the operator (served on --metrics-port)."""
from __future__ import annotations

from prometheus_client import REGISTRY, Counter, Gauge, Histogram

from .condition_metrics import ConditionStates
from .planner_metrics import PlannerDecisions

RECONCILES = Counter("disagg_operator_reconciles_total", "Reconcile passes by trigger and result",
                     ["trigger", "result"])
RECONCILE_ERRORS = Counter("disagg_operator_reconcile_errors_total",
                           "Reconcile passes that failed, whatever triggered them. Unlike the result=\"error\" "
                           "series of disagg_operator_reconciles_total, one per trigger and made at its first error, "
                           "it is exported from the start at 0, so rate() counts the first failure")
RECONCILE_SECONDS = Histogram("disagg_operator_reconcile_seconds", "Duration of a reconcile pass",
                              buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
CHILD_WRITES = Counter("disagg_operator_child_changes_total", "Children created or updated", ["kind", "change"])
CHILD_APPLIES = Counter("disagg_operator_child_applies_total",
                        "Server-side applies of children, by kind and why the plan sent them (new, changed, drifted, "
                        "verify)", ["kind", "why"])
STATUS_WRITES = Counter("disagg_operator_status_writes_total", "Status subresource patches")
API_ERRORS = Counter("disagg_operator_api_errors_total", "Failed API calls", ["kind", "verb"])
API_SECONDS = Histogram("disagg_operator_api_seconds", "Latency of API calls", ["verb"],
                        buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
MANAGED = Gauge("disagg_operator_managed_resources", "DisaggregatedInference objects known to this operator")
RESYNC_ROUNDS = Counter("disagg_operator_resync_rounds_total", "Completed periodic resyncs over every known CR")
RENDEZVOUS_POLLS = Counter("disagg_operator_rendezvous_polls_total",
                           "Reads of a deployment's rendezvous for the engines' transport", ["result"])
ROLLOUT_STEPS = Counter("disagg_operator_rollout_steps_total", "Rollout steps performed, by kind", ["step"])
ROLLOUT_BLOCKED = Counter("disagg_operator_rollouts_blocked_total", "Rollouts that became Blocked")
PASSES_WAITING = Gauge("disagg_operator_passes_waiting",
                       "Reconcile passes waiting for one of --max-concurrent-passes slots, by lane: urgent (may turn "
                       "a CR Ready or not Ready; served first) and other", ["lane"])
AUTOSCALE_TICKS = Counter("disagg_operator_autoscale_ticks_total",
                          "Autoscaling planner ticks, by result: decided, blind (could not observe), first (a window "
                          "needs a second scrape), error", ["result"])
PLANNER_DECISIONS = PlannerDecisions()
"""The planner's last decision per CR (disagg_planner_*), read at scrape time."""
REGISTRY.register(PLANNER_DECISIONS)
CONDITIONS = ConditionStates()
"""Each CR's conditions (disagg_operator_condition), read at scrape time."""
REGISTRY.register(CONDITIONS)
