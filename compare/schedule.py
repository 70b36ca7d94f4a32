"""The order in which `disagg compare` serves the workload in each mode: ABBA rounds, so that a drift over the run
(a warming cache, a neighbour's load) falls on both modes alike."""
from __future__ import annotations

from typing import TypeAlias

from disagg.connector.wire.advertisement import KvMode

Mode: TypeAlias = KvMode

MODES: tuple[Mode, Mode] = ("push", "pull")


def other(mode: Mode) -> Mode:
    return "pull" if mode == "push" else "push"


def abba(rounds: int, first: Mode = "push") -> list[Mode]:
    """`rounds` pairs of segments, each pair the reverse of the one before: push, pull, pull, push, ... Every mode
    serves `rounds` segments; a mode change between segments is one rollout."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    pair = [first, other(first)]
    return [m for i in range(rounds) for m in (pair if i % 2 == 0 else pair[::-1])]


def switches(order: list[Mode], current: Mode) -> int:
    """Rollouts the order needs from a deployment serving `current`, and back to it at the end."""
    path = [current, *order, current]
    return sum(1 for a, b in zip(path, path[1:], strict=False) if a != b)
