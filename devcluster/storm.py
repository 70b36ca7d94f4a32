"""Client load with aborts, and verified answers in the middle of it: what users send a P/D deployment.

A storm sends, through one OpenAI-compatible endpoint (the router), for `seconds`:
- aborted requests, at `abort_rate` per second (Poisson): streamed completions whose client goes away at a
  random moment, drawn so that some go before the first token is possible, some during prefill, some around the
  KV handoff and some mid-stream (where each one really ended is read afterwards from the router's access log);
- background requests, at `background_rate` per second: streamed completions that run to their end;
- verification requests, one after another, never aborted: greedy answers to prompts whose answers were
  recorded on the quiet deployment first (`record`), compared exactly.

Prompts of the aborted and background requests are random text; verification prompts are windows of the text
the test model learned by heart (`tinymodel`), so each of their next tokens wins by a margin that no batch order
can flip (`Reference.margin`), and any difference from the reference is a wrong token.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp

from disagg.compare.replay import data_events

ALPHABET = "abcdefghijklmnopqrstuvwxyz     "
Endpoint = Literal["completions", "chat"]
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class Reference:
    """A verification prompt's greedy answer on the quiet deployment, with how sure the model was of each token."""

    endpoint: Endpoint
    prompt: str
    max_tokens: int
    text: str
    margin: float
    """The least, over the answer's tokens, of the top token's log-probability minus the runner-up's (nats)."""

    def body(self, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"model": "tiny", "max_tokens": self.max_tokens, "temperature": 0,
                                "ignore_eos": True, "stream": stream}
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        return body


def corpus_windows(text: str, lengths: Iterable[int], seed: int = 0) -> list[str]:
    """Prompts cut from `text` read round and round, each starting at a word, of the given lengths in characters
    (one character is one token for the test model's byte-level tokenizer)."""
    rng = random.Random(seed)
    cyclic = text * 4
    starts = [i + 1 for i, ch in enumerate(text) if ch == " "]
    return [cyclic[s:s + n] for s, n in zip((rng.choice(starts) for _ in lengths), lengths, strict=False)]


async def record(session: aiohttp.ClientSession, url: str, endpoint: Endpoint, prompt: str,
                 max_tokens: int) -> Reference:
    """The greedy answer to `prompt` and its least top-2 margin (vLLM's logprobs; NaN, which no bound passes, when
    the engine returns none)."""
    ref = Reference(endpoint, prompt, max_tokens, "", 0.0)
    body = ref.body(stream=False)
    if endpoint == "chat":
        body |= {"logprobs": True, "top_logprobs": 2}
    else:
        body["logprobs"] = 2
    async with session.post(url + PATHS[endpoint], json=body) as r:
        answer = await r.json()
        if r.status != 200:
            raise RuntimeError(f"recording a reference failed: HTTP {r.status} {answer}")
    choice = answer["choices"][0]
    if choice.get("logprobs") is None:  # an engine emulator computes none: its answers have no margin to measure
        return Reference(endpoint, prompt, max_tokens,
                         choice["message"]["content"] if endpoint == "chat" else choice["text"], math.nan)
    if endpoint == "chat":
        text = choice["message"]["content"]
        tops = [[t["logprob"] for t in tok["top_logprobs"]] for tok in choice["logprobs"]["content"]]
    else:
        text = choice["text"]
        tops = [list(d.values()) for d in choice["logprobs"]["top_logprobs"]]
    margins = [max(lp) - sorted(lp)[-2] if len(lp) > 1 else float("inf") for lp in tops]
    return Reference(endpoint, prompt, max_tokens, text, min(margins))


@dataclass
class Verified:
    reference: int
    stream: bool
    status: int
    text: str | None
    seconds: float

    @property
    def correct(self) -> bool:
        return self.status == 200


@dataclass
class Aborted:
    after: float
    """Seconds after sending at which the client went away (or would have: `finished` if it ended first)."""
    chunks: int
    """Chunks received before going away."""
    request_id: str | None
    finished: bool = False


@dataclass
class StormReport:
    verified: list[Verified] = field(default_factory=list)
    aborted: list[Aborted] = field(default_factory=list)
    background: list[tuple[int, float | None]] = field(default_factory=list)
    """Background requests: (status, TTFT seconds or None)."""
    background_errors: list[tuple[int, str | None, str]] = field(default_factory=list)
    """The failed ones: (status, the router's X-Request-Id if it answered, the error body or exception)."""
    kept: list[tuple[int, float | None]] = field(default_factory=list)
    """The control run's would-be aborted requests, whose clients waited: (status, TTFT seconds or None)."""
    references: list[Reference] = field(default_factory=list)

    def wrong(self) -> list[tuple[Verified, Reference]]:
        """Answers that came back (200) with text other than the reference's."""
        return [(v, self.references[v.reference]) for v in self.verified
                if v.status == 200 and v.text != self.references[v.reference].text]

    def failed(self) -> list[Verified]:
        return [v for v in self.verified if v.status != 200]


def _random_prompt(rng: random.Random, lengths: tuple[int, int]) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(*lengths)))


async def _stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                  on_chunk: Any = None) -> tuple[int, str, str | None, float | None]:
    """One streamed completion: (status, text, X-Request-Id, TTFT); `on_chunk(n)` after each data chunk."""
    t0 = time.monotonic()
    ttft, parts, n = None, [], 0
    async with session.post(url, json=body) as r:
        rid = r.headers.get("X-Request-Id")
        if r.status != 200:
            return r.status, (await r.text())[:300], rid, None
        async for data in data_events(r):
            if "error" in data:
                return 502, json.dumps(data)[:300], rid, ttft
            for ch in data.get("choices", []):
                parts.append(ch.get("text") or (ch.get("delta") or {}).get("content") or "")
            if ttft is None:
                ttft = time.monotonic() - t0
            n += 1
            if on_chunk is not None:
                on_chunk(n)
    return 200, "".join(parts), rid, ttft


async def verify(session: aiohttp.ClientSession, url: str, i: int, ref: Reference, stream: bool) -> Verified:
    t0 = time.monotonic()
    path = url + PATHS[ref.endpoint]
    text: str | None
    try:
        if stream:
            status, text, _, _ = await _stream(session, path, ref.body(stream=True))
        else:
            async with session.post(path, json=ref.body(stream=False)) as r:
                answer = await r.json(content_type=None)
                status = r.status
                choice = (answer.get("choices") or [{}])[0] if status == 200 else {}
                text = choice.get("text") if ref.endpoint == "completions" else (choice.get("message") or {}).get(
                    "content")
                if status != 200:
                    text = json.dumps(answer)[:300]
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        status, text = 0, f"{type(e).__name__}: {e}"
    return Verified(i, stream, status, text, time.monotonic() - t0)


async def _abort(session: aiohttp.ClientSession, url: str, rng: random.Random, lengths: tuple[int, int],
                 typical_ttft: float, report: StormReport, go_away: bool) -> None:
    """One request whose client goes away: at a moment drawn from four kinds, so that every phase of a request is
    hit in a run of a few dozen. Not `go_away` (the control): the same request asks for as many tokens as its
    client would have waited for (one, when it would have gone before the first), and gets them all: about the
    same work, finished instead of abandoned."""
    kind = rng.choice(["at once", "prefill", "handoff", "stream"])
    after = {"at once": rng.uniform(0, 0.02), "prefill": rng.uniform(0.02, max(0.03, typical_ttft * 0.8)),
             "handoff": typical_ttft * rng.uniform(0.8, 1.3), "stream": float("inf")}[kind]
    stop_at = rng.randint(1, 6) if kind == "stream" else None
    body = {"model": "tiny", "prompt": _random_prompt(rng, lengths), "max_tokens": rng.randint(12, 48),
            "temperature": 0, "ignore_eos": True, "stream": True}
    if not go_away:
        body["max_tokens"] = stop_at or 1
        status, _, _, ttft = await _stream(session, url + PATHS["completions"], body)
        report.kept.append((status, ttft))
        return
    got = Aborted(after, 0, None)
    gone = asyncio.Event()

    def on_chunk(n: int) -> None:
        got.chunks = n
        if stop_at is not None and n >= stop_at:
            gone.set()

    t0 = time.monotonic()
    task = asyncio.create_task(_stream(session, url + PATHS["completions"], body, on_chunk))
    waiter = asyncio.create_task(gone.wait())
    done, _ = await asyncio.wait({task, waiter}, timeout=None if after == float("inf") else after,
                                 return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if task in done:
        got.finished = True
        got.request_id = task.result()[2]
    else:
        task.cancel()  # the client goes away: the connection closes
        got.after = time.monotonic() - t0
    report.aborted.append(got)


async def background(session: aiohttp.ClientSession, url: str, rng: random.Random, lengths: tuple[int, int],
                     report: StormReport) -> None:
    """One background request: a random prompt of a length in `lengths`, streamed to its end; its outcome goes to
    `report.background`."""
    body = {"model": "tiny", "prompt": _random_prompt(rng, lengths), "max_tokens": rng.randint(8, 48),
            "temperature": 0, "ignore_eos": True, "stream": True}
    try:
        status, text, rid, ttft = await _stream(session, url + PATHS["completions"], body)
    except (aiohttp.ClientError, TimeoutError) as e:
        status, text, rid, ttft = 0, repr(e)[:300], None, None
    report.background.append((status, ttft))
    if status != 200:
        report.background_errors.append((status, rid, text))


async def storm(url: str, references: list[Reference], *, seconds: float, abort_rate: float,
                background_rate: float, prompt_lengths: tuple[int, int], typical_ttft: float, seed: int = 0,
                verify_rate: float | None = None, go_away: bool = True,
                request_timeout: float = 120.0) -> StormReport:
    """Run the storm against `url` (see the module's docstring); verification cycles through `references`,
    alternating streamed and whole answers, one after another (`verify_rate` None) or at that rate (Poisson).
    Not `go_away`: the control run, where the clients of the would-be aborted requests wait for their answers
    (`kept`). Returns once every request sent has ended."""
    rng = random.Random(seed)
    report = StormReport(references=list(references))
    timeout = aiohttp.ClientTimeout(total=request_timeout)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        end = time.monotonic() + seconds
        tasks: set[asyncio.Task[None]] = set()

        def spawn(coro: Any) -> None:
            task = asyncio.create_task(coro)
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        async def arrivals(rate: float, make: Any) -> None:
            """Poisson arrivals of `make(rng)`, each with a generator of its own: the same seed gives the same
            arrivals and requests in every arm, whatever order the event loop runs them in."""
            if rate <= 0:
                return
            own = random.Random(rng.getrandbits(64))
            at = time.monotonic()
            while True:
                at += own.expovariate(rate)
                if at >= end:
                    return
                await asyncio.sleep(max(0.0, at - time.monotonic()))
                spawn(make(random.Random(own.getrandbits(64))))

        turn = iter(range(1 << 62))

        async def one_verification(_rng: random.Random | None = None) -> None:
            i = next(turn)
            k = i % len(references)
            report.verified.append(await verify(session, url, k, references[k], stream=bool(i % 2)))

        async def verification() -> None:
            while time.monotonic() < end:
                await one_verification()

        await asyncio.gather(
            arrivals(abort_rate, lambda r: _abort(session, url, r, prompt_lengths, typical_ttft, report, go_away)),
            arrivals(background_rate, lambda r: background(session, url, r, prompt_lengths, report)),
            verification() if verify_rate is None else arrivals(verify_rate, one_verification))
        while tasks:
            await asyncio.gather(*list(tasks), return_exceptions=True)
    return report


def abort_phases(report: StormReport, access_log: list[dict[str, Any]]) -> dict[str, int]:
    """Where each aborted request really ended, from the router's access log (status 499, its last attempt's
    times): before its legs went out, during prefill, between prefill's answer and the first token (the KV
    handoff), or after the first token; and those whose answer ended before the client could go away."""
    phases = {"before the legs": 0, "during prefill": 0, "during the handoff": 0, "mid-stream": 0,
              "finished first": sum(a.finished for a in report.aborted)}
    for line in access_log:
        if line.get("status") != 499:
            continue
        ms = line.get("ms") or {}
        if ms.get("start") is None:
            phases["before the legs"] += 1
        elif ms.get("prefill_done") is None:
            phases["during prefill"] += 1
        elif ms.get("first_token") is None:
            phases["during the handoff"] += 1
        else:
            phases["mid-stream"] += 1
    return phases
