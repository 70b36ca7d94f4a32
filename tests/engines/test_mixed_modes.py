"""A push prefill engine (core 0) and a pull decode engine (core 1), both advertised to one rendezvous: one
engine of each mode is enough to show that routers never pair engines of different transfer modes. Then the
decode is replaced by a push decode with a short registration timeout, for what happens when a prefill never
comes."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
import uuid

import pytest

from support.engines import (
    PROMPTS,
    advertised,
    await_advertised,
    completion,
    kv_moved,
    log_lines,
    post,
    push_by_hand,
    push_decode_leg,
    text_of,
)

pytestmark = pytest.mark.engines
REGISTRATION_S = 3.0


def health(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def await_engines_seen(router_url: str, engines: dict[str, int], timeout: float = 30) -> tuple[int, dict]:
    """Poll the router's /health until its engine counts (by role/state) are `engines`."""
    deadline = time.monotonic() + timeout
    status, body = health(router_url)
    while body.get("engines") != engines and time.monotonic() < deadline:
        time.sleep(0.2)  # the router learns from the rendezvous watch: another process's state
        status, body = health(router_url)
    assert body.get("engines") == engines, body
    return status, body


class TestMixedModes:
    def test_push_and_pull_engines_are_never_paired(self, mixed_pair):
        push_router, pull_router = mixed_pair.routers
        rendezvous = mixed_pair.rendezvous.url
        prefill = await_advertised(rendezvous, mixed_pair.prefill.spec.engine_id)
        decode = await_advertised(rendezvous, mixed_pair.decode.spec.engine_id)
        assert (prefill.kv_mode, decode.kv_mode) == ("push", "pull")
        assert prefill.layout_key != decode.layout_key  # the mode is part of the local layout key
        # Each router sees exactly the one engine of its own mode, and it is up; the other is ignored.
        assert await_engines_seen(push_router.url, {"prefill/up": 1})[0] == 503
        assert await_engines_seen(pull_router.url, {"decode/up": 1})[0] == 503
        for router in (push_router, pull_router):
            status, resp = post(router.url + "/v1/completions", completion(PROMPTS[0]), timeout=10)
            assert status == 503, resp
        # Both engines were registered all along: no pair, not a missing engine.
        assert {mixed_pair.prefill.spec.engine_id, mixed_pair.decode.spec.engine_id} <= set(advertised(rendezvous))

    def test_a_decode_whose_prefill_never_comes_fails_after_the_registration_timeout(self, mixed_pair, reference):
        """`spec.kvTransfer.registrationTimeoutSeconds` on a real push decode: the decode leg names a live push
        prefill that never gets the request. vLLM's own watchdog only drops the registration (measured: the
        request still waited after 40 s); the plugin fails the receive, so the client gets an error answer within
        the timeout, and the engine goes on serving."""
        p = mixed_pair.prefill
        d = mixed_pair.replace_decode(name="mixed-push-decode", mode="push", push_registration_timeout=REGISTRATION_S)
        t0 = time.monotonic()
        status, resp = push_decode_leg(p, d, completion(PROMPTS[0]), uuid.uuid4().hex, timeout=60)
        elapsed = time.monotonic() - t0
        assert status == 500 and "error" in resp, (status, resp)
        assert REGISTRATION_S <= elapsed < REGISTRATION_S + 10, elapsed
        assert log_lines(d, "timed out after 3.0 s; failing them")
        assert d.proc.poll() is None
        # The same engine serves a push request with its prefill, and a plain one, with the reference output.
        # Sequential legs: the registration clock starts only once prefill is done, so a prefill slowed by a busy
        # machine cannot run into this engine's 3 s timeout.
        with kv_moved(p, d, "push") as kv:
            status, resp = push_by_hand(p, d, completion(PROMPTS[1]), sequential=True)
        assert status == 200 and text_of(resp) == reference[("completion", 1)]
        kv.check(1)
        status, resp = post(d.url + "/v1/completions", completion(PROMPTS[0]))
        assert status == 200 and text_of(resp) == reference[("completion", 0)]
