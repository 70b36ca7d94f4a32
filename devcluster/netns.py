"""A network of its own for each local engine, as pods have: a network namespace per engine, joined to the host by
a veth pair on one bridge.

Engines in the host's namespace reach each other over loopback, and their NIXL/UCX moves KV through shared
memory. In a namespace of its own an engine is reached at its own address, and with `UCX_TLS` limited to TCP
(NETNS_UCX_TLS) its KV crosses the veth: bytes that can be counted on the link and, optionally, shaped with `tc`
to a stated bandwidth.

Invariants: every name a Network makes starts with its prefix, so its `teardown()` removes whatever an earlier,
killed run left, and no other network's; an address is a pure function of the slot, so the same slot always
gets the same one.
"""
from __future__ import annotations

import ipaddress
import subprocess
from dataclasses import dataclass
from pathlib import Path

MTU = 9001
"""An AWS VPC's jumbo frame size, the MTU an EFA node's pods see."""
NETNS_UCX_TLS = "tcp,self"
"""UCX transports for an engine in its own namespace. A pod has its own IPC namespace, so pod-to-pod UCX cannot
use shared memory; the shared /dev/shm of local namespaces would let it, and KV would bypass the link."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def _tc(*prefix_and_args: str) -> None:
    subprocess.run([*prefix_and_args], check=True, capture_output=True, text=True)


@dataclass(frozen=True)
class Network:
    """A bridge and the namespaces on it. Two networks with different prefixes and subnets coexist."""

    prefix: str = "dgb"
    subnet: str = "10.231.0.0/24"

    @property
    def bridge(self) -> str:
        return f"{self.prefix}-br0"

    @property
    def gateway(self) -> str:
        """The host's address on the bridge: where namespaced engines reach host services (a rendezvous)."""
        return str(ipaddress.ip_network(self.subnet)[1])

    def slot(self, index: int) -> Slot:
        return Slot(self, index)

    def setup(self, count: int, rate_mbit: float | None = None) -> list[Slot]:
        """`count` fresh namespaces on a fresh bridge. With `rate_mbit`, each link is shaped in both directions
        to that rate with a token bucket (`tc tbf`)."""
        self.teardown()
        prefixlen = str(ipaddress.ip_network(self.subnet).prefixlen)
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "mtu", str(MTU))
        _ip("addr", "add", f"{self.gateway}/{prefixlen}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        slots = [self.slot(i) for i in range(count)]
        for s in slots:
            _ip("netns", "add", s.netns)
            _ip("link", "add", s.host_veth, "mtu", str(MTU), "type", "veth", "peer", "name", "eth0", "mtu",
                str(MTU), "netns", s.netns)
            _ip("link", "set", s.host_veth, "master", self.bridge, "up")
            ns = ["-n", s.netns]
            _ip(*ns, "addr", "add", f"{s.address}/{prefixlen}", "dev", "eth0")
            _ip(*ns, "link", "set", "lo", "up")
            _ip(*ns, "link", "set", "eth0", "up")
            _ip(*ns, "route", "add", "default", "via", self.gateway)
            if rate_mbit:
                burst = str(max(int(rate_mbit * 125), MTU * 4))  # bytes: 1 ms at the rate, at least 4 frames
                shape = ["root", "tbf", "rate", f"{rate_mbit}mbit", "burst", burst, "latency", "50ms"]
                _tc("tc", "qdisc", "add", "dev", s.host_veth, *shape)
                _tc(*s.exec_prefix(), "tc", "qdisc", "add", "dev", "eth0", *shape)
        return slots

    def teardown(self) -> None:
        """Remove every namespace and the bridge of this network (deleting a namespace deletes its veth)."""
        for line in _ip("netns", "list", check=False).stdout.splitlines():
            name = line.split(" ")[0]
            if name.startswith(f"{self.prefix}-"):
                _ip("netns", "delete", name, check=False)
        _ip("link", "delete", self.bridge, check=False)


@dataclass(frozen=True)
class Slot:
    """One engine's namespace: its name, its address and the host end of its veth."""

    network: Network
    index: int

    @property
    def netns(self) -> str:
        return f"{self.network.prefix}-ns{self.index}"

    @property
    def address(self) -> str:
        return str(ipaddress.ip_network(self.network.subnet)[10 + self.index])

    @property
    def host_veth(self) -> str:
        return f"{self.network.prefix}-h{self.index}"

    def exec_prefix(self) -> list[str]:
        """Prefix for a command line that runs the command inside this namespace (`ip netns exec` execs in place,
        so the process started is the command itself)."""
        return ["ip", "netns", "exec", self.netns]

    def bytes_sent_received(self) -> tuple[int, int]:
        """Bytes this namespace has sent and received over its link, from the host end's counters (the host end
        receives what the namespace sends)."""
        stats = Path("/sys/class/net") / self.host_veth / "statistics"
        return int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())
