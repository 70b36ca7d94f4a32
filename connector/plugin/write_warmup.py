"""Warm a new push pair's WRITE path before its first request: prefill WRITEs its null block into decode's.

Loading a decode's NIXL agent and connecting to it (`prewarm`) still leaves work for the pair's first
WRITE: the transport sets up the lanes and remote keys for each memory region on first use. On this 2-core
machine that made a fresh pair's first handoff 10-20 ms slower than a warm one (bench/cold_pair.py). So right
after loading a decode, a push prefill issues one WRITE that touches every KV region, the way a real request
does, but carries nothing:

- source and destination are block 0 of every region. Block 0 is vLLM's null block: the block pool takes it
  before any request can, never hands it to a request and never caches a prefix in it, so no request's KV is
  read or overwritten. The source is prefill's own null block, so decode's null block keeps the kind of
  content it started with;
- descriptor ids come from vLLM's own `_compute_desc_ids`, the function its push worker uses for a request,
  on the null block's kernel ids (through `vllm_shim`, like every use of vLLM's internals);
- no notification: decode's connector never learns of it.

Only the plain layout is warmed: equal TP sizes, equal block sizes, no SSM state and no per-layer group
routing. Any other layout skips the warm-up (the first request pays the set-up, as without the plugin) rather
than risk a descriptor that points at live KV.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from .vllm_shim import WorkerShim

NULL_BLOCK_ID = 0
"""vLLM's BlockPool takes block 0 as its null block before any request is allocated (`BlockPool.null_block`)."""


@dataclass(frozen=True)
class WriteWarmup:
    """What one warm-up WRITE did, for the log and the tests."""

    engine_id: str
    ranks: tuple[int, ...]
    remote_desc_ids: tuple[int, ...]
    local_desc_ids: tuple[int, ...]
    seconds: float


class SkipWarmup(Exception):
    """The pair's layout is not one this warm-up can address without risk; nothing was written."""


def null_block_desc_ids(shim: WorkerShim, engine_id: str) -> tuple[list[int], list[int]]:
    """Descriptor ids of the null block in every KV region: (decode's, prefill's). Pure given the worker's
    registered layout; raises SkipWarmup for a layout other than the plain one."""
    layout = shim.pair_layout(engine_id)
    if layout.tp_ratio != 1:
        raise SkipWarmup(f"TP sizes differ (remote {layout.remote_tp_size})")
    if layout.block_size_ratio != 1:
        raise SkipWarmup(f"block sizes differ (remote {layout.remote_block_size})")
    if layout.has_ssm_state or layout.per_layer_group_routing:
        raise SkipWarmup("SSM state or per-layer group routing")
    remote, local = shim.block_desc_ids(engine_id, NULL_BLOCK_ID)
    if len(remote) != len(local):
        raise SkipWarmup(f"{len(local)} local vs {len(remote)} remote descriptors")
    return remote, local


def warm_write_path(shim: WorkerShim, engine_id: str, timeout: float = 5.0) -> WriteWarmup:
    """WRITE prefill's null block into decode `engine_id`'s null block on every decode rank this worker writes
    to, and wait for the transfers to finish. Runs on vLLM's handshake thread, after the decode's agent loaded."""
    remote, local = null_block_desc_ids(shim, engine_id)
    t0 = time.perf_counter()
    ranks = shim.write(engine_id, local, remote, timeout)
    return WriteWarmup(engine_id, ranks, tuple(remote), tuple(local), time.perf_counter() - t0)
