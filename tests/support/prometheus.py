"""A real Prometheus server on this host (3.16, built from Go modules: devcluster/gobuild-prometheus), scraping a
cluster as the Prometheus Operator would scrape it from the chart's PodMonitor and ServiceMonitor, with the
chart's alert rules loaded.

`scrape_configs` is what the Prometheus Operator's config generator makes of a monitor
(prometheus-operator/prometheus-operator, pkg/prometheus/promcfg.go: generatePodMonitorConfig and
generateServiceMonitorConfig, read at 6adcebc): the same job names, service discovery role and namespaces, and the
same relabelings in the same order. What it leaves out does nothing for one unsharded Prometheus with no scrape
classes and no enforced namespace label: the sharding hashmod (modulus 1 keeps every target), scrape classes'
relabelings, attach_metadata. A monitor field it does not translate is refused, never dropped.
"""
from __future__ import annotations

import json
import re
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from support.engines import polled

T = TypeVar("T")

_KNOWN = {
    "PodMonitor": ({"selector", "namespaceSelector", "podTargetLabels", "podMetricsEndpoints", "jobLabel"},
                   "podMetricsEndpoints"),
    "ServiceMonitor": ({"selector", "namespaceSelector", "podTargetLabels", "targetLabels", "endpoints", "jobLabel"},
                       "endpoints"),
}
_ENDPOINT = {"port", "path", "interval", "scrapeTimeout", "honorLabels", "relabelings", "metricRelabelings", "scheme",
             "filterRunning"}
_RELABEL_KEYS = (("sourceLabels", "source_labels"), ("separator", "separator"), ("targetLabel", "target_label"),
                 ("regex", "regex"), ("modulus", "modulus"), ("replacement", "replacement"), ("action", "action"))


def sanitize(name: str) -> str:
    """A Kubernetes label's name as a Prometheus label's (the operator's sanitizeLabelName)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def _relabelings(configs: list[dict]) -> list[dict]:
    """A monitor's relabelings in Prometheus' spelling (the operator's generateRelabelConfig)."""
    out = []
    for c in configs:
        unknown = set(c) - {k for k, _ in _RELABEL_KEYS}
        assert not unknown, f"relabeling fields not translated: {unknown}"
        out.append({p: (c[k].lower() if k == "action" else c[k]) for k, p in _RELABEL_KEYS if k in c})
    return out


def _selector(selector: dict, meta: str) -> list[dict]:
    """Keep/drop relabelings for a label selector on `meta` (`pod` or `service`) labels."""
    out = []
    for key in sorted(selector.get("matchLabels") or {}):
        k = sanitize(key)
        out.append({"action": "keep", "source_labels": [f"__meta_kubernetes_{meta}_label_{k}",
                                                        f"__meta_kubernetes_{meta}_labelpresent_{k}"],
                    "regex": f"({selector['matchLabels'][key]});true"})
    for exp in selector.get("matchExpressions") or []:
        k, op = sanitize(exp["key"]), exp["operator"]
        if op in ("In", "NotIn"):
            out.append({"action": "keep" if op == "In" else "drop",
                        "source_labels": [f"__meta_kubernetes_{meta}_label_{k}",
                                          f"__meta_kubernetes_{meta}_labelpresent_{k}"],
                        "regex": f"({'|'.join(exp['values'])});true"})
        else:
            assert op in ("Exists", "DoesNotExist"), op
            out.append({"action": "keep" if op == "Exists" else "drop",
                        "source_labels": [f"__meta_kubernetes_{meta}_labelpresent_{k}"], "regex": "true"})
    return out


def scrape_configs(monitor: dict, kubeconfig: Path) -> list[dict]:
    """The scrape jobs the Prometheus Operator generates for one PodMonitor or ServiceMonitor (one per endpoint),
    discovering through the apiserver of `kubeconfig`."""
    kind, meta, spec = monitor["kind"], monitor["metadata"], monitor["spec"]
    known, endpoints_key = _KNOWN[kind]
    assert set(spec) <= known, f"{kind} fields not translated: {set(spec) - known}"
    namespace, name = meta["namespace"], meta["name"]
    nsel = spec.get("namespaceSelector") or {}
    names = [] if nsel.get("any") else (nsel.get("matchNames") or [namespace])
    pod = kind == "PodMonitor"
    jobs = []
    for i, ep in enumerate(spec[endpoints_key]):
        assert set(ep) <= _ENDPOINT, f"{kind} endpoint fields not translated: {set(ep) - _ENDPOINT}"
        sd: dict[str, Any] = {"role": "pod" if pod else "endpoints", "kubeconfig_file": str(kubeconfig)}
        if names:
            sd["namespaces"] = {"names": names}
        job: dict[str, Any] = {"job_name": f"{'podMonitor' if pod else 'serviceMonitor'}/{namespace}/{name}/{i}",
                               "honor_labels": bool(ep.get("honorLabels", False)), "kubernetes_sd_configs": [sd]}
        for key, prom in (("interval", "scrape_interval"), ("scrapeTimeout", "scrape_timeout"),
                          ("path", "metrics_path"), ("scheme", "scheme")):
            if key in ep:
                job[prom] = ep[key]
        running = {"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"}
        relabel: list[dict] = [{"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"}]
        if pod:
            if ep.get("filterRunning", True):
                relabel.append(running)
            relabel += _selector(spec["selector"], "pod")
            if "port" in ep:
                relabel.append({"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"],
                                "regex": ep["port"]})
            relabel += [{"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                        {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
                        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"}]
        else:
            relabel += _selector(spec["selector"], "service")
            if "port" in ep:
                relabel.append({"action": "keep", "source_labels": ["__meta_kubernetes_endpoint_port_name"],
                                "regex": ep["port"]})
            target = ["__meta_kubernetes_endpoint_address_target_kind",
                      "__meta_kubernetes_endpoint_address_target_name"]
            relabel += [
                {"source_labels": list(target), "separator": ";", "regex": "Node;(.*)", "replacement": "${1}",
                 "target_label": "node"},
                {"source_labels": list(target), "separator": ";", "regex": "Pod;(.*)", "replacement": "${1}",
                 "target_label": "pod"},
                {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "service"},
                {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
                {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"}]
            if ep.get("filterRunning", True):
                relabel.append(running)
            relabel += [{"source_labels": [f"__meta_kubernetes_service_label_{sanitize(label)}"],
                         "target_label": sanitize(label), "regex": "(.+)", "replacement": "${1}"}
                        for label in spec.get("targetLabels") or []]
        relabel += [{"source_labels": [f"__meta_kubernetes_pod_label_{sanitize(label)}"],
                     "target_label": sanitize(label), "regex": "(.+)", "replacement": "${1}"}
                    for label in spec.get("podTargetLabels") or []]
        source = "pod" if pod else "service"
        relabel.append({"target_label": "job", "replacement": f"{namespace}/{name}"} if pod else
                       {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "job",
                        "replacement": "${1}"})
        if spec.get("jobLabel"):
            relabel.append({"source_labels": [f"__meta_kubernetes_{source}_label_{sanitize(spec['jobLabel'])}"],
                            "target_label": "job", "regex": "(.+)", "replacement": "${1}"})
        if "port" in ep:
            relabel.append({"target_label": "endpoint", "replacement": ep["port"]})
        relabel += _relabelings(ep.get("relabelings") or [])
        job["relabel_configs"] = relabel
        if ep.get("metricRelabelings"):
            job["metric_relabel_configs"] = _relabelings(ep["metricRelabelings"])
        jobs.append(job)
    return jobs


def await_value(fn: Callable[[], T | None], timeout: float, what: str, interval: float = 1.0) -> T:
    """The first truthy value of `fn`, polled: Prometheus is another process, whose state has no watch."""
    seen: list[T | None] = []

    def found() -> bool:
        seen.append(fn())
        return bool(seen[-1])

    if not polled(found, timeout, interval):
        raise TimeoutError(f"{what}: not within {timeout:.0f} s; last: {seen[-1]!r}")
    return seen[-1]  # type: ignore[return-value]  # truthy, so not None


class Prometheus:
    """One Prometheus server process on 127.0.0.1, its TSDB and configuration in `directory`."""

    def __init__(self, binary: Path, directory: Path, port: int, config: dict, rules: dict | None = None):
        self.binary, self.dir, self.port = binary, directory, port
        self.url = f"http://127.0.0.1:{port}"
        self.config = {**config, **({"rule_files": ["rules.yaml"]} if rules else {})}
        self.rules = rules
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60) -> Prometheus:
        (self.dir / "prometheus.yaml").write_text(yaml.safe_dump(self.config, sort_keys=False))
        if self.rules:
            (self.dir / "rules.yaml").write_text(yaml.safe_dump(self.rules, sort_keys=False))
        with open(self.dir / "prometheus.log", "wb") as log:
            self.proc = subprocess.Popen(
                [str(self.binary), f"--config.file={self.dir / 'prometheus.yaml'}",
                 f"--storage.tsdb.path={self.dir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}"],
                cwd=self.dir, stdout=log, stderr=subprocess.STDOUT)

        def ready() -> bool:
            assert self.proc is not None and self.proc.poll() is None, f"prometheus exited:\n{self.log()}"
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                    return r.status == 200
            except (urllib.error.URLError, ConnectionError):
                return False

        await_value(ready, timeout, "prometheus ready", interval=0.2)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)

    def log(self, lines: int = 40) -> str:
        return "\n".join((self.dir / "prometheus.log").read_text(errors="replace").splitlines()[-lines:])

    def api(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=30) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:
            raise AssertionError(f"/api/v1/{path} {params}: {e.code} {e.read().decode(errors='replace')}") from None
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """The instant query's series: each a {"metric": labels, "value": [t, "v"]}."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        return list(data["result"])

    def alerts(self) -> list[dict]:
        return list(self.api("alerts")["alerts"])

    def rule_groups(self) -> list[dict]:
        return list(self.api("rules")["groups"])

    def targets(self) -> list[dict]:
        return list(self.api("targets", state="active")["activeTargets"])
