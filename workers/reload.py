"""Live reload: the config file and the key files it names, watched and judged once, in the main process; every
worker applies what it accepted.

`ConfigWatch`, a daemon thread of the main process, looks every `POLL_S` at what the config file's path and each
`api_key_file` resolve to now: every symlink hop followed (realpath), and the file reached by its device, inode,
size, mtime and ctime. No directory entry's name is watched, so each way a file is replaced is seen: an edit in
place, an editor's rename, Kubernetes' ConfigMap or Secret mount (the kubelet swaps the `..data` symlink),
`ln -sfn` of a directory symlink anywhere on the path, `mv` of a directory, a key file rewritten or deleted.
A file changed within the last second is read again at each look whatever its identity says: timestamps move
by the kernel's tick, and two writes of one size within a tick look alike.

When the files' bytes changed, the config is validated again exactly as at start (config.load) and must not
leave out a security or limit key the running file writes (config.live.check_nothing_left_out). A file that
fails changes nothing, said in one ERROR line. Otherwise its live keys, merged into the running settings
(config.live), are published pickled in shared memory and `globals.config_gen` bumped; each changed key that needs a
restart is named in one WARNING line. One judge for all workers: they never disagree, whichever files they saw.

Each worker's `Reloader` looks at the counter every `POLL_S` and swaps the published settings into the worker's
`config.Live`; a worker restarted after a reload starts on them. From a change to every worker: two looks, half a
second at most. Every reader reads a setting where it uses it, so a request in flight keeps what it has passed
(its key, the limits, its admission, a deadline already running) and reads the new value at its next use (a
retry's count and backoff, a continuation's switch, the next timeout it starts).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import pickle
import threading
import time
from collections.abc import Callable
from typing import Any

from config import ConfigError, Settings, parse_config, read_config, settings_from_dict
from config.live import GUARDED, check_nothing_left_out, merge, overridden, section_of
from state.shared import SharedState

log = logging.getLogger("coordinator.reload")
POLL_S = 0.25  # how often the main process looks at the files, and a worker at the counter
FRESH_NS = 1_000_000_000  # a file changed this recently is read again at each look


def identity(path: str) -> tuple:
    """What `path` is now: the file its symlinks lead to, and that file's device, inode, size and times."""
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except OSError:  # gone, or mid-swap
        return (real,)
    return (real, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def key_files(raw: Any) -> list[str]:
    """The api_key_file paths a config file's JSON names."""
    names = ((section_of(raw, name) or {}).get("api_key_file") for name, _ in GUARDED)
    return [n for n in names if isinstance(n, str) and n]


class ConfigWatch:
    """The main process's judge of the config file: publishes the settings of each change it accepts."""

    def __init__(self, running: Settings, shared: SharedState):
        self.running, self.shared, self.path = running, shared, running.source_path
        self.raw: Any = None  # the JSON of the file the running settings came from
        self.kept: frozenset[str] = frozenset()
        self.files, self.digest = [self.path], b""
        try:
            data = read_config(self.path)
            self.raw = parse_config(data, self.path)
            self.files = [self.path, *key_files(self.raw)]
            self.kept = overridden(self._load(self.raw, quiet=True), running)
            self.digest = self._digest(data)
        except ConfigError:  # changed since the start read it: the next change is read whole
            pass
        self.seen = [identity(p) for p in self.files]
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, name="config-watch", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(timeout=2)

    def _run(self) -> None:
        while not self.stop_event.wait(POLL_S):
            try:
                self.look()
            except Exception:  # a reload must never stop the watch
                log.exception("config: reloading %s failed", self.path)

    def look(self) -> None:
        seen = [identity(p) for p in self.files]
        fresh = time.time_ns() - FRESH_NS
        if seen == self.seen and not any(len(i) > 1 and i[-1] > fresh for i in seen):
            return
        self.seen = seen
        try:
            data = read_config(self.path)
        except ConfigError:  # mid-swap, or gone: nothing to read yet
            return
        try:
            raw = parse_config(data, self.path)
        except ConfigError as e:  # said below, if these bytes are new
            raw = e
        self.files = [self.path, *key_files(raw)]
        digest = self._digest(data)
        if digest == self.digest:
            return
        self.digest = digest
        try:
            if isinstance(raw, ConfigError):
                raise raw
            check_nothing_left_out(self.raw, raw)
            reloaded = self._load(raw, quiet=False)
        except ConfigError as e:
            log.error("config: %s not reloaded, nothing changed: %s", self.path, e)
            return
        self.raw = raw
        merged, restart = merge(self.running, reloaded, self.kept)
        for key in restart:
            log.warning("config: %s changed in %s: needs a restart, runs on as before", key, self.path)
        if merged is not self.running:
            self.running = merged
            publish(self.shared, merged)

    def _digest(self, data: bytes) -> bytes:
        """Of the config's bytes and its key files' (or their absence)."""
        h = hashlib.sha256(data)
        for path in self.files[1:]:
            try:
                with open(path, "rb") as f:
                    h.update(b"\0" + hashlib.sha256(f.read()).digest())
            except OSError:
                h.update(b"\1")
        return h.digest()

    def _load(self, raw: Any, quiet: bool) -> Settings:
        """The file's settings; `quiet`: without its notes on keys that change nothing (said at start)."""
        notes = logging.getLogger("coordinator.config")
        notes.disabled = quiet
        try:
            return settings_from_dict(raw, source_path=os.path.abspath(self.path))
        finally:
            notes.disabled = False


def publish(shared: SharedState, settings: Settings) -> None:
    data = pickle.dumps(settings)
    g = shared.globals
    with shared.lock:
        shared.config[: len(data)] = data
        g.config_len = len(data)
        g.config_gen += 1


def published(shared: SharedState) -> Settings:
    with shared.lock:
        data = shared.config[: shared.globals.config_len]
    return pickle.loads(data)  # written by this Coordinator's main process, into memory only it shares


class Reloader:
    """One worker's side: the settings the main process published, applied when its counter moves."""

    def __init__(self, shared: SharedState, apply: Callable[[Settings], None], worker: int):
        self.shared, self.apply, self.worker = shared, apply, worker
        self.gen = 0
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.catch_up()  # restarted after a reload: on the reloaded settings from its first request
        self.task = asyncio.get_running_loop().create_task(self._poll())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            try:
                self.catch_up()
            except Exception:  # a reload must never stop the polling
                log.exception("config: applying a reload in worker %d failed", self.worker)

    def catch_up(self) -> None:
        gen = self.shared.globals.config_gen
        if gen != self.gen:
            self.gen = gen
            settings = published(self.shared)
            self.apply(settings)
            log.info("config: %s reloaded in worker %d", settings.source_path, self.worker)
