"""One CR's observations over time (operator/autoscaling/tracker.py) and the executor's pure helpers
(operator/autoscale_executor.py: which pods it scrapes, what counts as advertised). The metric text is real: the
router's own registry after admission saw requests, and the engine emulator's metrics."""
from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from disagg.connector.emulator.metrics import EngineMetrics
from disagg.connector.router.app import Router, Settings
from disagg.connector.router.engine_pool import EnginePool
from disagg.operator import api, run
from disagg.operator.autoscale_executor import advertised, targets
from disagg.operator.autoscaling import scrape, tracker
from disagg.operator.controller.settings import from_args

P90 = 90.0


def router() -> Router:
    return Router(EnginePool("push", lambda: []), Settings(mode="push"))  # type: ignore[arg-type]


async def admit(r: Router, n: int) -> None:
    for _ in range(n):
        assert await r.admission.admit() is None
        r.admission.leave()


def engine(role: str) -> EngineMetrics:
    return EngineMetrics("tiny", profile="cpu-kv64k", role=role, kv_mode="push", max_model_len=8192, block_size=16,
                         num_blocks=1024, kv_bytes_per_token=64)


class Fleet:
    """A router and one engine per role, scraped as the executor would."""

    def __init__(self) -> None:
        self.router, self.prefill, self.decode = router(), engine("prefill"), engine("decode")

    def scrape(self, at: float) -> tracker.Scrape:
        def one(name: str, registry: object) -> scrape.Snapshot:
            return scrape.parse({name: generate_latest(registry).decode()})  # type: ignore[arg-type]
        return tracker.Scrape(at, one("router-0", self.router.m.registry), one("prefill-0", self.prefill.registry),
                              one("decode-0", self.decode.registry))


def counts(prefill: tuple[int, int] = (1, 1), decode: tuple[int, int] = (1, 1)) -> dict[str, tracker.RoleCounts]:
    return {"prefill": tracker.RoleCounts(*prefill), "decode": tracker.RoleCounts(*decode)}


def test_the_first_tick_observes_nothing_and_the_second_reads_the_window_between_them():
    fleet = Fleet()
    observed, memory = tracker.observe(tracker.Memory(), fleet.scrape(100.0), counts(), P90)
    assert observed is None and memory.last is not None
    asyncio.run(admit(fleet.router, 30))
    observed, memory = tracker.observe(memory, fleet.scrape(115.5), counts(), P90)
    assert observed is not None
    assert observed.window.seconds == pytest.approx(15.5)  # the scrapes' distance, not a nominal interval
    assert observed.window.arrivals == 30 and observed.window.idle_seconds == 0.0
    assert observed.prefill.ready == 1 and observed.prefill.starting == 0


def test_idle_time_adds_up_over_windows_without_arrivals_and_restarts_at_an_arrival():
    fleet = Fleet()
    _, memory = tracker.observe(tracker.Memory(), fleet.scrape(0.0), counts(), P90)
    for t, idle in ((10.0, 10.0), (25.0, 25.0), (40.0, 40.0)):
        observed, memory = tracker.observe(memory, fleet.scrape(t), counts(), P90)
        assert observed is not None and observed.window.idle_seconds == pytest.approx(idle)
    asyncio.run(admit(fleet.router, 1))
    observed, memory = tracker.observe(memory, fleet.scrape(50.0), counts(), P90)
    assert observed is not None and observed.window.idle_seconds == 0.0
    observed, memory = tracker.observe(memory, fleet.scrape(55.0), counts(), P90)
    assert observed is not None and observed.window.idle_seconds == pytest.approx(5.0)


def test_with_a_window_longer_than_the_tick_each_tick_reads_the_window_behind_it():
    fleet = Fleet()
    _, memory = tracker.observe(tracker.Memory(), fleet.scrape(0.0), counts(), P90, window_seconds=15)
    asyncio.run(admit(fleet.router, 10))
    seen = []
    for t in (5.0, 10.0, 15.0, 20.0, 25.0, 30.0, 35.0):
        observed, memory = tracker.observe(memory, fleet.scrape(t), counts(), P90, window_seconds=15)
        assert observed is not None
        seen.append((observed.window.seconds, observed.window.arrivals, observed.window.idle_seconds))
        assert len(memory.earlier) <= 4, "only the scrapes a later window may start from are kept"
    # the 10 arrivals (before t=5) stay in every window that starts at 0, then leave; idle counts ticks
    assert seen == [(5, 10, 0), (10, 10, 5), (15, 10, 10), (15, 0, 15), (15, 0, 20), (15, 0, 25), (15, 0, 30)]
    # the same ticks without window_seconds read each tick alone
    fleet = Fleet()
    _, memory = tracker.observe(tracker.Memory(), fleet.scrape(0.0), counts(), P90)
    asyncio.run(admit(fleet.router, 10))
    observed, memory = tracker.observe(memory, fleet.scrape(5.0), counts(), P90)
    observed, memory = tracker.observe(memory, fleet.scrape(10.0), counts(), P90)
    assert observed is not None and (observed.window.seconds, observed.window.arrivals) == (5, 0)
    assert memory.earlier == ()


def test_engines_not_advertised_are_starting_until_the_startup_budget_is_spent():
    fleet = Fleet()
    three = counts(prefill=(3, 1))
    _, memory = tracker.observe(tracker.Memory(), fleet.scrape(0.0), three, P90, startup_seconds=60)
    observed, memory = tracker.observe(memory, fleet.scrape(30.0), three, P90, startup_seconds=60)
    assert observed is not None and (observed.prefill.ready, observed.prefill.starting) == (1, 2)
    observed, memory = tracker.observe(memory, fleet.scrape(60.0), three, P90, startup_seconds=60)
    assert observed is not None and observed.prefill.starting == 0  # given up: they hold the planner no longer
    # all advertised: the budget's clock stops, and a later wait gets a whole budget again
    observed, memory = tracker.observe(memory, fleet.scrape(70.0), counts(prefill=(3, 3)), P90, startup_seconds=60)
    assert memory.waiting_since is None
    observed, memory = tracker.observe(memory, fleet.scrape(80.0), counts(prefill=(4, 3)), P90, startup_seconds=60)
    assert observed is not None and observed.prefill.starting == 1


def test_advertised_engines_beyond_the_desired_count_are_draining_not_ready():
    fleet = Fleet()
    _, memory = tracker.observe(tracker.Memory(), fleet.scrape(0.0), counts(decode=(2, 3)), P90)
    observed, _ = tracker.observe(memory, fleet.scrape(10.0), counts(decode=(2, 3)), P90)
    assert observed is not None and (observed.decode.ready, observed.decode.starting) == (2, 0)


def test_engine_load_is_the_ticks_own_scrape():
    fleet = Fleet()
    _, memory = tracker.observe(tracker.Memory(), fleet.scrape(0.0), counts(), P90)
    fleet.decode.state(running=7, waiting=3, deferred=0, usage=0.5)
    observed, _ = tracker.observe(memory, fleet.scrape(10.0), counts(), P90)
    assert observed is not None
    assert (observed.decode.load.running, observed.decode.load.waiting) == (7, 3)
    assert observed.decode.load.kv_usage == pytest.approx(0.5)
    assert not observed.prefill.load.busy


def test_a_clock_that_does_not_move_forward_is_refused():
    fleet = Fleet()
    _, memory = tracker.observe(tracker.Memory(), fleet.scrape(10.0), counts(), P90)
    with pytest.raises(ValueError, match="forward"):
        tracker.observe(memory, fleet.scrape(10.0), counts(), P90)


def test_an_engine_scraped_as_a_router_is_refused():
    fleet = Fleet()
    first = fleet.scrape(0.0)
    _, memory = tracker.observe(tracker.Memory(), first, counts(), P90)
    wrong = tracker.Scrape(5.0, first.decode, first.prefill, first.decode)
    with pytest.raises(ValueError, match="disagg router"):
        tracker.observe(memory, wrong, counts(), P90)


# -- the executor's pure helpers ------------------------------------------------------------------------------------
def pod(name: str, component: str, ip: str | None = "10.0.0.1", ready: bool = True, deleting: bool = False) -> dict:
    meta: dict = {"name": name, "labels": {"app.kubernetes.io/component": component}}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-06T00:00:00Z"
    status: dict = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {"metadata": meta, "status": status}


def test_targets_are_the_ready_routers_and_engines_with_their_ports():
    found = targets([pod("r", "router"), pod("p", "prefill", "10.0.0.2"), pod("d", "decode", "fd00::3"),
                     pod("rdv", "rendezvous"), pod("p2", "prefill", ready=False), pod("p3", "prefill", ip=None),
                     pod("d2", "decode", deleting=True)], engine_port=8100)
    assert [(t.pod, t.component, t.url) for t in found] == [
        ("d", "decode", "http://[fd00::3]:8100/metrics"),
        ("p", "prefill", "http://10.0.0.2:8100/metrics"),
        ("r", "router", "http://10.0.0.1:8000/metrics"),
    ]


def test_advertised_sums_every_revision():
    status = api.DisaggregatedInferenceStatus(revisions=[
        api.RevisionStatus(name="a", prefill=api.RevisionRoleStatus(advertised=2),
                           decode=api.RevisionRoleStatus(advertised=1)),
        api.RevisionStatus(name="b", current=True, prefill=api.RevisionRoleStatus(advertised=1))])
    assert (advertised(status, "prefill"), advertised(status, "decode")) == (3, 1)
    assert advertised(None, "prefill") == 0


def test_the_operator_refuses_a_window_shorter_than_its_tick():
    disagg = str(Path(sys.executable).with_name("disagg"))
    done = subprocess.run([disagg, "operator", "--autoscale-seconds", "5",
                           "--autoscale-window-seconds", "2"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "--autoscale-window-seconds must be at least --autoscale-seconds" in done.stderr


def test_the_default_window_is_15_seconds_or_one_tick_if_longer():
    p = argparse.ArgumentParser()
    run.add_arguments(p)

    def window(*argv: str) -> float:
        return from_args(p.parse_args(list(argv))).autoscale_window_seconds

    assert window() == 15.0
    assert window("--autoscale-seconds", "30") == 30.0
    assert window("--autoscale-window-seconds", "40") == 40.0
