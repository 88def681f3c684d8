"""Handles on the real vLLM engines of an e2e run: address, /metrics samples, health, kill and restart."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass

import httpx

from harness.kv_trace import kv_addresses
from harness.loopback import wait_until

ROLES = ("union", "union2", "prefill", "decode")  # union2: a second union engine, for the KV-event trace
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


@dataclass
class Engine:
    """One real vLLM engine of this run; `restart()` relaunches it with the same command and ports."""

    name: str
    address: str
    run_dir: str

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def pid(self) -> int:
        with open(os.path.join(self.run_dir, f"{self.name}.pid")) as f:
            return int(f.read())

    @property
    def kv_events(self) -> dict:
        """Where a union engine publishes its KV events: an endpoint's `kv_events` object for the Coordinator."""
        return kv_addresses(self.run_dir, self.name)

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples of `name` whose labels include `labels` (0 when absent)."""
        return metric_value(self.metrics(), name, **labels)

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        """SIGKILL the engine's whole process group (API server, EngineCore, worker): a crash, not a shutdown."""
        pid = self.pid
        os.killpg(pid, signal.SIGKILL)
        wait_until(lambda: not _group_alive(pid), timeout_s=30)

    def restart(self, timeout_s: float = 600) -> None:
        """Run the engine's launch script again (new process group, pid file updated for vllm_up.sh's stop)."""
        with open(os.path.join(self.run_dir, f"{self.name}.log"), "ab") as log:
            proc = subprocess.Popen(
                ["bash", os.path.join(self.run_dir, f"{self.name}.sh")],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        with open(os.path.join(self.run_dir, f"{self.name}.pid"), "w") as f:
            f.write(str(proc.pid))
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            if proc.poll() is not None:
                raise RuntimeError(f"the {self.name} engine exited with {proc.returncode} while restarting")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {self.name} engine was not healthy {timeout_s} s after its restart")
            time.sleep(1)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def metric_value(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or m.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total
