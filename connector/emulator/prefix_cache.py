"""The emulated KV cache: a fixed number of blocks, a prefix cache over the full ones, and LRU eviction.

Deterministic and free of I/O and clocks: every change returns the KV events it causes (`Stored`, `Removed`,
`Cleared`, shaped as vLLM's), and the caller publishes them. Modelled on vLLM's block pool (v1/core/block_pool.py):

- a full block of a prompt has a hash chained from its parent's and its own token ids (`chain_hashes`), so two
  requests that share a prefix share its blocks' hashes;
- blocks nobody holds (reference count 0) wait in a free queue, least recently released first; allocating takes
  from its head, and a cached block taken from there is evicted (`Removed`);
- a cached block that a new request hits is taken out of the free queue (or its count raised) instead;
- a request releases its blocks last block first, so its tail is evicted before its head, as vLLM does.

Invariants (tests/unit/test_emulator_prefix_cache.py):
- held + free == num_blocks, and every block is in exactly one of them;
- a cached hash maps to exactly one block, which carries that hash;
- replaying the returned events onto an index gives exactly the set of cached hashes.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

BlockHash = bytes
ROOT_HASH = hashlib.sha256(b"disagg-emulator-prefix-cache").digest()
"""The parent of a prompt's first block."""


@dataclass(frozen=True)
class Stored:
    """Blocks newly cached, in prompt order: `hashes[i]` holds `token_ids[i*block_size:(i+1)*block_size]`."""

    hashes: tuple[BlockHash, ...]
    parent: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True)
class Removed:
    hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


def chain_hashes(token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """The hash of every full block of `token_ids`, each chained from the one before (SHA-256, as vLLM's default
    `sha256_cbor` is a SHA-256 too)."""
    out: list[BlockHash] = []
    parent = ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start:start + block_size]
        parent = hashlib.sha256(parent + b"".join(t.to_bytes(4, "big") for t in block)).digest()
        out.append(parent)
    return out


class PrefixCache:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a KV cache needs at least one block of at least one token")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.refs = [0] * num_blocks
        self.hash_of: list[BlockHash | None] = [None] * num_blocks
        self.cached: dict[BlockHash, int] = {}
        # Insertion order is eviction order: the head was released longest ago.
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.queries = 0
        self.hits = 0

    # -- queries (no change) ----------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks an allocation may take now: never used, released, or cached and unheld."""
        return len(self.free)

    def usage(self) -> float:
        """vLLM's `kv_cache_usage_perc`: the share of blocks held (1.0 is full)."""
        return 1.0 - len(self.free) / self.num_blocks

    def longest_hit(self, hashes: Sequence[BlockHash], max_tokens: int) -> int:
        """Leading blocks of `hashes` that are cached, at most `max_tokens // block_size` of them (vLLM never
        serves a whole prompt from the cache: its last token is computed for the logits)."""
        n = 0
        for h in hashes[:max(0, max_tokens) // self.block_size]:
            if h not in self.cached:
                break
            n += 1
        return n

    def free_blocks_among(self, hashes: Sequence[BlockHash]) -> int:
        """How many of these cached blocks are unheld: taking them for a hit costs that many free blocks."""
        return sum(1 for h in hashes if self.refs[self.cached[h]] == 0)

    # -- changes ----------------------------------------------------------------------------------------------
    def count_query(self, tokens: int, hit_tokens: int) -> None:
        """vLLM's prefix_cache_queries / prefix_cache_hits, in tokens."""
        self.queries += tokens
        self.hits += hit_tokens

    def touch(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Hold the cached blocks of a hit (every hash must be cached); their ids, in order."""
        ids = []
        for h in hashes:
            b = self.cached[h]
            if self.refs[b] == 0:
                del self.free[b]
            self.refs[b] += 1
            ids.append(b)
        return ids

    def allocate(self, n: int) -> tuple[list[int], list[Event]]:
        """Hold `n` blocks from the head of the free queue, evicting cached ones. ValueError if fewer are free:
        the scheduler counts before it allocates."""
        if n > len(self.free):
            raise ValueError(f"allocating {n} blocks with {len(self.free)} free")
        ids, evicted = [], []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            h = self.hash_of[b]
            if h is not None:
                del self.cached[h]
                self.hash_of[b] = None
                evicted.append(h)
            self.refs[b] = 1
            ids.append(b)
        return ids, ([Removed(tuple(evicted))] if evicted else [])

    def store(self, blocks: Sequence[int], hashes: Sequence[BlockHash], parent: BlockHash | None,
              token_ids: Sequence[int]) -> list[Event]:
        """Cache held blocks that have just become full with the prompt's `hashes` (one per block, in order, the
        first one's parent `parent`). A hash already cached in another block stays there and this block stays
        uncached (two requests computed the same block at once). One `Stored` per run of newly cached blocks, each
        naming the hash before it as its parent (None for a prompt's first block), so an index can chain them."""
        events: list[Event] = []
        run: list[BlockHash] = []
        run_tokens: list[int] = []
        run_parent, before = parent, parent
        for i, (b, h) in enumerate(zip(blocks, hashes, strict=True)):
            if h in self.cached or self.hash_of[b] is not None:
                if run:
                    events.append(Stored(tuple(run), _parent(run_parent), tuple(run_tokens), self.block_size))
                    run, run_tokens = [], []
                before = h
                continue
            if not run:
                run_parent = before
            self.cached[h] = b
            self.hash_of[b] = h
            run.append(h)
            run_tokens += token_ids[i * self.block_size:(i + 1) * self.block_size]
            before = h
        if run:
            events.append(Stored(tuple(run), _parent(run_parent), tuple(run_tokens), self.block_size))
        return events

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one hold of each block; those no longer held join the free queue's tail, the last block first."""
        for b in reversed(blocks):
            if self.refs[b] <= 0:
                raise ValueError(f"block {b} released more often than held")
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free[b] = None

    def clear(self) -> list[Event]:
        """Forget every cached hash (vLLM's reset_prefix_cache): only when no block is held."""
        if len(self.free) != self.num_blocks:
            raise ValueError("cannot clear a prefix cache while blocks are held")
        self.cached.clear()
        self.hash_of = [None] * self.num_blocks
        return [Cleared()]


def _parent(h: BlockHash | None) -> BlockHash | None:
    return None if h is None or h == ROOT_HASH else h
