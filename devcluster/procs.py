"""A local child process that serves HTTP, writes to its own log file and dies with us: `disagg rendezvous`,
`disagg router`, vllm-router or a stub engine, for the benchmarks, the demo and the engine tests.

vLLM engines are `engines.LocalEngine` instead: they fork processes of their own and need the supervisor.
"""
from __future__ import annotations

import os
import signal
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Collection

from .cluster import Process, free_port


def disagg_exe() -> str:
    """The `disagg` command of the running interpreter's environment."""
    return str(Path(sys.executable).parent / "disagg")


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

    def wait_http(self, url: str, timeout: float = 60, ok: Collection[int] | None = (200,)) -> "HttpChild":
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
    """`disagg <args>` (a rendezvous or a router) on 127.0.0.1, at `port` or a free one; it keeps the port across
    restarts, so peers find it again."""

    def __init__(self, name: str, args: list[str], log_dir: Path, port: int | None = None):
        self.port = port or free_port()
        super().__init__(name, [disagg_exe(), *args, "--host", "127.0.0.1", "--port", str(self.port)],
                         log_dir / f"{name}.log")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"
