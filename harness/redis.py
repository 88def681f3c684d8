"""A real `redis-server` (Debian's package) on a free loopback port, for cluster-mode tests and benchmarks.

No persistence: the tests' Redis lives as long as their module. `kill()` and `start()` take it away and bring it
back on the same port (its data gone, as after a Redis restart without persistence).
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time

from harness.loopback import free_port
from harness.processes import Proc


class RedisServer:
    def __init__(self, port: int | None = None, password: str | None = None):
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RuntimeError("redis-server not found: install Debian's redis-server package (.ci/run does)")
        self.port = port or free_port()
        self.password = password
        self.dir = tempfile.mkdtemp(prefix="motor-redis-")
        self.proc: Proc | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def auth(self) -> tuple[bytes, ...]:
        return (b"AUTH", self.password.encode()) if self.password else ()

    def start(self) -> None:
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self.dir,
            *(("--requirepass", self.password) if self.password else ()),
        ]
        self.proc = Proc(args, os.path.join(self.dir, "redis.log"))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.ping():
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited:\n{self.proc.output()}")
            time.sleep(0.05)
        raise RuntimeError(f"redis-server not answering on {self.port}:\n{self.proc.output()}")

    def ping(self) -> bool:
        return self.command(b"PING") in (b"+PONG", b"-NOAUTH Authentication required.")

    def command(self, *parts: bytes) -> bytes:
        """One command in RESP (after AUTH when the server has a password); the first line of its answer (b""
        if none)."""
        msgs = [self.auth, parts] if self.auth and parts[0] != b"PING" else [parts]
        data = b"".join(b"*%d\r\n" % len(m) + b"".join(b"$%d\r\n%b\r\n" % (len(p), p) for p in m) for m in msgs)
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(data)
                time.sleep(0.01)
                return s.recv(65536).split(b"\r\n")[len(msgs) - 1]
        except (OSError, IndexError):
            return b""

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(5)
            self.proc.log.close()
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)
