"""The prefix cache's events as vLLM's KV event structs (connector/wire/kv_events.py, shared with the router, which
decodes what this encodes). Pure.

Block hashes are published as vLLM 0.32 publishes them: the low 64 bits of the digest, as an integer.
"""
from __future__ import annotations

import time

from ..wire import kv_events as wire
from . import prefix_cache as pc


def external_hash(h: pc.BlockHash) -> int:
    """A block hash as vLLM 0.32 publishes it: the low 64 bits of its digest, as an integer."""
    return int.from_bytes(h, "big") & ((1 << 64) - 1)


def to_wire(event: pc.Event) -> wire.BlockStored | wire.BlockRemoved | wire.AllBlocksCleared:
    if isinstance(event, pc.Stored):
        return wire.BlockStored(block_hashes=[external_hash(h) for h in event.hashes],
                                parent_block_hash=None if event.parent is None else external_hash(event.parent),
                                token_ids=list(event.token_ids), block_size=event.block_size, lora_id=None,
                                medium=wire.MEDIUM_GPU, lora_name=None, extra_keys=[None] * len(event.hashes),
                                group_idx=0, kv_cache_spec_kind=wire.SPEC_KIND)
    if isinstance(event, pc.Removed):
        return wire.BlockRemoved(block_hashes=[external_hash(h) for h in event.hashes], medium=wire.MEDIUM_GPU,
                                 group_idx=0)
    return wire.AllBlocksCleared()


def encode_batch(events: list[pc.Event], ts: float | None = None, data_parallel_rank: int = 0) -> bytes:
    """One step's events as the msgpack payload vLLM publishes."""
    return wire.encode_batch(wire.KVEventBatch(ts=time.time() if ts is None else ts,
                                               events=[to_wire(e) for e in events],
                                               data_parallel_rank=data_parallel_rank))
