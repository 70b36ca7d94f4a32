"""disagg compare's replay client and handoff join against a push pair of engine emulators behind a real router:
every request of a mixed workload (completions and chat) is timed as a client sees it, failures are named, and
the handoffs the router logs join to the client's requests by their X-Request-Id."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from disagg.compare import workload
from disagg.compare.handoffs import Served, served
from disagg.compare.replay import replay
from disagg.devcluster.emulated_engines import EmulatorSpec, LocalEmulator
from disagg.devcluster.engines import LocalRendezvous
from support.engines import Service

RENDEZVOUS = LocalRendezvous(token="compare-replay", deployment="compare", heartbeat=1)


@dataclass
class Pair:
    router: Service
    access_log: Path


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    logs: Path = tmp_path_factory.mktemp("compare-replay")
    rdv = Service("rendezvous", [*RENDEZVOUS.args(), "--log-level", "WARNING"], logs).start()
    env = RENDEZVOUS.engine_env(rdv.url)
    flags = ["--time-scale", "0.1", "--registration-timeout", "30"]
    engines = [LocalEmulator(EmulatorSpec(f"emu-{role}", role, "push", rendezvous_env=env, flags=flags), logs).start()
               for role in ("prefill", "decode")]
    access_log = logs / "access.jsonl"
    router = Service("router", ["router", "--mode", "push", "--rendezvous", rdv.url, "--pair-wait-seconds", "5",
                                "--request-timeout", "30", "--access-log", str(access_log)], logs)
    try:
        for e in engines:
            e.wait_ready()
        router.start(ready_path="/health", ok=(200,))  # 200 once it pairs the two
        yield Pair(router, access_log)
    finally:
        router.stop()
        for e in engines:
            e.stop()
        rdv.stop()


async def test_a_workload_is_replayed_on_schedule_and_every_request_is_timed(pair):
    reqs = [*workload.synthetic(6, 24, 8, seed=1),
            workload.WorkloadRequest(messages=({"role": "user", "content": "hello there"},), max_tokens=5)]
    arrivals = workload.arrivals(len(reqs), 20.0, seed=1)
    seen: list[int] = []
    async with aiohttp.ClientSession() as s:
        out = await replay(s, pair.router.url, "tiny", reqs, arrivals, timeout=30,
                           progress=lambda done, total: seen.append(done))
    assert seen == list(range(1, len(reqs) + 1))
    assert all(t.ok and t.error is None for t in out), [t.error for t in out]
    assert [t.tokens for t in out] == [8] * 6 + [5]  # ignore_eos: exactly the asked length
    assert all(t.ttft_s is not None and t.ttft_s > 0 and t.tpot_s is not None and t.tpot_s > 0 for t in out)
    assert [t.sent_s for t in out] == arrivals
    ids = [t.request_id for t in out]
    assert all(ids) and len(set(ids)) == len(ids)
    # The router's access log holds each: served in push, with a handoff (prefill done to decode's first token).
    # It writes a record as the request finishes, which can be just after the client read its last byte.
    deadline = time.monotonic() + 10
    while not set(ids) <= set(joined := served(pair.access_log.read_text().splitlines())):
        assert time.monotonic() < deadline, set(ids) - set(joined)
        await asyncio.sleep(0.05)
    assert all(joined[i].mode == "push" and joined[i].handoff_ms is not None and joined[i].handoff_ms >= 0
               for i in ids if i)


async def test_failures_are_named_not_raised(pair):
    good = workload.synthetic(1, 8, 4, seed=2)[0]
    async with aiohttp.ClientSession() as s:
        wrong_model = await replay(s, pair.router.url, "no-such-model", [good], [0.0], timeout=30)
        too_slow = await replay(s, pair.router.url, "tiny", [good.model_copy(update={"max_tokens": 500})], [0.0],
                                timeout=0.05)
    assert not wrong_model[0].ok and wrong_model[0].error.startswith("HTTP 404: "), wrong_model[0].error
    assert "does not exist" in wrong_model[0].error
    assert not too_slow[0].ok and too_slow[0].error == "no answer in 0.05 s"


def test_what_is_not_an_access_record_is_skipped():
    lines = ['{"request_id": "a", "mode": "pull", "handoff_ms": 3.5}', "INFO starting",
             '{"request_id": "b", "handoff_ms": null}', '{"request_id": null, "handoff_ms": 2}', "{broken", "[1]"]
    assert served(lines) == {"a": Served("pull", 3.5), "b": Served(None, None)}
