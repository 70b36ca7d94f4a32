"""A local child process that serves HTTP, writes to its own log file and dies with us: `disagg rendezvous`,
`disagg router`, vllm-router or a stub engine, for the benchmarks, the demo and the engine tests.

vLLM engines are `engines.LocalEngine` instead: they fork processes of their own and need the supervisor.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from .cluster import Process, free_port


def disagg_exe() -> str:
    """The `disagg` command of the running interpreter's environment."""
    return str(Path(sys.executable).parent / "disagg")


def process_group(pgid: int) -> list[int]:
    """The live processes of process group `pgid`, leader first (from /proc: no helper process needed)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited while we looked
            continue
        # Fields after the command name, which may itself hold spaces and parentheses: state ppid pgrp ...
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return sorted(members, key=lambda pid: (pid != pgid, pid))


def children(pid: int) -> list[int]:
    """Direct children of `pid` (every thread's list: a child may have been forked from any thread)."""
    out: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            out += [int(c) for c in (task / "children").read_text().split()]
    except OSError:
        pass
    return sorted(set(out))


def thread_cpu_seconds(pids: list[int]) -> dict[tuple[int, int], tuple[str, float]]:
    """CPU-seconds (user + system) so far of every thread of `pids`, by (pid, tid), with the thread's name. A
    thread or process that exits while this reads is left out."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[tuple[int, int], tuple[str, float]] = {}
    for pid in pids:
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                stat = (task / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()  # state ppid ... utime(11) stime(12), as in process_group
            out[(pid, int(task.name))] = (stat[stat.index("(") + 1:stat.rindex(")")],
                                          (int(fields[11]) + int(fields[12])) / tick)
    return out


def thread_cores(before: dict[tuple[int, int], tuple[str, float]], after: dict[tuple[int, int], tuple[str, float]],
                 elapsed: float) -> dict[tuple[int, int], tuple[str, float]]:
    """Cores each thread used between two `thread_cpu_seconds` readings `elapsed` seconds apart, by (pid, tid).
    A thread started in between counts all of its CPU; one that ended in between is left out."""
    return {key: (name, (seconds - before.get(key, (name, 0.0))[1]) / elapsed)
            for key, (name, seconds) in after.items()}


def py_spy() -> str | None:
    """The py-spy command of this environment (the test extra installs it), or one on PATH."""
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


def stack_dump(pids: list[int], timeout: float = 30) -> str:
    """Every thread's Python stack in each of `pids` (`py-spy dump`), one section per process. Never raises: a
    process that cannot be dumped gets a line saying why instead."""
    exe = py_spy()
    if exe is None:
        return "(no stack dump: py-spy is not installed; it comes with the test extra)"
    sections = []
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            cmdline = "?"
        try:
            r = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=timeout)
            body = (r.stdout + r.stderr).strip() or f"(py-spy exited {r.returncode} with no output)"
        except (OSError, subprocess.TimeoutExpired) as e:
            body = f"(py-spy failed: {e})"
        sections.append(f"--- pid {pid}: {' '.join(cmdline.split())[:200]}\n{body}")
    return "\n".join(sections)


class ChildFailed(RuntimeError):
    """A child exited, or did not answer in time; the message names it and its log."""


@dataclass
class HttpChild(Process):
    """`start()`, `stop(grace)` (process group: SIGTERM, then SIGKILL) and `exited()` come from the control plane's
    Process."""

    # / keeps a checkout off sys.path (its operator/ folder must never meet the stdlib's).
    cwd: str | None = "/"

    def check(self) -> None:
        if self.popen is None or self.popen.poll() is not None:
            raise ChildFailed(f"{self.name} exited; log {self.log}\n{self.tail()}")

    def wait_http(self, url: str, timeout: float = 60, ok: Collection[int] | None = (200,)) -> HttpChild:
        """Poll `url` until it answers a status in `ok` (None: any status at all)."""
        deadline = time.monotonic() + timeout
        last: int | str | None = None
        while time.monotonic() < deadline:
            self.check()
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    last = r.status
            except urllib.error.HTTPError as e:
                last = e.code
            except OSError as e:
                last = repr(e)
            if isinstance(last, int) and (ok is None or last in ok):
                return self
            time.sleep(0.2)  # another process's port: there is nothing to await
        raise ChildFailed(f"{self.name}: {url} not ready after {timeout:g}s ({last}); log {self.log}\n{self.tail()}")

    def kill(self) -> None:
        """No grace: a peer that vanishes, for the tests that need one."""
        if self.popen is not None and self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait()

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:]) if self.log.exists() else ""


class DisaggService(HttpChild):
    """`disagg <args>` (a rendezvous or a router) on `host` (127.0.0.1 unless engines in namespaces of their own
    must reach it), at `port` or a free one; it keeps the port across restarts, so peers find it again."""

    def __init__(self, name: str, args: list[str], log_dir: Path, port: int | None = None, host: str = "127.0.0.1"):
        self.port, self.host = port or free_port(), host
        super().__init__(name, [disagg_exe(), *args, "--host", host, "--port", str(self.port)],
                         log_dir / f"{name}.log")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"
