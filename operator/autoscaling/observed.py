"""What the autoscaling planner reads: one window of what the router saw, what each role's engines export, and
each role's counts. Each type checks itself when built, so the planner only ever sees a consistent observation.

Engine readings are totals over a role's ready engines (not means), so a load keeps its size whatever the number
of engines it is spread over: the planner divides it by a per-engine threshold to size the role.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..rollout.state import Role


def _non_negative(**values: float | None) -> None:
    for name, value in values.items():
        if value is not None and not value >= 0:  # `not >=` also refuses NaN
            raise ValueError(f"{name} must not be negative, got {value}")


@dataclass(frozen=True, slots=True)
class RouterWindow:
    """The requests the router received over the last `seconds`, and its state at the end of them.

    Latencies are the `percentile` of the requests that reached each point in the window, in milliseconds; None
    when none did. Mean token counts are over the requests that finished in the window (0 when none did):
    requests the router refused (429) carry no usage, so they count as arrivals of the mean size."""

    seconds: float
    """The window's length."""
    arrivals: int
    """Requests received, the refused ones included: the offered load."""
    rejected: int = 0
    """Of them, refused with 429 (the router's in-flight bound and wait queue were full)."""
    queued: int = 0
    """Requests the router holds at the window's end: waiting for a slot, or for a pair when there is none."""
    mean_input_tokens: float = 0.0
    """Mean prompt tokens per request."""
    mean_output_tokens: float = 0.0
    """Mean output tokens per request."""
    percentile: float = 90.0
    """The percentile the latencies are at; the planner requires its policy's."""
    ttft_ms: float | None = None
    """Time to first token, from receipt to the first token sent."""
    tpot_ms: float | None = None
    """Time per output token after the first."""
    handoff_ms: float | None = None
    """Prefill finished to decode's first token. Reported, not acted on: its main part is the KV transfer, which no
    engine count changes, and a decode too busy to take sequences shows in its own queue and KV usage."""
    idle_seconds: float = 0.0
    """Time since the router last received a request; longer than the window when the window had none."""

    def __post_init__(self) -> None:
        if not self.seconds > 0:
            raise ValueError(f"seconds must be positive, got {self.seconds}")
        _non_negative(arrivals=self.arrivals, rejected=self.rejected, queued=self.queued,
                      mean_input_tokens=self.mean_input_tokens, mean_output_tokens=self.mean_output_tokens,
                      ttft_ms=self.ttft_ms, tpot_ms=self.tpot_ms, handoff_ms=self.handoff_ms,
                      idle_seconds=self.idle_seconds)
        if self.rejected > self.arrivals:
            raise ValueError(f"rejected {self.rejected} exceeds arrivals {self.arrivals}")
        if not 0 < self.percentile < 100:
            raise ValueError(f"percentile must be between 0 and 100, got {self.percentile}")
        if self.arrivals and self.idle_seconds > self.seconds:
            raise ValueError(f"idle for {self.idle_seconds} s, longer than a window of {self.seconds} s that had "
                             f"{self.arrivals} arrivals")

    @property
    def arrival_rate(self) -> float:
        """Requests per second offered."""
        return self.arrivals / self.seconds

    def arrival_rate_bounds(self, deviations: float = 1.0) -> tuple[float, float]:
        """The offered rate the window's count proves and the one it allows: the arrivals less and plus
        `deviations` Poisson standard deviations (the square root of the count), per second. Both rise with the
        count, and they close in on the rate as the window holds more requests."""
        spread = deviations * math.sqrt(self.arrivals)
        return max(0.0, self.arrivals - spread) / self.seconds, (self.arrivals + spread) / self.seconds


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What a role's ready engines export (vLLM's gauges), summed over them and averaged over the window."""

    waiting: float = 0.0
    """Requests queued in the engines (`vllm:num_requests_waiting`)."""
    running: float = 0.0
    """Sequences being computed (`vllm:num_requests_running`)."""
    kv_usage: float = 0.0
    """KV cache in use, in engines' worth: the sum of `vllm:kv_cache_usage_perc` (each 0 to 1)."""

    def __post_init__(self) -> None:
        _non_negative(waiting=self.waiting, running=self.running, kv_usage=self.kv_usage)

    @property
    def busy(self) -> bool:
        return self.waiting > 0 or self.running > 0


@dataclass(frozen=True, slots=True)
class RoleObserved:
    """One role's counts. `ready` and `starting` are among the `desired` engines (engines above it are draining and
    count for nothing here)."""

    desired: int
    """The count the last decision (or the spec) asks for."""
    ready: int
    """Engines Ready and advertised in the rendezvous: what the router pairs."""
    starting: int = 0
    """Engines asked for that are neither advertised nor failed yet. An engine past its startup budget has failed
    and is not starting, so a pod that can never be scheduled holds the planner for that budget at most."""
    seconds_since_scale: float | None = None
    """Time since `desired` last changed; None when it never has (no cooldown applies)."""
    load: EngineLoad = EngineLoad()
    """What the ready engines export."""

    def __post_init__(self) -> None:
        _non_negative(desired=self.desired, ready=self.ready, starting=self.starting,
                      seconds_since_scale=self.seconds_since_scale)
        if self.ready + self.starting > self.desired:
            raise ValueError(f"ready {self.ready} + starting {self.starting} exceed desired {self.desired}")


@dataclass(frozen=True, slots=True)
class Observed:
    """One observation: the router's window and both roles."""

    window: RouterWindow
    prefill: RoleObserved
    decode: RoleObserved

    def role(self, role: Role) -> RoleObserved:
        return self.prefill if role == "prefill" else self.decode

    @property
    def at_zero(self) -> bool:
        """Both roles asked for no engines: scaled to zero."""
        return self.prefill.desired == 0 and self.decode.desired == 0
