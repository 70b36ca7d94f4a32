"""A request's prompt token ids, as the engine will see them: what prefix-aware routing matches against the index.

The engine tokenizes: the router asks an engine's `/tokenize` (vLLM's OpenAI server, and the emulator's) with the
request's own prompt or messages and the fields that change how they become tokens. That is the model's tokenizer
and chat template by construction, whatever the model, so the router keeps no tokenizer of its own and cannot drift
from the engine's; it costs one local HTTP round trip per request (bench/kv_routing.py measures it), which costs the
router less CPU than a real tokenizer would: Qwen3's, kept in the router, 1.7-6.4x as much (bench/tokenize_cost.py).

`tokenize_body` (pure) says what to ask, or that no question is needed: a completions prompt of token ids is its own
answer. A request with several prompts, or none the router can read (embeddings), gets no preference: routing falls
back to least-loaded for it, as when the engine cannot answer.
"""
from __future__ import annotations

from typing import Any

import msgspec

from .pd_protocol import Endpoint

CHAT_TEMPLATE_FIELDS = ("add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template",
                        "chat_template_kwargs", "tools", "documents", "mm_processor_kwargs")
"""The chat request's fields that vLLM's chat /tokenize also takes, each changing the tokens the template renders."""
COMPLETION_FIELDS = ("add_special_tokens",)


def tokenize_body(endpoint: Endpoint, body: dict[str, Any]) -> dict[str, Any] | list[int] | None:
    """The /tokenize request for `body`'s prompt; its token ids when the request carries them; None when the request
    has no single prompt to match (several prompts, prompt embeddings, or a shape the engine will refuse anyway)."""
    model = body.get("model")
    if endpoint == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        out: dict[str, Any] = {"messages": messages}
        fields: tuple[str, ...] = CHAT_TEMPLATE_FIELDS
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]  # one prompt in a list: the same request
        if isinstance(prompt, list):
            if prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
                return list(prompt)
            return None
        if not isinstance(prompt, str) or "prompt_embeds" in body:
            return None
        out = {"prompt": prompt}
        fields = COMPLETION_FIELDS
    if model is not None:
        out["model"] = model
    for key in fields:
        if key in body:
            out[key] = body[key]
    return out


class _Answer(msgspec.Struct):
    tokens: list[int]


_ANSWER = msgspec.json.Decoder(_Answer)
_QUESTION = msgspec.json.Encoder()


def question(ask: dict[str, Any]) -> bytes:
    """The /tokenize request's JSON body."""
    return _QUESTION.encode(ask)


def token_ids(answer: bytes) -> list[int] | None:
    """The token ids of a /tokenize answer's JSON body, or None when it is not one. msgspec decodes and checks the
    ids in one pass, in C: a prompt's thousands of ids cost the router a few microseconds, where json and a Python
    check of each cost it a third of a millisecond (bench/kv_routing.py's prompts)."""
    try:
        return _ANSWER.decode(answer).tokens
    except msgspec.DecodeError:
        return None
