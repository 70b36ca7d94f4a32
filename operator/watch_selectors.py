"""Server-side filters for the operator's watches, derived from its handlers' own filters.

kopf filters a handler's `labels=` and `field=` in the operator, after the apiserver has sent and kopf has
decoded every object of the resource in the cluster. On a fleet that is every pod and every Event. When all
handlers on a resource (watch and index handlers alike) carry the same exact filter, the watch can ask the
apiserver for just those objects instead: nothing a handler would accept is filtered out. A resource whose
handlers differ, or filter by a callable or presence, is watched whole, as kopf does by default."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import kopf

Resource = tuple[str, str, str]  # (group, version, plural)


@dataclass(frozen=True)
class Selectors:
    labels: dict[Resource, str]
    fields: dict[Resource, str]


def _exact_labels(labels: Mapping[str, Any] | None) -> str | None:
    if not labels or not all(isinstance(v, str) for v in labels.values()):
        return None
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def _exact_field(field: tuple[str, ...] | None, value: Any) -> str | None:
    if not field or not isinstance(value, str):
        return None
    return f"{'.'.join(field)}={value}"


def _common(values: Iterable[str | None]) -> str | None:
    distinct = set(values)
    return distinct.pop() if len(distinct) == 1 else None


def derive(registry: kopf.OperatorRegistry) -> Selectors:
    """The label and field selector of each resource whose handlers all filter by that same exact value."""
    handlers: dict[Resource, list[Any]] = {}
    for group in (registry._watching, registry._indexing, registry._changing, registry._spawning,
                  registry._webhooks):
        for handler in group.get_all_handlers():
            selector = handler.selector
            if selector is None or selector.group is None or selector.version is None or \
                    not isinstance(selector.any_name, str):
                continue  # a selector by category, kind or everything: not one resource
            handlers.setdefault((selector.group, selector.version, selector.any_name), []).append(handler)
    labels: dict[Resource, str] = {}
    fields: dict[Resource, str] = {}
    for resource, hs in handlers.items():
        if (label := _common(_exact_labels(getattr(h, "labels", None)) for h in hs)) is not None:
            labels[resource] = label
        if (field := _common(_exact_field(getattr(h, "field", None), getattr(h, "value", None)) for h in hs)):
            fields[resource] = field
    return Selectors(labels, fields)


def configure(settings: kopf.OperatorSettings, selectors: Selectors) -> None:
    for resource, label in selectors.labels.items():
        settings.watching.label_selectors[resource] = label
    for resource, field in selectors.fields.items():
        settings.watching.field_selectors[resource] = field
