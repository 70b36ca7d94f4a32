"""The vLLM-free parts of the connector plugin: its settings, the advertised handshake metadata, the record."""
from __future__ import annotations

import base64
import re
from types import SimpleNamespace

import pytest

from disagg.connector.plugin.advertiser import build_advertisement
from disagg.connector.plugin.settings import PluginSettings
from disagg.connector.rendezvous.client import RendezvousClient
from disagg.connector.wire import kv_metadata
from disagg.connector.wire.advertisement import EngineAdvertisement
from disagg.operator import names
from disagg.operator.engine_builders import engine_env
from disagg.operator.merge import deep_merge
from support.crs import make_cr


def vllm_config(connector="NixlPushConnector", kv_role="kv_consumer", tp=2, block=128, device="cuda"):
    """The attributes of vLLM's VllmConfig the plugin reads (plain data, no vLLM needed)."""
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(engine_id="dec-0-uid", kv_connector=connector, kv_role=kv_role),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1, data_parallel_size=1),
        cache_config=SimpleNamespace(block_size=block), model_config=SimpleNamespace(model="m", dtype="bfloat16"),
        device_config=SimpleNamespace(device_type=device))


POD = {"metadata.name": "qwen-decode-0", "metadata.uid": "uid-1", "status.podIP": "10.0.0.7"}


def operator_env(spec: dict | None = None) -> dict[str, str]:
    """The env the operator renders for a decode engine container, as the kubelet resolves it for one pod."""
    env: dict[str, str] = {}
    for item in engine_env(make_cr(deep_merge({"engine": {"port": 9100}}, spec or {})), "decode"):
        if "value" in item:
            env[item["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], item["value"])
        elif "fieldRef" in item["valueFrom"]:
            env[item["name"]] = POD[item["valueFrom"]["fieldRef"]["fieldPath"]]
        else:  # a Secret's key: the token
            env[item["name"]] = "shared-token"
    return env


OPERATOR_ENV = operator_env()


def test_the_plugin_reads_what_the_operator_renders():
    env = OPERATOR_ENV
    s = PluginSettings.from_vllm(vllm_config(), env)
    assert (s.role, s.kv_mode, s.deployment) == ("decode", "push", "qwen")
    assert s.layout_key == names.layout_key(make_cr().spec)
    assert (s.tp_size, s.block_size, s.http_port, s.heartbeat_seconds) == (2, 128, 9100, 5.0)
    assert (s.rendezvous_url, s.token, s.token_file) == ("http://qwen-rendezvous.ml.svc:8080", None,
                                                         "/var/run/secrets/disagg/rendezvous/token")
    assert str(RendezvousClient.from_env(env).token_file) == s.token_file
    adv = build_advertisement(s, {(0, 0): b"x"}, "h", "UCX", env["VLLM_NIXL_SIDE_CHANNEL_HOST"],
                              int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]))
    assert (adv.pod_name, adv.pod_uid, adv.http_url) == ("qwen-decode-0", "uid-1", "http://10.0.0.7:9100")
    assert env["DISAGG_ENGINE_ID"] == "qwen-decode-0-uid-1", "vLLM's engine_id (the launch script's expansion)"
    shared = PluginSettings.from_vllm(vllm_config(), operator_env({"rendezvous": {"auth": "token"}}))
    assert (shared.token, shared.token_file) == ("shared-token", None)


def test_local_settings_derive_role_mode_and_a_layout_key():
    push = PluginSettings.from_vllm(vllm_config(kv_role="kv_producer"), {})
    pull = PluginSettings.from_vllm(vllm_config("NixlConnector", "kv_producer"), {})
    assert (push.role, push.kv_mode, pull.kv_mode) == ("prefill", "push", "pull")
    assert push.rendezvous_url is None and push.deployment == "local"
    assert push.write_warmup and not PluginSettings.from_vllm(vllm_config(), {"DISAGG_WRITE_WARMUP": "0"}).write_warmup
    # Engines that must not be paired (push vs pull, another block size) get different keys.
    other_block = PluginSettings.from_vllm(vllm_config(kv_role="kv_producer", block=16), {})
    assert len({push.layout_key, pull.layout_key, other_block.layout_key}) == 3


def test_warmup_spans_several_blocks_within_the_context():
    cfg = vllm_config(block=128)
    cfg.model_config = SimpleNamespace(model="m", dtype="bfloat16", max_model_len=8192)
    assert PluginSettings.from_vllm(cfg, {}).warmup_tokens() == 320  # past two full KV blocks
    cfg.model_config.max_model_len = 100  # a short-context model: stay inside it
    assert PluginSettings.from_vllm(cfg, {}).warmup_tokens() == 92
    assert PluginSettings.from_vllm(cfg, {"DISAGG_WARMUP_TOKENS": "3"}).warmup_tokens() == 3


def test_kv_metadata_round_trips_and_rejects_anything_else():
    payloads = {(0, 0): b"\x81\xa1a\x01", (0, 1): b"rank1"}
    md = kv_metadata.encode(payloads, "hash")
    assert md["format"] == "vllm-nixl-handshake-v1" and md["compatibility_hash"] == "hash"
    assert kv_metadata.decode(md) == payloads
    for junk in (None, "b64", {"format": "other"}, {"format": md["format"], "ranks": {"x": "AA=="}},
                 {"format": md["format"], "ranks": {"0,0": "not base64!"}}, {"format": md["format"], "ranks": []}):
        assert kv_metadata.decode(junk) is None


def test_advertisement_carries_identity_sizes_transport_and_metadata():
    s = PluginSettings.from_vllm(vllm_config(), OPERATOR_ENV)
    adv = build_advertisement(s, {(0, 0): b"p0", (0, 1): b"p1"}, "hash", "UCX", "10.0.0.7", 5600)
    assert isinstance(adv, EngineAdvertisement)
    assert (adv.role, adv.engine_id, adv.deployment, adv.pod_name, adv.pod_uid) == (
        "decode", "dec-0-uid", "qwen", "qwen-decode-0", "uid-1")
    assert (adv.http_url, adv.side_channel_host, adv.side_channel_ports) == ("http://10.0.0.7:9100", "10.0.0.7",
                                                                             [5600])
    assert (adv.tp_size, adv.block_size, adv.kv_mode, adv.transport, adv.lease_seconds) == (2, 128, "push", "UCX",
                                                                                           15.0)
    assert base64.b64decode(adv.kv_metadata["ranks"]["0,1"]) == b"p1"


def test_an_engine_without_a_role_cannot_advertise():
    s = PluginSettings.from_vllm(vllm_config(kv_role="kv_both"), {})
    with pytest.raises(ValueError, match="DISAGG_ROLE"):
        build_advertisement(s, {}, None, None, "127.0.0.1", 5600)


def test_compatible_peers_are_the_other_role_of_the_same_deployment_layout_and_mode():
    me = PluginSettings.from_vllm(vllm_config(kv_role="kv_producer"), {**OPERATOR_ENV, "DISAGG_ROLE": "prefill"})
    me.engine_id = "pre-0-uid"
    base = build_advertisement(PluginSettings.from_vllm(vllm_config(), OPERATOR_ENV), {}, None, None, "h", 1)
    assert me.compatible_peer(base)
    for change in ({"role": "prefill"}, {"deployment": "other"}, {"layout_key": "old"}, {"kv_mode": "pull"},
                   {"engine_id": me.engine_id}):
        assert not me.compatible_peer(base.model_copy(update=change)), change


def test_kv_work_starts_before_the_forward_only_where_the_forward_is_synchronous():
    """CPU forwards run to their end before vLLM starts the step's transfers; accelerator launches return at once."""
    assert PluginSettings.from_vllm(vllm_config(device="cpu"), {}).start_loads_at_bind
    assert PluginSettings.from_vllm(vllm_config(device="cpu"), {}).cpu_engine
    assert not PluginSettings.from_vllm(vllm_config(device="cuda"), {}).cpu_engine
    assert not PluginSettings.from_vllm(vllm_config(device="cuda"), {}).start_loads_at_bind
    assert not PluginSettings.from_vllm(vllm_config(device="neuron"), {}).start_loads_at_bind
    assert not PluginSettings.from_vllm(vllm_config(device="cpu"), {"DISAGG_KV_START_AT_BIND": "0"}).start_loads_at_bind
    assert PluginSettings.from_vllm(vllm_config(), {}).push_notify_on_step
    assert not PluginSettings.from_vllm(vllm_config(), {"DISAGG_PUSH_NOTIFY_ON_STEP": "0"}).push_notify_on_step
