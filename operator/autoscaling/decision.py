"""The autoscaling planner's answer: both roles' desired counts, each with its reason and the estimates behind it,
as one of four kinds. Every kind carries both counts, so a caller applies (or exports) them the same way."""
from __future__ import annotations

from dataclasses import dataclass

from ..rollout.state import Role


@dataclass(frozen=True, slots=True)
class RoleEstimate:
    """What the planner read into one role's load (what `disagg_planner_*{role}` metrics would export)."""

    demand_tokens_per_second: float
    """Offered load in the role's tokens: prefill prompt tokens, decode output tokens (arrivals x mean size)."""
    throughput_floor: int | None
    """Engines that demand needs at the policy's per-engine throughput; None when that throughput is not given."""
    latency_ms: float | None
    """The role's SLO latency at the policy's percentile (prefill TTFT, decode TPOT); None with no samples."""
    kv_usage: float
    """KV cache in use over the role's engines, in engines' worth."""
    waiting: float
    """Requests waiting in the role's engines."""
    running: float
    """Sequences running in the role's engines."""
    needed: int
    """The count the load calls for before cooldowns, step limits and [min, max]: above the current count when a
    signal is over its level, below it when every signal would stay under the band with fewer, else the current
    count. What an HPA or KEDA would scale on."""


@dataclass(frozen=True, slots=True)
class RoleDecision:
    """One role's desired count, why, and the estimates behind it."""

    desired: int
    reason: str
    estimate: RoleEstimate


@dataclass(frozen=True, slots=True)
class _Decided:
    prefill: RoleDecision
    decode: RoleDecision

    def role(self, role: Role) -> RoleDecision:
        return self.prefill if role == "prefill" else self.decode

    @property
    def counts(self) -> tuple[int, int]:
        """(prefill, decode) desired."""
        return self.prefill.desired, self.decode.desired


@dataclass(frozen=True, slots=True)
class Rescale(_Decided):
    """At least one role's desired count differs from the observed one: apply both."""


@dataclass(frozen=True, slots=True)
class Steady(_Decided):
    """Both counts stay: the load is inside the band, a cooldown holds, or the deployment idles at zero."""


@dataclass(frozen=True, slots=True)
class Limited(_Decided):
    """Both counts stay, and a role's load calls for more than its maxReplicas: only a policy change (a higher
    maximum) or less load moves it."""


@dataclass(frozen=True, slots=True)
class Waiting(_Decided):
    """Both counts stay because engines of an earlier decision are still starting: the window does not show their
    capacity yet. Decide again once they are advertised (or have failed their startup budget)."""


Decision = Rescale | Steady | Limited | Waiting
