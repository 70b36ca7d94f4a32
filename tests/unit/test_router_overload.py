"""The router's overload protection over HTTP: a router on 127.0.0.1 in front of stand-in engines
(tests/support/stub_engines.py) whose decode legs are held at a gate, so requests stay in flight until the test
opens it. The stand-ins count the legs they are answering (`active`, `peak`): what an engine would see."""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from disagg.connector.router import flags
from disagg.connector.router.access_log import AccessLog
from disagg.connector.router.app import Router, Settings
from disagg.connector.router.engine_pool import EnginePool
from support.stub_engines import KvBoard, StubEngine, serving, stub_engines


@dataclass
class Bed:
    url: str
    router: Router
    prefills: list[StubEngine]
    decodes: list[StubEngine]
    gate: asyncio.Event  # decode legs answer once it is set
    http: aiohttp.ClientSession
    seen_in_flight: list[int]  # the router's requests in flight whenever a decode leg starts answering

    def engines(self) -> list[StubEngine]:
        return self.prefills + self.decodes


@contextlib.asynccontextmanager
async def bed(prefills: int = 1, decodes: int = 1, access_log: AccessLog | None = None,
              **settings: float) -> AsyncIterator[Bed]:
    board = KvBoard()
    ps = [StubEngine(f"p-{i}", "prefill", board=board) for i in range(prefills)]
    ds = [StubEngine(f"d-{i}", "decode", board=board) for i in range(decodes)]
    gate, seen = asyncio.Event(), []
    async with stub_engines(*ps, *ds):
        engines = [e.advertisement() for e in ps + ds]
        router = Router(EnginePool("push", lambda: engines), Settings(mode="push", **settings),  # type: ignore[arg-type]
                        access_log=access_log)

        async def hold(_rid: str, i: int) -> None:
            if i == 0:
                seen.append(router.admission.in_flight)
                await gate.wait()

        for d in ds:
            d.decode_hold = hold
        async with serving(router.app()) as url, aiohttp.ClientSession() as http:
            yield Bed(url, router, ps, ds, gate, http, seen)


async def post(b: Bed, prompt: str = "x") -> tuple[int, dict[str, str], bytes]:
    async with b.http.post(b.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}) as r:
        return r.status, dict(r.headers), await r.read()


async def until(predicate: Callable[[], bool], turns: int = 5000) -> None:
    """Until `predicate()`: the router's queue has no event to await, and a request crosses the loopback to it in a
    few event-loop turns (no time passes); after `turns` of them it is not going to."""
    for _ in range(turns):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


def sample(text: str, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


def settled(router: Router) -> bool:
    a = router.admission
    return a.in_flight == 0 and a.waiting == 0 and router.pool.outstanding == {}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("total, per_engine, admitted", [(3, 2, 3), (10, 1, 2), (0, 2, 4)])
async def test_a_burst_never_has_more_in_flight_than_the_bounds_and_the_rest_is_served_once_slots_free(
        total, per_engine, admitted):
    """12 requests at once on 2 prefills and 2 decodes: `admitted` run (the total, or 2 decodes x the per-engine
    bound, whichever binds first), the rest wait, and every one is served once the decode legs answer."""
    async with bed(2, 2, max_inflight=total, max_inflight_per_engine=per_engine, max_queue=50,
                   queue_wait=30) as b:
        burst = [asyncio.create_task(post(b, f"r{i}")) for i in range(12)]
        await until(lambda: sum(d.active for d in b.decodes) == admitted
                    and b.router.admission.waiting == 12 - admitted)
        assert b.router.admission.in_flight == admitted
        b.gate.set()
        answers = await asyncio.gather(*burst)
        assert [status for status, _, _ in answers] == [200] * 12
        assert all(e.peak <= per_engine for e in b.engines())
        assert sum(d.peak for d in b.decodes) >= admitted  # the bound was reached, not just respected
        assert max(b.seen_in_flight) <= (total or 12)
        await until(lambda: settled(b.router))  # nothing leaks: every slot came back
        async with b.http.get(b.url + "/metrics") as r:
            text = await r.text()
        assert sample(text, "disagg_router_admitted_total") == 12
        assert sample(text, "disagg_router_queued_total") == 12 - admitted
        assert sample(text, "disagg_router_rejected_total", reason="queue_full") == 0
        assert sample(text, "disagg_router_inflight_requests") == 0


@pytest.mark.timeout(30)
async def test_waiting_requests_are_served_in_the_order_they_came():
    async with bed(max_inflight_per_engine=1, queue_wait=30) as b:
        first = asyncio.create_task(post(b, "r0"))
        await b.decodes[0].wait_for(lambda: b.decodes[0].active == 1)
        rest = []
        for i in range(1, 6):
            rest.append(asyncio.create_task(post(b, f"r{i}")))
            await until(lambda i=i: b.router.admission.waiting == i)  # queued before the next one comes
        b.gate.set()
        assert [s for s, _, _ in await asyncio.gather(first, *rest)] == [200] * 6
        assert [leg.body["prompt"] for leg in b.decodes[0].legs] == [f"r{i}" for i in range(6)]
        assert [leg.body["prompt"] for leg in b.prefills[0].legs] == [f"r{i}" for i in range(6)]
        assert b.decodes[0].peak == 1


@pytest.mark.timeout(30)
async def test_a_full_queue_is_a_429_at_once_with_retry_after_in_the_openai_format_and_logged(tmp_path: Path):
    log = tmp_path / "access.jsonl"
    access = AccessLog.open(str(log))
    async with bed(access_log=access, max_inflight=1, max_queue=1, queue_wait=2.5) as b:
        running = asyncio.create_task(post(b, "running"))
        await b.decodes[0].wait_for(lambda: b.decodes[0].active == 1)
        waiting = asyncio.create_task(post(b, "waiting"))
        await until(lambda: b.router.admission.waiting == 1)
        status, headers, body = await post(b, "refused")
        assert status == 429 and headers["Retry-After"] == "3"  # whole seconds: the deadline, rounded up
        error = json.loads(body)["error"]
        assert error["code"] == 429 and error["type"] == "overloaded_error" and "retry later" in error["message"]
        # Junk is still the client's fault, whatever the load: refused before admission, with its own status.
        async with b.http.post(b.url + "/v1/completions", data=b"{", headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400
        async with b.http.get(b.url + "/metrics") as r:
            text = await r.text()
        assert sample(text, "disagg_router_rejected_total", reason="queue_full") == 1
        assert sample(text, "disagg_router_queue_length") == 1
        assert sample(text, "disagg_router_inflight_requests") == 1
        assert sample(text, "disagg_router_inflight_legs", role="decode") == 1
        assert sample(text, "disagg_router_inflight_limit", scope="total") == 1
        assert sample(text, "disagg_router_queue_limit") == 1
        assert sample(text, "disagg_router_requests_total", mode="push", endpoint="completions", status="429") == 1
        b.gate.set()
        assert [(await t)[0] for t in (running, waiting)] == [200, 200]
        assert all("refused" not in leg.body["prompt"] for e in b.engines() for leg in e.legs)
    access.close()
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    [refused] = [line for line in lines if line["status"] == 429]
    assert refused["attempts"] == 0 and refused["request_id"] is None and "overloaded" in refused["error"]
    assert sorted(line["status"] for line in lines) == [200, 200, 400, 429]


@pytest.mark.timeout(30)
async def test_a_request_that_waits_past_the_deadline_is_a_429_and_frees_nothing_it_did_not_hold():
    async with bed(max_inflight_per_engine=1, queue_wait=0.2) as b:
        running = asyncio.create_task(post(b, "running"))
        await b.decodes[0].wait_for(lambda: b.decodes[0].active == 1)
        loop = asyncio.get_running_loop()
        start = loop.time()
        status, headers, body = await post(b, "late")
        assert status == 429 and loop.time() - start >= 0.2 and headers["Retry-After"] == "1"
        assert "within 0.2 s" in json.loads(body)["error"]["message"]
        assert b.router.admission.rejected == {"queue_full": 0, "deadline": 1}
        assert b.router.pool.outstanding == {"d-0": 1}  # the running request's decode leg, nothing else
        b.gate.set()
        assert (await running)[0] == 200
        await until(lambda: settled(b.router))


@pytest.mark.timeout(30)
async def test_a_client_gone_while_queued_leaves_the_queue_takes_no_slot_and_the_next_in_line_is_served():
    async with bed(max_inflight=1, queue_wait=30) as b:
        running = asyncio.create_task(post(b, "running"))
        await b.decodes[0].wait_for(lambda: b.decodes[0].active == 1)
        gone = asyncio.create_task(post(b, "gone"))
        await until(lambda: b.router.admission.waiting == 1)
        after = asyncio.create_task(post(b, "after"))
        await until(lambda: b.router.admission.waiting == 2)
        gone.cancel()  # the client closes its connection
        await until(lambda: b.router.admission.waiting == 1)
        assert b.router.admission.in_flight == 1
        b.gate.set()
        assert [(await t)[0] for t in (running, after)] == [200, 200]
        assert all(leg.body["prompt"] != "gone" for e in b.engines() for leg in e.legs)
        await until(lambda: settled(b.router))
        assert b.router.admission.admitted == 2


@pytest.mark.timeout(30)
async def test_requests_waiting_for_a_pair_count_toward_the_total():
    """No pair yet (an engine restarting): the first request waits for one (pair wait) holding its slot, so with
    one slot the next one waits in the queue and is refused at its deadline; the first is served once a pair is
    advertised."""
    board = KvBoard()
    p, d = StubEngine("p-0", "prefill", board=board), StubEngine("d-0", "decode", board=board)
    engines: list = []
    router = Router(EnginePool("push", lambda: engines),
                    Settings(mode="push", pair_wait=10, max_inflight=1, queue_wait=0.1))
    async with stub_engines(p, d), serving(router.app()) as url, aiohttp.ClientSession() as http:
        async def one(prompt: str) -> int:
            async with http.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}) as r:
                return r.status
        first = asyncio.create_task(one("first"))
        await until(lambda: router.admission.in_flight == 1)
        assert await one("second") == 429
        engines.extend([p.advertisement(), d.advertisement()])
        assert await first == 200
        assert [leg.body["prompt"] for leg in d.legs] == ["first"]
        await until(lambda: settled(router))


def test_flags_defaults_match_the_settings_and_refuse_junk():
    import argparse

    p = argparse.ArgumentParser()
    flags.add_arguments(p)
    args = p.parse_args(["--engines-file", "x"])
    s = Settings()
    assert (args.max_inflight, args.max_inflight_per_engine, args.max_queue, args.queue_wait_seconds) == \
        (s.max_inflight, s.max_inflight_per_engine, s.max_queue, s.queue_wait)
    for bad in (["--max-inflight", "-1"], ["--max-queue", "x"], ["--queue-wait-seconds", "nan"],
                ["--queue-wait-seconds", "-1"], ["--max-inflight-per-engine", "1.5"]):
        with pytest.raises(SystemExit):
            p.parse_args(["--engines-file", "x", *bad])
    assert math.isfinite(args.queue_wait_seconds)
