"""LocalEngine with a real process tree: a missed start-up deadline explains itself, and stopping is prompt.

The hanging engine is a real process tree, not vLLM: `HangingEngine` runs a Python program in place of vLLM's
API server that forks a child (as vLLM forks its engine core) and never opens its port. Everything else is
LocalEngine's own code: the supervisor, the readiness poll, the deadline and the stack dump.
"""
from __future__ import annotations

import re
import socket
import sys
import time
from pathlib import Path

import pytest

from disagg.devcluster.engines import EngineFailed, EngineSpec, LocalEngine
from disagg.devcluster.procs import py_spy

HANG = """
import os, socket, sys, threading, time

def side_channel_listener(port):
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # already taken: the thread dies, as vLLM's listener did

threading.Thread(target=side_channel_listener, args=(int(sys.argv[1]),), name="listener").start()
time.sleep(0.5)
for _ in range(50):
    print("retrying the rendezvous in 2.00s", flush=True)

def engine_core_never_ready():
    while True:
        time.sleep(0.05)

def api_server_waits_for_engine_core(child):
    os.waitpid(child, 0)

child = os.fork()
if child == 0:
    engine_core_never_ready()
else:
    api_server_waits_for_engine_core(child)
"""


class HangingEngine(LocalEngine):
    """A fake engine: a two-process tree that never serves, whose listener thread dies on a port the test holds
    (named as the fake it is)."""

    def command(self) -> list[str]:
        self.taken = socket.socket()  # held by the test for the engine's lifetime
        self.taken.bind(("127.0.0.1", 0))
        return [sys.executable, "-c", HANG, str(self.taken.getsockname()[1])]


@pytest.fixture
def engine(tmp_path):
    e = HangingEngine(EngineSpec("hangs", None, Path("/nonexistent-model"), core=0), Path(sys.executable), tmp_path)
    yield e
    e.stop()


def test_py_spy_comes_with_the_test_extra():
    assert py_spy() is not None


def test_missed_deadline_reports_every_process_stack(engine):
    engine.start()
    t0 = time.monotonic()
    with pytest.raises(EngineFailed) as failed:
        engine.wait_ready(timeout=2)
    assert time.monotonic() - t0 < 2 + 30, "the dump must not take much longer than the deadline it explains"
    head, _, stacks = str(failed.value).partition("Python stacks of its processes (py-spy dump):")
    assert "engine hangs not healthy after 2s" in head and f"log: {engine.log}" in head
    # The tail is all retries; the thread that died on its port is still named.
    errors = head.partition("Errors in its log:")[2]
    assert "Exception in thread listener" in errors and "Address already in use" in errors
    pids = engine.processes()
    assert len(pids) == 2, "the API-server stand-in and its forked child"
    # One section per process, leader first, each with that process's Python stack.
    assert [int(p) for p in re.findall(r"^--- pid (\d+):", stacks, re.M)] == pids
    leader, child = stacks.split(f"--- pid {pids[1]}:")
    frame = "{} (<string>:"  # py-spy's frame line: function (file:line)
    assert frame.format("api_server_waits_for_engine_core") in leader
    assert frame.format("engine_core_never_ready") not in leader
    assert frame.format("engine_core_never_ready") in child


def test_an_engine_that_is_gone_has_no_stacks(engine):
    engine.start()
    engine.stop()
    assert engine.processes() == [] and engine.stacks() == "(no engine processes left)"


def test_stopping_takes_as_long_as_the_processes_take_to_exit(engine):
    """The supervisor used to wait inside its SIGTERM handler, where it could never reap the child, so every stop
    took the full 15 s grace even when the engine had exited at once."""
    engine.start()
    deadline = time.monotonic() + 10
    while len(pids := engine.processes()) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)  # the supervisor's children appear in /proc: nothing to await but polling
    assert len(pids) == 2
    t0 = time.monotonic()
    engine.stop()
    assert time.monotonic() - t0 < 5
    assert engine.proc.returncode == 128 + 15  # the supervisor exits as if killed by the SIGTERM it got
    assert not [pid for pid in pids if alive(pid)], "the whole process group is gone"


def alive(pid: int) -> bool:
    """Running, not a zombie: a group member orphaned by its leader is reaped by init, in init's own time."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def test_engines_made_before_either_binds_get_distinct_ports(tmp_path):
    """A pair picks all its ports before either engine binds one: no port may serve two purposes."""
    specs = [EngineSpec(name=f"e{i}", model=tmp_path, role="prefill", core=0, kv_events=True) for i in range(40)]
    engines = [LocalEngine(spec, Path(sys.executable), tmp_path) for spec in specs]
    ports = [p for e in engines for p in (e.spec.port, e.spec.side_channel_port, *e.spec.kv_events_ports)]
    assert len(set(ports)) == len(ports) == 160
