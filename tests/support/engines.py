"""Real vLLM CPU engines, the rendezvous and the router as processes, for the data-plane tests."""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable

from disagg.connector.router import pd_protocol
from disagg.connector.wire.advertisement import EngineAdvertisement
from disagg.devcluster.procs import DisaggService
from support.metrics import scrape

PROMPTS = ["The quick brown fox jumps over the lazy dog. " * 8,
           "Disaggregated serving splits prefill and decode. " * 20]
MAX_TOKENS = 12
LAZY_HANDSHAKE = "side-channel handshake with engine"
"""What the plugin logs when vLLM's lazy GET_META handshake runs instead of the advertised metadata."""


def completion(prompt: str) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}


def chat(prompt: str) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True}


class Service(DisaggService):
    """`disagg rendezvous` or `disagg router` as a child process; start() returns once it serves."""

    def start(self, ready_path: str = "/health", timeout: float = 30, ok=None) -> Service:
        # Any status by default: a router answers /health (503) before it has a pair to route to.
        super().start()
        return self.wait_http(self.url + ready_path, timeout, ok)


def post(url: str, body: dict, timeout: float = 120, request_id: str | None = None) -> tuple[int, dict | str]:
    headers = {"Content-Type": "application/json", **({"X-Request-Id": request_id} if request_id else {})}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        text = e.read().decode()
        try:
            return e.code, json.loads(text)
        except json.JSONDecodeError:
            return e.code, text


def post_raw(url: str, data: bytes, timeout: float = 30) -> tuple[int, str]:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def stream_text(url: str, body: dict, timeout: float = 120) -> str:
    """Concatenate the text of an SSE completion/chat stream."""
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    out = []
    with urllib.request.urlopen(req, timeout=timeout) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for ch in chunk.get("choices", []):
                out.append(ch.get("text") or (ch.get("delta") or {}).get("content") or "")
    return "".join(out)


def text_of(resp: dict) -> str:
    ch = resp["choices"][0]
    return ch.get("text") if "text" in ch else ch["message"]["content"]


def metric(url: str, name: str, **labels: str) -> float:
    return scrape(url + "/metrics", name, **labels)


class Load(threading.Thread):
    """A steady stream of requests in the background, recording each outcome."""

    def __init__(self, url: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.results: list[tuple[int, str]] = []
        self.halt = threading.Event()
        self._done = threading.Condition()

    def run(self) -> None:
        while not self.halt.is_set():
            status, resp = post(self.url, self.body, timeout=60)
            with self._done:
                self.results.append((status, "" if status == 200 else str(resp)[:200]))
                self._done.notify_all()

    def await_results(self, n: int, timeout: float = 120) -> None:
        with self._done:
            if not self._done.wait_for(lambda: len(self.results) >= n, timeout):
                raise TimeoutError(f"only {len(self.results)} of {n} requests finished in {timeout}s")

    def stop(self) -> list[tuple[int, str]]:
        self.halt.set()
        self.join(120)
        return self.results


def polled(condition: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    """Whether `condition()` holds within `timeout`, read every `interval` s: another process's state (its metrics,
    its log) has no event to await."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def await_status(url: str, status: int = 200, timeout: float = 30) -> None:
    """Poll an HTTP endpoint until it answers `status` (another process's state has no event to await)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = urllib.request.urlopen(url, timeout=2).status
        except urllib.error.HTTPError as e:
            last = e.code
        except OSError as e:
            last = repr(e)
        if last == status:
            return
        time.sleep(0.1)
    raise TimeoutError(f"{url} answered {last}, not {status}, for {timeout}s")


def log_lines(engine, needle: str) -> list[str]:
    """Lines of the engine's current incarnation's log that contain `needle`."""
    text = engine.log.read_text(errors="replace")
    current = text[text.rfind("=== start "):]
    return [line for line in current.splitlines() if needle in line]


def await_log(engine, needle: str, timeout: float = 60) -> str:
    """Wait until the engine logs `needle` (another process's log has nothing to await but polling)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if lines := log_lines(engine, needle):
            return lines[0]
        time.sleep(0.1)
    raise TimeoutError(f"{engine.spec.name} did not log {needle!r} in {timeout}s; log {engine.log}\n{engine.tail()}")


def advertised(rendezvous_url: str) -> dict[str, EngineAdvertisement]:
    with urllib.request.urlopen(rendezvous_url + "/v1/engines", timeout=5) as r:
        return {e["engine_id"]: EngineAdvertisement.model_validate(e) for e in json.load(r)["engines"]}


def await_advertised(rendezvous_url: str, engine_id: str, timeout: float = 60) -> EngineAdvertisement:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if (adv := advertised(rendezvous_url).get(engine_id)) is not None:
                return adv
        except OSError:
            pass
        time.sleep(0.2)  # another process's registry: nothing to await but polling
    raise TimeoutError(f"{engine_id} not advertised at {rendezvous_url} within {timeout}s")


def push_decode_leg(prefill, decode, body: dict, request_id: str, timeout: float = 60) -> tuple[int, dict | str]:
    """A push request's decode leg sent straight to `decode`, naming `prefill` as the engine that will WRITE the
    KV of `request_id` (what the router sends, without the router or the rendezvous)."""
    adv = EngineAdvertisement(role="prefill", engine_id=prefill.spec.engine_id, deployment="tests",
                              http_url=prefill.url, side_channel_host="127.0.0.1",
                              side_channel_ports=[prefill.spec.side_channel_port], tp_size=1, block_size=128,
                              layout_key="any", kv_mode="push")
    return post(decode.url + "/v1/completions",
                pd_protocol.decode_body(body, pd_protocol.push_decode_params("completions", request_id, adv)),
                request_id=request_id, timeout=timeout)


def push_by_hand(prefill, decode, body: dict, sequential: bool = False) -> tuple[int, dict | str]:
    """Both legs of a push request sent straight to the engines (no router, no rendezvous), as the router does:
    at once, or (`sequential`) the decode leg once the prefill leg has answered."""
    rid = uuid.uuid4().hex
    prefill_result: list = []
    leg = threading.Thread(target=lambda: prefill_result.append(
        post(prefill.url + "/v1/completions", pd_protocol.prefill_body("completions", body), request_id=rid)))
    leg.start()
    if sequential:
        leg.join(60)
    out = push_decode_leg(prefill, decode, body, rid)
    leg.join(60)
    assert prefill_result and prefill_result[0][0] == 200, prefill_result
    return out


class KvMoved:
    """Proof that a block of P/D requests took its KV from the prefill engine: the decode engine computed at most
    one prompt token per request itself (the last, which vLLM may recompute) and took the rest from prefill (or its
    own prefix cache), and the transfer counter of the engine that drives transfers moved (push: prefill WRITEs;
    pull: decode READs).
    vLLM's own counters, read before and after: `with KvMoved(prefill_url, decode_url, mode) as kv: ...` then
    `kv.check(requests)`. A decode that recomputed its prompts would pass an output comparison, not this."""

    def __init__(self, prefill_url: str, decode_url: str, mode: str) -> None:
        self.decode_url = decode_url
        self.driver_url = prefill_url if mode == "push" else decode_url

    def _read(self) -> tuple[float, float, float]:
        source = "vllm:prompt_tokens_by_source_total"
        return (scrape(self.decode_url + "/metrics", source, source="local_compute"),
                scrape(self.decode_url + "/metrics", source, source="external_kv_transfer"),
                scrape(self.driver_url + "/metrics", "vllm:nixl_xfer_time_seconds_count"))

    def __enter__(self) -> KvMoved:
        self.before = self._read()
        return self

    def __exit__(self, *exc: object) -> None:
        self.after = self._read()

    def check(self, requests: int) -> None:
        computed, received, transfers = (a - b for a, b in zip(self.after, self.before, strict=True))
        assert computed <= requests, f"decode computed {computed} prompt tokens itself for {requests} requests"
        assert received > 0 and transfers >= 1, f"no KV crossed: {received} tokens received, {transfers} transfers"


def kv_moved(prefill, decode, mode: str) -> KvMoved:
    """KvMoved for two local engines (LocalEngine)."""
    return KvMoved(prefill.url, decode.url, mode)


def check_outputs(router_url: str, reference: dict, kv: KvMoved) -> None:
    """Every prompt's greedy answer through the router equals a single engine's, for completions and chat,
    streamed and not, and each of them took its prompt's KV from prefill (`kv`)."""
    with kv:
        for i, prompt in enumerate(PROMPTS):
            status, resp = post(router_url + "/v1/completions", completion(prompt))
            assert status == 200, resp
            assert text_of(resp) == reference[("completion", i)]
            assert stream_text(router_url + "/v1/completions", completion(prompt)) == reference[("completion", i)]
            status, resp = post(router_url + "/v1/chat/completions", chat(prompt))
            assert status == 200, resp
            assert text_of(resp) == reference[("chat", i)]
            assert stream_text(router_url + "/v1/chat/completions", chat(prompt)) == reference[("chat", i)]
    kv.check(4 * len(PROMPTS))
