"""Clients that go away, on real engines: no wrong token, no KV left held, no one else stalled, in push and pull.

One pair per mode (the module's fixture, push then pull; two engines at a time), with a KV cache of a few dozen
blocks, so that blocks are freed and handed to other requests all the time. A storm (devcluster/storm.py) sends
aborted requests (the client goes away before the first token, during prefill, around the handoff, mid-stream),
background requests and verification requests, whose greedy answers were recorded on the quiet pair first. The
test model learned its verification texts by heart (devcluster/tinymodel.py): each next token wins by several
nats, which no batch order moves, so a verification answer that differs from its reference is a wrong token.

Push also gets the registration-timeout path: a prefill stalled (SIGSTOP, as a noisy neighbour or a long pause
would) past its decode's registration timeout must not WRITE into the blocks that decode gave up.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import threading
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import pytest

from disagg.connector.router import pd_protocol
from disagg.devcluster import storm, tinymodel
from support.engine_pair import Pair
from support.engines import KvMoved, await_log, await_status, completion, log_lines, post, push_decode_leg
from support.metrics import scrape

pytestmark = pytest.mark.engines

BLOCKS = 40
"""KV blocks per engine: 5,120 tokens, a dozen requests' worth, so the storm keeps evicting and reusing them."""
REGISTRATION_S = 20.0
SURE = 2.0
"""Nats by which every token of a verification reference must beat the runner-up: batch order moves the test
model's logits by hundredths at most."""
PROMPT_LENGTHS = (64, 360)
PRESSURE_REQUESTS = 16
PRESSURE_PROMPT_TOKENS = 1000
"""Eight blocks a prompt (the test model's tokenizer takes a character at a time): five fit an engine at once."""
ABORTS_PER_S = 1.0


@pytest.fixture(scope="module", params=["push", "pull"])
def storm_pair(request, vllm_python, model, engine_logs, rendezvous, reference, plugin_dir, tmp_path_factory):
    access_log = tmp_path_factory.mktemp("storm") / f"{request.param}-access.jsonl"
    pair = Pair(request.param, vllm_python, model, engine_logs, rendezvous, plugin_dir, name="storm",
                access_log=access_log, num_blocks=BLOCKS, max_model_len=2048,
                push_registration_timeout=REGISTRATION_S)
    try:
        yield pair.start()
    finally:
        pair.stop()


def engine_metric(engine, name: str, **labels: str) -> float:
    return scrape(engine.url + "/metrics", name, **labels)


def await_idle(*engines, timeout: float = 60) -> None:
    """Each engine runs and queues nothing and holds no KV block (vLLM's own gauges; another process's state, so
    polled)."""
    deadline = time.monotonic() + timeout
    while True:
        held = {e.spec.name: {g: engine_metric(e, f"vllm:{g}") for g in
                              ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")}
                for e in engines}
        if all(v == 0 for gauges in held.values() for v in gauges.values()):
            return
        assert time.monotonic() < deadline, f"engines not idle with no KV held {timeout}s after the load: {held}"
        time.sleep(0.5)


class DownWatch(threading.Thread):
    """Samples the router's view of its engines every half second: any engine it ever marked down."""

    def __init__(self, router_url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.halt, self.seen_down = router_url, threading.Event(), []

    def run(self) -> None:
        while not self.halt.wait(0.5):
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                engines = json.load(r).get("engines", {})
            if any(k.endswith("/down") and n for k, n in engines.items()):
                self.seen_down.append(engines)

    def stop(self) -> list[dict]:
        self.halt.set()
        self.join(10)
        return self.seen_down


def references(url: str) -> list[storm.Reference]:
    corpus = tinymodel.corpus()
    prompts = storm.corpus_windows(corpus, (120, 200, 280, 340), seed=7)

    async def go() -> list[storm.Reference]:
        async with aiohttp.ClientSession() as s:
            refs = [await storm.record(s, url, "completions", p, 24) for p in prompts]
            refs.append(await storm.record(s, url, "chat", "Why push mode?", 24))
            return refs
    return asyncio.run(go())


def test_a_storm_of_aborts_leaves_no_wrong_answer_no_held_kv_and_no_engine_down(storm_pair):
    p, d, url = storm_pair.prefill, storm_pair.decode, storm_pair.router.url
    await_status(url + "/health")
    refs = references(url)
    assert all(r.margin >= SURE for r in refs), [(r.prompt[:30], r.margin) for r in refs]
    # A typical answer's time to first token on the quiet pair, to aim aborts at prefill and at the handoff.
    started = time.monotonic()
    assert post(url + "/v1/completions", completion("x" * PROMPT_LENGTHS[1]))[0] == 200
    typical_ttft = time.monotonic() - started
    decode_local = engine_metric(d, "vllm:prompt_tokens_by_source_total", source="local_compute")
    decode_moved = engine_metric(d, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")

    watch = DownWatch(url)
    watch.start()
    report = asyncio.run(storm.storm(url, refs, seconds=60, abort_rate=ABORTS_PER_S, background_rate=0.5,
                                     prompt_lengths=PROMPT_LENGTHS, typical_ttft=typical_ttft, seed=11))
    down = watch.stop()
    access = [json.loads(line) for line in storm_pair.access_log.read_text().splitlines()]
    phases = storm.abort_phases(report, access)
    print(f"{storm_pair.mode}: {len(report.verified)} verified, {len(report.aborted)} aborted {phases}, "
          f"{len(report.background)} background")

    assert report.wrong() == [], "wrong tokens"
    assert report.failed() == [], "verification requests that were never aborted failed"
    assert [s for s, _ in report.background if s != 200] == []
    assert down == [], "an engine was marked down"
    assert len(report.verified) >= 10 and len(report.aborted) >= 30
    # The client went away in every phase of a request, from before any leg to mid-stream.
    assert phases["during prefill"] and phases["mid-stream"] and phases["before the legs"] + phases["during prefill"]
    await_idle(p, d)
    # Decode computed nothing of any prompt but at most its last token: the KV always came from prefill.
    computed = engine_metric(d, "vllm:prompt_tokens_by_source_total", source="local_compute") - decode_local
    received = engine_metric(d, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") - decode_moved
    assert computed <= len(report.verified) + len(report.background) + len(report.aborted) and received > 0
    if storm_pair.mode == "push":
        # The mechanism, not luck: the decode cancelled its aborted requests with the prefill, which answered every
        # cancel, and no registration ran into its timeout (the stall a few aborts a second used to cause).
        assert log_lines(d, "telling prefill engine"), "no cancel was ever sent"
        assert log_lines(d, "did not answer the cancel") == []
        assert log_lines(d, "timed out after") == []
        assert log_lines(p, "its decode will not take its KV") or log_lines(p, "dropped")


def test_more_requests_than_the_kv_cache_holds_are_all_answered_with_their_kv_moved(storm_pair):
    """Requests whose prompts need three times the blocks either engine has, all at once: a push decode holds
    blocks for requests whose KV is on its way while later ones wait for blocks, and a prefill holds finished
    requests' blocks for their decodes. Each runs once its KV lands, so all are answered, none fails at its
    registration timeout, and nothing stays held (tests/emulator/test_kv_pressure.py holds the emulator to the
    same)."""
    p, d, url = storm_pair.prefill, storm_pair.decode, storm_pair.router.url
    await_status(url + "/health")
    rng = random.Random(36)
    prompts = ["".join(rng.choices(storm.ALPHABET, k=PRESSURE_PROMPT_TOKENS)) for _ in range(PRESSURE_REQUESTS)]
    assert PRESSURE_REQUESTS * -(-PRESSURE_PROMPT_TOKENS // p.spec.block_size) >= 3 * BLOCKS
    with KvMoved(p.url, d.url, storm_pair.mode) as kv, ThreadPoolExecutor(PRESSURE_REQUESTS) as pool:
        answers = list(pool.map(lambda prompt: post(url + "/v1/completions", {**completion(prompt), "max_tokens": 8},
                                                    timeout=3 * REGISTRATION_S), prompts))
    assert [status for status, _ in answers] == [200] * PRESSURE_REQUESTS, answers
    kv.check(PRESSURE_REQUESTS)
    await_idle(p, d)
    assert log_lines(d, "timed out after") == []


def _worker_pid(engine) -> int:
    (pid,) = [pid for pid in engine.processes() if Path(f"/proc/{pid}/comm").read_text().startswith("VLLM::Worker")]
    return pid


@pytest.mark.parametrize("storm_pair", ["push"], indirect=True)  # a pull decode reads: nothing is written into it
def test_a_stalled_prefill_never_writes_into_blocks_its_decode_gave_up(storm_pair):
    """The registration-timeout path: the request's prefill engine stops (SIGSTOP) before it can compute; the
    decode gives up at its registration timeout and cancels with the prefill. Its blocks stay held until the
    prefill answers; the prefill, resumed, drops the registration, computes the prefill and hands its blocks back
    without a WRITE. Without the cancel, the decode freed the blocks at the timeout, and the late prefill WROTE its
    KV into them, by then another request's."""
    p, d, url = storm_pair.prefill, storm_pair.decode, storm_pair.router.url
    refs = references(url)
    writes = engine_metric(p, "vllm:nixl_xfer_time_seconds_count")
    rid = uuid.uuid4().hex
    body = completion(tinymodel.corpus()[:300])
    answers: dict[str, tuple[float, tuple[int, dict | str]]] = {}

    def send(role: str, call) -> threading.Thread:
        def run() -> None:
            got = call()
            answers[role] = (time.monotonic(), got)
        thread = threading.Thread(target=run)
        thread.start()
        return thread

    worker = _worker_pid(p)
    os.kill(worker, signal.SIGSTOP)
    try:
        legs = [send("prefill", lambda: post(p.url + "/v1/completions", pd_protocol.prefill_body("completions", body),
                                             request_id=rid, timeout=180)),
                send("decode", lambda: push_decode_leg(p, d, body, rid, timeout=180))]
        await_log(d, f"cmpl-{rid}-0", timeout=30)  # the decode registered it
        await_log(d, "timed out; telling prefill engine", timeout=REGISTRATION_S + 30)
        assert "decode" not in answers
    finally:
        resumed = time.monotonic()
        os.kill(worker, signal.SIGCONT)
    for leg in legs:
        leg.join(120)
    answered, (status, resp) = answers["decode"]
    assert status == 500 and "error" in resp, (status, resp)
    assert answered > resumed, "the decode freed its blocks before its prefill answered the cancel"
    assert answers["prefill"][1][0] == 200  # the prefill was computed after all ...
    await_log(p, f"cmpl-{rid}-0", timeout=30)
    assert [line for line in log_lines(p, "its decode will not take its KV") if rid in line]
    assert engine_metric(p, "vllm:nixl_xfer_time_seconds_count") == writes  # ... and never written to the decode
    await_idle(p, d)

    async def verify() -> list[storm.Verified]:
        async with aiohttp.ClientSession() as s:
            return [await storm.verify(s, url, i, r, stream=False) for i, r in enumerate(refs)]
    assert [(v.status, v.text) for v in asyncio.run(verify())] == [(200, r.text) for r in refs]
    assert engine_metric(p, "vllm:nixl_xfer_time_seconds_count") > writes  # the counter does count WRITEs
