"""Simulated AWS nodes, shaped like the real ones: capacity, labels and taints as EKS shows them.

Pure data and pure functions: `build_nodes(FleetSpec)` returns Node manifests; nothing here talks to a
cluster. kwok adopts every node carrying the `kwok.x-k8s.io/node: fake` annotation.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

KWOK_ANNOTATION = ("kwok.x-k8s.io/node", "fake")
REGION = "us-west-2"
ZONES = ("us-west-2a", "us-west-2b")

GPU = "nvidia.com/gpu"
NEURON = "aws.amazon.com/neuron"
NEURONCORE = "aws.amazon.com/neuroncore"
EFA = "vpc.amazonaws.com/efa"


@dataclass(frozen=True)
class InstanceType:
    name: str
    cpu: int
    memory: str
    extended: dict[str, int] = field(default_factory=dict)
    hugepages_2mi: str | None = None
    taints: tuple[tuple[str, str], ...] = ()
    gpu_name: str | None = None
    pods: int = 250

    @property
    def family(self) -> str:
        return self.name.split(".")[0]

    @property
    def size(self) -> str:
        return self.name.split(".")[1]


CATALOG: dict[str, InstanceType] = {
    t.name: t
    for t in (
        InstanceType("p5en.48xlarge", 192, "2Ti", {GPU: 8, EFA: 16}, "32Gi", ((GPU, "NoSchedule"),), "h200"),
        InstanceType("p5.48xlarge", 192, "2Ti", {GPU: 8, EFA: 32}, "32Gi", ((GPU, "NoSchedule"),), "h100"),
        InstanceType("trn2.48xlarge", 192, "2Ti", {NEURON: 16, NEURONCORE: 64, EFA: 16}, "32Gi",
                     ((NEURON, "NoSchedule"),)),
        InstanceType("trn1.32xlarge", 128, "512Gi", {NEURON: 16, NEURONCORE: 32, EFA: 8}, "16Gi",
                     ((NEURON, "NoSchedule"),)),
        InstanceType("m7i.4xlarge", 16, "64Gi", {}, None, (), None, 110),
    )
}

# The default fleet from the foundation issue: 4 p5en (one of them advertising only 15 EFA, as real p5en
# nodes sometimes do), 2 trn2, 1 trn1 and 2 plain CPU nodes for control-plane workloads.
DEFAULT_COUNTS: dict[str, int] = {
    "p5en.48xlarge": 4,
    "trn2.48xlarge": 2,
    "trn1.32xlarge": 1,
    "m7i.4xlarge": 2,
}


@dataclass(frozen=True)
class FleetSpec:
    counts: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_COUNTS))
    # How many p5en nodes advertise one EFA device fewer than the instance has.
    short_efa_p5en: int = 1

    @classmethod
    def parse(cls, text: str, short_efa_p5en: int = 1) -> FleetSpec:
        """`p5en.48xlarge=4,trn2.48xlarge=2` (a short family name like `p5en=4` works too)."""
        counts: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, _, n = part.partition("=")
            full = name if name in CATALOG else next((t for t in CATALOG if t.split(".")[0] == name), None)
            if full is None:
                raise ValueError(f"unknown instance type {name!r}; known: {', '.join(CATALOG)}")
            if not n.isdigit():
                raise ValueError(f"count for {name!r} must be a non-negative integer, got {n!r}")
            counts[full] = int(n)
        return cls(counts, short_efa_p5en)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _node_name(t: InstanceType, i: int) -> str:
    return f"{t.family}-{i}"


def _network_layers(global_index: int, zone_index: int) -> dict[str, str]:
    # EKS exposes three levels of network nodes; layer 3 is the closest. Group 4 nodes per layer-3 switch and
    # 16 per layer-2 switch inside a zone so placement preferences have something real to work with.
    return {
        "topology.k8s.aws/network-node-layer-1": f"nn-{zone_index:02d}00",
        "topology.k8s.aws/network-node-layer-2": f"nn-{zone_index:02d}1{global_index // 16:02d}",
        "topology.k8s.aws/network-node-layer-3": f"nn-{zone_index:02d}2{global_index // 4:03d}",
    }


def build_node(t: InstanceType, i: int, zone_index: int, global_index: int,
               efa_override: int | None = None) -> dict[str, Any]:
    name = _node_name(t, i)
    resources: dict[str, str] = {"cpu": str(t.cpu), "memory": t.memory, "pods": str(t.pods),
                                 "ephemeral-storage": "1Ti"}
    if t.hugepages_2mi:
        resources["hugepages-2Mi"] = t.hugepages_2mi
    for k, v in t.extended.items():
        resources[k] = str(efa_override if (k == EFA and efa_override is not None) else v)
    labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "node.kubernetes.io/instance-type": t.name,
        "topology.kubernetes.io/region": REGION,
        "topology.kubernetes.io/zone": ZONES[zone_index],
        "karpenter.sh/capacity-type": "on-demand",
        "karpenter.sh/nodepool": "gpu" if t.taints else "default",
        "karpenter.k8s.aws/instance-family": t.family,
        "karpenter.k8s.aws/instance-size": t.size,
        "karpenter.k8s.aws/instance-cpu": str(t.cpu),
        "type": "kwok",
        **_network_layers(global_index, zone_index),
    }
    if GPU in t.extended:
        labels |= {
            "karpenter.k8s.aws/instance-gpu-count": str(t.extended[GPU]),
            "karpenter.k8s.aws/instance-gpu-manufacturer": "nvidia",
            "karpenter.k8s.aws/instance-gpu-name": t.gpu_name or "",
            "nvidia.com/gpu.present": "true",
        }
    if NEURON in t.extended:
        labels |= {"karpenter.k8s.aws/instance-accelerator-count": str(t.extended[NEURON]),
                   "karpenter.k8s.aws/instance-accelerator-manufacturer": "aws",
                   "karpenter.k8s.aws/instance-accelerator-name": "trainium2" if t.family == "trn2" else "trainium"}
    if EFA in t.extended:
        labels["vpc.amazonaws.com/efa.present"] = "true"
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels, "annotations": {KWOK_ANNOTATION[0]: KWOK_ANNOTATION[1],
                                                                      "node.alpha.kubernetes.io/ttl": "0"}},
        "spec": {"taints": [{"key": k, "effect": e} for k, e in t.taints]},
        "status": {
            "capacity": dict(resources),
            "allocatable": dict(resources),
            "addresses": [{"type": "InternalIP", "address": f"10.0.{global_index // 250}.{global_index % 250 + 4}"},
                          {"type": "Hostname", "address": name}],
        },
    }


def build_nodes(spec: FleetSpec) -> list[dict[str, Any]]:
    """Nodes alternate between the two zones per type, so each zone has a share of every accelerator."""
    nodes: list[dict[str, Any]] = []
    short_left = spec.short_efa_p5en
    for type_name, count in spec.counts.items():
        t = CATALOG[type_name]
        for i in range(count):
            override = None
            # The short node is the second p5en in zone a, so zone a still has a full 16-EFA node.
            if t.family == "p5en" and short_left > 0 and i % 2 == 0 and i > 0:
                override, short_left = t.extended[EFA] - 1, short_left - 1
            nodes.append(build_node(t, i, zone_index=i % 2, global_index=len(nodes), efa_override=override))
    return nodes
