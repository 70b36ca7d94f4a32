"""Engines publish KV events (issue 36, item 1), opt-in by `spec.router.policy: prefix-aware`: what the operator
renders for vLLM (operator/engine_builders.py), what the plugin advertises from it (connector/plugin/settings.py,
advertiser.py), what the engine emulator advertises from its own publisher (connector/emulator/), and that a CR
which does not ask renders its engines exactly as before."""
from __future__ import annotations

import functools
import json
import re
import shlex
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from disagg.connector.emulator.kv_events import KvEventPublisher
from disagg.connector.emulator.main import Emulator, advertisement
from disagg.connector.plugin.advertiser import build_advertisement
from disagg.connector.plugin.settings import PluginSettings
from disagg.connector.wire import env as wire_env
from disagg.operator import api, crdgen, names
from disagg.operator.builders import OperatorImages, build_children, engine_args, engine_revision
from disagg.operator.engine_builders import launch_script
from disagg.operator.profiles import PROFILES
from support.crs import child, engine, env_of, launch_configmap, make_cr
from support.emulators import emulator_args

PREFIX_AWARE = {"router": {"policy": "prefix-aware"}}
ONE_RANK_JSON = ('{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557",'
                 '"replay_endpoint":"tcp://*:5558","topic":""}')
"""The flag's value for an engine of one data-parallel rank, byte for byte."""


def cr_for(profile: str, spec: dict | None = None):
    """A CR that fits `profile` (one rank per pod on the cpu profile)."""
    tp = {} if profile != "cpu" else {"prefill": {"tensorParallelSize": 1}, "decode": {"tensorParallelSize": 1}}
    return make_cr({**tp, **(spec or {})}, profile=profile)


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def events_config(cr, role: str) -> dict[str, Any] | None:
    value = flag(engine_args(cr.spec, role), "--kv-events-config")
    return None if value is None else json.loads(value)


def port_names(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


# -- the operator ------------------------------------------------------------------------------------------------
BEFORE_THE_FIELD = {"cpu": ("dc1ece", "6e3bbb"), "nvidia-h100": ("6c8472", "812f92"),
                    "nvidia-h200": ("a0ba2e", "489d45"), "trainium1": ("b32c4a", "beaa34"),
                    "trainium2": ("e7afb2", "d4e66a")}
"""Each profile's revisions (`cr_for(profile)`, and with two decode DP ranks in pull mode) as the operator rendered
them before spec.router.policy existed (commit 5fe42f3). Like test_revision_pinning.py's EXAMPLE_REVISIONS, these
change only with a deliberate change of how engines render, which rolls every deployment on upgrade."""


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_least_loaded_renders_the_engines_exactly_as_before_the_field(profile):
    """Unset and explicit least-loaded are one rendering, the one from before the field, with none of the events'
    flag, env or ports: so an upgraded operator rolls no engine."""
    unset, explicit = cr_for(profile), cr_for(profile, {"router": {"policy": "least-loaded"}})
    assert unset.spec.router.policy == "least-loaded" and not unset.spec.kv_events
    images = OperatorImages()
    dp_pull = cr_for(profile, {"decode": {"dataParallelSize": 2}, "kvTransfer": {"mode": "pull"}})
    assert (engine_revision(unset, images), engine_revision(dp_pull, images)) == BEFORE_THE_FIELD[profile]
    assert build_children(explicit, images=images) == build_children(unset, images=images)
    assert engine_revision(explicit, images) == engine_revision(unset, images)
    children = build_children(unset, images=images)
    for role in ("prefill", "decode"):
        assert not {"--kv-events-config", "--enable-prompt-tokens-details"} & set(engine_args(unset.spec, role))
        assert not {wire_env.KV_EVENTS_PORT, wire_env.KV_EVENTS_REPLAY_PORT} & set(env_of(engine(children, role)))
        assert not [n for n in port_names(engine(children, role)) if n.startswith("kv-")]


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_prefix_aware_renders_vllms_events_config_env_and_ports_on_every_profile(profile):
    cr = cr_for(profile, PREFIX_AWARE)
    children = build_children(cr)
    for role in ("prefill", "decode"):
        args = engine_args(cr.spec, role)
        assert flag(args, "--kv-events-config") == ONE_RANK_JSON
        assert args.index("--kv-transfer-config") < args.index("--kv-events-config")
        assert "--enable-prompt-tokens-details" in args  # the cached tokens the router checks its index against
        # Prefix caching is vLLM's default (the events report on it): nothing renders a flag about it.
        assert not [a for a in args if "prefix-caching" in a]
        c = engine(children, role)
        assert {n: p for n, p in port_names(c).items() if n.startswith("kv-")} == {"kv-events-0": 5557,
                                                                                   "kv-replay-0": 5558}
        assert {k: v for k, v in env_of(c).items() if k.startswith("DISAGG_KV_EVENTS")} == {
            wire_env.KV_EVENTS_PORT: "5557", wire_env.KV_EVENTS_REPLAY_PORT: "5558"}
        service = child(children, "Service", f"qwen-{role}")
        assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == port_names(c), "the headless Service too"
    assert engine_revision(cr, OperatorImages()) != engine_revision(cr_for(profile), OperatorImages()), \
        "turning events on is a new revision: a rollout"


def test_the_launch_script_hands_vllm_the_json_as_one_argument():
    cr = cr_for("cpu", PREFIX_AWARE)
    script = launch_configmap(build_children(cr))["data"][names.launch_script_key("prefill")]
    assert script == launch_script(cr.spec, "prefill")
    [line] = [ln for ln in script.splitlines() if "--kv-events-config" in ln]
    assert shlex.split(line.removesuffix(" \\")) == ["--kv-events-config", ONE_RANK_JSON]


def test_each_data_parallel_rank_publishes_on_ports_of_its_own():
    """vLLM adds a rank's index to both endpoint ports: the replay ports start after every rank's events port."""
    cr = make_cr({**PREFIX_AWARE, "decode": {"dataParallelSize": 3}})
    assert events_config(cr, "decode") == {"enable_kv_cache_events": True, "publisher": "zmq",
                                           "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5560",
                                           "topic": ""}
    assert events_config(cr, "prefill")["replay_endpoint"] == "tcp://*:5558"
    ports = port_names(engine(build_children(cr), "decode"))
    assert {n: p for n, p in ports.items() if n.startswith("kv-")} == {
        "kv-events-0": 5557, "kv-events-1": 5558, "kv-events-2": 5559,
        "kv-replay-0": 5560, "kv-replay-1": 5561, "kv-replay-2": 5562}
    assert len(set(ports.values())) == len(ports)
    assert all(len(name) <= 15 for name in ports), "a container port's name is an IANA_SVC_NAME"


def test_engine_emulators_publish_under_either_policy_and_prefix_aware_changes_none_of_their_pods():
    spec = {"engine": {"emulator": {}}}
    emulated, aware = cr_for("cpu", spec), cr_for("cpu", {**spec, **PREFIX_AWARE})
    images = OperatorImages()
    assert engine_revision(aware, images) == engine_revision(emulated, images)
    c = engine(build_children(emulated, images=images), "prefill")
    assert {n: p for n, p in port_names(c).items() if n.startswith("kv-")} == {"kv-events": 5557, "kv-replay": 5558}
    assert wire_env.KV_EVENTS_PORT not in env_of(c), "the emulator advertises the ports it bound itself"


@pytest.mark.parametrize("args, needle", [
    (["--no-enable-prefix-caching"], "needs vLLM's prefix caching"),
    (["--no_enable_prefix_caching"], "needs vLLM's prefix caching"),
    (["--kv-events-config", "{}"], "renders --kv-events-config itself"),
    (["--kv_events_config={}"], "renders --kv-events-config itself"),
    (["--kv-events-config.endpoint", "tcp://*:7000"], "renders --kv-events-config itself"),
])
@pytest.mark.parametrize("where", ["engine", "prefill", "decode"])
def test_prefix_aware_refuses_args_that_undo_it(args, needle, where):
    with pytest.raises(ValidationError, match=re.escape(needle)) as e:
        make_cr({**PREFIX_AWARE, where: {"args": args}})
    assert f"spec.{where}.args" in str(e.value)
    make_cr({where: {"args": args}})  # least-loaded: the args are the user's, as before


@functools.cache
def crd_spec() -> dict[str, Any]:
    """The generated CRD's schema of `spec`."""
    crd = yaml.safe_load(crdgen.render())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def _cel(rule: str, spec: dict[str, Any]) -> Any:
    """A CEL expression of the rules below in Python: they use only `||`, `&&`, comparisons, integer arithmetic and
    `"...".format([...])` with %d (CEL's format), over fields of `self`."""
    def ns(value: Any) -> Any:
        return SimpleNamespace(**{k: ns(v) for k, v in value.items()}) if isinstance(value, dict) else value
    if m := re.fullmatch(r'(".*")\.format\(\[(.*)\]\)', rule, re.S):
        return eval(m[1]) % tuple(eval(f"[{m[2]}]", {"self": ns(spec)}))  # noqa: S307 - our own generated rule
    return eval(rule.replace("||", " or ").replace("&&", " and "), {"self": ns(spec)})  # noqa: S307


@pytest.mark.parametrize("dp", [1, 2, 21, 22])
@pytest.mark.parametrize("side, port", [(5600, 8000), (5558, 8000), (5500, 8000), (5400, 5557), (5400, 5600),
                                        (6000, 5565), (5540, 8000), (5556, 8000)])
def test_the_port_rule_of_the_crd_and_the_models_agree(dp, side, port):
    """The apiserver's rule (CEL, generated into the CRD) and the operator's (the spec's validator) refuse the same
    specs: KV event ports that overlap the side channel's or the HTTP port."""
    rules = [r for r in crd_spec()["x-kubernetes-validations"] if r.get("fieldPath") == ".router.policy"]
    assert len(rules) == 2
    for policy in ("least-loaded", "prefix-aware"):
        spec = {"router": {"policy": policy}, "kvTransfer": {"sideChannelPort": side}, "engine": {"port": port},
                "prefill": {"dataParallelSize": 1}, "decode": {"dataParallelSize": dp}}
        admitted = all(_cel(r["rule"], spec) for r in rules)
        try:
            make_cr(spec)
            valid = True
        except ValidationError as e:
            valid = False
            assert "KV event ports" in str(e)
        expect = policy == "least-loaded" or not (
            port in range(5557, 5557 + 2 * dp) or (side < 5557 + 2 * dp and 5557 < side + dp))
        assert (admitted, valid) == (expect, expect), (policy, spec)
        for r, role in zip(rules, ("prefill", "decode"), strict=True):
            if not _cel(r["rule"], spec):
                last = 5557 + 2 * spec[role]["dataParallelSize"] - 1
                message = _cel(r["messageExpression"], spec)
                assert f"the {role} engines' KV event ports at 5557-{last}" in message, message
                assert f"spec.engine.port {port}" in message


def test_the_crd_documents_the_policy_and_defaults_it():
    router = crd_spec()["properties"]["router"]
    policy = router["properties"]["policy"]
    assert policy["enum"] == ["least-loaded", "prefix-aware"] and policy["default"] == "least-loaded"
    assert router["default"]["policy"] == "least-loaded"
    for needle in ("--kv-events-config", "5557", "5558", "/tokenize", "--enable-prompt-tokens-details", "new revision"):
        assert needle in policy["description"], needle
    assert api.RouterSpec().policy == api.LEAST_LOADED


# -- the plugin: what the operator renders, advertised -------------------------------------------------------------
POD = {"metadata.name": "qwen-decode-0", "metadata.uid": "uid-1", "status.podIP": "10.0.0.7"}


def operator_env(cr, role: str = "decode") -> dict[str, str]:
    """The env the operator renders for an engine container, as the kubelet resolves it for one pod."""
    env: dict[str, str] = {}
    for item in engine_env_of(cr, role):
        if "value" in item:
            env[item["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], item["value"])
        elif "fieldRef" in item["valueFrom"]:
            env[item["name"]] = POD[item["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[item["name"]] = "shared-token"
    return env


def engine_env_of(cr, role: str) -> list[dict[str, Any]]:
    return engine(build_children(cr), role)["env"]


def vllm_config(cr, role: str = "decode", **cache: Any) -> SimpleNamespace:
    """The attributes of VllmConfig the plugin reads, as vLLM parses the operator's arguments (no vLLM needed)."""
    rspec = cr.spec.decode if role == "decode" else cr.spec.prefill
    events = events_config(cr, role)
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(engine_id="dec-0-uid", kv_connector="NixlPushConnector",
                                           kv_role="kv_consumer"),
        parallel_config=SimpleNamespace(tensor_parallel_size=rspec.tensor_parallel_size, pipeline_parallel_size=1,
                                        data_parallel_size=rspec.data_parallel_size),
        cache_config=SimpleNamespace(block_size=128, **cache), model_config=SimpleNamespace(model="m", dtype="auto"),
        device_config=SimpleNamespace(device_type="cuda"),
        kv_events_config=None if events is None else SimpleNamespace(**{"buffer_steps": 10_000, **events}))


def advertised(cr, config: SimpleNamespace | None = None, env: dict[str, str] | None = None):
    env = operator_env(cr) if env is None else env
    s = PluginSettings.from_vllm(config or vllm_config(cr), env)
    return build_advertisement(s, {}, None, "UCX", env[wire_env.SIDE_CHANNEL_HOST],
                               int(env[wire_env.SIDE_CHANNEL_PORT]))


def test_a_prefix_aware_engine_advertises_where_its_events_are():
    adv = advertised(make_cr(PREFIX_AWARE))
    assert adv.kv_events_endpoints == ["tcp://10.0.0.7:5557"]
    assert adv.kv_events_replay_endpoints == ["tcp://10.0.0.7:5558"]
    dp = make_cr({**PREFIX_AWARE, "decode": {"dataParallelSize": 2}})
    adv = advertised(dp)
    assert adv.kv_events_endpoints == ["tcp://10.0.0.7:5557", "tcp://10.0.0.7:5558"]
    assert adv.kv_events_replay_endpoints == ["tcp://10.0.0.7:5559", "tcp://10.0.0.7:5560"]


def test_a_least_loaded_engine_advertises_no_events_and_sends_what_it_sent_before():
    adv = advertised(make_cr())
    assert adv.kv_events_endpoints is None and adv.kv_events_replay_endpoints is None
    assert not {k for k in adv.model_dump(exclude_none=True) if k.startswith("kv_events")}


def test_the_plugin_advertises_only_what_vllm_publishes():
    cr = make_cr(PREFIX_AWARE)
    env = operator_env(cr)
    off = vllm_config(make_cr())  # vLLM runs without events (another launch, a user's override)
    assert advertised(cr, off, env).kv_events_endpoints is None
    elsewhere = vllm_config(cr)
    elsewhere.kv_events_config.endpoint = "tcp://*:7000"
    assert advertised(cr, elsewhere, env).kv_events_endpoints is None
    null = vllm_config(cr)
    null.kv_events_config.publisher = "null"
    assert advertised(cr, null, env).kv_events_endpoints is None
    assert advertised(cr, vllm_config(cr, enable_prefix_caching=False), env).kv_events_endpoints is None, \
        "without prefix caching vLLM stores no block: nothing to publish"
    no_replay = vllm_config(cr)
    no_replay.kv_events_config.replay_endpoint = None
    adv = advertised(cr, no_replay, env)
    assert (adv.kv_events_endpoints, adv.kv_events_replay_endpoints) == (["tcp://10.0.0.7:5557"], None)
    without_env = {k: v for k, v in env.items() if not k.startswith("DISAGG_KV_EVENTS")}
    assert advertised(cr, vllm_config(cr), without_env).kv_events_endpoints is None, \
        "events a user turned on through args are not the operator's to advertise"


# -- the engine emulator: the ports its publisher bound --------------------------------------------------------------
async def test_the_emulator_advertises_the_ports_its_publisher_bound():
    env = {wire_env.ENGINE_ID: "emu-decode-1", wire_env.POD_IP: "10.0.0.9", wire_env.SIDE_CHANNEL_HOST: "10.0.0.9"}
    emulator = Emulator(emulator_args("--role", "decode"), env)
    publisher = KvEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    try:
        assert publisher.port > 0 and publisher.replay_port not in (None, publisher.port)
        adv = advertisement(emulator.ident, emulator.side_port, publisher)
        assert adv.kv_events_endpoints == [f"tcp://10.0.0.9:{publisher.port}"]
        assert adv.kv_events_replay_endpoints == [f"tcp://10.0.0.9:{publisher.replay_port}"]
        assert advertisement(emulator.ident, emulator.side_port).kv_events_endpoints is None
    finally:
        await publisher.close()
    no_replay = KvEventPublisher("tcp://127.0.0.1:*", None)
    try:
        adv = advertisement(emulator.ident, emulator.side_port, no_replay)
        assert adv.kv_events_endpoints and adv.kv_events_replay_endpoints is None
    finally:
        await no_replay.close()


async def test_a_started_emulator_advertises_its_events_and_none_with_them_off():
    env = {wire_env.ENGINE_ID: "emu-prefill-1", wire_env.SIDE_CHANNEL_HOST: "127.0.0.1"}
    on = Emulator(emulator_args("--role", "prefill"), env)
    await on.start()
    try:
        assert on.publisher is not None
        adv = advertisement(on.ident, on.side_port, on.publisher)
        assert adv.kv_events_endpoints == [f"tcp://127.0.0.1:{on.args.kv_events_port}"]
        assert adv.kv_events_replay_endpoints == [f"tcp://127.0.0.1:{on.args.kv_events_replay_port}"]
    finally:
        await on.stop(drain_seconds=0)
    off = Emulator(emulator_args("--role", "prefill", "--kv-events-port", "0"), env)
    await off.start()
    try:
        assert off.publisher is None
        assert advertisement(off.ident, off.side_port, off.publisher).kv_events_endpoints is None
    finally:
        await off.stop(drain_seconds=0)
