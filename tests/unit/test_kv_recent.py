"""Prefix-aware routing for engines whose KV events the router does not follow (connector/router/kv_recent.py, and
its use in prefix_routing.py): the prompt blocks the router sent an engine count as held for a while, within
bounds; engines the index follows are never predicted this way."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from disagg.connector.router.engine_pool import EnginePool
from disagg.connector.router.kv_index import KvIndex, PromptKeys
from disagg.connector.router.kv_recent import RecentChoices
from disagg.connector.router.kv_scoring import Weights
from disagg.connector.router.prefix_routing import PrefixRouting
from support.rendezvous import ManualClock, advert

BS = 16
PROMPT = list(range(1, 101))  # 6 full blocks of 16


def test_a_prompt_sent_to_an_engine_counts_as_held_in_whole_blocks_for_the_ttl():
    recent = RecentChoices(ttl=60)
    recent.record("e1", BS, PromptKeys(PROMPT), now=0)
    assert recent.matched_tokens("e1", BS, PromptKeys(PROMPT), now=59) == 6 * BS
    assert recent.matched_tokens("e1", BS, PromptKeys(PROMPT[:40]), now=59) == 2 * BS
    assert recent.matched_tokens("e1", BS, PromptKeys([0, *PROMPT]), now=59) == 0  # a prefix, from block 0 only
    assert recent.matched_tokens("e2", BS, PromptKeys(PROMPT), now=59) == 0
    assert recent.matched_tokens("e1", BS, PromptKeys(PROMPT), now=60) == 0
    recent.record("e1", BS, PromptKeys(PROMPT[:32]), now=50)  # sent again: its blocks live longer
    assert recent.matched_tokens("e1", BS, PromptKeys(PROMPT), now=100) == 2 * BS


def test_memory_is_bounded_per_engine_and_in_engines():
    recent = RecentChoices(ttl=60, max_engines=2, max_blocks_per_engine=4)
    recent.record("e1", BS, PromptKeys(PROMPT), now=0)
    assert recent.blocks_held() == 4  # the oldest blocks went first, so the prompt's prefix is gone
    assert recent.matched_tokens("e1", BS, PromptKeys(PROMPT), now=1) == 0
    recent.record("e2", BS, PromptKeys(PROMPT[:32]), now=1)
    recent.record("e3", BS, PromptKeys(PROMPT[:32]), now=2)  # e1 was used least recently
    assert recent.matched_tokens("e1", BS, PromptKeys(PROMPT[:32]), now=3) == 0
    assert recent.matched_tokens("e3", BS, PromptKeys(PROMPT[:32]), now=3) == 2 * BS
    recent.record("e3", BS, PromptKeys(PROMPT[:16]), now=100)  # e3's older blocks expired meanwhile
    assert recent.blocks_held() == 2 + 1


@pytest.mark.parametrize("bad", [{"ttl": 0}, {"max_engines": 0}, {"max_blocks_per_engine": 0}])
def test_nonsense_bounds_are_refused(bad):
    with pytest.raises(ValueError):
        RecentChoices(**bad)


async def test_the_router_prefers_the_engines_it_sent_a_prompt_to_when_it_follows_no_events():
    engines = [advert(name, role=role) for name, role in
               (("p1", "prefill"), ("p2", "prefill"), ("d1", "decode"), ("d2", "decode"))]
    by_id = {e.engine_id: e for e in engines}
    pool, clock = EnginePool("push", lambda: engines), ManualClock(0)
    routing = PrefixRouting(pool, KvIndex(), Weights(decode_only_share=2.0), CollectorRegistry(), clock=clock)
    body = {"model": "tiny", "prompt": PROMPT}

    async def placed() -> tuple[str, str]:
        prefer = await routing.preference(None, "completions", body, "rid")  # type: ignore[arg-type]
        assert prefer is not None
        pair, _ = pool.place(prefer=prefer)
        assert pair is not None
        return pair[0].engine_id, pair[1].engine_id

    assert await placed() == ("p1", "d1")  # nothing known: least-loaded, ties on engine id
    prefer = await routing.preference(None, "completions", body, "rid")  # type: ignore[arg-type]
    assert prefer is not None
    routing.chosen(prefer, by_id["p2"], by_id["d2"])  # the router sent it to the others (say, p1 and d1 were busy)
    assert await placed() == ("p2", "d2")
    clock.t += routing.recent.ttl
    assert await placed() == ("p1", "d1")


async def test_engines_the_index_follows_are_predicted_by_the_index_alone():
    engines = [advert("p1", role="prefill"), advert("d1", role="decode")]
    index = KvIndex()
    index.add_engine("p1")  # followed, and has stored nothing yet
    routing = PrefixRouting(EnginePool("push", lambda: engines), index, Weights(), CollectorRegistry(),
                            clock=ManualClock(0))
    prefer = await routing.preference(None, "completions", {"prompt": PROMPT}, "rid")  # type: ignore[arg-type]
    assert prefer is not None
    routing.chosen(prefer, engines[0], engines[1])
    again = await routing.preference(None, "completions", {"prompt": PROMPT}, "rid")  # type: ignore[arg-type]
    assert again is not None
    assert again.cached("p1") == 0 and again.cached("d1") == 6 * BS
