"""Property tests of the router's HTTP API (hypothesis): a real router on 127.0.0.1 in front of stand-in engines
(tests/support/stub_engines.py; they answer any JSON body at once).

Properties, whatever a client sends (raw bytes, JSON of any shape, a valid request with fields of the wrong
type or absurd values, odd Content-Types, paths, methods and query strings):
- no 5xx; the one documented exception is 503 from a router with no prefill/decode pair, and only for a
  request it would otherwise serve;
- every error is an OpenAI-style error object whose code is the HTTP status;
- a refused request reaches no engine; an accepted one reaches both, the decode leg carrying exactly the
  client's JSON plus the router's kv_transfer_params.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from yarl import URL

from disagg.connector.router.app import DECODE_HEADER, PREFILL_HEADER, Router, Settings
from disagg.connector.router.engine_pool import EnginePool
from support.stub_engines import StubEngine, serving, stub_engines

# aiohttp's HTTP parser answers a longer request line itself (a plain-text 400, before any handler runs).
MAX_REQUEST_LINE = 8000
SHARED_SERVER = settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
ENDPOINTS = {"/v1/completions": {"model": "tiny", "prompt": "x", "max_tokens": 2},
             "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}}
FIELDS = ["prompt", "messages", "n", "max_tokens", "max_completion_tokens", "stream", "stream_options", "min_tokens",
          "kv_transfer_params", "temperature", "model", "logit_bias", "stop"]


@dataclass
class Served:
    url: str
    http: aiohttp.ClientSession
    engines: tuple[StubEngine, ...]

    def legs(self) -> int:
        return sum(len(e.legs) for e in self.engines)


@pytest.fixture(params=["push", "pull"])
async def router(request):
    mode = request.param
    prefill, decode = StubEngine("p-1", "prefill", mode=mode), StubEngine("d-1", "decode", mode=mode)
    async with stub_engines(prefill, decode):
        engines = [prefill.advertisement(), decode.advertisement()]
        r = Router(EnginePool(mode, lambda: engines), Settings(mode=mode))
        r.pool.max_model_len["d-1"] = 8192  # what the probes would learn, known from the start: deterministic
        async with serving(r.app()) as url, aiohttp.ClientSession() as http:
            yield Served(url, http, (prefill, decode))


@pytest.fixture
async def lonely_router():
    """A router whose only engine is a prefill stand-in: no pair, ever."""
    async with stub_engines(StubEngine("p-1", "prefill")) as (prefill,):
        engines = [prefill.advertisement()]
        async with serving(Router(EnginePool("push", lambda: engines), Settings()).app()) as url, \
                aiohttp.ClientSession() as http:
            yield Served(url, http, (prefill,))


# ---- strategies ------------------------------------------------------------------------------------------------
texts = st.lists(st.characters() | st.integers(0xD800, 0xDFFF).map(chr), max_size=12).map("".join)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(min_value=2**62, max_value=2**80) | st.floats() | texts
    | st.sampled_from(["", "16", "1", "true", "x" * 2000]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3), max_leaves=6)
# Raw JSON text for one value, where Python's json would be lenient: not JSON, or deeper than the router takes.
ODD_FRAGMENTS = [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"9" * 5000, b'"\\ud800"', b"[" * 80 + b"]" * 80,
                 b"[" * 3000 + b"]" * 3000, b'"\xff"', b'"\xed\xa0\x80"', b"", b"01", b"'x'", b"1.0", b"-0",
                 b"true", b"null", b"[]", b"{}"]


def _encode(value: Any, how: str) -> bytes:
    if how == "ascii":
        return json.dumps(value).encode()  # NaN and Infinity come out as such: not JSON
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")  # lone surrogates as raw bytes


@st.composite
def bodies(draw, path: str) -> bytes:
    kind = draw(st.sampled_from(["raw", "any json", "fields", "fields", "odd fragment", "valid"]))
    if kind == "raw":
        return draw(st.binary(max_size=200))
    if kind == "any json":
        return _encode(draw(json_values), draw(st.sampled_from(["ascii", "utf8"])))
    body = dict(ENDPOINTS[path])
    if kind == "fields":
        body.update(draw(st.dictionaries(st.sampled_from(FIELDS) | texts, json_values, min_size=1, max_size=3)))
    elif kind == "valid":
        body.update(draw(st.fixed_dictionaries({}, optional={
            "stream": st.booleans(), "max_tokens": st.integers(1, 8192), "temperature": st.floats(0, 2),
            "stop": st.lists(st.text(max_size=3), max_size=2), "min_tokens": st.integers(0, 4)})))
    else:
        text = json.dumps({**body, draw(st.sampled_from(FIELDS)): "@@ODD@@"}).encode()
        return text.replace(b'"@@ODD@@"', draw(st.sampled_from(ODD_FRAGMENTS)))
    return _encode(body, draw(st.sampled_from(["ascii", "utf8"])))


@st.composite
def requests(draw) -> tuple[str, bytes, dict[str, str]]:
    path = draw(st.sampled_from(list(ENDPOINTS)))
    content_type = draw(st.integers(0, 3).flatmap(lambda i: st.just("application/json") if i else st.sampled_from([
        None, "text/plain", "application/x-www-form-urlencoded", "application/json; charset=latin-1",
        "application/JSON", "application/problem+json", "application/json; charset=utf-16", "*/*", ";", "json"])))
    return path, draw(bodies(path)), ({"Content-Type": content_type} if content_type else {})


# ---- checks ----------------------------------------------------------------------------------------------------
async def _error(resp: aiohttp.ClientResponse) -> dict[str, Any]:
    assert resp.headers.get("Content-Type", "").startswith("application/json"), (resp.status, resp.headers)
    err = json.loads(await resp.read())["error"]
    assert err["code"] == resp.status and isinstance(err["message"], str) and err["message"], err
    return err


# ---- properties ------------------------------------------------------------------------------------------------
@SHARED_SERVER
@given(request=requests())
async def test_a_request_is_served_or_refused_with_a_4xx_and_refused_ones_reach_no_engine(router, request):
    path, raw, headers = request
    legs = router.legs()
    async with router.http.post(router.url + path, data=raw, headers=headers) as resp:
        event(f"{resp.status}")
        if resp.status == 200:
            await resp.read()
            assert (resp.headers[PREFILL_HEADER], resp.headers[DECODE_HEADER]) == ("p-1", "d-1")
            rid = resp.headers["X-Request-Id"]
        else:
            assert 400 <= resp.status < 500, (resp.status, await resp.text())
            await _error(resp)
            assert router.legs() == legs, "a refused request reached an engine"
            return
    prefill, decode = router.engines
    [prefill_leg] = [leg for leg in prefill.legs if leg.request_id == rid]
    [decode_leg] = [leg for leg in decode.legs if leg.request_id == rid]
    sent = json.loads(raw)
    assert prefill_leg.body["max_tokens"] == 1 and prefill_leg.body["stream"] is False
    assert {k: v for k, v in decode_leg.body.items() if k != "kv_transfer_params"} == sent
    assert decode_leg.params["do_remote_prefill"] is True


@SHARED_SERVER
@given(method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]),
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
                             "/v1/engines", "/", "/v1", "/v1/completions/", "/v1//completions", "/v1/%2e%2e/health",
                             "/%ff", "/v1/completions%00", "/" + "a" * 3000]),
       query=st.dictionaries(st.sampled_from(["since", "epoch", "role", "stream", ""]) | texts, texts, max_size=3),
       body=st.binary(max_size=64))
async def test_any_path_method_and_query_is_answered_without_a_5xx(router, method, path, query, body):
    legs = router.legs()
    url = URL(router.url + path, encoded=True).with_query(query)
    assume(len(url.raw_path_qs) < MAX_REQUEST_LINE)
    async with router.http.request(method, url, data=body or None) as resp:
        event(f"{method} {resp.status}")
        assert resp.status < 500, (method, url, resp.status, await resp.text())
        if resp.status >= 400 and method != "HEAD":
            await _error(resp)
        await resp.read()
    if method == "POST" and resp.status >= 400:
        assert router.legs() == legs


@SHARED_SERVER
@given(request=requests())
async def test_without_a_pair_only_a_servable_request_gets_the_503(lonely_router, request):
    path, raw, headers = request
    async with lonely_router.http.post(lonely_router.url + path, data=raw, headers=headers) as resp:
        event(f"{resp.status}")
        err = await _error(resp)
        assert resp.status < 500 or (resp.status == 503 and "no healthy push-mode prefill/decode pair" in
                                     err["message"]), err
    assert lonely_router.legs() == 0
