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
  on the null block's kernel ids;
- no notification: decode's connector never learns of it.

Only the plain layout is warmed: equal TP sizes, equal block sizes, no SSM state and no per-layer group
routing. Any other layout skips the warm-up (the first request pays the set-up, as without the plugin) rather
than risk a descriptor that points at live KV.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("disagg.plugin")

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


def null_block_desc_ids(worker: Any, engine_id: str) -> tuple[list[int], list[int]]:
    """Descriptor ids of the null block in every KV region: (decode's, prefill's). Pure given the worker's
    registered layout; raises SkipWarmup for a layout other than the plain one."""
    topo = worker.transfer_topo
    info = topo.get_engine_info(engine_id)
    if topo.tp_ratio(info.remote_tp_size) != 1:
        raise SkipWarmup(f"TP sizes differ (remote {info.remote_tp_size})")
    if topo.block_size_ratio(info.remote_block_size) != 1:
        raise SkipWarmup(f"block sizes differ (remote {info.remote_block_size})")
    if worker._has_mamba or worker._transfer_layer_group_ids:
        raise SkipWarmup("SSM state or per-layer group routing")
    groups = [[NULL_BLOCK_ID] for _ in worker._group_spec_types]
    remote = worker._compute_desc_ids(
        block_ids=worker._logical_to_kernel_block_ids(groups, info.remote_physical_blocks_per_logical),
        dst_num_blocks=worker.dst_num_blocks[engine_id],
        block_size_ratio=None,
        physical_blocks_per_logical=info.remote_physical_blocks_per_logical,
        region_num_blocks=worker.dst_region_num_blocks[engine_id],
        region_group_ids=worker.dst_region_group_ids[engine_id],
        uses_region_group_mapping=worker.dst_uses_region_group_mapping[engine_id])
    local = worker._compute_desc_ids(
        block_ids=worker._logical_to_kernel_block_ids(groups, worker._physical_blocks_per_logical_kv_block),
        dst_num_blocks=worker.dst_num_blocks[worker.engine_id],
        block_size_ratio=1,
        physical_blocks_per_logical=worker._physical_blocks_per_logical_kv_block,
        region_num_blocks=worker.dst_region_num_blocks[worker.engine_id],
        region_group_ids=worker.region_group_ids,
        uses_region_group_mapping=worker._uses_region_group_mapping)
    if len(remote) != len(local):
        raise SkipWarmup(f"{len(local)} local vs {len(remote)} remote descriptors")
    return [int(i) for i in remote], [int(i) for i in local]


def warm_write_path(worker: Any, engine_id: str, timeout: float = 5.0) -> WriteWarmup:
    """WRITE prefill's null block into decode `engine_id`'s null block on every decode rank this worker writes
    to, and wait for the transfers to finish. Runs on vLLM's handshake thread, after `add_remote_agent`."""
    remote, local = null_block_desc_ids(worker, engine_id)
    info = worker.transfer_topo.get_engine_info(engine_id)
    src = worker.src_xfer_handles_by_block_size[info.remote_block_size]
    nixl = worker.nixl_wrapper
    t0 = time.perf_counter()
    ranks = sorted(worker.dst_xfer_side_handles[engine_id])
    handles = []
    try:
        for rank in ranks:
            handle = nixl.make_prepped_xfer("WRITE", src, local, worker.dst_xfer_side_handles[engine_id][rank],
                                            remote)
            handles.append(handle)
            nixl.transfer(handle)
        deadline = time.monotonic() + timeout
        pending = list(handles)
        while pending:
            states = [nixl.check_xfer_state(h) for h in pending]
            if "ERR" in states:
                raise RuntimeError("the transport reported an error")
            pending = [h for h, s in zip(pending, states) if s != "DONE"]
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"not done within {timeout} s")
            if pending:
                time.sleep(0.0005)  # NIXL offers no blocking wait on a transfer: vLLM polls the same way
    finally:
        for h in handles:
            try:
                nixl.release_xfer_handle(h)
            except Exception as e:  # an unfinished transfer cannot be released; NIXL frees it with the agent
                log.info("disagg plugin: releasing a warm-up transfer handle failed: %s", e)
    return WriteWarmup(engine_id, tuple(ranks), tuple(remote), tuple(local), time.perf_counter() - t0)
