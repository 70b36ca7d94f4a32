"""What the rollout planner sees: the target, every revision's engines, and the policy.

Engines are identified by StatefulSet ordinal. A StatefulSet removes its highest ordinals first, so the planner
withdraws engines from the top: a role's `replicas` ordinals split into `live` (the lowest, still offered to the
router), then `draining` (withdrawn from the rendezvous, drain clock running), then `drained` (withdrawn and
drained: safe to delete). `ready`, `advertised` and `failed` are sets of ordinals; the planner reads them only
below `live`, so the executor need not filter out withdrawn ordinals.

Each state checks itself when built, so the planner only ever sees a consistent one.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from disagg.connector.wire.advertisement import Role as Role  # the one definition: the wire contract's

ROLES: tuple[Role, Role] = ("prefill", "decode")


def _ordinals(values: frozenset[int], replicas: int, what: str) -> None:
    bad = sorted(o for o in values if not 0 <= o < replicas)
    if bad:
        raise ValueError(f"{what} ordinals {bad} are outside 0..{replicas - 1}")


@dataclass(frozen=True, slots=True)
class RolloutPolicy:
    """How a rollout may move. These become `spec.rollout`; the executor maps them here."""

    max_surge: int = 1
    """Engines per role that may exist above the desired count while an older revision still has engines of that
    role; so when the old revision is at full size, a step adds this many. With no older engines to replace (a
    first deployment, a scale-up) every missing engine is added at once. At least 1, so a rollout can start."""
    max_unavailable: int = 0
    """Pairs the rollout may serve below the desired pair count (see `min_available_pairs`)."""
    max_skew: int = 1
    """How far, in engines, a revision's live prefill:decode may stray from the spec's ratio (see
    `planner.skew`). At least 1: counts are whole engines, and some rollouts must move one role before the
    other (0 deadlocks, for example, two older revisions of one layout whose excess prefill can only leave
    together with a decode still needed)."""
    min_available_pairs: int | None = None
    """Ready, compatible pairs that must serve at every step. None: the desired pairs minus `max_unavailable`,
    but at least 1 while the target has pairs. Never above the target's own pairs: a scale-down to fewer pairs
    must be able to finish."""
    drain_seconds: int = 30
    """The executor's: how long a withdrawn engine keeps working on its requests before it counts as drained."""
    startup_seconds: int = 600
    """The executor's: how long an engine may take to become Ready before it counts as failed."""

    def __post_init__(self) -> None:
        if self.max_surge < 1:
            raise ValueError(f"max_surge must be at least 1, got {self.max_surge}")
        if self.max_skew < 1:
            raise ValueError(f"max_skew must be at least 1, got {self.max_skew}")
        if self.max_unavailable < 0:
            raise ValueError(f"max_unavailable must not be negative, got {self.max_unavailable}")
        if self.min_available_pairs is not None and self.min_available_pairs < 0:
            raise ValueError(f"min_available_pairs must not be negative, got {self.min_available_pairs}")
        if self.drain_seconds < 0 or self.startup_seconds < 1:
            raise ValueError("drain_seconds must not be negative and startup_seconds must be at least 1")


@dataclass(frozen=True, slots=True)
class RoleState:
    """One role of one revision: its StatefulSet as the executor observed it."""

    replicas: int = 0
    """What the StatefulSet asks for now (its spec.replicas)."""
    ready: frozenset[int] = frozenset()
    """Ordinals whose pod is Ready."""
    advertised: frozenset[int] = frozenset()
    """Ordinals that are Ready and listed in the rendezvous: what the router pairs."""
    draining: int = 0
    """Ordinals just below the drained ones, withdrawn from the rendezvous, drain not over yet."""
    drained: int = 0
    """The highest ordinals: withdrawn and drained, safe to delete."""
    failed: frozenset[int] = frozenset()
    """Ordinals not Ready within the startup budget, or Degraded (a failed preflight, a crash loop)."""

    def __post_init__(self) -> None:
        if min(self.replicas, self.draining, self.drained) < 0:
            raise ValueError("replicas, draining and drained must not be negative")
        if self.draining + self.drained > self.replicas:
            raise ValueError(f"{self.draining} draining + {self.drained} drained exceed {self.replicas} replicas")
        for name in ("ready", "advertised", "failed"):
            _ordinals(getattr(self, name), self.replicas, name)
        if not self.advertised <= self.ready:
            raise ValueError(f"advertised ordinals {sorted(self.advertised - self.ready)} are not ready")

    @property
    def live(self) -> int:
        """Ordinals 0..live-1 are not withdrawn: the router may use them once advertised."""
        return self.replicas - self.draining - self.drained

    @property
    def serving(self) -> int:
        """Live engines the router can pair now."""
        return sum(1 for o in self.advertised if o < self.live)

    def serving_below(self, keep: int) -> int:
        """Live engines the router could still pair if every ordinal from `keep` up were withdrawn."""
        return sum(1 for o in self.advertised if o < min(keep, self.live))

    @property
    def starting(self) -> int:
        """Live engines neither advertised nor failed: the world will still move them one way or the other."""
        return sum(1 for o in range(self.live) if o not in self.advertised and o not in self.failed)

    def failed_below(self, keep: int) -> list[int]:
        """Failed live ordinals under `keep`, the ones a revision keeping `keep` engines would go on running."""
        return sorted(o for o in self.failed if o < min(keep, self.live))

    @classmethod
    def counted(cls, replicas: int, ready: int | None = None, advertised: int | None = None, *, draining: int = 0,
                drained: int = 0, failed: int = 0) -> RoleState:
        """A role from counts, with the usual ordinal layout: the lowest ordinals ready and advertised, failed
        ones just above them, withdrawn ones on top. `ready` and `advertised` default to every live engine."""
        live = replicas - draining - drained
        ready = live if ready is None else ready
        advertised = ready if advertised is None else advertised
        return cls(replicas=replicas, ready=frozenset(range(ready)), advertised=frozenset(range(advertised)),
                   draining=draining, drained=drained, failed=frozenset(range(ready, ready + failed)))


@dataclass(frozen=True, slots=True)
class RevisionState:
    """One revision: a pod template (its `name`, e.g. a hash) with a StatefulSet per role. Revisions with equal
    `layout_key` (everything that decides whether a prefill and a decode can exchange KV: model, dtype, block
    size, TP, connector, …) are compatible, so pairs across them count."""

    name: str
    layout_key: str
    prefill: RoleState = field(default_factory=RoleState)
    decode: RoleState = field(default_factory=RoleState)

    def role(self, role: Role) -> RoleState:
        return self.prefill if role == "prefill" else self.decode

    @property
    def empty(self) -> bool:
        return self.prefill.replicas == 0 and self.decode.replicas == 0


@dataclass(frozen=True, slots=True)
class Target:
    """The spec: the revision it names, that revision's layout key, and the desired engines per role."""

    name: str
    layout_key: str
    prefill: int
    decode: int

    def __post_init__(self) -> None:
        if self.prefill < 0 or self.decode < 0:
            raise ValueError("desired replicas must not be negative")

    def desired(self, role: Role) -> int:
        return self.prefill if role == "prefill" else self.decode

    @property
    def pairs(self) -> int:
        return min(self.prefill, self.decode)


@dataclass(frozen=True, slots=True)
class Observed:
    """Everything the planner decides from: the target and every revision that has StatefulSets, the target's
    among them once it exists. The order of `revisions` is the order older revisions are drained in (the
    executor lists them oldest first)."""

    target: Target
    revisions: tuple[RevisionState, ...] = ()

    def __post_init__(self) -> None:
        names = [r.name for r in self.revisions]
        if len(set(names)) != len(names):
            raise ValueError(f"revision names repeat: {names}")
        current = self.current
        if current is not None and current.layout_key != self.target.layout_key:
            raise ValueError(f"revision {current.name} has layout {current.layout_key!r}, the target says "
                             f"{self.target.layout_key!r}")

    @property
    def current(self) -> RevisionState | None:
        """The target's revision, when its StatefulSets exist."""
        return next((r for r in self.revisions if r.name == self.target.name), None)

    @property
    def older(self) -> tuple[RevisionState, ...]:
        """Every other revision, in drain order."""
        return tuple(r for r in self.revisions if r.name != self.target.name)
