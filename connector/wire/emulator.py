"""The engine emulator's contract with the operator: which emulated engines exist and how one is started.

The operator renders `disagg emulator ...` for engine pods of a CR with `spec.engine.emulator` (the flags below),
and the CRD's enum of profiles is `PROFILES`. The emulator (connector/emulator/) holds the profiles' parameters;
a unit test holds the two lists equal. Nothing here is used by real engines.
"""
from __future__ import annotations

from typing import Final

from . import env

PROFILES: Final = ("cpu-kv64k", "qwen3-32b-tp4-p5en")
"""Emulated engines: the vLLM CPU engines of this repository's bed (the kv64k model, 1 GiB of KV), fitted to
measurements (bench/emulator_fit.py); Qwen3-32B at TP4 on a p5en.48xlarge, from published figures."""
DEFAULT_PROFILE: Final = "cpu-kv64k"

TRANSPORT: Final = "EMULATED"
"""What an emulated engine reports as its KV transport (`EngineAdvertisement.transport`) and the operator expects
of it: KV moves between emulators over the emulated side channel, never over NIXL."""
OWNER: Final = "disagg-engine-emulator"
"""`owned_by` of the emulator's model card (`/v1/models`), its `Server` header, and its metrics' `job` in logs:
where a human looks, an emulated engine says what it is."""

KV_EVENTS_PORT: Final = env.kv_events_ports(1)[0][0]
"""The emulator's ZMQ PUB socket for KV events: a one-rank engine's (env.kv_events_ports), 5557."""
KV_EVENTS_REPLAY_PORT: Final = env.kv_events_ports(1)[1][0]
"""Its ZMQ ROUTER socket for replays, 5558."""
