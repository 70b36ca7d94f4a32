"""devcluster/netns.py on this host's kernel: namespaces joined by a bridge, traffic counted on each link."""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from disagg.devcluster.netns import Network

PAYLOAD = 1 << 20
SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 0)); s.listen(1); print(s.getsockname()[1], flush=True)
c, _ = s.accept(); n = 0
while (b := c.recv(65536)):
    n += len(b)
print(n, flush=True)
"""
CLIENT = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10) as c:
    c.sendall(b"x" * int(sys.argv[3]))
"""


@pytest.fixture
def network():
    net = Network(prefix="dgt", subnet="10.232.0.0/24")
    yield net
    net.teardown()


def in_ns(slot, code: str, *args: str, **kw) -> subprocess.Popen[str]:
    return subprocess.Popen([*slot.exec_prefix(), sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                            text=True, **kw)


def test_traffic_between_namespaces_crosses_and_is_counted_on_their_links(network):
    a, b = network.setup(2)
    sent0, received0 = a.bytes_sent_received()[0], b.bytes_sent_received()[1]
    server = in_ns(b, SERVER, b.address)
    port = server.stdout.readline().strip()
    client = in_ns(a, CLIENT, b.address, port, str(PAYLOAD))
    assert client.wait(timeout=30) == 0
    assert int(server.stdout.readline()) == PAYLOAD
    server.wait(timeout=10)
    assert a.bytes_sent_received()[0] - sent0 >= PAYLOAD
    assert b.bytes_sent_received()[1] - received0 >= PAYLOAD


def test_a_namespace_reaches_the_host_at_the_gateway_and_not_its_loopback(network):
    (a,) = network.setup(1)
    probe = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)"
    with socket.socket() as host:
        host.bind((network.gateway, 0))
        host.listen(1)
        port = str(host.getsockname()[1])
        assert in_ns(a, probe, network.gateway, port).wait(timeout=30) == 0
        refused = in_ns(a, probe, "127.0.0.1", port, stderr=subprocess.PIPE)
        assert refused.wait(timeout=30) != 0
        assert "ConnectionRefusedError" in refused.stderr.read()


def test_shaped_links_carry_a_token_bucket_on_both_ends(network):
    (a,) = network.setup(1, rate_mbit=80)
    host_end = subprocess.run(["tc", "qdisc", "show", "dev", a.host_veth], capture_output=True, text=True).stdout
    ns_end = subprocess.run([*a.exec_prefix(), "tc", "qdisc", "show", "dev", "eth0"], capture_output=True,
                            text=True).stdout
    for out in (host_end, ns_end):
        assert "tbf" in out and "rate 80Mbit" in out


def test_teardown_removes_only_its_own_network(network):
    other = Network(prefix="dgu", subnet="10.233.0.0/24")
    try:
        network.setup(1)
        (kept,) = other.setup(1)
        network.teardown()
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert "dgt-ns0" not in listed and kept.netns in listed
        assert subprocess.run(["ip", "link", "show", network.bridge], capture_output=True).returncode != 0
        assert subprocess.run(["ip", "link", "show", other.bridge], capture_output=True).returncode == 0
    finally:
        other.teardown()
