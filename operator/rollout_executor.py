"""The rollout's executor: observe a deployment's revisions, ask the planner, perform at most one step.

Hard bounds it enforces, whatever the planner says:
- one step per pass, and no step while the observation predates the last one: until the watch shows every
  StatefulSet this executor wrote at (at least) the generation its write produced, and every one it deleted
  gone, the pass only reports (an index lagging our own write must not make the planner repeat or undo a step);
- only the target revision is ever applied whole; others only change replicas or are deleted (actions.py);
- a write the apiserver refuses ends the pass with the refusal, and the next pass observes again.

An Event is posted per step (RolloutStep), and once per transition into Blocked (RolloutBlocked) or Complete
(RolloutComplete).
"""
from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.resources.apps_v1 import StatefulSet
from lightkube.resources.core_v1 import ConfigMap
from lightkube.types import PatchType

from . import metrics
from .meta import FIELD_MANAGER
from .names import Key
from .rollout import actions as rollout_actions
from .rollout.planner import plan
from .rollout.revisions import RevisionSets
from .rollout.state import Observed, RolloutPolicy
from .rollout.steps import Blocked, Complete, Plan, Progress, Waiting

ApplyFn = Callable[[dict[str, Any]], Awaitable[tuple[dict[str, Any], bool]]]
EventFn = Callable[[str, str, str], None]  # (type Normal|Warning, reason, message)


@dataclass
class _Expected:
    generations: dict[str, int] = field(default_factory=dict)  # StatefulSet name -> generation our write made
    deleted: set[str] = field(default_factory=set)  # StatefulSets we deleted


@dataclass(frozen=True)
class RolloutReport:
    """What the pass found, for status: the plan (None while the observation lags our last write)."""

    plan: Plan | None
    observed: Observed
    stepped: str | None = None  # the step performed in this pass, described


class RolloutFailed(RuntimeError):
    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def _generation(sts: Mapping[str, Any]) -> int:
    return int((sts.get("metadata") or {}).get("generation") or 0)


class RolloutExecutor:
    def __init__(self, client: AsyncClient, apply: ApplyFn, logger: logging.Logger | None = None) -> None:
        self.client = client
        self._apply = apply
        self.log = logger or logging.getLogger("disagg.operator.rollout")
        self._expected: dict[Key, _Expected] = {}
        self._last_kind: dict[Key, str] = {}

    def expect(self, key: Key, statefulset: str, marker: str) -> None:
        """Note a write of a StatefulSet made elsewhere (the reconciler's drift repair), by its child marker."""
        if marker.startswith("g"):
            self._expected.setdefault(key, _Expected()).generations[statefulset] = int(marker[1:])

    def expect_deleted(self, key: Key, statefulset: str) -> None:
        expected = self._expected.setdefault(key, _Expected())
        expected.deleted.add(statefulset)
        expected.generations.pop(statefulset, None)

    def caught_up(self, key: Key, statefulsets: Iterable[Mapping[str, Any]]) -> bool:
        """Whether the watch shows every write this executor made for `key`."""
        expected = self._expected.get(key)
        if expected is None:
            return True
        seen = {str(s["metadata"]["name"]): _generation(s) for s in statefulsets}
        if any(seen.get(name, -1) < gen for name, gen in expected.generations.items()):
            return False
        if expected.deleted & seen.keys():
            return False
        self._expected.pop(key, None)
        return True

    async def advance(self, key: Key, observed: Observed, sets: list[RevisionSets], policy: RolloutPolicy,
                      build: rollout_actions.BuildStatefulSet, statefulsets: Sequence[Mapping[str, Any]],
                      event: EventFn, exists: Callable[[], Awaitable[bool]]) -> RolloutReport:
        """Plan from `observed` and perform the step, if any, once `exists()` confirms the CR is still there (the
        watch can lag its deletion, and a write then would recreate children the garbage collector is removing).
        Raises RolloutFailed when a write is refused."""
        if not self.caught_up(key, statefulsets):
            return RolloutReport(None, observed)
        result = plan(observed, policy)
        kind = type(result).__name__
        previous = self._last_kind.get(key)
        self._last_kind[key] = kind
        if isinstance(result, Blocked) and previous != kind:
            event("Warning", "RolloutBlocked", result.reason)
            metrics.ROLLOUT_BLOCKED.inc()
        if isinstance(result, Complete) and previous not in (None, kind):
            event("Normal", "RolloutComplete", f"revision {observed.target.name} serves at "
                                               f"{observed.target.prefill}P{observed.target.decode}D")
        if not isinstance(result, Progress):
            return RolloutReport(result, observed)
        step = result.step
        if not await exists():
            return RolloutReport(None, observed)
        writes = rollout_actions.actions(step, key[1], sets, build)
        expected = self._expected.setdefault(key, _Expected())
        described = rollout_actions.describe(step)
        for action in writes:
            try:
                await self._perform(key[0], action, expected)
            except ApiError as e:
                verb, kind, name = _what(action)
                metrics.API_ERRORS.labels(kind=kind, verb=verb).inc()
                raise RolloutFailed(f"{_VERBING[verb]} {kind} {key[0]}/{name} ({described}): {e.status.message}",
                                    e.status.code or e.response.status_code) from e
        metrics.ROLLOUT_STEPS.labels(step=type(step).__name__).inc()
        event("Normal", "RolloutStep", f"{described}: {result.reason}")
        self.log.info("%s/%s: %s (%s)", key[0], key[1], described, result.reason)
        return RolloutReport(result, observed, described)

    async def _perform(self, namespace: str, action: rollout_actions.Action, expected: _Expected) -> None:
        if isinstance(action, rollout_actions.Apply):
            stored, _ = await self._apply(action.obj)
            expected.generations[action.obj["metadata"]["name"]] = _generation(stored)
        elif isinstance(action, rollout_actions.Scale):
            patched = await self.client.patch(StatefulSet, action.statefulset, {"spec": {"replicas": action.replicas}},
                                              namespace=namespace, patch_type=PatchType.MERGE,
                                              field_manager=FIELD_MANAGER)
            expected.generations[action.statefulset] = int(patched.metadata.generation or 0) if patched.metadata else 0
        else:
            resource = StatefulSet if action.kind == "StatefulSet" else ConfigMap
            try:
                await self.client.delete(resource, action.name, namespace=namespace)
            except ApiError as e:
                if e.status.code != 404:
                    raise
            if action.kind == "StatefulSet":
                expected.deleted.add(action.name)
                expected.generations.pop(action.name, None)

    def forget(self, key: Key) -> None:
        self._expected.pop(key, None)
        self._last_kind.pop(key, None)


_VERBING = {"apply": "applying", "scale": "scaling", "delete": "deleting"}


def _what(action: rollout_actions.Action) -> tuple[str, str, str]:
    """(verb, kind, name) of a write, for errors and metrics."""
    if isinstance(action, rollout_actions.Apply):
        return "apply", str(action.obj["kind"]), str(action.obj["metadata"]["name"])
    if isinstance(action, rollout_actions.Scale):
        return "scale", "StatefulSet", action.statefulset
    return "delete", action.kind, action.name


def summary(result: Plan | None) -> tuple[str, str]:
    """(reason, message) of the Progressing condition for a plan."""
    if result is None:
        return "RollingOut", "applying the last rollout step"
    if isinstance(result, Complete):
        return "Complete", "every engine runs the current revision"
    if isinstance(result, Blocked):
        return "Blocked", result.reason
    if isinstance(result, Waiting):
        return "RollingOut", result.reason
    return "RollingOut", f"{rollout_actions.describe(result.step)}: {result.reason}"
