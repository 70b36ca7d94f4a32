"""The emulator's tokenizer and its output text. Pure and deterministic: the same prompt always gives the same
tokens and the same answer, as a greedy engine does.

Tokens: `bytes_per_token` UTF-8 bytes each. With 1 it is the tiny models' tokenizer exactly (a byte-level BPE with
no merges and no BOS: a token's id is its byte's rank in GPT-2's byte-to-character table), so prompt lengths and
token ids match the real engine's `/tokenize`. With more, a token's id is a stable hash of its bytes, and lengths
approximate a BPE tokenizer's (about 4 bytes per token for English).

Chat prompts use the tiny models' chat template (`role: content` per message, then `assistant: `).
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

WORDS = ("the", "engine", "emulator", "answers", "with", "tokens", "it", "never", "computed", "a", "model",
         "of", "time", "and", "blocks", "in", "place", "for", "fleet", "size", "tests", "only")
"""An emulated answer is made of these words: legible, and plainly not a model's."""


def _byte_ranks() -> list[int]:
    """GPT-2's bytes_to_unicode (what a ByteLevel pre-tokenizer uses), as each byte's rank among the 256
    characters: the order a vocabulary of bare bytes lists them in (`!` is 0, a space 220)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    char = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in char:
            char[b] = 256 + extra
            extra += 1
    order = sorted(range(256), key=lambda b: char[b])
    rank = [0] * 256
    for i, b in enumerate(order):
        rank[b] = i
    return rank


_BYTE_RANK = _byte_ranks()


def tokenize(text: str, bytes_per_token: int, vocab_size: int) -> list[int]:
    data = text.encode()
    if bytes_per_token == 1:
        return [_BYTE_RANK[b] % vocab_size for b in data]
    return [int.from_bytes(hashlib.blake2b(data[i:i + bytes_per_token], digest_size=4).digest(), "big") % vocab_size
            for i in range(0, len(data), bytes_per_token)]


def chat_prompt(messages: Sequence[tuple[str, str]], add_generation_prompt: bool = True) -> str:
    """The tiny models' chat template (devcluster/tinymodel.py), applied to (role, content) pairs."""
    text = "".join(f"{role}: {content}\n" for role, content in messages)
    return text + ("assistant: " if add_generation_prompt else "")


def answer_seed(prompt: Sequence[int]) -> bytes:
    """What a request's answer is drawn from: a function of its prompt alone, so both legs of a P/D request and
    every repetition of it agree, as greedy decoding does."""
    h = hashlib.blake2b(digest_size=8)
    for t in prompt:
        h.update(t.to_bytes(4, "big"))
    return h.digest()


def answer_token(seed: bytes, i: int, vocab_size: int) -> int:
    """The `i`-th output token (from 0) of the answer drawn from `seed`."""
    return int.from_bytes(hashlib.blake2b(seed + i.to_bytes(4, "big"), digest_size=4).digest(), "big") % vocab_size


def text_of(token_id: int) -> str:
    """One output token's text: a word and a space."""
    return WORDS[token_id % len(WORDS)] + " "
