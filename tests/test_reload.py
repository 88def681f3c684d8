"""Live reload: the config file changed under a running two-worker Coordinator, as the kubelet changes a mounted
ConfigMap (a new timestamped directory, the `..data` symlink swapped; the file itself never written), while
clients keep sending. Keys, limits and SLOs take effect in both workers with no request failing; a key that
needs a restart is said to; a file that fails validation changes nothing and says why in one line. Every way a
path comes to hold other bytes is seen (a directory symlink on the path swapped, a directory moved over, a key
file rewritten or deleted), and a file that leaves out a security or limit key the running one writes is refused.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import threading
import time

import httpx
import pytest

from config.live import GUARDED
from config.validation import config_key
from harness.bodies import chat_body
from harness.configs import coordinator_config, instance
from harness.coordinator import Coordinator
from harness.loopback import wait_until
from tests.test_workers import restarted, served_by

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


def config(keys: list[str], slo: int, body_bytes: int, upstream, key_file: str = "", **extra) -> dict:
    """A whole user_config.json; `key_file`: api_key_config's api_key_file."""
    return {
        "motor_coordinator_config": coordinator_config(
            [instance(1, "union", MODEL, upstream.address)],
            models=[{"id": MODEL, "slo_ttft": slo, "slo_tpot": 50}],
            inference_workers_config={"num_workers": 2},
            api_key_config={"enable_api_key": True, "valid_keys": keys, "api_key_file": key_file},
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


REFUSED = "not reloaded, nothing changed"
FILE1, FILE2 = "sk-file-1", "sk-file-2"


def write(path: str, text: str) -> None:
    """In place, as `echo > file` does: the same inode, new bytes."""
    with open(path, "w") as f:
        f.write(text)


def replace_json(path: str, whole: dict) -> None:
    """As an editor saves: a new file renamed over the old one."""
    write(path + ".new", json.dumps(whole))
    os.replace(path + ".new", path)


def refusals(coord) -> list[str]:
    return [ln for ln in coord.output().splitlines() if REFUSED in ln]


SWAPS = {  # data/ replaced by v2/, the commands run in their parent
    "ln -sfn": [["ln", "-sfn", "v2", "data"]],
    "mv -T": [["ln", "-s", "v2", "data.new"], ["mv", "-T", "data.new", "data"]],
    "directory moved": [["mv", "-T", "data", "v1"], ["mv", "-T", "v2", "data"]],
}


@pytest.mark.parametrize("shape", [*SWAPS, "key file rewritten", "key file deleted"])
def test_a_change_through_a_directory_swap_or_a_key_file_is_applied_or_refused(sims, tmp_path, shape):
    """The config at data/user_config.json, data -> v1 a directory symlink (not the kubelet's `..data`; a
    directory itself for "directory moved"), its api_key_file in another directory: each shape changes what the
    paths resolve to without an event in the config file's directory."""
    u = sims("union", model=MODEL)
    root, key_file = str(tmp_path), str(tmp_path / "keys" / "key")
    os.mkdir(tmp_path / "keys")
    write(key_file, FILE1 + "\n")
    if shape == "directory moved":
        os.mkdir(tmp_path / "data")
    else:
        os.mkdir(tmp_path / "v1")
        os.symlink("v1", tmp_path / "data")
    first = config([OLD], 1000, 16 << 20, u, key_file)
    with Coordinator(first, wrap=False, config_path=str(tmp_path / "data" / "user_config.json")) as coord:
        assert ask(coord, OLD).status_code == 200 and ask(coord, FILE1).status_code == 200
        assert ask(coord, NEW).status_code == 401 and ask(coord, FILE2).status_code == 401
        changed = time.monotonic()
        if shape in SWAPS:
            os.mkdir(tmp_path / "v2")
            second = config([NEW], 1000, 16 << 20, u, key_file)
            write(str(tmp_path / "v2" / "user_config.json"), json.dumps(second))
            for command in SWAPS[shape]:
                subprocess.run(command, cwd=root, check=True)
            now, gone = NEW, OLD
        elif shape == "key file rewritten":
            write(key_file, FILE2 + "\n")
            now, gone = FILE2, FILE1
        else:
            os.remove(key_file)
            assert wait_until(lambda: refusals(coord), timeout_s=10)
            print(f"refused {time.monotonic() - changed:.2f} s after the change")
            time.sleep(0.5)  # both workers polled since
            (line,) = refusals(coord)
            assert f"motor_coordinator_config.api_key_config.api_key_file: cannot read {key_file!r}" in line
            assert all(ask(coord, FILE1).status_code == 200 for _ in range(10))  # the old keys, in both workers
            write(key_file, FILE2 + "\n")  # back: the file's return is seen too
            changed, now, gone = time.monotonic(), FILE2, FILE1
        assert wait_until(lambda: coord.output().count("reloaded in worker") == 2, timeout_s=10)
        print(f"{shape}: applied in both workers {time.monotonic() - changed:.2f} s after the change")
        assert all(ask(coord, now).status_code == 200 and ask(coord, gone).status_code == 401 for _ in range(10))


def every_key(cls: type, **values) -> dict:
    """A section that writes every key of its model: `values` by config key, the others at their defaults."""
    section = {}
    for f in dataclasses.fields(cls):
        key = config_key(cls, f.name)
        value = values.get(key, f.default)
        section[key] = list(value) if isinstance(value, tuple) else value
    return section


def test_leaving_out_any_security_or_limit_key_or_section_is_refused_and_opens_nothing(sims):
    """Property: for every key of api_key_config, mgmt_api_key_config, rate_limit_config and tenant_config (read from their
    models, so a new key is covered), a file that leaves it out, or its whole section, or writes `{}`, is refused
    in one ERROR line naming it, and no request refused before succeeds; an explicit value is applied."""
    u = sims("union", model=MODEL)
    MGMT = "m-key-1"
    whole = config([KEPT], 1000, 8192, u)
    sections = dict(zip((name for name, _ in GUARDED), (cls for _, cls in GUARDED), strict=True))
    written = {
        "api_key_config": every_key(sections["api_key_config"], enable_api_key=True, valid_keys=[KEPT]),
        "mgmt_api_key_config": every_key(sections["mgmt_api_key_config"], enable_api_key=True, valid_keys=[MGMT]),
        # One request's worth of bucket, refilled once in 1000 s: the first request empties it.
        "rate_limit_config": every_key(
            sections["rate_limit_config"],
            max_request_body_size=8192,
            enable_rate_limit=True,
            max_requests=1,
            window_size=1000.0,
            requests_per_second=0.001,
            max_inflight_requests=1,
        ),
        "tenant_config": {"tenants": [], "default": {"rpm": 1}},
    }
    assert set(written) == set(sections)  # a new guarded section needs its values here
    whole["motor_coordinator_config"].update(written)
    big = chat_body(MODEL, max_tokens=1, content="x" * 12000)
    probes = {
        "no key": lambda c: ask(c, None),
        "a wrong key": lambda c: ask(c, "sk-wrong"),
        "a body over the limit": lambda c: ask(c, KEPT, big),
        "past the rate limit": lambda c: ask(c, KEPT),
        "management without its key": lambda c: httpx.get(c.mgmt + "/instances", timeout=10),
    }

    def statuses(c) -> dict:
        return {name: probe(c).status_code for name, probe in probes.items()}

    variants = []  # (the key path the refusal names, the file that leaves it out)
    for section, keys in written.items():
        for key in [*keys, None]:
            variant = json.loads(json.dumps(whole))
            inner = variant["motor_coordinator_config"]
            del (inner[section] if key else inner)[key or section]
            variants.append((f"motor_coordinator_config.{section}" + (f".{key}" if key else ""), variant))
    variants.append(("motor_coordinator_config.api_key_config", {}))
    with Coordinator(whole, wrap=False) as coord:
        ask(coord, KEPT)  # the bucket's one request
        before = statuses(coord)
        assert before == {
            "no key": 401,
            "a wrong key": 401,
            "a body over the limit": 413,
            "past the rate limit": 429,
            "management without its key": 401,
        }
        for n, (names, variant) in enumerate(variants, start=1):
            replace_json(coord.config_path, variant)

            def judged(n: int = n) -> bool:  # refused, or applied in both workers
                return len(refusals(coord)) == n or coord.output().count("reloaded in worker") >= 2

            assert wait_until(judged, timeout_s=10), names
            assert statuses(coord) == before, names
            assert (
                len(refusals(coord)) == n and f"{names}: set in the running config and left out" in refusals(coord)[-1]
            )
        assert len(refusals(coord)) == len(variants) and "reloaded in worker" not in coord.output()
        # Written, a looser value is the operator's: keys off.
        whole["motor_coordinator_config"]["api_key_config"]["enable_api_key"] = False
        replace_json(coord.config_path, whole)
        assert wait_until(lambda: coord.output().count("reloaded in worker") == 2, timeout_s=10)
        assert all(ask(coord, None).status_code == 429 for _ in range(4))  # past the key check: the rate limit
    print(f"{len(variants)} files leaving out a key or section, each refused")


def test_a_worker_restarted_after_a_reload_runs_on_the_reloaded_settings(sims):
    """A worker restarts from what the main process started with: it must not bring a revoked key back."""
    u = sims("union", model=MODEL)
    with Coordinator(config([OLD, KEPT], 1000, 16 << 20, u), wrap=False) as coord:
        replace_json(coord.config_path, config([KEPT, NEW], 1000, 16 << 20, u))
        assert wait_until(lambda: coord.output().count("reloaded in worker") == 2, timeout_s=10)
        victim = "Sanic-Server-1-0"
        old_pid = coord.server_workers()[victim]
        os.kill(old_pid, signal.SIGKILL)
        new_pid = restarted(coord, victim, old_pid)
        mark = len(coord.output())

        def answered_by_the_restarted_worker() -> bool:
            assert ask(coord, OLD).status_code == 401 and ask(coord, NEW).status_code == 200
            return served_by(coord, new_pid, mark)

        assert wait_until(answered_by_the_restarted_worker, timeout_s=30)
