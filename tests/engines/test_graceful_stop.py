"""A push prefill stopped as the kubelet stops a pod, under a steady stream of streamed requests, loses nothing.

The kubelet sends SIGTERM to the pod's first process (for an engine, vLLM's API server) and SIGKILL at the end of
the grace period. The engine leaves the rendezvous at once and drains what it holds; what it cannot finish in
its drain, the router runs again once the prefill's probes fail; requests that find no prefill wait for the
replacement, up to the router's pair wait.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid

import pytest

from disagg.operator.engine_builders import DRAIN_EXIT_SECONDS
from support.engine_pair import Pair
from support.engines import PROMPTS, await_status, completion, log_lines, polled
from support.metrics import scrape

pytestmark = pytest.mark.engines

RATE_PER_S = 1.0
"""Well below what the pair serves here (a salt each: no prefix-cache hit), so the requests held while no prefill
is left (about 40 s of them) clear within the read timeout once the replacement is up."""
BURST = 24
"""Sent at once on top of the stream."""
HELD_AT_STOP = 12
"""Requests the prefill holds when it is stopped. It drains that many within a second here, so it is a prefill with
no drain that leaves requests to run again."""
PAIR_WAIT_S = 120.0
"""Long enough for a replacement prefill to start and advertise itself (about 40 s here)."""
READ_TIMEOUT_S = 180.0
"""The held requests reach the replacement pair at once; the last of them waits in its queue for the others."""
GRACE_S = 5 + DRAIN_EXIT_SECONDS
"""An engine pod's terminationGracePeriodSeconds: the engines here drain for 5 s (`--shutdown-timeout 5`)."""


@pytest.fixture(scope="module")
def stop_pair(vllm_python, model, engine_logs, rendezvous, reference, plugin_dir):
    pair = Pair("push", vllm_python, model, engine_logs, rendezvous, plugin_dir, name="stop",
                router_args=("--pair-wait-seconds", str(PAIR_WAIT_S), "--request-timeout", str(READ_TIMEOUT_S)))
    try:
        yield pair.start()
    finally:
        pair.stop()


class Outcome:
    def __init__(self, sent: float) -> None:
        self.sent, self.done = sent, 0.0
        self.status: int | None = None
        self.text, self.error = "", ""


def streamed(url: str, prompt_index: int, outcome: Outcome) -> None:
    """One streamed completion; its outcome is an HTTP status, the text, and any error event in the stream."""
    # A salt of its own: no prefix-cache hit, so every prefill computes its whole prompt and a stop finds work.
    body = {**completion(PROMPTS[prompt_index]), "stream": True, "cache_salt": uuid.uuid4().hex}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    parts = []
    try:
        with urllib.request.urlopen(req, timeout=PAIR_WAIT_S + READ_TIMEOUT_S + 60) as r:
            outcome.status = r.status
            for line in r:
                line = line.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    outcome.error = json.dumps(chunk["error"])[:300]
                for ch in chunk.get("choices", []):
                    parts.append(ch.get("text") or "")
    except urllib.error.HTTPError as e:
        outcome.status, outcome.error = e.code, e.read().decode()[:300]
    except OSError as e:
        outcome.error = repr(e)
    outcome.text = "".join(parts)
    outcome.done = time.monotonic()


class OpenLoop(threading.Thread):
    """Requests sent at a fixed rate, each on its own thread, whatever the answers take."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.halt = url, threading.Event()
        self.sent: list[tuple[int, Outcome, threading.Thread]] = []
        self.ticked = threading.Condition()

    def run(self) -> None:
        while not self.halt.wait(1 / RATE_PER_S):
            self.send()

    def send(self) -> None:
        with self.ticked:
            i = len(self.sent)
            outcome = Outcome(time.monotonic())
            t = threading.Thread(target=self._one, args=(i % len(PROMPTS), outcome), daemon=True)
            t.start()
            self.sent.append((i % len(PROMPTS), outcome, t))
            self.ticked.notify_all()

    def _one(self, prompt_index: int, outcome: Outcome) -> None:
        streamed(self.url, prompt_index, outcome)
        with self.ticked:
            self.ticked.notify_all()

    def wait_until(self, predicate, timeout: float = 300) -> None:
        """Until `predicate` holds of the requests sent and finished (checked at each send and each answer)."""
        with self.ticked:
            assert self.ticked.wait_for(predicate, timeout), f"not reached in {timeout} s"

    def finish(self) -> list[tuple[int, Outcome]]:
        self.halt.set()
        self.join()
        for _, _, t in self.sent:
            t.join(PAIR_WAIT_S + READ_TIMEOUT_S + 120)
        return [(i, o) for i, o, _ in self.sent]


def test_a_push_prefill_stopped_as_the_kubelet_does_under_load_loses_no_request(stop_pair, reference):
    """A steady stream of streamed requests, and a burst on top of it; SIGTERM to the prefill's API server once it
    holds many requests (computing, queued, or done with their WRITE pending), then SIGKILL to what is left at the
    end of the grace period, as the kubelet does. Twice: a prefill that drains finishes what it holds; one with no
    drain (`drainSeconds: 0`) aborts it, and the router runs it again on the replacement. Nothing hangs or fails,
    every answer equals a single engine's, and decode computed no prompt of its own."""
    url, prefill, decode = stop_pair.router.url, stop_pair.prefill, stop_pair.decode
    await_status(url + "/health")
    source = "vllm:prompt_tokens_by_source_total"
    computed = metric(decode.url, source, source="local_compute")
    received = metric(decode.url, source, source="external_kv_transfer")
    legs = metric(url, "disagg_router_decode_legs_total", mode="push")
    load = OpenLoop(url + "/v1/completions")
    load.start()
    try:
        load.wait_until(lambda: sum(1 for _, o, _ in load.sent if o.done) >= 10)  # the stream is going
        drained_after = stop_as_the_kubelet_does(load, prefill)
        drained = log_lines(prefill, "draining in-flight requests")
        prefill.spec.drain_seconds = 0
        replace(prefill, url, load)
        retried = metric(url, "disagg_router_prefill_retries_total")
        aborted_after = stop_as_the_kubelet_does(load, prefill)
        replace(prefill, url, load)
    finally:
        results = load.finish()
    retried = metric(url, "disagg_router_prefill_retries_total") - retried
    bad = [(round(o.sent, 2), round(o.done, 2), o.status, o.error, o.text[:40], i)
           for i, o in results if o.status != 200 or o.error or o.text != reference[("completion", i)]]
    print(f"{len(results)} sent; a draining prefill gone {drained_after:.1f} s after SIGTERM ({drained}), one with "
          f"no drain {aborted_after:.1f} s after; {retried:g} retried")
    assert [n for n in map(held_at_drain, drained) if n >= 1], "the drain found no request in flight: it proved nothing"
    assert drained_after < GRACE_S, "the drain did not end on its own within the grace period"
    assert retried >= 1, "the aborted requests were not run again"
    assert bad == []
    legs = metric(url, "disagg_router_decode_legs_total", mode="push") - legs
    assert metric(decode.url, source, source="local_compute") - computed <= legs
    assert metric(decode.url, source, source="external_kv_transfer") > received
    assert metric(prefill.url, "vllm:nixl_xfer_time_seconds_count") >= 1  # the replacement WRITEs too


def stop_as_the_kubelet_does(load: OpenLoop, prefill) -> float:
    """A burst on top of the stream; SIGTERM to the prefill's API server once it holds HELD_AT_STOP requests, and
    SIGKILL to its processes at the end of the grace period. Returns the seconds from SIGTERM until it was gone."""
    api_server = prefill.processes()[0]
    for _ in range(BURST):
        load.send()
    assert polled(lambda: held(prefill.url) >= HELD_AT_STOP, 30, interval=0.01), \
        f"the prefill never held {HELD_AT_STOP} requests at once"
    t_stop = time.monotonic()
    os.kill(api_server, signal.SIGTERM)
    try:
        prefill.proc.wait(GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(prefill.proc.pid, signal.SIGKILL)  # the end of the pod's grace period
        prefill.proc.wait()
    return time.monotonic() - t_stop


def replace(prefill, url: str, load: OpenLoop) -> None:
    """The stopped prefill's replacement, up and serving the stream (ten more requests sent)."""
    prefill.start().wait_ready()
    await_status(url + "/health", timeout=60)
    n = len(load.sent)
    load.wait_until(lambda: len(load.sent) >= n + 10)


def held_at_drain(line: str) -> int:
    """The count in vLLM's `draining in-flight requests count=N` line."""
    return int(re.search(r"count=(\d+)", line).group(1))


def held(url: str) -> float:
    return metric(url, "vllm:num_requests_running") + metric(url, "vllm:num_requests_waiting")


def metric(url: str, name: str, **labels: str) -> float:
    return scrape(url + "/metrics", name, **labels)
