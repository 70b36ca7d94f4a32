"""A push prefill engine (core 0) and a pull decode engine (core 1), both advertised to one rendezvous: one
engine of each mode is enough to show that routers never pair engines of different transfer modes."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from support.engines import PROMPTS, advertised, await_advertised, completion, post

pytestmark = pytest.mark.engines


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
