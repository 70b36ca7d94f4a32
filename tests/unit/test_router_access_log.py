"""The router's per-request access log (connector/router/access_log.py): a router on 127.0.0.1 in front of
stand-in engines (tests/support/stub_engines.py), writing to a real file."""
from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest
from multidict import CIMultiDict

from disagg.connector.router.access_log import AccessLog
from disagg.connector.router.app import DECODE_HEADER, PREFILL_HEADER, Router, Settings
from disagg.connector.router.engine_pool import EnginePool
from support.stub_engines import KvBoard, StubEngine, serving, stub_engines


async def run(tmp_path: Path, mode: str, bodies: list[dict], fail_first_prefill: bool = False) -> tuple[
        list[tuple[int, CIMultiDict[str]]], list[dict]]:
    board = KvBoard()
    p_a, p_b = StubEngine("p-a", "prefill", mode=mode, board=board), StubEngine("p-b", "prefill", mode=mode,
                                                                               board=board)
    d_1 = StubEngine("d-1", "decode", mode=mode, board=board)
    if fail_first_prefill:
        p_a.fail_status = 500
    log_path = tmp_path / "access.jsonl"
    access = AccessLog.open(str(log_path))
    answers = []
    async with stub_engines(p_a, p_b, d_1):
        engines = [p_a.advertisement(), p_b.advertisement(), d_1.advertisement()]
        router = Router(EnginePool(mode, lambda: engines), Settings(mode=mode), access_log=access)
        async with serving(router.app()) as url, aiohttp.ClientSession() as s:
            for body in bodies:
                async with s.post(url + "/v1/completions", json=body) as r:
                    await r.read()
                    answers.append((r.status, r.headers.copy()))
    access.close()
    return answers, [json.loads(line) for line in log_path.read_text().splitlines()]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("stream", [False, True])
async def test_a_push_request_is_one_line_with_its_exact_timings(tmp_path, stream):
    [(status, headers)], [line] = await run(tmp_path, "push", [{"prompt": "x", "max_tokens": 2, "stream": stream}])
    assert status == 200
    assert (line["status"], line["attempts"], line["mode"], line["endpoint"]) == (200, 1, "push", "completions")
    assert line["request_id"] == headers["X-Request-Id"]
    assert (line["prefill"], line["decode"]) == (headers[PREFILL_HEADER], headers[DECODE_HEADER])
    ms = line["ms"]
    # Push: the decode leg is on its way before prefill answers; the first token only after prefill's KV.
    assert 0 <= ms["start"] <= ms["decode_sent"] < ms["prefill_done"] <= ms["first_token"] <= ms["done"]
    assert line["handoff_ms"] == pytest.approx(ms["first_token"] - ms["prefill_done"], abs=0.002)
    assert line["error"] is None


@pytest.mark.timeout(30)
async def test_pull_sends_decode_after_prefill_answered(tmp_path):
    _, [line] = await run(tmp_path, "pull", [{"prompt": "x", "max_tokens": 2, "stream": True}])
    ms = line["ms"]
    assert ms["prefill_done"] <= ms["decode_sent"] <= ms["first_token"] <= ms["done"]


@pytest.mark.timeout(30)
async def test_a_retried_request_records_its_last_attempt(tmp_path):
    [(status, headers)], [line] = await run(tmp_path, "push", [{"prompt": "x", "max_tokens": 2}],
                                            fail_first_prefill=True)
    assert status == 200 and line["attempts"] == 2
    assert (line["prefill"], line["request_id"]) == ("p-b", headers["X-Request-Id"])


@pytest.mark.timeout(30)
async def test_a_refused_request_has_its_status_and_message_and_no_attempt(tmp_path):
    answers, lines = await run(tmp_path, "push", [{"prompt": "x", "n": 2}, {"prompt": "x", "max_tokens": 1}])
    assert [a[0] for a in answers] == [400, 200]
    refused, served = lines
    assert (refused["status"], refused["attempts"], refused["request_id"]) == (400, 0, None)
    assert refused["error"] == "'n' must be 1" and refused["ms"]["first_token"] is None
    assert refused["handoff_ms"] is None and served["status"] == 200


@pytest.mark.timeout(30)
def test_standard_output_gets_each_line_as_the_request_ends():
    """`--access-log -` in a pod: stdout is a pipe (the container's log), which Python would block-buffer. A line
    must reach the pipe while the router runs, not when it exits."""
    import os
    import subprocess
    import sys

    child = ("import sys\n"
             "from disagg.connector.router.access_log import AccessLog\n"
             "AccessLog.open('-').record(time=0.0, received=1.0, done=1.5, endpoint='completions', mode='push', "
             "status=200, attempts=0, last=None, error=None)\n"
             "sys.stdin.read()\n")  # stays alive until the test closes its stdin
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # an image need not set it
    p = subprocess.Popen([sys.executable, "-c", child], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    try:
        assert p.stdout is not None
        line = json.loads(p.stdout.readline())  # blocks (until the timeout) if the line sits in a buffer
        assert (line["status"], line["ms"]["done"]) == (200, 500.0)
        assert p.poll() is None, "the line came before the process ended"
    finally:
        p.communicate(timeout=10)
