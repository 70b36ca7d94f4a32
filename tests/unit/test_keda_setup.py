"""What the dev cluster writes and runs for KEDA (devcluster/keda.py): the aggregation path hangs together, and
KEDA's binaries are built only when asked for."""
from __future__ import annotations

from pathlib import Path

import pytest

from disagg.devcluster import build, keda

PORTS = keda.Ports(adapter=6443, adapter_metrics=6080, grpc=6666, operator_metrics=6081, operator_health=6082)


def by_kind(objs: list[dict]) -> dict[str, dict]:
    return {o["kind"]: o for o in objs}


def test_the_apiservice_reaches_the_adapter_on_this_host_through_its_service():
    objs = by_kind(keda.api_objects("10.0.0.5", PORTS, b"CA"))
    svc, eps, api = objs["Service"], objs["EndpointSlice"], objs["APIService"]
    assert api["spec"]["service"] == {"name": svc["metadata"]["name"], "namespace": svc["metadata"]["namespace"],
                                      "port": svc["spec"]["ports"][0]["port"]}
    assert "selector" not in svc["spec"], "a selectorless Service: its EndpointSlice is ours"
    assert eps["metadata"]["labels"]["kubernetes.io/service-name"] == svc["metadata"]["name"]
    assert eps["metadata"]["namespace"] == svc["metadata"]["namespace"] == keda.NAMESPACE
    assert [p["name"] for p in eps["ports"]] == [p["name"] for p in svc["spec"]["ports"]]
    assert eps["ports"][0]["port"] == svc["spec"]["ports"][0]["targetPort"] == PORTS.adapter
    assert eps["endpoints"][0]["addresses"] == ["10.0.0.5"] and eps["addressType"] == "IPv4"
    backend = api["spec"]["service"]
    assert f"{backend['name']}.{backend['namespace']}.svc" in keda.serving_names(), \
        "the aggregator verifies <service>.<namespace>.svc"


def test_the_adapter_calls_the_operators_grpc_port_and_both_share_one_cert_dir():
    op = keda.operator_argv(Path("/bin/op"), Path("/certs"), PORTS)
    ad = keda.adapter_argv(Path("/bin/ad"), Path("/certs"), Path("/kc"), PORTS)
    assert f"--metrics-service-bind-address=127.0.0.1:{PORTS.grpc}" in op
    assert f"--metrics-service-address=127.0.0.1:{PORTS.grpc}" in ad
    assert "--cert-dir=/certs" in op and "--cert-dir=/certs" in ad
    assert f"--secure-port={PORTS.adapter}" in ad


def test_keda_is_built_only_when_named(monkeypatch):
    default = {b.name for b in build.binaries()}
    addons = {b.name for b in build.addon_binaries()}
    assert addons == {"keda-operator", "keda-adapter", "prometheus", "promtool"} and not addons & default
    assert {b.name: b.wrapper for b in build.addon_binaries()} == {
        "keda-operator": build.KEDA_DIR, "keda-adapter": build.KEDA_DIR, "prometheus": build.PROMETHEUS_DIR,
        "promtool": build.PROMETHEUS_DIR}
    monkeypatch.setattr(build, "_go_version", lambda: "go-test")
    monkeypatch.setattr(build.shutil, "which", lambda _n: "/usr/bin/go")
    with pytest.raises(SystemExit, match="no such binary: nope"):
        build.ensure_built(["keda-operator", "nope"])
