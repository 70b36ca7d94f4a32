"""The operator's reader of each deployment's rendezvous (operator/transport.py), against a real rendezvous
server on 127.0.0.1 and against addresses that never answer. No cluster."""
from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator

import pytest

from disagg.connector.rendezvous.auth import TokenAuth
from disagg.connector.rendezvous.client import RendezvousClient
from disagg.connector.rendezvous.server import RendezvousServer
from disagg.operator import names
from disagg.operator.status import EngineTransport, TransportReport
from disagg.operator.transport import DEFAULT_TEMPLATE, TransportPoller, check_template
from support.rendezvous import advert

TOKEN = "t0ken"
KEY = ("ml", "qwen")


@contextlib.asynccontextmanager
async def rendezvous() -> AsyncIterator[tuple[str, RendezvousClient]]:
    server = RendezvousServer(auth=TokenAuth(TOKEN), heartbeat_seconds=1)
    url = await server.start("127.0.0.1", 0)
    client = RendezvousClient(url, token=TOKEN)
    try:
        yield url, client
    finally:
        await client.close()
        await server.stop()


@contextlib.asynccontextmanager
async def silent_server(port: int = 0) -> AsyncIterator[int]:
    """Accepts connections and never answers: a rendezvous that hangs."""
    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(hold, "127.0.0.1", port)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        for w in held:
            w.close()
        server.close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


def test_default_template_is_the_in_cluster_service():
    assert DEFAULT_TEMPLATE == names.DEFAULT_RENDEZVOUS_TEMPLATE
    assert DEFAULT_TEMPLATE.format(name="qwen", namespace="ml") == names.rendezvous_url("qwen", "ml")
    assert check_template("http://127.0.0.1:8080") == "http://127.0.0.1:8080", "placeholders are optional"
    for bad in ("http://{cr}.svc", "{name}-rendezvous:8080", "http://{0}"):
        with pytest.raises(ValueError, match="rendezvous-url-template"):
            check_template(bad)


@pytest.mark.timeout(30)
async def test_reports_this_deployments_engines_and_calls_back_only_on_change():
    changes: list[tuple[str, str]] = []

    async def on_change(key):
        changes.append(key)

    async with rendezvous() as (url, writer):
        poller = TransportPoller(url, on_change=on_change)
        try:
            empty = await poller.refresh(KEY)
            assert empty == TransportReport(url=url, engines=()) and changes == [KEY]
            await writer.register(advert("qwen-prefill-0-u1", deployment="qwen", pod_name="qwen-prefill-0",
                                         transport="UCX"))
            await writer.register(advert("qwen-decode-0-u2", role="decode", deployment="qwen", transport=None))
            await writer.register(advert("other-prefill-0-u3", deployment="other", transport="UCX"))
            got = await poller.refresh(KEY)
            assert got.error is None
            assert got.engines == (EngineTransport("qwen-decode-0-u2", "decode", None),
                                   EngineTransport("qwen-prefill-0", "prefill", "UCX")), \
                "only this deployment's engines, named by pod when known"
            assert poller.report(KEY) == got and changes == [KEY, KEY]
            await poller.refresh(KEY)
            assert changes == [KEY, KEY], "an unchanged answer triggers nothing"
            await writer.register(advert("qwen-decode-0-u2", role="decode", deployment="qwen",
                                         transport="LIBFABRIC"))
            assert (await poller.refresh(KEY)).engines[0].transport == "LIBFABRIC" and len(changes) == 3
        finally:
            await poller.close()


@pytest.mark.timeout(30)
async def test_an_unreachable_rendezvous_is_an_answer_and_never_blocks_the_caller():
    changes: list[tuple[str, str]] = []

    async def on_change(key):
        changes.append(key)

    refused = TransportPoller(f"http://127.0.0.1:{closed_port()}", timeout=2, on_change=on_change)
    try:
        rep = await refused.refresh(KEY)
        assert rep.error == "connection failed" and rep.engines == () and changes == [KEY]
        await refused.refresh(KEY)
        assert changes == [KEY], "the same failure again is no change: no status pass, no write"
    finally:
        await refused.close()

    async with silent_server() as port:
        hung = TransportPoller(f"http://127.0.0.1:{port}", timeout=0.5, interval=60)
        try:
            t0 = time.monotonic()
            hung.request(KEY)  # what a status pass does: start a refresh, read the cache
            assert hung.report(KEY) is None
            assert time.monotonic() - t0 < 0.05, "a pass never waits for the rendezvous"
            async with asyncio.timeout(5):
                while hung.report(KEY) is None:
                    await asyncio.sleep(0.02)  # a background task, observable only by polling its result
            assert hung.report(KEY).error == "no answer in time"
            assert time.monotonic() - t0 < 2, "bounded by the timeout"
            polls = hung.polls
            hung.request(KEY)
            assert not hung._tasks and hung.polls == polls, "a recent answer is reused until the interval passes"
            hung.request(KEY, force=True)
            assert KEY in hung._tasks
        finally:
            await hung.close()


@pytest.mark.timeout(30)
async def test_something_else_answering_is_reported_by_status():
    async with rendezvous() as (url, _):
        wrong = TransportPoller(url + "/not-the-rendezvous")
        try:
            assert (await wrong.refresh(KEY)).error.startswith("HTTP 404")
        finally:
            await wrong.close()


@pytest.mark.timeout(30)
async def test_forget_drops_a_deleted_deployment():
    async with rendezvous() as (url, _):
        poller = TransportPoller(url)
        try:
            await poller.refresh(KEY)
            assert poller.report(KEY) is not None
            assert poller.keys() == {KEY}
            poller.forget(KEY)
            assert poller.report(KEY) is None and KEY not in poller._clients and poller.keys() == set()
        finally:
            await poller.close()


@pytest.mark.timeout(30)
async def test_a_forced_read_during_a_refresh_reads_again_after_it():
    """An engine registers while a refresh is in flight, after that refresh read the rendezvous: the forced request
    made then (a pass that saw the pod Ready) runs one more read, so the cache lists the engine without waiting
    for the next poll. The first read's answer is held back until after the registration."""
    async with rendezvous() as (url, writer):
        poller = TransportPoller(url, interval=3600)
        real_fetch, answered, release = poller.fetch, asyncio.Event(), asyncio.Event()

        async def slow_fetch(key):
            report = await real_fetch(key)
            if not release.is_set():
                answered.set()
                await release.wait()
            return report

        poller.fetch = slow_fetch  # type: ignore[method-assign]
        try:
            poller.request(KEY)
            await answered.wait()  # the first read has its (empty) answer, not yet delivered
            await writer.register(advert("qwen-prefill-0-u1", deployment="qwen", pod_name="qwen-prefill-0",
                                         pod_uid="u1", transport="UCX"))
            poller.request(KEY, force=True)
            release.set()
            async with asyncio.timeout(5):
                while KEY in poller._tasks:
                    await poller._tasks[KEY]
            assert poller.report(KEY).engines == (EngineTransport("qwen-prefill-0", "prefill", "UCX", "u1"),)
        finally:
            await poller.close()


@pytest.mark.timeout(30)
async def test_one_outage_seen_through_another_symptom_is_no_change():
    """A rendezvous that stays unreachable while the symptom changes (refused, then hanging) triggers no status
    pass: on kwok its name lookup sometimes outlasts the timeout, and every flip cost a status write per CR. Its
    recovery is a change."""
    changes: list[tuple[str, str]] = []

    async def on_change(key):
        changes.append(key)

    port = closed_port()
    poller = TransportPoller(f"http://127.0.0.1:{port}", timeout=0.5, on_change=on_change)
    server = RendezvousServer(auth=TokenAuth(TOKEN), heartbeat_seconds=1)
    try:
        refused = await poller.refresh(KEY)
        assert refused.error == "connection failed" and changes == [KEY]
        async with silent_server(port):
            assert (await poller.refresh(KEY)) == refused and changes == [KEY], "now it hangs: the same outage"
        await server.start("127.0.0.1", port)
        assert (await poller.refresh(KEY)).error is None and changes == [KEY, KEY]
    finally:
        await poller.close()
        await server.stop()
