"""What the plugin needs to know about its engine: vLLM's config plus the env the operator (or a local run) sets.

Kept free of vLLM imports so it is testable anywhere; `from_vllm` only reads attributes of the config object.
"""
from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..wire import env as wire_env
from ..wire.advertisement import KvMode, Role
from ..wire.kv_transfer import ROLE_OF_KV_ROLE

PUSH_CONNECTORS = frozenset({"NixlPushConnector"})
log = logging.getLogger("disagg.plugin")


def _role(value: str | None) -> Role | None:
    """An engine role, or None for anything else (kv_both, a typo): such an engine does not advertise."""
    if value == "prefill":
        return "prefill"
    if value == "decode":
        return "decode"
    return None


def _device(vllm_config: Any) -> str:
    """vLLM's device type ("cpu", "cuda", "neuron", ...), or "" when the config does not say."""
    return str(getattr(getattr(vllm_config, "device_config", None), "device_type", "") or "")


def _bound_port(endpoint: object) -> int | None:
    """The port of a ZMQ endpoint vLLM binds on every interface (`tcp://*:5557`), else None."""
    if not isinstance(endpoint, str) or not endpoint.startswith("tcp://*:"):
        return None
    port = endpoint.removeprefix("tcp://*:")
    return int(port) if port.isdigit() else None


def kv_events_publishing(vllm_config: Any, env: Mapping[str, str]) -> tuple[int | None, int | None]:
    """The KV event ports to advertise (`kv_events_port`, `kv_events_replay_port`), each None or: the operator's
    (`$DISAGG_KV_EVENTS_PORT`, `$DISAGG_KV_EVENTS_REPLAY_PORT`), and only those vLLM binds too (its
    `kv_events_config`: events on, the zmq publisher, the same ports) with prefix caching on (without it vLLM stores
    no block, so it has no event to send). So an engine never advertises an endpoint nobody publishes on, and a
    replay port only beside its events port."""
    off = (None, None)
    want = env.get(wire_env.KV_EVENTS_PORT)
    if not want:
        return off
    events_config = getattr(vllm_config, "kv_events_config", None)
    enabled = bool(getattr(events_config, "enable_kv_cache_events", False))
    publisher = getattr(events_config, "publisher", None)
    port = _bound_port(getattr(events_config, "endpoint", None))
    caching = getattr(getattr(vllm_config, "cache_config", None), "enable_prefix_caching", True) is not False
    if not enabled or publisher != "zmq" or str(port) != want or not caching:
        log.warning("disagg plugin: $%s is %s, but vLLM publishes no KV events there (enable_kv_cache_events %s, "
                    "publisher %s, endpoint %s, prefix caching %s): advertising none", wire_env.KV_EVENTS_PORT, want,
                    enabled, publisher, getattr(events_config, "endpoint", None), caching)
        return off
    replay = _bound_port(getattr(events_config, "replay_endpoint", None))
    want_replay = env.get(wire_env.KV_EVENTS_REPLAY_PORT)
    if want_replay and str(replay) != want_replay:
        log.warning("disagg plugin: $%s is %s, but vLLM's replay endpoint is %s: advertising no replay",
                    wire_env.KV_EVENTS_REPLAY_PORT, want_replay, getattr(events_config, "replay_endpoint", None))
    if not want_replay or str(replay) != want_replay:
        replay = None
    return port, replay


@dataclass
class PluginSettings:
    engine_id: str
    role: Role | None
    kv_mode: KvMode
    deployment: str
    layout_key: str
    tp_size: int
    pp_size: int
    dp_size: int
    block_size: int
    http_port: int
    rendezvous_url: str | None
    token: str | None
    token_file: str | None
    heartbeat_seconds: float
    env: Mapping[str, str]
    transport: str | None = None
    max_model_len: int = 0
    write_warmup: bool = True
    """Push prefill: WRITE the null block to each newly loaded decode (`write_warmup`);
    `$DISAGG_WRITE_WARMUP=0` turns it off (the benchmark's before/after arm)."""

    cpu_engine: bool = False
    """vLLM runs on the CPU (its device type): the worker asks for AMX tiles before its first forward
    (`cpu_amx`)."""
    start_loads_at_bind: bool = False
    """CPU engines: start a step's KV transfers when vLLM binds its metadata, before the (synchronous) forward,
    not after it (`connectors._DisaggMixin.bind_connector_metadata`); `$DISAGG_KV_START_AT_BIND=0` keeps vLLM's
    order."""
    push_notify_on_step: bool = True
    """Push decode: have the writer read NIXL's notifications at the end of every engine step, before vLLM reads
    what it forwarded (`push_notify`); `$DISAGG_PUSH_NOTIFY_ON_STEP=0` keeps vLLM's order (the benchmark's
    before/after arm)."""
    kv_events_port: int | None = None
    """DP rank 0's KV events PUB port the engine advertises (rank r's: this + r), or None: advertised only when the
    operator set it (`$DISAGG_KV_EVENTS_PORT`) and vLLM publishes there (`kv_events_publishing`)."""
    kv_events_replay_port: int | None = None
    """DP rank 0's replay port, on the same terms (`$DISAGG_KV_EVENTS_REPLAY_PORT`); None without events."""

    def warmup_tokens(self) -> int:
        """Prompt length of the self warm-up (`advertiser.warm_up`): two and a half KV blocks unless
        `$DISAGG_WARMUP_TOKENS` says otherwise, within the model's context. Several blocks, because a P/D engine's
        first real forward runs on a multi-block context."""
        want = int(self.env.get(wire_env.WARMUP_TOKENS) or (2 * self.block_size + self.block_size // 2))
        if self.max_model_len:
            want = min(want, self.max_model_len - 8)
        return max(want, 1)

    @classmethod
    def from_vllm(cls, vllm_config: Any, env: Mapping[str, str] = os.environ) -> PluginSettings:
        kv = vllm_config.kv_transfer_config
        par = vllm_config.parallel_config
        block_size = int(vllm_config.cache_config.block_size)
        mode: KvMode = "push" if kv.kv_connector in PUSH_CONNECTORS else "pull"
        model = getattr(vllm_config.model_config, "model", "") or ""
        dtype = str(getattr(vllm_config.model_config, "dtype", ""))
        cpu = _device(vllm_config) == "cpu"
        events_port, replay_port = kv_events_publishing(vllm_config, env)
        return cls(
            engine_id=kv.engine_id,
            role=_role(env.get(wire_env.ROLE) or ROLE_OF_KV_ROLE.get(kv.kv_role)),
            kv_mode=mode,
            deployment=env.get(wire_env.DEPLOYMENT) or "local",
            # Without the operator's key, derive one from what must match between paired engines.
            layout_key=env.get(wire_env.LAYOUT_KEY) or "local-" + hashlib.sha256(
                f"{model}|{dtype}|{block_size}|{mode}".encode()).hexdigest()[:16],
            tp_size=int(par.tensor_parallel_size), pp_size=int(par.pipeline_parallel_size),
            dp_size=int(par.data_parallel_size), block_size=block_size,
            http_port=int(env.get(wire_env.HTTP_PORT) or wire_env.DEFAULT_HTTP_PORT),
            rendezvous_url=env.get(wire_env.RENDEZVOUS_URL) or None, token=env.get(wire_env.RENDEZVOUS_TOKEN) or None,
            token_file=env.get(wire_env.RENDEZVOUS_TOKEN_FILE) or None,
            heartbeat_seconds=wire_env.heartbeat_seconds(env), env=env,
            max_model_len=int(getattr(vllm_config.model_config, "max_model_len", 0) or 0),
            write_warmup=env.get(wire_env.WRITE_WARMUP, "1") != "0",
            push_notify_on_step=env.get(wire_env.PUSH_NOTIFY_ON_STEP, "1") != "0",
            cpu_engine=cpu,
            start_loads_at_bind=cpu and env.get(wire_env.KV_START_AT_BIND, "1") != "0",
            kv_events_port=events_port, kv_events_replay_port=replay_port)

    def compatible_peer(self, adv: Any) -> bool:
        """A peer this engine may be paired with: the other role, same deployment, layout and transfer mode."""
        return (adv.engine_id != self.engine_id and self.role is not None and adv.role != self.role
                and adv.deployment == self.deployment and adv.layout_key == self.layout_key
                and adv.kv_mode == self.kv_mode)

