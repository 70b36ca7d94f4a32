from __future__ import annotations

import pytest

from disagg.devcluster.fleet import CATALOG, EFA, FleetSpec, build_nodes


def test_default_fleet_matches_the_issue():
    nodes = build_nodes(FleetSpec())
    types = [n["metadata"]["labels"]["node.kubernetes.io/instance-type"] for n in nodes]
    assert types.count("p5en.48xlarge") == 4
    assert types.count("trn2.48xlarge") == 2
    assert types.count("trn1.32xlarge") == 1
    assert types.count("m7i.4xlarge") == 2
    p5en = [n for n in nodes if n["metadata"]["labels"]["karpenter.k8s.aws/instance-family"] == "p5en"]
    assert sorted(n["status"]["allocatable"][EFA] for n in p5en) == ["15", "16", "16", "16"]
    full = p5en[0]["status"]["allocatable"]
    assert full["nvidia.com/gpu"] == "8" and full["cpu"] == "192" and full["memory"] == "2Ti"
    assert "hugepages-2Mi" in full
    assert p5en[0]["spec"]["taints"] == [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]
    trn1 = next(n for n in nodes if n["metadata"]["name"] == "trn1-0")
    assert trn1["status"]["allocatable"]["aws.amazon.com/neuron"] == "16"
    assert trn1["status"]["allocatable"][EFA] == "8"


def test_every_zone_gets_a_full_efa_p5en():
    nodes = build_nodes(FleetSpec())
    full = {n["metadata"]["labels"]["topology.kubernetes.io/zone"] for n in nodes
            if n["status"]["allocatable"].get(EFA) == "16" and n["metadata"]["name"].startswith("p5en")}
    assert full == {"us-west-2a", "us-west-2b"}


def test_scale_fleet_has_unique_names_and_addresses():
    nodes = build_nodes(FleetSpec.parse("p5en=150,trn2=40,m7i=10"))
    assert len(nodes) == 200
    assert len({n["metadata"]["name"] for n in nodes}) == 200
    assert len({n["status"]["addresses"][0]["address"] for n in nodes}) == 200
    layer3 = {n["metadata"]["labels"]["topology.k8s.aws/network-node-layer-3"] for n in nodes}
    assert 1 < len(layer3) < 200


@pytest.mark.parametrize("text, message", [
    ("p9=1", "unknown instance type 'p9'"),
    ("p5en=-1", "must be a non-negative integer"),
    ("p5en=x", "must be a non-negative integer"),
])
def test_fleet_parse_rejects_bad_input(text, message):
    with pytest.raises(ValueError, match=message):
        FleetSpec.parse(text)


def test_catalog_labels_are_real_eks_keys():
    node = build_nodes(FleetSpec({"p5en.48xlarge": 1}))[0]
    labels = node["metadata"]["labels"]
    for key in ("node.kubernetes.io/instance-type", "topology.kubernetes.io/zone", "karpenter.sh/capacity-type",
                "karpenter.k8s.aws/instance-family", "topology.k8s.aws/network-node-layer-1"):
        assert key in labels
    assert node["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake"
    assert set(CATALOG) >= {"p5en.48xlarge", "trn2.48xlarge", "trn1.32xlarge"}
