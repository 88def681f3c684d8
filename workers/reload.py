"""Live reload: every worker watches the config file and applies what a change to it may change live.

Each worker runs one `Reloader`, a task on its own event loop: watchfiles (inotify, through its Rust notify
thread) watches the file's directory, not the file, so Kubernetes' ConfigMap and Secret mounts work: the kubelet
writes a new timestamped directory and swaps the `..data` symlink, and the file itself is never written. An
event naming the file or a `..` entry makes the worker read the file; when its bytes changed, it is validated
again exactly as at start (config.load). A file that fails changes nothing, and worker 0 says why in one line.
Otherwise the live keys (config.live) apply to this worker from its next request on, requests in flight
finishing on the settings they started with; worker 0 names each changed key that needs a restart. Every
worker applies it on its own, within the watcher's debounce (`DEBOUNCE_MS`) of the change.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import Callable

import watchfiles

from config import ConfigError, Settings, load_settings
from config.live import merge, overridden

log = logging.getLogger("coordinator.reload")
DEBOUNCE_MS = 200  # changes this close together are read once (the kubelet's swap is a few renames)


class Reloader:
    def __init__(self, running: Settings, apply: Callable[[Settings], None], worker: int):
        self.running, self.apply, self.worker = running, apply, worker
        self.path = running.source_path
        self.name = os.path.basename(self.path)
        self.digest = self._digest()
        try:
            self.kept = overridden(self._load(quiet=True), running)
        except ConfigError:  # changed since the main process read it: the next change is read whole
            self.kept = frozenset()
        self.stop_event = asyncio.Event()
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._watch())

    async def stop(self) -> None:
        self.stop_event.set()
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    def _digest(self) -> bytes | None:
        try:
            with open(self.path, "rb") as f:
                return hashlib.sha256(f.read()).digest()
        except OSError:  # mid-swap, or gone: nothing to read yet
            return None

    def _names_the_file(self, _change: watchfiles.Change, path: str) -> bool:
        base = os.path.basename(path)
        return base == self.name or base.startswith("..")

    async def _watch(self) -> None:
        async for _ in watchfiles.awatch(
            os.path.dirname(self.path) or ".",
            watch_filter=self._names_the_file,
            debounce=DEBOUNCE_MS,
            step=50,
            recursive=False,
            stop_event=self.stop_event,
            ignore_permission_denied=True,
        ):
            try:
                await self.reload()
            except Exception:  # a reload must never stop the watcher
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
