"""The router's KV event subscriptions follow the engine source (connector/router/kv_follow.py): the pure diff of
what is advertised against what is subscribed, and the follower acting on it over real ZMQ sockets (a SUB connects
lazily, so no publisher is needed to see which subscriptions exist)."""
from __future__ import annotations

from typing import Any

import pytest

from disagg.connector.router.kv_follow import Changes, KvFollower, Stream, diff, stream_key, streams
from disagg.connector.router.kv_index import KvIndex
from disagg.connector.wire.advertisement import EngineAdvertisement
from support.rendezvous import advert


def ev(port: int, replay: bool = True) -> dict[str, Any]:
    """An advertisement's KV event fields, one rank, on `port` (and its replay on the next)."""
    return {"kv_events_endpoints": [f"tcp://10.0.0.5:{port}"],
            "kv_events_replay_endpoints": [f"tcp://10.0.0.5:{port + 1}"] if replay else None}


A = Stream("a", "prefill", "tcp://h:1", "tcp://h:2")
A_MOVED = Stream("a", "prefill", "tcp://h:3", "tcp://h:4")
A_NO_REPLAY = Stream("a", "prefill", "tcp://h:1", None)
B = Stream("b", "decode", "tcp://h:5", None)

DIFFS = [
    # (advertised, subscribed, stop, start)
    ({}, {}, (), ()),
    ({"a": A}, {}, (), (("a", A),)),  # new: add and subscribe
    ({}, {"a": A}, ("a",), ()),  # withdrawn: unsubscribe and drop
    ({"a": A}, {"a": A}, (), ()),  # unchanged: nothing, whatever it holds is kept
    ({"a": A_MOVED}, {"a": A}, ("a",), (("a", A_MOVED),)),  # same id, other endpoints: resubscribe
    ({"a": A_NO_REPLAY}, {"a": A}, ("a",), (("a", A_NO_REPLAY),)),  # the replay endpoint counts too
    ({"b": B, "a": A}, {"a": A_MOVED, "c": B}, ("a", "c"), (("a", A), ("b", B))),  # all at once, sorted
]


@pytest.mark.parametrize(("advertised", "subscribed", "stop", "start"), DIFFS)
def test_the_diff(advertised, subscribed, stop, start):
    changes = diff(advertised, subscribed)
    assert (changes.stop, changes.start) == (stop, start)
    assert bool(changes) == bool(stop or start)


def test_streams_are_the_engines_that_advertise_events_one_per_data_parallel_rank():
    two_ranks = advert("d", role="decode", dp_size=2, side_channel_ports=[5600, 5601],
                       kv_events_endpoints=["tcp://10.0.0.6:5557", "tcp://10.0.0.6:5558"],
                       kv_events_replay_endpoints=["tcp://10.0.0.6:5559", "tcp://10.0.0.6:5560"])
    engines = [advert("p", **ev(5557)), advert("quiet"), advert("p2", **ev(6000, replay=False)), two_ranks]
    assert streams(engines) == {
        "p": Stream("p", "prefill", "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558"),
        "p2": Stream("p2", "prefill", "tcp://10.0.0.5:6000", None),
        "d/dp0": Stream("d", "decode", "tcp://10.0.0.6:5557", "tcp://10.0.0.6:5559"),
        "d/dp1": Stream("d", "decode", "tcp://10.0.0.6:5558", "tcp://10.0.0.6:5560"),
    }
    assert stream_key("p", 0, 1) == "p" and "/" not in advert("x").engine_id


async def test_the_follower_adds_withdraws_and_resubscribes():
    engines: list[EngineAdvertisement] = [advert("a", **ev(7001)), advert("b", role="decode", **ev(7003)),
                                          advert("quiet")]
    index = KvIndex(max_engines=4, max_blocks_per_engine=8)
    follower = KvFollower(lambda: engines, index)
    try:
        changes = await follower.sync()
        assert [k for k, _ in changes.start] == ["a", "b"] and not changes.stop
        assert set(follower.client.subscriptions) == set(index.engines()) == set(follower.subscribed) == {"a", "b"}
        assert await follower.sync() == Changes((), ())  # nothing changed: nothing done

        engines[:] = [advert("a", **ev(7101)), advert("quiet")]  # b withdrawn, a moved
        changes = await follower.sync()
        assert changes.stop == ("a", "b") and [k for k, _ in changes.start] == ["a"]
        assert set(index.engines()) == set(follower.client.subscriptions) == {"a"}
        sub = follower.subscription("a")
        assert sub is not None and (sub.endpoint, sub.replay_endpoint) == ("tcp://10.0.0.5:7101", "tcp://10.0.0.5:7102")
        assert (follower.started, follower.stopped) == (3, 2)
        assert follower.by_role() == ({"prefill": 1}, {"prefill": 0})
    finally:
        await follower.close()
    assert not index.engines() and not follower.subscribed


async def test_past_the_bound_engines_wait_for_a_slot_in_key_order():
    engines = [advert("b", **ev(7201)), advert("a", **ev(7203)), advert("c", **ev(7205))]
    index = KvIndex(max_engines=2, max_blocks_per_engine=8)
    follower = KvFollower(lambda: engines, index)
    try:
        await follower.sync()
        assert set(index.engines()) == {"a", "b"} and follower.unindexed == {"c"}
        assert index.counters.engines_refused == 0  # the follower never asks past the bound
        await follower.sync()
        assert follower.unindexed == {"c"} and follower.started == 2  # retried each round, still no slot
        del engines[1]  # a withdrawn: c takes its slot
        await follower.sync()
        assert set(index.engines()) == {"b", "c"} and not follower.unindexed
    finally:
        await follower.close()
