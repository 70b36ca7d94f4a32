"""The router's overload protection (connector/router/admission.py) on its own: the bounds, the queue's order,
its deadline, cancellation and retries, against an engine pool of advertisements (no HTTP). Tasks stand for
requests; a granted waiter resumes within one event-loop turn, so `settle` waits turns, never time."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from disagg.connector.router.admission import Admission, Legs, Overloaded
from disagg.connector.router.engine_pool import EnginePool
from support.rendezvous import advert

ENGINES = [advert("p1", role="prefill"), advert("p2", role="prefill"), advert("d1", role="decode"),
           advert("d2", role="decode")]


def admission(*, total: int | None = None, per_engine: int | None = None, queue: int = 100,
              wait: float = 60.0, engines: list | None = None) -> Admission:
    chosen = ENGINES if engines is None else engines
    return Admission(EnginePool("push", lambda: chosen), max_inflight=total, max_per_engine=per_engine,
                     max_queue=queue, queue_wait=wait)


async def settle(turns: int = 5) -> None:
    for _ in range(turns):
        await asyncio.sleep(0)  # one loop turn each: a granted waiter resumes in one


def admit(a: Admission, **kw) -> asyncio.Task:
    return asyncio.create_task(a.admit(**kw))


def ids(legs: Legs | None) -> tuple[str, str] | None:
    return None if legs is None else (legs.prefill.engine_id, legs.decode.engine_id)


async def test_requests_are_admitted_least_outstanding_first_until_each_engine_is_at_its_bound():
    a = admission(per_engine=2)
    granted = [await a.admit() for _ in range(4)]
    assert [ids(g) for g in granted] == [("p1", "d1"), ("p2", "d2"), ("p1", "d1"), ("p2", "d2")]
    assert a.pool.outstanding == {"p1": 2, "p2": 2, "d1": 2, "d2": 2} and a.in_flight == 4
    fifth = admit(a)
    await settle()
    assert not fifth.done() and a.waiting == 1
    granted[0].prefill_answered()  # p1 has room again, but both decodes are full
    await settle()
    assert not fifth.done()
    granted[0].release()  # d1 too
    assert ids(await fifth) == ("p1", "d1")
    assert a.waiting == 0 and a.admitted == 5 and a.queued == 1


async def test_a_prefill_slot_frees_when_prefill_answers_while_its_decode_leg_runs_on():
    a = admission(per_engine=1, engines=ENGINES[:1] + ENGINES[2:])  # p1; d1, d2
    first = await a.admit()
    second = admit(a)
    await settle()
    assert not second.done() and first is not None
    first.prefill_answered()
    assert ids(await second) == ("p1", "d2") and a.pool.outstanding == {"p1": 1, "d1": 1, "d2": 1}


async def test_the_total_bound_holds_whatever_room_the_engines_have():
    a = admission(total=2)
    first, second = await a.admit(), await a.admit()
    third = admit(a)
    await settle()
    assert not third.done() and a.in_flight == 2
    assert first is not None and second is not None
    first.release()  # engine slots alone do not admit anyone: the request slot is still held
    await settle()
    assert not third.done()
    a.leave()
    assert ids(await third) == ("p1", "d1") and a.in_flight == 2


async def test_waiters_are_admitted_in_arrival_order_each_as_soon_as_a_slot_frees():
    a = admission(total=1)
    held: dict[int, Legs | None] = {-1: await a.admit()}
    order: list[int] = []

    async def request(i: int) -> None:
        held[i] = await a.admit()
        order.append(i)

    tasks = []
    for i in range(5):
        tasks.append(asyncio.create_task(request(i)))
        await settle()  # each queues before the next arrives
    assert a.waiting == 5 and order == []
    for i in range(5):
        legs = held.pop(i - 1)
        assert legs is not None
        legs.release()
        a.leave()  # one request ends: exactly the next one in line is admitted
        await settle()
        assert order == list(range(i + 1)) and a.waiting == 4 - i
    await asyncio.gather(*tasks)


async def test_a_full_queue_refuses_at_once_and_holds_nothing():
    a = admission(total=1, queue=2)
    await a.admit()
    waiters = [admit(a), admit(a)]
    await settle()
    with pytest.raises(Overloaded) as e:
        await a.admit()
    assert e.value.reason == "queue_full" and a.rejected == {"queue_full": 1, "deadline": 0}
    assert a.in_flight == 1 and a.waiting == 2
    for w in waiters:
        w.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    assert a.waiting == 0 and a.in_flight == 1


async def test_a_waiter_past_its_deadline_is_refused_and_leaves_the_queue():
    a = admission(total=1, wait=0.05)
    await a.admit()
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(Overloaded) as e:
        await a.admit()
    assert e.value.reason == "deadline" and loop.time() - start >= 0.05
    assert a.waiting == 0 and a.in_flight == 1 and a.rejected["deadline"] == 1
    assert a.retry_after == 1  # whole seconds, at least one


async def test_a_cancelled_waiter_leaves_the_queue_and_the_next_one_takes_its_turn():
    a = admission(total=1)
    running = await a.admit()
    gone, next_one = admit(a), admit(a)
    await settle()
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    assert gone.cancelled() and a.waiting == 1 and a.in_flight == 1
    assert running is not None
    running.release()
    a.leave()
    assert ids(await next_one) == ("p1", "d1") and a.in_flight == 1


async def test_a_waiter_cancelled_after_its_grant_gives_back_what_it_was_given():
    """The slot freed and was handed to the waiter, whose client left before it ran: nothing may stay taken."""
    a = admission(total=1, per_engine=1, engines=ENGINES[:1] + ENGINES[2:3])
    running = await a.admit()
    waiter = admit(a)
    later = admit(a)
    await settle()
    assert running is not None
    running.release()
    a.leave()  # grants `waiter` now, synchronously; it has not run yet
    assert a.in_flight == 1 and a.pool.outstanding == {"p1": 1, "d1": 1}
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    assert waiter.cancelled()
    granted = await later  # what `waiter` gave back went to the next in line
    assert ids(granted) == ("p1", "d1") and a.in_flight == 1 and a.waiting == 0
    assert granted is not None
    granted.release()
    a.leave()
    assert a.in_flight == 0 and a.pool.outstanding == {}


async def test_a_retry_waits_ahead_of_new_requests_and_avoids_the_engine_that_failed():
    a = admission(per_engine=1, engines=ENGINES[:1] + ENGINES[2:])  # p1; d1, d2
    first = await a.admit()
    assert first is not None and ids(first) == ("p1", "d1")
    second = admit(a)
    await settle()
    assert not second.done()  # p1 is busy
    first.release()  # d1 failed before answering: that attempt ends; p1 goes to the request waiting
    running = await second
    assert running is not None and ids(running) == ("p1", "d1")  # both slots came back at once
    retry = admit(a, exclude={"d1"}, holding=True)  # the first request again, holding its request slot
    third = admit(a)
    await settle()
    assert not retry.done() and not third.done() and a.waiting == 2 and a.in_flight == 2
    running.release()  # p1 and d1 free: the retry goes first, on the decode it did not fail on
    assert ids(await retry) == ("p1", "d2")
    await settle()
    assert not third.done() and a.in_flight == 2  # p1 is the retry's now
    third.cancel()
    await asyncio.gather(third, return_exceptions=True)
    assert a.waiting == 0


async def test_no_pair_at_all_gives_the_request_slot_alone():
    """No engines is not overload: the router waits for a pair (its pair wait) holding its request slot."""
    a = admission(total=1, engines=[])
    assert await a.admit() is None and a.in_flight == 1
    queued = admit(a)
    await settle()
    assert not queued.done()  # the slot is taken by the one waiting for engines
    a.leave()
    assert await queued is None and a.in_flight == 1


def test_defaults_bound_nothing_when_told_so():
    a = admission()
    assert a.max_inflight is None and a.max_per_engine is None


# -- properties ------------------------------------------------------------------------------------------------
@dataclass
class Model:
    """The test's view of each request: its arrival index, task, and what it holds once admitted."""

    arrivals: int = 0
    waiting: dict[int, asyncio.Task] = field(default_factory=dict)
    running: dict[int, Legs | None] = field(default_factory=dict)
    retrying: dict[int, asyncio.Task] = field(default_factory=dict)
    order: list[int] = field(default_factory=list)
    refused: int = 0


OPS = st.lists(st.tuples(st.sampled_from(["arrive", "arrive", "arrive", "prefill", "end", "cancel", "retry"]),
                         st.integers(0, 1000)), min_size=10, max_size=80)


@given(total=st.sampled_from([None, 1, 2, 3, 5]), per_engine=st.sampled_from([None, 1, 2]),
       queue=st.integers(0, 4), ops=OPS)
def test_the_bounds_hold_the_queue_is_fifo_and_work_conserving_and_nothing_leaks(total, per_engine, queue, ops):
    """Arrivals, prefills answering, requests ending, clients leaving the queue and retries avoiding a decode, in
    any order: never more in flight than the bounds, never more waiting than the queue, new requests admitted in
    arrival order, nobody left waiting who could be placed, and everything back to zero at the end."""
    asyncio.run(_run(total, per_engine, queue, ops))


async def _run(total: int | None, per_engine: int | None, queue: int, ops: list[tuple[str, int]]) -> None:
    # One more decode than prefills, so that either role can be the one that binds.
    a = admission(total=total, per_engine=per_engine, queue=queue, engines=[*ENGINES, advert("d3", role="decode")])
    m = Model()

    async def request(i: int) -> Legs | None:
        legs = await a.admit()
        m.order.append(i)
        return legs

    def harvest() -> None:
        for i, t in list(m.waiting.items()):
            if t.done():
                del m.waiting[i]
                if t.cancelled():
                    continue
                if isinstance(t.exception(), Overloaded):
                    m.refused += 1
                    continue
                m.running[i] = t.result()
        for i, t in list(m.retrying.items()):
            if t.done() and not t.cancelled():
                del m.retrying[i]
                m.running[i] = t.result()

    def check() -> None:
        assert total is None or a.in_flight <= total
        assert per_engine is None or all(n <= per_engine for n in a.pool.outstanding.values())
        assert all(n > 0 for n in a.pool.outstanding.values())
        assert len(a._new) <= queue
        assert a.in_flight == len(m.running) + len(m.retrying)
        assert m.order == sorted(m.order)  # new requests are admitted in arrival order

    def pick(pool: dict, k: int) -> int | None:
        return sorted(pool)[k % len(pool)] if pool else None

    for op, k in ops:
        if op == "arrive":
            m.waiting[m.arrivals] = asyncio.create_task(request(m.arrivals))
            m.arrivals += 1
        elif op == "prefill" and (i := pick({i: g for i, g in m.running.items() if g}, k)) is not None:
            legs = m.running[i]
            assert legs is not None
            legs.prefill_answered()
        elif op == "end" and (i := pick(m.running, k)) is not None:
            legs = m.running.pop(i)
            if legs is not None:
                legs.release()
            a.leave()
        elif op == "cancel" and (i := pick(m.waiting, k)) is not None:
            m.waiting[i].cancel()
        elif op == "retry" and (i := pick({i: g for i, g in m.running.items() if g}, k)) is not None:
            legs = m.running.pop(i)
            assert legs is not None
            legs.release()
            m.retrying[i] = asyncio.create_task(a.admit({legs.decode.engine_id}, holding=True))
        await settle()
        if m.retrying:
            event("a retry waited")
        harvest()
        check()
        if a._new:  # work-conserving: the head waits only when nothing can be placed for it
            pair, exists = a.pool.place(frozenset(), per_engine)
            assert (total is not None and a.in_flight >= total) or (pair is None and exists)
    # Everyone still queued gives up; everyone running ends; every retry gets its pair and ends.
    for t in m.waiting.values():
        t.cancel()
    while m.running or m.retrying:
        for i in list(m.running):
            legs = m.running.pop(i)
            if legs is not None:
                legs.release()
            a.leave()
        await settle()
        harvest()
    await settle()
    assert a.in_flight == 0 and a.pool.outstanding == {} and a.waiting == 0
    event(f"queued {min(a.queued, 3)}+, refused for a full queue {min(m.refused, 1)}+")
    assert a.admitted == len(m.order) and a.rejected["queue_full"] == m.refused


async def test_a_prefill_leg_routed_by_the_index_queues_its_uncached_tokens_until_prefill_answers():
    """What prefix-aware pairing weighs a prefill queue by (kv_scoring.py): counted while the prefill slot is held,
    gone with it, whichever way it goes."""
    from disagg.connector.router.kv_scoring import Preference, Weights

    a = admission()
    held = {"p2": 900, "d2": 900}
    prefer = Preference(1000, lambda engine_id: held.get(engine_id, 0), Weights())
    first = await a.admit(prefer=prefer)
    assert ids(first) == ("p2", "d2") and a.pool.queued_tokens == {"p2": (1, 100)}
    second = await a.admit(prefer=prefer)  # decode legs count as legs: the idle decode wins this time
    assert ids(second) == ("p2", "d1") and a.pool.queued_tokens == {"p2": (2, 200)}
    plain = await a.admit()  # routed least-loaded: its size is unknown
    assert ids(plain) == ("p1", "d1") and "p1" not in a.pool.queued_tokens
    first.prefill_answered()
    assert a.pool.queued_tokens == {"p2": (1, 100)}
    first.release()
    second.release()
    plain.release()
    for _ in range(3):
        a.leave()
    assert a.pool.queued_tokens == {} and a.pool.outstanding == {} and a.in_flight == 0
