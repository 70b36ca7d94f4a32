"""The operator runs the engine emulator from the CR (`spec.engine.emulator`): light pods that run the operator's
image with `disagg emulator`, the CR's values on its command line (parsed by the emulator's own flags), never paired
with real engines, transport EMULATED, and pinned to their image across an operator upgrade like the plugin."""
from __future__ import annotations

import argparse
import shlex

import pytest
from pydantic import ValidationError

from disagg.connector.emulator import flags
from disagg.connector.emulator.main import profile_for
from disagg.connector.emulator.profiles import PROFILES
from disagg.connector.wire import emulator as contract
from disagg.operator import names
from disagg.operator.builders import OperatorImages, build_children, engine_revision
from disagg.operator.engine_builders import (
    EMULATOR_LABEL,
    engine_statefulset,
    launch_script,
    pinned_revision,
    plugin_image_of,
)
from disagg.operator.status import EngineTransport, TransportReport, transport_verdict
from support.crs import engine, env_of, launch_configmap, make_cr, pod

A, B = OperatorImages("registry.example/disagg:a"), OperatorImages("registry.example/disagg:b")


def emulated(emulator: dict | None = None, **spec: object):
    return make_cr({"engine": {"emulator": emulator or {}}, "prefill": {"tensorParallelSize": 1},
                    "decode": {"tensorParallelSize": 1}, **spec}, profile="cpu")


def command_line(cr, role: str) -> argparse.Namespace:
    """The emulator's arguments as the launch script gives them, parsed by `disagg emulator`'s own flags."""
    script = launch_script(cr.spec, role)
    exec_line = script[script.index("exec disagg emulator"):].replace("\\\n", " ")
    words = shlex.split(exec_line)[3:]
    assert words[-1] == "$@"
    p = argparse.ArgumentParser()
    flags.add_arguments(p)
    return p.parse_args(words[:-1])


def test_emulator_pods_run_the_operators_image_light_and_labelled_with_no_device_or_vllm_setting():
    cr = emulated({"profile": "qwen3-32b-tp4-p5en"})
    children = build_children(cr, images=A)
    for role in ("prefill", "decode"):
        c = engine(children, role)
        spec = pod(children, role)["spec"]
        assert c["image"] == A.operator and "initContainers" not in spec
        assert c["command"] == ["/bin/sh", f"/etc/disagg/{names.launch_script_key(role)}"]
        assert c["resources"]["requests"]["cpu"].endswith("m") and int(c["resources"]["requests"]["cpu"][:-1]) <= 50
        assert set(c["resources"]["requests"]) == {"cpu", "memory"} and "cpu" not in c["resources"]["limits"]
        assert c["securityContext"] == {"allowPrivilegeEscalation": False}
        env = env_of(c)
        assert {"DISAGG_ENGINE_ID", "DISAGG_ROLE", "DISAGG_RENDEZVOUS_URL", "VLLM_NIXL_SIDE_CHANNEL_HOST"} <= set(env)
        assert not {"VLLM_CPU_KVCACHE_SPACE", "PYTHONPATH", "UCX_TLS", "HF_HOME"} & set(env)
        assert {v["name"] for v in spec["volumes"]} == {"launch", "rendezvous-token"}
        assert pod(children, role)["metadata"]["labels"][EMULATOR_LABEL] == "emulator"
        assert {p["name"] for p in c["ports"]} == {"http", "nixl-0", "kv-events", "kv-replay"}
    script = launch_configmap(children)["data"][names.launch_script_key("decode")]
    assert "ENGINE EMULATOR" in script and "exec disagg emulator" in script and "vllm" not in script.split("set -eu")[1]


def test_an_emulator_on_accelerator_nodes_takes_their_placement_but_none_of_their_devices():
    cr = make_cr({"engine": {"emulator": {}}})  # p5en, TP4
    children = build_children(cr, images=A)
    c = engine(children, "prefill")
    assert "nvidia.com/gpu" not in c["resources"]["requests"]
    assert "vpc.amazonaws.com/efa" not in c["resources"]["limits"]
    assert pod(children, "prefill")["spec"]["nodeSelector"] == {"node.kubernetes.io/instance-type": "p5en.48xlarge"}


def test_the_crs_values_reach_the_emulator_through_its_own_flags():
    cr = emulated({"profile": "cpu-kv64k", "kvCacheBlocks": 96},
                  kvTransfer={"mode": "pull", "registrationTimeoutSeconds": 7, "leaseSeconds": 11,
                              "sideChannelPort": 6000},
                  model={"name": "some/model", "servedName": "served", "maxModelLen": 4096})
    for role in ("prefill", "decode"):
        args = command_line(cr, role)
        assert (args.profile, args.role, args.kv_mode, args.port, args.side_channel_port) == \
            ("cpu-kv64k", role, "pull", 8000, 6000)
        assert (args.served_model_name, args.max_model_len, args.kv_cache_blocks, args.block_size) == \
            ("served", 4096, 96, 128)
        assert (args.registration_timeout, args.lease_seconds, args.drain_seconds) == (7, 11, 30)
        profile = profile_for(args)
        assert (profile.num_blocks, profile.max_model_len) == (96, 4096)


def test_a_capacity_that_cannot_hold_one_request_is_refused_by_the_emulator():
    args = command_line(emulated({"kvCacheBlocks": 2}), "decode")
    with pytest.raises(SystemExit, match="does not fit 2 blocks"):
        profile_for(args)


def test_emulated_engines_never_pair_with_real_ones_and_real_crs_keep_their_layout_key():
    real, emu = make_cr(), make_cr({"engine": {"emulator": {}}})
    assert names.layout_key(emu.spec) != names.layout_key(real.spec)
    assert names.layout_key(make_cr({"engine": {"emulator": {"profile": "qwen3-32b-tp4-p5en"}}}).spec) != \
        names.layout_key(emu.spec)


def test_transport_verified_expects_the_emulators_transport():
    spec = emulated().spec
    assert spec.backend == contract.TRANSPORT and spec.advertises and not spec.uses_plugin
    ok = TransportReport("http://r", (EngineTransport("p", "prefill", contract.TRANSPORT),
                                      EngineTransport("d", "decode", contract.TRANSPORT)))
    assert transport_verdict(spec, ok)[:2] == ("True", "TransportMatches")
    real = TransportReport("http://r", (EngineTransport("p", "prefill", "UCX"),))
    assert transport_verdict(spec, real)[:2] == ("False", "TransportMismatch")


def test_an_operator_upgrade_keeps_the_emulators_revision_and_image():
    cr = emulated()
    old = engine_revision(cr, A)
    running = [(old, plugin_image_of(engine_statefulset(cr, "prefill", A, old)))]
    assert running == [(old, A.operator)]
    pinned = pinned_revision(cr, B, running)  # type: ignore[arg-type]
    assert pinned.revision == old
    assert engine_statefulset(cr, "decode", pinned.images, old) == engine_statefulset(cr, "decode", A, old)


def test_the_crd_offers_the_emulators_profiles_and_bounds_its_capacity():
    assert tuple(PROFILES) == contract.PROFILES
    with pytest.raises(ValidationError):
        emulated({"profile": "gpt-5"})
    with pytest.raises(ValidationError):
        emulated({"kvCacheBlocks": 0})
    assert emulated().spec.engine.emulator is not None
    assert emulated().spec.engine.emulator.profile == contract.DEFAULT_PROFILE  # type: ignore[union-attr]


def test_a_contention_flag_replaces_the_profiles_for_the_engines_role_and_junk_is_refused():
    args = command_line(emulated({}), "decode")
    args.contention = "0.2,7.5"
    c = profile_for(args).contention.of("decode")
    assert (c.share, c.per_sequence_s) == (0.2, 0.0075)
    args.contention = "lots"
    with pytest.raises(SystemExit, match="SHARE,PER_SEQUENCE_MS"):
        profile_for(args)
    args.contention = "-1,0"
    with pytest.raises(SystemExit):
        profile_for(args)
