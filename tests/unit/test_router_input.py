"""Bad input to the router gets a 4xx with an OpenAI-style error body, never a 5xx, and reaches no engine.

The router serves on a real port of 127.0.0.1 in front of stand-in engines (tests/support/stub_engines.py);
a case passes only if the stand-ins received nothing for it. Issue 12: a body that is not UTF-8 was a 500.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest

from disagg.connector.router.app import MAX_BODY, Router, Settings
from disagg.connector.router.engine_pool import EnginePool
from support.stub_engines import StubEngine, serving, stub_engines

GOOD = {"model": "tiny", "prompt": "x", "max_tokens": 2}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
JSON_TYPE = {"Content-Type": "application/json"}


def _body(base: dict, **over: Any) -> bytes:
    return json.dumps({**base, **over}).encode()


# (path, raw body, headers, status, words in the message)
CASES: list[tuple[str, bytes, dict[str, str], int, str]] = [
    # Not UTF-8: Latin-1, a lone continuation byte, a UTF-8-encoded surrogate, UTF-16 with its BOM.
    *[(path, raw, JSON_TYPE, 400, "not valid UTF-8") for path in ("/v1/completions", "/v1/chat/completions")
      for raw in (b'{"prompt": "caf\xe9"}', b"\x80", b'{"prompt": "\xed\xa0\x80"}',
                  '{"prompt": "x"}'.encode("utf-16"))],
    ("/v1/completions", b'{"prompt": "caf\xe9"}', {"Content-Type": "application/json; charset=latin-1"}, 400,
     "not valid UTF-8"),
    ("/v1/completions", _body(GOOD), {"Content-Type": "application/json; charset=no-such-codec"}, 200, ""),
    ("/v1/completions", b"", JSON_TYPE, 400, "body is empty"),
    ("/v1/completions", b"{", JSON_TYPE, 400, "invalid JSON"),
    ("/v1/completions", b"\xef\xbb\xbf" + _body(GOOD), JSON_TYPE, 400, "invalid JSON"),  # a UTF-8 BOM
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', JSON_TYPE, 400, "NaN is not a JSON number"),
    ("/v1/completions", b'{"prompt": "x", "temperature": -Infinity}', JSON_TYPE, 400, "-Infinity"),
    ("/v1/completions", b'{"prompt": "x", "temperature": 1e999}', JSON_TYPE, 400, "out of range"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", JSON_TYPE, 400, "invalid JSON"),
    ("/v1/completions", b'{"prompt": "\\ud800"}', JSON_TYPE, 400, "unpaired surrogate"),
    ("/v1/completions", b'{"prompt": "x", "\\udfff": 1}', JSON_TYPE, 400, "unpaired surrogate"),
    ("/v1/completions", b'{"prompt": "x", "logit_bias": ' + b"[" * 70 + b"]" * 70 + b"}", JSON_TYPE, 400,
     "nested deeper than 64"),
    ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, JSON_TYPE, 400, "nested deeper than 64"),
    ("/v1/completions", b"[1, 2]", JSON_TYPE, 400, "must be a JSON object, got an array"),
    ("/v1/completions", b'"prompt"', JSON_TYPE, 400, "must be a JSON object, got a string"),
    ("/v1/completions", b"null", JSON_TYPE, 400, "got null"),
    ("/v1/completions", b"17", JSON_TYPE, 400, "got a number"),
    ("/v1/chat/completions", b"true", JSON_TYPE, 400, "got a boolean"),
    # Wrong types, numbers as strings, booleans as numbers.
    ("/v1/completions", _body(GOOD, max_tokens="16"), JSON_TYPE, 400, "'max_tokens' must be a positive integer"),
    ("/v1/completions", _body(GOOD, max_tokens=True), JSON_TYPE, 400, "'max_tokens' must be a positive integer"),
    ("/v1/completions", _body(GOOD, max_tokens=2.5), JSON_TYPE, 400, "'max_tokens' must be a positive integer"),
    ("/v1/completions", _body(GOOD, max_tokens=0), JSON_TYPE, 400, "'max_tokens' must be a positive integer"),
    ("/v1/completions", _body(GOOD, max_tokens=10**30), JSON_TYPE, 400, "exceeds the model's max_model_len=64"),
    ("/v1/chat/completions", _body(CHAT, max_completion_tokens="2"), JSON_TYPE, 400, "'max_completion_tokens'"),
    ("/v1/completions", _body(GOOD, n="1"), JSON_TYPE, 400, "'n' must be 1"),
    ("/v1/completions", _body(GOOD, n=True), JSON_TYPE, 400, "'n' must be 1"),
    ("/v1/completions", _body(GOOD, n=2), JSON_TYPE, 400, "'n' must be 1"),
    ("/v1/completions", _body(GOOD, stream="true"), JSON_TYPE, 400, "'stream' must be a boolean"),
    ("/v1/completions", _body(GOOD, stream_options={"include_usage": True}), JSON_TYPE, 400,
     "only allowed with 'stream': true"),
    ("/v1/completions", _body(GOOD, stream=True, stream_options=[1]), JSON_TYPE, 400, "must be an object"),
    ("/v1/completions", _body(GOOD, prompt=12), JSON_TYPE, 400, "'prompt' must be"),
    ("/v1/completions", _body(GOOD, prompt=""), JSON_TYPE, 400, "'prompt' must be"),
    ("/v1/completions", _body(GOOD, prompt=["a", "b"]), JSON_TYPE, 400, "batched prompts"),
    ("/v1/completions", _body(GOOD, prompt=[1, True]), JSON_TYPE, 400, "'prompt' must be"),
    ("/v1/completions", _body(GOOD, prompt=[1, -2]), JSON_TYPE, 400, "'prompt' must be"),
    ("/v1/completions", _body(GOOD, prompt=["1"]), JSON_TYPE, 200, ""),  # one prompt in a list is one prompt
    ("/v1/completions", _body(GOOD, kv_transfer_params={}), JSON_TYPE, 400, "set by the router"),
    ("/v1/chat/completions", _body(CHAT, messages={}), JSON_TYPE, 400, "'messages' must be a non-empty list"),
    ("/v1/chat/completions", _body(CHAT, messages=[]), JSON_TYPE, 400, "'messages' must be a non-empty list"),
    ("/v1/chat/completions", _body(CHAT, messages=["hi"]), JSON_TYPE, 400, "'messages[0]' must be an object"),
    # Content-Type: JSON or none; anything else is refused with 415 (vLLM refuses it too).
    ("/v1/completions", _body(GOOD), {"Content-Type": "text/plain"}, 415, "Content-Type must be application/json"),
    ("/v1/completions", _body(GOOD), {"Content-Type": "application/x-www-form-urlencoded"}, 415, "Content-Type"),
    ("/v1/completions", _body(GOOD), {"Content-Type": "multipart/form-data; boundary=x"}, 415, "Content-Type"),
    ("/v1/completions", _body(GOOD), {"Content-Type": "Application/JSON"}, 200, ""),
    ("/v1/completions", _body(GOOD), {"Content-Type": "application/vnd.api+json"}, 200, ""),
    # Other routes and methods.
    ("/v1/embeddings", _body(GOOD), JSON_TYPE, 404, "no such endpoint"),
    ("/v1/models", _body(GOOD), JSON_TYPE, 405, "method not allowed"),
    ("/health", b"\xff", JSON_TYPE, 405, "method not allowed"),
]


@pytest.fixture
async def router_url():
    prefill, decode = StubEngine("p-1", "prefill"), StubEngine("d-1", "decode")
    async with stub_engines(prefill, decode):
        engines = [prefill.advertisement(), decode.advertisement()]
        router = Router(EnginePool("push", lambda: engines), Settings(mode="push"))
        router.pool.max_model_len["d-1"] = 64  # as the probes learn it from /v1/models
        async with serving(router.app()) as url:
            yield url, (prefill, decode)


async def test_probes_livez_always_readyz_once_synced_health_with_a_pair():
    """Liveness (/livez) never depends on the engines, readiness (/readyz) only on having read the rendezvous once;
    /health says whether a pair is up."""
    synced = False
    router = Router(EnginePool("push", lambda: []), Settings(mode="push"), synced=lambda: synced)
    async with serving(router.app()) as url, aiohttp.ClientSession() as s:
        async with s.get(url + "/health") as resp:
            assert resp.status == 503 and (await resp.json())["status"] == "no-engines"
        async with s.get(url + "/livez") as resp:
            assert resp.status == 200 and (await resp.json()) == {"status": "ok"}
        async with s.get(url + "/readyz") as resp:
            assert resp.status == 503 and (await resp.json()) == {"status": "syncing"}
        synced = True
        async with s.get(url + "/readyz") as resp:
            assert resp.status == 200


async def test_a_request_waits_for_a_pair_up_to_the_pair_wait():
    """No pair: the request waits (an engine restarting) and is served when one appears; with none it gets a 503
    after the wait, not before."""
    prefill, decode = StubEngine("p-1", "prefill"), StubEngine("d-1", "decode")
    engines: list = []
    router = Router(EnginePool("push", lambda: engines), Settings(mode="push", pair_wait=2.0))
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    async with stub_engines(prefill, decode), serving(router.app()) as url, aiohttp.ClientSession() as s:
        start = time.monotonic()
        async with s.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 503, await resp.text()
        assert time.monotonic() - start >= 2.0

        async def engines_appear() -> None:
            await asyncio.sleep(0.5)
            engines.extend([prefill.advertisement(), decode.advertisement()])

        appear = asyncio.create_task(engines_appear())
        async with s.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
        await appear


async def _check_error(resp: aiohttp.ClientResponse, status: int, words: str) -> None:
    assert resp.headers["Content-Type"].startswith("application/json"), resp.headers
    err = (await resp.json())["error"]
    assert err["code"] == status and words in err["message"], err
    assert err["type"] == "invalid_request_error"


async def test_bad_input_gets_a_4xx_error_body_and_reaches_no_engine(router_url):
    url, engines = router_url
    async with aiohttp.ClientSession() as s:
        for path, raw, headers, status, words in CASES:
            legs = sum(len(e.legs) for e in engines)
            async with s.post(url + path, data=raw, headers=headers) as resp:
                where = (path, raw[:80], headers)
                assert resp.status == status, (where, await resp.text())
                if status == 200:
                    await resp.read()
                    continue
                await _check_error(resp, status, words)
            assert sum(len(e.legs) for e in engines) == legs, where


async def test_get_routes_ignore_bodies_and_odd_queries_and_other_methods_are_405(router_url):
    url, _ = router_url
    async with aiohttp.ClientSession() as s:
        for path in ("/health", "/livez", "/v1/models", "/metrics"):
            async with s.get(url + path + "?role=%ff&since=-1&x", data=b"\xff\xfe") as resp:
                assert resp.status == 200, (path, await resp.text())
            for method in ("PUT", "DELETE", "PATCH"):
                async with s.request(method, url + path) as resp:
                    assert resp.status == 405 and "GET" in resp.headers["Allow"], path
                    await _check_error(resp, 405, "method not allowed")
        async with s.get(url + "/v1/completions") as resp:
            assert resp.status == 405 and resp.headers["Allow"] == "POST"
            await _check_error(resp, 405, "GET /v1/completions")


async def _raw_request(url: str, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """One request written by hand (headers aiohttp's client will not send); the status and body."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(head + b"\r\n" + body)
        await writer.drain()
        async with asyncio.timeout(10):
            status_line = await reader.readline()
            headers = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in headers.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), None)
            data = await reader.readexactly(length) if length is not None else b""
        return int(status_line.split()[1]), data
    finally:
        writer.close()
        await writer.wait_closed()


async def test_a_huge_content_length_is_refused_before_the_body_is_read(router_url):
    url, engines = router_url
    # Says 1 TB, sends 16 bytes: answered at once (a reader would wait for the rest until the client gives up).
    status, data = await _raw_request(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                                      b"application/json\r\nContent-Length: 1000000000000\r\n", b'{"prompt": "x"}')
    assert status == 413 and f"larger than {MAX_BODY} bytes" in json.loads(data)["error"]["message"]
    # Really sent, chunked (no Content-Length): refused once it passes the limit.
    async with aiohttp.ClientSession() as s:
        async def chunks():
            yield b'{"prompt": "'
            for _ in range(MAX_BODY // (1 << 20) + 1):
                yield b"x" * (1 << 20)
            yield b'"}'
        async with s.post(url + "/v1/completions", data=chunks(), headers=JSON_TYPE) as resp:
            assert resp.status == 413
            await _check_error(resp, 413, "larger than")
    # A Content-Length no HTTP parser takes: aiohttp's own 400, before the router.
    status, _ = await _raw_request(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                   b"Content-Length: 99999999999999999999999\r\n")
    assert status == 400
    assert not any(e.legs for e in engines)
