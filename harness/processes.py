"""Child processes on this machine: started in their own session with their output in a log file, stopped
with SIGTERM and then SIGKILL of their process group; and the /proc reading that finds a process's
descendants and tells Sanic's server workers among them."""

from __future__ import annotations

import os
import signal
import subprocess

from harness import ROOT


class Proc(subprocess.Popen):
    """A child process in its own session (a SIGKILL of its group takes its workers too), stdout and stderr
    written to `log_path`."""

    def __init__(self, args: list[str], log_path: str, env: dict | None = None, cwd: str = ROOT):
        self.log_path = log_path
        self.log = open(log_path, "wb")  # noqa: SIM115 (closed by stop())
        super().__init__(
            args,
            cwd=cwd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )

    def output(self) -> str:
        """All the process has written so far, also after stop() (the child writes the log through its own
        descriptor: this process has nothing buffered to flush)."""
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM, and SIGKILL of the whole group when it has not exited within `timeout_s`; its exit code."""
        if self.poll() is None:
            self.send_signal(signal.SIGTERM)
            try:
                self.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.pid, signal.SIGKILL)
                self.wait(5)
        self.log.close()
        return self.returncode


def parents() -> dict[int, int]:
    """pid -> parent pid of every live process."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    out[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    return out


def children(pid: int) -> list[int]:
    """The live processes whose parent is `pid`."""
    return [child for child, parent in parents().items() if parent == pid]


def tree(root: int) -> list[int]:
    """`root` and all its live descendants."""
    kids: dict[int, list[int]] = {}
    for child, parent in parents().items():
        kids.setdefault(parent, []).append(child)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, ()))
    return out


def cmdline(pid: int) -> bytes:
    """The NUL-separated command line of `pid` (b"" when it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def sanic_server_name(pid: int) -> str:
    """The SANIC_WORKER_NAME of `pid` when it is one of Sanic's server workers (Sanic-Server-<index>-0),
    else "" (Sanic's state manager and other helpers, or a process that is gone)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except OSError:
        return ""
    name = env.get(b"SANIC_WORKER_NAME", b"").decode()
    return name if name.startswith("Sanic-Server-") else ""
