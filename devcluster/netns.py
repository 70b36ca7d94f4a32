"""A network of its own for each local engine, as pods have: a network namespace per engine, joined to the host by
a veth pair on one bridge.

Engines in the host's namespace reach each other over loopback, and their NIXL/UCX moves KV through shared
memory. In a namespace of its own an engine is reached at its own address, and with `UCX_TLS` limited to TCP
(NETNS_UCX_TLS) its KV crosses the veth: bytes that can be counted on the link and, optionally, shaped with `tc`
to a stated bandwidth.

Invariants: every name this module makes starts with PREFIX, so `teardown()` removes whatever an earlier,
killed run left; an address is a pure function of the engine's slot, so the same slot always gets the same one.
"""
from __future__ import annotations

import ipaddress
import subprocess
from dataclasses import dataclass
from pathlib import Path

PREFIX = "dgb"
BRIDGE = f"{PREFIX}-br0"
SUBNET = ipaddress.ip_network("10.231.0.0/24")
GATEWAY = str(SUBNET[1])
MTU = 9001
"""An AWS VPC's jumbo frame size, the MTU an EFA node's pods see."""
NETNS_UCX_TLS = "tcp,self"
"""UCX transports for an engine in its own namespace. A pod has its own IPC namespace, so pod-to-pod UCX cannot
use shared memory; the shared /dev/shm of local namespaces would let it, and KV would bypass the link."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def _tc(*args: str) -> None:
    subprocess.run(["tc", *args], check=True, capture_output=True, text=True)


@dataclass(frozen=True)
class Slot:
    """One engine's namespace: its name, its address and the host end of its veth."""

    index: int

    @property
    def netns(self) -> str:
        return f"{PREFIX}-ns{self.index}"

    @property
    def address(self) -> str:
        return str(SUBNET[10 + self.index])

    @property
    def host_veth(self) -> str:
        return f"{PREFIX}-h{self.index}"

    def exec_prefix(self) -> list[str]:
        """Prefix for a command line that runs the command inside this namespace (`ip netns exec` execs in place,
        so the process started is the command itself)."""
        return ["ip", "netns", "exec", self.netns]

    def bytes_sent_received(self) -> tuple[int, int]:
        """Bytes this namespace has sent and received over its link, from the host end's counters."""
        stats = Path("/sys/class/net") / self.host_veth / "statistics"
        # The host end receives what the namespace sends.
        return int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())


def setup(count: int, rate_mbit: float | None = None) -> list[Slot]:
    """`count` fresh namespaces on the bridge (made first if missing). With `rate_mbit`, each link is shaped in
    both directions to that rate with a token bucket (`tc tbf`)."""
    teardown()
    _ip("link", "add", BRIDGE, "type", "bridge")
    _ip("link", "set", BRIDGE, "mtu", str(MTU))
    _ip("addr", "add", f"{GATEWAY}/{SUBNET.prefixlen}", "dev", BRIDGE)
    _ip("link", "set", BRIDGE, "up")
    slots = [Slot(i) for i in range(count)]
    for s in slots:
        _ip("netns", "add", s.netns)
        _ip("link", "add", s.host_veth, "mtu", str(MTU), "type", "veth", "peer", "name", "eth0", "mtu", str(MTU),
            "netns", s.netns)
        _ip("link", "set", s.host_veth, "master", BRIDGE, "up")
        ns = ["-n", s.netns]
        _ip(*ns, "addr", "add", f"{s.address}/{SUBNET.prefixlen}", "dev", "eth0")
        _ip(*ns, "link", "set", "lo", "up")
        _ip(*ns, "link", "set", "eth0", "up")
        _ip(*ns, "route", "add", "default", "via", GATEWAY)
        if rate_mbit:
            shape = ["root", "tbf", "rate", f"{rate_mbit}mbit", "burst", f"{max(int(rate_mbit * 125), MTU * 4)}",
                     "latency", "50ms"]
            _tc("qdisc", "add", "dev", s.host_veth, *shape)
            subprocess.run(["ip", "netns", "exec", s.netns, "tc", "qdisc", "add", "dev", "eth0", *shape],
                           check=True, capture_output=True, text=True)
    return slots


def teardown() -> None:
    """Remove every namespace and the bridge this module made (deleting a namespace deletes its veth)."""
    for name in _ip("netns", "list", check=False).stdout.split("\n"):
        if name.split(" ")[0].startswith(f"{PREFIX}-"):
            _ip("netns", "delete", name.split(" ")[0], check=False)
    _ip("link", "delete", BRIDGE, check=False)
