"""Loopback ports and polling: what every test or benchmark that starts a server needs first."""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Callable

import httpx

# One keep-alive client for the harness's own calls (polls above all): a fresh httpx client sets up TLS, which
# takes 0.05-0.15 s on a loaded 2-core machine, so a poll of three replicas could outlast its deadline by itself.
CLIENT = httpx.Client(timeout=10)


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# Ports are drawn below the kernel's ephemeral range: a port from bind(0) is one the kernel may give the next
# outgoing connection of any process before the server that was handed it binds it (CI lost a run to that).
# Those handed out are not handed out again by this process, whose servers may still be starting.
PORT_RANGE = range(10_000, _ephemeral_low())
_handed_out: set[int] = set()
_draw = random.Random()


def _bindable(port: int) -> socket.socket | None:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("127.0.0.1", port))
        return s
    except OSError:
        s.close()
        return None


def free_port() -> int:
    """A port of 127.0.0.1 free just now, not handed out before by this process."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """`n` distinct ports of 127.0.0.1 free just now, outside the ephemeral range when it leaves room."""
    if len(PORT_RANGE) < 1024:  # a kernel whose ephemeral range starts low: the kernel's choice it is
        socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
        try:
            for s in socks:
                s.bind(("127.0.0.1", 0))
            return [s.getsockname()[1] for s in socks]
        finally:
            for s in socks:
                s.close()
    if len(_handed_out) > len(PORT_RANGE) // 2:
        _handed_out.clear()
    chosen: list[socket.socket] = []
    try:
        while len(chosen) < n:
            port = _draw.choice(PORT_RANGE)
            if port in _handed_out:
                continue
            _handed_out.add(port)
            s = _bindable(port)
            if s is not None:
                chosen.append(s)
        return [s.getsockname()[1] for s in chosen]
    finally:
        for s in chosen:
            s.close()


def wait_until(predicate: Callable[[], object], timeout_s: float = 5.0, interval_s: float = 0.05) -> bool:
    """Poll `predicate` until it holds or `timeout_s` passes; its last answer."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()
