"""Prefix-aware pairing (connector/router/kv_scoring.py with EnginePool.place): what an engine holds weighs against
how busy it is, weights of 0 are least-loaded routing exactly, and which pairs have room never depends on it."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from disagg.connector.router.engine_pool import EnginePool
from disagg.connector.router.kv_scoring import Preference, Weights
from support.rendezvous import advert

ENGINES = [advert("p1", role="prefill"), advert("p2", role="prefill"), advert("d1", role="decode"),
           advert("d2", role="decode")]


def pool(load: dict[str, int] | None = None, queued: dict[str, tuple[int, int]] | None = None) -> EnginePool:
    p = EnginePool("push", lambda: ENGINES)
    p.outstanding = dict(load or {})
    p.queued_tokens = dict(queued or {})
    return p


def prefer(held: dict[str, int], prompt: int = 1000, **weights: float) -> Preference:
    return Preference(prompt, lambda engine_id: held.get(engine_id, 0), Weights(**weights))


def ids(pair) -> tuple[str, str] | None:
    return None if pair is None else (pair[0].engine_id, pair[1].engine_id)


def test_the_engines_that_hold_the_prompt_win_over_idle_ones_that_do_not():
    pair, exists = pool().place(prefer=prefer({"p2": 1000, "d2": 1000}))
    assert ids(pair) == ("p2", "d2") and exists
    assert ids(pool().place()[0]) == ("p1", "d1")  # least-loaded: ties break on engine id


def test_a_hit_is_worth_its_weight_in_outstanding_legs_and_no_more():
    # p2 holds it all and has one leg in flight more than p1: 1 + 0 against 0 + 1.0, a tie broken on id.
    assert ids(pool({"p2": 1}).place(prefer=prefer({"p2": 1000}))[0])[0] == "p1"
    assert ids(pool({"p2": 1}).place(prefer=prefer({"p2": 1000}, prefill=1.5))[0])[0] == "p2"
    # Half the prompt held is half the weight.
    assert ids(pool({"p2": 1}).place(prefer=prefer({"p2": 500}, prefill=3.0))[0])[0] == "p2"
    assert ids(pool({"p2": 2}).place(prefer=prefer({"p2": 500}, prefill=3.0))[0])[0] == "p1"


def test_a_prefill_queue_of_hits_weighs_what_it_computes_not_how_many_requests_it_holds():
    """The shared-prompt case: p2 holds the prefix and computes 100 tokens for the one request it runs; p1 is idle
    and holds nothing. Counting requests would send the next one to p1 and compute all 1000 tokens there."""
    held = {"p2": 900}
    assert ids(pool({"p2": 1}, {"p2": (1, 100)}).place(prefer=prefer(held))[0])[0] == "p2"  # 0.1 + 0.1 < 1
    # A leg of unknown size (routed least-loaded) counts as a prompt like this one: 1 + 0.1 > 1.
    assert ids(pool({"p2": 1}).place(prefer=prefer(held))[0])[0] == "p1"
    # Five such hits queued are still less work than one whole prompt.
    assert ids(pool({"p2": 5}, {"p2": (5, 500)}).place(prefer=prefer(held))[0])[0] == "p2"
    assert ids(pool({"p2": 6}, {"p2": (6, 1000)}).place(prefer=prefer(held))[0])[0] == "p1"


def test_decode_hits_weigh_with_the_decode_weight():
    held = {"d2": 1000}
    assert ids(pool({"d2": 1}).place(prefer=prefer(held))[0])[1] == "d1"  # 1 + 0 > 0 + 0.5
    assert ids(pool({"d2": 1}).place(prefer=prefer(held, decode=2.0))[0])[1] == "d2"


@given(load=st.dictionaries(st.sampled_from(["p1", "p2", "d1", "d2"]), st.integers(0, 5)),
       held=st.dictionaries(st.sampled_from(["p1", "p2", "d1", "d2"]), st.integers(0, 2000)),
       limit=st.none() | st.integers(1, 6))
def test_weights_of_zero_are_least_loaded_routing_and_room_never_depends_on_the_preference(load, held, limit):
    """(With no prefill legs of known size: those weigh by their tokens, not by their count.)"""
    zero = prefer(held, prefill=0.0, decode=0.0)
    assert pool(load).place(limit=limit, prefer=zero) == pool(load).place(limit=limit)
    pair, exists = pool(load).place(limit=limit, prefer=prefer(held))
    plain, plain_exists = pool(load).place(limit=limit)
    assert exists == plain_exists and (pair is None) == (plain is None)
    if pair is not None and limit is not None:
        assert all(load.get(e.engine_id, 0) < limit for e in pair)


def test_a_full_decode_that_holds_the_prompt_is_passed_over_for_one_with_room():
    pair, _ = pool({"d2": 2}).place(limit=2, prefer=prefer({"d2": 1000}, decode=10.0))
    assert ids(pair) == ("p1", "d1")


def test_decode_alone_from_the_configured_share_of_the_prompt():
    p = prefer({"d1": 900, "d2": 899}, prompt=1000)
    assert p.decode_only("d1") and not p.decode_only("d2")
    assert not prefer({"d1": 1000}, decode_only_share=1.01).decode_only("d1")
    assert not prefer({}, prompt=0).decode_only("d1")


def test_a_prediction_never_exceeds_the_prompt_and_is_looked_up_once_per_engine():
    calls: list[str] = []

    def lookup(engine_id: str) -> int:
        calls.append(engine_id)
        return 5000

    p = Preference(1000, lookup, Weights())
    assert p.cached("d1") == 1000 and p.share("d1") == 1.0 and p.uncached("d1") == 0
    pool().place(prefer=p)
    assert sorted(calls) == ["d1", "d2", "p1", "p2"]


@pytest.mark.parametrize("weights", [{"prefill": -1.0}, {"decode": -0.1}, {"decode_only_share": 0.0}])
def test_nonsense_weights_are_refused(weights):
    with pytest.raises(ValueError):
        Weights(**weights)
