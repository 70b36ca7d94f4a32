"""Engine children per role (operator/engine_builders.py): devices, EFA, env, kv-transfer-config, placement,
StatefulSet."""
from __future__ import annotations

from typing import Any

import pytest

from disagg.operator import names
from disagg.operator.api import DisaggregatedInference
from disagg.operator.builders import OperatorImages, build_children, engine_args
from disagg.operator.merge import deep_merge
from disagg.operator.profiles import CPU_ENGINES_LABEL, CPU_ENGINES_TAINT, CPU_ENGINES_VALUE
from support.crs import child, engine, env_of, kv_config, launch_configmap, make_cr, pod, statefulset


def test_p5en_tp4_gets_four_gpus_eight_efa_hugepages_and_privileged():
    children = build_children(make_cr(), images=OperatorImages())
    for role in ("prefill", "decode"):
        c = engine(children, role)
        res = c["resources"]
        for side in ("requests", "limits"):
            assert res[side]["nvidia.com/gpu"] == "4"
            assert res[side]["vpc.amazonaws.com/efa"] == "8"
            assert res[side]["hugepages-2Mi"] == "5120Mi"
        assert c["securityContext"] == {"privileged": True}
        env = env_of(c)
        assert env["FI_PROVIDER"] == "efa" and env["FI_EFA_USE_DEVICE_RDMA"] == "1"
        assert env["LD_LIBRARY_PATH"].startswith("/opt/amazon/efa/lib")
        spec = pod(children, role)["spec"]
        assert spec["nodeSelector"]["node.kubernetes.io/instance-type"] == "p5en.48xlarge"
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert kv_config(make_cr(), "prefill")["kv_connector_extra_config"] == {"backends": ["LIBFABRIC"],
                                                                           "push_registration_timeout": 60}

def test_data_parallel_ranks_multiply_into_devices_and_efa():
    cr = make_cr()
    cr.spec.prefill.tensor_parallel_size, cr.spec.prefill.data_parallel_size = 2, 3
    res = engine(build_children(cr, images=OperatorImages()), "prefill")["resources"]["limits"]
    assert res["nvidia.com/gpu"] == "6" and res["vpc.amazonaws.com/efa"] == "12"

def test_trn2_tp32_gets_eight_neuron_devices_and_ipc_lock_not_privileged():
    cr = make_cr({"prefill": {"tensorParallelSize": 32}, "decode": {"tensorParallelSize": 32}}, profile="trainium2")
    c = engine(build_children(cr), "decode")
    assert c["resources"]["requests"]["aws.amazon.com/neuron"] == "8"
    assert c["resources"]["limits"]["aws.amazon.com/neuron"] == "8"
    assert "nvidia.com/gpu" not in c["resources"]["requests"]
    assert c["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
    assert pod(build_children(cr), "decode")["spec"]["nodeSelector"] == {
        "node.kubernetes.io/instance-type": "trn2.48xlarge"}

def test_efa_off_drops_efa_resources_env_and_uses_ucx():
    cr = make_cr({"accelerator": {"efa": "off"}})
    children = build_children(cr)
    for role in ("prefill", "decode"):
        c = engine(children, role)
        for side in ("requests", "limits"):
            assert "vpc.amazonaws.com/efa" not in c["resources"][side]
            assert "hugepages-2Mi" not in c["resources"][side]
        assert not [n for n in env_of(c) if n.startswith("FI_")]
        assert "LD_LIBRARY_PATH" not in env_of(c)
        # No EFA to register GPU memory with: the privileged escape hatch is not needed.
        assert c["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
        assert kv_config(cr, role)["kv_connector_extra_config"]["backends"] == ["UCX"]
    script = launch_configmap(children)["data"]["prefill.sh"]
    assert "fi_info" not in script and "HugePages_Total" not in script

def test_explicit_efa_count_is_used():
    c = engine(build_children(make_cr({"accelerator": {"efa": 2}})), "prefill")
    assert c["resources"]["limits"]["vpc.amazonaws.com/efa"] == "2"

@pytest.mark.parametrize("mode, connector", [("pull", "NixlConnector"), ("push", "NixlPushConnector")])
def test_mode_selects_connector(mode, connector):
    cr = make_cr({"kvTransfer": {"mode": mode}})
    assert kv_config(cr, "prefill")["kv_connector"] == connector
    assert kv_config(cr, "prefill")["kv_role"] == "kv_producer"
    assert kv_config(cr, "decode")["kv_role"] == "kv_consumer"
    assert kv_config(cr, "decode")["engine_id"] == "$DISAGG_ENGINE_ID"
    assert kv_config(cr, "decode")["kv_connector_module_path"] == "disagg.connector.plugin"
    router = child(build_children(cr), "Deployment", "qwen-router")
    command = router["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--mode") + 1] == mode

def test_connector_override_and_bidirectional_pull():
    cr = make_cr({"kvTransfer": {"mode": "pull", "connector": "NeuronNixlConnector", "bidirectional": True}})
    cfg = kv_config(cr, "prefill")
    assert cfg["kv_connector"] == "NeuronNixlConnector" and cfg["kv_role"] == "kv_both"

def _plugin_parts(cr: DisaggregatedInference, role: str) -> dict[str, Any]:
    children = build_children(cr, images=OperatorImages(operator="registry.example/disagg:dev"))
    spec = pod(children, role)["spec"]
    eng = engine(children, role)
    return {"module": kv_config(cr, role).get("kv_connector_module_path"),
            "init": spec.get("initContainers", []), "pythonpath": env_of(eng).get("PYTHONPATH"),
            "volumes": {v["name"]: v for v in spec["volumes"]},
            "mounts": {m["name"]: m for m in eng["volumeMounts"]}}

@pytest.mark.parametrize("mode, connector", [("push", None), ("pull", None), ("push", "NixlPushConnector"),
                                             ("pull", "NixlConnector"), ("pull", "NixlPullConnector")])
def test_connectors_the_plugin_wraps_load_it_from_the_init_containers_copy(mode, connector):
    cr = make_cr({"kvTransfer": {"mode": mode, **({"connector": connector} if connector else {})}})
    for role in ("prefill", "decode"):
        parts = _plugin_parts(cr, role)
        assert parts["module"] == "disagg.connector.plugin"
        [init] = parts["init"]
        assert init["image"] == "registry.example/disagg:dev", "the operator image carries the package"
        assert init["command"] == ["disagg", "install-plugin", "/opt/disagg"]
        [init_mount] = init["volumeMounts"]
        assert not init_mount.get("readOnly")
        engine_mount = parts["mounts"][init_mount["name"]]
        assert engine_mount["mountPath"] == init_mount["mountPath"] == "/opt/disagg", "one volume, one path"
        assert engine_mount["readOnly"] is True
        assert parts["volumes"][init_mount["name"]] == {"name": init_mount["name"], "emptyDir": {}}
        assert parts["pythonpath"] == "/opt/disagg"

def test_a_vendor_connector_gets_no_plugin():
    """NeuronNixlConnector is not one the plugin wraps: no module path, no init container, nothing to import."""
    cr = make_cr({"kvTransfer": {"mode": "pull", "connector": "NeuronNixlConnector"}}, profile="trainium2")
    for role in ("prefill", "decode"):
        parts = _plugin_parts(cr, role)
        assert parts["module"] is None and parts["init"] == [] and parts["pythonpath"] is None
        assert "disagg-plugin" not in parts["volumes"] and "disagg-plugin" not in parts["mounts"]
        assert kv_config(cr, role)["kv_connector"] == "NeuronNixlConnector"

def test_engines_know_their_http_port():
    """The plugin runs in vLLM's engine core, which does not know the API server's port; it advertises this one."""
    for spec, port in (({}, "8000"), ({"engine": {"port": 9000}}, "9000")):
        cr = make_cr(spec)
        for role in ("prefill", "decode"):
            eng = engine(build_children(cr), role)
            assert env_of(eng)["DISAGG_HTTP_PORT"] == port
            assert engine_args(cr.spec, role)[engine_args(cr.spec, role).index("--port") + 1] == port

def test_engine_id_env_is_declared_after_the_vars_it_expands():
    """Kubernetes expands $(VAR) only from variables defined earlier in the list."""
    cr = make_cr({"decode": {"env": [{"name": "POD_NAME", "value": "x"}, {"name": "EXTRA", "value": "1"}]}})
    for role in ("prefill", "decode"):
        env = engine(build_children(cr), role)["env"]
        order = [e["name"] for e in env]
        assert len(order) == len(set(order))
        by_name = {e["name"]: e for e in env}
        assert by_name["DISAGG_ENGINE_ID"]["value"] == "$(POD_NAME)-$(POD_UID)"
        assert order.index("POD_NAME") < order.index("DISAGG_ENGINE_ID")
        assert order.index("POD_UID") < order.index("DISAGG_ENGINE_ID")
        assert order.index("POD_IP") < order.index("VLLM_NIXL_SIDE_CHANNEL_HOST")
        assert by_name["POD_UID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.uid"}}
        assert by_name["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert by_name["VLLM_NIXL_SIDE_CHANNEL_HOST"]["value"] == "$(POD_IP)"
        assert by_name["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"] == "5600"
        assert by_name["DISAGG_ROLE"]["value"] == role
        assert by_name["DISAGG_DEPLOYMENT"]["value"] == "qwen"
        assert by_name["DISAGG_RENDEZVOUS_URL"]["value"] == "http://qwen-rendezvous.ml.svc:8080"
        assert by_name["DISAGG_HEARTBEAT_SECONDS"]["value"] == "5"
        assert by_name["PYTHONPATH"]["value"] == "/opt/disagg"
    decode = engine(build_children(cr), "decode")["env"]
    names_in_order = [e["name"] for e in decode]
    # The override keeps the operator's position (still before DISAGG_ENGINE_ID) with the user's value.
    assert {e["name"]: e for e in decode}["POD_NAME"] == {"name": "POD_NAME", "value": "x"}
    assert names_in_order.index("POD_NAME") < names_in_order.index("DISAGG_ENGINE_ID")
    assert names_in_order[-1] == "EXTRA"

def test_role_env_wins_over_engine_env():
    cr = make_cr({"engine": {"env": [{"name": "A", "value": "engine"}, {"name": "B", "value": "engine"}]},
                  "prefill": {"env": [{"name": "A", "value": "prefill"}]}})
    assert env_of(engine(build_children(cr), "prefill"))["A"] == "prefill"
    assert env_of(engine(build_children(cr), "decode"))["A"] == "engine"
    assert env_of(engine(build_children(cr), "prefill"))["B"] == "engine"

def test_layout_key_matches_between_roles_and_tracks_block_size():
    children = build_children(make_cr())
    prefill = env_of(engine(children, "prefill"))["DISAGG_LAYOUT_KEY"]
    decode = env_of(engine(children, "decode"))["DISAGG_LAYOUT_KEY"]
    assert prefill == decode
    assert len(prefill) == 16 and int(prefill, 16) >= 0
    other = names.layout_key(make_cr({"engine": {"blockSize": 64}}).spec)
    assert other != prefill
    # Role-local knobs (replicas, TP) do not change what must match.
    assert names.layout_key(make_cr({"decode": {"replicas": 3, "tensorParallelSize": 8}}).spec) == prefill
    assert names.layout_key(make_cr({"kvTransfer": {"mode": "pull"}}).spec) != prefill

def test_resources_defaults_and_overrides():
    cr = make_cr({"decode": {"resources": {"requests": {"memory": "300Gi", "cpu": 40},
                                           "limits": {"ephemeral-storage": "100Gi"}}}})
    children = build_children(cr)
    p = engine(children, "prefill")["resources"]
    assert p["requests"]["cpu"] == "48" and p["requests"]["memory"] == "512Gi"
    assert p["limits"]["memory"] == "512Gi" and "cpu" not in p["limits"]
    d = engine(children, "decode")["resources"]
    # A one-sided memory override keeps request == limit; cpu has no limit to follow.
    assert d["requests"]["memory"] == d["limits"]["memory"] == "300Gi"
    assert d["requests"]["cpu"] == "40" and "cpu" not in d["limits"]
    assert d["limits"]["ephemeral-storage"] == "100Gi" and "ephemeral-storage" not in d["requests"]

def test_startup_probe_budgets():
    nvidia = engine(build_children(make_cr()), "prefill")["startupProbe"]
    assert nvidia["httpGet"] == {"path": "/health", "port": "http"} and nvidia["periodSeconds"] == 10
    assert nvidia["periodSeconds"] * nvidia["failureThreshold"] >= 30 * 60
    for profile in ("trainium2", "trainium1"):
        trn = engine(build_children(make_cr(profile=profile)), "prefill")
        probe = trn["startupProbe"]
        assert probe["periodSeconds"] * probe["failureThreshold"] >= 60 * 60
        assert trn["readinessProbe"]["httpGet"]["path"] == trn["livenessProbe"]["httpGet"]["path"] == "/health"

def test_container_basics_volumes_and_plugin_init_container():
    images = OperatorImages(operator="registry.example/disagg:dev")
    template = pod(build_children(make_cr(), images=images), "decode")
    spec = template["spec"]
    eng = engine(build_children(make_cr(), images=images), "decode")
    assert eng["command"] == ["/bin/sh", "/etc/disagg/decode.sh"] and not eng.get("args")
    assert eng["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert eng["terminationMessagePath"] == "/dev/termination-log"
    [init] = spec["initContainers"]
    assert init["name"] == "install-plugin" and init["image"] == "registry.example/disagg:dev"
    assert init["command"] == ["disagg", "install-plugin", "/opt/disagg"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    launch = launch_configmap(build_children(make_cr(), images=images))["metadata"]["name"]
    assert volumes["launch"]["configMap"] == {"name": launch, "defaultMode": 0o755}
    assert volumes["disagg-plugin"]["emptyDir"] == {}
    assert volumes["hf-cache"]["emptyDir"] == {}
    mounts = {m["mountPath"]: m["name"] for m in eng["volumeMounts"]}
    assert mounts == {"/dev/shm": "dshm", "/etc/disagg": "launch", "/opt/disagg": "disagg-plugin",
                      "/root/.cache/huggingface": "hf-cache", "/var/run/secrets/disagg/rendezvous": "rendezvous-token"}

def test_pvc_model_source_and_hub_token():
    cr = make_cr({"model": {"source": {"pvc": {"claimName": "weights", "path": "/qwen/32b/"}}}})
    children = build_children(cr)
    spec = pod(children, "prefill")["spec"]
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in spec["volumes"]
    eng = engine(children, "prefill")
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in eng["volumeMounts"]
    args = engine_args(cr.spec, "prefill")
    assert args[args.index("--model") + 1] == "/models/qwen/32b"
    assert args[args.index("--served-model-name") + 1] == "Qwen/Qwen3-32B"
    assert "HF_TOKEN" not in env_of(eng)

    hub = make_cr({"model": {"source": {"hub": {"tokenSecret": {"name": "hf"}}}}})
    env = env_of(engine(build_children(hub), "decode"))
    assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    args = engine_args(hub.spec, "decode")
    assert args[args.index("--model") + 1] == "Qwen/Qwen3-32B"

def test_engine_args_order_and_optional_flags():
    cr = make_cr({"model": {"maxModelLen": 16384, "dtype": "bfloat16", "servedName": "qwen"},
                  "engine": {"args": ["--enable-prefix-caching"], "blockSize": 64, "port": 9000},
                  "decode": {"dataParallelSize": 2, "args": ["--max-num-seqs", "64"]}})
    prefill, decode = engine_args(cr.spec, "prefill"), engine_args(cr.spec, "decode")
    assert "--data-parallel-size" not in prefill
    assert decode[decode.index("--data-parallel-size") + 1] == "2"
    for args in (prefill, decode):
        assert args[args.index("--max-model-len") + 1] == "16384"
        assert args[args.index("--dtype") + 1] == "bfloat16"
        assert args[args.index("--block-size") + 1] == "64"
        assert args[args.index("--port") + 1] == "9000"
        assert args[args.index("--served-model-name") + 1] == "qwen"
        assert args[args.index("--tensor-parallel-size") + 1] == "4"
        assert args[args.index("--pipeline-parallel-size") + 1] == "1"
        assert args.index("--kv-transfer-config") < args.index("--enable-prefix-caching")
    assert decode[-3:] == ["--enable-prefix-caching", "--max-num-seqs", "64"]
    assert prefill[-1] == "--enable-prefix-caching"

def test_stopping_engines_drain_within_the_pods_grace_period():
    """Rolling updates keep serving: vLLM finishes in-flight requests for drainSeconds (`--shutdown-timeout`), and
    the kubelet waits longer than that before it kills the pod."""
    for overrides, drain in (({}, 30), ({"engine": {"drainSeconds": 120}}, 120), ({"engine": {"drainSeconds": 0}}, 0)):
        cr = make_cr(overrides)
        children = build_children(cr)
        for role in ("prefill", "decode"):
            args = engine_args(cr.spec, role)
            assert args[args.index("--shutdown-timeout") + 1] == str(drain)
            assert args.index("--shutdown-timeout") < args.index("--kv-transfer-config")  # user args still win
            assert pod(children, role)["spec"]["terminationGracePeriodSeconds"] == drain + 15

def test_side_channel_ports_per_dp_rank_on_container_and_headless_service():
    cr = make_cr({"decode": {"dataParallelSize": 3}, "kvTransfer": {"sideChannelPort": 6000}})
    children = build_children(cr)
    ports = {p["name"]: p["containerPort"] for p in engine(children, "decode")["ports"]}
    assert ports == {"http": 8000, "nixl-0": 6000, "nixl-1": 6001, "nixl-2": 6002}
    svc = child(children, "Service", "qwen-decode")
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == ports
    assert {p["name"] for p in engine(children, "prefill")["ports"]} == {"http", "nixl-0"}

def test_port_collision_is_rejected_naming_the_field():
    with pytest.raises(ValueError, match="spec.engine.port"):
        build_children(make_cr({"engine": {"port": 5601}, "decode": {"dataParallelSize": 2}}))

def test_statefulset_and_pdb_shape():
    children = build_children(make_cr({"decode": {"replicas": 3}}))
    sts = statefulset(children, "decode")["spec"]
    assert sts["replicas"] == 3 and sts["serviceName"] == "qwen-decode", "one headless Service for every revision"
    assert sts["podManagementPolicy"] == "Parallel" and sts["updateStrategy"] == {"type": "RollingUpdate"}
    pdb = child(children, "PodDisruptionBudget", "qwen-prefill")
    assert pdb["apiVersion"] == "policy/v1" and pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == names.selector_labels("qwen", "prefill")

def _matches(selector: dict, labels: dict) -> bool:
    if not selector["matchLabels"].items() <= labels.items():
        return False
    return all(labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", []))

def test_placement_affinity():
    children = build_children(make_cr())
    for role, other in (("prefill", "decode"), ("decode", "prefill")):
        template = pod(children, role)
        labels, affinity = template["metadata"]["labels"], template["spec"]["affinity"]
        [zone] = affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert zone["topologyKey"] == "topology.kubernetes.io/zone"
        # Self-matching is what lets the scheduler place the very first engine pod.
        assert _matches(zone["labelSelector"], labels)
        assert _matches(zone["labelSelector"], pod(children, other)["metadata"]["labels"])
        assert not _matches(zone["labelSelector"], {**labels, names.LABEL_INSTANCE: "another-cr"})
        [layer] = affinity["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
        assert layer["podAffinityTerm"]["topologyKey"] == "topology.k8s.aws/network-node-layer-3"
        assert _matches(layer["podAffinityTerm"]["labelSelector"], pod(children, other)["metadata"]["labels"])
        assert not _matches(layer["podAffinityTerm"]["labelSelector"], labels)
        [spread] = affinity["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
        assert spread["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
        assert _matches(spread["podAffinityTerm"]["labelSelector"], labels)
        assert not _matches(spread["podAffinityTerm"]["labelSelector"], pod(children, other)["metadata"]["labels"])

def test_placement_off_and_role_affinity_merge():
    off = make_cr({"placement": {"sameZone": False, "spreadAcrossNodes": False, "preferNetworkLayer": False}})
    assert "affinity" not in pod(build_children(off), "prefill")["spec"]
    node_affinity = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["on-demand"]}]}]}}
    cr = make_cr({"decode": {"affinity": {"nodeAffinity": node_affinity}}})
    affinity = pod(build_children(cr), "decode")["spec"]["affinity"]
    assert affinity["nodeAffinity"] == node_affinity
    assert "requiredDuringSchedulingIgnoredDuringExecution" in affinity["podAffinity"]
    assert "nodeAffinity" not in pod(build_children(cr), "prefill")["spec"]["affinity"]

def test_node_selector_and_tolerations_merge():
    cr = make_cr({"prefill": {"nodeSelector": {"karpenter.sh/capacity-type": "on-demand"},
                              "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml",
                                               "effect": "NoSchedule"}]}})
    spec = pod(build_children(cr), "prefill")["spec"]
    assert spec["nodeSelector"] == {"karpenter.sh/capacity-type": "on-demand",
                                    "node.kubernetes.io/instance-type": "p5en.48xlarge"}
    assert spec["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}]

def test_launch_configmap_and_hash_annotation_roll_pods_on_arg_change():
    children = build_children(make_cr())
    data = launch_configmap(children)["data"]
    assert sorted(data) == ["decode.sh", "prefill.sh"]
    assert '"kv_role":"kv_consumer"' in data["decode.sh"] and '"kv_role":"kv_producer"' in data["prefill.sh"]
    before = pod(children, "decode")["metadata"]["annotations"]
    after = pod(build_children(make_cr({"decode": {"args": ["--max-num-seqs", "8"]}})), "decode")
    assert after["metadata"]["annotations"] != before
    assert pod(build_children(make_cr({"decode": {"args": ["--max-num-seqs", "8"]}})), "prefill")[
        "metadata"]["annotations"] == pod(children, "prefill")["metadata"]["annotations"]


def test_a_revision_is_what_either_role_runs_and_not_how_many():
    base = build_children(make_cr())
    rev = statefulset(base, "prefill")["metadata"]["labels"][names.LABEL_REVISION]
    assert statefulset(base, "decode")["metadata"]["labels"][names.LABEL_REVISION] == rev, "one revision, both roles"
    assert launch_configmap(base)["metadata"]["name"] == f"qwen-launch-{rev}"
    for role in ("prefill", "decode"):
        sts = statefulset(base, role)
        assert sts["spec"]["template"]["metadata"]["labels"][names.LABEL_REVISION] == rev
        assert sts["metadata"]["annotations"][names.LAYOUT_KEY_ANNOTATION] == names.layout_key(make_cr().spec)
    def revision(spec):
        return statefulset(build_children(make_cr(spec)), "decode")["metadata"]["labels"][names.LABEL_REVISION]
    assert revision({"decode": {"replicas": 5}, "prefill": {"replicas": 3}}) == rev
    changed = {revision({"decode": {"args": ["--max-num-seqs", "8"]}}), revision({"engine": {"image": "v:2"}}),
               revision({"prefill": {"env": [{"name": "A", "value": "1"}]}}), revision({"engine": {"blockSize": 64}})}
    assert rev not in changed and len(changed) == 4


CPU_SPEC = {"prefill": {"tensorParallelSize": 1}, "decode": {"tensorParallelSize": 1}}


def cpu_cr(spec: dict[str, Any] | None = None) -> DisaggregatedInference:
    return make_cr(deep_merge(CPU_SPEC, spec or {}), profile="cpu")


def test_cpu_engine_requests_cpu_and_memory_and_no_device_efa_or_hugepages():
    children = build_children(cpu_cr())
    for role in ("prefill", "decode"):
        c = engine(children, role)
        # 4 GiB for vLLM plus the default 4 GiB KV cache; no cpu limit (CFS throttling).
        assert c["resources"] == {"requests": {"cpu": "4", "memory": "8Gi"}, "limits": {"memory": "8Gi"}}
        assert c["securityContext"] == {"allowPrivilegeEscalation": False}, "not privileged, no capability"
        env = env_of(c)
        assert env["VLLM_CPU_KVCACHE_SPACE"] == "4" and env["UCX_TLS"] == "tcp,self,sm"
        assert env["DISAGG_NIXL_PROGRESS_DELAY_US"] == "1000"  # the progress thread must not spin the model's core
        assert not [n for n in env if n.startswith(("FI_", "NEURON_"))] and "LD_LIBRARY_PATH" not in env
        assert "VLLM_CPU_OMP_THREADS_BIND" not in env, "the launch script binds the container's own cores"
        dshm = next(v for v in pod(children, role)["spec"]["volumes"] if v["name"] == "dshm")
        assert dshm["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}
        assert qos_class(pod(children, role)["spec"]) == "Burstable"
    config = kv_config(cpu_cr(), "decode")
    assert config["kv_buffer_device"] == "cpu"
    assert config["kv_connector_extra_config"]["backends"] == ["UCX"]
    assert "kv_buffer_device" not in kv_config(make_cr(), "decode"), "accelerators keep vLLM's default"
    script = launch_configmap(children)["data"]["prefill.sh"]
    assert "fi_info" not in script and "HugePages_Total" not in script and "Cpus_allowed_list" in script
    assert "Cpus_allowed_list" not in launch_configmap(build_children(make_cr()))["data"][
        "prefill.sh"]


def test_cpu_kv_cache_field_sets_the_env_and_grows_the_memory_default():
    cr = cpu_cr({"accelerator": {"kvCacheGiB": 10}})
    c = engine(build_children(cr), "prefill")
    assert env_of(c)["VLLM_CPU_KVCACHE_SPACE"] == "10"
    assert c["resources"]["requests"]["memory"] == c["resources"]["limits"]["memory"] == "14Gi"


def qos_class(pod_spec: dict[str, Any]) -> str:
    """The kubelet's QoS class (init containers count): Guaranteed when every container limits cpu and memory to
    exactly its requests, which the static CPU manager needs to give a container exclusive cores."""
    containers = pod_spec["containers"] + pod_spec.get("initContainers", [])
    if all(c["resources"].get("limits", {}).get(k) is not None and
           c["resources"]["limits"][k] == c["resources"].get("requests", {}).get(k, c["resources"]["limits"][k])
           for c in containers for k in ("cpu", "memory")):
        return "Guaranteed"
    return "Burstable" if any(c.get("resources") for c in containers) else "BestEffort"


def test_cpu_role_resources_and_env_override_the_defaults():
    cr = cpu_cr({"prefill": {"resources": {"requests": {"cpu": "500m", "memory": "5Gi"}},
                             "env": [{"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "0"}]},
                 "decode": {"resources": {"requests": {"cpu": "2"}, "limits": {"cpu": "2"}}}})
    children = build_children(cr)
    prefill = engine(children, "prefill")
    # Memory's request and limit are paired: a request override moves the limit too.
    assert prefill["resources"] == {"requests": {"cpu": "500m", "memory": "5Gi"}, "limits": {"memory": "5Gi"}}
    assert env_of(prefill)["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    decode = engine(children, "decode")["resources"]
    assert decode == {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"cpu": "2", "memory": "8Gi"}}
    # A whole-core cpu limit equal to the request makes the pod Guaranteed (the plugin init container's limits
    # equal its requests): with the kubelet's static CPU manager, exclusive cores the launch script binds.
    assert qos_class(pod(children, "decode")["spec"]) == "Guaranteed"
    assert qos_class(pod(children, "prefill")["spec"]) == "Burstable"


def test_cpu_engines_select_the_cpu_engine_nodes_and_tolerate_their_taint():
    assert (CPU_ENGINES_LABEL, CPU_ENGINES_VALUE) == ("serving.disagg.io/cpu-engines", "true")
    assert CPU_ENGINES_TAINT == {"key": CPU_ENGINES_LABEL, "value": "true", "effect": "NoSchedule"}
    cr = cpu_cr({"decode": {"nodeSelector": {"disk": "ssd"}}})
    children = build_children(cr)
    for role, selector in (("prefill", {CPU_ENGINES_LABEL: "true"}), ("decode", {CPU_ENGINES_LABEL: "true",
                                                                                "disk": "ssd"})):
        spec = pod(children, role)["spec"]
        assert spec["nodeSelector"] == selector, "no instance type: any node labelled for CPU engines"
        assert spec["tolerations"] == [{"key": CPU_ENGINES_LABEL, "operator": "Exists", "effect": "NoSchedule"}]
        # No zone requirement: CPU engines talk TCP, and kind/minikube nodes have no zone label to match.
        assert "requiredDuringSchedulingIgnoredDuringExecution" not in spec["affinity"].get("podAffinity", {})
    accel = pod(build_children(make_cr()), "prefill")["spec"]
    assert "requiredDuringSchedulingIgnoredDuringExecution" in accel["affinity"]["podAffinity"]


def test_cpu_engine_with_a_pvc_model():
    cr = cpu_cr({"model": {"name": "tiny", "source": {"pvc": {"claimName": "disagg-models", "path": "/tiny"}}}})
    children = build_children(cr)
    spec = pod(children, "decode")["spec"]
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "disagg-models", "readOnly": True}} in \
        spec["volumes"]
    args = engine_args(cr.spec, "decode")
    assert args[args.index("--model") + 1] == "/models/tiny"
    assert "HF_HOME" not in env_of(engine(children, "decode"))
