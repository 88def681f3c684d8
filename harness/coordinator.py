"""The Coordinator as a real process: `python app.py --config FILE` (the entry point users run) on loopback.

`Coordinator` writes the configuration to a file, starts the process, waits for its management probes and
its workers, and stops it with SIGTERM only after it is ready (sanic #2997).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time

import httpx

from harness import ROOT
from harness.loopback import CLIENT, wait_until
from harness.processes import Proc, children, cmdline, sanic_server_name

ROUTE_TABLE = """
import json, sys
import app
from config import load_settings

routes = app.create_app(load_settings(sys.argv[1])).router.routes
print(json.dumps([(m, "/" + r.path, getattr(r.ctx, "plane", None)) for r in routes for m in sorted(r.methods)]))
"""


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
        ready_timeout_s: float = 90.0,
        config_path: str | None = None,
    ):
        """`config` is a motor_coordinator_config object, written wrapped in a whole user_config.json unless
        `wrap` is false (then it is written as given: a bare section, or a whole file). `verify`: the CA that
        a management port with TLS is checked against while waiting for readiness. `root`: the tree whose
        app.py runs, in that directory. `ready_timeout_s`: how long its workers may take to start. `config_path`:
        where to write the config (a path through a symlink, as Kubernetes mounts one), not a temporary file."""
        self.config = config.get("motor_coordinator_config", config)
        self.verify = verify
        self.root = root
        self.ready_timeout_s = ready_timeout_s
        api = self.config["api_config"]
        self.host = api["coordinator_api_host"]
        self.infer_port = api["coordinator_api_infer_port"]
        self.mgmt_port = api["coordinator_api_mgmt_port"]
        self.obs_port = api["coordinator_obs_port"]
        if config_path is None:
            fd, self.config_path = tempfile.mkstemp(suffix=".json", prefix="motor-test-")
            os.close(fd)
        else:
            self.config_path = config_path
        with open(self.config_path, "w") as f:
            json.dump({"motor_coordinator_config": config} if wrap else config, f)
        fd, self.log_path = tempfile.mkstemp(suffix=".log", prefix="motor-test-")  # apart: the config's may move
        os.close(fd)
        args = [sys.executable, os.path.join(root, "app.py"), "--config", self.config_path]
        if workers is not None:
            args += ["--workers", str(workers)]
        self.proc = Proc(args, self.log_path, env=env, cwd=root)
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

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Readiness answers and every worker has started (SIGTERM before that hangs Sanic, sanic #2997),
        within `timeout_s` (the constructor's `ready_timeout_s` by default).

        A worker counts as started when Sanic logs it ready, or when its process has been up for a few
        seconds while the Coordinator answers (worker log lines can reach the shared log file late)."""
        timeout_s = self.ready_timeout_s if timeout_s is None else timeout_s
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
        return self.proc.output()

    def every_worker_started(self, timeout_s: float = 20) -> bool:
        """The main process has seen every worker start (its supervisor's INFO line): a stop signal before that
        exits at once, undrained, and workers can answer requests some tenths of a second before it."""
        return wait_until(lambda: "every worker started" in self.output(), timeout_s)

    def worker_pids(self) -> list[int]:
        """The Sanic worker processes of this Coordinator (spawned children of its main process)."""
        return [
            pid
            for pid in children(self.proc.pid)
            if b"spawn_main" in (line := cmdline(pid)) and b"resource_tracker" not in line
        ]

    def server_workers(self) -> dict[str, int]:
        """The Sanic server workers among `worker_pids()` (not Sanic's state manager process): name -> pid,
        by the SANIC_WORKER_NAME each was started with (Sanic-Server-<index>-0)."""
        return {name: pid for pid in self.worker_pids() if (name := sanic_server_name(pid))}

    def routes(self) -> list[tuple[str, str, str | None]]:
        """The route table of the app this config makes, as (method, path, plane), one per method of each route.

        Read from `create_app` in a process of its own (importing app.py sets the process's metrics directory)."""
        with tempfile.TemporaryDirectory(prefix="motor-routes-") as prom:
            out = subprocess.run(
                [sys.executable, "-c", ROUTE_TABLE, self.config_path],
                capture_output=True,
                text=True,
                timeout=60,
                cwd=self.root,
                env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": prom},
                check=True,
            )
        return [tuple(row) for row in json.loads(out.stdout.strip().splitlines()[-1])]

    def instances(self) -> dict:
        """GET /instances on the management port: the instance table, and cluster mode's status."""
        return CLIENT.get(self.mgmt + "/instances").json()

    def refresh(self, event: str, instances: list) -> httpx.Response:
        return CLIENT.post(self.mgmt + "/instances/refresh", json={"event": event, "instances": instances})

    def stop(self, timeout_s: float = 20.0) -> int | None:
        code = self.proc.stop(timeout_s)
        for path in (self.config_path, self.log_path):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        return code

    def __enter__(self) -> Coordinator:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def logged_request_pids(coord: Coordinator, since: int = 0) -> set[str]:
    """Process ids of the workers that logged a request line after output offset `since`."""
    return set(re.findall(r"coordinator\.request\[(\d+)\]", coord.output()[since:]))
