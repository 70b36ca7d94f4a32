"""Each CR's conditions as Prometheus series (served with the operator's own, on --metrics-port), for alerts that
watch what `kubectl get dinf` shows: `disagg_operator_condition{namespace, name, type, status}` is 1 for the status
a condition has (True, False or Unknown) and 0 for the two others, as kube-state-metrics does for pods.

Invariant: the series are exactly the conditions last computed for each CR still known (`record`, `forget`); a
CR forgotten leaves no series behind. Read at scrape time, so a scrape never sees half of a status.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from .api import Condition
from .names import Key

STATUSES = ("True", "False", "Unknown")


class ConditionStates(Collector):
    def __init__(self) -> None:
        self._last: dict[Key, dict[str, str]] = {}
        self._lock = threading.Lock()  # recorded by the operator's loop, read by the metrics server's thread

    def record(self, namespace: str, name: str, conditions: Sequence[Condition]) -> None:
        with self._lock:
            self._last[(namespace, name)] = {c.type: c.status for c in conditions}

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._last.pop((namespace, name), None)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            last = dict(self._last)
        family = GaugeMetricFamily("disagg_operator_condition", "1 for the status each condition of the CR has "
                                   "(True, False, Unknown), 0 for the others", labels=["namespace", "name", "type",
                                                                                        "status"])
        for (namespace, name), conditions in sorted(last.items()):
            for ctype, current in sorted(conditions.items()):
                for status in STATUSES:
                    family.add_metric([namespace, name, ctype, status], 1.0 if status == current else 0.0)
        yield family
