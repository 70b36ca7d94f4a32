"""What a real node changes on the host, captured before it starts and put back when it stops.

A node changes sysctls (the kubelet sets kernel.panic, panic_on_oops and vm.overcommit_memory; kube-proxy
route_localnet; pods need ip_forward), iptables (kube-proxy's and the kubelet's chains, CNI's NAT chains), the
`cni0` bridge, the kubepods cgroups, mounts (pod network namespaces, container root filesystems, the kubelet's
own bind mount), the pod sandboxes' named network namespaces and a few fixed paths. The snapshot is written to
disk before anything changes, so a run that was killed is restored by the next one (`recover`).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

SYSCTLS = ("net.ipv4.ip_forward", "kernel.panic", "kernel.panic_on_oops", "vm.overcommit_memory",
           "net.ipv4.conf.all.route_localnet")
# Paths outside the node's directory that the kubelet, containerd or CNI create whatever they are told.
FIXED_PATHS = ("/var/lib/kubelet", "/var/log/containers", "/var/log/pods", "/run/containerd", "/run/netns",
               "/var/run/netns", "/var/lib/cni", "/etc/cni", "/opt/cni")
CGROUP_ROOT = Path("/sys/fs/cgroup")
NETNS_DIR = "/var/run/netns"
POD_NETNS_PREFIX = "cni-"
"""containerd's name for a pod sandbox's network namespace."""
IPTABLES = (("iptables-save", "iptables-restore", "iptables"), ("ip6tables-save", "ip6tables-restore", "ip6tables"))
TABLES = ("filter", "nat", "mangle", "raw")


def _sysctl_path(name: str) -> Path:
    return Path("/proc/sys") / name.replace(".", "/")


def read_sysctl(name: str) -> str:
    return _sysctl_path(name).read_text().strip()


def write_sysctl(name: str, value: str) -> None:
    _sysctl_path(name).write_text(value + "\n")


def _run(argv: list[str], stdin: str | None = None) -> str:
    return subprocess.run(argv, input=stdin, capture_output=True, text=True, check=True).stdout


def _cgroup_dirs() -> list[Path]:
    """kubepods under every cgroup v1 controller and the unified hierarchy."""
    return [d / "kubepods" for d in CGROUP_ROOT.iterdir() if d.is_dir() and not d.is_symlink()] + \
        [CGROUP_ROOT / "kubepods"]


@dataclass
class HostSnapshot:
    node_dir: str
    sysctls: dict[str, str] = field(default_factory=dict)
    iptables: dict[str, str] = field(default_factory=dict)  # save command -> its output
    absent_paths: list[str] = field(default_factory=list)
    had_cni0: bool = False
    absent_cgroups: list[str] = field(default_factory=list)

    @classmethod
    def capture(cls, node_dir: Path) -> HostSnapshot:
        return cls(
            node_dir=str(node_dir),
            sysctls={s: read_sysctl(s) for s in SYSCTLS},
            iptables={save: _run([save]) for save, _, _ in IPTABLES if shutil.which(save)},
            absent_paths=[p for p in FIXED_PATHS if not os.path.lexists(p)],
            had_cni0=Path("/sys/class/net/cni0").exists(),
            absent_cgroups=[str(d) for d in _cgroup_dirs() if not d.exists()],
        )

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> HostSnapshot:
        return cls(**json.loads(path.read_text()))

    def restore(self) -> list[str]:
        """Put everything back; return what could not be (each a line naming the setting and the error)."""
        problems: list[str] = []
        kill_pod_processes(self.absent_cgroups)
        problems += remove_netns(POD_NETNS_PREFIX)
        roots = [self.node_dir, *self.absent_paths]
        for target in mounts_under(roots):
            r = subprocess.run(["umount", "-l", target], capture_output=True, text=True)
            if r.returncode != 0 and Path(target).exists():
                problems.append(f"umount {target}: {r.stderr.strip()}")
        for save, restore, binary in IPTABLES:
            if save in self.iptables:
                problems += _restore_iptables(self.iptables[save], restore, binary)
        if not self.had_cni0 and Path("/sys/class/net/cni0").exists():
            r = subprocess.run(["ip", "link", "delete", "cni0"], capture_output=True, text=True)
            if r.returncode != 0:
                problems.append(f"ip link delete cni0: {r.stderr.strip()}")
        for cg in self.absent_cgroups:
            problems += _remove_cgroup_tree(Path(cg))
        for p in self.absent_paths:
            if os.path.lexists(p):
                shutil.rmtree(p, ignore_errors=True)
                if os.path.lexists(p):
                    problems.append(f"remove {p}: still present")
        for name, value in self.sysctls.items():
            try:
                if read_sysctl(name) != value:
                    write_sysctl(name, value)
            except OSError as e:
                problems.append(f"sysctl {name}={value}: {e}")
        return problems


def _restore_iptables(saved: str, restore: str, binary: str) -> list[str]:
    """Tables in the snapshot are replaced whole by it; tables the node created are flushed and their chains
    deleted (iptables-restore touches only the tables its input names)."""
    present = {line[1:].strip() for line in saved.splitlines() if line.startswith("*")}
    problems = []
    r = subprocess.run([restore], input=saved, capture_output=True, text=True)
    if r.returncode != 0:
        problems.append(f"{restore}: {r.stderr.strip()}")
    for table in TABLES:
        if table in present:
            continue
        for argv in ([binary, "-t", table, "-F"], [binary, "-t", table, "-X"]):
            subprocess.run(argv, capture_output=True, text=True)  # absent table: nothing to undo
    return problems


def iptables_rules(dump: str) -> dict[str, list[str]]:
    """What an iptables-save dump filters and rewrites, per table: its chains (with policies) and rules, without
    timestamps and packet counters. A table with only built-in chains, every policy ACCEPT and no rule does
    nothing, so it is left out: the same as no table. (iptables-nft cannot delete a table the node created,
    only empty it, so a host that had no tables before the node has empty ones after.)"""
    tables: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in dump.splitlines():
        if line.startswith("*"):
            current = tables.setdefault(line[1:].strip(), [])
        elif current is not None and line and not line.startswith("#") and line != "COMMIT":
            current.append(line.split(" [")[0])
    return {t: lines for t, lines in tables.items()
            if not all(line.startswith(":") and line.endswith(" ACCEPT") for line in lines)}


def mounts_under(roots: list[str]) -> list[str]:
    """Mount points at or below any of `roots`, deepest (latest) first, as umount needs them."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        target = line.split()[4].replace("\\040", " ")
        if any(target == r or target.startswith(r.rstrip("/") + "/") for r in roots):
            out.append(target)
    return list(reversed(out))


def remove_netns(prefix: str) -> list[str]:
    """Delete every named network namespace whose name starts with `prefix`; what could not be deleted. The pod
    sandboxes' namespaces (POD_NETNS_PREFIX) outlive a kubelet and containerd that are stopped rather than told to
    tear their pods down, and nothing else removes them; one real node runs per host, so once its pods are killed
    none is in use."""
    problems = []
    for name in sorted(os.listdir(NETNS_DIR)) if os.path.isdir(NETNS_DIR) else []:
        if name.startswith(prefix):
            r = subprocess.run(["ip", "netns", "delete", name], capture_output=True, text=True)
            if r.returncode != 0:
                problems.append(f"ip netns delete {name}: {r.stderr.strip()}")
    return problems


def kill_pod_processes(cgroups: list[str]) -> None:
    """SIGKILL every process in the given cgroup trees: containers the kubelet left when it was killed."""
    for cg in cgroups:
        # os.walk, not Path.rglob: containers exiting meanwhile remove their cgroup directories under the walk,
        # which rglob raises on (FileNotFoundError) and os.walk skips.
        for directory, _dirs, files in os.walk(cg):
            if "cgroup.procs" not in files:
                continue
            try:
                pids = (Path(directory) / "cgroup.procs").read_text().split()
            except OSError:
                continue
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _remove_cgroup_tree(root: Path) -> list[str]:
    if not root.exists():
        return []
    dirs = [Path(d) for d, _subdirs, _files in os.walk(root, topdown=False)]  # deepest first; root last
    for d in dirs:
        try:
            d.rmdir()
        except OSError:
            pass
    return [f"cgroup {root}: still present (processes left in it?)"] if root.exists() else []


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains `text`: the containerd shims of a node directory (they
    daemonize, so no parent's death reaches them)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if text.encode() in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids
