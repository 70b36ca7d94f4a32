"""kopf's diff base, kept empty: the operator decides what a CR's change asks for itself (generations.py)."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import kopf


class NoDiffBase(kopf.DiffBaseStorage):
    """kopf's diff base, for an operator with no changing handlers (on.create/update/delete/resume/field).

    kopf builds a deep copy of every watched object's essence on every event, to diff it against the stored
    copy for those handlers; with none registered the diff is never read. This storage keeps nothing and builds
    an empty essence, so an added changing handler would never fire: tests/unit/test_no_diffbase.py fails
    when one is registered."""

    def build(self, *, body: kopf.Body, extra_fields: Iterable[Any] | None = None) -> kopf.BodyEssence:
        return kopf.BodyEssence()

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        return None
