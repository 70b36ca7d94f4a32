"""The OpenAI API as vLLM 0.32 speaks it, for the emulator: typed requests in, vLLM's response shapes out. Pure.

Requests are parsed leniently where vLLM is lenient (unknown fields are accepted and ignored) and refused where it
refuses (a missing prompt, n other than 1, a length past the context, another model's name), always with vLLM's
error body `{"error": {"message", "type", "param", "code"}}` and a 4xx. tests/emulator/test_wire_format.py holds
every shape to a real engine's recorded answers (tests/emulator/vllm_wire/).
"""
from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..wire.emulator import OWNER
from . import tokens as tok

Endpoint = Literal["completions", "chat"]
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class BadRequest(Exception):
    """A request vLLM would refuse: `status` (4xx), vLLM's error type name and the parameter at fault."""

    def __init__(self, message: str, status: int = 400, kind: str = "BadRequestError",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param


class Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(Lenient):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class ContentPart(Lenient):
    type: str
    text: str | None = None


class ChatMessage(Lenient):
    role: str
    content: str | list[ContentPart] | None = None


class CommonRequest(Lenient):
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int = 1
    kv_transfer_params: dict[str, Any] | None = None


class CompletionRequest(CommonRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = COMPLETIONS_DEFAULT_MAX_TOKENS


class ChatRequest(CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None


@dataclass(frozen=True)
class Parsed:
    """A request the emulator will serve."""

    endpoint: Endpoint
    prompt: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    kv_transfer_params: dict[str, Any] | None


def error_body(message: str, status: int, kind: str = "BadRequestError", param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def parse(endpoint: Endpoint, body: Any, *, served_model_name: str, max_model_len: int, bytes_per_token: int,
          vocab_size: int) -> Parsed:
    """BadRequest for anything vLLM would refuse."""
    try:
        req: CompletionRequest | ChatRequest = (CompletionRequest if endpoint == "completions" else ChatRequest) \
            .model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise BadRequest(f"{first['msg']} at {where or 'the body'} ({e.error_count()} validation error(s))",
                         param=where or None) from None
    if req.model is not None and req.model != served_model_name:
        raise BadRequest(f"The model `{req.model}` does not exist. Valid aliases: {served_model_name}.", 404,
                         "NotFoundError", "model")
    if req.n != 1:
        raise BadRequest("the engine emulator serves n=1 only")
    if isinstance(req, CompletionRequest):
        prompt = _completion_prompt(req.prompt, bytes_per_token, vocab_size)
        wanted = req.max_tokens
    else:
        prompt = tok.tokenize(tok.chat_prompt([(m.role, _content(m.content)) for m in req.messages]),
                              bytes_per_token, vocab_size)
        wanted = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if not prompt:
        raise BadRequest("The prompt is empty: it must have at least one token.")
    if len(prompt) >= max_model_len:
        raise BadRequest(f"This model's maximum context length is {max_model_len} tokens. However, your request "
                         f"has {len(prompt)} input tokens. Please reduce the length of the input messages.")
    if wanted is not None and wanted > max_model_len:
        raise BadRequest(f"max_tokens={wanted} cannot be greater than max_model_len={max_model_len}. Please request "
                         f"fewer output tokens. (parameter=max_tokens, value={wanted})", param="max_tokens")
    max_tokens = max_model_len - len(prompt) if wanted is None else wanted
    if max_tokens < 1:
        raise BadRequest(f"max_tokens must be at least 1, got {max_tokens}.")
    if len(prompt) + max_tokens > max_model_len:
        raise BadRequest(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                         f"{max_tokens} output tokens and your prompt contains {len(prompt)} input tokens, for a "
                         f"total of {len(prompt) + max_tokens} tokens. Please reduce the length of the input prompt "
                         "or the number of requested output tokens.")
    stream = bool(req.stream)
    if req.stream_options is not None and not stream:
        raise BadRequest("Stream options can only be defined when `stream=True`.")
    include_usage = bool(stream and req.stream_options is not None and req.stream_options.include_usage)
    return Parsed(endpoint, prompt, max_tokens, stream, include_usage, req.kv_transfer_params)


def _completion_prompt(prompt: str | list[int] | list[str] | list[list[int]], bytes_per_token: int,
                       vocab_size: int) -> list[int]:
    if isinstance(prompt, str):
        return tok.tokenize(prompt, bytes_per_token, vocab_size)
    if prompt and all(isinstance(p, int) for p in prompt):
        ids = [int(p) for p in prompt]  # type: ignore[arg-type]
        if any(t < 0 or t >= vocab_size for t in ids):
            raise BadRequest(f"Token id out of vocabulary (size {vocab_size}).")
        return ids
    if len(prompt) == 1:
        (only,) = prompt
        return _completion_prompt(only, bytes_per_token, vocab_size)  # type: ignore[arg-type]
    raise BadRequest("the engine emulator serves one prompt per request (no batches)")


def _content(content: str | list[ContentPart] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.text or "" for p in content if p.type == "text")


# -- answers ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Answer:
    """What a finished request answers with."""

    request_id: str
    """The response id: `cmpl-<X-Request-Id>` or `chatcmpl-<X-Request-Id>`."""
    model: str
    created: int
    prompt_tokens: int
    cached_tokens: int
    created_cache_tokens: int
    """Chat only (vLLM reports none for completions): prompt tokens this request newly put in the prefix cache."""
    token_ids: Sequence[int]
    finish_reason: str | None
    kv_transfer_params: dict[str, Any] | None
    fingerprint: str


def response_id(endpoint: Endpoint, x_request_id: str) -> str:
    return f"cmpl-{x_request_id}" if endpoint == "completions" else f"chatcmpl-{x_request_id}"


def internal_id(endpoint: Endpoint, x_request_id: str) -> str:
    """vLLM's request id without its random suffix (what a push decode's remote_request_id names)."""
    return f"cmpl-{x_request_id}-0" if endpoint == "completions" else f"chatcmpl-{x_request_id}"


def usage(endpoint: Endpoint, a: Answer, streamed: bool) -> dict[str, Any]:
    """vLLM's usage: a streamed one leaves out what is null."""
    details: dict[str, Any] = {"cached_tokens": a.cached_tokens,
                               "created_cache_tokens": a.created_cache_tokens if endpoint == "chat" else None,
                               "multimodal_tokens": None}
    out: dict[str, Any] = {"prompt_tokens": a.prompt_tokens, "total_tokens": a.prompt_tokens + len(a.token_ids),
                           "completion_tokens": len(a.token_ids), "prompt_tokens_details": details,
                           "completion_tokens_details": None}
    if streamed:
        out["prompt_tokens_details"] = {k: v for k, v in details.items() if v is not None}
        del out["completion_tokens_details"]
    return out


def text(token_ids: Sequence[int]) -> str:
    return "".join(tok.text_of(t) for t in token_ids)


def completion(endpoint: Endpoint, a: Answer) -> dict[str, Any]:
    """The whole answer of a request that was not streamed."""
    out: dict[str, Any] = {"id": a.request_id, "object": "text_completion" if endpoint == "completions"
                           else "chat.completion", "created": a.created, "model": a.model}
    if endpoint == "completions":
        out["choices"] = [{"index": 0, "text": text(a.token_ids), "logprobs": None, "finish_reason": a.finish_reason,
                           "stop_reason": None, "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None,
                           "routed_experts": None}]
    else:
        out["choices"] = [{"index": 0, "message": {"role": "assistant", "content": text(a.token_ids),
                                                   "refusal": None, "annotations": None, "audio": None,
                                                   "function_call": None, "reasoning": None},
                           "logprobs": None, "finish_reason": a.finish_reason, "stop_reason": None,
                           "token_ids": None, "routed_experts": None}]
    out.update({"service_tier": None, "system_fingerprint": a.fingerprint, "usage": usage(endpoint, a, False)})
    if endpoint == "chat":
        out.update({"prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None})
    out.update({"kv_transfer_params": a.kv_transfer_params, "ec_transfer_params": None, "metrics": None})
    return out


def role_chunk(request_id: str, model: str, created: int) -> bytes:
    """A streamed chat answer's first event, sent with its first token."""
    return sse({"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}], "prompt_token_ids": None, "prompt_text": None})


def chunk(endpoint: Endpoint, request_id: str, model: str, created: int, token_ids: Sequence[int],
          finish_reason: str | None) -> bytes:
    """One SSE event of a streamed answer: one step's tokens (the last one carries the finish reason)."""
    if endpoint == "completions":
        choice: dict[str, Any] = {"index": 0, "text": text(token_ids), "logprobs": None,
                                  "finish_reason": finish_reason, "stop_reason": None, "prompt_token_ids": None,
                                  "token_ids": None}
        return sse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                    "choices": [choice]})
    choice = {"index": 0, "delta": {"content": text(token_ids)}, "logprobs": None, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = None
    choice["token_ids"] = None
    return sse({"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [choice]})


def usage_chunk(endpoint: Endpoint, a: Answer) -> bytes:
    obj = "text_completion" if endpoint == "completions" else "chat.completion.chunk"
    return sse({"id": a.request_id, "object": obj, "created": a.created, "model": a.model, "choices": [],
                "usage": usage(endpoint, a, True), "system_fingerprint": a.fingerprint})


def sse(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def models(served_model_name: str, max_model_len: int, profile: str, created: int | None = None) -> dict[str, Any]:
    """`/v1/models`: vLLM's model card, owned by the emulator, which is how a human tells it from an engine."""
    created = int(time.time()) if created is None else created
    return {"object": "list", "data": [{
        "id": served_model_name, "object": "model", "created": created, "owned_by": OWNER,
        "root": f"{OWNER}/{profile}", "parent": None, "max_model_len": max_model_len,
        "permission": [{"id": f"modelperm-{OWNER}", "object": "model_permission", "created": created,
                        "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                        "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                        "organization": "*", "group": None, "is_blocking": False}]}]}
