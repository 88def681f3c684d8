"""Test support: start the Coordinator as a real process on loopback ports and talk to it.

`Coordinator` runs `python app.py --config FILE` (the same entry point users run) with free ports,
waits for its management probes, and stops it with SIGTERM only after it is ready (sanic #2997).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import closing

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
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


def instance(iid: int, role: str, model: str, *addresses: str, **extra) -> dict:
    return {
        "id": iid,
        "role": role,
        "model_name": model,
        "endpoints": [{"id": i, "address": a} for i, a in enumerate(addresses)],
        **extra,
    }


def coordinator_config(instances: list[dict], models: list[dict] | None = None, **sections) -> dict:
    """A motor_coordinator_config object; `sections` override whole sections (api_key_config=...)."""
    infer, mgmt, obs = free_ports(3)
    cfg = {
        "api_config": {
            "coordinator_api_host": "127.0.0.1",
            "coordinator_api_infer_port": infer,
            "coordinator_api_mgmt_port": mgmt,
            "coordinator_obs_port": obs,
        },
        "inference_workers_config": {"num_workers": 1},
        "scheduler_config": {"health_check_interval": 0.2, "metrics_scrape_interval": 0.2},
        "exception_config": {"retry_delay": 0.01},
        "log_config": {"log_level": "INFO"},
        "models": models if models is not None else [],
        "instances": instances,
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg


class Coordinator:
    """A running `python app.py` process."""

    def __init__(
        self,
        config: dict,
        workers: int | None = None,
        wrap: bool = True,
        env: dict | None = None,
        verify: str | bool = True,
        root: str = ROOT,
    ):
        """`config` is a motor_coordinator_config object, written wrapped in a whole user_config.json unless
        `wrap` is false (then it is written as given: a bare section, or a whole file). `verify`: the CA that
        a management port with TLS is checked against while waiting for readiness. `root`: the tree whose
        app.py runs, in that directory."""
        self.config = config.get("motor_coordinator_config", config)
        self.verify = verify
        api = self.config["api_config"]
        self.host = api["coordinator_api_host"]
        self.infer_port = api["coordinator_api_infer_port"]
        self.mgmt_port = api["coordinator_api_mgmt_port"]
        self.obs_port = api["coordinator_obs_port"]
        fd, self.config_path = tempfile.mkstemp(suffix=".json", prefix="motor-test-")
        with os.fdopen(fd, "w") as f:
            json.dump({"motor_coordinator_config": config} if wrap else config, f)
        self.log_path = self.config_path + ".log"
        args = [sys.executable, os.path.join(root, "app.py"), "--config", self.config_path]
        if workers is not None:
            args += ["--workers", str(workers)]
        self.log = open(self.log_path, "wb")  # noqa: SIM115 (closed by stop())
        self.proc = subprocess.Popen(
            args,
            cwd=root,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        try:
            self.wait_ready()
        except Exception:
            self.stop()
            raise

    def _scheme(self, section: str) -> str:
        return "https" if self.config.get(section, {}).get("enable_tls") else "http"

    @property
    def url(self) -> str:
        return f"{self._scheme('infer_tls_config')}://{self.host}:{self.infer_port}"

    @property
    def mgmt(self) -> str:
        return f"{self._scheme('mgmt_tls_config')}://{self.host}:{self.mgmt_port}"

    @property
    def obs(self) -> str:
        return f"{self._scheme('mgmt_tls_config')}://{self.host}:{self.obs_port}"

    def wait_ready(self, timeout_s: float = 90.0) -> None:
        """Readiness answers and every worker has started (SIGTERM before that hangs Sanic, sanic #2997).

        A worker counts as started when Sanic logs it ready, or when its process has been up for a few
        seconds while the Coordinator answers (worker log lines can reach the shared log file late)."""
        deadline = time.monotonic() + timeout_s
        workers = self.config.get("inference_workers_config", {}).get("num_workers", 1)
        answering_since = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"coordinator exited with {self.proc.returncode}:\n{self.output()}")
            try:
                ready = httpx.get(self.mgmt + "/readiness", timeout=1.0, verify=self.verify).status_code == 200
            except httpx.HTTPError:
                ready = False
            if ready:
                answering_since = answering_since or time.monotonic()
                if self.output().count("Worker ready") >= workers:
                    return
                if len(self.worker_pids()) >= workers and time.monotonic() - answering_since > 3.0:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"coordinator not ready in {timeout_s}s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def worker_pids(self) -> list[int]:
        """The Sanic worker processes of this Coordinator (spawned children of its main process)."""
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read()
            except (OSError, ValueError, IndexError):
                continue
            if ppid == self.proc.pid and b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
                pids.append(int(entry))
        return pids

    def server_workers(self) -> dict[str, int]:
        """The Sanic server workers among `worker_pids()` (not Sanic's state manager process): name -> pid,
        by the SANIC_WORKER_NAME each was started with (Sanic-Server-<index>-0)."""
        workers = {}
        for pid in self.worker_pids():
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            except OSError:
                continue
            name = env.get(b"SANIC_WORKER_NAME", b"").decode()
            if name.startswith("Sanic-Server-"):
                workers[name] = pid
        return workers

    def refresh(self, event: str, instances: list) -> httpx.Response:
        return httpx.post(self.mgmt + "/instances/refresh", json={"event": event, "instances": instances}, timeout=5)

    def stop(self, timeout_s: float = 20.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.log.close()
        for path in (self.config_path, self.log_path):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        return self.proc.returncode

    def __enter__(self) -> Coordinator:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def sse_events(raw: bytes | str) -> list[str]:
    """The data payloads of an SSE body, in order."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    return [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]


def wait_until(predicate, timeout_s: float = 5.0, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()
