"""Which children a full pass applies: a pure decision over what the builders want, what this process last
applied, which children its watch saw change under it, and what the watch last showed of each.

Invariants:
- a child is applied when this process has not applied it yet (a start, a new child), when its manifest changed
  since (a spec change), when the watch saw it change in a way that is not the echo of our apply or saw it
  deleted (a hand edit);
- on a thorough pass (the resync) a child is also applied unless the watch's latest event for it shows exactly
  what our last apply produced: then the watched index, not a request, confirms the cluster holds our write. A
  child the watch has not shown since our apply, or has shown otherwise, is verified by applying it;
- otherwise it is skipped: applying it would be a server-side apply no-op, which costs a request and writes nothing;
- steps keep the builders' order (ServiceAccount before the Deployment that runs as it, and so on).
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

ChildKey = tuple[str, str, str]  # (kind, namespace, name); namespace "" for cluster-scoped children
Why = Literal["new", "changed", "drifted", "verify", "unchanged"]


def child_key(obj: Mapping[str, Any]) -> ChildKey:
    meta = obj.get("metadata", {})
    return str(obj.get("kind", "")), str(meta.get("namespace") or ""), str(meta.get("name", ""))


def child_marker(obj: Mapping[str, Any]) -> str:
    """What identifies our own write of a child: its generation where it has one (spec changes only), else
    its resourceVersion."""
    meta = obj.get("metadata", {})
    return f"g{meta['generation']}" if meta.get("generation") else f"rv{meta.get('resourceVersion')}"


def digest(obj: Mapping[str, Any]) -> str:
    """A fingerprint of a desired manifest: equal manifests, equal digests."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:20]


@dataclass(frozen=True)
class Applied:
    """This process's last apply of a child: the manifest it sent and the marker of what came back."""

    digest: str
    marker: str


@dataclass(frozen=True)
class Step:
    key: ChildKey
    obj: dict[str, Any]
    apply: bool
    why: Why


@dataclass(frozen=True)
class ApplyPlan:
    steps: tuple[Step, ...]

    @property
    def to_apply(self) -> tuple[Step, ...]:
        return tuple(s for s in self.steps if s.apply)

    @property
    def skipped(self) -> int:
        return sum(not s.apply for s in self.steps)


def plan_children(desired: list[dict[str, Any]], applied: Mapping[ChildKey, Applied],
                  drifted: frozenset[ChildKey] | set[ChildKey], thorough: bool,
                  watched: Mapping[ChildKey, str] | None = None) -> ApplyPlan:
    """`watched` maps a child to the marker (`child_marker`) of the latest watch event seen for it."""
    watched = watched or {}
    steps = []
    for obj in desired:
        key = child_key(obj)
        last = applied.get(key)
        if last is None:
            why: Why = "new"
        elif last.digest != digest(obj):
            why = "changed"
        elif key in drifted:
            why = "drifted"
        elif thorough and watched.get(key) != last.marker:
            why = "verify"
        else:
            why = "unchanged"
        steps.append(Step(key, obj, why != "unchanged", why))
    return ApplyPlan(tuple(steps))
