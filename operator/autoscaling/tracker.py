"""One CR's observations over time: each tick's scrapes of its routers and engines, turned into the planner's
`Observed` against the tick before. Pure: the executor fetches the metric text and the counts, and keeps the
`Memory` this returns for the next tick.

Invariants (tests/unit/test_autoscaling_tracker.py):
- the first tick, and a tick after one that could not observe, gives no observation: a window needs two scrapes;
- the window is the time between the two scrapes, never a nominal interval (a slow tick is a longer window); with
  `window_seconds`, it reaches back to the newest earlier scrape at least that old (or the oldest kept), so ticks
  can come more often than the window they read: the queues and KV are each tick's own, the rates a window's;
- idle time grows by each tick without an arrival, and is 0 after one with an arrival;
- `ready` counts a role's engines advertised in the rendezvous, at most its desired count; the rest of `desired`
  is `starting` until the planner has waited `startup_seconds` for it, then nothing (engines that cannot start, a
  pod that cannot be scheduled, must not hold the planner forever);
- engine load is read at the tick's scrape, summed over the role's ready engines (all revisions: a draining
  engine still carries requests).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from ..rollout.state import ROLES, Role
from . import scrape
from .observed import Observed, RoleObserved

STARTUP_SECONDS = 900.0
"""How long the planner waits for engines it asked for when spec.rollout.startupSeconds is unset."""


@dataclass(frozen=True, slots=True)
class Scrape:
    """One tick's scrapes, each snapshot's sources named by pod."""

    at: float
    """Monotonic seconds."""
    routers: scrape.Snapshot
    prefill: scrape.Snapshot
    decode: scrape.Snapshot

    def engines(self, role: Role) -> scrape.Snapshot:
        return self.prefill if role == "prefill" else self.decode


@dataclass(frozen=True, slots=True)
class RoleCounts:
    desired: int
    """What the role's DisaggregatedRole asks for now."""
    advertised: int
    """The role's engines in the rendezvous, over every revision."""
    seconds_since_scale: float | None = None


@dataclass(frozen=True, slots=True)
class Memory:
    """What one tick leaves for the next."""

    last: Scrape | None = None
    earlier: tuple[Scrape, ...] = ()
    """With a window longer than the tick: the scrapes before `last` that a later window may still start from,
    oldest first."""
    idle_seconds: float = 0.0
    waiting_since: float | None = None
    """When the planner began to wait for engines that are not advertised yet; None while none are missing."""


def observe(memory: Memory, now: Scrape, counts: Mapping[Role, RoleCounts], percentile: float,
            startup_seconds: float = STARTUP_SECONDS,
            window_seconds: float | None = None) -> tuple[Observed | None, Memory]:
    """The observation from `memory`'s last scrape (or, with `window_seconds`, the newest kept scrape at least that
    long before `now`) to `now`, and the memory for the next tick. Raises ValueError (from `scrape`) when a source
    is not what it should be; the memory to keep then is `Memory(last=now)`."""
    missing = any(counts[r].advertised < counts[r].desired for r in ROLES)
    waiting_since = (memory.waiting_since if memory.waiting_since is not None else now.at) if missing else None
    if memory.last is None:
        return None, Memory(last=now, waiting_since=waiting_since)
    last = memory.last
    tick = now.at - last.at
    if not tick > 0:
        raise ValueError(f"scrapes {tick} s apart: the clock must move forward between ticks")
    kept = (*memory.earlier, last)
    base = last
    if window_seconds is not None:
        old_enough = [s for s in kept if now.at - s.at >= window_seconds]
        base = old_enough[-1] if old_enough else kept[0]
    window = scrape.window((base.routers, now.routers), (base.prefill, now.prefill), (base.decode, now.decode),
                           now.at - base.at, percentile)
    arrived = window.arrivals if base is last else scrape.arrivals(last.routers, now.routers)
    idle = 0.0 if arrived else memory.idle_seconds + tick
    window = replace(window, idle_seconds=idle)
    given_up = waiting_since is not None and now.at - waiting_since >= startup_seconds

    def role(r: Role) -> RoleObserved:
        c = counts[r]
        ready = min(c.advertised, c.desired)
        return RoleObserved(desired=c.desired, ready=ready, starting=0 if given_up else c.desired - ready,
                            seconds_since_scale=c.seconds_since_scale,
                            load=scrape.engine_load(now.engines(r)))

    observed = Observed(window=window, prefill=role("prefill"), decode=role("decode"))
    earlier = tuple(s for s in kept if s.at >= base.at) if window_seconds is not None else ()
    return observed, Memory(last=now, earlier=earlier, idle_seconds=idle, waiting_since=waiting_since)
