"""Run the real operator (`disagg operator`) as a child process against the test cluster."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from disagg.devcluster.cluster import die_with_parent, free_port
from support.metrics import scrape


class OperatorProcess:
    def __init__(self, kubeconfig: Path, log: Path, *, resync_seconds: float = 300, extra: list[str] = (),
                 env: dict[str, str] | None = None):
        self.kubeconfig, self.log, self.resync, self.extra = kubeconfig, log, resync_seconds, list(extra)
        self.env = env or {}
        self.proc: subprocess.Popen | None = None
        self.metrics_port = self.health_port = 0

    def start(self, timeout: float = 60) -> OperatorProcess:
        self.metrics_port, self.health_port = free_port(), free_port()
        cmd = [str(Path(sys.executable).parent / "disagg"), "operator", "--metrics-port", str(self.metrics_port),
               "--liveness", f"http://127.0.0.1:{self.health_port}/healthz",
               "--resync-seconds", str(self.resync), *self.extra]
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), **self.env}
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=die_with_parent)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"operator exited with {self.proc.returncode}; log: {self.log}\n{self.tail()}")
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/healthz", timeout=1).status == 200:
                    return self
            except OSError:
                time.sleep(0.1)  # no event to await until the port listens
        raise TimeoutError(f"operator not live after {timeout}s; log: {self.log}\n{self.tail()}")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:]) if self.log.exists() else ""

    def metric(self, name: str, **labels: str) -> float:
        return scrape(f"http://127.0.0.1:{self.metrics_port}/metrics", name, **labels)

    def await_metric(self, name: str, at_least: float, timeout: float = 60, **labels: str) -> float:
        """Metrics can only be polled; poll until the counter reaches `at_least`."""
        deadline = time.monotonic() + timeout
        while (value := self.metric(name, **labels)) < at_least:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name}{labels} stayed at {value} < {at_least}; log:\n{self.tail()}")
            time.sleep(0.2)
        return value

    def await_quiet(self, rounds: int = 1) -> None:
        """Wait for `rounds` complete resync rounds over every CR: afterwards no earlier trigger is in flight."""
        n = self.metric("disagg_operator_resync_rounds_total")
        self.await_metric("disagg_operator_resync_rounds_total", n + rounds + 1)

    def await_log(self, text: str, timeout: float = 60) -> None:
        """The operator's log is a file another process writes: poll it for a line."""
        deadline = time.monotonic() + timeout
        while text not in (self.log.read_text(errors="replace") if self.log.exists() else ""):
            if time.monotonic() > deadline or (self.proc and self.proc.poll() is not None):
                raise TimeoutError(f"{text!r} not in the operator log after {timeout}s:\n{self.tail()}")
            time.sleep(0.2)
