"""The DisaggregatedInference API (serving.disagg.io/v1alpha1) as typed models.

These models are the single source of truth: `crdgen.py` turns them into the CRD in `crds/`, the builders
read them, and the operator parses every object through them. Each attribute's docstring becomes its
`kubectl explain` text. CEL rules (`x-kubernetes-validations`) sit on the model they constrain, so the
apiserver itself rejects bad input with a message that names the field.
"""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from .profiles import PROFILES

GROUP = "serving.disagg.io"
VERSION = "v1alpha1"
KIND = "DisaggregatedInference"
PLURAL = "disaggregatedinferences"
SINGULAR = "disaggregatedinference"
SHORT_NAMES = ["dinf"]

PUSH_CONNECTOR = "NixlPushConnector"
PULL_CONNECTOR = "NixlConnector"


def _cel(rule: str, message: str | None = None, *, message_expression: str | None = None,
         field_path: str | None = None, reason: str | None = None) -> dict[str, str]:
    out = {"rule": rule}
    if message:
        out["message"] = message
    if message_expression:
        out["messageExpression"] = message_expression
    if field_path:
        out["fieldPath"] = field_path
    if reason:
        out["reason"] = reason
    return out


class Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid",
                              use_attribute_docstrings=True)

    def dump(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class SecretKeyRef(Model):
    """A key in a Secret in the same namespace."""

    name: str = Field(min_length=1)
    """Name of the Secret."""
    key: str = Field(default="token", min_length=1)
    """Key within the Secret."""


class PVCSource(Model):
    """Weights already on a PersistentVolumeClaim (for example FSx for Lustre or EFS)."""

    claim_name: str = Field(min_length=1)
    """Name of an existing PersistentVolumeClaim in the same namespace."""
    path: str = "/"
    """Directory inside the volume that holds the model (config.json, weights, tokenizer)."""


class HubSource(Model):
    """Weights downloaded from a model hub at engine start."""

    token_secret: SecretKeyRef | None = None
    """Secret holding the hub access token, exposed to the engine as HF_TOKEN."""


class ModelSource(Model):
    """Where the weights come from. Exactly one of `pvc` or `hub`; the hub is used when neither is set."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        _cel("!(has(self.pvc) && has(self.hub))", "spec.model.source: set at most one of pvc or hub")]})
    pvc: PVCSource | None = None
    """Load the model from an existing PersistentVolumeClaim."""
    hub: HubSource | None = None
    """Download the model from the hub by `spec.model.name`."""


class ModelSpec(Model):
    """The model to serve."""

    name: str = Field(min_length=1, max_length=512)
    """Model id, for example `Qwen/Qwen3-32B`. With a PVC source it names the model; the path locates it."""
    served_name: str | None = Field(default=None, min_length=1)
    """Name clients use in requests (`model` in the OpenAI API). Defaults to `name`."""
    source: ModelSource = Field(default_factory=ModelSource)
    """Where the weights come from."""
    max_model_len: int | None = Field(default=None, ge=1)
    """Maximum context length (`--max-model-len`). Defaults to the model's own."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Weight and activation dtype (`--dtype`). Prefill and decode always use the same value."""


class EnvVar(Model):
    """An environment variable with a literal value."""

    name: str = Field(min_length=1)
    """Variable name."""
    value: str = ""
    """Variable value."""


class EngineSpec(Model):
    """Settings shared by the prefill and decode engines."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        _cel("self.blockSize in [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]",
             message_expression="'spec.engine.blockSize must be a power of two (128 is recommended for NIXL), got '"
                                " + string(self.blockSize)", field_path=".blockSize")]})
    image: str = Field(default="vllm/vllm-openai:v0.32.0", min_length=1)
    """vLLM image for both roles. On EFA it must carry the EFA userspace (libfabric with the efa provider)."""
    block_size: int = Field(default=128, ge=1, le=4096)
    """KV cache block size in tokens, identical on both roles (`--block-size`)."""
    port: int = Field(default=8000, ge=1, le=65535)
    """HTTP port of the OpenAI-compatible server in each engine."""
    args: list[str] = Field(default_factory=list)
    """Extra vLLM arguments appended for both roles."""
    env: list[EnvVar] = Field(default_factory=list)
    """Extra environment variables for both roles."""


class KVTransferSpec(Model):
    """How KV cache moves from prefill to decode."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        _cel("!(self.mode == 'push' && self.bidirectional)",
             "spec.kvTransfer.bidirectional: push mode does not support bidirectional transfer; use mode: pull",
             field_path=".bidirectional"),
    ]})
    mode: Literal["push", "pull"] = "push"
    """`push`: decode pre-registers its blocks and prefill WRITEs KV as soon as it finishes (NixlPushConnector).
    `pull`: decode READs KV after prefill returns (NixlConnector)."""
    connector: str | None = Field(default=None, min_length=1)
    """vLLM KV connector class. Defaults to NixlPushConnector (push) or NixlConnector (pull); override for
    vendor connectors such as Neuron's NeuronNixlConnector."""
    backend: Literal["LIBFABRIC", "UCX"] | None = None
    """NIXL transport backend. Defaults to LIBFABRIC when EFA is in use, UCX otherwise."""
    bidirectional: bool = False
    """Let KV also flow from decode back to prefill (pull mode only)."""
    side_channel_port: int = Field(default=5600, ge=1024, le=65535)
    """Base port of the NIXL side channel (one per data-parallel rank, from this port up)."""
    lease_seconds: int = Field(default=30, ge=1, le=3600)
    """How long prefill holds finished KV blocks for decode to claim before freeing them."""
    registration_timeout_seconds: int = Field(default=60, ge=1, le=3600)
    """How long a decode request waits for its KV before it is aborted (vLLM's default is 480 s)."""


EfaSetting = Union[Literal["auto", "off"], int]


class AcceleratorSpec(Model):
    """The accelerator profile and EFA usage. The profile fixes the instance type, the device resource, the
    per-pod EFA share and the security settings."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        _cel("type(self.efa) == string ? self.efa in ['auto', 'off'] : self.efa >= 0",
             "spec.accelerator.efa must be 'auto', 'off', or a non-negative count", field_path=".efa"),
        _cel("type(self.efa) == string || self.efa <= (self.profile == 'nvidia-h100' ? 32 :"
             " self.profile == 'trainium1' ? 8 : 16)",
             message_expression="'spec.accelerator.efa: ' + string(self.efa) + ' EFA devices exceed the ' + "
                                "(self.profile == 'nvidia-h100' ? '32 of p5.48xlarge' : self.profile == 'trainium1'"
                                " ? '8 of trn1.32xlarge' : self.profile == 'trainium2' ? '16 of trn2.48xlarge' :"
                                " '16 of p5en.48xlarge')",
             field_path=".efa"),
    ]})
    profile: Literal[tuple(PROFILES)]  # type: ignore[valid-type]
    """Accelerator profile: nvidia-h200 (p5en.48xlarge), nvidia-h100 (p5.48xlarge), trainium2 (trn2.48xlarge)
    or trainium1 (trn1.32xlarge)."""
    efa: EfaSetting = Field(default="auto", json_schema_extra={"x-kubernetes-int-or-string": True})
    """EFA devices per engine pod: `auto` (in proportion to the accelerators the pod uses; p5en: 2 per GPU),
    `off` (TCP only; for tests), or an explicit count."""


class Toleration(Model):
    """A pod toleration."""

    key: str | None = None
    """Taint key; empty with operator Exists matches every taint."""
    operator: Literal["Exists", "Equal"] = "Equal"
    """Exists or Equal."""
    value: str | None = None
    """Taint value for Equal."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect to match; empty matches all."""
    toleration_seconds: int | None = None
    """For NoExecute: how long the pod stays bound after the taint appears."""


class ResourceOverrides(Model):
    """Resource requests and limits merged over what the profile computes (per key)."""

    requests: dict[str, Union[int, str]] = Field(default_factory=dict)
    """Requests, for example cpu: 32, memory: 256Gi."""
    limits: dict[str, Union[int, str]] = Field(default_factory=dict)
    """Limits, for example memory: 512Gi."""


class RoleSpec(Model):
    """One role's engines (prefill or decode)."""

    replicas: int = Field(default=1, ge=0, le=1000)
    """Number of engine pods."""
    tensor_parallel_size: int = Field(default=1, ge=1, le=128)
    """Tensor parallel size (`--tensor-parallel-size`); must fit in one node."""
    pipeline_parallel_size: int = Field(default=1, ge=1, le=64)
    """Pipeline parallel size (`--pipeline-parallel-size`)."""
    data_parallel_size: int = Field(default=1, ge=1, le=64)
    """Data parallel ranks inside each pod (`--data-parallel-size`); each has its own side-channel port."""
    resources: ResourceOverrides = Field(default_factory=ResourceOverrides)
    """Overrides for the computed requests and limits."""
    args: list[str] = Field(default_factory=list)
    """Extra vLLM arguments for this role, after `spec.engine.args`."""
    env: list[EnvVar] = Field(default_factory=list)
    """Extra environment variables for this role."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Merged over the profile's instance-type selector."""
    tolerations: list[Toleration] = Field(default_factory=list)
    """Added to the profile's tolerations."""
    affinity: dict[str, Any] | None = Field(default=None, json_schema_extra={"x-kubernetes-preserve-unknown-fields": True})
    """A core/v1 Affinity merged over the placement rules the operator computes."""
    pod_template: dict[str, Any] | None = Field(default=None,
                                                json_schema_extra={"x-kubernetes-preserve-unknown-fields": True})
    """A partial PodTemplateSpec deep-merged last, for anything this API does not model."""


class RouterSpec(Model):
    """The push-aware router: the deployment's OpenAI-compatible endpoint."""

    replicas: int = Field(default=1, ge=0, le=100)
    """Router pods."""
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    """Type of the router's Service."""
    port: int = Field(default=8000, ge=1, le=65535)
    """Service port."""


class RendezvousSpec(Model):
    """The rendezvous service where engines advertise themselves."""

    heartbeat_seconds: int = Field(default=5, ge=1, le=300)
    """How often engines renew their lease; an entry expires after three missed heartbeats."""


class PlacementSpec(Model):
    """Where engine pods go relative to each other."""

    same_zone: bool = True
    """Keep prefill and decode in one availability zone (EFA does not cross zones)."""
    spread_across_nodes: bool = True
    """Prefer spreading a role's replicas over distinct nodes."""
    prefer_network_layer: bool = True
    """Prefer nodes that share an EKS network-node layer (topology.k8s.aws/network-node-layer-3)."""


def _ranks_rule(role: str) -> dict[str, str]:
    ranks = f"self.{role}.tensorParallelSize * self.{role}.pipelineParallelSize"
    cap = ("(self.accelerator.profile == 'trainium2' ? 64 : self.accelerator.profile == 'trainium1' ? 32 : 8)")
    return _cel(
        f"{ranks} <= {cap}",
        message_expression=(
            f"'spec.{role}: tensorParallelSize × pipelineParallelSize = ' + string({ranks}) + ' exceeds the ' + "
            f"string({cap}) + ' accelerators of one node for profile ' + self.accelerator.profile + "
            "'; multi-node tensor/pipeline parallelism is not supported yet'"),
        field_path=f".{role}.tensorParallelSize")


class DisaggregatedInferenceSpec(Model):
    """A model served with disaggregated prefill and decode engines."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        _ranks_rule("prefill"),
        _ranks_rule("decode"),
        _cel("self.prefill.tensorParallelSize <= self.decode.tensorParallelSize",
             message_expression="'spec.prefill.tensorParallelSize (' + string(self.prefill.tensorParallelSize) + "
                                "') must not exceed spec.decode.tensorParallelSize (' + "
                                "string(self.decode.tensorParallelSize) + '): unsupported for non-MLA models'",
             field_path=".prefill.tensorParallelSize"),
        _cel("self.kvTransfer.mode != 'push' || self.decode.pipelineParallelSize == 1",
             "spec.decode.pipelineParallelSize: push mode does not support pipeline parallelism on decode; "
             "use mode: pull or pipelineParallelSize: 1", field_path=".decode.pipelineParallelSize"),
        _cel("!has(self.kvTransfer.backend) || self.kvTransfer.backend != 'LIBFABRIC' || "
             "(type(self.accelerator.efa) == int ? self.accelerator.efa > 0 : self.accelerator.efa != 'off')",
             "spec.kvTransfer.backend: LIBFABRIC needs EFA; set spec.accelerator.efa to auto or a count, or use UCX",
             field_path=".kvTransfer.backend"),
    ]})
    model: ModelSpec
    """The model to serve."""
    accelerator: AcceleratorSpec
    """Accelerator profile and EFA usage."""
    engine: EngineSpec = Field(default_factory=EngineSpec)
    """Settings shared by both roles."""
    kv_transfer: KVTransferSpec = Field(default_factory=KVTransferSpec)
    """KV transfer between prefill and decode."""
    prefill: RoleSpec = Field(default_factory=RoleSpec)
    """Prefill engines (KV producers)."""
    decode: RoleSpec = Field(default_factory=RoleSpec)
    """Decode engines (KV consumers)."""
    router: RouterSpec = Field(default_factory=RouterSpec)
    """The router in front of both roles."""
    rendezvous: RendezvousSpec = Field(default_factory=RendezvousSpec)
    """The rendezvous service."""
    placement: PlacementSpec = Field(default_factory=PlacementSpec)
    """Placement of engine pods."""

    # -- derived values: one place decides each default ---------------------------------------------------
    @property
    def profile(self):
        return PROFILES[self.accelerator.profile]

    @property
    def connector(self) -> str:
        return self.kv_transfer.connector or (PUSH_CONNECTOR if self.kv_transfer.mode == "push" else PULL_CONNECTOR)

    def efa_for(self, role: RoleSpec) -> int:
        efa = self.accelerator.efa
        if efa == "off":
            return 0
        if efa == "auto":
            return self.profile.efa_for(role.tensor_parallel_size * role.pipeline_parallel_size)
        return int(efa)

    @property
    def efa_enabled(self) -> bool:
        return self.efa_for(self.prefill) > 0 or self.efa_for(self.decode) > 0

    @property
    def backend(self) -> str:
        return self.kv_transfer.backend or ("LIBFABRIC" if self.efa_enabled else "UCX")

    @property
    def served_name(self) -> str:
        return self.model.served_name or self.model.name


class Condition(Model):
    """A status condition (metav1.Condition shape)."""

    type: str
    """Ready, Progressing, Degraded or TransportVerified."""
    status: Literal["True", "False", "Unknown"]
    """True, False or Unknown."""
    reason: str = ""
    """Machine-readable CamelCase reason."""
    message: str = ""
    """Human-readable detail."""
    last_transition_time: str | None = None
    """When the status last changed (RFC 3339)."""
    observed_generation: int | None = None
    """The .metadata.generation this condition was computed from."""


class RoleStatus(Model):
    """Replica counts of one role."""

    desired: int = 0
    """Replicas requested."""
    ready: int = 0
    """Replicas whose engine passes its readiness probe."""
    updated: int = 0
    """Replicas running the current pod template."""


class DisaggregatedInferenceStatus(Model):
    """Observed state, written by the operator."""

    observed_generation: int | None = None
    """The .metadata.generation the operator last reconciled."""
    conditions: list[Condition] = Field(default_factory=list)
    """Ready, Progressing and Degraded, with reasons and messages."""
    prefill: RoleStatus = Field(default_factory=RoleStatus)
    """Prefill replica counts."""
    decode: RoleStatus = Field(default_factory=RoleStatus)
    """Decode replica counts."""
    endpoint: str | None = None
    """In-cluster URL of the router (the OpenAI-compatible endpoint)."""
    connector: str | None = None
    """Effective KV connector class."""
    backend: str | None = None
    """Effective NIXL backend."""
    mode: str | None = None
    """Effective KV transfer mode (for the printer column)."""
    prefill_ready: str | None = None
    """Prefill ready/desired, for the printer column."""
    decode_ready: str | None = None
    """Decode ready/desired, for the printer column."""


class DisaggregatedInference(Model):
    """Disaggregated vLLM serving: prefill and decode engines with push- or pull-mode NIXL KV transfer."""

    model_config = ConfigDict(extra="ignore")
    api_version: str = f"{GROUP}/{VERSION}"
    """APIVersion of this object."""
    kind: str = KIND
    """Kind of this object."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    """Standard object metadata."""
    spec: DisaggregatedInferenceSpec
    """Desired state."""
    status: DisaggregatedInferenceStatus | None = None
    """Observed state."""
