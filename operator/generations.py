"""Which of a DisaggregatedInference's own watch events ask for a full pass: a pure decision.

Invariants:
- a CR found at start-up (an object from a listing: event type None) gets one ("resume");
- then one per new (uid, generation): "create" for a uid not seen before, "update" for a later generation of a
  known uid (the apiserver bumps a CR's generation on spec changes only);
- an event with the generation already passed (a status write, ours among them; a label or annotation change)
  gets none.

This is what kopf's on.create/on.update(field="spec")/on.resume would decide, without their cost: those keep a
copy of the spec in an annotation (one PATCH per change), and build and compare it on every event of the CR.
"""
from __future__ import annotations

from typing import Literal

from .names import Key

Trigger = Literal["resume", "create", "update"]


class Generations:
    def __init__(self) -> None:
        self._passed: dict[Key, tuple[str, int]] = {}

    def trigger(self, key: Key, event_type: str | None, uid: str, generation: int) -> Trigger | None:
        """The full pass this event asks for, if any; noted as passed."""
        previous = self._passed.get(key)
        self._passed[key] = (uid, generation)
        if event_type is None:
            return "resume" if previous != (uid, generation) else None
        if previous is None or previous[0] != uid:
            return "create"
        return "update" if generation != previous[1] else None

    def forget(self, key: Key) -> None:
        self._passed.pop(key, None)

