"""The planner's observation from Prometheus scrapes (operator/autoscaling/scrape.py). The metric text is real
wherever the project makes it in-process: the router's own registry after its admission and histograms have seen
requests (and once over HTTP, in front of stand-in engines), the engine emulator's metrics after it recorded
requests, and a real vLLM 0.32 engine's `/metrics` as recorded in tests/emulator/vllm_wire/. Hand-written text only
for malformed input and counter resets."""
from __future__ import annotations

import ast
import asyncio
import math
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest
from prometheus_client import generate_latest

from disagg.connector.emulator.metrics import EngineMetrics
from disagg.connector.emulator.requests import Request
from disagg.connector.router.admission import Overloaded
from disagg.connector.router.app import Router, Settings
from disagg.connector.router.engine_pool import EnginePool
from disagg.operator.autoscaling import scrape
from disagg.operator.autoscaling.observed import EngineLoad
from support.stub_engines import KvBoard, StubEngine, serving, stub_engines

INF = math.inf
WIRE = Path(__file__).resolve().parents[1] / "emulator" / "vllm_wire"


def router(**settings: float) -> Router:
    """A router with no engines: admission hands out the request slot alone (the router would hold the request for
    a pair), which is all these tests need of it."""
    return Router(EnginePool("push", lambda: []), Settings(mode="push", **settings))  # type: ignore[arg-type]


def text(r: Router) -> str:
    return generate_latest(r.m.registry).decode()


async def taken(r: Router, n: int) -> None:
    """`n` requests admitted and finished."""
    for _ in range(n):
        assert await r.admission.admit() is None
        r.admission.leave()


async def until(predicate: Callable[[], bool], turns: int = 5000) -> None:
    for _ in range(turns):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


# -- histogram_quantile, against values computed by hand -------------------------------------------------------------
B = [(0.1, 2.0), (0.5, 6.0), (1.0, 10.0), (INF, 10.0)]


@pytest.mark.parametrize(("q", "buckets", "expected"), [
    (0.5, B, 0.4),  # rank 5 in (0.1, 0.5]: 0.1 + 0.4 x (5 - 2) / (6 - 2)
    (0.9, B, 0.875),  # rank 9 in (0.5, 1]: 0.5 + 0.5 x (9 - 6) / (10 - 6)
    (0.1, B, 0.05),  # rank 1 in the lowest bucket, from 0: 0.1 x 1 / 2
    (1.0, B, 1.0),  # rank 10, reached at 1.0
    (0.5, list(reversed(B)), 0.4),  # in any order
    (0.9, [(0.1, 1.0), (1.0, 2.0), (INF, 10.0)], 1.0),  # only +Inf reaches rank 9: the highest finite bound
    (0.5, [(0.0, 3.0), (1.0, 4.0), (INF, 4.0)], 0.0),  # the lowest bucket ends at 0 or below: its bound
    (0.5, [(0.1, 5.0), (0.5, 3.0), (INF, 10.0)], 0.1),  # 3 raised to 5: rank 5 is reached at 0.1, 0.1 x 5 / 5
    (0.5, [(0.1, 1.0), (0.1, 1.0), (INF, 2.0)], 0.05),  # equal bounds merged into (0.1, 2): 0.1 x 1 / 2
    (0.9, [(0.1, 0.0), (INF, 0.0)], None),  # no observation
])
def test_histogram_quantile_interpolates_as_prometheus_does(q, buckets, expected):
    found = scrape.histogram_quantile(q, buckets)
    assert found == (None if expected is None else pytest.approx(expected))


@pytest.mark.parametrize(("q", "buckets", "message"), [
    (0.0, B, "in \\(0, 1\\]"), (1.5, B, "in \\(0, 1\\]"), (0.5, [(0.1, 1.0)], "\\+Inf"), (0.5, [], "\\+Inf"),
    (0.5, [(INF, 3.0)], "finite bucket"),
])
def test_histogram_quantile_refuses_what_prometheus_answers_nan_or_infinity_for(q, buckets, message):
    with pytest.raises(ValueError, match=message):
        scrape.histogram_quantile(q, buckets)


def test_histograms_of_different_layouts_sum_over_the_bounds_they_share():
    a = scrape.Histogram(((0.1, 1.0), (0.5, 3.0), (1.0, 4.0), (INF, 5.0)), 2.0)
    b = scrape.Histogram(((0.5, 2.0), (2.0, 6.0), (INF, 6.0)), 7.0)
    assert scrape.sum_histograms([a, b]) == scrape.Histogram(((0.5, 5.0), (INF, 11.0)), 9.0)
    assert scrape.sum_histograms([]) is None


# -- parsing -------------------------------------------------------------------------------------------------------
async def test_the_routers_own_text_parses_into_counters_gauges_and_histograms():
    r = router()
    r.m.requests.labels(mode="push", endpoint="completions", status="200").inc(3)
    r.m.ttft.labels(mode="push").observe(0.2)
    r.m.ttft.labels(mode="push").observe(3.0)
    assert await r.admission.admit() is None  # held for a pair: admitted, in flight
    snap = scrape.parse({"router-0": text(r)})
    assert snap.sources == {"router-0"}
    assert snap.counter("disagg_router_requests_total") == snap.counter("disagg_router_requests", status="200") == 3
    assert snap.counter("disagg_router_requests", status="429") == 0
    assert snap.counter(scrape.ROUTER_ADMITTED) == 1 and snap.counter(scrape.ROUTER_REJECTED) == 0
    assert snap.gauge("disagg_router_inflight_requests") == 1 and snap.gauge(scrape.ROUTER_QUEUE) == 0
    ttft = snap.histogram(scrape.ROUTER_TTFT, mode="push")
    assert ttft is not None and ttft.bounds == (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, INF)
    assert (dict(ttft.buckets)[0.1], dict(ttft.buckets)[0.25], dict(ttft.buckets)[2.5], ttft.count) == (0, 1, 1, 2)
    assert ttft.sum == pytest.approx(3.2)
    assert snap.histogram(scrape.ROUTER_TTFT, mode="pull") is None
    # prometheus_client writes each counter's and histogram's `_created` as a gauge family of its own: not kept.
    assert "_created" in text(r) and not [name for name in snap.gauges if name.endswith("_created")]


def test_a_real_vllm_engines_text_parses_with_its_created_families_dropped():
    snap = scrape.parse({"decode-0": (WIRE / "push_metrics_decode.txt").read_text()})
    assert snap.counter("vllm:request_success_total", finished_reason="length") == 7
    assert snap.counter("vllm:request_success", finished_reason="abort") == 0
    assert snap.counter("vllm:prompt_tokens_total") == 2276
    assert snap.gauge(scrape.RUNNING) == 0 and snap.gauge(scrape.KV_USAGE) == 0
    assert not [name for name in snap.gauges if name.endswith("_created")]
    generated = snap.histogram(scrape.GENERATION_TOKENS)
    assert generated is not None and (generated.sum, generated.count) == (33, 7)
    assert snap.histogram("vllm:iteration_tokens_total") is not None  # a histogram whose own name ends in _total


@pytest.mark.parametrize(("body", "message"), [
    ("<!DOCTYPE html>\n<html><body>502 Bad Gateway</body></html>\n", "not Prometheus text exposition"),
    ('# TYPE a counter\na_to!tal{x="1", ="2"} 2.0\n', "not Prometheus text exposition \\(IndexError"),
    ("# TYPE a_total counter\na_total -1\n", "counter a_total is -1"),
    ("# TYPE a_total counter\na_total NaN\n", "counter a_total is nan"),
    ('# TYPE g gauge\ng{x="1"} 1\ng{x="1"} 2\n', "g{'x': '1'} appears twice"),
    ('# TYPE h histogram\nh_bucket{le="1"} 1\nh_count 1\n', "needs a \\+Inf bucket"),
    ('# TYPE h histogram\nh_bucket{le="1"} 2\nh_bucket{le="+Inf"} 1\nh_count 1\n', "never decrease"),
    ('# TYPE h histogram\nh_bucket{le="1"} 1\nh_bucket{le="+Inf"} 2\nh_count 3\n', "_count 3.0 is not its \\+Inf"),
    ('# TYPE h histogram\nh_bucket{le="soon"} 1\n', "no numeric le label"),
])
def test_text_that_is_not_well_formed_metrics_is_a_value_error_naming_its_source(body, message):
    with pytest.raises(ValueError, match=message) as e:
        scrape.parse({"router-0": "# TYPE ok gauge\nok 1\n", "router-1": body})
    assert str(e.value).startswith("metrics of router-1: ")


# -- increases over a window ----------------------------------------------------------------------------------------
def admitted(**series: float) -> str:
    lines = [f'disagg_router_admitted_total{{reason="{k}"}} {v}' for k, v in series.items()]
    return "\n".join(["# TYPE disagg_router_admitted_total counter", *lines, ""])


def test_a_counter_that_drops_restarted_and_counts_from_zero_and_a_source_counts_once_scraped_twice():
    before = scrape.parse({"r0": admitted(a=10), "r1": admitted(a=40), "r2": admitted(x=5), "r4": admitted(a=7)})
    after = scrape.parse({"r0": admitted(a=25), "r1": admitted(a=3), "r2": admitted(x=5, y=2), "r3": admitted(a=100)})
    # r0 gained 15; r1 restarted (3 since); r2's new series y started at 0; r3 is new (from its next window); r4 gone.
    assert scrape.increase(before, after, scrape.ROUTER_ADMITTED) == 15 + 3 + 2
    assert scrape.increase(before, after, scrape.ROUTER_ADMITTED, reason="y") == 2
    assert scrape.increase(after, after, scrape.ROUTER_ADMITTED) == 0


# -- the routers' window ---------------------------------------------------------------------------------------------
async def test_the_routers_window_counts_arrivals_refusals_the_queue_and_the_latencies_of_the_window_only():
    a, b = router(max_inflight=1, max_queue=1, queue_wait=60), router()
    await taken(a, 4)
    for _ in range(5):
        a.m.ttft.labels(mode="push").observe(0.02)  # before the window: must not count
    before = scrape.parse({"router-a": text(a), "router-b": text(b)})

    await taken(a, 3)
    assert await a.admission.admit() is None  # holds a's only slot
    waiting = asyncio.create_task(a.admission.admit())
    await until(lambda: a.admission.waiting == 1)
    with pytest.raises(Overloaded):
        await a.admission.admit()  # the queue is full: refused
    await taken(b, 2)
    for _ in range(8):
        a.m.ttft.labels(mode="push").observe(0.2)
    for _ in range(2):
        b.m.ttft.labels(mode="pull").observe(0.7)
    for _ in range(4):
        a.m.handoff.labels(mode="push").observe(0.03)
    after = scrape.parse({"router-a": text(a), "router-b": text(b)})

    w = scrape.router_window(before, after, seconds=10, percentile=90)
    # a: 3 taken + 1 holding + 1 refused; b: 2. The waiting one counts once it is taken or refused.
    assert (w.arrivals, w.rejected, w.queued, w.seconds, w.percentile) == (7, 1, 1, 10, 90)
    assert w.ttft_ms == pytest.approx(750)  # 10 first tokens, rank 9 in (0.5, 1]: 0.5 + 0.5 x (9 - 8) / (10 - 8)
    assert w.handoff_ms == pytest.approx(47.5)  # rank 3.6 of 4 in (0.025, 0.05]: 0.025 + 0.025 x 3.6 / 4
    assert w.idle_seconds == 0 and (w.mean_input_tokens, w.mean_output_tokens, w.tpot_ms) == (0, 0, None)
    median = scrape.router_window(before, after, seconds=10, percentile=50)
    assert median.ttft_ms == pytest.approx(193.75)  # rank 5 in (0.1, 0.25]: 0.1 + 0.15 x 5 / 8
    waiting.cancel()


async def test_a_router_restarted_between_the_scrapes_counts_from_zero_and_a_new_one_from_its_next_window():
    old, new, joined = router(), router(), router(max_inflight=1, max_queue=1, queue_wait=60)
    await taken(old, 50)
    for _ in range(10):
        old.m.ttft.labels(mode="push").observe(2.0)
    before = scrape.parse({"router-a": text(old)})
    await taken(new, 3)  # the same pod, its process restarted: every counter and histogram from 0
    for _ in range(2):
        new.m.ttft.labels(mode="push").observe(0.04)
    await taken(joined, 5)
    assert await joined.admission.admit() is None
    waiting = asyncio.create_task(joined.admission.admit())
    await until(lambda: joined.admission.waiting == 1)
    after = scrape.parse({"router-a": text(new), "router-new": text(joined)})
    w = scrape.router_window(before, after, seconds=10, percentile=90)
    assert w.arrivals == 3  # not 3 - 50, and not the new router's 6 it took before its first scrape
    assert w.queued == 1  # a gauge: read from every router at the window's end
    assert w.ttft_ms == pytest.approx(47.5)  # the restarted router's 2 only: 0.025 + 0.025 x 1.8 / 2
    waiting.cancel()


async def test_idle_time_is_the_window_when_nothing_arrived_unless_the_caller_knows_longer():
    r = router()
    before = scrape.parse({"router-0": text(r)})
    quiet = scrape.router_window(before, before, seconds=15, percentile=90)
    assert (quiet.arrivals, quiet.idle_seconds, quiet.ttft_ms, quiet.handoff_ms) == (0, 15, None, None)
    assert scrape.router_window(before, before, seconds=15, percentile=90, idle_seconds=600).idle_seconds == 600
    await taken(r, 1)
    after = scrape.parse({"router-0": text(r)})
    assert scrape.router_window(before, after, seconds=15, percentile=90).idle_seconds == 0
    with pytest.raises(ValueError, match="idle for 20 s"):
        scrape.router_window(before, after, seconds=15, percentile=90, idle_seconds=20)


def test_a_window_without_routers_or_from_something_else_is_refused():
    routers = scrape.parse({"router-0": text(router())})
    engine = scrape.parse({"router-1": (WIRE / "push_metrics_decode.txt").read_text()})
    with pytest.raises(ValueError, match="no router was scraped"):
        scrape.router_window(routers, scrape.parse({}), seconds=10, percentile=90)
    with pytest.raises(ValueError, match="router-1 exports no disagg_router_admitted_total, disagg_router_rejected_"):
        scrape.router_window(routers, engine, seconds=10, percentile=90)
    with pytest.raises(ValueError, match="percentile"):
        scrape.router_window(routers, routers, seconds=10, percentile=0)


@pytest.mark.timeout(30)
async def test_over_http_arrivals_are_requests_as_the_router_takes_or_refuses_them_not_as_it_answers_them():
    """A router with one request slot and one queue place in front of stand-in engines whose decode holds its answer
    until the gate opens: one request runs, one waits, one is refused (429), one is junk (400)."""
    board, gate = KvBoard(), asyncio.Event()
    p, d = StubEngine("p-0", "prefill", board=board), StubEngine("d-0", "decode", board=board)

    async def hold(_rid: str, i: int) -> None:
        if i == 0:
            await gate.wait()

    d.decode_hold = hold
    async with stub_engines(p, d):
        r = Router(EnginePool("push", lambda: [p.advertisement(), d.advertisement()]),
                   Settings(mode="push", max_inflight=1, max_queue=1, queue_wait=30))
        async with serving(r.app()) as url, aiohttp.ClientSession() as http:
            async def post(body: bytes) -> int:
                async with http.post(url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"}) as resp:
                    await resp.read()
                    return resp.status

            async def scraped() -> scrape.Snapshot:
                async with http.get(url + "/metrics") as resp:
                    return scrape.parse({"router-0": await resp.text()})

            request = b'{"prompt": "x", "max_tokens": 2}'
            s0 = await scraped()
            running = asyncio.create_task(post(request))
            await d.wait_for(lambda: d.active == 1)
            waiting = asyncio.create_task(post(request))
            await until(lambda: r.admission.waiting == 1)
            assert await post(request) == 429
            assert await post(b"{") == 400
            s1 = await scraped()
            w = scrape.router_window(s0, s1, seconds=5, percentile=90)
            assert (w.arrivals, w.rejected, w.queued, w.ttft_ms) == (2, 1, 1, None)  # no first token yet
            # What requests_total says instead: two answers, the 429 and the junk's 400, and nothing of the rest.
            assert scrape.increase(s0, s1, "disagg_router_requests_total") == 2
            gate.set()
            assert [await running, await waiting] == [200, 200]
            s2 = await scraped()
            w = scrape.router_window(s1, s2, seconds=5, percentile=90)
            assert (w.arrivals, w.rejected, w.queued) == (1, 0, 0)  # the waiting one, taken once the slot freed
            assert w.ttft_ms is not None and scrape.histogram_increase(s1, s2, scrape.ROUTER_TTFT).count == 2


@pytest.mark.timeout(30)
async def test_over_http_a_request_held_for_a_pair_while_there_is_none_is_queued():
    """A fleet at zero: the router holds the request for a pair (pairWaitSeconds) and the window shows it queued,
    the demand that wakes the fleet; once engines come, it is served and nothing is queued."""
    board = KvBoard()
    p, d = StubEngine("p-0", "prefill", board=board), StubEngine("d-0", "decode", board=board)
    engines: list = []
    async with stub_engines(p, d):
        r = Router(EnginePool("push", lambda: list(engines)), Settings(mode="push", pair_wait=30))
        async with serving(r.app()) as url, aiohttp.ClientSession() as http:
            async def scraped() -> scrape.Snapshot:
                async with http.get(url + "/metrics") as resp:
                    return scrape.parse({"router-0": await resp.text()})

            async def post() -> int:
                async with http.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}) as resp:
                    await resp.read()
                    return resp.status

            s0 = await scraped()
            held = asyncio.create_task(post())
            await until(lambda: r.m.registry.get_sample_value(scrape.ROUTER_PAIR_WAITING) == 1)
            s1 = await scraped()
            assert (scrape.router_window(s0, s1, seconds=5, percentile=90).queued, held.done()) == (1, False)
            engines += [p.advertisement(), d.advertisement()]
            assert await held == 200
            assert scrape.router_window(s1, await scraped(), seconds=5, percentile=90).queued == 0


# -- the engines -----------------------------------------------------------------------------------------------------
def engine(role: str) -> EngineMetrics:
    return EngineMetrics("tiny", profile="cpu-kv64k", role=role, kv_mode="push", max_model_len=8192, block_size=16,
                         num_blocks=1024, kv_bytes_per_token=64)


def serve(m: EngineMetrics, prompt: int, outputs: int = 1, tpot: float = 0.0) -> None:
    """One request through the emulator's metrics as its engine records it: first token at 1 s, then `outputs - 1`
    more, `tpot` apart."""
    req = Request(id="r-0", base_id="r", prompt=[1] * prompt, max_tokens=outputs, arrived=0.0, scheduled=0.0,
                  first_token=1.0)
    m.first_token(1.0, req)
    req.outputs = [2] * outputs
    for _ in range(outputs - 1):
        m.inter_token(tpot)
    m.finished(req, 1.0 + tpot * (outputs - 1))


def scraped(*engines: tuple[str, EngineMetrics]) -> scrape.Snapshot:
    return scrape.parse({name: generate_latest(m.registry).decode() for name, m in engines})


def scraped_router(r: Router) -> scrape.Snapshot:
    return scrape.parse({"router-0": text(r)})


def test_token_means_and_tpot_are_the_windows_finished_requests_on_the_engines():
    p0, p1, d0, d1 = engine("prefill"), engine("prefill"), engine("decode"), engine("decode")
    serve(p0, 1000)
    serve(d0, 100, outputs=50, tpot=0.2)  # before the window: must not count
    prefill_before, decode_before = scraped(("p0", p0), ("p1", p1)), scraped(("d0", d0), ("d1", d1))
    for m, prompts in ((p0, (100, 300)), (p1, (200, 600))):
        for n in prompts:
            serve(m, n)
    for m, long in ((d0, 20), (d1, 30)):
        for _ in range(4):
            serve(m, 100, outputs=10, tpot=0.03)
        serve(m, 100, outputs=long, tpot=0.12)
    prefill_after, decode_after = scraped(("p0", p0), ("p1", p1)), scraped(("d0", d0), ("d1", d1))
    assert scrape.mean_input_tokens(prefill_before, prefill_after) == 300  # (100 + 300 + 200 + 600) / 4
    assert scrape.mean_output_tokens(decode_before, decode_after) == 13  # (8 x 10 + 20 + 30) / 10
    # 8 TPOTs in (0.025, 0.05], 2 in (0.1, 0.15]: p90 is rank 9, 0.1 + 0.05 x (9 - 8) / 2; p50 rank 5 of the 8.
    assert scrape.tpot_ms(decode_before, decode_after, 90) == pytest.approx(125)
    assert scrape.tpot_ms(decode_before, decode_after, 50) == pytest.approx(40.625)  # 0.025 + 0.025 x 5 / 8
    assert scrape.tpot_ms(decode_after, decode_after, 90) is None  # nothing finished
    assert scrape.mean_output_tokens(decode_after, decode_after) == 0


async def test_the_whole_window_takes_the_routers_counts_and_the_engines_sizes_and_tpot():
    r, p, d = router(), engine("prefill"), engine("decode")
    routers_before, prefill_before, decode_before = scraped_router(r), scraped(("p", p)), scraped(("d", d))
    await taken(r, 4)
    r.m.ttft.labels(mode="push").observe(0.3)
    for n in (100, 200, 300, 400):
        serve(p, n)
        serve(d, n, outputs=n // 10, tpot=0.06)
    w = scrape.window((routers_before, scraped_router(r)), (prefill_before, scraped(("p", p))),
                      (decode_before, scraped(("d", d))), seconds=20, percentile=90)
    assert (w.arrivals, w.mean_input_tokens, w.mean_output_tokens, w.seconds) == (4, 250, 25, 20)
    assert w.ttft_ms == pytest.approx(475)  # one first token in (0.25, 0.5], rank 0.9: 0.25 + 0.25 x 0.9
    assert w.tpot_ms == pytest.approx(72.5)  # 4 in (0.05, 0.075], rank 3.6: 0.05 + 0.025 x 3.6 / 4
    assert w.arrival_rate == pytest.approx(0.2)


def test_on_a_real_vllm_decode_the_per_request_tpot_wins_over_the_inter_token_latency():
    real = (WIRE / "push_metrics_decode.txt").read_text()
    started = scrape.parse({"decode-0": ""})  # the engine's first scrape, before it had any series
    # vllm:request_time_per_output_token_seconds: 5 of 7 in (0.01, 0.025], 2 in (0.025, 0.05]; p90 is rank 6.3.
    assert scrape.tpot_ms(started, scrape.parse({"decode-0": real}), 90) == pytest.approx(41.25)
    # An engine without it: vllm:inter_token_latency_seconds, 19 of 26 gaps by 0.025, the rest by 0.05: rank 23.4.
    older = "\n".join(line for line in real.splitlines() if "request_time_per_output_token" not in line) + "\n"
    assert scrape.tpot_ms(started, scrape.parse({"decode-0": older}), 90) == pytest.approx(25 + 25 * 4.4 / 7)
    assert scrape.mean_output_tokens(started, scrape.parse({"decode-0": real})) == pytest.approx(33 / 7)
    prefill = scrape.parse({"prefill-0": (WIRE / "push_metrics_prefill.txt").read_text()})
    assert scrape.mean_input_tokens(scrape.parse({"prefill-0": ""}), prefill) == pytest.approx(2276 / 7)


def test_engine_load_sums_the_roles_gauges_and_refuses_what_is_not_an_engine():
    e0, e1 = engine("decode"), engine("decode")
    e0.state(running=3, waiting=2, deferred=1, usage=0.5)
    e1.state(running=1, waiting=0, deferred=0, usage=0.25)
    assert scrape.engine_load(scraped(("d0", e0), ("d1", e1))) == EngineLoad(waiting=2, running=4, kv_usage=0.75)
    real = scrape.parse({"decode-0": (WIRE / "push_metrics_decode.txt").read_text()})
    assert scrape.engine_load(real) == EngineLoad()  # recorded idle
    assert scrape.engine_load(scrape.parse({})) == EngineLoad()  # a role at zero engines
    routers = scrape.parse({"d0": generate_latest(e0.registry).decode(), "router-0": text(router())})
    with pytest.raises(ValueError, match="router-0 exports no vllm:num_requests_waiting, .*: is it a vLLM engine"):
        scrape.engine_load(routers)
    with pytest.raises(ValueError, match="exports a TPOT histogram"):
        scrape.tpot_ms(routers, scrape.parse({"router-0": text(router())}), 90)
    assert scrape.tpot_ms(scrape.parse({}), scrape.parse({}), 90) is None


def test_scrape_reads_only_prometheus_clients_text_parser_of_it():
    """The autoscaling package's purity contract (pyproject.toml) lets scrape.py import prometheus_client: this
    holds it to the parser (no registry, no HTTP)."""
    tree = ast.parse(Path(scrape.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert {m for m in imported if m.split(".")[0] == "prometheus_client"} == {"prometheus_client.parser"}
