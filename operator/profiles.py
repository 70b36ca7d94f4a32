"""Accelerator profiles: what one node of each supported instance type offers, and what an engine pod on it
needs. Data, not logic; the CRD's CEL rules and the pod builders both read it.

Security choice per profile (documented in docs/operating/security.md): NVIDIA profiles run the engine
`privileged`, because registering GPU memory with the EFA NIC (`fi_mr_reg` over dmabuf/peer-memory) needs more
than IPC_LOCK on stock EKS AMIs (NVIDIA Dynamo's EFA guide). Trainium profiles use IPC_LOCK only: the Neuron
driver exposes its devices through the device plugin and libfabric only needs to pin host memory. The cpu profile
adds no capability: UCX over TCP and shared memory pins nothing, and Pod Security `baseline` (kind, minikube, CI
clusters) refuses IPC_LOCK.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from disagg.connector.wire import env as wire_env

GPU = "nvidia.com/gpu"
NEURON = "aws.amazon.com/neuron"
EFA = "vpc.amazonaws.com/efa"
INSTANCE_TYPE_KEY = "node.kubernetes.io/instance-type"

CPU_PROFILE = "cpu"
CPU_ENGINES_LABEL = "serving.disagg.io/cpu-engines"
"""Nodes meant for CPU engines carry this label with CPU_ENGINES_VALUE, and the taint
`serving.disagg.io/cpu-engines=true:NoSchedule` (CPU_ENGINES_TAINT), so that only pods of the cpu profile (its
engines, router and rendezvous) land there. The dev cluster's real node imports these."""
CPU_ENGINES_VALUE = "true"
CPU_ENGINES_TAINT = {"key": CPU_ENGINES_LABEL, "value": CPU_ENGINES_VALUE, "effect": "NoSchedule"}
DEFAULT_CPU_KV_CACHE_GIB = 4
"""KV cache per CPU engine (VLLM_CPU_KVCACHE_SPACE, GiB) when spec.accelerator.kvCacheGiB is unset."""


@dataclass(frozen=True)
class Profile:
    name: str
    # None: not one instance type (the cpu profile selects nodes by label instead).
    instance_type: str | None
    # None: no device resource (the cpu profile).
    accelerator_resource: str | None
    # Parallel ranks one node can host (GPUs, or logical NeuronCores at the default LNC=2 for trn2).
    ranks_per_node: int
    # Ranks served by one device of `accelerator_resource` (1 GPU; 2 NeuronCores per trn1 chip, 4 logical per trn2).
    ranks_per_device: int
    efa_per_node: int
    privileged: bool
    hugepages_2mi: str = "5120Mi"
    shm_size: str = "64Gi"
    tolerations: tuple[tuple[str, str], ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    # Engine pod defaults per device of `accelerator_resource`: about half the node's CPU and memory per
    # device share, leaving room for the kubelet, daemonsets and the /dev/shm tmpfs.
    cpu_per_device: int = 12
    memory_gi_per_device: int = 128
    # Startup-probe budget: model load (NVIDIA) or Neuron graph compilation (Trainium, can take hours).
    startup_seconds: int = 1800
    # Node labels the engines select instead of the instance type.
    node_labels: tuple[tuple[str, str], ...] = ()
    # Env every engine of the profile gets (`env` above is the EFA env, set only with EFA).
    engine_env: dict[str, str] = field(default_factory=dict)
    capabilities: tuple[str, ...] = ("IPC_LOCK",)
    # vLLM's `kv_buffer_device`; None leaves vLLM's default (the accelerator).
    kv_buffer_device: str | None = None
    # Require prefill and decode in one zone (EFA does not cross zones).
    same_zone: bool = True

    @property
    def cpu_only(self) -> bool:
        """Engines run vLLM's CPU build: no device resource, KV in host memory, pinned to the container's cores."""
        return self.accelerator_resource is None

    def node_selector(self) -> dict[str, str]:
        return dict(self.node_labels) if self.node_labels else {INSTANCE_TYPE_KEY: str(self.instance_type)}

    def pod_tolerations(self) -> list[dict[str, str]]:
        return [{"key": key, "operator": "Exists", "effect": effect} for key, effect in self.tolerations]

    def devices_for(self, ranks: int) -> int:
        return -(-ranks // self.ranks_per_device)

    def efa_for(self, ranks: int) -> int:
        """EFA devices in proportion to the node share the pod takes (p5en: 2 per GPU)."""
        return self.efa_per_node * self.devices_for(ranks) // (self.ranks_per_node // self.ranks_per_device)


# libfabric settings from AWS's EFA guidance for GPU-direct RDMA.
_EFA_ENV = {
    "FI_PROVIDER": "efa",
    "FI_EFA_USE_DEVICE_RDMA": "1",
    "FI_EFA_USE_HUGE_PAGE": "1",
    "FI_EFA_ENABLE_SHM_TRANSFER": "0",
    "FI_EFA_FORK_SAFE": "1",
    "FI_EFA_MR_MAX_CACHED_COUNT": "524288",
    "FI_EFA_MR_MAX_CACHED_SIZE": "0",
    "LD_LIBRARY_PATH": "/opt/amazon/efa/lib:/opt/amazon/openmpi/lib:/usr/local/lib",
}

PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        # 192 vCPU, 2 TiB, 8 GPUs.
        Profile("nvidia-h200", "p5en.48xlarge", GPU, 8, 1, 16, True, tolerations=((GPU, "NoSchedule"),),
                env=_EFA_ENV),
        Profile("nvidia-h100", "p5.48xlarge", GPU, 8, 1, 32, True, tolerations=((GPU, "NoSchedule"),),
                env=_EFA_ENV),
        # 192 vCPU, 2 TiB, 16 Trainium2 devices.
        Profile("trainium2", "trn2.48xlarge", NEURON, 64, 4, 16, False, tolerations=((NEURON, "NoSchedule"),),
                env={**_EFA_ENV, "FI_EFA_USE_DEVICE_RDMA": "1", "NEURON_RT_VIRTUAL_CORE_SIZE": "2"},
                cpu_per_device=8, memory_gi_per_device=96, startup_seconds=7200),
        # 128 vCPU, 512 GiB, 16 Trainium devices.
        Profile("trainium1", "trn1.32xlarge", NEURON, 32, 2, 8, False, tolerations=((NEURON, "NoSchedule"),),
                env={**_EFA_ENV, "FI_EFA_USE_DEVICE_RDMA": "1"},
                cpu_per_device=6, memory_gi_per_device=24, startup_seconds=7200),
        # Any node labelled for CPU engines (kind, minikube, a CI cluster). One rank per pod; "device" is the
        # pod's share: 4 cores and 4 GiB for vLLM itself, plus the KV cache (engine_builders adds it). UCX over
        # TCP (and shared memory on one node), and NIXL's progress thread sleeping in poll() instead of spinning
        # the core the model needs (wire_env.CPU_ENGINE_ENV).
        Profile(CPU_PROFILE, None, None, 1, 1, 0, False, shm_size="1Gi",
                tolerations=((CPU_ENGINES_LABEL, CPU_ENGINES_TAINT["effect"]),),
                node_labels=((CPU_ENGINES_LABEL, CPU_ENGINES_VALUE),), engine_env=dict(wire_env.CPU_ENGINE_ENV),
                cpu_per_device=4, memory_gi_per_device=4, capabilities=(), kv_buffer_device="cpu",
                same_zone=False),
    )
}
