"""The harness's loopback ports: drawn where no outgoing connection can take them before their server binds."""

from __future__ import annotations

import socket

from harness.loopback import PORT_RANGE, free_port, free_ports


def test_ports_are_drawn_below_the_ephemeral_range_and_never_twice():
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    drawn = free_ports(50) + [free_port() for _ in range(50)]
    assert len(set(drawn)) == 100
    assert all(p in PORT_RANGE and p < ephemeral_low for p in drawn)
    with socket.socket() as s:  # free when handed out
        s.bind(("127.0.0.1", drawn[-1]))
