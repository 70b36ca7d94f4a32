"""How an engine's NIXL handshake payloads ride in its advertisement (`kv_metadata`).

Per (pp_rank, tp_rank), the msgpack bytes vLLM's side channel would serve for GET_META, base64-encoded, so a
peer can load the engine's NIXL agent without the side-channel round trip. Opaque to the rendezvous and router.
"""
from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any, Final

FORMAT: Final = "vllm-nixl-handshake-v1"
"""`kv_metadata.format` of advertisements that carry vLLM NIXL handshake payloads."""


def encode(payloads: Mapping[tuple[int, int], bytes], compatibility_hash: str | None) -> dict[str, Any]:
    """Every (pp_rank, tp_rank)'s handshake payload as an advertisement's `kv_metadata`."""
    return {"format": FORMAT, "compatibility_hash": compatibility_hash,
            "ranks": {f"{pp},{tp}": base64.b64encode(raw).decode() for (pp, tp), raw in sorted(payloads.items())}}


def decode(kv_metadata: Any) -> dict[tuple[int, int], bytes] | None:
    """The inverse of `encode`: {(pp, tp): payload bytes}, or None for anything else."""
    if not isinstance(kv_metadata, dict) or kv_metadata.get("format") != FORMAT:
        return None
    ranks = kv_metadata.get("ranks")
    if not isinstance(ranks, dict):
        return None
    out: dict[tuple[int, int], bytes] = {}
    try:
        for key, b64 in ranks.items():
            pp, tp = (int(x) for x in key.split(","))
            out[(pp, tp)] = base64.b64decode(b64, validate=True)
    except (ValueError, TypeError, AttributeError):
        return None
    return out
