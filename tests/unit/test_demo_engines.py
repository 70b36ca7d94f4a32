"""The engine demo's pure helpers: stream parsing, metrics reading, and what it prints. The demo itself runs real
engines and is verified by running it (`disagg demo`), not here."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from disagg.cli import parser
from disagg.devcluster.demo_engines import (
    TIMING_HEADER,
    Result,
    Timing,
    comparison,
    printable,
    sample_sum,
    seconds,
    sse_text,
    timing_row,
)


def test_sse_text_reads_completion_and_chat_chunks_and_skips_the_rest():
    assert sse_text(b'data: {"choices": [{"index": 0, "text": "ab"}]}\n') == "ab"
    assert sse_text('data: {"choices": [{"delta": {"content": "c"}}]}') == "c"
    assert sse_text('data: {"choices": [{"delta": {"role": "assistant"}}]}') == ""
    assert sse_text(b'data: {"choices": [], "usage": {"completion_tokens": 16}}\n') is None
    assert sse_text(b"data: [DONE]\n") is None
    assert sse_text(b"\n") is None and sse_text(b": keep-alive\n") is None


def test_printable_escapes_what_a_random_model_emits():
    assert printable("plain text, ok") == "plain text, ok"
    assert printable("a\nb\tc\x07") == "a\\nb\\tc\\x07"
    assert printable("ü\ufffd") == "ü\ufffd"


def test_sample_sum_reads_one_modes_histogram_from_the_router_exposition():
    r = CollectorRegistry()
    h = Histogram("disagg_router_handoff_seconds", "x", ["mode"], registry=r)
    h.labels(mode="push").observe(0.012)
    h.labels(mode="pull").observe(0.5)
    h.labels(mode="pull").observe(0.25)
    text = generate_latest(r).decode()
    assert sample_sum(text, "disagg_router_handoff_seconds_count", mode="push") == 1
    assert sample_sum(text, "disagg_router_handoff_seconds_sum", mode="push") == 0.012
    assert sample_sum(text, "disagg_router_handoff_seconds_sum", mode="pull") == 0.75
    assert sample_sum(text, "disagg_router_handoff_seconds_count") == 3
    assert sample_sum(text, "disagg_router_ttft_seconds_sum", mode="push") == 0


def test_seconds_rows_and_the_one_line_comparison():
    assert (seconds(0.0123), seconds(2.345), seconds(None)) == ("12 ms", "2.35 s", "n/a")
    row = timing_row("first request", Timing(2.16, 2.31, 0.048))
    assert row == "first request      2.16 s      48 ms      2.31 s"
    assert len(TIMING_HEADER) == len(row) and TIMING_HEADER.endswith("last token")
    assert timing_row("again (warm)", Timing(0.1, 0.2, None), "same answer").endswith("n/a      200 ms  same answer")
    push = Result("push", "xyz", Timing(2.16, 2.3, 0.048), Timing(0.12, 0.27, 0.012), ("p", "d"))
    pull = Result("pull", "xyz", Timing(0.24, 0.35, 0.106), Timing(0.2, 0.3, None), ("p", "d"))
    assert comparison([push, pull]) == ("push vs pull: TTFT 120 ms vs 200 ms, KV handoff 12 ms vs n/a (first "
                                        "request's TTFT 2.16 s vs 240 ms); the same answer in every mode")
    assert "DIFFERENT answers" in comparison([push, Result(**{**push.__dict__, "mode": "pull", "text": "xy"})])


def test_demo_flags():
    args = parser().parse_args(["demo"])
    assert (args.keep, args.engines) == (False, True)
    args = parser().parse_args(["demo", "--keep", "--no-engines"])
    assert (args.keep, args.engines) == (True, False)
