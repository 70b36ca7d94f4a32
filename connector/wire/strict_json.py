"""What the rendezvous and the router accept as a JSON request body: RFC 8259 JSON, strictly.

Python's `json.loads` is lenient where a server must not be: it takes bytes in UTF-16 or with lone surrogates,
the non-JSON words NaN and Infinity, numbers that overflow to infinity (1e400), and strings with unpaired
surrogate escapes ("\\ud800", not Unicode text), and it fails deep inside other code (a RecursionError in a
copy or an encoder) on bodies nested a few hundred levels deep. `loads` refuses all of these with one error
type, `InvalidJson`, whose message names the problem; nothing else escapes it.
"""
from __future__ import annotations

import json
import math
from typing import Any

DEFAULT_MAX_DEPTH = 64
"""Deepest nesting of arrays and objects. Real bodies nest a handful of levels."""


class InvalidJson(ValueError):
    """The body is not strict JSON; the message says why and is meant for the sender."""


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def loads(raw: bytes, *, max_depth: int = DEFAULT_MAX_DEPTH) -> Any:
    """Decode a request body; InvalidJson for anything but UTF-8 JSON text without NaN or Infinity, at most
    `max_depth` levels deep, whose strings are all Unicode text."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidJson(f"body is not valid UTF-8 (byte {e.start}: {e.reason}); JSON must be sent as UTF-8") \
            from None
    if not text.strip():
        raise InvalidJson("body is empty")
    try:
        data = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise InvalidJson(f"nested deeper than {max_depth} levels") from None
    except ValueError as e:  # JSONDecodeError, the number checks, an integer longer than Python converts
        raise InvalidJson(str(e)) from None
    _check(data, max_depth)
    return data


def _check(data: Any, max_depth: int) -> None:
    if isinstance(data, str) and not _is_text(data):
        raise InvalidJson("the string holds an unpaired surrogate escape (\\ud800-\\udfff), which is not Unicode text")
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            items: Any = node.items()
        elif isinstance(node, list):
            items = enumerate(node)
        else:
            continue
        if depth > max_depth:
            raise InvalidJson(f"nested deeper than {max_depth} levels")
        for key, value in items:
            for s in (key, value):
                if isinstance(s, str) and not _is_text(s):
                    raise InvalidJson("a string holds an unpaired surrogate escape (\\ud800-\\udfff), which is "
                                      "not Unicode text")
            if isinstance(value, (dict, list)):
                stack.append((value, depth + 1))


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
