"""A client that goes away while its prefill is still computing takes both legs with it at once.

In push mode the decode leg is answered (its 200 and headers, as vLLM sends them) long before its KV comes. When
the client leaves before the relay starts, that open decode stream must be closed too: vLLM aborts a request
only when its connection closes, and a decode left waiting holds its KV blocks until its registration timeout,
which a few aborts a second turn into a stalled deployment. A router on 127.0.0.1 in front of stand-in engines
(tests/support/stub_engines.py)."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest

from disagg.connector.router.app import Router, Settings
from disagg.connector.router.engine_pool import EnginePool
from support.stub_engines import KvBoard, StubEngine, serving, stub_engines


@pytest.mark.timeout(30)
@pytest.mark.parametrize("stream", [True, False])
async def test_a_client_gone_during_prefill_aborts_both_legs_at_once(stream):
    board, prefill_may_answer = KvBoard(), asyncio.Event()
    prefill = StubEngine("p-1", "prefill", board=board)
    decode = StubEngine("d-1", "decode", board=board)
    prefill.hold = lambda _rid: prefill_may_answer.wait()  # prefill is still computing when the client leaves
    async with stub_engines(prefill, decode):
        engines = [prefill.advertisement(), decode.advertisement()]
        router = Router(EnginePool("push", lambda: engines), Settings(mode="push"))
        async with serving(router.app()) as url, aiohttp.ClientSession() as session:
            body = {"model": "tiny", "prompt": "x", "max_tokens": 2, "stream": stream}
            client = asyncio.create_task(session.post(url + "/v1/completions", json=body))
            await decode.wait_for(lambda: len(decode.legs) == 1)  # both legs are out (push: at once)
            await prefill.wait_for(lambda: len(prefill.legs) == 1)
            client.cancel()  # the client goes away
            (leg,) = decode.legs
            await decode.wait_for(lambda: leg.request_id in decode.cancelled)
            await prefill.wait_for(lambda: leg.request_id in prefill.cancelled)
            prefill_may_answer.set()


async def test_a_leg_that_failed_as_its_attempt_ended_leaves_no_unretrieved_exception():
    """The client goes away in the same instant a leg fails (both at a 60 s timeout, under load): the attempt
    ends without awaiting that leg. Its exception must be retrieved at the attempt's end, or asyncio logs "Task
    exception was never retrieved" as an error for a request that was already accounted for."""
    import gc

    from disagg.connector.router.app import _settle

    loop = asyncio.get_running_loop()
    unretrieved: list[dict] = []
    loop.set_exception_handler(lambda _loop, ctx: unretrieved.append(ctx))

    async def fails() -> None:
        raise aiohttp.ServerTimeoutError("Timeout on reading data from socket")

    async def runs() -> None:
        await asyncio.Event().wait()

    for settle in (False, True):  # without _settle, the case it guards against: one error logged
        failed, running = loop.create_task(fails()), loop.create_task(runs())
        await asyncio.wait([failed])  # it ends with its exception, which waiting does not retrieve
        assert not running.done()
        if settle:
            _settle(failed, None, running)
        else:
            running.cancel()
        await asyncio.wait([running])
        assert running.cancelled()
        del failed, running
        gc.collect()  # a task's unretrieved exception is reported as it is collected
        assert len(unretrieved) == (0 if settle else 1), unretrieved
        unretrieved.clear()
