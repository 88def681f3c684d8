"""Loopback ports and polling: what every test or benchmark that starts a server needs first."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from contextlib import closing

import httpx

# One keep-alive client for the harness's own calls (polls above all): a fresh httpx client sets up TLS, which
# takes 0.05-0.15 s on a loaded 2-core machine, so a poll of three replicas could outlast its deadline by itself.
CLIENT = httpx.Client(timeout=10)


def free_port() -> int:
    """A port of 127.0.0.1 free just now (two calls may return one port: use free_ports for several)."""
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports: the sockets stay bound until all are chosen (free_port() twice in a row may
    give one port twice)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_until(predicate: Callable[[], object], timeout_s: float = 5.0, interval_s: float = 0.05) -> bool:
    """Poll `predicate` until it holds or `timeout_s` passes; its last answer."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()
