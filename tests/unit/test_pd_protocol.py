"""The P/D protocol as tables (connector/router/pd_protocol.py): what each leg carries, push against pull,
and what is refused. Pure functions, no servers."""
from __future__ import annotations

import copy
from typing import Any

import pytest

from disagg.connector.router import pd_protocol as pd
from support.rendezvous import advert

PREFILL = advert("qwen-prefill-0-u1", role="prefill", side_channel_host="10.0.0.7", side_channel_ports=[5601, 5602],
                 dp_size=2, tp_size=4, pp_size=2)
RID = "0123abcd"
TRANSFER_OFF = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None}


# ---- the prefill leg -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("endpoint, body, expected", [
    # One token, not streamed, no stream options, transfer params asking for a remote decode.
    ("completions", {"prompt": "x", "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True}},
     {"prompt": "x", "max_tokens": 1, "stream": False, "kv_transfer_params": TRANSFER_OFF}),
    ("completions", {"prompt": [1, 2, 3], "temperature": 0.5},
     {"prompt": [1, 2, 3], "temperature": 0.5, "max_tokens": 1, "stream": False, "kv_transfer_params": TRANSFER_OFF}),
    # min_tokens above the prefill's single token would be refused by vLLM: dropped from this leg only.
    ("completions", {"prompt": "x", "max_tokens": 8, "min_tokens": 4},
     {"prompt": "x", "max_tokens": 1, "stream": False, "kv_transfer_params": TRANSFER_OFF}),
    # Chat: max_completion_tokens gives way to max_tokens=1.
    ("chat", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 9},
     {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "stream": False,
      "kv_transfer_params": TRANSFER_OFF}),
    # Completions keeps max_completion_tokens (not a completions field; vLLM decides).
    ("completions", {"prompt": "x", "max_completion_tokens": 9},
     {"prompt": "x", "max_completion_tokens": 9, "max_tokens": 1, "stream": False, "kv_transfer_params": TRANSFER_OFF}),
])
def test_prefill_leg(endpoint, body, expected):
    before = copy.deepcopy(body)
    assert pd.prefill_body(endpoint, body) == expected
    assert body == before  # the client's body is never changed: the decode leg is built from it too


# ---- the decode leg --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("endpoint, transfer_id, expected", [
    ("completions", False, {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": PREFILL.engine_id,
                            "remote_request_id": f"cmpl-{RID}-0", "remote_host": "10.0.0.7", "remote_port": 5601,
                            "tp_size": 4, "pp_size": 2}),
    ("chat", False, {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": PREFILL.engine_id,
                     "remote_request_id": f"chatcmpl-{RID}", "remote_host": "10.0.0.7", "remote_port": 5601,
                     "tp_size": 4, "pp_size": 2}),
    ("chat", True, {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": PREFILL.engine_id,
                    "remote_request_id": f"chatcmpl-{RID}", "remote_host": "10.0.0.7", "remote_port": 5601,
                    "tp_size": 4, "pp_size": 2, "transfer_id": RID}),
])
def test_push_decode_params_name_the_prefill_engine_before_it_answers(endpoint, transfer_id, expected):
    """Push: everything comes from the prefill engine's advertisement (DP rank 0's side-channel port) and the
    X-Request-Id both legs carry; vLLM's random suffix is unknowable, so the id is sent without it."""
    assert pd.push_decode_params(endpoint, RID, PREFILL, transfer_id) == expected


PULL_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_request_id": "cmpl-x-0-1f2e",
               "remote_engine_id": "p", "remote_block_ids": [3, 4], "remote_host": "h", "remote_port": 1, "tp_size": 1}


@pytest.mark.parametrize("prefill_answer, expected", [
    ({"choices": [], "kv_transfer_params": PULL_PARAMS}, PULL_PARAMS),  # handed on unchanged, suffix and all
    ({"kv_transfer_params": {**PULL_PARAMS, "extra": [1]}}, {**PULL_PARAMS, "extra": [1]}),
    # Not what a kv_producer returns: refused (the router retries another prefill engine).
    ({"choices": []}, ValueError),
    ({"kv_transfer_params": None}, ValueError),
    ({"kv_transfer_params": "x"}, ValueError),
    ({"kv_transfer_params": {**PULL_PARAMS, "do_remote_prefill": False}}, ValueError),
    ({"kv_transfer_params": {k: v for k, v in PULL_PARAMS.items() if k != "remote_request_id"}}, ValueError),
    ([PULL_PARAMS], ValueError),
    (None, ValueError),
])
def test_pull_decode_params_are_prefills_own(prefill_answer, expected):
    if expected is ValueError:
        with pytest.raises(ValueError, match="no usable kv_transfer_params"):
            pd.pull_decode_params(prefill_answer)
    else:
        assert pd.pull_decode_params(prefill_answer) == expected


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_decode_leg_is_the_clients_body_plus_the_params(mode):
    body = {"prompt": "x", "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True},
            "min_tokens": 2}
    params = pd.push_decode_params("completions", RID, PREFILL) if mode == "push" else PULL_PARAMS
    out = pd.decode_body(body, params)
    assert out == {**body, "kv_transfer_params": params}
    assert "kv_transfer_params" not in body
    out["stream_options"]["include_usage"] = False
    assert body["stream_options"] == {"include_usage": True}  # a copy: the prefill leg is built from it too


# ---- what clients may send -------------------------------------------------------------------------------------
MSG = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize("endpoint, body", [
    ("completions", {"prompt": "x"}),
    ("completions", {"prompt": ["x"]}),
    ("completions", {"prompt": [1, 2, 0]}),
    ("completions", {"prompt": [[1, 2]]}),
    ("completions", {"prompt": "x", "n": 1, "max_tokens": None, "stream": None, "stream_options": None}),
    ("completions", {"prompt": "x", "stream": False, "stream_options": {}}),
    ("completions", {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}}),
    ("completions", {"prompt": "x", "max_tokens": 10**30}),  # the model's limit is the router's to check
    ("completions", {"prompt": "x", "max_tokens": 4, "min_tokens": 4}),
    ("completions", {"prompt": "x", "min_tokens": 0}),
    ("completions", {"prompt": "x", "min_tokens": 16}),  # max_tokens defaults to 16
    ("completions", {"prompt": "x", "min_tokens": 50, "max_tokens": None}),  # None: up to the model's length
    ("chat", {"messages": MSG, "min_tokens": 50}),  # no maximum given: the engine's default is the model's length
    ("chat", {"messages": MSG, "max_completion_tokens": 3, "tools": [{"type": "function"}]}),
])
def test_accepted(endpoint, body):
    assert pd.validate_client_body(endpoint, body) is body


@pytest.mark.parametrize("endpoint, body, words", [
    ("completions", [], "must be a JSON object, got an array"),
    ("completions", None, "got null"),
    ("completions", {"prompt": "x", "kv_transfer_params": None}, "set by the router"),
    ("chat", {"messages": MSG, "kv_transfer_params": {"do_remote_prefill": True}}, "set by the router"),
    ("completions", {}, "'prompt' must be"),
    ("completions", {"prompt": ""}, "'prompt' must be"),
    ("completions", {"prompt": []}, "'prompt' must be"),
    ("completions", {"prompt": ["a", "b"]}, "batched prompts"),
    ("completions", {"prompt": [[1], [2]]}, "batched prompts"),
    ("completions", {"prompt": [1, 2.0]}, "'prompt' must be"),
    ("completions", {"prompt": [1, False]}, "'prompt' must be"),
    ("completions", {"prompt": [-1]}, "'prompt' must be"),
    ("completions", {"prompt": {"text": "x"}}, "'prompt' must be"),
    ("chat", {"prompt": "x"}, "'messages' must be a non-empty list"),
    ("chat", {"messages": []}, "'messages' must be a non-empty list"),
    ("chat", {"messages": "hi"}, "'messages' must be a non-empty list"),
    ("chat", {"messages": [MSG[0], None]}, "'messages[1]' must be an object, got null"),
    ("completions", {"prompt": "x", "n": 2}, "'n' must be 1"),
    ("completions", {"prompt": "x", "n": "1"}, "'n' must be 1"),
    ("completions", {"prompt": "x", "n": True}, "'n' must be 1"),
    ("completions", {"prompt": "x", "n": 1.0}, "'n' must be 1"),
    ("completions", {"prompt": "x", "n": None}, "'n' must be 1"),
    ("completions", {"prompt": "x", "max_tokens": 0}, "'max_tokens' must be a positive integer"),
    ("completions", {"prompt": "x", "max_tokens": "5"}, "'max_tokens' must be a positive integer"),
    ("completions", {"prompt": "x", "max_tokens": True}, "'max_tokens' must be a positive integer"),
    ("completions", {"prompt": "x", "max_tokens": 5.0}, "'max_tokens' must be a positive integer"),
    ("chat", {"messages": MSG, "max_completion_tokens": -1}, "'max_completion_tokens' must be a positive integer"),
    ("completions", {"prompt": "x", "stream": 1}, "'stream' must be a boolean"),
    ("completions", {"prompt": "x", "stream": "true"}, "'stream' must be a boolean"),
    ("completions", {"prompt": "x", "stream": True, "stream_options": "usage"}, "'stream_options' must be an object"),
    ("completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "only allowed with 'stream': true"),
    ("chat", {"messages": MSG, "stream": False, "stream_options": {"include_usage": True}}, "only allowed with"),
    # min_tokens rides only on the decode leg: what vLLM would refuse there is refused here.
    ("completions", {"prompt": "x", "min_tokens": -1}, "'min_tokens' must be a non-negative integer"),
    ("completions", {"prompt": "x", "min_tokens": False}, "'min_tokens' must be a non-negative integer"),
    ("completions", {"prompt": "x", "min_tokens": "2"}, "'min_tokens' must be a non-negative integer"),
    ("completions", {"prompt": "x", "max_tokens": 4, "min_tokens": 5}, "must not exceed the maximum tokens \\(4\\)"),
    ("chat", {"messages": MSG, "max_completion_tokens": 3, "max_tokens": 9, "min_tokens": 4}, "maximum tokens \\(3\\)"),
    ("chat", {"messages": MSG, "max_tokens": 2, "min_tokens": 4}, "maximum tokens \\(2\\)"),
    ("completions", {"prompt": "x", "min_tokens": 17}, "maximum tokens \\(16\\)"),
])
def test_refused(endpoint, body, words):
    with pytest.raises(pd.BadRequest, match=words.replace("[", r"\[").replace("]", r"\]")) as e:
        pd.validate_client_body(endpoint, body)
    assert e.value.status == 400


@pytest.mark.parametrize("raw, words", [
    (b"\xff", "not valid UTF-8"),
    (b'{"prompt": "\xed\xa0\x80"}', "not valid UTF-8"),
    (b"  ", "body is empty"),
    (b"{'prompt': 'x'}", "Expecting property name"),
    (b'{"a": NaN}', "NaN is not a JSON number"),
    (b'{"a": Infinity}', "Infinity is not a JSON number"),
    (b'{"a": -1e400}', "out of range"),
    (b'{"a": "\\udc00x"}', "unpaired surrogate"),
    (b'"\\ud800"', "unpaired surrogate"),
    (b"[" * 65 + b"]" * 65, "nested deeper than 64 levels"),
    (b"[" * 5000 + b"]" * 5000, "nested deeper than 64 levels"),
])
def test_parse_refuses_what_is_not_strict_json(raw, words):
    with pytest.raises(pd.BadRequest, match=words) as e:
        pd.parse_client_json(raw)
    assert e.value.status == 400 and str(e.value).startswith("invalid JSON: ")


def _nested(levels: int) -> list:
    out: list = []
    for _ in range(levels - 1):
        out = [out]
    return out


@pytest.mark.parametrize("raw, expected", [
    (b'{"prompt": "caf\xc3\xa9 \\ud83d\\ude00"}', {"prompt": "caf\u00e9 \U0001F600"}),  # a surrogate pair is fine
    (b"[" * 64 + b"]" * 64, _nested(64)),
    (b'{"t": 1e308, "n": -0.0, "i": ' + b"9" * 4000 + b"}", {"t": 1e308, "n": -0.0, "i": int("9" * 4000)}),
])
def test_parse_accepts_strict_json(raw, expected: Any):
    assert pd.parse_client_json(raw) == expected
