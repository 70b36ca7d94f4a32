"""A push decode reads NIXL's notifications at the end of each engine step (connector/plugin/push_notify.py).

vLLM is not installed here, and NIXL's notification list cannot be filled without two engines, so these tests
use named fakes: `FakeNixl` hands out queued notifications as NIXL's `get_new_notifs` does, and
`FakePushWorker` keeps vLLM 0.32's push worker's shape (its completion queue, read in `get_transfer_results`).
On real engines the tests in tests/engines run with the plugin doing this.
"""
from __future__ import annotations

import logging
import queue
import sys
import threading
import types

import pytest

from disagg.connector.plugin import vllm_shim
from disagg.connector.plugin.push_notify import StepNotifications
from disagg.connector.plugin.vllm_shim import WorkerShim

PREFIX = b"PUSH_REG:"


class FakeNixl:
    """FAKE: NIXL's notification list; each call returns what arrived since the last one, by agent."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.arrived: list[tuple[str, bytes]] = []

    def arrive(self, agent: str, message: bytes) -> None:
        with self.lock:
            self.arrived.append((agent, message))

    def get_new_notifs(self, backends: list[str] | None = None) -> dict[str, list[bytes]]:
        with self.lock:
            out: dict[str, list[bytes]] = {}
            for agent, message in self.arrived:
                out.setdefault(agent, []).append(message)
            self.arrived.clear()
        return out


def test_completions_go_to_the_main_thread_and_registrations_stay_for_the_writer():
    nixl, forwarded = FakeNixl(), []
    notes = StepNotifications(nixl.get_new_notifs, lambda m: m.startswith(PREFIX), forwarded.append)
    nixl.arrive("p", b"req-1:1")
    nixl.arrive("p", PREFIX + b"reg-a")
    nixl.arrive("q", b"HB:req-2")
    assert notes.drain() == 2
    assert forwarded == [b"req-1:1", b"HB:req-2"]  # in arrival order, as the writer forwards them
    nixl.arrive("p", PREFIX + b"reg-b")
    # The writer gets the held registration first, then what NIXL has now; nothing twice.
    assert notes.for_writer() == {"p": [PREFIX + b"reg-a", PREFIX + b"reg-b"]}
    assert notes.for_writer() == {}
    assert notes.drain() == 0 and notes.drained == 2


def test_every_notification_reaches_its_consumer_once_while_both_threads_read():
    nixl, forwarded = FakeNixl(), []
    notes = StepNotifications(nixl.get_new_notifs, lambda m: m.startswith(PREFIX), forwarded.append)
    writer_got: list[bytes] = []
    stop = threading.Event()

    def writer() -> None:
        while not stop.is_set():
            for messages in notes.for_writer().values():
                for m in messages:  # vLLM's writer: registrations kept, the rest forwarded
                    (writer_got if m.startswith(PREFIX) else forwarded).append(m)

    t = threading.Thread(target=writer)
    t.start()
    sent = []
    for i in range(3000):
        m = (PREFIX if i % 3 == 0 else b"") + f"n{i}".encode()
        sent.append(m)
        nixl.arrive(f"agent-{i % 2}", m)
        if i % 7 == 0:
            notes.drain()
    stop.set()
    t.join()
    notes.drain()
    writer_got += [m for ms in notes.for_writer().values() for m in ms]
    assert sorted(writer_got) == sorted(m for m in sent if m.startswith(PREFIX))
    assert sorted(forwarded) == sorted(m for m in sent if not m.startswith(PREFIX))


class FakePushWorker:
    """FAKE: vLLM 0.32's push worker as far as notifications go. Its writer thread is parked (as on an idle or busy
    decode between steps); `get_transfer_results` reports the completions in the main thread's queue."""

    def __init__(self, nixl: FakeNixl) -> None:
        self.nixl_wrapper = nixl
        self._pending_completion_notifs: queue.Queue[bytes] = queue.Queue()

    def get_transfer_results(self) -> set[str]:
        done = set()
        while not self._pending_completion_notifs.empty():
            done.add(self._pending_completion_notifs.get_nowait().decode().rsplit(":", 1)[0])
        return done


@pytest.fixture
def vllm_metadata(monkeypatch):
    """FAKE: the one vLLM module the shim imports for this, with vLLM 0.32's registration prefix."""
    names = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata".split(".")
    for i in range(1, len(names) + 1):
        monkeypatch.setitem(sys.modules, ".".join(names[:i]), types.ModuleType(".".join(names[:i])))
    monkeypatch.setattr(sys.modules[".".join(names)], "PUSH_REG_NOTIF_PREFIX", PREFIX, raising=False)


def test_a_landed_write_is_reported_in_the_step_it_landed_in(vllm_metadata):
    nixl = FakeNixl()
    worker = FakePushWorker(nixl)
    nixl.arrive("prefill", b"req-1:1")
    assert worker.get_transfer_results() == set()  # vLLM's own path: only once the writer has forwarded it
    notes = WorkerShim(worker).notify_on_step()  # type: ignore[arg-type]
    assert notes is not None
    assert worker.get_transfer_results() == {"req-1"}
    nixl.arrive("prefill", PREFIX + b"reg")
    assert worker.get_transfer_results() == set()
    assert worker.nixl_wrapper.get_new_notifs() == {"prefill": [PREFIX + b"reg"]}  # the writer's, still


def test_a_worker_of_another_shape_keeps_vllms_path(vllm_metadata, caplog):
    class OtherWorker:
        nixl_wrapper = FakeNixl()

        def get_transfer_results(self) -> set[str]:
            return set()

    caplog.set_level(logging.INFO, logger="disagg.plugin")
    worker = OtherWorker()
    assert WorkerShim(worker).notify_on_step() is None  # type: ignore[arg-type]
    assert "_pending_completion_notifs" in caplog.text
    assert "get_transfer_results" not in vars(worker)
    assert vllm_shim.stepped_aside() is None  # the rest of the plugin stays
