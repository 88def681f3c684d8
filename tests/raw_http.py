"""HTTP/1.1 as bytes on a loopback socket, for tests where the bytes matter: framing, slow clients, floods."""

from __future__ import annotations

import re
import socket
import time


def connect(port: int, timeout_s: float = 5.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout_s)


def read_until_closed(s: socket.socket, timeout_s: float = 5.0) -> tuple[bytes, bool]:
    """Everything the server sends until it closes (True) or is silent for `timeout_s` (False)."""
    s.settimeout(timeout_s)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except TimeoutError:
        return out, False
    except ConnectionResetError:
        pass
    return out, True


def exchange(port: int, data: bytes, timeout_s: float = 5.0) -> tuple[bytes, bool, float]:
    """Send `data` at once: the answer, whether the server closed the connection, and how long that took."""
    with connect(port) as s:
        start = time.monotonic()
        s.sendall(data)
        out, closed = read_until_closed(s, timeout_s)
        return out, closed, time.monotonic() - start


def statuses(answer: bytes) -> list[bytes]:
    """The status of each response in `answer` (a pipelined one starts right after the body before it)."""
    return re.findall(rb"HTTP/1\.1 (\d{3}) ", answer)
