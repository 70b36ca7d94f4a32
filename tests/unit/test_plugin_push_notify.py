"""A push decode's writer reads NIXL's notifications at the end of each engine step, before the main thread reads
what it forwarded (connector/plugin/push_notify.py).

vLLM is not installed here, and NIXL's notification list cannot be filled without two engines, so these tests
use named fakes: `FakeNixl` hands out queued notifications as NIXL's `get_new_notifs` does, `FakeWriter` is the
push writer thread's loop, and `FakePushWorker` keeps vLLM 0.32's push worker's shape (its writer, its wake
event, its completion queue, read in `get_transfer_results`).
On real engines the tests in tests/engines run with the plugin doing this.
"""
from __future__ import annotations

import logging
import queue
import sys
import threading
import time
import types

import pytest

from disagg.connector.plugin import vllm_shim
from disagg.connector.plugin.push_notify import WriterDrain
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


def notes_for(nixl: FakeNixl, forwarded: list[bytes], wake=lambda: None, timeout: float = 1.0) -> WriterDrain:
    return WriterDrain(nixl.get_new_notifs, lambda m: m.startswith(PREFIX), forwarded.append, wake, timeout)


def test_the_writers_read_forwards_completions_and_returns_only_registrations():
    nixl, forwarded = FakeNixl(), []
    notes = notes_for(nixl, forwarded)
    nixl.arrive("p", b"req-1:1")
    nixl.arrive("p", PREFIX + b"reg-a")
    nixl.arrive("q", b"HB:req-2")
    assert notes.for_writer() == {"p": [PREFIX + b"reg-a"]}
    assert forwarded == [b"req-1:1", b"HB:req-2"]  # in arrival order, as the writer forwards them
    assert notes.for_writer() == {} and forwarded == [b"req-1:1", b"HB:req-2"]  # nothing twice


class FakeWriter:
    """FAKE: vLLM 0.32's push writer thread as far as notifications go: parked until woken, then one read of NIXL,
    registrations kept, everything else forwarded (which `WriterDrain.for_writer` has done by then)."""

    def __init__(self, read) -> None:
        self.wake = threading.Event()
        self.stop = threading.Event()
        self.registrations: list[bytes] = []
        self.read = read
        self.thread = threading.Thread(target=self.run)

    def run(self) -> None:
        while not self.stop.is_set():
            self.wake.wait()
            self.wake.clear()
            for messages in self.read().values():
                self.registrations.extend(messages)

    def __enter__(self) -> FakeWriter:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.wake.set()
        self.thread.join()


def test_a_drain_returns_once_the_writer_has_read_what_arrived_before_it():
    nixl, forwarded = FakeNixl(), []
    writer = FakeWriter(lambda: notes.for_writer())
    notes = notes_for(nixl, forwarded, writer.wake.set)
    with writer:
        for i in range(200):
            nixl.arrive("p", f"req-{i}:1".encode())
            assert notes.drain()
            assert forwarded[-1] == f"req-{i}:1".encode()
    assert notes.late == 0 and notes.drains == 200


def test_every_notification_reaches_its_consumer_once_while_both_threads_run():
    nixl, forwarded = FakeNixl(), []
    writer = FakeWriter(lambda: notes.for_writer())
    notes = notes_for(nixl, forwarded, writer.wake.set)
    sent = []
    with writer:
        for i in range(3000):
            m = (PREFIX if i % 3 == 0 else b"") + f"n{i}".encode()
            sent.append(m)
            nixl.arrive(f"agent-{i % 2}", m)
            if i % 7 == 0:
                notes.drain()
            elif i % 5 == 0:
                writer.wake.set()  # vLLM's own wakes (new work from start_load_kv), at any moment
        notes.drain()
    assert sorted(writer.registrations) == sorted(m for m in sent if m.startswith(PREFIX))
    assert sorted(forwarded) == sorted(m for m in sent if not m.startswith(PREFIX))


def test_a_read_that_began_before_the_drain_does_not_satisfy_it():
    """A completion may arrive after a read began: only a read that begins after the drain was called has seen
    everything that arrived before it."""
    nixl, forwarded = FakeNixl(), []
    in_read, release = threading.Event(), threading.Event()

    def slow_read(*args):
        in_read.set()
        release.wait()
        return nixl.get_new_notifs()

    notes = WriterDrain(slow_read, lambda m: m.startswith(PREFIX), forwarded.append, lambda: None, 0.3)
    reading = threading.Thread(target=notes.for_writer)
    reading.start()
    in_read.wait()
    threading.Timer(0.05, release.set).start()  # the old read finishes while the drain waits
    assert not notes.drain()
    reading.join()
    assert notes.late == 1


def test_a_writer_that_never_reads_costs_the_bound_and_loses_nothing():
    nixl, forwarded = FakeNixl(), []
    notes = notes_for(nixl, forwarded, timeout=0.05)
    nixl.arrive("p", b"req-1:1")
    t0 = time.monotonic()
    assert not notes.drain()
    assert 0.05 <= time.monotonic() - t0 < 1.0
    assert forwarded == [] and (notes.late, notes.drains) == (1, 1)
    assert notes.for_writer() == {} and forwarded == [b"req-1:1"]  # the writer's next read still delivers it


class FakePushWorker:
    """FAKE: vLLM 0.32's push worker as far as notifications go: its parked writer thread (`FakeWriter`), woken
    through `_push_writer_wake`, and `get_transfer_results`, which reports the completions in the main thread's
    queue."""

    def __init__(self, nixl: FakeNixl) -> None:
        self.nixl_wrapper = nixl
        self._pending_completion_notifs: queue.Queue[bytes] = queue.Queue()
        self.writer = FakeWriter(self.read)
        self._push_writer_wake = self.writer.wake

    def read(self) -> dict[str, list[bytes]]:
        registrations: dict[str, list[bytes]] = {}
        for agent, messages in self.nixl_wrapper.get_new_notifs().items():
            for m in messages:
                if m.startswith(PREFIX):
                    registrations.setdefault(agent, []).append(m)
                else:
                    self._pending_completion_notifs.put(m)
        return registrations

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
    with worker.writer:
        nixl.arrive("prefill", b"req-1:1")
        assert worker.get_transfer_results() == set()  # vLLM's own path: only once the writer has forwarded it
        notes = WorkerShim(worker).notify_on_step()  # type: ignore[arg-type]
        assert notes is not None
        nixl.arrive("prefill", b"req-2:1")
        assert worker.get_transfer_results() == {"req-1", "req-2"}
        nixl.arrive("prefill", PREFIX + b"reg")
        assert worker.get_transfer_results() == set()
    assert worker.writer.registrations == [PREFIX + b"reg"]  # the writer's, still
    assert notes.late == 0


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
