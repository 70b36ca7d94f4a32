"""A departed peer's NIXL agent is released on the engine's main thread, but not while KV still crosses with it
(`PeerPrewarmer.release_departed`). The worker is a named fake: what it holds cannot be produced without engines
(tests/engines/test_graceful_stop.py stops a real prefill under load)."""
from __future__ import annotations

import types

from disagg.connector.plugin.prewarm import PeerPrewarmer


class FakeShim:
    """FAKE: the WorkerShim calls release_departed makes, with the engines this worker still exchanges KV with."""

    def __init__(self) -> None:
        self.busy: set[str] = set()
        self.released: list[str] = []

    def hook_handshake(self, replacement):
        return replacement

    def busy_with(self, engine_id: str) -> bool:
        return engine_id in self.busy

    def release_if_loaded(self, engine_id: str) -> bool:
        self.released.append(engine_id)
        return True


def test_a_departed_peer_is_released_once_no_kv_crosses_with_it():
    shim = FakeShim()
    prewarmer = PeerPrewarmer(shim, types.SimpleNamespace(role="decode"))  # type: ignore[arg-type]
    shim.busy = {"prefill-a"}
    for gone in ("prefill-a", "prefill-b"):
        prewarmer._departed.put(gone)
    prewarmer.release_departed()
    assert shim.released == ["prefill-b"]
    prewarmer.release_departed()
    assert shim.released == ["prefill-b"]  # still draining into this decode
    shim.busy.clear()
    prewarmer.release_departed()
    assert shim.released == ["prefill-b", "prefill-a"]
    prewarmer.release_departed()
    assert shim.released == ["prefill-b", "prefill-a"]
