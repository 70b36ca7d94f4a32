"""What `disagg compare` replays: requests, each a prompt or a chat conversation and the tokens to generate, read
from a user's JSONL file or built in; and when each is sent (Poisson arrivals at a rate, seeded).

Every request asks for exactly its output length (`ignore_eos`, greedy), so both modes generate the same tokens
and their TPOT compares like with like.
"""
from __future__ import annotations

import json
import random
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import ErrorDetails

MAX_OUTPUT_TOKENS = 1_000_000


class WorkloadError(ValueError):
    """A workload that cannot be replayed; the message names the line and the field."""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class WorkloadRequest(BaseModel):
    """One line of a workload file: `prompt` (completions) or `messages` (chat), and `max_tokens` (also read as
    `output_tokens` or `output_len`). Other fields on the line are ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    max_tokens: int = Field(validation_alias=AliasChoices("max_tokens", "output_tokens", "output_len"), ge=1,
                            le=MAX_OUTPUT_TOKENS)

    @model_validator(mode="after")
    def _one_input(self) -> WorkloadRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.prompt is not None and not self.prompt:
            raise ValueError("prompt is empty")
        if self.messages is not None and not self.messages:
            raise ValueError("messages is empty")
        return self

    def tagged(self, tag: str) -> WorkloadRequest:
        """The same request with `tag` before its prompt (or its first message): segments that replay the same
        workload then share no prefix, so none is served from a cache an earlier segment filled, while the
        workload's own sharing within a segment stays."""
        if self.prompt is not None:
            return self.model_copy(update={"prompt": f"{tag} {self.prompt}"})
        first, *rest = self.messages or ()
        return self.model_copy(update={"messages": (first.model_copy(update={"content": f"{tag} {first.content}"}),
                                                    *rest)})

    @property
    def path(self) -> str:
        return "/v1/completions" if self.prompt is not None else "/v1/chat/completions"

    def body(self, model: str) -> dict[str, Any]:
        """The streamed OpenAI request for it, with usage in the last chunk."""
        out: dict[str, Any] = {"model": model, "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True,
                               "stream": True, "stream_options": {"include_usage": True}}
        if self.prompt is not None:
            out["prompt"] = self.prompt
        else:
            out["messages"] = [m.model_dump() for m in self.messages or ()]
        return out


def _where(error: ErrorDetails) -> str:
    return ".".join(str(p) for p in error["loc"]) or "line"


def parse_jsonl(text: str, source: str = "workload") -> list[WorkloadRequest]:
    """The requests of a JSONL text, one JSON object per line (blank lines skipped). Raises WorkloadError naming
    `source`, the line number and the field of the first bad line."""
    out = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as e:
            raise WorkloadError(f"{source}:{number}: not JSON ({e.msg})") from None
        if not isinstance(data, dict):
            raise WorkloadError(f"{source}:{number}: a line must be a JSON object, got {type(data).__name__}")
        try:
            out.append(WorkloadRequest.model_validate(data))
        except ValidationError as e:
            first = e.errors()[0]
            raise WorkloadError(f"{source}:{number}: {_where(first)}: {first['msg']}") from None
    if not out:
        raise WorkloadError(f"{source}: no requests")
    return out


WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa quebec "
         "romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def synthetic(requests: int, prompt_words: int, output_tokens: int, seed: int) -> list[WorkloadRequest]:
    """`requests` completions of `prompt_words` random words each (no two sharing a prefix beyond chance, so no
    mode gains from a prefix cache), each asking for `output_tokens` tokens."""
    if requests < 1 or prompt_words < 1 or not 1 <= output_tokens <= MAX_OUTPUT_TOKENS:
        raise WorkloadError("a synthetic workload needs at least one request of at least one word, and from 1 to "
                            f"{MAX_OUTPUT_TOKENS} output tokens")
    rng = random.Random(seed)
    return [WorkloadRequest(prompt=" ".join(rng.choice(WORDS) for _ in range(prompt_words)),
                            max_tokens=output_tokens) for _ in range(requests)]


def arrivals(count: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each of `count` requests is sent: a Poisson process at `rate` per second.
    The same seed gives the same arrivals, so each mode's segments are offered the same load."""
    if not rate > 0:
        raise WorkloadError(f"the rate must be positive, got {rate}")
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate)
        out.append(round(t, 6))
    return out
