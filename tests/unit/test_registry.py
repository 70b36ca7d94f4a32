"""The in-memory registry: leases on an injected clock, conflicts, versions, resumable change log."""
from __future__ import annotations

import asyncio

import pytest

from disagg.connector.rendezvous.registry import Conflict, NotFound, Registry, RegistryFull
from support.rendezvous import ManualClock, advert


def registry(**kw) -> tuple[Registry, ManualClock]:
    clock = ManualClock()
    return Registry(clock=clock, epoch="epoch-1", **kw), clock


def test_register_new_changed_and_unchanged():
    r, _ = registry()
    a = advert("e1")
    first = r.register(a)
    assert (first.result, first.version, [e.type for e in first.events]) == ("created", 1, ["ADDED"])
    same = r.register(a)
    assert (same.result, same.version, same.events) == ("renewed", 1, ())  # a heartbeat is not a change
    changed = r.register(advert("e1", transport="LIBFABRIC"))
    assert (changed.result, changed.version, [e.type for e in changed.events]) == ("modified", 2, ["MODIFIED"])
    assert r.get("e1").transport == "LIBFABRIC" and len(r) == 1


def test_lease_expiry_follows_the_injected_clock_and_renewals():
    r, clock = registry()
    r.register(advert("e1", lease_seconds=10))
    r.register(advert("e2", lease_seconds=20))
    clock.advance(9.9)
    assert r.expire() == []
    renewed = r.renew("e1")  # now + 10
    assert renewed.result == "renewed" and renewed.expires_at == pytest.approx(clock.t + 10)
    clock.advance(9.0)  # t0 + 18.9: e1 renewed at 9.9 lives until 19.9
    assert r.expire() == []
    clock.advance(1.0)  # 19.9
    gone = r.expire()
    assert [(e.type, e.engine.engine_id) for e in gone] == [("EXPIRED", "e1")]
    assert r.get("e1") is None and r.get("e2") is not None
    assert [(e.type, e.engine.engine_id) for e in r.expire(now=clock.t + 0.1)] == [("EXPIRED", "e2")]
    assert len(r) == 0 and r.version == 4
    # A re-registration after expiry is new again.
    assert r.register(advert("e1")).result == "created"


def test_next_deadline_is_the_earliest_lease():
    r, clock = registry()
    assert r.next_deadline() is None
    r.register(advert("e1", lease_seconds=10))
    r.register(advert("e2", lease_seconds=3))
    assert r.next_deadline() == pytest.approx(clock.t + 3)


def test_an_engine_id_held_by_another_pod_is_a_conflict_and_changes_nothing():
    r, _ = registry()
    r.register(advert("e1", pod_name="qwen-prefill-0", pod_uid="uid-a"))
    for over in ({"pod_uid": "uid-b"}, {"pod_uid": None}, {"pod_name": "qwen-prefill-1"}, {"role": "decode"}):
        fields = {"pod_name": "qwen-prefill-0", "pod_uid": "uid-a", **over}
        with pytest.raises(Conflict, match="new incarnation needs a new engine id"):
            r.register(advert("e1", transport="LIBFABRIC", **fields))
    assert r.version == 1 and r.get("e1").pod_uid == "uid-a" and r.get("e1").transport == "UCX"


def test_a_new_engine_of_the_same_pod_replaces_the_old_one():
    r, _ = registry()
    r.register(advert("old", pod_name="qwen-decode-0", pod_uid="uid-a", role="decode"))
    r.register(advert("other", pod_name="qwen-decode-1", pod_uid="uid-c", role="decode"))
    reg = r.register(advert("new", pod_name="qwen-decode-0", pod_uid="uid-b", role="decode"))
    assert [(e.type, e.engine.engine_id) for e in reg.events] == [("DELETED", "old"), ("ADDED", "new")]
    assert sorted(a.engine_id for a in r.engines()) == ["new", "other"]
    # Local engines (no pod) never replace each other.
    r.register(advert("local-1"))
    r.register(advert("local-2"))
    assert {"local-1", "local-2"} <= {a.engine_id for a in r.engines()}


def test_versions_increase_by_one_per_event():
    r, clock = registry()
    versions = []
    versions += [e.version for e in r.register(advert("a", lease_seconds=1)).events]
    versions += [e.version for e in r.register(advert("b")).events]
    versions += [e.version for e in r.register(advert("b", tp_size=2)).events]
    versions.append(r.deregister("b").version)
    clock.advance(2)
    versions += [e.version for e in r.expire()]
    assert versions == [1, 2, 3, 4, 5] and r.version == 5


def test_deregister_and_renew_of_unknown_engines():
    r, _ = registry()
    with pytest.raises(NotFound):
        r.deregister("nope")
    with pytest.raises(NotFound):
        r.renew("nope")
    assert r.version == 0


def test_filters():
    r, _ = registry()
    r.register(advert("p1"))
    r.register(advert("d1", role="decode"))
    r.register(advert("d2", role="decode", layout_key="other"))
    assert [a.engine_id for a in r.engines(role="decode")] == ["d1", "d2"]
    assert [a.engine_id for a in r.engines(layout_key="other")] == ["d2"]
    assert r.counts_by_role() == {"prefill": 1, "decode": 2}


def test_watch_resumes_from_a_version():
    r, _ = registry()
    r.register(advert("a"))
    r.register(advert("b"))
    r.deregister("a")
    r.register(advert("b", tp_size=2))
    ch = r.changes_since(2, "epoch-1")
    assert not ch.reset and ch.version == 4
    assert [(e.version, e.type, e.engine.engine_id) for e in ch.events] == [(3, "DELETED", "a"), (4, "MODIFIED", "b")]
    assert r.changes_since(4).events == [] and not r.changes_since(4).reset
    assert [e.version for e in r.changes_since(0).events] == [1, 2, 3, 4]


@pytest.mark.parametrize("since,epoch", [(None, None), (1, "another-epoch"), (99, None), (0, None)])
def test_snapshot_when_the_log_cannot_resume(since, epoch):
    r, _ = registry(log_size=3)
    for name in "abcde":  # versions 1..5; the log keeps 3..5
        r.register(advert(name))
    r.deregister("a")  # 6; log keeps 4..6
    if since == 0:
        since = 2  # older than the log's floor (3)
    ch = r.changes_since(since, epoch)
    assert ch.reset and ch.version == 6
    assert ch.events[0].type == "RESET" and ch.events[0].epoch == "epoch-1"
    assert [(e.type, e.version, e.engine.engine_id) for e in ch.events[1:]] == \
        [("ADDED", 6, n) for n in "bcde"]
    # The oldest version still in the log resumes without a snapshot.
    assert not r.changes_since(3).reset and [e.version for e in r.changes_since(3).events] == [4, 5, 6]


def test_warming_ends_after_the_warmup():
    r, clock = registry(warmup_seconds=10)
    assert r.warming() and r.control("BOOKMARK").warming
    clock.advance(10)
    assert not r.warming() and r.control("RESET").warming is False


def test_registry_limit():
    r, _ = registry(max_engines=2)
    r.register(advert("a"))
    r.register(advert("b"))
    with pytest.raises(RegistryFull):
        r.register(advert("c"))
    assert r.register(advert("b", tp_size=2)).result == "modified"  # existing engines still update


@pytest.mark.timeout(5)
async def test_wait_wakes_on_change_times_out_and_closes():
    r, _ = registry()
    assert await r.wait(0, timeout=0.01) is False
    waiter = asyncio.create_task(r.wait(0, timeout=5))
    await asyncio.sleep(0)
    r.register(advert("a"))
    assert await waiter is True
    assert await r.wait(0, timeout=5) is True  # already past: no waiting
    closing = asyncio.create_task(r.wait(1, timeout=5))
    await asyncio.sleep(0)
    r.close()
    assert await closing is False and r.closed
