"""Deep merge for user overlays (`affinity`, `podTemplate`) onto built objects."""
from __future__ import annotations

import copy
from typing import Any


def _named(items: list[Any]) -> bool:
    return bool(items) and all(isinstance(i, dict) and "name" in i for i in items)


def deep_merge(base: Any, overlay: Any) -> Any:
    """Return `overlay` merged over `base` without mutating either.

    Dicts merge recursively and a None value deletes the key; lists whose items are all objects with a
    "name" (containers, env, volumes, ports...) merge item by item on that name, new names appended; any
    other value, lists included, replaces.
    """
    if isinstance(base, dict) and isinstance(overlay, dict):
        out = copy.deepcopy(base)
        for key, value in overlay.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = deep_merge(out[key], value)
            else:
                out[key] = copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(overlay, list) and _named(base) and _named(overlay):
        items = copy.deepcopy(base)
        index = {item["name"]: i for i, item in enumerate(items)}
        for item in overlay:
            if item["name"] in index:
                items[index[item["name"]]] = deep_merge(items[index[item["name"]]], item)
            else:
                index[item["name"]] = len(items)
                items.append(copy.deepcopy(item))
        return items
    return copy.deepcopy(overlay)
