"""The router's retry: a failed prefill cancels the decode leg and the request is retried once, on another
prefill engine; a decode that fails before the client got anything is retried once on another pair, or on the same
one when no other comes within `retry_elsewhere` and a probe finds it alive after the failure (the only decode of a
1P1D deployment), never on one that stopped answering. A router on
127.0.0.1 in front of stand-in engines (tests/support/stub_engines.py): the decode stand-in waits for its KV on a
board the prefill stand-ins post to, as a push-mode decode waits for prefill's WRITE, so a decode leg whose
prefill failed hangs until the router cancels it."""
from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
from multidict import CIMultiDict

from disagg.connector.router.app import DECODE_HEADER, PREFILL_HEADER, Router, Settings
from disagg.connector.router.engine_pool import EnginePool
from support.stub_engines import KvBoard, StubEngine, serving, stub_engines

BODY = {"model": "tiny", "prompt": "x", "max_tokens": 2}


@contextlib.asynccontextmanager
async def deployment(mode: str) -> AsyncIterator[tuple[str, Router, StubEngine, StubEngine, StubEngine]]:
    """Prefill stand-ins p-a and p-b (p-a is chosen first: same load, lower id) and decode stand-in d-1."""
    board = KvBoard()
    p_a, p_b = (StubEngine(n, "prefill", mode=mode, board=board) for n in ("p-a", "p-b"))
    d_1 = StubEngine("d-1", "decode", mode=mode, board=board)
    async with stub_engines(p_a, p_b, d_1):
        engines = [p_a.advertisement(), p_b.advertisement(), d_1.advertisement()]
        router = Router(EnginePool(mode, lambda: engines), Settings(mode=mode))
        async with serving(router.app()) as url:
            yield url, router, p_a, p_b, d_1


def metric(router: Router, name: str, **labels: str) -> float:
    return router.m.registry.get_sample_value(name, labels) or 0.0


async def post(url: str, stream: bool = False) -> tuple[int, CIMultiDict, bytes]:
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json={**BODY, "stream": stream}) as r:
        return r.status, r.headers.copy(), await r.read()  # case-insensitive


@pytest.mark.timeout(30)
@pytest.mark.parametrize("stream", [False, True])
async def test_push_a_failed_prefill_cancels_its_decode_leg_and_is_retried_once_elsewhere(stream):
    async with deployment("push") as (url, router, p_a, p_b, d_1):
        p_a.fail_status = 500
        # p-a fails only once the decode leg it would have fed has reached d-1, so there is a leg to cancel.
        p_a.hold = lambda rid: d_1.wait_for(lambda: d_1.received(rid))
        status, headers, body = await post(url, stream)
        assert status == 200, body
        assert (headers[PREFILL_HEADER], headers[DECODE_HEADER]) == ("p-b", "d-1")
        [failed] = p_a.legs
        [served] = p_b.legs
        assert headers["X-Request-Id"] == served.request_id != failed.request_id  # a new id for the retry
        await d_1.wait_for(lambda: failed.request_id in d_1.cancelled)  # the first decode leg, aborted
        assert [leg.request_id for leg in d_1.legs] == [failed.request_id, served.request_id]
        assert d_1.cancelled == [failed.request_id]
        # The decode legs named the prefill engine of their own attempt.
        assert [leg.params["remote_engine_id"] for leg in d_1.legs] == ["p-a", "p-b"]
        assert metric(router, "disagg_router_prefill_retries_total") == 1
        assert metric(router, "disagg_router_upstream_errors_total", role="prefill", kind="status") == 1
        assert "p-a" not in router.pool.down  # it answered: an error status is no sign of a dead engine


@pytest.mark.timeout(30)
async def test_push_retries_only_once_then_502():
    async with deployment("push") as (url, router, p_a, p_b, d_1):
        for p in (p_a, p_b):
            p.fail_status = 503
            p.hold = lambda rid: d_1.wait_for(lambda: d_1.received(rid))
        status, _, body = await post(url)
        assert status == 502 and b"upstream failure" in body
        assert (len(p_a.legs), len(p_b.legs), len(d_1.legs)) == (1, 1, 2)
        await d_1.wait_for(lambda: len(d_1.cancelled) == 2)
        assert metric(router, "disagg_router_prefill_retries_total") == 1
        assert metric(router, "disagg_router_requests_total", mode="push", endpoint="completions", status="502") == 1


@pytest.mark.timeout(30)
async def test_push_a_prefill_that_refuses_the_request_is_not_retried():
    """A 4xx from prefill is the client's fault: the same body would be refused anywhere."""
    async with deployment("push") as (url, router, p_a, p_b, d_1):
        p_a.fail_status = 400
        p_a.hold = lambda rid: d_1.wait_for(lambda: d_1.received(rid))
        status, _, body = await post(url)
        assert status == 400 and b"stand-in p-a fails" in body
        assert (len(p_a.legs), len(p_b.legs)) == (1, 0)
        await d_1.wait_for(lambda: d_1.cancelled == [p_a.legs[0].request_id])
        assert metric(router, "disagg_router_prefill_retries_total") == 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("param", "status", "tried"), [("model", 404, (1, 0)), (None, 200, (1, 1))])
async def test_a_prefill_404_for_the_model_is_the_clients_and_one_for_a_path_is_the_engines(param, status, tried):
    """vLLM answers a model it does not serve with a 404 naming `param: model`: any engine would, so the client gets
    it. A 404 without it is an engine lacking the endpoint, and another pair is tried."""
    async with deployment("push") as (url, router, p_a, p_b, d_1):
        p_a.fail_status, p_a.fail_param = 404, param
        p_a.hold = lambda rid: d_1.wait_for(lambda: d_1.received(rid))
        got, _, body = await post(url)
        assert got == status, body
        assert (len(p_a.legs), len(p_b.legs)) == tried
        if param == "model":
            assert b"stand-in p-a fails" in body


@pytest.mark.timeout(30)
async def test_a_dead_prefill_leaves_rotation_and_the_request_is_served_by_another():
    async with deployment("push") as (url, router, p_a, p_b, d_1):
        await p_a.stop()  # connection refused from now on
        status, headers, _ = await post(url)
        assert status == 200 and headers[PREFILL_HEADER] == "p-b"
        assert router.pool.down == {"p-a"}
        status, headers, _ = await post(url)  # the next request does not try p-a at all
        assert status == 200 and headers[PREFILL_HEADER] == "p-b"
        assert metric(router, "disagg_router_prefill_retries_total") == 1
        assert metric(router, "disagg_router_upstream_errors_total", role="prefill", kind="ClientConnectorError") == 1


@pytest.mark.timeout(30)
async def test_pull_sends_decode_only_after_a_good_prefill_with_its_params_unchanged():
    async with deployment("pull") as (url, router, p_a, p_b, d_1):
        p_a.fail_status = 500
        status, headers, _ = await post(url, stream=True)
        assert status == 200 and (headers[PREFILL_HEADER], headers[DECODE_HEADER]) == ("p-b", "d-1")
        [leg] = d_1.legs  # nothing was sent to decode for the failed attempt
        assert leg.request_id == p_b.legs[0].request_id and d_1.cancelled == []
        assert leg.params == {"do_remote_prefill": True, "do_remote_decode": False,
                              "remote_request_id": f"cmpl-{leg.request_id}-0", "remote_engine_id": "p-b",
                              "remote_block_ids": [1, 2], "remote_host": "127.0.0.1", "remote_port": 5600,
                              "tp_size": 1}
        assert metric(router, "disagg_router_prefill_retries_total") == 1


@pytest.mark.timeout(30)
@pytest.mark.parametrize("stream", [False, True])
async def test_a_decode_that_fails_before_answering_is_retried_once_on_another_pair(stream):
    """A stopping vLLM answers 500 before its engine has left the rendezvous: the request runs again, both legs
    with a new id, on a pair without that decode. The client sees one 200."""
    board = KvBoard()
    p_a = StubEngine("p-a", "prefill", board=board)
    d_1, d_2 = StubEngine("d-1", "decode", board=None), StubEngine("d-2", "decode", board=board)
    d_1.decode_status = 500
    async with stub_engines(p_a, d_1, d_2):
        engines = [p_a.advertisement(), d_1.advertisement(), d_2.advertisement()]
        router = Router(EnginePool("push", lambda: engines), Settings(mode="push"))
        async with serving(router.app()) as url:
            status, headers, body = await post(url, stream)
    assert status == 200, body
    assert (headers[PREFILL_HEADER], headers[DECODE_HEADER]) == ("p-a", "d-2")
    [failed], [served] = d_1.legs, d_2.legs
    assert [leg.request_id for leg in p_a.legs] == [failed.request_id, served.request_id]
    assert served.request_id != failed.request_id == p_a.legs[0].request_id
    assert metric(router, "disagg_router_decode_retries_total") == 1
    assert metric(router, "disagg_router_prefill_retries_total") == 0
    assert metric(router, "disagg_router_upstream_errors_total", role="decode", kind="status") == 1
    assert "d-1" not in router.pool.down  # it answered: its probes decide whether it stays


@pytest.mark.timeout(30)
async def test_the_retry_waits_for_a_pair_as_the_first_attempt_does():
    """1P1D while the decode pod is replaced: the old decode refuses, and the request waits (pairWaitSeconds) for
    the new decode to be advertised instead of failing."""
    board = KvBoard()
    p_a = StubEngine("p-a", "prefill", board=board)
    old, new = StubEngine("d-old", "decode", board=None), StubEngine("d-new", "decode", board=board)
    old.decode_status = 500
    async with stub_engines(p_a, old, new):
        engines = [p_a.advertisement(), old.advertisement()]
        router = Router(EnginePool("push", lambda: engines), Settings(mode="push", pair_wait=10))
        async with serving(router.app()) as url:
            request = asyncio.create_task(post(url))
            await old.wait_for(lambda: len(old.legs) == 1)
            engines[1:] = [new.advertisement()]  # the old engine leaves the rendezvous, the new one arrives
            status, headers, body = await request
    assert status == 200, body
    assert headers[DECODE_HEADER] == "d-new"
    assert metric(router, "disagg_router_decode_retries_total") == 1


@pytest.mark.timeout(30)
async def test_a_failed_decode_with_no_other_pair_is_a_502_after_one_attempt():
    """pairWaitSeconds 0: no wait for another pair, nor for a probe to prove the failed decode alive."""
    async with deployment("push") as (url, router, p_a, p_b, d_1):
        d_1.board = None
        d_1.decode_status = 500
        status, _, body = await post(url)
        assert status == 502 and b"decode engine d-1" in body
        assert (len(p_a.legs), len(p_b.legs), len(d_1.legs)) == (1, 0, 1)
        assert metric(router, "disagg_router_decode_retries_total") == 0


@pytest.mark.timeout(30)
async def test_a_decode_that_failed_once_and_is_the_only_one_serves_the_retry_instead_of_a_502_after_the_wait():
    """1P1D: the engine that failed is still advertised and answers its probes, and no other comes. The retry waits
    `retry_elsewhere` for another pair and for a probe to find the engine alive, then takes the same pair, instead
    of waiting the whole pair wait for a pair without it and answering 502 (what the soak saw: 502s exactly
    pairWaitSeconds after the request came)."""
    board = KvBoard()
    p_a, d_1 = StubEngine("p-a", "prefill", board=board), StubEngine("d-1", "decode", board=board)
    d_1.decode_failures = 1
    async with stub_engines(p_a, d_1):
        engines = [p_a.advertisement(), d_1.advertisement()]
        router = Router(EnginePool("push", lambda: engines),
                        Settings(mode="push", pair_wait=60, retry_elsewhere=0.3))
        async with serving(router.app()) as url:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            status, headers, body = await post(url)
            took = loop.time() - t0
    assert status == 200, body
    assert headers[DECODE_HEADER] == "d-1" and len(d_1.legs) == 2
    assert 0.3 <= took < 30, took  # waited for another pair first, and not for the whole pair wait
    assert metric(router, "disagg_router_decode_retries_total") == 1


@pytest.mark.timeout(30)
async def test_a_decode_that_refuses_the_request_is_not_retried():
    async with deployment("push") as (url, router, p_a, p_b, d_1):
        d_1.board = None
        d_1.decode_status = 400
        status, _, body = await post(url)
        assert status == 400 and b"stand-in d-1 fails" in body
        assert len(d_1.legs) == 1
        assert metric(router, "disagg_router_decode_retries_total") == 0


@pytest.mark.timeout(30)
async def test_a_decode_that_dies_mid_stream_ends_the_stream_with_an_error_event():
    """The client already has the 200 and the first tokens: the router cannot send another status. It ends the
    stream with an OpenAI-style error event and a proper end (before: a second status line inside the chunked
    body, which clients reject as a protocol error)."""
    async with deployment("push") as (url, router, p_a, p_b, d_1):
        d_1.decode_dies_after = 1

        async def once_relayed(_rid: str, i: int) -> None:
            # The death must follow the router's read of the first chunk: a connection lost first would fail that
            # read (a death before the first token, retried on another pair).
            while i == 1 and not metric(router, "disagg_router_ttft_seconds_count", mode="push"):
                await asyncio.sleep(0.01)  # an in-process counter has nothing to await

        d_1.decode_hold = once_relayed
        status, headers, body = await post(url, stream=True)
        assert status == 200 and headers[DECODE_HEADER] == "d-1"
        events = [json.loads(line.removeprefix(b"data: ")) for line in body.split(b"\n\n") if line]
        assert events[0]["choices"][0]["text"] == "b"
        assert events[1]["error"]["code"] == 502 and "decode engine d-1" in events[1]["error"]["message"]
        assert len(events) == 2
        assert metric(router, "disagg_router_upstream_errors_total", role="decode", kind="ClientPayloadError") == 1
        assert metric(router, "disagg_router_decode_retries_total") == 0
        assert metric(router, "disagg_router_prefill_retries_total") == 0


def events(body: bytes) -> list[dict]:
    return [json.loads(e.removeprefix(b"data: ")) for e in body.split(b"\n\n") if e and e != b"data: [DONE]"]


@pytest.mark.timeout(30)
async def test_a_decode_that_dies_after_its_headers_and_before_its_first_token_is_retried_on_another_pair():
    """vLLM sends its 200 and headers before the first token. The router starts the client's answer only with
    decode's first chunk, so a decode that dies in between is retried like one that refused: the client sees one
    200 with the whole stream of the other pair, and no error event."""
    board = KvBoard()
    p_a = StubEngine("p-a", "prefill", board=board)
    d_1, d_2 = StubEngine("d-1", "decode", board=board), StubEngine("d-2", "decode", board=board)
    d_1.decode_dies_after = 0
    async with stub_engines(p_a, d_1, d_2):
        engines = [p_a.advertisement(), d_1.advertisement(), d_2.advertisement()]
        router = Router(EnginePool("push", lambda: engines), Settings(mode="push"))
        async with serving(router.app()) as url, asyncio.timeout(10):
            status, headers, body = await post(url, stream=True)
    assert status == 200, body
    assert (headers[PREFILL_HEADER], headers[DECODE_HEADER]) == ("p-a", "d-2")
    assert [e["choices"][0]["text"] for e in events(body)] == ["b", "c"] and body.endswith(b"data: [DONE]\n\n")
    [failed], [served] = d_1.legs, d_2.legs
    assert headers["X-Request-Id"] == served.request_id != failed.request_id
    assert metric(router, "disagg_router_decode_retries_total") == 1
    assert metric(router, "disagg_router_upstream_errors_total", role="decode", kind="ClientPayloadError") == 1
    assert metric(router, "disagg_router_requests_total", mode="push", endpoint="completions", status="200") == 1


@pytest.mark.timeout(30)
async def test_a_decode_that_dies_before_its_first_token_with_no_other_pair_is_a_clean_502():
    async with deployment("push") as (url, router, p_a, p_b, d_1):
        d_1.decode_dies_after = 0
        async with asyncio.timeout(10):
            status, headers, body = await post(url, stream=True)
        assert status == 502 and headers["Content-Type"].startswith("application/json")
        assert json.loads(body)["error"]["code"] == 502 and "decode engine d-1" in json.loads(body)["error"]["message"]
        assert len(d_1.legs) == 1 and metric(router, "disagg_router_decode_retries_total") == 0


@pytest.mark.timeout(30)
async def test_a_decode_that_stalls_after_its_first_token_ends_the_stream_with_an_error_event_not_a_hang():
    """The client has the first token: no retry is possible. A decode that stops sending (a hung engine) ends the
    stream after the read timeout with the error event and the stream's end; the leg is aborted."""
    board = KvBoard()
    p_a = StubEngine("p-a", "prefill", board=board)
    d_1 = StubEngine("d-1", "decode", board=board)

    async def stall_after_first(_rid: str, i: int) -> None:
        if i == 1:
            await asyncio.Event().wait()

    d_1.decode_hold = stall_after_first
    async with stub_engines(p_a, d_1):
        engines = [p_a.advertisement(), d_1.advertisement()]
        router = Router(EnginePool("push", lambda: engines), Settings(mode="push", request_timeout=0.3))
        async with serving(router.app()) as url, asyncio.timeout(10):
            status, _, body = await post(url, stream=True)
            await d_1.wait_for(lambda: d_1.cancelled == [d_1.legs[0].request_id])
    assert status == 200
    [first, error] = events(body)
    assert first["choices"][0]["text"] == "b"
    assert error["error"]["code"] == 502 and "SocketTimeoutError" in error["error"]["message"]
    assert router.pool.down == set()


@pytest.mark.timeout(30)
async def test_a_decode_that_failed_and_stopped_answering_its_probes_is_not_tried_again():
    """The soak's kill-decode: the engine's address is gone, so connections and probes time out and it stays
    advertised (and not yet down) for a while. No probe proves it alive after the failure: the retry keeps waiting
    for another decode, and takes the replacement when it comes."""
    board = KvBoard()
    p_a, d_old, d_new = (StubEngine("p-a", "prefill", board=board), StubEngine("d-old", "decode", board=board),
                         StubEngine("d-new", "decode", board=board))
    d_old.decode_failures = 1
    async with stub_engines(p_a, d_old, d_new):
        engines = [p_a.advertisement(), d_old.advertisement()]
        pool = EnginePool("push", lambda: engines, probe_timeout=0.2)
        router = Router(pool, Settings(mode="push", pair_wait=20, retry_elsewhere=0.2))
        async with serving(router.app()) as url:
            d_old.health_hangs = True  # from now on its probes time out, as a killed pod's do
            request = asyncio.create_task(post(url))
            await d_old.wait_for(lambda: len(d_old.legs) == 1)
            probed = d_old.probes
            # Three probe rounds since the failure, each timing out: long past retry_elsewhere, and the retry has
            # not gone back to d-old.
            await d_old.wait_for(lambda: d_old.probes >= probed + 3)
            assert len(d_old.legs) == 1 and not request.done()
            engines.append(d_new.advertisement())  # its replacement
            status, headers, body = await request
    assert status == 200, body
    assert headers[DECODE_HEADER] == "d-new" and len(d_old.legs) == 1
