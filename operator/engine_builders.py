"""Engine objects per role: vLLM arguments, launch scripts, StatefulSet, headless Service and PDB."""
from __future__ import annotations

import hashlib
import json
import posixpath
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from disagg.connector.wire import emulator as emulator_contract
from disagg.connector.wire import env as wire_env
from disagg.connector.wire import kv_events as wire_kv_events
from disagg.connector.wire.kv_transfer import KV_ROLES
from disagg.connector.wire.kv_transfer import kv_transfer_config as render_kv_transfer_config

from . import names
from .api import DisaggregatedInference, DisaggregatedInferenceSpec, RoleSpec, ranks_per_pod
from .launch_script import ENGINE_ID_PLACEHOLDER, render_emulator_script, render_launch_script
from .merge import deep_merge
from .meta import OperatorImages, cr_name, http_probe, namespace_of, object_meta
from .profiles import EFA

ENGINE_CONTAINER = "engine"
PLUGIN_CONTAINER = "install-plugin"
PLUGIN_VOLUME = "disagg-plugin"
RENDEZVOUS_TOKEN_VOLUME = "rendezvous-token"
LAUNCH_DIR = "/etc/disagg"
PLUGIN_DIR = "/opt/disagg"
MODELS_DIR = "/models"
HF_CACHE_DIR = "/root/.cache/huggingface"
DRAIN_EXIT_SECONDS = 15
SHM_DIR = "/dev/shm"
TERMINATION_LOG = "/dev/termination-log"
HUGEPAGES = "hugepages-2Mi"
LAUNCH_HASH_ANNOTATION = "serving.disagg.io/launch-script-hash"
RESTARTED_AT_ANNOTATION = "serving.disagg.io/restarted-at"
ZONE_KEY = "topology.kubernetes.io/zone"
HOST_KEY = "kubernetes.io/hostname"
NETWORK_LAYER_KEY = "topology.k8s.aws/network-node-layer-3"
PROBE_PERIOD = 10
EMULATOR_LABEL = "serving.disagg.io/engine"
"""On engine EMULATOR pods, value `emulator`: `kubectl get pods -L serving.disagg.io/engine` tells them from vLLM."""
EMULATOR_RESOURCES = {"requests": {"cpu": "25m", "memory": "80Mi"}, "limits": {"memory": "256Mi"}}
"""An engine emulator's pod: measured idle and busy (bench/emulator_footprint.py); no cpu limit, as for engines."""
EMULATOR_KV_EVENT_PORTS = (("kv-events", emulator_contract.KV_EVENTS_PORT),
                           ("kv-replay", emulator_contract.KV_EVENTS_REPLAY_PORT))
EMULATOR_STARTUP_SECONDS = 120

_UNITS = {"Ki": 1, "Mi": 1024, "Gi": 1024 ** 2, "Ti": 1024 ** 3}


def role_spec(spec: DisaggregatedInferenceSpec, role: str) -> RoleSpec:
    if role not in KV_ROLES:
        raise ValueError(f"role must be one of {tuple(KV_ROLES)}, got {role!r}")
    return spec.prefill if role == "prefill" else spec.decode




def side_channel_ports(spec: DisaggregatedInferenceSpec, role: RoleSpec) -> list[int]:
    """One NIXL side-channel listener per DP rank, from the base port up; rejects clashes with the HTTP port."""
    base = spec.kv_transfer.side_channel_port
    ports = list(range(base, base + role.data_parallel_size))
    if ports[-1] > 65535:
        raise ValueError(f"spec.kvTransfer.sideChannelPort: {base} + {role.data_parallel_size} data-parallel ranks "
                         "runs past port 65535")
    if spec.engine.port in ports:
        raise ValueError(f"spec.engine.port: {spec.engine.port} collides with the NIXL side-channel ports "
                         f"{ports[0]}-{ports[-1]} (spec.kvTransfer.sideChannelPort)")
    return ports


def model_path(spec: DisaggregatedInferenceSpec) -> str:
    """What vLLM loads: a directory on the PVC, or the hub model id."""
    pvc = spec.model.source.pvc
    if pvc is None:
        return spec.model.name
    return posixpath.normpath(posixpath.join(MODELS_DIR, pvc.path.lstrip("/")))


def kv_transfer_config(spec: DisaggregatedInferenceSpec, role: str) -> dict[str, Any]:
    # Bidirectional (pull only) needs both directions on both engines: vLLM's kv_both. Only the classes the
    # plugin wraps (under vLLM's own names) come from it; a vendor connector such as NeuronNixlConnector is
    # vLLM's (or its platform's) to resolve, and its engines do not advertise.
    return render_kv_transfer_config(connector=spec.connector, role=role, engine_id=ENGINE_ID_PLACEHOLDER,
                                     backend=spec.backend, use_plugin=spec.uses_plugin,
                                     buffer_device=spec.profile.kv_buffer_device,
                                     bidirectional=spec.kv_transfer.bidirectional,
                                     push_registration_timeout=spec.kv_transfer.registration_timeout_seconds
                                     if spec.kv_transfer.mode == "push" else None)


def kv_events_config(spec: DisaggregatedInferenceSpec, role_name: str) -> dict[str, Any] | None:
    """vLLM's `--kv-events-config` (vllm/config/kv_events.py) for a role's engines, or None when they publish no
    events (spec.kv_events). The endpoints bind every interface on DP rank 0's ports (wire_env.kv_events_ports);
    vLLM adds its rank to each port for the other data-parallel ranks. Prefix caching, which the events report on,
    is vLLM's default, and the spec refuses args that turn it off."""
    if not spec.kv_events:
        return None
    events, replay = kv_events_ports(spec, role_name)
    return wire_kv_events.vllm_config(events[0], replay[0])


def kv_events_ports(spec: DisaggregatedInferenceSpec, role_name: str) -> tuple[range, range]:
    """The role's KV event ports, events then replay, one of each per data-parallel rank (index = rank)."""
    return wire_env.kv_events_ports(role_spec(spec, role_name).data_parallel_size)


def emulator_args(spec: DisaggregatedInferenceSpec, role_name: str) -> list[str]:
    """`disagg emulator` arguments (connector/emulator/flags.py); its identity comes from the same env as an
    engine's."""
    emulator = spec.engine.emulator
    assert emulator is not None
    role_spec(spec, role_name)
    args = ["--profile", emulator.profile, "--role", role_name, "--kv-mode", spec.kv_transfer.mode,
            "--port", str(spec.engine.port), "--side-channel-port", str(spec.kv_transfer.side_channel_port),
            "--served-model-name", spec.served_name, "--block-size", str(spec.engine.block_size)]
    if spec.model.max_model_len is not None:
        args += ["--max-model-len", str(spec.model.max_model_len)]
    if emulator.kv_cache_blocks is not None:
        args += ["--kv-cache-blocks", str(emulator.kv_cache_blocks)]
    args += ["--registration-timeout", str(spec.kv_transfer.registration_timeout_seconds),
             "--lease-seconds", str(spec.kv_transfer.lease_seconds), "--drain-seconds", str(spec.engine.drain_seconds)]
    return args


def engine_args(spec: DisaggregatedInferenceSpec, role_name: str) -> list[str]:
    """vLLM OpenAI server arguments (the emulator's, for an emulated spec). The engine id in --kv-transfer-config
    is ENGINE_ID_PLACEHOLDER; the launch script replaces it with $DISAGG_ENGINE_ID at runtime."""
    if spec.emulated:
        return emulator_args(spec, role_name)
    role = role_spec(spec, role_name)
    args = ["--model", model_path(spec), "--served-model-name", spec.served_name, "--port", str(spec.engine.port),
            "--tensor-parallel-size", str(role.tensor_parallel_size),
            "--pipeline-parallel-size", str(role.pipeline_parallel_size)]
    if role.data_parallel_size > 1:
        args += ["--data-parallel-size", str(role.data_parallel_size)]
    args += ["--block-size", str(spec.engine.block_size), "--dtype", spec.model.dtype]
    if spec.model.max_model_len is not None:
        args += ["--max-model-len", str(spec.model.max_model_len)]
    args += ["--shutdown-timeout", str(spec.engine.drain_seconds)]
    args += ["--kv-transfer-config", json.dumps(kv_transfer_config(spec, role_name), separators=(",", ":"))]
    events = kv_events_config(spec, role_name)
    if events is not None:  # absent otherwise: a CR that does not ask keeps the engine arguments it had
        # The cached tokens in each answer's usage: what prefix-aware routing's predictions are checked against.
        args += ["--kv-events-config", json.dumps(events, separators=(",", ":")), "--enable-prompt-tokens-details"]
    return args + list(spec.engine.args) + list(role.args)


def _kib(quantity: str) -> int:
    for unit, factor in _UNITS.items():
        if quantity.endswith(unit):
            return int(quantity[: -len(unit)]) * factor
    return int(quantity) // 1024


def launch_script(spec: DisaggregatedInferenceSpec, role_name: str) -> str:
    if spec.emulated:
        return render_emulator_script(role=role_name, args=engine_args(spec, role_name))
    efa = spec.efa_for(role_spec(spec, role_name)) > 0
    # Half the configured size: catches the 64 MiB container-runtime default (volume missing or overlaid
    # away) without failing on how the kubelet rounds or caps the tmpfs.
    return render_launch_script(role=role_name, args=engine_args(spec, role_name), efa_expected=efa,
                                hugepages_expected=efa, shm_min_kib=_kib(spec.profile.shm_size) // 2,
                                bind_allowed_cpus=spec.profile.cpu_only)


def launch_configmap(cr: DisaggregatedInference, revision: str) -> dict[str, Any]:
    """One revision's launch scripts. Per revision, so a pod of an older revision that restarts mid-rollout
    still runs its own engine arguments."""
    name = cr_name(cr)
    data = {names.launch_script_key(r): launch_script(cr.spec, r) for r in names.ENGINE_ROLES}
    # Component "launch" is only a label here: no selector ever targets it.
    meta = object_meta(cr, names.launch_configmap_name(name, revision), "launch")
    meta["labels"][names.LABEL_REVISION] = revision
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}


def _env(name: str, value: str | int) -> dict[str, Any]:
    return {"name": name, "value": str(value)}


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _dedupe(env: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # Last value wins, but at the FIRST position: an override must not move a variable below the $(VAR)
    # references that expand it (POD_NAME/POD_UID before DISAGG_ENGINE_ID).
    out: dict[str, dict[str, Any]] = {}
    for item in env:
        out[item["name"]] = item
    return list(out.values())


def rendezvous_token_env(cr: str) -> dict[str, Any]:
    """auth token: the deployment's shared write token, from the Secret the operator creates once."""
    return {"name": wire_env.RENDEZVOUS_TOKEN, "valueFrom": {"secretKeyRef": {
        "name": names.rendezvous_token_secret(cr), "key": names.RENDEZVOUS_TOKEN_KEY}}}


def engine_rendezvous_auth_env(cr: DisaggregatedInference) -> dict[str, Any]:
    """How an engine proves itself to the rendezvous: auth kubernetes, the pod's projected ServiceAccount token
    (a file the kubelet rotates, re-read on every request); auth token, the shared token."""
    if cr.spec.rendezvous.auth == "kubernetes":
        return _env(wire_env.RENDEZVOUS_TOKEN_FILE, posixpath.join(names.RENDEZVOUS_TOKEN_DIR,
                                                                    names.RENDEZVOUS_TOKEN_PATH))
    return rendezvous_token_env(cr_name(cr))


def engine_env(cr: DisaggregatedInference, role_name: str) -> list[dict[str, Any]]:
    spec, name = cr.spec, cr_name(cr)
    role = role_spec(spec, role_name)
    env: list[dict[str, Any]] = []
    if not spec.emulated:  # vLLM's and NIXL's own settings: an emulator reads none of them
        env += [_env(k, v) for k, v in spec.profile.engine_env.items()]
        if spec.efa_for(role) > 0:
            env += [_env(k, v) for k, v in spec.profile.env.items()]
        if spec.profile.cpu_only:
            env.append(_env("VLLM_CPU_KVCACHE_SPACE", spec.cpu_kv_cache_gib))
    env += [
        _field_env(wire_env.POD_NAME, "metadata.name"),
        _field_env(wire_env.POD_UID, "metadata.uid"),
        _field_env(wire_env.POD_IP, "status.podIP"),
        _env(wire_env.ENGINE_ID, f"$({wire_env.POD_NAME})-$({wire_env.POD_UID})"),
        _env(wire_env.SIDE_CHANNEL_HOST, f"$({wire_env.POD_IP})"),
        _env(wire_env.SIDE_CHANNEL_PORT, spec.kv_transfer.side_channel_port),
        _env(wire_env.ROLE, role_name),
        _env(wire_env.DEPLOYMENT, name),
        _env(wire_env.LAYOUT_KEY, names.layout_key(spec)),
        _env(wire_env.RENDEZVOUS_URL, names.rendezvous_url(name, namespace_of(cr))),
        engine_rendezvous_auth_env(cr),
        _env(wire_env.HEARTBEAT_SECONDS, spec.rendezvous.heartbeat_seconds),
        # vLLM's own knob for how long a producer keeps unclaimed KV blocks (pull mode's lease).
        _env("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", spec.kv_transfer.lease_seconds),
        # The plugin runs inside vLLM's engine core, which does not know the API server's port it advertises.
        _env(wire_env.HTTP_PORT, spec.engine.port),
    ]
    if spec.kv_events and not spec.emulated:  # the emulator advertises the ports it bound itself
        events, replay = kv_events_ports(spec, role_name)
        env += [_env(wire_env.KV_EVENTS_PORT, events[0]), _env(wire_env.KV_EVENTS_REPLAY_PORT, replay[0])]
    if spec.uses_plugin:
        env.append(_env("PYTHONPATH", PLUGIN_DIR))  # the init container's copy of disagg.connector
    hub = spec.model.source.hub
    if spec.model.source.pvc is None and not spec.emulated:
        env.append(_env("HF_HOME", HF_CACHE_DIR))
        if hub is not None and hub.token_secret is not None:
            env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
                "name": hub.token_secret.name, "key": hub.token_secret.key}}})
    env += [_env(e.name, e.value) for e in [*spec.engine.env, *role.env]]
    return _dedupe(env)


def engine_resources(spec: DisaggregatedInferenceSpec, role_name: str) -> dict[str, dict[str, str]]:
    """Profile defaults (cpu/memory per device, devices, EFA, hugepages; cpu profile: plus the KV cache in
    memory), then role.resources per key."""
    role, profile = role_spec(spec, role_name), spec.profile
    if spec.emulated:
        # An emulator computes nothing: no device, EFA or hugepages, and a share of a core that lets dozens of
        # them share a node.
        requests, limits = dict(EMULATOR_RESOURCES["requests"]), dict(EMULATOR_RESOURCES["limits"])
    else:
        devices = profile.devices_for(ranks_per_pod(role))
        memory_gi = profile.memory_gi_per_device * devices + (spec.cpu_kv_cache_gib if profile.cpu_only else 0)
        memory, cpu = f"{memory_gi}Gi", str(profile.cpu_per_device * devices)
        # No cpu limit: CFS throttling. On CPU engines worse still: vLLM runs one OMP thread per core it binds (all
        # of the shared pool without the static CPU manager), so a quota would throttle the model's own threads. A
        # role that sets limits.cpu equal to an integer requests.cpu gets a Guaranteed pod and, under the static
        # CPU manager, exclusive cores (see plugin_install_resources).
        requests = {"cpu": cpu, "memory": memory}
        limits = {"memory": memory}
        if profile.accelerator_resource is not None:
            requests[profile.accelerator_resource] = limits[profile.accelerator_resource] = str(devices)
        efa = spec.efa_for(role)
        if efa > 0:
            requests[EFA] = limits[EFA] = str(efa)
            requests[HUGEPAGES] = limits[HUGEPAGES] = profile.hugepages_2mi
    # Keys whose request equals the limit (devices, EFA, hugepages, memory) must stay equal: an override on
    # one side applies to both unless the user sets both.
    paired = {k for k, v in requests.items() if limits.get(k) == v}
    over_req = {k: str(v) for k, v in role.resources.requests.items()}
    over_lim = {k: str(v) for k, v in role.resources.limits.items()}
    for key, value in over_req.items():
        requests[key] = value
        if key in paired and key not in over_lim:
            limits[key] = value
    for key, value in over_lim.items():
        limits[key] = value
        if key in paired and key not in over_req:
            requests[key] = value
    return {"requests": dict(sorted(requests.items())), "limits": dict(sorted(limits.items()))}


def engine_security_context(spec: DisaggregatedInferenceSpec, role_name: str) -> dict[str, Any]:
    # The per-profile choice and its reasons live in profiles.py: NVIDIA needs privileged for fi_mr_reg of GPU
    # memory over EFA; everything else (Trainium, or no EFA) only pins host memory, which IPC_LOCK allows; CPU
    # engines (UCX over TCP) pin nothing; nor does an emulator.
    if spec.emulated:
        return {"allowPrivilegeEscalation": False}
    if spec.profile.privileged and spec.efa_for(role_spec(spec, role_name)) > 0:
        return {"privileged": True}
    if spec.profile.capabilities:
        return {"capabilities": {"add": list(spec.profile.capabilities)}}
    return {"allowPrivilegeEscalation": False}


def _term(cr: str, components: list[str], topology: str) -> dict[str, Any]:
    return {"labelSelector": {"matchLabels": {names.LABEL_INSTANCE: cr}, "matchExpressions": [
        {"key": names.LABEL_COMPONENT, "operator": "In", "values": sorted(components)}]}, "topologyKey": topology}


def engine_affinity(cr: DisaggregatedInference, role_name: str) -> dict[str, Any]:
    spec, name = cr.spec, cr_name(cr)
    placement = spec.placement
    other = "decode" if role_name == "prefill" else "prefill"
    affinity: dict[str, Any] = {}
    if placement.same_zone and spec.profile.same_zone:
        # The term matches this pod's own labels, so the scheduler lets the very first engine land in any zone;
        # every later one (either role) must join it. EFA does not cross zones.
        affinity.setdefault("podAffinity", {})["requiredDuringSchedulingIgnoredDuringExecution"] = [
            _term(name, list(names.ENGINE_ROLES), ZONE_KEY)]
    if placement.prefer_network_layer:
        affinity.setdefault("podAffinity", {})["preferredDuringSchedulingIgnoredDuringExecution"] = [
            {"weight": 50, "podAffinityTerm": _term(name, [other], NETWORK_LAYER_KEY)}]
    if placement.spread_across_nodes:
        affinity["podAntiAffinity"] = {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 100, "podAffinityTerm": _term(name, [role_name], HOST_KEY)}]}
    role = role_spec(spec, role_name)
    return deep_merge(affinity, role.affinity) if role.affinity else affinity


def _volumes(cr: DisaggregatedInference, revision: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    spec = cr.spec
    volumes: list[dict[str, Any]] = [
        {"name": "launch", "configMap": {"name": names.launch_configmap_name(cr_name(cr), revision),
                                         "defaultMode": 0o755}},
    ]
    mounts: list[dict[str, Any]] = [{"name": "launch", "mountPath": LAUNCH_DIR, "readOnly": True}]
    if not spec.emulated:
        volumes.insert(0, {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.profile.shm_size}})
        mounts.insert(0, {"name": "dshm", "mountPath": SHM_DIR})
    if spec.uses_plugin:
        volumes.append({"name": PLUGIN_VOLUME, "emptyDir": {}})
        mounts.append({"name": PLUGIN_VOLUME, "mountPath": PLUGIN_DIR, "readOnly": True})
    if spec.rendezvous.auth == "kubernetes":
        # Bound to this pod (name and UID, which the rendezvous checks) and to the rendezvous' audience, so the
        # token is no credential for the API server.
        volumes.append({"name": RENDEZVOUS_TOKEN_VOLUME, "projected": {"sources": [{"serviceAccountToken": {
            "audience": names.RENDEZVOUS_AUDIENCE, "expirationSeconds": names.RENDEZVOUS_TOKEN_SECONDS,
            "path": names.RENDEZVOUS_TOKEN_PATH}}]}})
        mounts.append({"name": RENDEZVOUS_TOKEN_VOLUME, "mountPath": names.RENDEZVOUS_TOKEN_DIR, "readOnly": True})
    pvc = spec.model.source.pvc
    if spec.emulated:
        return volumes, mounts  # no weights
    if pvc is not None:
        volumes.append({"name": "models", "persistentVolumeClaim": {"claimName": pvc.claim_name, "readOnly": True}})
        mounts.append({"name": "models", "mountPath": MODELS_DIR, "readOnly": True})
    else:
        volumes.append({"name": "hf-cache", "emptyDir": {}})
        mounts.append({"name": "hf-cache", "mountPath": HF_CACHE_DIR})
    return volumes, mounts


def _container_ports(spec: DisaggregatedInferenceSpec, role: RoleSpec) -> list[dict[str, Any]]:
    ports = [{"name": "http", "containerPort": spec.engine.port, "protocol": "TCP"}]
    ports += [{"name": f"nixl-{i}", "containerPort": p, "protocol": "TCP"}
              for i, p in enumerate(side_channel_ports(spec, role))]
    if spec.emulated:
        ports += [{"name": name, "containerPort": port, "protocol": "TCP"} for name, port in EMULATOR_KV_EVENT_PORTS]
    elif spec.kv_events:
        events, replay = wire_env.kv_events_ports(role.data_parallel_size)
        ports += [{"name": f"kv-events-{i}", "containerPort": p, "protocol": "TCP"} for i, p in enumerate(events)]
        ports += [{"name": f"kv-replay-{i}", "containerPort": p, "protocol": "TCP"} for i, p in enumerate(replay)]
    return ports


def plugin_install_resources(spec: DisaggregatedInferenceSpec) -> dict[str, dict[str, str]]:
    # cpu profile: limits equal to requests, so the init container does not keep the pod out of the Guaranteed
    # QoS class the static CPU manager needs for exclusive cores (see engine_resources).
    if spec.profile.cpu_only:
        return {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"cpu": "100m", "memory": "256Mi"}}
    return {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "256Mi"}}


_UNNAMED_REVISION = "0" * names.REVISION_CHARS


def engine_revision(cr: DisaggregatedInference, images: OperatorImages) -> str:
    """The revision of what the engines run now: a hash of both roles' pod templates (as rendered before the
    revision is known). Equal specs under one operator release give equal revisions; any change to what either
    role's pods run gives a new one. Replicas are not in it: scaling stays within a revision."""
    return names.revision_hash([_pod_template(cr, role, images, None) for role in names.ENGINE_ROLES])


@dataclass(frozen=True)
class Pinned:
    """The revision the spec asks for, and the images its engines run (`images.plugin_image` is its plugin)."""

    revision: str
    images: OperatorImages


def pinned_revision(cr: DisaggregatedInference, images: OperatorImages,
                    running: Iterable[tuple[str, str]]) -> Pinned:
    """The revision the spec asks for under an operator running `images`, given the revisions whose StatefulSets
    exist and the plugin image each runs (`running`, newest first).

    Invariants:
    - the operator's own image alone never makes a new revision: when the spec, rendered with the plugin image a
      running revision has, gives exactly that revision, that revision is the target and keeps its image. So
      an upgraded operator (a new image, a new flag) rolls no engine, and a spec applied again, a rollback among
      them, finds the revision it had;
    - anything else (a change of what the engines run, `spec.engine.restartedAt`) makes the revision this
      operator renders: the new revision takes the operator's current plugin image;
    - the revision is still the hash of both roles' pod templates (`engine_revision`), the pinned image in
      them; with several matches the one this operator renders wins, then the newest.
    Pure; costs one rendering of both templates, plus one per running revision whose plugin image differs."""
    own = engine_revision(cr, images)
    if not (cr.spec.uses_plugin or cr.spec.emulated):  # the engines run nothing of the operator's image
        return Pinned(own, images)
    running = list(running)
    if any(name == own for name, _ in running):
        return Pinned(own, images)
    for name, plugin in running:
        if plugin == images.plugin_image:
            continue
        pinned = replace(images, plugin=plugin)
        if engine_revision(cr, pinned) == name:
            return Pinned(name, pinned)
    return Pinned(own, images)


def plugin_image_of(statefulset: Mapping[str, Any]) -> str | None:
    """The operator image a StatefulSet's engines run: its plugin init container's, or an emulator's own; None
    when it has neither."""
    template = (statefulset.get("spec") or {}).get("template") or {}
    pod_spec = template.get("spec") or {}
    if ((template.get("metadata") or {}).get("labels") or {}).get(EMULATOR_LABEL) == "emulator":
        return next((str(c["image"]) for c in pod_spec.get("containers") or []
                     if c.get("name") == ENGINE_CONTAINER and c.get("image")), None)
    return next((str(c["image"]) for c in pod_spec.get("initContainers") or []
                 if c.get("name") == PLUGIN_CONTAINER and c.get("image")), None)


def engine_pod_template(cr: DisaggregatedInference, role_name: str, images: OperatorImages,
                        revision: str) -> dict[str, Any]:
    return _pod_template(cr, role_name, images, revision)


def _pod_template(cr: DisaggregatedInference, role_name: str, images: OperatorImages,
                  revision: str | None) -> dict[str, Any]:
    spec, name = cr.spec, cr_name(cr)
    role, profile = role_spec(spec, role_name), spec.profile
    volumes, mounts = _volumes(cr, revision or _UNNAMED_REVISION)
    # An emulator serves within a second or two, so probe it every second; an engine loads (or compiles) a model.
    startup_period = 1 if spec.emulated else PROBE_PERIOD
    startup_failures = -(-(EMULATOR_STARTUP_SECONDS if spec.emulated else profile.startup_seconds) // startup_period)
    engine = {
        "name": ENGINE_CONTAINER,
        # An emulator runs the operator's image, pinned per revision like the plugin's (pinned_revision).
        "image": images.plugin_image if spec.emulated else spec.engine.image,
        "command": ["/bin/sh", f"{LAUNCH_DIR}/{names.launch_script_key(role_name)}"],
        "ports": _container_ports(spec, role),
        "env": engine_env(cr, role_name),
        "resources": engine_resources(spec, role_name),
        "securityContext": engine_security_context(spec, role_name),
        "volumeMounts": mounts,
        "startupProbe": http_probe("/health", "http", period=startup_period, failures=startup_failures),
        "readinessProbe": http_probe("/health", "http", period=5, failures=3),
        # Generous: a liveness restart throws away a loaded (or compiled) model.
        "livenessProbe": http_probe("/health", "http", period=PROBE_PERIOD, failures=6, timeout=10),
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    # The operator image copies disagg.connector into the shared emptyDir (connector/install_plugin.py); the
    # engine imports it from there through PYTHONPATH, read-only.
    install = {
        "name": PLUGIN_CONTAINER,
        "image": images.plugin_image,
        "command": ["disagg", "install-plugin", PLUGIN_DIR],
        "volumeMounts": [{"name": PLUGIN_VOLUME, "mountPath": PLUGIN_DIR}],
        "resources": plugin_install_resources(spec),
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    tolerations = profile.pod_tolerations() + [t.dump() for t in role.tolerations]
    pod_spec: dict[str, Any] = {
        # Service links would inject e.g. VLLM_PORT for a Service named "vllm", which vLLM misreads.
        "enableServiceLinks": False,
        # Engines talk to the rendezvous over HTTP, never to the API server (their rendezvous token, with auth
        # kubernetes, is a separate projected volume for the rendezvous' audience only).
        "automountServiceAccountToken": False,
        **({"initContainers": [install]} if spec.uses_plugin else {}),
        "containers": [engine],
        "volumes": volumes,
        # vLLM's drain (--shutdown-timeout) plus time for its processes to exit: the kubelet's SIGKILL must not
        # cut the drain short.
        "terminationGracePeriodSeconds": spec.engine.drain_seconds + DRAIN_EXIT_SECONDS,
        "nodeSelector": dict(sorted({**profile.node_selector(), **role.node_selector}.items())),
        "tolerations": tolerations,
    }
    affinity = engine_affinity(cr, role_name)
    if affinity:
        pod_spec["affinity"] = affinity
    script = launch_script(spec, role_name)
    # The script (vLLM args) lives in a ConfigMap; this hash rolls the pods when it changes.
    annotations = {LAUNCH_HASH_ANNOTATION: hashlib.sha256(script.encode()).hexdigest()[:16]}
    if spec.engine.restarted_at is not None:  # absent when unset: a CR that never asked keeps its revision
        annotations[RESTARTED_AT_ANNOTATION] = spec.engine.restarted_at
    labels = names.labels(name, role_name)
    if spec.emulated:
        labels[EMULATOR_LABEL] = "emulator"
    template: dict[str, Any] = {
        "metadata": {"labels": labels, "annotations": annotations},
        "spec": pod_spec,
    }
    if role.pod_template:
        template = deep_merge(template, role.pod_template)
    # An overlay must not detach pods from their StatefulSet and Services.
    template.setdefault("metadata", {}).setdefault("labels", {}).update(
        revision_selector(name, role_name, revision) if revision else names.selector_labels(name, role_name))
    return template


def revision_selector(cr: str, role_name: str, revision: str) -> dict[str, str]:
    """The pods of one role of one revision: its StatefulSet's selector."""
    return {**names.selector_labels(cr, role_name), names.LABEL_REVISION: revision}


def engine_statefulset(cr: DisaggregatedInference, role_name: str, images: OperatorImages, revision: str,
                       replicas: int | None = None) -> dict[str, Any]:
    """One role of one revision, at `replicas` (default: the spec's; the rollout decides during a change).
    The role's headless Service (`names.engine_name`) fronts every revision's pods."""
    name = cr_name(cr)
    meta = object_meta(cr, names.engine_statefulset_name(name, role_name, revision), role_name)
    meta["labels"][names.LABEL_REVISION] = revision
    meta["annotations"] = {names.LAYOUT_KEY_ANNOTATION: names.layout_key(cr.spec)}
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": meta,
        "spec": {
            "replicas": role_spec(cr.spec, role_name).initial_replicas if replicas is None else replicas,
            "serviceName": names.engine_name(name, role_name),
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "RollingUpdate"},
            "selector": {"matchLabels": revision_selector(name, role_name, revision)},
            "template": engine_pod_template(cr, role_name, images, revision),
        },
    }


def engine_service(cr: DisaggregatedInference, role_name: str) -> dict[str, Any]:
    """Headless: stable per-pod DNS, and not-ready pods still resolve (side channels open before /health)."""
    spec = cr.spec
    ports = [{"name": p["name"], "port": p["containerPort"], "targetPort": p["name"], "protocol": "TCP"}
             for p in _container_ports(spec, role_spec(spec, role_name))]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(cr, names.engine_name(cr_name(cr), role_name), role_name),
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                 "selector": names.selector_labels(cr_name(cr), role_name), "ports": ports},
    }


def engine_pdb(cr: DisaggregatedInference, role_name: str) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": object_meta(cr, names.engine_name(cr_name(cr), role_name), role_name),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": names.selector_labels(cr_name(cr), role_name)}},
    }
