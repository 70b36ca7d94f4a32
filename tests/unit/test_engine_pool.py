"""The engine pool's pairing as tables (connector/router/engine_pool.py): layout key, mode and block size are
never crossed, least outstanding work first, dead and excluded engines out. Pure, no servers; the probes that
decide who is dead are checked last, against stand-in engines."""
from __future__ import annotations

import socket

import aiohttp
import pytest

from disagg.connector.router.engine_pool import EnginePool
from support.rendezvous import advert
from support.stub_engines import StubEngine, stub_engines


def P(engine_id: str, **over):  # noqa: N802 - reads as a table
    return advert(engine_id, role="prefill", **over)


def D(engine_id: str, **over):  # noqa: N802
    return advert(engine_id, role="decode", **over)


def pair(pool: EnginePool, exclude: set[str] = frozenset()) -> tuple[str, str] | None:
    chosen = pool.choose(exclude=exclude)
    return None if chosen is None else (chosen[0].engine_id, chosen[1].engine_id)


# (engines, pool mode, outstanding work, down, exclude, expected (prefill, decode) or None)
CASES = [
    # Never crossed: layout key (two rollout generations), mode, block size.
    ([P("p1", layout_key="gen-a"), D("d1", layout_key="gen-b")], "push", {}, set(), set(), None),
    ([P("p1", layout_key="gen-a"), D("d1", layout_key="gen-b"), P("p2", layout_key="gen-b")], "push", {}, set(),
     set(), ("p2", "d1")),
    ([P("p1", kv_mode="pull"), D("d1")], "push", {}, set(), set(), None),
    ([P("p1", kv_mode="pull"), D("d1", kv_mode="pull")], "push", {}, set(), set(), None),  # a push router
    ([P("p1", kv_mode="pull"), D("d1", kv_mode="pull")], "pull", {}, set(), set(), ("p1", "d1")),
    ([P("p1"), D("d1", block_size=32)], "push", {}, set(), set(), None),
    ([P("p1"), P("p2")], "push", {}, set(), set(), None),  # no decode
    ([D("d1"), D("d2")], "push", {}, set(), set(), None),  # no prefill
    # Least outstanding work: the decode first, then among its compatible prefills; ties by engine id.
    ([P("p1"), P("p2"), D("d1"), D("d2")], "push", {}, set(), set(), ("p1", "d1")),
    ([P("p1"), P("p2"), D("d1"), D("d2")], "push", {"d1": 3, "d2": 1, "p1": 2}, set(), set(), ("p2", "d2")),
    ([P("p1"), P("p2"), D("d1"), D("d2")], "push", {"d1": 1, "d2": 1, "p1": 1, "p2": 1}, set(), set(), ("p1", "d1")),
    # The least busy decode has no compatible prefill: the next decode that has one.
    ([P("p1", layout_key="gen-b"), D("d1", layout_key="gen-a"), D("d2", layout_key="gen-b")], "push",
     {"d2": 5}, set(), set(), ("p1", "d2")),
    # Dead engines are out; so are prefills already tried for this request.
    ([P("p1"), P("p2"), D("d1"), D("d2")], "push", {}, {"p1", "d1"}, set(), ("p2", "d2")),
    ([P("p1"), D("d1")], "push", {}, {"d1"}, set(), None),
    ([P("p1"), P("p2"), D("d1")], "push", {}, set(), {"p1"}, ("p2", "d1")),
    ([P("p1"), P("p2"), D("d1")], "push", {}, {"p2"}, {"p1"}, None),
]


@pytest.mark.parametrize("engines, mode, outstanding, down, exclude, expected", CASES)
def test_pairing(engines, mode, outstanding, down, exclude, expected):
    pool = EnginePool(mode, lambda: engines)
    pool.outstanding.update(outstanding)
    pool.down = set(down)
    assert pair(pool, exclude) == expected
    if expected is not None:
        p, d = pool.choose(exclude=exclude)
        assert (p.layout_key, p.kv_mode, p.block_size) == (d.layout_key, d.kv_mode, d.block_size) and \
            p.kv_mode == mode


# (outstanding legs, limit, expected (prefill, decode) or None, whether a compatible pair exists at all)
PLACES = [
    ({}, 1, ("p1", "d1"), True),
    ({"d1": 1}, 1, ("p1", "d2"), True),  # a full decode is passed over
    ({"p1": 1}, 1, ("p2", "d1"), True),  # so is a full prefill
    ({"d1": 1, "d2": 1}, 1, None, True),  # full: the request waits (overload), not a missing pair
    ({"p1": 2, "p2": 2}, 2, None, True),
    ({"p1": 2, "p2": 2}, 3, ("p1", "d1"), True),
    ({"p1": 9, "d1": 9, "d2": 9}, None, ("p2", "d1"), True),  # no bound: least outstanding first, as choose()
]


@pytest.mark.parametrize("outstanding, limit, expected, exists", PLACES)
def test_placing_under_a_bound_on_legs_per_engine(outstanding, limit, expected, exists):
    pool = EnginePool("push", lambda: [P("p1"), P("p2"), D("d1"), D("d2")])
    pool.outstanding.update(outstanding)
    chosen, found = pool.place(limit=limit)
    assert (None if chosen is None else (chosen[0].engine_id, chosen[1].engine_id)) == expected
    assert found is exists


def test_placing_tells_a_missing_pair_from_a_full_one():
    pool = EnginePool("push", lambda: [P("p1", layout_key="gen-a"), D("d1", layout_key="gen-b")])
    assert pool.place(limit=1) == (None, False)
    assert pool.place(limit=None) == (None, False)


def test_the_source_is_read_at_every_choice():
    """Engines come and go (rendezvous events): no caching between choices."""
    engines = [P("p1"), D("d1")]
    pool = EnginePool("push", lambda: engines)
    assert pair(pool) == ("p1", "d1")
    engines[:] = [P("p2"), D("d1")]
    assert pair(pool) == ("p2", "d1")
    engines.clear()
    assert pair(pool) is None and pool.snapshot() == {}


def test_snapshot_counts_by_role_and_state():
    pool = EnginePool("push", lambda: [P("p1"), P("p2"), D("d1"), D("d2", kv_mode="pull")])
    pool.down = {"p2"}
    assert pool.snapshot() == {"prefill/up": 1, "prefill/down": 1, "decode/up": 1}


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_probes_take_dead_engines_out_and_bring_them_back():
    """Refused connections and non-200 health are dead at the first probe; a timeout only after `slow_strikes`
    in a row; a good probe brings an engine back. max_model_len is learned from /v1/models."""
    async with stub_engines(StubEngine("p1", "prefill", max_model_len=77), StubEngine("d1", "decode")) as (p1, d1):
        engines = [p1.advertisement(), d1.advertisement(), P("gone", http_url=f"http://127.0.0.1:{_closed_port()}")]
        pool = EnginePool("push", lambda: engines, probe_timeout=0.2, slow_strikes=2)
        async with aiohttp.ClientSession() as session:
            await pool.probe_once(session)
            assert pool.down == {"gone"} and pool.max_model_len == {"p1": 77, "d1": 8192}

            d1.health_status = 503  # the engine answers, but not healthy
            await pool.probe_once(session)
            assert pool.down == {"gone", "d1"} and pair(pool) is None
            d1.health_status = 200
            await pool.probe_once(session)
            assert pool.down == {"gone"} and pair(pool) == ("p1", "d1")

            p1.health_hangs = True  # slow: one strike is not enough, two are
            await pool.probe_once(session)
            assert pool.down == {"gone"}
            await pool.probe_once(session)
            assert pool.down == {"gone", "p1"}
            p1.health_hangs = False
            await pool.probe_once(session)
            assert pool.down == {"gone"} and pool.timeouts["p1"] == 0


async def test_an_odd_models_answer_neither_marks_an_engine_down_nor_fails_the_round():
    """/v1/models only tells max_model_len; an engine answering it oddly stays up (no known limit), and the
    round still probes every other engine (one engine's answer raising used to fail the whole round)."""
    odd = [StubEngine(f"p{i}", "prefill") for i in range(5)]
    for engine, body in zip(odd, [b"[]", b"not json", b'{"data": []}', b'{"data": [1]}',
                                  b'{"data": [{"max_model_len": true}]}'], strict=True):
        engine.models_body = body
    async with stub_engines(*odd, StubEngine("d1", "decode"), StubEngine("dead", "decode")) as engines:
        *_, dead = engines
        ads = [e.advertisement() for e in engines]
        await dead.stop()
        pool = EnginePool("push", lambda: ads)
        async with aiohttp.ClientSession() as session:
            await pool.probe_once(session)
        assert pool.down == {"dead"} and pool.max_model_len == {"d1": 8192}
