"""The rendezvous HTTP server and its client, on real sockets on 127.0.0.1 (no cluster)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from disagg.connector.rendezvous.auth import KubernetesAuth, NoAuth, TokenAuth
from disagg.connector.rendezvous.client import EngineCache, EngineRegistration, RendezvousClient, RendezvousError
from disagg.connector.rendezvous.registry import Registry
from disagg.connector.rendezvous.server import RendezvousServer
from disagg.connector.wire.advertisement import WatchEvent
from support.rendezvous import advert, advert_json, next_event, task

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@contextlib.asynccontextmanager
async def serving(port: int = 0, **kw: Any) -> AsyncIterator[tuple[RendezvousServer, RendezvousClient]]:
    kw.setdefault("auth", TokenAuth(TOKEN))
    kw.setdefault("heartbeat_seconds", 0.2)
    kw.setdefault("expire_interval", 0.02)
    server = RendezvousServer(**kw)
    url = await server.start("127.0.0.1", port)
    client = RendezvousClient(url, token=TOKEN, timeout=5)
    try:
        yield server, client
    finally:
        await client.close()
        await server.stop()


async def raw(method: str, url: str, *, body: bytes | str | None = None, headers: dict[str, str] | None = None,
              ) -> tuple[int, dict[str, Any] | None, dict[str, str]]:
    async with aiohttp.ClientSession() as s:
        async with s.request(method, url, data=body, headers=headers) as resp:
            data = await resp.read()
            return resp.status, (json.loads(data) if data else None), dict(resp.headers)


def metrics(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def watch_lines(url: str, params: str = "") -> AsyncIterator[dict[str, Any]]:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/v1/watch{params}") as resp:
            assert resp.status == 200, await resp.text()
            assert resp.headers["Content-Type"].startswith("application/x-ndjson")
            async for line in resp.content:
                yield json.loads(line)


@pytest.mark.timeout(20)
async def test_register_renew_list_get_deregister():
    async with serving() as (server, client):
        a = advert("qwen-prefill-0-a")
        created = await client.register(a)
        assert (created.result, created.version, created.engine) == ("created", 1, a)
        assert 29 < created.expires_in <= 30
        assert (await client.register(a)).result == "renewed"
        modified = await client.register(advert("qwen-prefill-0-a", transport="LIBFABRIC"))
        assert (modified.result, modified.version) == ("modified", 2)
        assert (await client.renew("qwen-prefill-0-a")).result == "renewed"
        await client.register(advert("qwen-decode-0-b", role="decode", layout_key="other"))

        everything = await client.list()
        assert [e.engine_id for e in everything.engines] == ["qwen-decode-0-b", "qwen-prefill-0-a"]
        assert everything.version == 3 and everything.epoch == server.registry.epoch
        assert [e.engine_id for e in (await client.list(role="decode")).engines] == ["qwen-decode-0-b"]
        assert [e.engine_id for e in (await client.list(layout_key="other")).engines] == ["qwen-decode-0-b"]
        assert (await client.get("qwen-prefill-0-a")).transport == "LIBFABRIC"

        assert await client.deregister("qwen-prefill-0-a") is True
        assert await client.deregister("qwen-prefill-0-a") is False  # 404
        assert await client.get("qwen-prefill-0-a") is None
        with pytest.raises(RendezvousError) as e:
            await client.renew("qwen-prefill-0-a")
        assert e.value.status == 404 and e.value.reason == "not_found"
        health = await client.health()
        assert health["status"] == "ok" and health["engines"] == 1 and health["auth"] == "token"


@pytest.mark.timeout(20)
async def test_watch_delivers_added_then_expired_within_a_heartbeat():
    async with serving(heartbeat_seconds=0.2) as (server, client):
        events = client.watch()
        first = await next_event(events, skip=())
        assert first.type == "RESET" and first.version == 0 and first.epoch == server.registry.epoch
        assert (await next_event(events, skip=())).type == "BOOKMARK"  # end of the (empty) snapshot
        registered_at = time.monotonic()
        await client.register(advert("short", lease_seconds=0.3))
        added = await next_event(events)
        assert (added.type, added.version, added.engine.engine_id) == ("ADDED", 1, "short")
        expired = await next_event(events, timeout=2)
        waited = time.monotonic() - registered_at
        assert (expired.type, expired.version, expired.engine.engine_id) == ("EXPIRED", 2, "short")
        assert 0.3 <= waited < 0.3 + server.heartbeat_seconds, waited
        assert (await client.list()).engines == []
        await events.aclose()


@pytest.mark.timeout(20)
async def test_watch_resumes_from_since_and_snapshots_when_too_old():
    async with serving(log_size=2) as (server, client):
        epoch = server.registry.epoch
        for name in ("a", "b", "c"):
            await client.register(advert(name))  # versions 1..3; the log keeps 2..3, so since >= 1 resumes
        for since, expected in ((2, [("ADDED", 3, "c")]), (1, [("ADDED", 2, "b"), ("ADDED", 3, "c")]), (3, [])):
            lines = watch_lines(server.url, f"?since={since}&epoch={epoch}")
            got = [await anext(lines) for _ in range(len(expected) + 1)]
            assert [(ln["type"], ln["version"], ln.get("engine", {}).get("engine_id")) for ln in got] == \
                expected + [("BOOKMARK", 3, None)]
            await lines.aclose()

        for params in ("?since=0", f"?since=0&epoch={epoch}", "?since=2&epoch=old-epoch", "?since=50", ""):
            lines = watch_lines(server.url, params)
            got = [await anext(lines) for _ in range(5)]
            assert [(ln["type"], ln["version"]) for ln in got] == \
                [("RESET", 3), ("ADDED", 3), ("ADDED", 3), ("ADDED", 3), ("BOOKMARK", 3)], params
            assert [ln["engine"]["engine_id"] for ln in got[1:4]] == ["a", "b", "c"]
            await lines.aclose()


@pytest.mark.timeout(20)
async def test_bookmarks_keep_an_idle_stream_alive():
    async with serving(heartbeat_seconds=0.1, warmup_seconds=0.25) as (server, _):
        lines = watch_lines(server.url)
        assert (await anext(lines))["type"] == "RESET"
        started = time.monotonic()
        marks = [await anext(lines) for _ in range(5)]
        elapsed = time.monotonic() - started
        assert all(m["type"] == "BOOKMARK" and m["epoch"] == server.registry.epoch for m in marks)
        assert 0.3 <= elapsed < 1.0, elapsed  # the first comes at once, then one per heartbeat
        assert marks[0]["warming"] is True and marks[-1]["warming"] is False
        await lines.aclose()


@pytest.mark.timeout(20)
async def test_token_auth():
    async with serving(deployment="qwen") as (server, client):
        url = f"{server.url}/v1/engines/e1"
        body = json.dumps(advert_json("e1"))
        status, err, headers = await raw("PUT", url, body=body)
        assert status == 401 and err["reason"] == "unauthenticated" and "Bearer" in err["error"]
        assert headers["WWW-Authenticate"].startswith("Bearer")
        for header in ("Bearer wrong", "Basic czNjcmV0", "Bearer "):
            status, err, _ = await raw("PUT", url, body=body, headers={"Authorization": header})
            assert status == 401, header
        status, err, _ = await raw("PUT", url, body=json.dumps(advert_json("e1", deployment="other")), headers=AUTH)
        assert status == 403 and "deployment 'qwen'" in err["error"]
        assert (await raw("PUT", url, body=body, headers=AUTH))[0] == 201
        # Unauthenticated deletes and renewals are refused and change nothing; reads need no token.
        assert (await raw("DELETE", url))[0] == 401
        assert (await raw("POST", url + "/renew", headers={"Authorization": "Bearer nope"}))[0] == 401
        assert (await raw("GET", url))[0] == 200
        anonymous = RendezvousClient(server.url)
        assert [e.engine_id for e in (await anonymous.list()).engines] == ["e1"]
        with pytest.raises(RendezvousError) as e:
            await anonymous.register(advert("e2"))
        assert e.value.status == 401
        await anonymous.close()


@pytest.mark.timeout(20)
async def test_no_auth_must_be_chosen_explicitly():
    with pytest.raises(TypeError):
        RendezvousServer()  # type: ignore[call-arg]  # no default authenticator
    with pytest.raises(ValueError, match="non-empty token"):
        TokenAuth("")
    async with serving(auth=NoAuth()) as (server, _):
        assert (await raw("PUT", f"{server.url}/v1/engines/e1", body=json.dumps(advert_json("e1"))))[0] == 201


def _malformed_cases(big: int) -> list[tuple[str, str, Any, int, str, str]]:
    """(method, path, body, status, reason, words in the message)."""
    good = advert_json("keep", pod_uid="uid-1")

    def body(**over):
        d = dict(good)
        d.update(over)
        return json.dumps(d)

    missing = dict(good)
    del missing["http_url"]
    return [
        ("PUT", "/v1/engines/keep", "{", 400, "invalid_json", "invalid JSON"),
        ("PUT", "/v1/engines/keep", b"\xff\xfe", 400, "invalid_json", "invalid JSON"),
        ("PUT", "/v1/engines/keep", "", 400, "invalid_json", "invalid JSON"),
        ("PUT", "/v1/engines/keep", "[" * 20000 + "]" * 20000, 400, "invalid_json", "invalid JSON"),
        ("PUT", "/v1/engines/keep", "[1, 2]", 422, "invalid_body", "JSON object"),
        ("PUT", "/v1/engines/keep", "null", 422, "invalid_body", "JSON object"),
        ("PUT", "/v1/engines/keep", json.dumps(missing), 422, "invalid_body", "http_url: Field required"),
        ("PUT", "/v1/engines/keep", body(side_channel_ports=[70000]), 422, "invalid_body", "side_channel_ports.0"),
        ("PUT", "/v1/engines/keep", body(tp_size=0), 422, "invalid_body", "tp_size"),
        ("PUT", "/v1/engines/keep", body(tp_size="4"), 422, "invalid_body", "tp_size"),
        ("PUT", "/v1/engines/keep", body(http_url="ftp://x"), 422, "invalid_body", "http_url"),
        ("PUT", "/v1/engines/keep", body(role="router"), 422, "invalid_body", "role"),
        ("PUT", "/v1/engines/keep", body(engine_id="../keep"), 422, "invalid_body", "engine_id"),
        ("PUT", "/v1/engines/keep", body(surprise=True), 422, "invalid_body", "surprise: Extra inputs"),
        ("PUT", "/v1/engines/keep", body(kv_metadata="%%%"), 422, "invalid_body", "base64"),
        ("PUT", "/v1/engines/keep", body(kv_metadata={"a": [[[[[[[[[[[]]]]]]]]]]]} | {"n": 1}), 200, "", ""),
        ("PUT", "/v1/engines/keep", body(lease_seconds=0), 422, "invalid_body", "lease_seconds"),
        ("PUT", "/v1/engines/keep", body(lease_seconds=1e9), 422, "invalid_body", "lease_seconds"),
        # Not JSON, though Python's json module would take them: NaN, Infinity, a number overflowing to infinity,
        # an unpaired surrogate, nesting deeper than any advertisement. Stored, the last two made every later
        # answer naming the engine (the PUT's own, GET /v1/engines, each watch) fail to encode: 500s for all.
        ("PUT", "/v1/engines/keep", body(lease_seconds=float("nan")), 400, "invalid_json", "NaN is not a JSON number"),
        ("PUT", "/v1/engines/keep", body(kv_metadata={"x": float("inf")}), 400, "invalid_json", "Infinity"),
        ("PUT", "/v1/engines/keep", body(lease_seconds=12.345).replace("12.345", "1e999"), 400, "invalid_json",
         "out of range"),
        ("PUT", "/v1/engines/keep", body(kv_metadata={"x": "\ud800"}), 400, "invalid_json", "unpaired surrogate"),
        ("PUT", "/v1/engines/keep", body(kv_metadata={"n": "NESTED"}).replace('"NESTED"', "[" * 70 + "]" * 70), 400,
         "invalid_json", "nested deeper than 64 levels"),
        ("PUT", "/v1/engines/other", body(), 400, "id_mismatch", "differs from the body's engine_id"),
        ("PUT", "/v1/engines/bad%20id", body(), 400, "bad_parameter", "engine_id"),
        ("PUT", "/v1/engines/keep", body(pod_uid="another-uid"), 409, "conflict", "pod_uid"),
        ("PUT", "/v1/engines/keep", "x" * big, 413, "too_large", "client_max_size"),
        ("POST", "/v1/engines/bad%20id/renew", None, 400, "bad_parameter", "engine_id"),
        ("DELETE", "/v1/engines/unknown", None, 404, "not_found", "not registered"),
        ("GET", "/v1/engines?role=router", None, 400, "bad_parameter", "role must be one of"),
        ("GET", "/v1/watch?since=abc", None, 400, "bad_parameter", "since"),
        ("GET", "/v1/watch?since=-1", None, 400, "bad_parameter", "since"),
        ("GET", "/v1/nothing", None, 404, "not_found", ""),
        ("PATCH", "/v1/engines/keep", "{}", 405, "not_allowed", ""),
    ]


@pytest.mark.timeout(20)
async def test_malformed_input_gets_4xx_with_a_message_and_loses_nothing():
    async with serving(max_body=64 * 1024) as (server, client):
        kept = advert("keep", pod_uid="uid-1")
        await client.register(kept)
        version = server.registry.version
        for method, path, body, status, reason, words in _malformed_cases(big=100 * 1024):
            got, err, _ = await raw(method, server.url + path, body=body, headers=AUTH)
            if status == 200:  # a deeply nested but valid kv_metadata is fine; restore the original
                assert got == 200, err
                await client.register(kept)
                version = server.registry.version
                continue
            where = f"{method} {path} {str(body)[:60]!r}"
            assert got == status, (where, got, err)
            assert err["reason"] == reason and words in err["error"], (where, err)
            assert server.registry.get("keep") == kept, where
        assert server.registry.version == version and len(server.registry) == 1
        text = (await raw("GET", server.url + "/health"))[1]
        assert text["engines"] == 1
        m = metrics(await (await client._http().get(server.url + "/metrics")).text())
        assert m[("disagg_rendezvous_rejected_requests_total", (("reason", "invalid_body"),))] >= 10
        assert m[("disagg_rendezvous_rejected_requests_total", (("reason", "too_large"),))] == 1


@pytest.mark.timeout(20)
async def test_head_of_the_watch_is_405_and_the_connection_stays_usable():
    """HEAD of a stream used to answer with the stream's events as a body, which the client then read as the
    next response's status line."""
    async with serving() as (server, _), aiohttp.ClientSession() as s:
        for _ in range(2):  # the second pair on the same kept-alive connection
            async with s.head(server.url + "/v1/watch") as resp:
                assert resp.status == 405 and resp.headers["Allow"] == "GET"
            async with s.get(server.url + "/health") as resp:
                assert resp.status == 200 and (await resp.json())["status"] == "ok"


@pytest.mark.timeout(20)
async def test_a_huge_content_length_is_refused_at_once():
    """Content-Length says 1 TB, 2 bytes follow: a 413 at once (reading first would wait for the rest forever)."""
    async with serving() as (server, _):
        host, port = server.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"PUT /v1/engines/e1 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                     "Content-Length: 1000000000000\r\n\r\n{}".encode())
        async with asyncio.timeout(5):
            assert await reader.readline() == b"HTTP/1.1 413 Request Entity Too Large\r\n"
        writer.close()
        await writer.wait_closed()
        assert len(server.registry) == 0


@pytest.mark.timeout(20)
async def test_metrics():
    async with serving(heartbeat_seconds=0.2) as (server, client):
        async def scrape() -> dict:
            async with aiohttp.ClientSession() as s, s.get(server.url + "/metrics") as resp:
                assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
                return metrics(await resp.text())

        await client.register(advert("p1"))
        await client.register(advert("d1", role="decode"))
        await client.register(advert("d2", role="decode", lease_seconds=0.2))
        await client.register(advert("p1"))  # renewal
        await client.renew("p1")
        await client.deregister("d1")
        await raw("PUT", server.url + "/v1/engines/x", body="{}")  # 401
        events = client.watch()
        assert (await next_event(events, skip=("RESET", "BOOKMARK", "ADDED"))).type == "EXPIRED"
        m = await scrape()
        p = "disagg_rendezvous_"
        assert m[(p + "registrations_total", ())] == 3
        assert m[(p + "renewals_total", ())] == 2
        assert m[(p + "deregistrations_total", ())] == 1
        assert m[(p + "expiries_total", ())] == 1
        assert m[(p + "entries", (("role", "prefill"),))] == 1 and m[(p + "entries", (("role", "decode"),))] == 0
        assert m[(p + "watch_clients", ())] == 1
        assert m[(p + "rejected_requests_total", (("reason", "unauthenticated"),))] == 1
        await events.aclose()
        await client.close()
        async with asyncio.timeout(5):
            while (await scrape())[(p + "watch_clients", ())] != 0:  # noticed at the next bookmark write
                await asyncio.sleep(0.05)


@pytest.mark.timeout(20)
async def test_restart_on_the_same_port_the_cache_keeps_serving_and_rebuilds():
    """Soft state: a restarted rendezvous starts empty. The client's watch reconnects and resumes; the cache
    keeps every engine while the new instance warms up, takes the re-registrations, and then drops the
    engine that never came back."""
    cache = EngineCache()
    changes: list[tuple[str, str]] = []
    cache.listeners.append(lambda ev: changes.append((ev.type, ev.engine.engine_id)))
    async with serving(heartbeat_seconds=0.1) as (server, client):
        port = int(server.url.rsplit(":", 1)[1])
        first_epoch = server.registry.epoch
        alive = EngineRegistration(None, advert("alive", lease_seconds=0.3), heartbeat_seconds=0.1,
                                   client_factory=lambda: RendezvousClient(server.url, token=TOKEN, timeout=1))
        alive.start()
        await client.register(advert("dies-during-outage", role="decode"))
        watcher = RendezvousClient(server.url, timeout=1)
        async with task(cache.follow(watcher)):
            async with asyncio.timeout(5):
                while set(cache.engines) != {"alive", "dies-during-outage"}:
                    await asyncio.sleep(0.02)
            await server.stop()
            assert set(cache.engines) == {"alive", "dies-during-outage"}  # serving from the cache
            async with serving(port=port, heartbeat_seconds=0.1, warmup_seconds=0.6) as (second, _):
                assert second.registry.epoch != first_epoch
                async with asyncio.timeout(5):
                    while cache.epoch != second.registry.epoch or second.registry.get("alive") is None:
                        await asyncio.sleep(0.02)
                # Reconnected and re-registered while warming: the missing engine is still kept.
                assert second.registry.warming() and "dies-during-outage" in cache.engines
                async with asyncio.timeout(5):
                    while "dies-during-outage" in cache.engines:
                        await asyncio.sleep(0.02)
                assert not second.registry.warming()
                assert set(cache.engines) == {"alive"} and cache.version == second.registry.version
                assert ("DELETED", "dies-during-outage") in changes and alive.registered
                await alive.stop()
                assert second.registry.get("alive") is None  # deregistered on stop
        await watcher.close()


@pytest.mark.timeout(20)
async def test_watch_detects_a_silent_server_and_resumes_where_it_was():
    """A server that stops sending lines (no bookmarks) is dead after ~3 heartbeats: the client reconnects
    and asks to resume from the last version it delivered."""
    requests: asyncio.Queue[str] = asyncio.Queue()
    bookmark = WatchEvent(version=7, type="BOOKMARK", epoch="ep", warming=False).model_dump_json()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        await requests.put(head.split(b"\r\n", 1)[0].decode())
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nX-Disagg-Heartbeat-Seconds: 0.1\r\n"
                     b"Connection: close\r\n\r\n" + bookmark.encode() + b"\n")
        await writer.drain()
        await asyncio.sleep(30)  # then nothing

    srv = await asyncio.start_server(silent, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
    client = RendezvousClient(url, timeout=1)
    events = client.watch()
    started = time.monotonic()
    assert (await next_event(events, skip=())).version == 7
    async with task(anext(events)):
        first, second = await requests.get(), await requests.get()
    elapsed = time.monotonic() - started
    assert first == "GET /v1/watch HTTP/1.1"
    assert second == "GET /v1/watch?since=7&epoch=ep HTTP/1.1"
    assert 0.3 <= elapsed < 2.0, elapsed
    await events.aclose()
    await client.close()
    srv.close()


@pytest.mark.timeout(20)
async def test_registration_never_raises_and_recovers():
    # Nothing listens on this port yet: failures are recorded, not raised.
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    reg = EngineRegistration(RendezvousClient(f"http://127.0.0.1:{port}", token=TOKEN, timeout=1),
                             advert("e1"), heartbeat_seconds=0.1, min_backoff=0.02)
    assert await reg.step() is False and not reg.registered and "ClientConnector" in reg.last_error
    bad = EngineRegistration(reg.client, lambda: 1 / 0, heartbeat_seconds=0.1)  # a broken advertiser too
    assert await bad.step() is False and "ZeroDivisionError" in bad.last_error
    reg.start()
    # The rendezvous comes up with the id already held by another pod: a conflict, retried, never raised.
    registry = Registry()
    registry.register(advert("e1", pod_uid="someone-else"))
    async with serving(port=port, registry=registry) as (server, _):
        async with asyncio.timeout(5):
            while reg.last_error is None or "409" not in reg.last_error:
                await asyncio.sleep(0.02)
        assert not reg.registered and not reg._task.done()
        server.registry.deregister("e1")  # the other holder goes away: the loop recovers on its own
        assert await reg.wait_registered(timeout=5)
        assert server.registry.get("e1").pod_uid is None and reg.last_error is None
        await reg.stop(deregister=False)
        assert server.registry.get("e1") is not None
    await reg.client.close()


@pytest.mark.timeout(20)
async def test_a_rendezvous_that_accepts_but_does_not_answer_costs_one_short_attempt():
    """A restarting rendezvous can accept connections before it serves. One attempt must not hold the registration
    for the client's whole timeout (here 30 s): it gives up after half a heartbeat and retries with backoff, so
    the engine is registered again about as soon as the server answers."""
    accepted: list[asyncio.StreamWriter] = []
    released = asyncio.Event()

    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)
        await released.wait()  # holds the connection, never answers

    srv = await asyncio.start_server(mute, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    reg = EngineRegistration(RendezvousClient(f"http://127.0.0.1:{port}", token=TOKEN, timeout=30), advert("m1"),
                             heartbeat_seconds=0.4)
    assert reg.attempt_timeout == 0.5
    started = time.monotonic()
    assert await reg.step() is False
    assert 0.4 <= time.monotonic() - started < 2.0 and accepted
    assert reg.last_error == "no answer within 0.5 s" and not reg.registered
    released.set()
    srv.close()
    await srv.wait_closed()
    reg.start()  # retries while the port is closed, then the real server comes up on it
    async with serving(port=port) as (server, _):
        started = time.monotonic()
        assert await reg.wait_registered(timeout=5)
        assert time.monotonic() - started < 1.5 and server.registry.get("m1") is not None
        await reg.stop(deregister=False)
    for w in accepted:
        w.close()
    await reg.client.close()


@pytest.mark.timeout(20)
async def test_registration_sends_changes_and_renews_cheaply():
    async with serving() as (server, client):
        state = {"adv": advert("d1", role="decode")}
        reg = EngineRegistration(client, lambda: state["adv"], heartbeat_seconds=0.05)
        assert await reg.step() and reg.last_response.result == "created"
        assert await reg.step() and reg.last_response.result == "renewed"
        state["adv"] = advert("d1", role="decode", kv_metadata={"blocks": [1, 2]})
        assert await reg.step() and reg.last_response.result == "modified"
        assert server.registry.get("d1").kv_metadata == {"blocks": [1, 2]}
        server.registry.deregister("d1")  # as if the rendezvous restarted
        assert await reg.step() and reg.last_response.result == "created"
        m = metrics(await (await client._http().get(server.url + "/metrics")).text())
        assert m[("disagg_rendezvous_renewals_total", ())] == 1  # via POST .../renew


@pytest.mark.timeout(20)
async def test_registration_in_a_thread_for_synchronous_callers():
    async with serving() as (server, _):
        reg = EngineRegistration(None, advert("threaded"), heartbeat_seconds=0.05,
                                 client_factory=lambda: RendezvousClient(server.url, token=TOKEN, timeout=1))
        reg.start_thread()
        async with asyncio.timeout(5):
            while server.registry.get("threaded") is None:
                await asyncio.sleep(0.02)
        await asyncio.to_thread(reg.stop_thread)
        assert server.registry.get("threaded") is None and not reg.registered


# ---- Kubernetes auth, with a stand-in for the TokenReview API (the real one: tests/cluster) --------------------
def _review(user: str, pod: str | None, uid: str | None = "uid-1", *, authenticated: bool = True,
            audiences: tuple[str, ...] = ("disagg-rendezvous",)) -> dict[str, Any]:
    extra = {} if pod is None else {"authentication.kubernetes.io/pod-name": [pod],
                                    "authentication.kubernetes.io/pod-uid": [uid]}
    return {"authenticated": authenticated, "audiences": list(audiences),
            "user": {"username": user, "extra": extra}}


@pytest.mark.timeout(20)
async def test_kubernetes_auth_decisions_and_cache():
    sa = "system:serviceaccount:ml:default"
    reviews = {
        "ok": _review(sa, "qwen-prefill-0"),
        "decode": _review(sa, "qwen-decode-3", "uid-3"),
        "lws": _review(sa, "qwen-decode-1-2", "uid-4"),
        "bad": _review(sa, None, authenticated=False),
        "no-aud": _review(sa, "qwen-prefill-0", audiences=()),
        "user": _review("alice", "qwen-prefill-0"),
        "other-ns": _review("system:serviceaccount:prod:default", "qwen-prefill-0"),
        "unbound": _review(sa, None),
        "other-deploy": _review(sa, "other-decode-0"),
        "prefix-trick": _review(sa, "qwen-prefill-prefill-0"),
    }
    calls: list[tuple[str, list[str] | None]] = []

    async def reviewer(token: str, audiences: list[str] | None) -> dict[str, Any]:
        calls.append((token, audiences))
        if token == "boom":
            raise ConnectionError("apiserver down")
        return reviews[token]

    auth = KubernetesAuth(deployment="qwen", namespace="ml", reviewer=reviewer)
    async with serving(auth=auth, deployment="qwen") as (server, _):
        async def put(token: str, **over) -> tuple[int, dict | None]:
            a = advert_json(over.pop("engine_id", "e1"), **{"pod_name": "qwen-prefill-0", "pod_uid": "uid-1", **over})
            status, err, _ = await raw("PUT", f"{server.url}/v1/engines/{a['engine_id']}", body=json.dumps(a),
                                       headers={"Authorization": f"Bearer {token}"})
            return status, err

        assert (await put("ok"))[0] == 201
        assert (await put("ok"))[0] == 200
        assert calls == [("ok", ["disagg-rendezvous"])]  # the second call was served from the cache
        assert (await put("decode", engine_id="e3", role="decode", pod_name="qwen-decode-3", pod_uid="uid-3"))[0] == 201
        assert (await put("lws", engine_id="e4", role="decode", pod_name="qwen-decode-1-2", pod_uid="uid-4"))[0] == 201
        for token, status, words in [
            ("bad", 401, "not authenticated"), ("no-aud", 401, "audience"), ("user", 403, "not a ServiceAccount"),
            ("other-ns", 403, "not in namespace 'ml'"), ("unbound", 403, "not bound to a pod"),
            ("other-deploy", 403, "not an engine of deployment 'qwen'"),
            ("prefix-trick", 403, "not an engine of deployment 'qwen'"), ("boom", 503, "TokenReview failed"),
        ]:
            got, err = await put(token, engine_id="x")
            assert (got, err["error"].count(words)) == (status, 1), (token, err)
        # The token's pod must be the advertised pod, with the role its name says.
        got, err = await put("ok", engine_id="x", pod_name="qwen-prefill-1")
        assert got == 403 and "advertisement names pod qwen-prefill-1" in err["error"]
        got, err = await put("ok", engine_id="x", pod_uid="uid-2")
        assert got == 403
        got, err = await put("ok", engine_id="x", role="decode")
        assert got == 403 and "may not advertise a decode engine" in err["error"]
        # Renew and delete only your own entry.
        ok = {"Authorization": "Bearer ok"}
        assert (await raw("POST", f"{server.url}/v1/engines/e3/renew", headers=ok))[0] == 403
        assert (await raw("DELETE", f"{server.url}/v1/engines/e3", headers=ok))[0] == 403
        assert (await raw("POST", f"{server.url}/v1/engines/e1/renew", headers=ok))[0] == 200
        assert (await raw("DELETE", f"{server.url}/v1/engines/e1", headers=ok))[0] == 204
        assert sorted(a.engine_id for a in server.registry.engines()) == ["e3", "e4"]


# ---- the command ---------------------------------------------------------------------------------------------
def _disagg() -> str:
    return str(Path(sys.executable).parent / "disagg")


def test_command_refuses_incomplete_auth_settings():
    env = {k: v for k, v in os.environ.items()
           if k not in ("DISAGG_RENDEZVOUS_TOKEN", "DISAGG_DEPLOYMENT", "POD_NAMESPACE", "KUBECONFIG")}
    out = subprocess.run([_disagg(), "rendezvous", "--auth", "token", "--port", "0"], capture_output=True, text=True,
                         env=env, timeout=60)
    assert out.returncode != 0 and "non-empty token" in out.stderr
    out = subprocess.run([_disagg(), "rendezvous", "--port", "0"], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode != 0 and "--auth kubernetes needs the deployment" in out.stderr


@pytest.mark.timeout(60)
async def test_command_serves():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    env = {**os.environ, "DISAGG_RENDEZVOUS_TOKEN": TOKEN}
    proc = subprocess.Popen([_disagg(), "rendezvous", "--host", "127.0.0.1", "--port", str(port), "--auth", "token",
                             "--heartbeat-seconds", "1", "--deployment", "qwen"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        client = RendezvousClient(f"http://127.0.0.1:{port}", token=TOKEN, timeout=1)
        async with asyncio.timeout(25):
            while True:
                try:
                    health = await client.health()
                    break
                except aiohttp.ClientError:
                    assert proc.poll() is None, proc.stdout.read()
                    await asyncio.sleep(0.1)  # another process starting: nothing to await but polling
        assert health["auth"] == "token" and health["warming"] is True
        assert (await client.register(advert("e1"))).result == "created"
        await client.close()
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0, out
    assert "engine e1 created" in out


@contextlib.asynccontextmanager
async def intercepted_first_connection(upstream: str) -> AsyncIterator[tuple[str, list[int]]]:
    """A fake, named as such: a TCP front whose first connection is answered by something that is not the
    rendezvous (404, empty body, keep-alive), as an egress interceptor answers a ClusterIP that kube-proxy has not
    programmed yet; every later connection is forwarded to the real rendezvous at `upstream`. Yields its URL and
    the number of requests the interceptor answered."""
    host, port = upstream.removeprefix("http://").split(":")
    answered = [0]
    connections = [0]

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def front(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections[0] += 1
        if connections[0] == 1:
            try:
                while await reader.readuntil(b"\r\n\r\n"):  # requests without a body: watch, PUT's head
                    answered[0] += 1
                    writer.write(b"HTTP/1.1 404 Not Found\r\nserver: interceptor\r\ncontent-length: 0\r\n\r\n")
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    srv = await asyncio.start_server(front, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}", answered
    finally:
        srv.close()


@pytest.mark.timeout(20)
async def test_an_answer_from_something_else_is_not_asked_again_on_the_same_connection():
    """A Service's first connections can reach something that is not the rendezvous (before kube-proxy programs
    the ClusterIP, an egress interceptor answers 404 with an empty body, keep-alive). The client must not keep
    that connection: watch, register and list each reach the real rendezvous on their next attempt."""
    async with serving() as (server, _):
        async with intercepted_first_connection(server.url) as (url, answered):
            watcher = RendezvousClient(url, timeout=5)
            events = watcher.watch(min_backoff=0.01, max_backoff=0.05)
            async with asyncio.timeout(5):
                first = await anext(events)
            assert first.type in ("RESET", "BOOKMARK") and answered == [1]
            await events.aclose()
            await watcher.close()
        async with intercepted_first_connection(server.url) as (url, answered):
            writer = RendezvousClient(url, token=TOKEN, timeout=5)
            with pytest.raises(RendezvousError) as e:
                await writer.register(advert("i1"))
            assert e.value.status == 404 and "interceptor" in e.value.message, e.value
            await writer.register(advert("i1"))  # the next attempt is a new connection, to the rendezvous
            assert server.registry.get("i1") is not None and answered == [1]
            assert [a.engine_id for a in (await writer.list()).engines] == ["i1"]
            await writer.close()
