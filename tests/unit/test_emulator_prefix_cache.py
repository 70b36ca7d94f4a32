"""The engine emulator's prefix cache (connector/emulator/prefix_cache.py): tables of what a hit, an eviction and a
release do, and properties over random request sequences: blocks are conserved, the hash map is consistent, and an
index fed only with the published events knows exactly what the cache holds."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from disagg.connector.emulator import prefix_cache as pc

BS = 4


def prompt(*blocks: int, tail: int = 0) -> list[int]:
    """Full blocks of one repeated token each (so prompts share exactly the blocks they name), then `tail` more."""
    return [t for b in blocks for t in [b] * BS] + [99] * tail


def admit(cache: pc.PrefixCache, tokens: list[int]) -> tuple[list[int], int, list[pc.Event]]:
    """What the engine does for a new request that computes its whole prompt: take its hit, allocate the rest, store
    its full blocks. Returns its blocks, its hit in blocks and the events."""
    hashes = pc.chain_hashes(tokens, BS)
    hit = cache.longest_hit(hashes, len(tokens) - 1)
    blocks = cache.touch(hashes[:hit])
    new, events = cache.allocate(-(-len(tokens) // BS) - hit)
    blocks += new
    full = len(tokens) // BS
    events += cache.store(blocks[hit:full], hashes[hit:full], hashes[hit - 1] if hit else None,
                          tokens[hit * BS:full * BS])
    return blocks, hit, events


def test_hashes_chain_so_equal_prefixes_share_them():
    a, b = pc.chain_hashes(prompt(1, 2, 3), BS), pc.chain_hashes(prompt(1, 2, 4), BS)
    assert a[:2] == b[:2] and a[2] != b[2]
    assert pc.chain_hashes(prompt(2, 2), BS)[1] != pc.chain_hashes(prompt(1, 2), BS)[1]  # a block's hash has its past
    assert pc.chain_hashes(prompt(1, tail=3), BS) == pc.chain_hashes(prompt(1), BS)  # a partial block has no hash


def test_a_repeated_prompt_hits_its_full_blocks_but_never_its_last_token():
    cache = pc.PrefixCache(8, BS)
    blocks, hit, events = admit(cache, prompt(1, 2, tail=1))
    assert hit == 0 and [type(e) for e in events] == [pc.Stored]
    stored = events[0]
    assert isinstance(stored, pc.Stored) and stored.parent is None and len(stored.hashes) == 2
    assert stored.token_ids == tuple(prompt(1, 2))
    cache.release(blocks)
    assert admit(cache, prompt(1, 2, tail=1))[1] == 2
    # Exactly two full blocks: vLLM computes the last token again, so only the first block is a hit.
    hashes = pc.chain_hashes(prompt(1, 2), BS)
    assert cache.longest_hit(hashes, len(prompt(1, 2)) - 1) == 1


def test_eviction_takes_the_longest_released_blocks_and_the_tail_of_a_request_first():
    cache = pc.PrefixCache(4, BS)
    a, _, _ = admit(cache, prompt(1, 2))
    cache.release(a)  # released tail first: block of 2 is evicted before block of 1
    b, _, _ = admit(cache, prompt(5, 6))
    cache.release(b)
    _, events = cache.allocate(3)
    removed = [h for e in events if isinstance(e, pc.Removed) for h in e.hashes]
    h12, h56 = pc.chain_hashes(prompt(1, 2), BS), pc.chain_hashes(prompt(5, 6), BS)
    assert removed == [h12[1], h12[0], h56[1]]
    assert cache.longest_hit(h56, 8) == 1  # the block of 5 survived


def test_a_held_hit_is_not_free_and_an_unheld_one_costs_a_free_block():
    cache = pc.PrefixCache(4, BS)
    a, _, _ = admit(cache, prompt(1, 2))
    hashes = pc.chain_hashes(prompt(1, 2), BS)
    assert cache.num_free == 2 and cache.free_blocks_among(hashes) == 0
    cache.release(a)
    assert cache.num_free == 4 and cache.free_blocks_among(hashes) == 2
    assert cache.usage() == 0.0


def test_storing_a_block_someone_else_cached_meanwhile_keeps_the_first_and_splits_the_event():
    cache = pc.PrefixCache(8, BS)
    tokens = prompt(1, 2, 3)
    hashes = pc.chain_hashes(tokens, BS)
    mine, _ = cache.allocate(3)
    other, _ = cache.allocate(1)
    assert cache.store(other, hashes[1:2], hashes[0], tokens[BS:2 * BS])  # block 2 cached elsewhere first
    events = cache.store(mine, hashes, None, tokens)
    assert [(e.hashes, e.parent) for e in events if isinstance(e, pc.Stored)] == \
        [((hashes[0],), None), ((hashes[2],), hashes[1])]
    assert cache.cached[hashes[1]] == other[0]


def test_misuse_is_refused():
    cache = pc.PrefixCache(2, BS)
    with pytest.raises(ValueError, match="allocating 3 blocks with 2 free"):
        cache.allocate(3)
    held, _ = cache.allocate(1)
    with pytest.raises(ValueError, match="while blocks are held"):
        cache.clear()
    cache.release(held)
    with pytest.raises(ValueError, match="released more often"):
        cache.release(held)
    assert cache.clear() == [pc.Cleared()]
    with pytest.raises(ValueError):
        pc.PrefixCache(0, BS)


class Index:
    """What a KV-aware router builds from the events alone."""

    def __init__(self) -> None:
        self.hashes: set[bytes] = set()

    def apply(self, events: list[pc.Event]) -> None:
        for e in events:
            if isinstance(e, pc.Stored):
                assert not (set(e.hashes) & self.hashes), "a block stored twice without its removal"
                assert e.parent is None or e.parent in self.hashes, "a stored run whose parent is unknown"
                assert len(e.token_ids) == len(e.hashes) * e.block_size
                self.hashes |= set(e.hashes)
            elif isinstance(e, pc.Removed):
                assert set(e.hashes) <= self.hashes, "a removal of a block never stored"
                self.hashes -= set(e.hashes)
            else:
                self.hashes.clear()


ops = st.lists(st.tuples(st.sampled_from(["admit", "release", "clear"]),
                         st.lists(st.integers(0, 3), min_size=0, max_size=4), st.integers(0, BS - 1)),
               max_size=40)


@given(ops, st.integers(3, 12))
def test_blocks_are_conserved_and_events_tell_exactly_what_is_cached(sequence, num_blocks):
    cache = pc.PrefixCache(num_blocks, BS)
    index = Index()
    live: list[list[int]] = []
    for op, blocks, tail in sequence:
        tokens = prompt(*blocks, tail=tail) or [7]
        if op == "admit" and -(-len(tokens) // BS) <= cache.num_free:
            got, hit, events = admit(cache, tokens)
            assert hit <= (len(tokens) - 1) // BS
            index.apply(events)
            live.append(got)
        elif op == "release" and live:
            cache.release(live.pop(0))
        elif op == "clear" and not live:
            index.apply(cache.clear())
        held = {b for b in range(num_blocks) if cache.refs[b] > 0}
        assert held.isdisjoint(cache.free) and len(held) + len(cache.free) == num_blocks
        assert sum(cache.refs) == sum(len(b) for b in live)
        assert all(cache.hash_of[b] == h for h, b in cache.cached.items())
        assert index.hashes == set(cache.cached)
