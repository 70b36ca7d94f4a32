"""Env names the operator sets on engine containers and the engines read (the plugin and the launch script).

The operator renders them (operator/engine_builders.py); the plugin, the rendezvous client and local runs
(devcluster/engines.py) read them. A name used by only one side is not here.
"""
from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

ROLES: Final = ("prefill", "decode")
"""Engine roles, in this order everywhere (labels, env, advertisements)."""

# Identity, from the downward API and the spec.
POD_NAME: Final = "POD_NAME"
POD_UID: Final = "POD_UID"
POD_IP: Final = "POD_IP"
ENGINE_ID: Final = "DISAGG_ENGINE_ID"
"""`$(POD_NAME)-$(POD_UID)` in the pod spec, to which the launch script appends a suffix drawn at each start of the
container: unique per engine process; equals the vLLM `engine_id` of --kv-transfer-config."""
ROLE: Final = "DISAGG_ROLE"
DEPLOYMENT: Final = "DISAGG_DEPLOYMENT"
LAYOUT_KEY: Final = "DISAGG_LAYOUT_KEY"
"""Engines pair only within one layout key (model, dtype, block size, connector mode, image)."""
HTTP_PORT: Final = "DISAGG_HTTP_PORT"
"""The engine's API server port: the engine core, where the plugin advertises from, does not know it."""

# vLLM's own side-channel settings, which the advertisement repeats.
SIDE_CHANNEL_HOST: Final = "VLLM_NIXL_SIDE_CHANNEL_HOST"
SIDE_CHANNEL_PORT: Final = "VLLM_NIXL_SIDE_CHANNEL_PORT"

# The rendezvous.
RENDEZVOUS_URL: Final = "DISAGG_RENDEZVOUS_URL"
RENDEZVOUS_TOKEN: Final = "DISAGG_RENDEZVOUS_TOKEN"
"""`spec.rendezvous.auth: token`: the shared token itself (from the deployment's Secret)."""
RENDEZVOUS_TOKEN_FILE: Final = "DISAGG_RENDEZVOUS_TOKEN_FILE"
"""`spec.rendezvous.auth: kubernetes`: the projected pod-bound token's path, re-read on every request."""
HEARTBEAT_SECONDS: Final = "DISAGG_HEARTBEAT_SECONDS"

# KV cache events (spec.router.policy: prefix-aware). Set only on engines that publish them: unset, the plugin
# advertises no events endpoint.
KV_EVENTS_PORT: Final = "DISAGG_KV_EVENTS_PORT"
"""DP rank 0's port of vLLM's KV events PUB socket (`--kv-events-config` endpoint); rank r's is this plus r, as
vLLM offsets each data-parallel rank's endpoint by its rank."""
KV_EVENTS_REPLAY_PORT: Final = "DISAGG_KV_EVENTS_REPLAY_PORT"
"""DP rank 0's port of the events' replay socket (`replay_endpoint`), offset per rank in the same way."""

# Plugin tuning (users set these through spec.engine.env; the operator does not, except where a profile says).
WARMUP: Final = "DISAGG_WARMUP"
"""`0` skips the engine's two requests of its own before it advertises."""
WARMUP_TOKENS: Final = "DISAGG_WARMUP_TOKENS"
WRITE_WARMUP: Final = "DISAGG_WRITE_WARMUP"
"""`0` turns off push prefill's null-block WRITE to each newly loaded decode."""
PUSH_NOTIFY_ON_STEP: Final = "DISAGG_PUSH_NOTIFY_ON_STEP"
"""`0` keeps vLLM's order at a push decode's step end, which reports a landed KV one engine step later
(connector/plugin/push_notify.py); the default has the writer read NIXL's notifications before the step reads
its queue."""
KV_START_AT_BIND: Final = "DISAGG_KV_START_AT_BIND"
"""`0` keeps vLLM's order on CPU engines, where a step's KV transfers start only after its forward has run
(connector/plugin/connectors.py); the default starts them before it, as a GPU's asynchronous launch does."""
NIXL_PROGRESS_DELAY_US: Final = "DISAGG_NIXL_PROGRESS_DELAY_US"
"""Microseconds NIXL's progress thread may sleep in poll() between events (rounded up to whole milliseconds);
unset, NIXL's default 0 spins a core. CPU engines get it (CPU_ENGINE_ENV)."""

CPU_ENGINE_ENV: Final[Mapping[str, str]] = MappingProxyType({
    "UCX_TLS": "tcp,self,sm",  # shared memory alone fails with NIXL_ERR_BACKEND
    NIXL_PROGRESS_DELAY_US: "1000",  # NIXL's poll() rounds it up to 1 ms, the least wait that is not a spin
})
"""What every vLLM CPU engine gets: the `cpu` profile's pods (operator/profiles.py) and local runs alike."""

DEFAULT_HTTP_PORT: Final = 8000
DEFAULT_KV_EVENTS_PORT: Final = 5557
"""vLLM's own default KV events endpoint port: the first of an engine's KV event ports (`kv_events_ports`)."""
DEFAULT_HEARTBEAT_SECONDS: Final = 5.0
LEASE_HEARTBEATS: Final = 3
"""An engine's lease is this many heartbeats: one lost renewal never expires it."""
RENDEZVOUS_PORT: Final = 8080
REVISION_CHARS: Final = 6
"""Hex characters of a revision in an engine StatefulSet's name (`<cr>-<role>-<revision>`), so in its pods'."""
TOKEN_AUDIENCE: Final = "disagg-rendezvous"
"""Audience of the projected engine tokens: the rendezvous accepts only these, and the API server never does."""


def heartbeat_seconds(env: Mapping[str, str]) -> float:
    return float(env.get(HEARTBEAT_SECONDS) or DEFAULT_HEARTBEAT_SECONDS)


def kv_events_ports(dp_size: int) -> tuple[range, range]:
    """An engine's KV event ports, one PUB and one replay port per data-parallel rank (index = rank): the PUB ports
    from DEFAULT_KV_EVENTS_PORT up, then the replay ports right after them, so no rank's port is another's. With one
    rank they are 5557 and 5558, where vLLM's example subscriber (examples/online_serving/kv_events_subscriber.py)
    connects."""
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    events = range(DEFAULT_KV_EVENTS_PORT, DEFAULT_KV_EVENTS_PORT + dp_size)
    return events, range(events.stop, events.stop + dp_size)
