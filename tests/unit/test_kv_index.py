"""The router's KV index (connector/router/kv_index.py): tables of what stored, removed and cleared blocks do to a
prompt's match, the sequence order (gaps, duplicates, resets), the bounds, keys made of token ids alone, and a
property: fed the emulated prefix cache's events through the wire, it predicts exactly the cache's hits."""
from __future__ import annotations

import random
import tracemalloc

import pytest
from hypothesis import given
from hypothesis import strategies as st

from disagg.connector.emulator import kv_event_wire
from disagg.connector.emulator import prefix_cache as pc
from disagg.connector.router.kv_index import BYTES_PER_BLOCK, KvIndex, Outcome, PromptKeys
from disagg.connector.wire import kv_events as wire

BS = 4


def block(b: int) -> list[int]:
    """The tokens of block `b`: distinct per block, so prompts share exactly the blocks they name."""
    return [b * 10 + i for i in range(BS)]


def prompt(*blocks: int, tail: int = 0) -> list[int]:
    return [t for b in blocks for t in block(b)] + [9999] * tail


def stored(hashes: list[int], blocks: list[int], parent: int | None = None, **fields: object) -> wire.BlockStored:
    kw: dict[str, object] = {"lora_id": None, "medium": wire.MEDIUM_GPU, "lora_name": None, **fields}
    return wire.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=prompt(*blocks),
                            block_size=BS, **kw)


def removed(*hashes: int, medium: str = wire.MEDIUM_GPU) -> wire.BlockRemoved:
    return wire.BlockRemoved(block_hashes=list(hashes), medium=medium)


def batch(*events: wire.BlockStored | wire.BlockRemoved | wire.AllBlocksCleared) -> wire.KVEventBatch:
    return wire.KVEventBatch(ts=0.0, events=list(events))


def fed(*batches: wire.KVEventBatch, **bounds: int) -> KvIndex:
    """An index of engine "e" after applying `batches` as seqs 0, 1, ..."""
    index = KvIndex(**bounds)
    assert index.add_engine("e")
    for seq, b in enumerate(batches):
        assert index.apply("e", seq, b) is Outcome.APPLIED
    return index


# A chain 1-2-3 stored in two steps, the second naming the first's last block as its parent.
CHAIN = (batch(stored([101, 102], [1, 2])), batch(stored([103], [3], parent=102)))


@pytest.mark.parametrize(("after", "query", "matched"), [
    ((), prompt(1, 2, 3), 3 * BS),
    ((), prompt(1, 2, 3, 4, tail=2), 3 * BS),             # only what is held, from the first token
    ((), prompt(1, 2, 3, tail=BS - 1), 3 * BS),           # a partial block never counts
    ((), prompt(1, 2) + block(3)[:-1], 2 * BS),
    ((), prompt(1, 5, 3), BS),                            # the same block after another prefix is another block
    ((), prompt(2, 3), 0),
    ((), prompt(), 0),
    ((batch(removed(102)),), prompt(1, 2, 3), BS),        # a removal in the middle cuts the prefix there
    ((batch(removed(101)),), prompt(1, 2, 3), 0),
    ((batch(removed(103, medium="CPU")),), prompt(1, 2, 3), 3 * BS),  # an offloaded copy's removal is not ours
    ((batch(removed(999)),), prompt(1, 2, 3), 3 * BS),   # a hash never indexed
    ((batch(wire.AllBlocksCleared()),), prompt(1, 2, 3), 0),
    ((batch(wire.AllBlocksCleared(), stored([201], [1])),), prompt(1, 2, 3), BS),
    ((batch(removed(103), stored([203], [3], parent=102)),), prompt(1, 2, 3), 3 * BS),  # stored again
])
def test_a_prompt_matches_the_longest_contiguous_held_prefix_in_whole_blocks(after, query, matched):
    assert fed(*CHAIN, *after).matched_tokens("e", query) == matched


@pytest.mark.parametrize("fields", [
    {"lora_id": 3}, {"lora_name": "adapter"}, {"extra_keys": [("image-hash",)]}, {"medium": "CPU"},
    {"group_idx": 1}, {"kv_cache_spec_kind": "sliding_window"},
])
def test_blocks_the_token_ids_alone_do_not_describe_are_skipped_with_their_descendants(fields):
    index = fed(batch(stored([101], [1], **fields)), batch(stored([102], [2], parent=101)))
    assert index.matched_tokens("e", prompt(1, 2)) == 0
    assert index.blocks_held("e") == 0 and index.counters.blocks_skipped == 2


def test_malformed_and_orphaned_runs_are_skipped():
    index = fed(batch(stored([101], [1]), stored([102], [2], parent=777),  # a parent it never held
                      wire.BlockStored(block_hashes=[103, 104], parent_block_hash=None, token_ids=prompt(1),
                                       block_size=BS, lora_id=None, medium=None, lora_name=None),  # half the tokens
                      wire.BlockStored(block_hashes=[105], parent_block_hash=None, token_ids=list(range(8)),
                                       block_size=8, lora_id=None, medium=None, lora_name=None)))  # another size
    assert index.blocks_held("e") == 1 and index.counters.blocks_skipped == 4
    assert index.matched_tokens("e", prompt(1, 2)) == BS


def test_keys_are_the_token_ids_so_each_engines_own_hashes_do_not_matter():
    index = KvIndex()
    rng = random.Random(7)
    for engine in ("a", "b"):
        assert index.add_engine(engine)
        h = [rng.getrandbits(64) for _ in range(3)]  # each engine seeds its own hashes
        index.apply(engine, 0, batch(stored(h[:2], [1, 2]), stored(h[2:], [3], parent=h[1])))
    assert index.add_engine("c")
    index.apply("c", 0, batch(stored([1, 2, 3], [4, 5, 6])))  # hash values a, b or nobody else used: other tokens
    keys = PromptKeys(prompt(1, 2, 3))
    assert [index.matched_tokens(e, keys) for e in ("a", "b", "c", "unknown")] == [3 * BS, 3 * BS, 0, 0]
    assert index.matched_tokens("c", prompt(4, 5)) == 2 * BS


def test_batches_apply_in_sequence_order_and_a_gap_applies_nothing():
    index = KvIndex()
    index.add_engine("e")
    one, two, three = (batch(stored([100 + b], [b])) for b in (1, 2, 3))
    assert index.apply("e", 1, one) is Outcome.GAP  # a new engine expects seq 0: a late subscriber sees a gap
    assert index.apply("e", 0, one) is Outcome.APPLIED
    assert index.apply("e", 2, three) is Outcome.GAP
    assert index.matched_tokens("e", prompt(3)) == 0 and index.expected_seq("e") == 1
    assert index.apply("e", 1, two) is Outcome.APPLIED
    assert index.apply("e", 1, two) is Outcome.DUPLICATE
    assert index.apply("e", 0, one) is Outcome.DUPLICATE
    assert index.apply("e", 2, three) is Outcome.APPLIED
    assert index.apply("x", 0, one) is Outcome.UNKNOWN_ENGINE
    c = index.counters
    assert (c.gaps, c.duplicates, c.batches_applied, c.events_applied, c.blocks_stored) == (2, 2, 3, 3, 3)
    assert [index.matched_tokens("e", prompt(b)) for b in (1, 2, 3)] == [BS, BS, BS]


def test_reset_forgets_the_engine_and_takes_the_next_batch_as_the_order():
    index = fed(*CHAIN)
    index.reset("e")
    assert index.blocks_held("e") == 0 and index.expected_seq("e") is None and index.counters.resets == 1
    assert index.matched_tokens("e", prompt(1, 2, 3)) == 0
    assert index.apply("e", 40, batch(stored([103], [3], parent=102))) is Outcome.APPLIED  # its parent went too
    assert index.blocks_held("e") == 0 and index.counters.blocks_skipped == 1
    assert index.apply("e", 41, CHAIN[0]) is Outcome.APPLIED and index.apply("e", 43, CHAIN[1]) is Outcome.GAP
    index.reset("e", expect=0)  # a restarted engine counts from 0 again
    assert index.apply("e", 0, CHAIN[0]) is Outcome.APPLIED and index.matched_tokens("e", prompt(1, 2)) == 2 * BS
    index.remove_engine("e")
    assert "e" not in index and index.blocks_held() == 0 and index.matched_tokens("e", prompt(1)) == 0


def test_the_bounds_refuse_engines_and_drop_the_least_recently_stored_blocks():
    index = fed(batch(stored([101, 102, 103], [1, 2, 3])), batch(stored([201], [5])),
                max_blocks_per_engine=3, max_engines=2)
    assert index.blocks_held("e") == 3 and index.counters.blocks_evicted == 1
    assert index.matched_tokens("e", prompt(1, 2, 3)) == 0  # block 1 went first: the chain matches nothing
    assert index.matched_tokens("e", prompt(5)) == BS
    index.apply("e", 2, batch(stored([301], [2], parent=101)))  # its parent is gone: skipped, nothing evicted
    assert index.counters.blocks_evicted == 1
    # Blocks stored again (under new hashes) are the most recent: the next block stored drops block 2.
    index.apply("e", 3, batch(stored([203], [3], parent=102), stored([202], [5]), stored([401], [6])))
    assert index.blocks_held("e") == 3 and index.counters.blocks_evicted == 2
    assert index.matched_tokens("e", prompt(5)) == BS and index.matched_tokens("e", prompt(6)) == BS
    index.apply("e", 4, batch(removed(201)))  # the old hash of block 5 no longer names it
    assert index.matched_tokens("e", prompt(5)) == BS
    index.apply("e", 5, batch(removed(202)))
    assert index.matched_tokens("e", prompt(5)) == 0 and index.blocks_held("e") == 2
    assert index.add_engine("f") and not index.add_engine("g") and index.add_engine("f")
    assert index.counters.engines_refused == 1 and index.engines() == ["e", "f"]
    with pytest.raises(ValueError):
        KvIndex(max_blocks_per_engine=0)


def test_a_held_block_costs_less_than_the_stated_bytes():
    n = 20_000
    rng = random.Random(1)
    batches = [batch(stored([rng.getrandbits(64) for _ in range(100)],
                            [rng.randrange(400_000_000) for _ in range(100)])) for _ in range(n // 100)]
    index = KvIndex(max_blocks_per_engine=n)
    index.add_engine("e")
    tracemalloc.start()
    try:
        for seq, b in enumerate(batches):
            index.apply("e", seq, b)
        used = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert index.blocks_held("e") == n
    assert used / n < BYTES_PER_BLOCK


def test_prompt_keys_refuse_token_ids_that_are_not_32_bit():
    for bad in ([-1], [2**32], ["a"]):
        with pytest.raises(ValueError):
            PromptKeys(bad)


# -- against the emulated engine's prefix cache ---------------------------------------------------------------------
def admit(cache: pc.PrefixCache, tokens: list[int]) -> tuple[list[int], list[pc.Event]]:
    """A new request computing its whole prompt, as the emulated engine runs it: its blocks and the events."""
    hashes = pc.chain_hashes(tokens, BS)
    hit = cache.longest_hit(hashes, len(tokens) - 1)
    blocks = cache.touch(hashes[:hit])
    new, events = cache.allocate(-(-len(tokens) // BS) - hit)
    blocks += new
    full = len(tokens) // BS
    events += cache.store(blocks[hit:full], hashes[hit:full], hashes[hit - 1] if hit else None,
                          tokens[hit * BS:full * BS])
    return blocks, events


ops = st.lists(st.tuples(st.sampled_from(["admit", "admit", "release", "clear"]),
                         st.lists(st.integers(0, 3), min_size=0, max_size=4), st.integers(0, BS - 1)),
               max_size=40)


@given(ops, st.integers(3, 12))
def test_fed_the_emulators_events_over_the_wire_it_predicts_exactly_its_hits(sequence, num_blocks):
    cache = pc.PrefixCache(num_blocks, BS)
    index = KvIndex()
    index.add_engine("emu")
    seq = 0
    live: list[list[int]] = []
    prompts = [prompt(*blocks) for _, blocks, _ in sequence]
    for op, blocks, tail in sequence:
        tokens = prompt(*blocks, tail=tail) or [7]
        events: list[pc.Event] = []
        if op == "admit" and -(-len(tokens) // BS) <= cache.num_free:
            got, events = admit(cache, tokens)
            live.append(got)
        elif op == "release" and live:
            cache.release(live.pop(0))
        elif op == "clear" and not live:
            events = cache.clear()
        if events:
            assert index.apply("emu", seq, wire.decode_batch(kv_event_wire.encode_batch(events))) is Outcome.APPLIED
            seq += 1
        for p in prompts:
            hashes = pc.chain_hashes(p, BS)
            assert index.matched_tokens("emu", p) == cache.longest_hit(hashes, len(p)) * BS
        assert index.blocks_held("emu") == len(cache.cached)
