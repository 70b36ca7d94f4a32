"""The router's index of the KV blocks each engine holds, built only from the engine's KV events
(connector/wire/kv_events.py). Pure: no sockets, no clocks; kv_events_client.py feeds it.

Keys. A block is keyed on the token ids of the whole prefix it ends, never on the engine's block hash (vLLM seeds
those per engine): `key(block) = blake2b-128(key(parent) + token ids of block)`, from a root per block size. A
`BlockStored` names its first block's parent by the engine's hash, so the index keeps the engine's hashes next to
its own keys (`by_hash` and `blocks` are inverse maps) to chain a stored run onto what it holds and to drop what
`BlockRemoved` names. A prompt's keys come the same way from its token ids (`PromptKeys`), lazily and once per
block size: matching it costs one dict lookup per matched block plus one, and engines of a block size share them.

Order. Batches apply in sequence order (`apply`): the expected seq applies; an older one is a duplicate and is
ignored; a later one is a gap and is not applied: the caller fills it from the replay or `reset`s the engine. A new
engine expects seq 0 (vLLM counts from 0 at each start, so a late subscriber sees a gap it can ask a replay for);
after `reset`, the next batch applied sets the order again.

What it never claims. Every block the index holds for an engine was stored by that engine's events and neither
removed nor cleared since, in the order applied. So after a reset and any contiguous run of batches it holds a
subset of the engine's cache: a prediction errs by missing blocks, never by inventing them (up to collisions of
128-bit keys). Blocks it cannot key exactly are skipped (`blocks_skipped`), and with them their descendants, whose
parent it then does not hold:
- a run whose parent hash it does not hold (stored before a reset or a gap, or dropped at the bound);
- LoRA blocks, and blocks with extra keys (multimodal inputs, cache salts): the same token ids alone would not hit;
- blocks of another medium (offloaded copies), of a KV cache group but the first, or of a kind but full attention;
- a run whose token ids are not `block_size` per block, or whose block size is not the engine's.

Bounds. At most `max_engines` engines: `add_engine` refuses more (`engines_refused`); and at most
`max_blocks_per_engine` blocks per engine. Set that at or above an engine's KV capacity in blocks (vLLM's
num_gpu_blocks) and the engine always evicts first. Past it (removals were missed, or the engine is larger), storing
a block first drops the engine's least recently stored one (`blocks_evicted`), which can only shorten predictions.
A held block costs at most `BYTES_PER_BLOCK` (190 to 250 measured; tests/unit/test_kv_index.py holds the bound),
so the index stays under max_engines * max_blocks_per_engine * BYTES_PER_BLOCK: 32 engines of 16,384 blocks, 150
MiB, by default (`index_bound_bytes`); a router sizes both to its fleet (its --kv-index-* flags).
"""
from __future__ import annotations

import enum
import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..wire import kv_events as wire

DEFAULT_MAX_ENGINES = 32
"""Twice the 16 engines (8 prefill, 8 decode) of the emulated fleet issue 36 benchmarks: a rollout's surge adds new
engine ids before the old ones leave."""
DEFAULT_MAX_BLOCKS_PER_ENGINE = 16_384
"""2M tokens in the operator's blocks of 128 (spec.engine.blockSize): above the KV capacity of Qwen3-32B at TP4 on
a p5en.48xlarge (12,457 blocks; connector/emulator/profiles.py). Engines of smaller blocks or a larger cache evict
in the index first, which only shortens its predictions."""
BYTES_PER_BLOCK = 300
"""An upper bound of the memory one held block costs (its key, the engine's 64-bit hash, two dict entries). A
block's tokens are not kept, so the cost does not depend on the block size."""
KEY_BYTES = 16
_TOKEN = "I"  # 4-byte unsigned: every vocabulary's ids fit
assert array(_TOKEN).itemsize == 4
BlockKey = bytes


class Outcome(enum.Enum):
    APPLIED = "applied"
    DUPLICATE = "duplicate"
    """Older than the expected seq: already applied (a replay overlapping the live stream)."""
    GAP = "gap"
    """Later than the expected seq: batches are missing; nothing was applied."""
    UNKNOWN_ENGINE = "unknown_engine"


@dataclass
class Counters:
    """Cumulative over the index's life, engines removed included: what the router's metrics export."""

    batches_applied: int = 0
    events_applied: int = 0
    duplicates: int = 0
    gaps: int = 0
    resets: int = 0
    clears: int = 0
    """AllBlocksCleared events applied."""
    blocks_stored: int = 0
    blocks_removed: int = 0
    blocks_skipped: int = 0
    blocks_evicted: int = 0
    engines_refused: int = 0


def _root(block_size: int) -> BlockKey:
    return hashlib.blake2b(b"disagg-kv-index/%d" % block_size, digest_size=KEY_BYTES).digest()


def _chain(parent: BlockKey, block: bytes | memoryview) -> BlockKey:
    h = hashlib.blake2b(parent, digest_size=KEY_BYTES)
    h.update(block)
    return h.digest()


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    try:
        return array(_TOKEN, token_ids).tobytes()
    except (OverflowError, TypeError) as e:
        raise ValueError("token ids are integers from 0 to 2**32 - 1") from e


class PromptKeys:
    """A prompt's block keys, computed on demand per block size and kept, so that every engine matched against the
    prompt shares them. Only full blocks have a key. ValueError for a token id outside 0 <= id < 2**32."""

    def __init__(self, token_ids: Sequence[int]) -> None:
        self.num_tokens = len(token_ids)
        self._bytes = memoryview(_token_bytes(token_ids))
        self._keys: dict[int, list[BlockKey]] = {}

    def key(self, block_size: int, i: int) -> BlockKey | None:
        """The key of block `i` (from 0) in blocks of `block_size`; None past the last full block."""
        if i >= self.num_tokens // block_size:
            return None
        keys = self._keys.setdefault(block_size, [])
        width = block_size * 4
        while len(keys) <= i:
            n = len(keys)
            keys.append(_chain(keys[-1] if keys else _root(block_size), self._bytes[n * width:(n + 1) * width]))
        return keys[i]


@dataclass
class _Engine:
    expected: int | None = 0
    """The seq that applies next; None after a reset: whatever comes next."""
    block_size: int | None = None
    """Learned from the first BlockStored indexed; None until then, and after a reset."""
    blocks: OrderedDict[BlockKey, wire.ExternalBlockHash] = field(default_factory=OrderedDict)
    """Least recently stored first."""
    by_hash: dict[wire.ExternalBlockHash, BlockKey] = field(default_factory=dict)


def _indexable_stored(event: wire.BlockStored) -> bool:
    return (event.medium in (None, wire.MEDIUM_GPU) and event.group_idx in (None, 0)
            and event.kv_cache_spec_kind in (None, wire.SPEC_KIND) and event.lora_id is None
            and event.lora_name is None and not any(k is not None for k in event.extra_keys or ()))


class KvIndex:
    """Per engine id, the blocks its KV events say it holds (see the module docstring for keys, order, invariants
    and bounds)."""

    def __init__(self, *, max_engines: int = DEFAULT_MAX_ENGINES,
                 max_blocks_per_engine: int = DEFAULT_MAX_BLOCKS_PER_ENGINE) -> None:
        if max_engines < 1 or max_blocks_per_engine < 1:
            raise ValueError("an index holds at least one engine of at least one block")
        self.max_engines, self.max_blocks_per_engine = max_engines, max_blocks_per_engine
        self.counters = Counters()
        self._engines: dict[str, _Engine] = {}

    # -- engines ----------------------------------------------------------------------------------------------
    def add_engine(self, engine_id: str) -> bool:
        """Start indexing an engine (expecting seq 0); True if it is indexed now, False if refused at the bound."""
        if engine_id in self._engines:
            return True
        if len(self._engines) >= self.max_engines:
            self.counters.engines_refused += 1
            return False
        self._engines[engine_id] = _Engine()
        return True

    def remove_engine(self, engine_id: str) -> None:
        """Forget an engine (withdrawn): its blocks are freed at once."""
        self._engines.pop(engine_id, None)

    def reset(self, engine_id: str, *, expect: int | None = None) -> None:
        """Forget what an engine holds (a restart, or a gap nothing can fill); the next batch applied is `expect`,
        or any when None."""
        e = self._engines.get(engine_id)
        if e is None:
            return
        self._engines[engine_id] = _Engine(expected=expect)
        self.counters.resets += 1

    @property
    def index_bound_bytes(self) -> int:
        """What the index's blocks may cost at most (the module docstring's bound)."""
        return self.max_engines * self.max_blocks_per_engine * BYTES_PER_BLOCK

    def __contains__(self, engine_id: object) -> bool:
        return engine_id in self._engines

    def engines(self) -> list[str]:
        return list(self._engines)

    def expected_seq(self, engine_id: str) -> int | None:
        """The seq that applies next (None: any); KeyError for an engine not indexed."""
        return self._engines[engine_id].expected

    def blocks_held(self, engine_id: str | None = None) -> int:
        """Blocks held for one engine (0 if not indexed), or for all when None."""
        if engine_id is None:
            return sum(len(e.blocks) for e in self._engines.values())
        e = self._engines.get(engine_id)
        return 0 if e is None else len(e.blocks)

    # -- events -----------------------------------------------------------------------------------------------
    def apply(self, engine_id: str, seq: int, batch: wire.KVEventBatch) -> Outcome:
        """Apply one batch if `seq` is the one expected (see the module docstring); nothing changes otherwise but
        the counters."""
        e = self._engines.get(engine_id)
        if e is None:
            return Outcome.UNKNOWN_ENGINE
        if e.expected is not None and seq < e.expected:
            self.counters.duplicates += 1
            return Outcome.DUPLICATE
        if e.expected is not None and seq > e.expected:
            self.counters.gaps += 1
            return Outcome.GAP
        for event in batch.events:
            if isinstance(event, wire.BlockStored):
                self._stored(e, event)
            elif isinstance(event, wire.BlockRemoved):
                if event.medium in (None, wire.MEDIUM_GPU) and event.group_idx in (None, 0):
                    for h in event.block_hashes:
                        self._drop_hash(e, h)
            else:
                e.blocks.clear()
                e.by_hash.clear()
                self.counters.clears += 1
        e.expected = seq + 1
        self.counters.batches_applied += 1
        self.counters.events_applied += len(batch.events)
        return Outcome.APPLIED

    def _stored(self, e: _Engine, event: wire.BlockStored) -> None:
        n, size = len(event.block_hashes), event.block_size
        if e.block_size is None and size > 0:
            e.block_size = size
        if n == 0:
            return
        parent = _root(size) if event.parent_block_hash is None else e.by_hash.get(event.parent_block_hash)
        if (parent is None or size < 1 or size != e.block_size or len(event.token_ids) != n * size
                or not _indexable_stored(event)):
            self.counters.blocks_skipped += n
            return
        try:
            tokens = memoryview(_token_bytes(event.token_ids))
        except ValueError:
            self.counters.blocks_skipped += n
            return
        width = size * 4
        for i, h in enumerate(event.block_hashes):
            parent = _chain(parent, tokens[i * width:(i + 1) * width])
            self._hold(e, h, parent)
        self.counters.blocks_stored += n

    def _hold(self, e: _Engine, h: wire.ExternalBlockHash, key: BlockKey) -> None:
        """Hold `key` under the engine's hash `h`, keeping `blocks` and `by_hash` inverse maps: a key held under
        another hash moves to `h` (the same tokens twice: only with extra keys this index skips), a hash that
        named another key leaves it."""
        old_key = e.by_hash.get(h)
        if old_key is not None and old_key != key:
            del e.blocks[old_key]
        old_hash = e.blocks.get(key)
        if old_hash is not None:
            if old_hash != h:
                del e.by_hash[old_hash]
            e.blocks.move_to_end(key)
        elif len(e.blocks) >= self.max_blocks_per_engine:
            _, evicted = e.blocks.popitem(last=False)
            del e.by_hash[evicted]
            self.counters.blocks_evicted += 1
        e.blocks[key] = h
        e.by_hash[h] = key

    def _drop_hash(self, e: _Engine, h: wire.ExternalBlockHash) -> None:
        key = e.by_hash.pop(h, None)
        if key is not None:
            del e.blocks[key]
            self.counters.blocks_removed += 1

    # -- queries ----------------------------------------------------------------------------------------------
    def matched_tokens(self, engine_id: str, prompt: Sequence[int] | PromptKeys) -> int:
        """Tokens of the longest prefix of the prompt that the engine holds, contiguous from its first token, in
        whole blocks (a partial last block never counts). 0 for an engine not indexed or that stored nothing yet.
        vLLM itself computes at least a prompt's last token, so its own hit on a fully held prompt is a block less
        when the prompt ends on a block boundary: the caller decides which of the two it compares."""
        e = self._engines.get(engine_id)
        if e is None or e.block_size is None or not e.blocks:
            return 0
        keys = prompt if isinstance(prompt, PromptKeys) else PromptKeys(prompt)
        n = 0
        while (key := keys.key(e.block_size, n)) is not None and key in e.blocks:
            n += 1
        return n * e.block_size
