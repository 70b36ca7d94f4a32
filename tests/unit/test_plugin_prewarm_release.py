"""A departed peer's NIXL agent is released on the engine's main thread, but not while KV still crosses with it
(`PeerPrewarmer.release_departed`). The worker is a named fake: what it holds cannot be produced without engines
(tests/engines/test_graceful_stop.py stops a real prefill under load)."""
from __future__ import annotations

import types

from disagg.connector.plugin.prewarm import DEPARTED_GRACE, PeerPrewarmer
from disagg.connector.plugin.push_cancel import Address, Mailbox, PrefillCancels


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


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_departed_peer_is_released_once_no_kv_crosses_with_it():
    shim, clock = FakeShim(), Clock()
    prewarmer = PeerPrewarmer(shim, types.SimpleNamespace(role="decode"), clock=clock)  # type: ignore[arg-type]
    shim.busy = {"prefill-a"}
    for gone in ("prefill-a", "prefill-b"):
        prewarmer._departed.put((gone, clock.now))
    clock.now += DEPARTED_GRACE
    prewarmer.release_departed()
    assert shim.released == ["prefill-b"]
    prewarmer.release_departed()
    assert shim.released == ["prefill-b"]  # still draining into this decode
    shim.busy.clear()
    prewarmer.release_departed()
    assert shim.released == ["prefill-b", "prefill-a"]
    prewarmer.release_departed()
    assert shim.released == ["prefill-b", "prefill-a"]


def departed(prewarmer: PeerPrewarmer, engine_id: str) -> None:
    """The rendezvous says `engine_id` left (what the watch delivers, reduced to what the prewarmer reads)."""
    prewarmer._on_event(types.SimpleNamespace(type="DELETED", engine=types.SimpleNamespace(engine_id=engine_id)))


def prefill_settings() -> types.SimpleNamespace:
    return types.SimpleNamespace(role="prefill", compatible_peer=lambda adv: True)


def test_a_departed_peer_is_kept_for_the_grace_even_when_nothing_tracked_uses_it():
    """Its last registration may still be in NIXL's queue, or between vLLM's writer thread popping it and posting
    the WRITE: no check sees it there."""
    shim, clock = FakeShim(), Clock()
    prewarmer = PeerPrewarmer(shim, prefill_settings(), clock=clock)  # type: ignore[arg-type]
    departed(prewarmer, "decode-a")
    clock.now += DEPARTED_GRACE - 0.5
    prewarmer.release_departed()
    assert shim.released == []
    clock.now += 0.5
    prewarmer.release_departed()
    assert shim.released == ["decode-a"]


def test_a_departed_decode_is_kept_while_a_write_to_it_is_in_flight():
    """The WRITE vLLM posted after popping the registration: a push prefill's busy check must see it too."""
    shim, clock = FakeShim(), Clock()
    cancels = PrefillCancels(Address("prefill-1", "10.0.0.1", 5600, 1), Mailbox(lambda: None), lambda rid: rid)
    prewarmer = PeerPrewarmer(shim, prefill_settings(), writing_to=cancels.writing_to,  # type: ignore[arg-type]
                              clock=clock)
    registration = {"decode_engine_id": "decode-a", "decode_host": "10.0.0.2", "decode_port": 5600,
                    "decode_tp_size": 1, "request_id": "req-1"}
    cancels.posted("req-1-prefill", registration, failed=False)
    departed(prewarmer, "decode-a")
    clock.now += 10 * DEPARTED_GRACE
    prewarmer.release_departed()
    assert shim.released == []
    cancels.writes_done({"req-1-prefill"}, set())
    prewarmer.release_departed()
    assert shim.released == ["decode-a"]
