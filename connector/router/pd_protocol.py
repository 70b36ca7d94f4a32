"""The prefill/decode request protocol of vLLM's NIXL connectors, as pure functions.

Verified against the installed vLLM (0.32, nixl/push_scheduler.py, base_scheduler.py):
- Both legs carry the same `X-Request-Id`. vLLM derives the internal request id from it (`cmpl-<id>-0` for
  a single-prompt completion, `chatcmpl-<id>` for chat) plus a random `-xxxxxxxx` suffix; the push writer
  matches decode's registration to prefill's finished blocks on the id without that suffix.
- Push decode params must include `remote_request_id` and `tp_size`: a decode engine given push params
  without `remote_request_id` dies with a KeyError. Prefill's random suffix is unknowable before it
  answers, so the suffix-free id is sent; it is what decode's lease heartbeats name.
- This vLLM has no `transfer_id`; engines that advertise `transfer_id` support get one as well.
"""
from __future__ import annotations

import copy
import json
from typing import Any, Literal

from ..wire import strict_json
from ..wire.advertisement import EngineAdvertisement

Endpoint = Literal["completions", "chat"]
ROUTER_ONLY_FIELDS = ("kv_transfer_params",)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""vLLM's (and OpenAI's) max_tokens of a completions request that does not say."""


class BadRequest(ValueError):
    """The client's request cannot be served; the message is returned with `status` (400 unless said)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def parse_client_json(raw: bytes) -> Any:
    """A client body as strict JSON (`wire.strict_json`: UTF-8, no NaN or Infinity, not absurdly deep, Unicode
    strings); BadRequest otherwise. Whatever cannot be decoded here must not reach an engine."""
    try:
        return strict_json.loads(raw)
    except strict_json.InvalidJson as e:
        raise BadRequest(f"invalid JSON: {e}") from None


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)


def validate_client_body(endpoint: Endpoint, body: Any) -> dict[str, Any]:
    """Refuse what the router cannot split into two legs, and what one engine would accept and the other refuse:
    in push mode a decode leg refused after prefill started leaves vLLM 0.32's push state wedged."""
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {_json_type(body)}")
    for key in ROUTER_ONLY_FIELDS:
        if key in body:
            # Forwarding client-made transfer params lets anyone crash or wedge an engine.
            raise BadRequest(f"'{key}' is set by the router and must not be sent by clients")
    if endpoint == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if not (isinstance(prompt, str) and prompt) and not _token_ids(prompt):
            raise BadRequest("'prompt' must be one non-empty string or one list of token ids "
                             "(batched prompts are not supported by the disaggregated router)")
    else:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list")
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise BadRequest(f"'messages[{i}]' must be an object, got {_json_type(message)}")
    n = body.get("n", 1)
    if not (isinstance(n, int) and not isinstance(n, bool) and n == 1):
        raise BadRequest("'n' must be 1")
    for key in ("max_tokens", "max_completion_tokens"):
        if body.get(key) is not None and not _positive_int(body[key]):
            raise BadRequest(f"'{key}' must be a positive integer")
    min_tokens = body.get("min_tokens")
    if min_tokens is not None:
        # Only the decode leg carries it (prefill makes one token), so only decode would refuse a bad one.
        if not (isinstance(min_tokens, int) and not isinstance(min_tokens, bool) and min_tokens >= 0):
            raise BadRequest("'min_tokens' must be a non-negative integer")
        # vLLM 0.32's limit: chat's max_completion_tokens, else max_tokens; completions' max_tokens, 16 if absent.
        if endpoint == "chat":
            limit = body.get("max_completion_tokens") or body.get("max_tokens")
        else:
            limit = body.get("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
        if isinstance(limit, int) and min_tokens > limit:
            raise BadRequest(f"'min_tokens' ({min_tokens}) must not exceed the maximum tokens ({limit})")
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise BadRequest("'stream' must be a boolean")
    if body.get("stream_options") is not None:
        if not isinstance(body["stream_options"], dict):
            raise BadRequest("'stream_options' must be an object")
        if body["stream_options"] and body.get("stream") is not True:
            # vLLM refuses this, and only the decode leg carries stream_options.
            raise BadRequest("'stream_options' is only allowed with 'stream': true")
    return body


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


def internal_request_id(endpoint: Endpoint, request_id: str) -> str:
    """vLLM's request id for an `X-Request-Id`, without the random suffix."""
    return f"cmpl-{request_id}-0" if endpoint == "completions" else f"chatcmpl-{request_id}"


def prefill_body(endpoint: Endpoint, body: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(body)
    out["max_tokens"] = 1
    if endpoint == "chat":
        out.pop("max_completion_tokens", None)
    out["stream"] = False
    out.pop("stream_options", None)
    out.pop("min_tokens", None)  # vLLM refuses min_tokens above max_tokens, and prefill makes one token
    out["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                 "remote_block_ids": None, "remote_host": None, "remote_port": None}
    return out


def push_decode_params(endpoint: Endpoint, request_id: str, prefill: EngineAdvertisement,
                       transfer_id: bool = False) -> dict[str, Any]:
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": prefill.engine_id,
        "remote_request_id": internal_request_id(endpoint, request_id),
        "remote_host": prefill.side_channel_host,
        "remote_port": prefill.side_channel_ports[0],
        "tp_size": prefill.tp_size,
        "pp_size": prefill.pp_size,
    }
    if transfer_id:
        params["transfer_id"] = request_id
    return params


def decode_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(body)
    out["kv_transfer_params"] = params
    return out


def check_prefill_answer(prefill_response: Any) -> None:
    """Refuse a prefill answer for a request its engine aborted (vLLM answers one with finish_reason "abort", on a
    shutdown with no drain or an abort of its own): it computed no KV to hand over."""
    choices = prefill_response.get("choices") if isinstance(prefill_response, dict) else None
    first = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else None
    if first is None or first.get("finish_reason") == "abort":
        raise ValueError(f"prefill did not finish its request (finish_reason "
                         f"{first.get('finish_reason') if first else 'absent: no choices'})")


def pull_decode_params(prefill_response: Any) -> dict[str, Any]:
    """Prefill's returned params, unchanged; refuse anything that is not what a producer returns."""
    params = prefill_response.get("kv_transfer_params") if isinstance(prefill_response, dict) else None
    if not isinstance(params, dict) or not params.get("do_remote_prefill") or "remote_request_id" not in params:
        raise ValueError("prefill returned no usable kv_transfer_params (is it running as a kv_producer?)")
    return params


def compatible(prefill: EngineAdvertisement, decode: EngineAdvertisement) -> bool:
    """Only engines of one rollout generation (layout key) and one transfer mode are ever paired."""
    return (prefill.role == "prefill" and decode.role == "decode" and prefill.layout_key == decode.layout_key
            and prefill.kv_mode == decode.kv_mode and prefill.block_size == decode.block_size)


def model_list(served_model_name: str, created: int) -> dict[str, Any]:
    """/v1/models in OpenAI's shape, naming the deployment's model: the router's own answer while no decode engine
    answers it (`owned_by` says so)."""
    return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": created,
                                        "owned_by": "disagg-router", "root": served_model_name, "parent": None,
                                        "permission": []}]}


def cached_tokens(answer: Any) -> int | None:
    """`usage.prompt_tokens_details.cached_tokens` of an engine's answer (vLLM reports it with
    --enable-prompt-tokens-details), or None when it is not there."""
    usage = answer.get("usage") if isinstance(answer, dict) else None
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0 else None


STREAM_TAIL_BYTES = 8192
"""Bytes of a stream's end that hold its usage chunk and [DONE]."""


def stream_usage(tail: bytes) -> dict[str, Any] | None:
    """The last chunk with a `usage` in the end of an SSE stream (present when the client asked for
    `stream_options.include_usage`), as an answer `cached_tokens` reads; None when there is none."""
    for line in reversed(tail.split(b"\n")):
        line = line.strip()
        if not line.startswith(b"data:") or b'"usage"' not in line:
            continue
        try:
            chunk = json.loads(line[5:])
        except ValueError:
            continue
        if isinstance(chunk, dict) and isinstance(chunk.get("usage"), dict):
            return chunk
    return None
