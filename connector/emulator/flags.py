"""Flags of `disagg emulator`, kept apart so building the CLI never imports aiohttp or zmq.

Identity (engine id, role, deployment, layout key, rendezvous, side-channel host) comes from the same env the
operator sets on engine containers (connector/wire/env.py); the flags say what is emulated and how it serves.
"""
from __future__ import annotations

import argparse

from ..wire import emulator as contract
from ..wire import env as wire_env


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", choices=contract.PROFILES, default=contract.DEFAULT_PROFILE,
                   help="which engine to emulate: its capacity, limits and step costs (connector/emulator/profiles.py)")
    p.add_argument("--role", choices=wire_env.ROLES, default=None,
                   help=f"prefill or decode (default ${wire_env.ROLE})")
    p.add_argument("--kv-mode", choices=("push", "pull"), default="push",
                   help="the KV connector it emulates: push (NixlPushConnector) or pull (NixlConnector)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=wire_env.DEFAULT_HTTP_PORT, help="the OpenAI API's port")
    p.add_argument("--side-channel-port", type=int, default=None,
                   help=f"the emulated KV side channel's port (default ${wire_env.SIDE_CHANNEL_PORT}, else 5600)")
    p.add_argument("--served-model-name", default=None, help="the model name clients use (default: the profile's)")
    p.add_argument("--block-size", type=int, default=None,
                   help="KV block size in tokens instead of the profile's (its KV capacity in tokens stays)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length instead of the profile's")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply every modelled duration (steps, the API's share, KV transfers) by this: 1 is the "
                        "profile's time; functional tests run at a fraction of it")
    p.add_argument("--kv-cache-blocks", type=int, default=None,
                   help="KV cache capacity in blocks instead of the profile's (to make the prefix cache evict)")
    p.add_argument("--contention", default=None, metavar="SHARE,PER_SEQUENCE_MS",
                   help="this engine's contention instead of its role's in the profile: the share every step is "
                        "stretched by while serving, and the milliseconds added per sequence in a step "
                        "(bench/emulator_fit.py contention fits them)")
    p.add_argument("--registration-timeout", type=float, default=60.0,
                   help="push decode: seconds to wait for the prefill's WRITE before the request fails")
    p.add_argument("--lease-seconds", type=float, default=30.0,
                   help="prefill: seconds a finished request's blocks wait for their decode")
    p.add_argument("--drain-seconds", type=float, default=30.0,
                   help="on SIGTERM: leave the rendezvous, then finish the requests in flight for at most this long")
    p.add_argument("--kv-events-port", type=int, default=contract.KV_EVENTS_PORT,
                   help="ZMQ PUB port of the KV events (vLLM's format); 0 turns KV events off")
    p.add_argument("--kv-events-replay-port", type=int, default=contract.KV_EVENTS_REPLAY_PORT,
                   help="ZMQ ROUTER port of the KV events' replay; 0 turns it off")
    p.add_argument("--kv-events-topic", default="", help="topic of every KV event message (vLLM's default: empty)")
    p.add_argument("--log-level", default="INFO")
