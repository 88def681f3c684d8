"""Live reload: the config file changed under a running two-worker Coordinator, as the kubelet changes a mounted
ConfigMap (a new timestamped directory, the `..data` symlink swapped; the file itself never written), while
clients keep sending. Keys, limits and SLOs take effect in both workers with no request failing; a key that
needs a restart is said to; a file that fails validation changes nothing and says why in one line.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time

import httpx
import pytest

from harness.bodies import chat_body
from harness.configs import coordinator_config, instance
from harness.coordinator import Coordinator
from harness.loopback import wait_until

MODEL = "live"
OLD, KEPT, NEW = "sk-old-1", "sk-kept-2", "sk-new-3"


class Mount:
    """A directory laid out as the kubelet mounts a ConfigMap: user_config.json -> ..data/user_config.json,
    ..data -> ..<timestamp>."""

    def __init__(self, root):
        self.dir, self.n = str(root), 1
        os.mkdir(os.path.join(self.dir, self._stamp()))
        os.symlink(self._stamp(), os.path.join(self.dir, "..data"))
        os.symlink("..data/user_config.json", self.path)

    @property
    def path(self) -> str:
        return os.path.join(self.dir, "user_config.json")

    def _stamp(self) -> str:
        return f"..2026_12_01_19_00_{self.n:02d}"

    def swap(self, whole: dict) -> None:
        """The kubelet's update: the new content in a new directory, then the swap, then the old one removed."""
        self.n += 1
        stamp = self._stamp()
        os.mkdir(os.path.join(self.dir, stamp))
        with open(os.path.join(self.dir, stamp, "user_config.json"), "w") as f:
            json.dump(whole, f)
        tmp = os.path.join(self.dir, "..data_tmp")
        os.symlink(stamp, tmp)
        old = os.path.realpath(os.path.join(self.dir, "..data"))
        os.replace(tmp, os.path.join(self.dir, "..data"))
        shutil.rmtree(old)


def ask(coord, key: str | None, body: dict | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(timeout=30) as c:  # a new connection each time: the kernel picks the worker
        return c.post(coord.url + "/v1/chat/completions", json=body or chat_body(MODEL, max_tokens=1), headers=headers)


def slo_ttft(coord) -> int:
    with httpx.Client(timeout=10) as c:
        return c.get(coord.url + "/v1/models", headers={"Authorization": f"Bearer {KEPT}"}).json()["data"][0][
            "slo_ttft"
        ]


class Load:
    """Clients that keep sending with the key both configs hold, counting every answer."""

    def __init__(self, coord, threads: int = 3):
        self.coord, self.stop, self.statuses = coord, threading.Event(), []
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]
        for t in self.threads:
            t.start()

    def _run(self):
        while not self.stop.is_set():
            try:
                self.statuses.append(ask(self.coord, KEPT).status_code)
            except httpx.HTTPError as e:
                self.statuses.append(type(e).__name__)

    def end(self) -> list:
        self.stop.set()
        for t in self.threads:
            t.join(30)
        return self.statuses


def config(keys: list[str], slo: int, body_bytes: int, upstream, **extra) -> dict:
    return {
        "motor_coordinator_config": coordinator_config(
            [instance(1, "union", MODEL, upstream.address)],
            models=[{"id": MODEL, "slo_ttft": slo, "slo_tpot": 50}],
            inference_workers_config={"num_workers": 2},
            api_key_config={"enable_api_key": True, "valid_keys": keys},
            rate_limit_config={"max_request_body_size": body_bytes},
            **extra,
        )
    }


def test_a_kubelet_swap_applies_in_every_worker_under_load_and_a_broken_file_changes_nothing(sims, tmp_path):
    u = sims("union", model=MODEL)
    mount = Mount(tmp_path)
    first = config([OLD, KEPT], 1000, 16 << 20, u)
    big = chat_body(MODEL, max_tokens=1, content="x" * 12000)  # 12 KB, a few thousand tokens
    with Coordinator(first, wrap=False, config_path=mount.path) as coord:
        assert ask(coord, OLD).status_code == 200 and ask(coord, NEW).status_code == 401
        assert ask(coord, KEPT, big).status_code == 200 and slo_ttft(coord) == 1000
        load = Load(coord)
        time.sleep(0.5)
        second = config([KEPT, NEW], 700, 8 << 10, u)
        second["motor_coordinator_config"]["scheduler_config"]["scheduler_type"] = "round_robin"
        mount.swap(second)
        swapped = time.monotonic()
        assert wait_until(lambda: coord.output().count("reloaded in worker") == 2, timeout_s=10)
        took = time.monotonic() - swapped

        def second_applies() -> bool:
            return (
                ask(coord, NEW).status_code == 200
                and ask(coord, OLD).status_code == 401
                and ask(coord, KEPT, big).status_code == 413
                and slo_ttft(coord) == 700
            )

        assert all(second_applies() for _ in range(10))  # ten rounds of fresh connections over both workers
        log = coord.output()
        assert log.count("scheduler_config.scheduler_type changed") == 1 and "needs a restart" in log
        # A file that fails validation: one line naming the key, and everything stays as it was.
        broken = config([KEPT], 300, 1 << 20, u, exception_config={"max_retry": -1})
        mount.swap(broken)
        assert wait_until(lambda: "not reloaded, nothing changed" in coord.output(), timeout_s=10)
        time.sleep(0.5)  # the other worker read it too
        (line,) = [ln for ln in coord.output().splitlines() if "not reloaded" in ln]
        assert "motor_coordinator_config.exception_config.max_retry: must be 0..100" in line
        assert all(second_applies() for _ in range(5))
        assert coord.output().count("reloaded in worker") == 2
        statuses = load.end()
    assert len(statuses) > 20 and set(statuses) == {200}, statuses
    print(f"reload applied in both workers {took:.2f} s after the swap; {len(statuses)} requests, none failed")


@pytest.mark.parametrize("broken", ["{not json", '{"motor_coordinator_config": {"models": [{"id": ""}]}}'])
def test_a_file_edited_in_place_that_fails_changes_nothing(sims, broken):
    u = sims("union", model=MODEL)
    with Coordinator(config([KEPT], 1000, 16 << 20, u), wrap=False) as coord:
        tmp = coord.config_path + ".new"
        with open(tmp, "w") as f:
            f.write(broken)
        os.replace(tmp, coord.config_path)  # as an editor saves
        assert wait_until(lambda: "not reloaded, nothing changed" in coord.output(), timeout_s=10)
        assert ask(coord, KEPT).status_code == 200 and slo_ttft(coord) == 1000
        with open(tmp, "w") as f:
            json.dump(config([KEPT], 900, 16 << 20, u), f)
        os.replace(tmp, coord.config_path)
        assert wait_until(lambda: slo_ttft(coord) == 900, timeout_s=10)


def test_merge_takes_live_keys_and_names_the_rest():
    from dataclasses import replace

    from config import ModelConfig, settings_from_dict
    from config.live import merge, overridden

    running = settings_from_dict({"models": [{"id": "a"}]})
    started = replace(running, num_workers=4)  # --workers 4: the start's, not the file's
    kept = overridden(running, started)
    reloaded = settings_from_dict(
        {
            "models": [{"id": "a", "slo_ttft": 700}],
            "api_config": {"coordinator_api_infer_port": 2025},
            "scheduler_config": {"pd_dispatch": "trigger", "breaker_open_time": 9},
            "exception_config": {"max_retry": 1},
        }
    )
    merged, restart = merge(started, reloaded, kept)
    assert merged.models == (ModelConfig(id="a", slo_ttft_ms=700),) and merged.max_retry == 1
    assert merged.breaker_open_s == 9.0 and merged.num_workers == 4 and merged.infer_port == 1025
    assert sorted(restart) == [
        "motor_coordinator_config.api_config.coordinator_api_infer_port",
        "motor_coordinator_config.scheduler_config.pd_dispatch",
    ]
    assert merge(started, running, kept) == (started, [])  # the file as it was: nothing changes
