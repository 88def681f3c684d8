"""Live reload: the config file watched once, in the main process; every worker applies what may change live.

`ConfigWatch`, a daemon thread of the main process, runs watchfiles (inotify) on the file's directory, not the
file, so Kubernetes' ConfigMap and Secret mounts work: the kubelet writes a new timestamped directory and swaps
the `..data` symlink, and the file itself is never written. An event naming the file or a `..` entry bumps a
counter in shared memory (G_CONFIG_GEN). One watcher for all workers, outside them: a worker's only cost is a
look at that counter every `POLL_S` (a watcher in each worker woke its event loop's process every step).

Each worker's `Reloader` sees the counter move and reads the file; when its bytes changed, it is validated
again exactly as at start (config.load). A file that fails changes nothing, and worker 0 says why in one line.
Otherwise the live keys (config.live) apply in this worker from its next request on, requests in flight
finishing on the settings they started with; worker 0 names each changed key that needs a restart. From the
change to every worker: the watcher's debounce plus one poll, under half a second.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import threading
from collections.abc import Callable

import watchfiles

from config import ConfigError, Settings, load_settings
from config.live import merge, overridden
from state.shared import G_CONFIG_GEN, SharedState

log = logging.getLogger("coordinator.reload")
DEBOUNCE_MS = 200  # changes this close together are one (the kubelet's swap is a few renames)
POLL_S = 0.2  # how often a worker looks at the counter


def names_the_file(path: str) -> Callable[[watchfiles.Change, str], bool]:
    """The watch filter: the file itself, or a `..` entry (`..data`, `..data_tmp`, `..<timestamp>`)."""
    name = os.path.basename(path)

    def wanted(_change: watchfiles.Change, changed: str) -> bool:
        base = os.path.basename(changed)
        return base == name or base.startswith("..")

    return wanted


class ConfigWatch:
    """The main process's watcher of the config file: bumps G_CONFIG_GEN at each change."""

    def __init__(self, path: str, shared: SharedState):
        self.path, self.shared = path, shared
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, name="config-watch", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(timeout=2)

    def _run(self) -> None:
        try:
            for _ in watchfiles.watch(
                os.path.dirname(self.path) or ".",
                watch_filter=names_the_file(self.path),
                debounce=DEBOUNCE_MS,
                step=50,
                recursive=False,
                stop_event=self.stop_event,
                ignore_permission_denied=True,
                raise_interrupt=False,
            ):
                self.shared.globals[G_CONFIG_GEN] += 1  # this thread is its only writer
        except Exception:  # the directory went away: the Coordinator runs on, without live reload
            log.exception("config: watching %s stopped; changes to it need a restart", self.path)


class Reloader:
    """One worker's side: when the counter moves, the file read, validated and its live keys applied."""

    def __init__(self, running: Settings, shared: SharedState, apply: Callable[[Settings], None], worker: int):
        self.running, self.shared, self.apply, self.worker = running, shared, apply, worker
        self.path = running.source_path
        self.gen = shared.globals[G_CONFIG_GEN]
        self.digest = self._digest()
        try:
            self.kept = overridden(self._load(quiet=True), running)
        except ConfigError:  # changed since the main process read it: the next change is read whole
            self.kept = frozenset()
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._poll())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    def _digest(self) -> bytes | None:
        try:
            with open(self.path, "rb") as f:
                return hashlib.sha256(f.read()).digest()
        except OSError:  # mid-swap, or gone: nothing to read yet
            return None

    async def _poll(self) -> None:
        g = self.shared.globals
        while True:
            await asyncio.sleep(POLL_S)
            if g[G_CONFIG_GEN] != self.gen:
                self.gen = g[G_CONFIG_GEN]
                try:
                    await self.reload()
                except Exception:  # a reload must never stop the polling
                    log.exception("config: reloading %s failed", self.path)

    async def reload(self) -> None:
        loop = asyncio.get_running_loop()
        digest = await loop.run_in_executor(None, self._digest)
        if digest is None or digest == self.digest:
            return
        self.digest = digest
        try:
            reloaded = await loop.run_in_executor(None, self._load, self.worker != 0)
        except ConfigError as e:
            if self.worker == 0:
                log.error("config: %s not reloaded, nothing changed: %s", self.path, e)
            return
        merged, restart = merge(self.running, reloaded, self.kept)
        if self.worker == 0:
            for key in restart:
                log.warning("config: %s changed in %s: needs a restart, runs on as before", key, self.path)
        if merged is not self.running:
            self.running = merged
            self.apply(merged)
            log.info("config: %s reloaded in worker %d", self.path, self.worker)

    def _load(self, quiet: bool) -> Settings:
        """The file's settings; `quiet`: without its notes on keys that change nothing (said once: at start by the
        main process, at a reload by worker 0)."""
        notes = logging.getLogger("coordinator.config")
        notes.disabled = quiet
        try:
            return load_settings(self.path)
        finally:
            notes.disabled = False
