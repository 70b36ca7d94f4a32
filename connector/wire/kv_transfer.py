"""vLLM's `--kv-transfer-config` for a disagg engine: what the operator renders and local runs start with."""
from __future__ import annotations

from typing import Any, Final

PLUGIN_MODULE: Final = "disagg.connector.plugin"
"""`kv_connector_module_path` of engines that load the plugin (the module engine pods import)."""
KV_ROLES: Final = {"prefill": "kv_producer", "decode": "kv_consumer"}
"""vLLM's `kv_role` per engine role; `kv_both` is for bidirectional pull."""
ROLE_OF_KV_ROLE: Final = {v: k for k, v in KV_ROLES.items()}


def kv_transfer_config(*, connector: str, role: str, engine_id: str, backend: str, use_plugin: bool,
                       bidirectional: bool = False, buffer_device: str | None = None,
                       push_registration_timeout: float | None = None) -> dict[str, Any]:
    """The config vLLM's KV connector factory reads. `use_plugin` names this package's module, which wraps
    `connector` under vLLM's own class name; without it vLLM (or its platform) resolves the class itself.
    `push_registration_timeout`: how long a push decode waits for its prefill's KV (vLLM's default: 480 s)."""
    if role not in KV_ROLES:
        raise ValueError(f"role must be one of {tuple(KV_ROLES)}, got {role!r}")
    config: dict[str, Any] = {"kv_connector": connector, "kv_role": "kv_both" if bidirectional else KV_ROLES[role],
                              "engine_id": engine_id}
    if buffer_device is not None:
        config["kv_buffer_device"] = buffer_device
    if use_plugin:
        config["kv_connector_module_path"] = PLUGIN_MODULE
    extra: dict[str, Any] = {"backends": [backend]}
    if push_registration_timeout is not None:
        extra["push_registration_timeout"] = push_registration_timeout
    config["kv_connector_extra_config"] = extra
    return config
