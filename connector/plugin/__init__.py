"""The disagg KV connector plugin for vLLM (`kv_connector_module_path: disagg.connector.plugin`).

vLLM imports this module and looks up the connector class by name. The classes live in `connectors`, which
imports vLLM; they are resolved on first access so that the plugin's vLLM-free parts (settings, advertiser,
prewarm) import anywhere, e.g. in unit tests and in the operator image that copies this package.
"""
from __future__ import annotations

from typing import Any

CONNECTOR_CLASSES = ("NixlPushConnector", "NixlConnector", "NixlPullConnector")
"""The vLLM connector classes this plugin wraps under vLLM's own names."""


def __getattr__(name: str) -> Any:
    if name in CONNECTOR_CLASSES:
        from . import connectors

        return getattr(connectors, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = list(CONNECTOR_CLASSES)
