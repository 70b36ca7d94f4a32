"""Who used the CPU, moment by moment, while a benchmark ran: a sampler of /proc that charges every process's
CPU time to a named group (the control plane's parts, the node's, the operator, router, rendezvous, the engines,
this benchmark's own client), so a slow request can be set against what else ran while it waited.

A process is charged to the first group whose rule matches its command; one no rule matches is charged to its
parent's group (an engine core under its API server, a shell under the kubelet). The machine's busy time from
/proc/stat is kept too: what no process accounts for (softirq, the network stack) shows as `unattributed`.
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")

Rule = tuple[str, Callable[[str, list[str]], bool]]  # group, (comm, argv) -> matches


def _argv_has(word: str) -> Callable[[str, list[str]], bool]:
    return lambda _comm, argv: any(word in a for a in argv)


def _disagg(command: str) -> Callable[[str, list[str]], bool]:
    """`disagg <command>`, as the CLI entry point or the package's module."""
    def match(_comm: str, argv: list[str]) -> bool:
        for i, a in enumerate(argv[:-1]):
            if (Path(a).name == "disagg" or a in ("disagg.cli", "disagg")) and argv[i + 1] == command:
                return True
        return False
    return match


def _comm(prefix: str) -> Callable[[str, list[str]], bool]:
    return lambda comm, _argv: comm.startswith(prefix)


RULES: tuple[Rule, ...] = (
    ("apiserver", _comm("kube-apiserver")),
    ("etcd", _comm("etcd")),
    ("controller-manager", _comm("kube-controller")),
    ("scheduler", _comm("kube-scheduler")),
    ("kwok", _comm("kwok")),
    ("kubelet", _comm("kubelet")),
    ("containerd-shims", _comm("containerd-shim")),
    ("containerd", _comm("containerd")),
    ("runc", _comm("runc")),
    ("kube-proxy", _comm("kube-proxy")),
    ("iptables", lambda comm, _a: "tables" in comm),
    ("coredns", _comm("coredns")),
    ("operator", _disagg("operator")),
    ("router", _disagg("router")),
    ("rendezvous", _disagg("rendezvous")),
    ("prefill", _argv_has('"kv_producer"')),
    ("decode", _argv_has('"kv_consumer"')),
    ("engine", lambda comm, argv: comm.startswith("VLLM") or any("vllm" in a for a in argv[:3])),
)


def classify(comm: str, argv: list[str]) -> str | None:
    for group, match in RULES:
        if match(comm, argv):
            return group
    return None


@dataclass
class _Proc:
    ppid: int
    cpu: float  # seconds, all its threads
    own: str | None  # its own rule's group


def _read_procs(me: int) -> dict[int, _Proc]:
    out: dict[int, _Proc] = {}
    for d in os.scandir("/proc"):
        if not d.name.isdigit():
            continue
        pid = int(d.name)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:  # gone between the listing and the read
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        ppid, cpu = int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK
        own = "bench-client" if pid == me else "kernel" if not argv[0] and (pid == 2 or ppid == 2) else \
            classify(comm, argv)
        out[pid] = _Proc(ppid, cpu, own)
    return out


def _group(pid: int, procs: dict[int, _Proc]) -> str:
    seen = 0
    while pid in procs and seen < 64:
        p = procs[pid]
        if p.own is not None:
            return p.own
        pid, seen = p.ppid, seen + 1
    return "other"


def _machine_busy() -> float:
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / TICK


@dataclass
class CpuTimeline:
    """Samples every `interval` seconds in a thread of its own, from `start` until `stop`. `rows` holds, per
    interval, its end (time.monotonic, comparable with the benchmark's request times) and the cores each group
    used over it."""

    interval: float = 0.5
    rows: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> CpuTimeline:
        self._thread = threading.Thread(target=self._run, name="cpu-timeline", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        me = os.getpid()
        before, busy_before, t_before = _read_procs(me), _machine_busy(), time.monotonic()
        while not self._stop.wait(self.interval):
            now, busy, t = _read_procs(me), _machine_busy(), time.monotonic()
            span = t - t_before
            used: dict[str, float] = {}
            for pid, p in now.items():
                prev = before.get(pid)
                delta = p.cpu - (prev.cpu if prev is not None else 0.0)
                if delta > 0:
                    g = _group(pid, now)
                    used[g] = used.get(g, 0.0) + delta
            attributed = sum(used.values())
            used["unattributed"] = max(0.0, (busy - busy_before) - attributed)
            self.rows.append((t, {g: round(v / span, 3) for g, v in used.items()}))
            before, busy_before, t_before = now, busy, t

    def groups(self) -> list[str]:
        return sorted({g for _, used in self.rows for g in used})

    def window(self, t0: float, t1: float) -> dict[str, float]:
        """Mean cores per group over the samples whose interval overlaps [t0, t1]."""
        rows = [used for end, used in self.rows if end >= t0 and end - self.interval <= t1]
        if not rows:
            return {}
        return {g: round(sum(r.get(g, 0.0) for r in rows) / len(rows), 3) for g in self.groups()}

    def to_json(self) -> dict:
        groups = self.groups()
        return {"interval_s": self.interval, "groups": groups,
                "rows": [[round(t, 3), *(used.get(g, 0.0) for g in groups)] for t, used in self.rows]}


def tail_attribution(timeline: CpuTimeline, requests: Iterable[tuple[int, float, float]], *, top: int = 5,
                     cell: tuple[float, float] | None = None) -> list[dict]:
    """For the `top` slowest requests, given as (index, sent, ttft seconds): the cores each group used while the
    request waited for its first token, against the cell's whole span (`cell`, else the requests' span), and the
    groups that used the most more than usual then."""
    reqs = sorted(requests, key=lambda r: -r[2])
    if not reqs:
        return []
    span = cell or (min(r[1] for r in reqs), max(r[1] + r[2] for r in reqs))
    usual = timeline.window(*span)
    out = []
    for idx, sent, ttft in reqs[:top]:
        during = timeline.window(sent, sent + ttft)
        excess = sorted(((g, round(during.get(g, 0.0) - usual.get(g, 0.0), 3)) for g in during),
                        key=lambda kv: -kv[1])
        out.append({"idx": idx, "ttft_ms": round(ttft * 1000, 1), "cores_during": during,
                    "most_above_usual": [g for g, v in excess[:3] if v > 0.05]})
    return out
