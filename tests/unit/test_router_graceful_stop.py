"""`disagg router` stops gracefully on SIGTERM: /readyz answers 503 while it still serves for --stop-delay-seconds
(a Service's endpoints lag the SIGTERM), then it stops listening and the requests in flight, streams included,
finish within --drain-seconds; then it exits. A real router process (tests/support/engines.py Service) in front of
stand-in engines served in this process, whose decode streams its first token and then waits for the test."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from support.engines import Service
from support.stub_engines import KvBoard, StubEngine, stub_engines

TOKENS = [f"t{i} " for i in range(8)]
BODY = {"model": "tiny", "prompt": "x", "max_tokens": len(TOKENS), "stream": True}
FULL = "".join(TOKENS)


@contextlib.asynccontextmanager
async def router(tmp_path: Path, gate: asyncio.Event, *flags: str) -> AsyncIterator[tuple[Service, StubEngine]]:
    """A push pair of stand-ins behind a `disagg router` child process. Every decode leg sends its first token,
    then waits for `gate`."""
    board = KvBoard()
    p_a, d_1 = StubEngine("p-a", "prefill", board=board), StubEngine("d-1", "decode", board=board)
    d_1.tokens = TOKENS

    async def after_first_token(_rid: str, i: int) -> None:
        if i == 1:
            await gate.wait()

    d_1.decode_hold = after_first_token
    async with stub_engines(p_a, d_1):
        engines = tmp_path / "engines.json"
        engines.write_text(json.dumps([e.advertisement().model_dump(mode="json") for e in (p_a, d_1)]))
        svc = Service("router", ["router", "--mode", "push", "--engines-file", str(engines), *flags], tmp_path)
        await asyncio.to_thread(svc.start, "/readyz", 30, (200,))  # in a thread: the stand-ins answer its probes
        try:
            yield svc, d_1
        finally:
            await asyncio.to_thread(svc.stop, 1)


class Stream:
    """One streamed completion through the router, on a keep-alive connection of its own (a session of its own);
    `first` is set once its first token is in, `connection` is the response's Connection header."""

    def __init__(self, url: str) -> None:
        self.first = asyncio.Event()
        self.connection: str | None = None
        self.task = asyncio.create_task(self._run(url))

    async def _run(self, url: str) -> tuple[int, str, bool]:
        """(status, the text of every token, whether the stream ended with [DONE] and nothing else)."""
        text, clean = [], False
        async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=BODY) as r:
            self.connection = r.headers.get("Connection")
            buffer = b""
            async for chunk in r.content.iter_any():
                buffer += chunk
                *events, buffer = buffer.split(b"\n\n")
                for event in events:
                    payload = event.removeprefix(b"data: ")
                    if payload == b"[DONE]":
                        clean = True
                        continue
                    data = json.loads(payload)
                    if "error" in data:
                        return r.status, "".join(text), False
                    text.append(data["choices"][0]["text"])
                    self.first.set()
            return r.status, "".join(text), clean and not buffer


async def status_of(url: str) -> int | str:
    """On a new connection, as a client that a lagging Service sends here."""
    try:
        async with aiohttp.ClientSession() as s, s.get(url, timeout=aiohttp.ClientTimeout(total=5)) as r:
            return r.status
    except aiohttp.ClientConnectorError as e:
        return "refused" if isinstance(e.os_error, ConnectionRefusedError) else repr(e)


async def until_status(url: str, wanted: int | str, timeout: float = 10.0) -> None:
    """Another process's state has no event to await: ask it until it answers `wanted`."""
    last: int | str | None = None
    try:
        async with asyncio.timeout(timeout):
            while (last := await status_of(url)) != wanted:
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"{url} answered {last}, not {wanted}, for {timeout}s") from None


async def exit_code(svc: Service, timeout: float) -> int:
    assert svc.popen is not None
    return await asyncio.to_thread(svc.popen.wait, timeout)


@pytest.mark.timeout(60)
async def test_sigterm_finishes_the_streams_in_flight_and_refuses_new_connections_after_the_delay(tmp_path):
    gate = asyncio.Event()
    async with router(tmp_path, gate, "--stop-delay-seconds", "3", "--drain-seconds", "30") as (svc, d_1):
        streams = [Stream(svc.url) for _ in range(3)]
        async with asyncio.timeout(10):
            for st in streams:
                await st.first.wait()  # all three are mid-stream

        assert svc.popen is not None
        os.kill(svc.popen.pid, signal.SIGTERM)
        signalled = time.monotonic()
        # The delay: not ready, and a client the Service still sends here is served.
        await until_status(svc.url + "/readyz", 503)
        late = Stream(svc.url)
        async with asyncio.timeout(10):
            await late.first.wait()
        # Then the drain: new connections are refused while the streams in flight go on.
        await until_status(svc.url + "/livez", "refused")
        assert time.monotonic() - signalled >= 3
        assert not any(st.task.done() for st in [*streams, late])
        assert svc.exited() is None

        gate.set()
        async with asyncio.timeout(10):
            results = [await st.task for st in [*streams, late]]
        assert results == [(200, FULL, True)] * 4
        # Answers begun while stopping close their connection, so a keep-alive client reconnects elsewhere.
        assert [st.connection for st in streams] == [None] * 3 and late.connection == "close"
        assert await exit_code(svc, timeout=10) == 0  # once they are done, not at the drain's bound (30 s)
        assert d_1.cancelled == []
        assert len(d_1.legs) == 4


@pytest.mark.timeout(60)
async def test_what_is_still_in_flight_after_the_drain_is_cut_and_the_router_exits_within_the_bound(tmp_path):
    gate = asyncio.Event()  # never set: the stream would last forever
    async with router(tmp_path, gate, "--drain-seconds", "2") as (svc, d_1):
        stream = Stream(svc.url)
        async with asyncio.timeout(10):
            await stream.first.wait()

        assert svc.popen is not None
        os.kill(svc.popen.pid, signal.SIGTERM)
        signalled = time.monotonic()
        await until_status(svc.url + "/livez", "refused")  # no delay asked: refused at once
        assert await exit_code(svc, timeout=10) == 0
        took = time.monotonic() - signalled
        assert 2 <= took < 3, took  # the drain, then the exit
        with pytest.raises(aiohttp.ClientPayloadError):  # cut: the connection closed mid-answer
            await stream.task
        await d_1.wait_for(lambda: d_1.cancelled == [d_1.legs[0].request_id])  # the decode leg was aborted
