"""Engine emulators under KV pressure, behind the real `disagg router` and `disagg rendezvous`: more requests at once
than either engine's KV cache holds are all answered, with their KV moved, and none waits for a timeout.

A push decode admits a request in two moves: it takes blocks for the whole prompt and waits for its KV, then runs it.
vLLM keeps such a request in its waiting queue ahead of later arrivals, so once its KV lands it runs, even while the
next request waits for blocks. Queued behind that request instead, it would wait for blocks that only its own
progress frees, and the decode would stall until its registration timeout (tests/engines/test_aborts.py holds real
engines to the same)."""
from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from disagg.devcluster.emulated_engines import EmulatorSpec, LocalEmulator
from disagg.devcluster.engines import LocalRendezvous
from support.engines import KvMoved, Service, completion, post
from support.metrics import scrape

RENDEZVOUS = LocalRendezvous(token="emulator-kv-pressure", deployment="pressure", heartbeat=1)
BLOCKS = 8
"""KV blocks per engine, of 128 tokens: two requests' prompts at once."""
PROMPT_TOKENS = 300
"""Three blocks a prompt (the emulator's tokenizer takes a byte at a time)."""
REQUESTS = 12
REGISTRATION_TIMEOUT_S = 30
"""Far longer than the whole burst takes unstalled (about 2 s here), so no request is saved by it."""


@pytest.fixture(scope="module", params=["push", "pull"])
def tight(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, ...]]:
    mode = str(request.param)
    logs: Path = tmp_path_factory.mktemp(f"pressure-{mode}")
    rdv = Service(f"rendezvous-{mode}", [*RENDEZVOUS.args(), "--log-level", "WARNING"], logs).start()
    flags = ["--time-scale", "0.05", "--kv-cache-blocks", str(BLOCKS), "--max-model-len", "1024",
             "--registration-timeout", str(REGISTRATION_TIMEOUT_S)]
    env = RENDEZVOUS.engine_env(rdv.url)
    engines = [LocalEmulator(EmulatorSpec(f"tight-{mode}-{role}", role, mode, rendezvous_env=env, flags=flags),
                             logs).start() for role in ("prefill", "decode")]
    router = Service(f"router-{mode}", ["router", "--mode", mode, "--rendezvous", rdv.url, "--pair-wait-seconds",
                                        "5", "--request-timeout", str(2 * REGISTRATION_TIMEOUT_S)], logs)
    try:
        for e in engines:
            e.wait_ready()
        router.start(ready_path="/health", ok=(200,))
        yield mode, router.url, engines[0].url, engines[1].url
    finally:
        router.stop()
        for e in engines:
            e.stop()
        rdv.stop()


def test_more_requests_than_the_kv_cache_holds_are_all_answered_with_their_kv_moved(tight):
    mode, url, prefill, decode = tight
    rng = random.Random(36)
    prompts = ["".join(rng.choices("abcdefgh", k=PROMPT_TOKENS)) for _ in range(REQUESTS)]
    assert REQUESTS * -(-PROMPT_TOKENS // 128) > 2 * BLOCKS  # more than both caches hold at once
    with KvMoved(prefill, decode, mode) as kv, ThreadPoolExecutor(REQUESTS) as pool:
        answers = list(pool.map(lambda p: post(url + "/v1/completions", {**completion(p), "max_tokens": 16},
                                               timeout=3 * REGISTRATION_TIMEOUT_S), prompts))
    # A stalled decode request fails at its registration timeout (an error, not a 200).
    assert [status for status, _ in answers] == [200] * REQUESTS, answers
    kv.check(REQUESTS)
    assert scrape(decode + "/metrics", "vllm:kv_cache_usage_perc") == 0  # and nothing is left held
