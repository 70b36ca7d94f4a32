"""The chart's dashboard and alerts on a real Prometheus, scraping the product on the real node.

Prometheus (3.16, built from Go modules) runs on this host with the scrape jobs the Prometheus Operator makes of the
chart's own PodMonitor and ServiceMonitor (rendered by helm with the installed release's values;
support/prometheus.py translates them), discovering pods and endpoints through the cluster's apiserver
(`kubernetes_sd_configs`) and scraping them at their pod IPs, which route from the host over the node's bridge. It
loads the chart's alert rules (the PrometheusRule's groups), with their `for` and window set short through the
chart's values. The deployment is one push CR of engine emulators (as in test_autoscale_e2e.py: cheap, with the
same /metrics names as vLLM's engines) with the planner in Recommend mode, so the planner's series exist too.

- the targets are exactly the deployment's pods and the operator's, labelled as the Prometheus Operator labels them;
- healthy: every dashboard query (and variable) and every alert rule's expression without its comparison, and each
  vector selector in it, returns this deployment's series, every rule evaluates without error, and no alert about
  the deployment or the operator is pending or firing at an evaluation after DisaggNoPairs' window filled;
- a change freeze (an admission policy refusing StatefulSet replica changes) while the decode role is scaled to zero
  refuses the operator's writes: DisaggOperatorReconcileErrors fires, and the operator's API error series, which it
  creates at their first error, answer the dashboard's queries;
- the freeze lifted, the decode engine goes and a request held for a pair fires DisaggNoPairs; the decode back, the
  request is served and the alert resolves;
- the plain scrape configuration docs/operating/metrics.md gives users without the Prometheus Operator, with the
  release's namespace and name, finds the same targets with the same labels and answers the same queries.
"""
from __future__ import annotations

import json
import re
import time

import pytest
import yaml
from lightkube.resources.apps_v1 import StatefulSet
from lightkube.resources.core_v1 import Endpoints, Pod

from disagg.operator import names, role_api
from disagg.operator.merge import deep_merge
from support.kube import watch_until
from support.prometheus import Prometheus, await_value, scrape_configs
from support.traffic import Stream, emulated_autoscaled

pytestmark = [pytest.mark.cluster, pytest.mark.node]

NAME = "monitored"
INTERVAL = 2
"""Seconds between scrapes and between rule evaluations."""
FOR = 10
"""The alerts' `for` and DisaggNoPairs' window (metrics.alerts.for), in seconds; DisaggOperatorReconcileErrors'
`for` (metrics.alerts.operatorErrorsFor) too."""
MONITORING = {"metrics": {
    "serviceMonitor": {"enabled": True, "interval": f"{INTERVAL}s", "scrapeTimeout": f"{INTERVAL}s"},
    "podMonitor": {"enabled": True, "interval": f"{INTERVAL}s"},
    "prometheusRule": {"enabled": True},
    "grafanaDashboard": {"enabled": True},
    "alerts": {"for": f"{FOR}s", "operatorErrorsFor": f"{FOR}s"},
}}
AUTOSCALING = {
    "mode": "Recommend",  # publishes the planner's series; the test sets the counts
    "prefill": {"minReplicas": 1, "maxReplicas": 2, "inputTokensPerSecond": 20000},
    "decode": {"minReplicas": 1, "maxReplicas": 2, "outputTokensPerSecond": 3000},
}
FAULT_ONLY = {"disagg_operator_api_errors_total"}
"""Selectors of counters the operator creates at its first error (one series per kind and verb): a healthy operator
has no such series. Its reconcile errors, which the alert reads, are exported at 0 from the start."""
SELECTOR = re.compile(r"(?<![\w:])(disagg_[a-z_]+|vllm:[a-z_]+)(\{[^}]*\})?")
COMPARISON = re.compile(r"\s*(==|!=|>=|<=|>|<)\s*[0-9.]+\s*$")


@pytest.fixture(scope="module")
def rendered(operator_release, tmp_path_factory) -> dict[str, dict]:
    """The chart's monitoring objects, rendered with the installed release's values and MONITORING."""
    from support.tools import CHART, docs, helm

    values = tmp_path_factory.mktemp("monitoring") / "values.yaml"
    values.write_text(yaml.safe_dump(deep_merge(operator_release.values, MONITORING)))
    out = docs(helm("template", operator_release.name, str(CHART), "--namespace", operator_release.namespace,
                    "-f", str(values)).stdout)
    by_kind = {d["kind"]: d for d in out if d["kind"] in ("PodMonitor", "ServiceMonitor", "PrometheusRule")}
    by_kind["Dashboard"] = next(d for d in out if d["kind"] == "ConfigMap" and "disagg.json" in d.get("data", {}))
    by_kind["Service"] = next(d for d in out if d["kind"] == "Service"
                              and d["metadata"]["labels"].get("app.kubernetes.io/component") == "metrics")
    return by_kind


@pytest.fixture(scope="module")
def deployment(cluster, real_node, operator_release, module_namespace) -> str:
    """The CR's router URL, once it is settled at 1P1D."""
    return emulated_autoscaled(cluster, module_namespace, NAME, AUTOSCALING)


@pytest.fixture(scope="module")
def prometheus(cluster, rendered, deployment, tmp_path_factory):
    from disagg.devcluster import build
    from disagg.devcluster.cluster import free_port

    build.ensure_built(["prometheus"], quiet=True)
    jobs = [job for kind in ("PodMonitor", "ServiceMonitor") for job in scrape_configs(rendered[kind],
                                                                                       cluster.kubeconfig)]
    config = {"global": {"scrape_interval": f"{INTERVAL}s", "evaluation_interval": f"{INTERVAL}s"},
              "scrape_configs": jobs}
    prom = Prometheus(build.bin_dir() / "prometheus", tmp_path_factory.mktemp("prometheus"), free_port(), config,
                      {"groups": rendered["PrometheusRule"]["spec"]["groups"]})
    prom.start()
    yield prom
    prom.stop()


def _expected_targets(cluster, rendered, namespace: str, release_namespace: str) -> set[tuple]:
    """(job, namespace, pod, container, endpoint, instance, component) of every target the monitors select, from
    the live objects: the PodMonitor's, each container port named as its endpoint of each running pod the
    operator made in `namespace`; the ServiceMonitor's, each address of the metrics Service's Endpoints."""
    pm = rendered["PodMonitor"]
    (ep,) = pm["spec"]["podMetricsEndpoints"]
    selector = pm["spec"]["selector"]["matchLabels"]
    out = set()
    for pod in cluster.client.list(Pod, namespace=namespace, labels=selector):
        if pod.status.phase != "Running":
            continue
        labels = pod.metadata.labels or {}
        for c in pod.spec.containers:
            if any(p.name == ep["port"] for p in c.ports or []):
                out.add((f"{pm['metadata']['namespace']}/{pm['metadata']['name']}", namespace, pod.metadata.name,
                         c.name, ep["port"], labels.get("app.kubernetes.io/instance"),
                         labels.get("app.kubernetes.io/component")))
    svc = rendered["Service"]["metadata"]["name"]
    (sm_ep,) = rendered["ServiceMonitor"]["spec"]["endpoints"]
    endpoints = cluster.client.get(Endpoints, svc, namespace=release_namespace)
    for subset in endpoints.subsets or []:
        if not any(p.name == sm_ep["port"] for p in subset.ports or []):
            continue
        for address in subset.addresses or []:
            pod = cluster.client.get(Pod, address.targetRef.name, namespace=release_namespace)
            (container,) = [c.name for c in pod.spec.containers
                            if any(p.name == sm_ep["port"] for p in c.ports or [])]
            out.add((svc, release_namespace, pod.metadata.name, container, sm_ep["port"], None, None))
    return out


def _docs_scrape_configs(kubeconfig, release: str, release_namespace: str) -> list[dict]:
    """docs/operating/metrics.md's plain scrape jobs, for the release `release` in `release_namespace`,
    discovering through the apiserver of `kubeconfig`."""
    from support.tools import REPO

    text = (REPO / "docs" / "operating" / "metrics.md").read_text()
    section = text.split("## Without the Prometheus Operator", 1)[1]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block, "no yaml block under 'Without the Prometheus Operator'"
    jobs = yaml.safe_load(block.group(1))["scrape_configs"]
    for job in jobs:
        for sd in job["kubernetes_sd_configs"]:
            sd["kubeconfig_file"] = str(kubeconfig)
            if "namespaces" in sd:
                assert sd["namespaces"] == {"names": ["disagg-system"]}, sd
                sd["namespaces"] = {"names": [release_namespace]}
        for r in job["relabel_configs"]:
            if r.get("regex") == "disagg;metrics":
                r["regex"] = f"{release};metrics"
    return jobs


def _target_key(t: dict) -> tuple:
    lab = t["labels"]
    return (lab.get("job"), lab.get("namespace"), lab.get("pod"), lab.get("container"), lab.get("endpoint"),
            lab.get("app_kubernetes_io_instance"), lab.get("app_kubernetes_io_component"))


def test_prometheus_discovers_exactly_the_deployments_pods_and_the_operator(
        cluster, rendered, prometheus, module_namespace, operator_release):
    expected = _expected_targets(cluster, rendered, module_namespace, operator_release.namespace)
    assert {e[6] for e in expected} >= {names.ROUTER, names.RENDEZVOUS, "prefill", "decode", None}, expected

    def up() -> set[tuple] | None:
        ours = {_target_key(t): t for t in prometheus.targets()
                if t["labels"].get("namespace") in (module_namespace, operator_release.namespace)}
        return set(ours) if set(ours) == expected and all(t["health"] == "up" for t in ours.values()) else None

    try:
        await_value(up, 60, "every expected target discovered and up")
    except TimeoutError:
        got = [(_target_key(t), t["health"], t["lastError"]) for t in prometheus.targets()]
        raise AssertionError(f"expected {sorted(expected, key=str)}\ngot {got}\n{prometheus.log()}") from None
    svc = rendered["Service"]["metadata"]["name"]
    (operator_target,) = [t for t in prometheus.targets() if t["labels"]["job"] == svc]
    assert operator_target["labels"]["service"] == svc


def _dashboard_queries(rendered, namespace: str, name: str) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel target, with the dashboard's variables set to this deployment."""
    dashboard = json.loads(rendered["Dashboard"]["data"]["disagg.json"])
    return [(p["title"], t["expr"].replace("$namespace", namespace).replace("$dinf", name))
            for p in dashboard["panels"] for t in p["targets"]]


def _variables(rendered) -> list[tuple[str, str, str]]:
    """(variable, metric selector, label) of the dashboard's label_values(...) variables."""
    dashboard = json.loads(rendered["Dashboard"]["data"]["disagg.json"])
    out = []
    for v in dashboard["templating"]["list"]:
        if v["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", v["query"])
        assert m, f"variable {v['name']}: a query this test does not read: {v['query']}"
        out.append((v["name"], m.group(1), m.group(2)))
    return out


def _rules(rendered) -> dict[str, dict]:
    return {r["alert"]: r for g in rendered["PrometheusRule"]["spec"]["groups"] for r in g["rules"]}


def _selectors(expr: str) -> list[str]:
    return [m.group(0) for m in SELECTOR.finditer(expr)]


def _ours(series: dict, namespace: str, name: str, operator_job: str) -> bool:
    """A series of this deployment: its pods' (namespace and the PodMonitor's instance label), the operator's about
    this CR (its own namespace and name labels), or the operator's own."""
    lab = series["metric"]
    return (lab.get("namespace") == namespace and name in (lab.get("app_kubernetes_io_instance"), lab.get("name"))) \
        or lab.get("job") == operator_job


def _unanswered(prometheus: Prometheus, rendered, namespace: str, name: str, *, fault_only: bool,
                operator_job: str | None = None) -> list[str]:
    """The dashboard's queries and variables and the alert rules' queries and selectors that return no series of
    this deployment: the healthy ones (`fault_only` False) or those reading FAULT_ONLY series. The operator's own
    series are those of `operator_job` (default: the ServiceMonitor's, named after the metrics Service)."""
    operator_job = operator_job or rendered["Service"]["metadata"]["name"]
    missing = []
    for title, expr in _dashboard_queries(rendered, namespace, name):
        if any(s in FAULT_ONLY for s in _selectors(expr)) != fault_only:
            continue
        if not prometheus.query(expr):
            missing.append(f"panel {title!r}: {expr}")
    if not fault_only:
        for var, selector, label in _variables(rendered):
            values = {s["metric"].get(label) for s in prometheus.query(selector.replace("$namespace", namespace))}
            if (namespace if label == "namespace" else name) not in values:
                missing.append(f"variable {var}: label_values({selector}, {label}) = {values}")
    for alert, rule in _rules(rendered).items():
        expr = rule["expr"].strip()
        selectors = _selectors(expr)
        if any(s in FAULT_ONLY for s in selectors) != fault_only:
            continue
        bare, n = COMPARISON.subn("", expr)
        assert n == 1, f"{alert}: not `<query> <comparison> <number>`, which this test reads: {expr}"
        if not prometheus.query(bare):
            missing.append(f"alert {alert} without its comparison: {bare}")
        for s in selectors:
            if not any(_ours(series, namespace, name, operator_job) for series in prometheus.query(s)):
                missing.append(f"alert {alert}: selector {s}")
    return missing


def _await_answered(prometheus, rendered, namespace: str, name: str, *, fault_only: bool, timeout: float = 90,
                    operator_job: str | None = None) -> None:
    def unanswered() -> list[str]:
        return _unanswered(prometheus, rendered, namespace, name, fault_only=fault_only, operator_job=operator_job)

    try:
        await_value(lambda: not unanswered(), timeout, "every query answered")
    except TimeoutError:
        missing = unanswered()
        raise AssertionError("queries with no series of this deployment:\n" + "\n".join(missing)) from None


def _evaluated_after(prometheus: Prometheus, t: float, timeout: float = 30) -> list[dict]:
    """Every alerting rule, once each was evaluated after the Unix time `t`."""
    from datetime import datetime

    def rules() -> list[dict] | None:
        out = [r for g in prometheus.rule_groups() for r in g["rules"] if r["type"] == "alerting"]
        done = all(datetime.fromisoformat(r["lastEvaluation"]).timestamp() > t for r in out)
        return out if out and done else None

    return await_value(rules, timeout, f"every rule evaluated after {t}")


def test_healthy_every_query_answers_and_no_alert_is_pending_or_firing(
        cluster, rendered, prometheus, deployment, module_namespace):
    stream = Stream(deployment).start()
    try:
        stream.await_more(5)
        _await_answered(prometheus, rendered, module_namespace, NAME, fault_only=False)
        # DisaggNoPairs' window holds a full FOR of samples: were a request held for a pair, it would fire now.
        window = f'count_over_time(disagg_router_pair_waiting{{namespace="{module_namespace}"}}[{FOR}s])'
        await_value(lambda: [s for s in prometheus.query(window) if float(s["value"][1]) >= FOR / INTERVAL - 1],
                    3 * FOR, "a full DisaggNoPairs window")
        rules = _evaluated_after(prometheus, time.time())
    finally:
        results = stream.stop()
    assert [r for r in results if r[0] != 200] == []
    assert {r["name"] for r in rules} == set(_rules(rendered))
    assert [(r["name"], r["health"], r.get("lastError")) for r in rules if r["health"] != "ok"] == []
    # This deployment's and the operator's (an alert with no namespace is about the operator): the session's cluster
    # may hold other modules' CRs.
    assert [a for a in prometheus.alerts() if a["labels"].get("namespace") in (None, module_namespace)] == []


def test_the_docs_plain_configuration_finds_the_same_targets_and_answers_every_query(
        cluster, rendered, prometheus, operator_release, module_namespace, tmp_path):
    from disagg.devcluster import build
    from disagg.devcluster.cluster import free_port

    jobs = _docs_scrape_configs(cluster.kubeconfig, operator_release.name, operator_release.namespace)
    config = {"global": {"scrape_interval": f"{INTERVAL}s"}, "scrape_configs": jobs}
    plain = Prometheus(build.bin_dir() / "prometheus", tmp_path, free_port(), config).start()
    scoped = (module_namespace, operator_release.namespace)

    def without_job(prom: Prometheus) -> set[tuple] | None:
        targets = [t for t in prom.targets() if t["labels"].get("namespace") in scoped]
        if not targets or any(t["health"] != "up" for t in targets):
            return None
        return {_target_key(t)[1:4] + _target_key(t)[5:] for t in targets}

    try:
        want = without_job(prometheus)
        assert want
        try:
            await_value(lambda: without_job(plain) == want or None, 60, "the same targets, up")
        except TimeoutError:
            raise AssertionError(f"expected {want}\ngot {without_job(plain)}\n{plain.log()}") from None
        _await_answered(plain, rendered, module_namespace, NAME, fault_only=False, operator_job="disagg-operator")
    finally:
        plain.stop()


def _firing(prometheus: Prometheus, alert: str, **labels: str) -> list[dict] | None:
    found = [a for a in prometheus.alerts() if a["labels"]["alertname"] == alert and a["state"] == "firing"
             and all(a["labels"].get(k) == v for k, v in labels.items())]
    return found or None


def _freeze(namespace: str) -> list[dict]:
    """A ValidatingAdmissionPolicy and its binding refusing any change of a StatefulSet's replicas in `namespace`,
    as a change freeze of a cluster's policy engine would."""
    name = f"e2e-replica-freeze-{namespace}"
    return [
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
         "metadata": {"name": name},
         "spec": {"failurePolicy": "Fail",
                  "matchConstraints": {"resourceRules": [{"apiGroups": ["apps"], "apiVersions": ["v1"],
                                                          "operations": ["UPDATE"], "resources": ["statefulsets"]}]},
                  "validations": [{"expression": "object.spec.replicas == oldObject.spec.replicas",
                                   "message": "replica changes are frozen", "reason": "Invalid"}]}},
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
         "metadata": {"name": name},
         "spec": {"policyName": name, "validationActions": ["Deny"],
                  "matchResources": {"namespaceSelector": {
                      "matchLabels": {"kubernetes.io/metadata.name": namespace}}}}},
    ]


def _decode_statefulset(cluster, namespace: str) -> StatefulSet:
    (sts,) = [s for s in cluster.client.list(StatefulSet, namespace=namespace, labels={
        names.LABEL_INSTANCE: NAME, names.LABEL_COMPONENT: "decode"})]
    return sts


def _scale_decode(cluster, namespace: str, replicas: int) -> None:
    from support.tools import kubectl

    kubectl("scale", "-n", namespace, f"{role_api.PLURAL}/{names.role_object_name(NAME, 'decode')}",
            f"--replicas={replicas}", cluster=cluster)


def test_a_change_freeze_refusing_the_operators_scale_fires_reconcile_errors(
        cluster, rendered, prometheus, module_namespace):
    from support.tools import kubectl

    freeze = yaml.safe_dump_all(_freeze(module_namespace))
    kubectl("apply", "-f", "-", stdin=freeze, cluster=cluster)
    try:
        sts = _decode_statefulset(cluster, module_namespace).metadata.name

        def enforced() -> bool:
            # A merge patch of the StatefulSet, as the operator scales it (not its /scale subresource).
            out = kubectl("patch", "-n", module_namespace, f"statefulset/{sts}", "--type=merge",
                          "--patch", '{"spec": {"replicas": 0}}', "--dry-run=server", cluster=cluster, check=False)
            assert out.returncode != 0 or "patched" in out.stdout, out.stderr
            return out.returncode != 0 and "replica changes are frozen" in out.stderr

        await_value(enforced, 30, "the freeze enforced by the apiserver")
        assert not _firing(prometheus, "DisaggOperatorReconcileErrors")
        _scale_decode(cluster, module_namespace, 0)
        await_value(lambda: _firing(prometheus, "DisaggOperatorReconcileErrors"), 120 + FOR,
                    "DisaggOperatorReconcileErrors firing")
        _await_answered(prometheus, rendered, module_namespace, NAME, fault_only=True, timeout=30)
        assert _decode_statefulset(cluster, module_namespace).spec.replicas == 1  # the freeze held
        assert not _firing(prometheus, "DisaggNoPairs", namespace=module_namespace)
    finally:
        kubectl("delete", "--ignore-not-found", "-f", "-", stdin=freeze, cluster=cluster)


def test_requests_held_for_a_pair_fire_no_pairs_until_a_decode_is_back(cluster, prometheus, deployment,
                                                                        module_namespace):
    """The decode role is at zero (the previous test's scale, applied once the freeze is lifted)."""
    watch_until(cluster, StatefulSet, _decode_statefulset(cluster, module_namespace).metadata.name,
                lambda s: s.spec.replicas == 0 and not (s.status.replicas or 0), namespace=module_namespace,
                timeout=180, what="the decode scaled to zero")
    assert not _firing(prometheus, "DisaggNoPairs", namespace=module_namespace)
    held = Stream(deployment).start()
    try:
        (alert,) = await_value(lambda: _firing(prometheus, "DisaggNoPairs", namespace=module_namespace,
                                               app_kubernetes_io_instance=NAME), 60 + FOR, "DisaggNoPairs firing")
        assert held.results == []  # the request is still held
        _scale_decode(cluster, module_namespace, 1)
        held.await_more(1, timeout=120)
        await_value(lambda: not _firing(prometheus, "DisaggNoPairs", namespace=module_namespace), 30,
                    "DisaggNoPairs resolved")
    finally:
        results = held.stop()
    assert results and [r for r in results if r[0] != 200] == []
    assert alert["labels"]["severity"] == "critical"
    assert alert["annotations"]["summary"].startswith(f"{module_namespace}/{NAME}: "), alert["annotations"]
