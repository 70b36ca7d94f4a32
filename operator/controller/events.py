"""Kubernetes Events about a CR: what a pass wants posted (Event), and the one place that posts them (Poster)."""
from __future__ import annotations

import contextvars
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import kopf

EventType = Literal["Normal", "Warning", "Error"]


@dataclass(frozen=True)
class Event:
    type: EventType
    reason: str
    message: str


def normal(reason: str, message: str) -> Event:
    return Event("Normal", reason, message)


def warning(reason: str, message: str) -> Event:
    return Event("Warning", reason, message)


def from_kind(kind: str, reason: str, message: str) -> Event:
    """The executors' (kind, reason, message) callbacks: "Warning" or anything else, Normal."""
    return Event("Warning" if kind == "Warning" else "Normal", reason, message)


class Poster:
    """Posts Events through kopf's event queue, from any task.

    kopf finds its queue through context variables that only its own handler tasks carry; the work queue's passes
    and the background loops run outside them. So every handler calls `bind`, and posts run in the context of
    the first handler call. Before any handler has run (nothing to post about yet) an Event is logged instead."""

    def __init__(self) -> None:
        self._context: contextvars.Context | None = None

    def bind(self) -> None:
        if self._context is None:
            self._context = contextvars.copy_context()

    def post(self, body: kopf.Body, events: Iterable[Event]) -> None:
        for e in events:
            if self._context is None:
                logging.getLogger("disagg.operator").warning("event %s not posted (no handler context yet): %s",
                                                             e.reason, e.message)
                continue
            self._context.run(_post, body, e)


def _post(body: kopf.Body, e: Event) -> None:
    if e.type == "Normal":
        kopf.info(body, reason=e.reason, message=e.message)
    elif e.type == "Warning":
        kopf.warn(body, reason=e.reason, message=e.message)
    else:
        kopf.event(body, type=e.type, reason=e.reason, message=e.message)
