"""vLLM's KV event wire format (vllm/distributed/kv_events.py, vLLM 0.32), as msgspec structs, and the
conversion from the prefix cache's events. Pure.

A batch is a msgpack array `[ts, [event, ...], data_parallel_rank]`; each event a msgpack map tagged with its
class name (`{"type": "BlockStored", ...}`), block hashes as 64-bit integers (what a real engine here publishes).
Field names, order, defaults and the struct options below are vLLM's: tests/emulator/test_wire_format.py decodes
what this module encodes with vLLM's own classes, and re-encodes a real engine's recorded frames byte for byte.
"""
from __future__ import annotations

import time
from typing import Any

import msgspec

from . import prefix_cache as pc

MEDIUM = "GPU"
"""vLLM's medium for the KV cache of the engine itself (its CPU build says GPU too)."""
SPEC_KIND = "full_attention"
"""The KV cache group's kind, which vLLM 0.32 puts on every BlockStored."""


def external_hash(h: pc.BlockHash) -> int:
    """A block hash as vLLM 0.32 publishes it: the low 64 bits of its digest, as an integer."""
    return int.from_bytes(h, "big") & ((1 << 64) - 1)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


_ENCODER = msgspec.msgpack.Encoder()


def to_wire(event: pc.Event) -> BlockStored | BlockRemoved | AllBlocksCleared:
    if isinstance(event, pc.Stored):
        return BlockStored(block_hashes=[external_hash(h) for h in event.hashes],
                           parent_block_hash=None if event.parent is None else external_hash(event.parent),
                           token_ids=list(event.token_ids), block_size=event.block_size, lora_id=None, medium=MEDIUM,
                           lora_name=None, extra_keys=[None] * len(event.hashes), group_idx=0,
                           kv_cache_spec_kind=SPEC_KIND)
    if isinstance(event, pc.Removed):
        return BlockRemoved(block_hashes=[external_hash(h) for h in event.hashes], medium=MEDIUM, group_idx=0)
    return AllBlocksCleared()


def encode_batch(events: list[pc.Event], ts: float | None = None, data_parallel_rank: int = 0) -> bytes:
    """One step's events as the msgpack payload vLLM publishes."""
    batch = KVEventBatch(ts=time.time() if ts is None else ts, events=[to_wire(e) for e in events],
                         data_parallel_rank=data_parallel_rank)
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A payload back into structs (msgspec.ValidationError or DecodeError when it is not one)."""
    return msgspec.msgpack.decode(payload, type=KVEventBatch)
