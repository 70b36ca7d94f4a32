"""What the router asks an engine's /tokenize for a request (connector/router/prompt_tokens.py): the request's own
prompt or messages with every field that changes how they become tokens, token ids as they are, and nothing for a
request with no single prompt."""
from __future__ import annotations

import json

import pytest

from disagg.connector.router.prompt_tokens import question, token_ids, tokenize_body


def test_a_completions_prompt_is_asked_with_the_fields_that_change_its_tokens():
    body = {"model": "m", "prompt": "hello", "max_tokens": 5, "add_special_tokens": False, "temperature": 0}
    assert tokenize_body("completions", body) == {"model": "m", "prompt": "hello", "add_special_tokens": False}
    assert tokenize_body("completions", {"prompt": ["hello"]}) == {"prompt": "hello"}


def test_token_ids_are_their_own_answer():
    assert tokenize_body("completions", {"prompt": [1, 2, 3]}) == [1, 2, 3]
    assert tokenize_body("completions", {"prompt": [[4, 5]]}) == [4, 5]


def test_chat_messages_are_asked_with_the_template_fields_and_nothing_else():
    messages = [{"role": "user", "content": "hi"}]
    body = {"model": "m", "messages": messages, "add_generation_prompt": False, "chat_template_kwargs": {"x": 1},
            "tools": [{"type": "function"}], "max_tokens": 3, "stream": True}
    assert tokenize_body("chat", body) == {"model": "m", "messages": messages, "add_generation_prompt": False,
                                           "chat_template_kwargs": {"x": 1}, "tools": [{"type": "function"}]}


@pytest.mark.parametrize("endpoint,body", [
    ("completions", {"prompt": ["a", "b"]}),  # two prompts: no single preference
    ("completions", {"prompt": [[1], [2]]}),
    ("completions", {"prompt": [1, -2]}),
    ("completions", {"prompt": [True, 2]}),
    ("completions", {"prompt": []}),
    ("completions", {"prompt": None}),
    ("completions", {"prompt": "x", "prompt_embeds": "..."}),
    ("chat", {"messages": []}),
    ("chat", {"messages": "hi"}),
])
def test_a_request_with_no_single_prompt_gets_no_question(endpoint, body):
    assert tokenize_body(endpoint, body) is None


def test_only_a_list_of_integers_is_an_answer():
    assert token_ids(b'{"count": 2, "max_model_len": 4096, "tokens": [7, 8]}') == [7, 8]
    for bad in (b"null", b"[]", b'{"tokens": "78"}', b'{"tokens": [7, "8"]}', b'{"tokens": [true]}',
                b'{"tokens": [7.5]}', b'{"error": "x"}', b'{"tokens": [7', b"<html>", b""):
        assert token_ids(bad) is None, bad


def test_the_question_is_the_json_of_what_to_ask():
    ask = {"model": "m", "messages": [{"role": "user", "content": "hé \u2028"}], "add_generation_prompt": True}
    assert json.loads(question(ask)) == ask
