"""Property tests of the rendezvous' HTTP API (hypothesis), against a real server on 127.0.0.1.

Properties, whatever arrives (raw bytes, JSON of any shape, an advertisement with one field of the wrong type
or an absurd value, odd engine ids, paths, query parameters and Authorization headers):
- no 5xx, except 503 `auth_unavailable` (a TokenReview that failed; the server's documented answer);
- every error is an ErrorResponse (JSON, a reason, a message);
- a rejected write changes nothing stored: the registry's version, epoch and every entry are as before;
- the rendezvous still answers reads afterwards (nothing stored that it cannot encode).
The server lives for the whole test; examples share it, and an accepted write is undone before the next one.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from yarl import URL

from disagg.connector.rendezvous.auth import KubernetesAuth, TokenAuth
from disagg.connector.rendezvous.server import RendezvousServer
from disagg.connector.wire.advertisement import EngineAdvertisement, EngineList, ErrorResponse, WatchEvent
from support.rendezvous import advert, advert_json

TOKEN = "s3cret-token"
KEPT = advert("keep", pod_uid="uid-1", lease_seconds=3600)  # outlives any run: an expiry is a change too
FIELDS = list(advert_json("x"))
REASONS = {"invalid_json", "invalid_body", "id_mismatch", "bad_parameter", "too_large", "unauthenticated", "forbidden",
           "conflict", "not_found", "registry_full", "not_allowed"}
# A server shared by examples: hypothesis' warning about function-scoped fixtures does not apply.
# aiohttp's HTTP parser answers a longer request line itself (a plain-text 400, before any handler runs).
MAX_REQUEST_LINE = 8000
SHARED_SERVER = settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@dataclass
class Rendezvous:
    server: RendezvousServer
    http: aiohttp.ClientSession

    def url(self, path: str) -> URL:
        return URL(self.server.url + path, encoded=True)  # sent exactly as written (already percent-encoded)

    def state(self) -> tuple[Any, ...]:
        r = self.server.registry
        return r.version, r.epoch, [(e.engine_id, e) for e in r.engines()]

    def reset(self) -> None:
        """Back to one engine, `keep`, as stored at the start (after an accepted write)."""
        r = self.server.registry
        for e in r.engines():
            if e != KEPT:
                r.deregister(e.engine_id)
        if r.get("keep") is None:
            r.register(KEPT)


async def _serve(auth) -> Rendezvous:
    server = RendezvousServer(auth=auth, heartbeat_seconds=5, deployment="qwen", max_body=256 * 1024)
    await server.start("127.0.0.1", 0)
    server.registry.register(KEPT)
    return Rendezvous(server, aiohttp.ClientSession())


@pytest.fixture
async def rendezvous():
    r = await _serve(TokenAuth(TOKEN))
    yield r
    await r.http.close()
    await r.server.stop()


async def _reviewer(token: str, audiences: list[str] | None) -> dict[str, Any]:
    """A stand-in for the TokenReview API: `pod` is keep's pod, `down` is an API that fails, the rest is junk."""
    if token == "down":
        raise ConnectionError("apiserver unreachable")
    if token == "pod":
        return {"authenticated": True, "audiences": audiences or [], "user": {
            "username": "system:serviceaccount:ml:default",
            "extra": {"authentication.kubernetes.io/pod-name": ["qwen-prefill-0"],
                      "authentication.kubernetes.io/pod-uid": ["uid-1"]}}}
    return {"authenticated": False}


@pytest.fixture
async def kube_rendezvous():
    r = await _serve(KubernetesAuth(deployment="qwen", namespace="ml", reviewer=_reviewer, negative_cache_seconds=0))
    yield r
    await r.http.close()
    await r.server.stop()


# ---- strategies ------------------------------------------------------------------------------------------------
# Text with unpaired surrogates now and then (hypothesis' own text never has them; Python's json decodes them).
texts = st.lists(st.characters() | st.integers(0xD800, 0xDFFF).map(chr), max_size=12).map("".join)


def json_values(max_leaves: int = 8) -> st.SearchStrategy[Any]:
    """Any JSON value, and the values Python's json module also produces: NaN, infinities, unpaired surrogates."""
    scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=2**62, max_value=2**80)
               | st.floats() | texts | st.sampled_from(["", "x" * 300, "0", "8", "true"]))
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                          max_size=3),
                        max_leaves=max_leaves)


# Raw JSON text for one value, where Python's json would be lenient: not JSON, or beyond what a server keeps.
ODD_FRAGMENTS = [b"NaN", b"-Infinity", b"1e999", b"-1e400", b"9" * 5000, b'"\\ud800"', b'"\\udfff\\ud800"',
                 b"[" * 80 + b"]" * 80, b'{"a":' * 70 + b"1" + b"}" * 70, b"1.0", b"-0", b"01", b"0x10", b"'x'",
                 b'"\xff"', b'"\xed\xa0\x80"', b"", b"null", b"[]", b"{}", b"true", b'"' + b"z" * 5000 + b'"']


def _encode(value: Any, how: str) -> bytes:
    if how == "ascii":
        return json.dumps(value).encode()  # NaN and Infinity come out as such: not JSON
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")  # lone surrogates as raw bytes


def mostly(value: Any, otherwise: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """`value` three times in four, else a draw from `otherwise`: the checks before the one under test must
    mostly pass, or every example stops at the first (a wrong token, a path that is not the body's id)."""
    return st.integers(0, 3).flatmap(lambda i: st.just(value) if i else otherwise)


@st.composite
def put_bodies(draw) -> bytes:
    kind = draw(st.sampled_from(["raw", "any json", "one field", "one field", "odd fragment", "extra field", "valid",
                                 "kv_metadata", "kv_metadata"]))
    if kind == "raw":
        return draw(st.binary(max_size=300))
    if kind == "any json":
        return _encode(draw(json_values()), draw(st.sampled_from(["ascii", "utf8"])))
    adv = advert_json("keep", pod_uid="uid-1")
    if kind == "one field":
        adv[draw(st.sampled_from(FIELDS))] = draw(json_values(max_leaves=3))
    elif kind == "kv_metadata":  # opaque to the rendezvous: any JSON object it can store and send on again
        adv["kv_metadata"] = draw(st.dictionaries(texts, json_values(), min_size=1, max_size=3))
    elif kind == "extra field":
        adv[draw(texts)] = draw(json_values(max_leaves=2))
    elif kind == "valid":  # accepted writes: a change to keep (or refused: another engine id than the path's)
        adv = advert_json(draw(mostly("keep", st.just("other-1"))), pod_uid="uid-1",
                          transport=draw(st.sampled_from(["UCX", "LIBFABRIC"])), tp_size=draw(st.integers(1, 8)))
    else:
        field = draw(st.sampled_from(FIELDS))
        text = json.dumps({**adv, field: "@@ODD@@"}).encode()
        return text.replace(b'"@@ODD@@"', draw(st.sampled_from(ODD_FRAGMENTS)))
    return _encode(adv, draw(st.sampled_from(["ascii", "utf8"])))


ODD_IDS = ["keep", "other-1", "", ".", "..", "%", "%ff", "%00", "%2e%2e", "a%2Fb", "%20keep", "keep%0A", "-x", "_x",
           "x" * 321, "k" * 320, "%C3%A9", "keep.", "KEEP", "keep;x", "keep,x", "@", "~", "*"]
engine_ids = st.sampled_from(ODD_IDS) | st.text(max_size=40).map(lambda s: quote(s, safe=""))
auth_headers = mostly({"Authorization": f"Bearer {TOKEN}"}, st.sampled_from([
    {}, {"Authorization": "Bearer"}, {"Authorization": f"bearer  {TOKEN} "}, {"Authorization": f"Basic {TOKEN}"},
    {"Authorization": f"Bearer {TOKEN}x"}, {"Authorization": "Bearer " + "a" * 5000}]) | st.builds(
    lambda t: {"Authorization": "Bearer " + t}, st.text(st.characters(min_codepoint=33, max_codepoint=126),
                                                        max_size=30)))
query_values = st.sampled_from(["", "-1", "0", "3", "1e3", "9" * 5000, "0x10", " 5", "\u0663", "NaN", "null", "prefill",
                                "decode", "router", "PREFILL", "%", "\x00", "a&b=c"]) | st.text(max_size=12)


# ---- checks ----------------------------------------------------------------------------------------------------
async def _answer(resp: aiohttp.ClientResponse, kube: bool = False) -> None:
    """No 5xx but the documented 503, and every error an ErrorResponse."""
    data = await resp.read()
    assert resp.status < 500 or (kube and resp.status == 503), (resp.status, data[:300])
    if resp.status < 400 or resp.method == "HEAD":
        return
    err = ErrorResponse.model_validate_json(data)
    assert err.error and (err.reason in REASONS or (kube and err.reason == "auth_unavailable")), err


async def _still_reads(r: Rendezvous) -> None:
    async with r.http.get(r.url("/v1/engines")) as resp:
        assert resp.status == 200
        listed = EngineList.model_validate_json(await resp.read())
    assert [e.engine_id for e in listed.engines] == [e.engine_id for e in r.server.registry.engines()]


# ---- properties ------------------------------------------------------------------------------------------------
@SHARED_SERVER
@given(body=put_bodies(), engine_id=mostly("keep", engine_ids), headers=auth_headers,
       content_type=st.sampled_from(["application/json", "text/plain", None]))
async def test_put_rejections_change_nothing(rendezvous, body, engine_id, headers, content_type):
    r = rendezvous
    before = r.state()
    if content_type:
        headers = {**headers, "Content-Type": content_type}
    async with r.http.put(r.url(f"/v1/engines/{engine_id}"), data=body, headers=headers) as resp:
        await _answer(resp)
        status = resp.status
        event(f"{status} {(await resp.json()).get('reason') if status >= 400 else ''}")
    if status >= 400:
        assert r.state() == before
    else:
        stored = r.server.registry.get(engine_id)
        assert stored == EngineAdvertisement.model_validate_json(body)
    await _still_reads(r)
    r.reset()


@SHARED_SERVER
@given(method=st.sampled_from(["GET", "POST", "DELETE", "PUT", "PATCH", "HEAD", "OPTIONS"]),
       template=st.sampled_from(["/v1/engines/{id}", "/v1/engines/{id}/renew", "/v1/engines", "/v1/watch", "/health",
                                 "/metrics", "/v1/{id}", "/{id}", "/v1/engines/{id}/{id}"]),
       engine_id=engine_ids, headers=auth_headers,
       query=st.dictionaries(st.sampled_from(["since", "epoch", "role", "layout_key", "x", ""]), query_values,
                             max_size=3))
async def test_any_request_is_answered_and_only_accepted_writes_change_anything(rendezvous, method, template,
                                                                                 engine_id, headers, query):
    r = rendezvous
    before = r.state()
    url = r.url(template.replace("{id}", engine_id)).with_query(query)
    assume(len(url.raw_path_qs) < MAX_REQUEST_LINE)
    async with r.http.request(method, url, headers=headers) as resp:
        if resp.status == 200 and resp.headers.get("Content-Type", "").startswith("application/x-ndjson"):
            first = await resp.content.readline()  # a watch: open-ended; its first line is enough
            assert first.endswith(b"\n")
            WatchEvent.model_validate_json(first)  # a snapshot's RESET, or the events after `since`
            resp.close()
            status = 200
        else:
            await _answer(resp)
            status = resp.status
    writes = method in ("PUT", "POST", "DELETE")
    if status >= 400 or not writes:
        after = r.state()
        # A renewal changes no version or content (only the lease); anything else must leave it all as it was.
        assert after == before, (method, url, status)
    await _still_reads(r)
    r.reset()


@SHARED_SERVER
@given(body=put_bodies(), token=st.sampled_from(["pod", "down", "junk", ""]) | st.text(
    st.characters(min_codepoint=33, max_codepoint=126), max_size=20),
       method=st.sampled_from(["PUT", "POST", "DELETE"]), engine_id=st.sampled_from(["keep", "other-1", "x"]))
async def test_kubernetes_auth_rejections_change_nothing_and_a_failed_review_is_503(kube_rendezvous, body, token,
                                                                                   method, engine_id):
    r = kube_rendezvous
    before = r.state()
    path = f"/v1/engines/{engine_id}" + ("/renew" if method == "POST" else "")
    async with r.http.request(method, r.url(path), data=body if method == "PUT" else None,
                              headers={"Authorization": f"Bearer {token}"}) as resp:
        await _answer(resp, kube=True)
        status = resp.status
        if status == 503:
            assert token == "down"
    if status >= 400 or method == "POST":
        assert r.state() == before
    await _still_reads(r)
    r.reset()
