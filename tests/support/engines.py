"""Real vLLM CPU engines, the rendezvous and the router as processes, for the data-plane tests."""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

from disagg.devcluster.procs import DisaggService
from support.metrics import scrape


PROMPTS = ["The quick brown fox jumps over the lazy dog. " * 8, "Disaggregated serving splits prefill and decode. " * 20]
MAX_TOKENS = 12


def completion(prompt: str) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}


def chat(prompt: str) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True}


class Service(DisaggService):
    """`disagg rendezvous` or `disagg router` as a child process; start() returns once it serves."""

    def start(self, ready_path: str = "/health", timeout: float = 30, ok=None) -> "Service":
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
