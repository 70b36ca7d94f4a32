"""devcluster's free_port: a port the kernel will not also hand to an outgoing connection, never the same twice."""
from __future__ import annotations

import socket

from disagg.devcluster.cluster import LISTEN_PORTS, free_port


def ephemeral_range() -> range:
    lo, hi = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    return range(lo, hi + 1)


def test_ports_are_outside_the_ephemeral_range_distinct_and_bindable():
    assert not set(LISTEN_PORTS) & set(ephemeral_range())
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(p in LISTEN_PORTS for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))


def test_a_port_something_listens_on_is_skipped(monkeypatch):
    from disagg.devcluster import cluster

    monkeypatch.setattr(cluster.random, "randrange", lambda _n: 0)  # look from the first port on
    taken = []
    try:
        for port in LISTEN_PORTS[:50]:
            s = socket.socket()
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                s.close()
                continue
            s.listen()
            taken.append(s)
        held = {s.getsockname()[1] for s in taken}
        assert held, "nothing to hold: the first ports are all in use"
        got = free_port()
        assert got not in held and got > min(held)
    finally:
        for s in taken:
            s.close()
