"""The main process's watch over its Sanic workers (multi-worker mode only).

Sanic's WorkerManager notices a worker process that died only to mark it FAILED or COMPLETED
(`_sync_states`): it does not restart it and logs nothing. What that worker held in shared memory (its
ledger row: requests, tokens and decode slots on engines; its admission counters: requests in flight and
queued) would stay there for good, and if it was worker 0, health checks and engine scraping
(serving/background.py) would stop. The supervisor, a daemon thread of the main process, polls the
manager every `interval_s`; for a server worker that exited while the Coordinator is not shutting down it:

- logs it at ERROR (name, pid, exit code),
- zeroes that worker's rows (safe: only that worker wrote them, and it is gone),
- releases the shared lock if the worker died holding it (otherwise every other worker would block on
  it at its next request),
- has Sanic restart it, by sending the process name over the manager's monitor pipe: the monitor loop
  (Sanic's own thread) handles it like an auto-reload restart (`_handle_message` -> `restart`), so no
  manager method is called from this thread. The new process has the same name, hence the same worker
  index, row and duties (worker 0 restarts the background loop). A worker that keeps dying soon after
  its start is restarted with a growing delay (up to `MAX_DELAY_S`).

A worker that is alive but stuck (its event loop blocked: a bug, a hung call, a process stopped) would
keep the connections the kernel hands it unanswered for good, and liveness probes that land on another
worker would not see it. Each worker's loop writes a heartbeat into its row every `HEARTBEAT_S`
(`start_heartbeat`); a worker whose heartbeat is older than `inference_workers_config.worker_watchdog_timeout`
is killed (SIGKILL, logged at ERROR), and then handled like any dead worker above.

It also owns the main process's SIGINT/SIGTERM handler, which wraps Sanic's:

- a stop signal of the whole Coordinator sets the global draining flag in shared memory first, so every
  worker answers readiness 503 and refuses new requests from then on (a signal sent to one worker process
  makes only that worker drain; see app.py), then Sanic's handler stops the workers;
- a stop signal before every worker has started would hang Sanic's start-up wait (`wait_for_ack` puts the
  stop message back on the pipe forever, sanic #2997): then the workers are killed and the main process
  exits at once, 128 + the signal number.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import threading
import time
import weakref
from typing import Any

from state.shared import SharedState, worker_index

log = logging.getLogger("coordinator.supervisor")

SERVER_PREFIX = "Sanic-Server-"
QUICK_DEATH_S = 10.0  # a worker dying sooner than this after a restart is restarted again with a delay
MAX_DELAY_S = 30.0
STUCK_LOCK_S = 5.0  # the shared lock still taken this long after a worker died: the dead worker held it
HEARTBEAT_S = 1.0
KILL_SETTLE_S = 10.0  # no other watchdog kill while one made this recently is not yet handled
SANIC_SHUTDOWN_S = 2.0  # Sanic's GRACEFUL_SHUTDOWN_TIMEOUT (app.py): the drain window is ours
# After the drain window a worker takes up to a second to write its cut streams' error events and Sanic's
# shutdown wait, then stops its background work: a worker alive this much later is hung, and is killed
# (inside the deployer's terminationGracePeriodSeconds, drain + 10 s, so the pod still exits on its own).
STOP_GRACE_S = 1.0 + SANIC_SHUTDOWN_S + 5.0


def start_heartbeat(shared: SharedState, worker: int, watch_parent: bool = True) -> None:
    """Worker side: write this worker's heartbeat now and every `HEARTBEAT_S`, from its event loop.

    Each beat also checks that the main process is still this worker's parent. If it died (killed, out of
    memory), nothing would restart this worker, zero what it holds or watch it, yet it would go on serving
    on the inherited sockets and answer readiness with 200, and hold the ports against a new Coordinator: it
    stops itself instead, as a stop signal to it alone would (a drain, then exit)."""
    loop = asyncio.get_running_loop()
    mine = shared.workers[worker]
    parent = os.getppid() if watch_parent else None

    def beat() -> None:
        mine.heartbeat_ms = int(time.monotonic() * 1000)  # CLOCK_MONOTONIC: one clock for every process of the machine
        if parent is not None and os.getppid() != parent:
            log.error("worker %s (pid %s): the main process (pid %s) is gone: stopping", worker, os.getpid(), parent)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        loop.call_later(HEARTBEAT_S, beat)

    beat()


class Supervisor:
    def __init__(
        self,
        manager: Any,
        shared: SharedState,
        watchdog_timeout_s: float,
        interval_s: float = 0.5,
        stop_deadline_s: float = float("inf"),
    ):
        """`watchdog_timeout_s`: how old a live worker's heartbeat may get before it is killed (0: never;
        else at least config.MIN_WATCHDOG_S: a healthy worker's heartbeat is up to HEARTBEAT_S + interval_s old).
        `stop_deadline_s`: how long after the stop signal a worker may still be alive before it is killed."""
        self.manager, self.shared, self.interval_s = manager, shared, interval_s
        self.watchdog_timeout_s = watchdog_timeout_s
        self.stop_deadline_s = stop_deadline_s
        # The OS processes (Sanic's WorkerProcess._current_process: a restart swaps it) the watchdog killed,
        # with when, until their death is handled; and those whose death was handled.
        self.killed: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()
        self.handled: weakref.WeakSet[Any] = weakref.WeakSet()
        self.quiet_until = 0.0  # no watchdog kill before this: workers that were blocked get to beat first
        self.last_pass = float("inf")  # when _check last ran
        self.ready = False  # every worker acknowledged its start: Sanic's start-up wait is over
        self.stopping = False  # the whole Coordinator is stopping
        self.pipe_lock = threading.RLock()  # one writer at a time on the monitor pipe (signal handler, thread)
        self.sanic_handlers: dict[int, Any] = {}
        self.started_at: dict[str, float] = {}  # name -> when the supervisor last restarted it
        self.delay: dict[str, float] = {}  # name -> delay before its next restart
        self.due: dict[str, float] = {}  # name -> when a restart that waits may be sent
        self.last_sent = float("-inf")  # when the last restart was sent
        self.stopped_pids: set[int] = set()  # the workers alive when the stop signal came

    def install(self) -> None:
        """Main process, `main_process_ready` (after Sanic's manager set its own signal handlers)."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.sanic_handlers[sig] = signal.getsignal(sig)
            signal.signal(sig, self.on_signal)
        threading.Thread(target=self._run, name="motor-supervisor", daemon=True).start()

    # -- the whole Coordinator's stop signal ----------------------------------------------------------

    def on_signal(self, sig: int, frame: Any) -> None:
        if not self.stopping:
            self.stopped_pids = {p.pid for p in self._servers() if p.is_alive()}  # the ones Sanic's shutdown stops
            threading.Thread(target=self._kill_at_stop_deadline, name="motor-stop-deadline", daemon=True).start()
        self.stopping = True
        self.shared.globals.draining = 1  # before the workers hear of it: readiness 503 on every worker
        if not self._startup_over():
            self._exit_during_startup(sig)
        with self.pipe_lock:
            handler = self.sanic_handlers.get(sig)
            if callable(handler):
                handler(sig, frame)

    def _kill_at_stop_deadline(self) -> None:
        """A worker hung when the stop signal came (its loop blocked: it never hears the manager's SIGINT) would
        keep Sanic's shutdown waiting for it for good, and the watchdog stands down once the stop begins. The
        drain window and Sanic's own shutdown wait are over by the deadline: a worker still alive then is
        killed, so the Coordinator exits."""
        time.sleep(self.stop_deadline_s)
        for process in self._servers():
            if process.is_alive():
                log.error(
                    "worker %s (pid %s) is still running %.0f s after the stop signal: killing it",
                    process.name,
                    process.pid,
                    self.stop_deadline_s,
                )
                try:
                    os.kill(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def _exit_during_startup(self, sig: int) -> None:
        log.warning(
            "%s before every worker started: stopping the workers and exiting (Sanic's start-up wait would never end)",
            signal.Signals(sig).name,
        )
        children = multiprocessing.active_children()  # the workers and Sanic's state manager process
        for child in children:
            try:
                child.kill()
            except Exception:
                pass
        deadline = time.monotonic() + 5
        for child in children:
            child.join(max(0.0, deadline - time.monotonic()))
        if os.environ.get("MOTOR_OWNS_PROM_DIR"):
            shutil.rmtree(os.environ.get("PROMETHEUS_MULTIPROC_DIR", ""), ignore_errors=True)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(128 + sig)

    # -- dead workers ---------------------------------------------------------------------------------

    def _startup_over(self) -> bool:
        """Sanic's start-up wait (`wait_for_ack`) is over. Only its monitor loop, which runs after that wait,
        moves a process's own state (main process side) past STARTED: to ACKED by `_sync_states`, or to a
        final state."""
        from sanic.worker.constants import ProcessState

        if not self.ready:
            self.ready = any(
                p.state >= ProcessState.ACKED or p.state is ProcessState.RESTARTING for p in self._servers()
            )
        return self.ready

    def _run(self) -> None:
        announced = False
        while not self.stopping:
            time.sleep(self.interval_s)
            if self.stopping or self.shared.globals.draining or getattr(self.manager, "_shutting_down", False):
                self._stop_late_restarts()
                return
            if not self._startup_over():
                continue
            if not announced:  # from here a stop signal drains (before it, the Coordinator exits at once)
                announced = True
                log.info("every worker started: a stop signal now drains")
            try:
                self._check()
            except Exception:
                log.exception("worker supervisor check failed")

    def _stop_late_restarts(self) -> None:
        """A restart sent just before the stop signal is started by Sanic's monitor loop after its shutdown
        stopped the workers then alive; Sanic would then wait for that new worker for ever. Stop it too."""
        if time.monotonic() - self.last_sent > 10:
            return
        time.sleep(2 * self.interval_s)  # let the monitor loop handle what is on its pipe
        for process in self._servers():
            if process.is_alive() and process.pid not in self.stopped_pids:
                log.warning(
                    "stopping worker %s (pid %s), restarted as the Coordinator began to stop", process.name, process.pid
                )
                process.terminate()

    def _silence(self, process: Any, current: Any, now: float) -> float:
        """How long a live worker's event loop has not run its heartbeat (0: not beating yet, or killed)."""
        beat_ms = self.shared.workers[worker_index(process.name)].heartbeat_ms
        if not beat_ms or current in self.killed:
            return 0.0  # starting (its row was zeroed), or already killed
        return now - beat_ms / 1000

    def _kill_stalest(self, silent: list[tuple[Any, Any]]) -> None:
        """Kill the live worker whose heartbeat is the oldest past the timeout, if any still is.

        One per pass, and none while the last kill is not yet handled (for up to KILL_SETTLE_S): a worker
        stopped inside a critical section blocks every other worker on the lock, and their heartbeats stop
        too (within a heartbeat of its own, so the stalest may be one of them: its death frees the lock,
        see _handle_death, and the stopped worker goes at a later pass)."""
        now = time.monotonic()  # fresh: the pass may have waited for the lock
        if self.stopping or now < self.quiet_until or any(now - at < KILL_SETTLE_S for at in self.killed.values()):
            return
        silent_s, process, current = max(((self._silence(p, c, now), p, c) for p, c in silent), key=lambda t: t[0])
        if silent_s <= self.watchdog_timeout_s:
            return
        log.error(
            "worker %s (pid %s) has not run its event loop for %.1f s (worker_watchdog_timeout %g s): killing it",
            process.name,
            current.pid,
            silent_s,
            self.watchdog_timeout_s,
        )
        self.killed[current] = now
        try:
            os.kill(current.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _servers(self) -> list[Any]:
        return [p for p in list(self.manager.transient_processes) if p.name.startswith(SERVER_PREFIX)]

    def _check(self) -> None:
        # Sanic's monitor loop (`_sync_states`) reaps a dead process and marks it FAILED (non-zero exit,
        # a signal) or COMPLETED (exit 0: a worker stopped by a signal of its own); the exit code is read
        # only then, when the process object has it already. A restart (also that loop's) swaps the OS
        # process under the WorkerProcess, so each is read once, as `current`, after the state: a swap in
        # between shows the new process, whose exitcode is a waitpid(WNOHANG) that races nothing harmful
        # (both threads share that process object, which keeps the exit status once either reaps it).
        from sanic.worker.constants import ProcessState

        now = time.monotonic()
        if now - self.last_pass > self.interval_s + HEARTBEAT_S:  # this thread did not run for a while
            self.quiet_until = max(self.quiet_until, now + 2 * HEARTBEAT_S)  # every heartbeat looks old
        self.last_pass = now
        silent: list[tuple[Any, Any]] = []  # live workers past the watchdog timeout
        for process in self._servers():
            state, current = process.state, process._current_process
            if state not in (ProcessState.FAILED, ProcessState.COMPLETED) or current.exitcode is None:
                if self.watchdog_timeout_s and self._silence(process, current, now) > self.watchdog_timeout_s:
                    silent.append((process, current))
                continue
            name = process.name
            if current not in self.handled:
                self.handled.add(current)
                self._handle_death(name, current, now)
            if now < self.due.get(name, 0.0):
                continue
            self.due[name] = float("inf")  # sent once per death; the restarted process is handled anew
            self.started_at[name] = time.monotonic()  # (the pass may have waited for the lock)
            with self.pipe_lock:
                if self.stopping:
                    return
                self.manager.monitor_publisher.send(name)
                self.last_sent = time.monotonic()
        if silent:
            self._kill_stalest(silent)

    def _handle_death(self, name: str, current: Any, now: float) -> None:
        pid, code = current.pid, current.exitcode
        log.error(
            "worker %s (pid %s) exited with code %s while the Coordinator runs: releasing what it held and "
            "restarting it",
            name,
            pid,
            code,
        )
        lived = now - self.started_at.get(name, float("-inf"))  # restarted by the supervisor how long ago
        delay = min(MAX_DELAY_S, max(1.0, 2 * self.delay.get(name, 0.0))) if lived < QUICK_DEATH_S else 0.0
        self.delay[name] = delay
        self.due[name] = now + delay  # first: whatever follows, the restart is scheduled
        if delay:
            log.error("worker %s died %.1f s after its start: restarting it in %.0f s", name, lived, delay)
        self.shared.clear_worker(worker_index(name))
        # Workers that waited on the dead one (the watchdog's victim, or the lock's holder) were blocked,
        # not hung: they get to beat again before the watchdog judges them.
        blocked_others = self.killed.pop(current, None) is not None
        # Only a process killed by a signal can leave a critical section without releasing the lock.
        if code < 0 and self.shared.release_if_stuck(STUCK_LOCK_S):
            log.error("worker %s (pid %s) died holding the shared lock: released it", name, pid)
            blocked_others = True
        if blocked_others:
            self.quiet_until = time.monotonic() + 2 * HEARTBEAT_S + self.interval_s
