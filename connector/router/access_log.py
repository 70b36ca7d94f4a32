"""The router's per-request record: one JSON line per request, for benchmarks to read exact per-request figures
(the KV handoff above all) instead of interpolating histogram buckets.

A line (`--access-log PATH`, `-` for standard output) has:
- `time`: when the router received the request (seconds since the epoch);
- `request_id`: the `X-Request-Id` both legs of the last attempt carried (also a response header), or null when
  no attempt was made (a refused body, no pair);
- `endpoint`, `mode`, `status` (the HTTP status the client got), `attempts` (legs sent: 0, 1 or 2);
- `prefill`, `decode`: the engines of the last attempt;
- `ms`: milliseconds from receipt, on one monotonic clock, of the last attempt's `start`, `prefill_done`
  (prefill answered), `decode_sent` (the decode leg handed to the HTTP client), `first_token` (first token relayed) and
  `done` (the answer finished); absent ones are null;
- `handoff_ms`: `first_token` minus `prefill_done`, the KV handoff, when both are known;
- `error`: the last upstream failure, when the request was not served;
- `prefix` (prefix-aware routing, when the request was routed by the index; else null): `prompt_tokens`, the
  `predicted` cached tokens of the last attempt's `prefill` and `decode` engines, `decode_only` (prefill skipped:
  `prefill` above is then null), and `actual`: the cached tokens the engine that computed the prompt reported
  (`usage.prompt_tokens_details.cached_tokens`), null when it did not.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any, TextIO


@dataclass
class Attempt:
    """One try of a request on one pair. Times are time.monotonic(); None until they happen."""

    request_id: str
    prefill: str | None
    decode: str
    start: float
    prefill_done: float | None = None
    decode_sent: float | None = None
    first_token: float | None = None
    prefix: Prefix | None = None


@dataclass
class Prefix:
    """What prefix-aware routing predicted for one attempt, and what the engine reported."""

    prompt_tokens: int
    prefill: int | None
    """Predicted cached tokens on the prefill engine; None when decode ran alone."""
    decode: int
    actual: int | None = None

    @property
    def decode_only(self) -> bool:
        return self.prefill is None


class AccessLog:
    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    @classmethod
    def open(cls, path: str) -> AccessLog:
        """Appends to `path` (`-`: standard output) line-buffered, so each record is written whole as the request
        ends, even when standard output is a pipe (a container's log)."""
        if path == "-":
            return cls(open(sys.stdout.fileno(), "w", buffering=1, encoding="utf-8", closefd=False))  # noqa: SIM115
        return cls(open(path, "a", buffering=1, encoding="utf-8"))  # noqa: SIM115

    def record(self, *, time: float, received: float, done: float, endpoint: str, mode: str, status: int,
               attempts: int, last: Attempt | None, error: str | None) -> None:
        def ms(t: float | None) -> float | None:
            return None if t is None else round((t - received) * 1000, 3)

        handoff = None
        if last is not None and last.first_token is not None and last.prefill_done is not None:
            handoff = round((last.first_token - last.prefill_done) * 1000, 3)
        line: dict[str, Any] = {
            "time": round(time, 6), "request_id": last.request_id if last else None, "endpoint": endpoint,
            "mode": mode, "status": status, "attempts": attempts,
            "prefill": last.prefill if last else None, "decode": last.decode if last else None,
            "ms": {"start": ms(last.start if last else None), "prefill_done": ms(last.prefill_done if last else None),
                   "decode_sent": ms(last.decode_sent if last else None),
                   "first_token": ms(last.first_token if last else None), "done": ms(done)},
            "handoff_ms": handoff, "error": error, "prefix": None,
        }
        if last is not None and (p := last.prefix) is not None:
            line["prefix"] = {"prompt_tokens": p.prompt_tokens, "predicted": {"prefill": p.prefill, "decode": p.decode},
                              "decode_only": p.decode_only, "actual": p.actual}
        self.stream.write(json.dumps(line, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self.stream.close()
