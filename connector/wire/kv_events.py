"""vLLM's KV cache events on the wire (vllm/distributed/kv_events.py, vLLM 0.32): the msgspec structs and the ZMQ
framing. The engine emulator encodes with them and the router decodes with them; nothing else restates them.

- PUB socket: one multipart message per engine step that changed the cache, `(topic, seq, payload)`: seq an
  8-byte big-endian counter from 0 at each start of the engine, payload a msgpack `KVEventBatch`.
- ROUTER socket (replay): a client (a DEALER) sends `(b"", start_seq)`, start_seq 8 bytes big-endian; it receives
  `(b"", topic, seq, payload)` for every batch still buffered from `start_seq` on, then `REPLAY_END`.

A batch is a msgpack array `[ts, [event, ...], data_parallel_rank]`; each event a msgpack map tagged with its
class name (`{"type": "BlockStored", ...}`), block hashes as 64-bit integers (what a real engine here publishes).
Field names, order, defaults and the struct options below are vLLM's: tests/emulator/test_wire_format.py decodes
what the emulator encodes with vLLM's own classes, and re-encodes a real engine's recorded frames byte for byte.
Decoding ignores fields a later vLLM adds; an unknown event type fails the whole batch.
"""
from __future__ import annotations

from typing import Any, Final

import msgspec

TOPIC: Final = ""
"""The topic engines here publish under: vLLM's default, which a subscription to every topic (the router's) matches."""
MEDIUM_GPU: Final = "GPU"
"""vLLM's medium for the KV cache of the engine itself (its CPU build says GPU too); offloaded copies name another."""
SPEC_KIND: Final = "full_attention"
"""The KV cache group's kind, which vLLM 0.32 puts on every BlockStored of a full-attention model."""
SEQ_BYTES: Final = 8
REPLAY_END: Final = (b"", b"", (-1).to_bytes(SEQ_BYTES, "big", signed=True), b"")
"""The replay socket's last message of an answer (after the DEALER's empty delimiter)."""

ExternalBlockHash = bytes | int
"""A block hash as the engine publishes it: seeded per engine, so only the engine's own events can name it."""


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    """Full blocks newly cached, in prompt order: `block_hashes[i]` holds
    `token_ids[i * block_size:(i + 1) * block_size]`, and the first one's parent is `parent_block_hash` (None for a
    prompt's first block)."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
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
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def vllm_config(events_port: int, replay_port: int) -> dict[str, Any]:
    """vLLM's `--kv-events-config` (vllm/config/kv_events.py) publishing on ZMQ: events on `events_port`, the replay
    on `replay_port`, both on every interface. vLLM adds a data-parallel rank's number to each port."""
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events_port}",
            "replay_endpoint": f"tcp://*:{replay_port}", "topic": TOPIC}


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack payload vLLM publishes for a batch."""
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A payload back into structs (msgspec.ValidationError or msgspec.DecodeError when it is not one)."""
    return _DECODER.decode(payload)


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big")


def decode_seq(frame: bytes) -> int:
    """A sequence frame as the publisher's counter; ValueError unless it is 8 bytes. The replay's end marker reads as
    -1."""
    if len(frame) != SEQ_BYTES:
        raise ValueError(f"a sequence number is {SEQ_BYTES} bytes, not {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)
