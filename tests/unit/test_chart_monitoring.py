"""The chart's monitoring (metrics.podMonitor, metrics.prometheusRule, metrics.grafanaDashboard): off by default;
on, they render with the values' thresholds, and every series an alert or a panel reads is one the product
exports; Prometheus' own promtool (built from Go modules) loads the rules, and its rule tests fire an alert on its
fault and not before its `for`. (That each query returns series from a running deployment, on a real Prometheus,
is for the node tests.)"""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from support.tools import ALL_OPTIONS, CHART, docs, helm

ROOT = CHART.parents[1]
SOURCES = ("operator", "connector")
METRIC = re.compile(r"\b(disagg_[a-z_]+|vllm:[a-z_]+)")


def rendered(*values: str) -> list[dict]:
    args = [a for v in values for a in ("-f", v)]
    return docs(helm("template", "demo", str(CHART), "--namespace", "disagg-system", *args).stdout)


@pytest.fixture(scope="module")
def everything() -> dict[str, dict]:
    return {d["kind"]: d for d in rendered(str(ALL_OPTIONS)) if d["kind"] in ("PrometheusRule", "PodMonitor")
            or d["metadata"]["name"].endswith("-dashboard")}


def exported() -> str:
    return "\n".join(p.read_text() for src in SOURCES for p in (ROOT / src).rglob("*.py"))


def is_exported(name: str, code: str) -> bool:
    """`name` is written in the product's code (the rendezvous writes its names as a prefix plus the rest)."""
    rest = name.removeprefix("disagg_rendezvous_")
    return f'"{name}' in code or (rest != name and f'p + "{rest}"' in code)


def series(expr: str) -> set[str]:
    return {re.sub(r"_(bucket|total)$", "", m) for m in METRIC.findall(expr)}


def test_monitoring_is_off_by_default():
    kinds = {d["kind"] for d in rendered()}
    assert not kinds & {"PrometheusRule", "PodMonitor"}


def test_the_rules_carry_the_values_thresholds_and_read_only_exported_series(everything):
    rule = everything["PrometheusRule"]
    assert rule["metadata"]["namespace"] == "monitoring"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    rules = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert set(rules) == {"DisaggTransportNotVerified", "DisaggNotReady", "DisaggNoPairs", "DisaggHandoffSlow",
                          "DisaggRendezvousLeaseChurn", "DisaggOperatorReconcileErrors"}
    assert rules["DisaggHandoffSlow"]["expr"].rstrip().endswith("> 0.25")
    assert rules["DisaggRendezvousLeaseChurn"]["expr"].rstrip().endswith("> 10")
    assert rules["DisaggNotReady"]["for"] == "30m" and rules["DisaggTransportNotVerified"]["for"] == "2m"
    assert "$labels.namespace" in rules["DisaggNoPairs"]["annotations"]["summary"]  # left for Prometheus
    code = exported()
    for name, r in rules.items():
        found = series(r["expr"])
        assert found, name
        for s in found:
            assert is_exported(s, code), f"{name} reads {s}, which nothing exports"


def test_the_podmonitor_scrapes_every_pod_the_operator_makes_with_the_labels_the_rules_read(everything):
    pm = everything["PodMonitor"]["spec"]
    assert pm["selector"] == {"matchLabels": {"app.kubernetes.io/managed-by": "disagg-operator"}}
    assert pm["namespaceSelector"] == {"any": True}
    assert "app.kubernetes.io/instance" in pm["podTargetLabels"]
    assert pm["podMetricsEndpoints"] == [{"port": "http", "path": "/metrics", "interval": "10s"}]


def test_the_dashboard_is_the_charts_file_and_reads_only_exported_series(everything):
    cm = everything["ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["disagg.json"])
    assert dashboard == json.loads((CHART / "files" / "dashboard.json").read_text())
    code = exported()
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 12
    for expr in exprs:
        for s in series(expr):
            assert is_exported(s, code), f"a panel reads {s}, which nothing exports"


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """Prometheus' own rule checker, built from Go modules (devcluster/gobuild-prometheus)."""
    from disagg.devcluster import build

    build.ensure_built(["promtool"], quiet=True)
    return subprocess.run([str(build.bin_dir() / "promtool"), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_prometheus_loads_the_rules(everything, tmp_path):
    groups = everything["PrometheusRule"]["spec"]["groups"]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    out = promtool("check", "rules", "rules.yaml", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 6 rules found" in out.stdout


def test_an_alert_fires_on_its_fault_and_only_after_its_for(everything, tmp_path):
    """promtool's rule tests, on series shaped as the product exports them: TransportVerified False fires after
    its 2 minutes and not before; a router holding requests for a pair fires; failing reconcile passes fire after
    their `for`, counted from the first failure; nothing fires while all is well."""
    groups = everything["PrometheusRule"]["spec"]["groups"]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    rules = {r["alert"]: r for g in groups for r in g["rules"]}

    def annotations(alert: str, **labels: str) -> dict[str, str]:
        out = {}
        for key, text in rules[alert]["annotations"].items():
            for name, value in labels.items():
                text = text.replace(f"{{{{ $labels.{name} }}}}", value)
            out[key] = text
        return out

    condition = 'disagg_operator_condition{type="TransportVerified",status="False",namespace="ns",name="demo"}'
    waiting = 'disagg_router_pair_waiting{namespace="ns",app_kubernetes_io_instance="demo",pod="demo-router-0"}'
    transport = {"severity": "warning", "type": "TransportVerified", "status": "False", "namespace": "ns",
                 "name": "demo"}
    no_pairs = {"severity": "critical", "namespace": "ns", "app_kubernetes_io_instance": "demo",
                "pod": "demo-router-0"}
    tests = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": [
        {"interval": "1m",
         "input_series": [{"series": condition, "values": "1x15"}, {"series": waiting, "values": "3x15"}],
         "alert_rule_test": [
             {"eval_time": "1m", "alertname": "DisaggTransportNotVerified", "exp_alerts": []},
             {"eval_time": "10m", "alertname": "DisaggTransportNotVerified", "exp_alerts": [
                 {"exp_labels": transport, "exp_annotations": annotations("DisaggTransportNotVerified",
                                                                          namespace="ns", name="demo")}]},
             {"eval_time": "10m", "alertname": "DisaggNoPairs", "exp_alerts": [
                 {"exp_labels": no_pairs, "exp_annotations": annotations(
                     "DisaggNoPairs", namespace="ns", app_kubernetes_io_instance="demo")}]}]},
        {"interval": "1m",
         "input_series": [{"series": condition, "values": "0x15"}, {"series": waiting, "values": "0x15"}],
         "alert_rule_test": [{"eval_time": "10m", "alertname": name, "exp_alerts": []}
                             for name in ("DisaggTransportNotVerified", "DisaggNoPairs")]},
        # The operator exports its error count at 0 from the start, so the first failure already counts: passes
        # failing from minute 5 fire after the for (10m in these values), not before.
        {"interval": "1m",
         "input_series": [{"series": "disagg_operator_reconcile_errors_total", "values": "0x4 1+1x20"}],
         "alert_rule_test": [
             {"eval_time": "14m", "alertname": "DisaggOperatorReconcileErrors", "exp_alerts": []},
             {"eval_time": "15m", "alertname": "DisaggOperatorReconcileErrors", "exp_alerts": [
                 {"exp_labels": {"severity": "critical"},
                  "exp_annotations": annotations("DisaggOperatorReconcileErrors")}]}]},
        {"interval": "1m",
         "input_series": [{"series": "disagg_operator_reconcile_errors_total", "values": "0x25"}],
         "alert_rule_test": [{"eval_time": "25m", "alertname": "DisaggOperatorReconcileErrors", "exp_alerts": []}]}]}
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests))
    out = promtool("test", "rules", "tests.yaml", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
