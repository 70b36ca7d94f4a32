"""The planner's answer: one typed plan, and at most one step in it.

Every step names a revision and, per role, the count it leaves: the executor makes that true and observes
again. A step never needs the one before it to be remembered: the next observation shows its effect.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ScaleUp:
    """Set the revision's StatefulSets to `prefill` and `decode` replicas, each at least what it has; create them
    first when the revision has none. Only ever the target revision, and only roles with nothing withdrawn."""

    revision: str
    prefill: int
    decode: int


@dataclass(frozen=True, slots=True)
class Drain:
    """Keep the lowest `prefill` and `decode` ordinals live and withdraw the ones above them: take them out of
    the rendezvous now and start their drain clock (`drain_seconds`). Their pods keep running, finishing what
    they have. A role whose count is its live count is left alone."""

    revision: str
    prefill: int
    decode: int


@dataclass(frozen=True, slots=True)
class ScaleDown:
    """Set the revision's StatefulSets to `prefill` and `decode` replicas. Only drained ordinals are above
    them."""

    revision: str
    prefill: int
    decode: int


@dataclass(frozen=True, slots=True)
class Retire:
    """Delete the revision's StatefulSets (and what belongs to them only). Only an older revision with no
    replicas left."""

    revision: str


Step = ScaleUp | Drain | ScaleDown | Retire


@dataclass(frozen=True, slots=True)
class Progress:
    """Apply `step`; `reason` says why it is the next one, for events and logs."""

    step: Step
    reason: str


@dataclass(frozen=True, slots=True)
class Waiting:
    """No step is safe yet, but the world is still moving: engines are starting (they become advertised, or
    failed once their startup budget is over) or draining. Observe again when it changes."""

    reason: str


@dataclass(frozen=True, slots=True)
class Blocked:
    """No step is safe and nothing is in motion that could make one safe: target engines failed, or the floor
    cannot be kept with what serves. Only a spec change (a fix, a rollback, a looser policy) or a hand repair
    moves it. The older revisions are left as they are."""

    reason: str


@dataclass(frozen=True, slots=True)
class Complete:
    """Only the target revision is left, at exactly the desired replicas, every engine advertised."""


Plan = Progress | Waiting | Blocked | Complete
