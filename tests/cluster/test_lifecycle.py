"""The cluster fixture's promises: failures name the component and its log; no process outlives its owner."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from disagg.devcluster import build
from disagg.devcluster.cluster import ClusterConfig, ComponentFailed, LocalCluster
from disagg.devcluster.fleet import FleetSpec

pytestmark = pytest.mark.cluster


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.split(") ", 1)[1][0] != "Z"  # a zombie has already exited


def _await_gone(pids: list[int], timeout: float = 30) -> list[int]:
    deadline = time.monotonic() + timeout
    while (alive := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)  # polling /proc: there is no event to await for another process's death
    return alive


def test_startup_failure_names_component_and_log(tmp_path):
    build.ensure_built(quiet=True)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        c = LocalCluster(ClusterConfig(name="fail", state_dir=tmp_path / "c", etcd_port=port,
                                       fleet=FleetSpec({}), startup_timeout=60))
        with pytest.raises(ComponentFailed) as err:
            c.start()
    assert err.value.component == "etcd"
    assert str(err.value).startswith("etcd failed to start: exited with code")
    assert str(err.value.log) in str(err.value)
    assert "address already in use" in err.value.log.read_text()
    assert c.processes == []


CHILD = """
import json, sys
from pathlib import Path
from disagg.devcluster.cluster import ClusterConfig, LocalCluster
from disagg.devcluster.fleet import FleetSpec
c = LocalCluster(ClusterConfig(name="orphan", state_dir=Path(sys.argv[1]), fleet=FleetSpec({"m7i.4xlarge": 1})))
c.start()
print(json.dumps(c.pids), flush=True)
sys.stdin.read()
"""


def test_no_process_outlives_a_killed_owner(tmp_path):
    """SIGKILL gives the owner no chance to clean up; the kernel's parent-death signal must do it."""
    build.ensure_built(quiet=True)
    owner = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / "c")], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(owner.stdout.readline())
        assert len(pids) == 5 and all(_alive(p) for p in pids)
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    assert _await_gone(pids) == []


def test_stop_ends_every_component(tmp_path):
    build.ensure_built(quiet=True)
    c = LocalCluster(ClusterConfig(name="stop", state_dir=tmp_path / "c", fleet=FleetSpec({"m7i.4xlarge": 1})))
    c.start()
    pids = c.pids
    assert len(pids) == 5
    c.stop()
    assert _await_gone(pids, timeout=1) == []
    assert not any(_alive(p) for p in pids)
    os.sync()
