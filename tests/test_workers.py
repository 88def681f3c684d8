"""A worker process that dies or is stopped on its own, and a stop signal during start-up.

Each test runs `python app.py` with several Sanic workers (harness/coordinator.py) and acts on one worker process
with a real signal. The main process's supervisor (workers/supervisor.py) must give back what a dead worker
held in shared memory, restart it (under the same name, so worker 0 resumes health checks), and only a
stop of the whole Coordinator may put it in draining.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager

import httpx

from harness import ROOT
from harness.bodies import chat_body
from harness.configs import coordinator_config, instance
from harness.coordinator import Coordinator
from harness.ledger import IN_FLIGHT, ledger
from harness.loopback import wait_until
from tests.conftest import MODEL
from workers.supervisor import STOP_GRACE_S


def chat(coord, max_tokens: int = 2, **extra) -> httpx.Response:
    body = chat_body(MODEL, max_tokens=max_tokens, **extra)
    return httpx.post(coord.url + "/v1/chat/completions", json=body, timeout=30)


def long_stream(coord, tokens: int) -> None:
    body = chat_body(MODEL, True, tokens, "long", ignore_eos=True)
    try:
        with httpx.stream("POST", coord.url + "/v1/chat/completions", json=body, timeout=60) as r:
            r.read()
    except httpx.HTTPError:
        pass  # the streams the killed worker served end with a broken connection


def metric(coord, name: str) -> float | None:
    try:
        text = httpx.get(coord.obs + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def idle(coord) -> bool:
    """No request in flight, nothing on any engine's ledger column (requests, tokens, held decode slots)."""
    try:
        zero = all(load[k] == 0 for load in ledger(coord) for k in (*IN_FLIGHT, "held_decode_slots"))
    except httpx.HTTPError:
        return False
    return zero and metric(coord, "motor_inflight_requests") == 0


def restarted(coord, name: str, old_pid: int, timeout_s: float = 45) -> int:
    """Wait until worker `name` runs again under a new pid and logged itself ready; return the pid."""

    def up() -> bool:
        pid = coord.server_workers().get(name)
        return pid is not None and pid != old_pid and f"Worker ready [{pid}]" in coord.output()

    assert wait_until(up, timeout_s=timeout_s, interval_s=0.2), coord.output()[-3000:]
    return coord.server_workers()[name]


def served_by(coord, pid: int, since: int) -> bool:
    return f"coordinator.request[{pid}]" in coord.output()[since:]


def test_a_killed_worker_gives_back_its_load_and_is_restarted(sims):
    a, b = sims("union", speedup=2.0), sims("union", speedup=2.0)
    cfg = coordinator_config(
        [instance(1, "union", MODEL, a.address), instance(2, "union", MODEL, b.address)],
        inference_workers_config={"num_workers": 3},
        rate_limit_config={"max_inflight_requests": 6},
        scheduler_config={
            "scheduler_type": "load_balance",
            "health_check_interval": 0.2,
            "metrics_scrape_interval": 0.2,
        },
    )
    with Coordinator(cfg) as coord:
        workers = coord.server_workers()
        assert len(workers) == 3
        # 400 tokens at 5 ms each: about 2 s a stream, so they are all running when the worker dies.
        streams = [threading.Thread(target=long_stream, args=(coord, 400)) for _ in range(6)]
        for t in streams:
            t.start()
        try:
            assert wait_until(lambda: a.stats()["running"] + b.stats()["running"] == 6, timeout_s=20)
            assert metric(coord, "motor_inflight_requests") == 6
            victim = "Sanic-Server-1-0"
            os.kill(workers[victim], signal.SIGKILL)
        finally:
            for t in streams:
                t.join(90)
        # What the dead worker held is given back: no ghost load on the engines, no ghost in-flight places.
        assert wait_until(lambda: idle(coord), timeout_s=30, interval_s=0.2), ledger(coord)
        assert wait_until(lambda: a.stats()["running"] + b.stats()["running"] == 0, timeout_s=20)
        assert f"worker {victim} (pid {workers[victim]}) exited with code -9" in coord.output()
        new_pid = restarted(coord, victim, workers[victim])
        assert new_pid not in workers.values()
        # The cap is whole again, and load balancing spreads requests over both engines again.
        a.reset()
        b.reset()
        mark = len(coord.output())
        statuses = [chat(coord).status_code for _ in range(20)]
        assert statuses == [200] * 20
        assert a.stats()["received"] > 0 and b.stats()["received"] > 0, (a.stats()["received"], b.stats()["received"])
        # The restarted worker serves (the kernel hands new connections to any worker: keep asking a while).
        assert wait_until(lambda: chat(coord).status_code == 200 and served_by(coord, new_pid, mark), timeout_s=30)
        six = [threading.Thread(target=long_stream, args=(coord, 200)) for _ in range(6)]
        for t in six:
            t.start()
        try:
            assert wait_until(lambda: a.stats()["running"] + b.stats()["running"] == 6, timeout_s=20)
        finally:
            for t in six:
                t.join(90)
        assert wait_until(lambda: idle(coord), timeout_s=30)


def test_health_checks_resume_when_worker_0_is_killed(sims):
    a = sims("union")
    cfg = coordinator_config([instance(1, "union", MODEL, a.address)], inference_workers_config={"num_workers": 2})
    with Coordinator(cfg) as coord:
        workers = coord.server_workers()
        os.kill(workers["Sanic-Server-0-0"], signal.SIGKILL)
        restarted(coord, "Sanic-Server-0-0", workers["Sanic-Server-0-0"])

        def healthy() -> bool:
            r = httpx.get(coord.mgmt + "/instances", timeout=5)
            return r.json()["instances"][0]["endpoints"][0]["healthy"]

        # Worker 0 checks every engine's /health for all workers: checks must run again after its restart.
        a.set_faults(health_status=503)
        assert wait_until(lambda: not healthy(), timeout_s=20)
        assert chat(coord).status_code == 503  # no healthy instance left
        a.clear_faults()
        assert wait_until(healthy, timeout_s=20)
        assert chat(coord).status_code == 200


def test_a_worker_whose_loop_stops_is_killed_and_restarted(sims):
    """A worker that hangs without exiting (SIGSTOP: its event loop makes no progress) would leave the
    connections the kernel hands it unanswered for good. Its heartbeat goes stale, the watchdog kills it,
    and it is restarted like a dead worker."""
    a = sims("union")
    cfg = coordinator_config(
        [instance(1, "union", MODEL, a.address)],
        inference_workers_config={"num_workers": 2, "worker_watchdog_timeout": 5},
    )
    with Coordinator(cfg) as coord:
        workers = coord.server_workers()
        victim = "Sanic-Server-1-0"
        os.kill(workers[victim], signal.SIGSTOP)
        try:
            new_pid = restarted(coord, victim, workers[victim])
        finally:
            try:
                os.kill(workers[victim], signal.SIGCONT)  # only if the watchdog did not kill it
            except ProcessLookupError:
                pass
        assert f"worker {victim} (pid {workers[victim]}) has not run its event loop" in coord.output()
        assert f"worker {victim} (pid {workers[victim]}) exited with code -9" in coord.output()
        assert new_pid not in workers.values()
        mark = len(coord.output())
        assert [chat(coord).status_code for _ in range(10)] == [200] * 10
        assert wait_until(lambda: chat(coord).status_code == 200 and served_by(coord, new_pid, mark), timeout_s=30)
        # The other worker, alive and beating all along, was left alone.
        assert coord.server_workers()["Sanic-Server-0-0"] == workers["Sanic-Server-0-0"]


def running(pid: int) -> bool:
    """The process exists and has not exited (an exited one stays a zombie until whoever adopted it reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_worker_hung_when_the_coordinator_stops_is_killed_and_the_coordinator_exits(sims):
    """The watchdog stands down once the stop begins, and a hung worker never hears the manager's SIGINT:
    Sanic's shutdown waited for it for good. It is killed STOP_GRACE_S after the drain window."""
    a = sims("union")
    cfg = coordinator_config(
        [instance(1, "union", MODEL, a.address)],
        inference_workers_config={"num_workers": 2, "worker_watchdog_timeout": 30},
        shutdown_config={"drain_timeout": 1},
    )
    with Coordinator(cfg) as coord:
        workers = coord.server_workers()
        victim = "Sanic-Server-1-0"
        assert coord.every_worker_started()
        os.kill(workers[victim], signal.SIGSTOP)
        try:
            started = time.monotonic()
            coord.proc.send_signal(signal.SIGTERM)
            code = coord.proc.wait(1 + STOP_GRACE_S + 20)
            took = time.monotonic() - started
        finally:
            try:
                os.kill(workers[victim], signal.SIGCONT)
            except ProcessLookupError:
                pass
        assert f"worker {victim} (pid {workers[victim]}) is still running" in coord.output()
        assert 1 + STOP_GRACE_S - 1 <= took <= 1 + STOP_GRACE_S + 10, took
        assert not running(workers[victim]) and code is not None


def test_workers_whose_main_process_died_stop_themselves(sims):
    """Nothing supervises a worker whose main process was killed (OOM, SIGKILL): it went on serving on the
    inherited sockets, ready, and kept the ports from a new Coordinator. It drains and exits instead."""
    a = sims("union")
    cfg = coordinator_config([instance(1, "union", MODEL, a.address)], inference_workers_config={"num_workers": 2})
    with Coordinator(cfg) as coord:
        workers = coord.server_workers()
        coord.proc.kill()
        try:
            assert wait_until(lambda: not any(running(pid) for pid in workers.values()), timeout_s=15)
        finally:
            for pid in workers.values():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        assert "the main process (pid %d) is gone: stopping" % coord.proc.pid in coord.output()


def test_sigterm_to_one_worker_drains_only_that_worker(sims):
    a = sims("union")
    cfg = coordinator_config([instance(1, "union", MODEL, a.address)], inference_workers_config={"num_workers": 3})
    with Coordinator(cfg) as coord:
        workers = coord.server_workers()
        victim = "Sanic-Server-2-0"
        os.kill(workers[victim], signal.SIGTERM)
        # That worker drains (nothing in flight: at once) and exits; the Coordinator is not shutting down:
        # the other workers go on serving and say they are ready (they once all answered 503 for good).
        assert wait_until(lambda: f"Worker complete [{workers[victim]}]" in coord.output(), timeout_s=20)
        for _ in range(10):
            assert chat(coord).status_code == 200
            assert httpx.get(coord.mgmt + "/readiness", timeout=5).status_code == 200
        # And the supervisor starts it again.
        restarted(coord, victim, workers[victim])
        assert coord.proc.poll() is None
        for _ in range(20):
            assert chat(coord).status_code == 200
            r = httpx.get(coord.mgmt + "/readiness", timeout=5)
            assert r.status_code == 200 and r.json()["ready"] is True
        assert metric(coord, "motor_draining") == 0
        # A stop of the whole Coordinator still drains and exits cleanly (its log said why when not).
        code = coord.proc.stop(20.0)
        assert code == 0, coord.output()[-4000:]


def test_sigterm_to_the_whole_process_group_stops_cleanly(sims):
    """`kill -TERM -- -PGID` (docker stop, most supervisors) reaches Sanic's state manager process too, which the
    main process still needs to stop its workers: when that one went first, the main process failed with
    `Experienced exception while trying to serve`, a BrokenPipeError traceback and exit 1. The kernel signals a
    group's processes in no set order; here the state manager's signal comes first, which made that certain."""
    a = sims("union")
    cfg = coordinator_config([instance(1, "union", MODEL, a.address)], inference_workers_config={"num_workers": 2})
    with Coordinator(cfg) as coord:
        servers = set(coord.server_workers().values())
        [state_manager] = [pid for pid in coord.worker_pids() if pid not in servers]
        assert coord.every_worker_started()
        os.kill(state_manager, signal.SIGTERM)
        # The main process's monitor loop reads the state manager's table every 0.1 s: time to find it gone.
        wait_until(lambda: coord.proc.poll() is not None, timeout_s=3)
        os.killpg(coord.proc.pid, signal.SIGTERM)
        code = coord.proc.wait(30)
        output = coord.output()
        assert code == 0, output[-4000:]
        assert "Traceback" not in output and "Experienced exception" not in output, output[-4000:]
        assert wait_until(lambda: not any(running(pid) for pid in (*servers, state_manager)), timeout_s=10)


def test_sigterm_before_the_workers_are_ready_exits_promptly(sims):
    """Sanic's start-up wait puts a stop message back on its pipe for ever while a worker has not acknowledged
    its start (sanic #2997): the main process spun, holding the ports. It now kills the workers and exits."""
    a = sims("union")
    cfg = coordinator_config([instance(1, "union", MODEL, a.address)], inference_workers_config={"num_workers": 3})
    fd, path = tempfile.mkstemp(suffix=".json", prefix="motor-test-")
    with os.fdopen(fd, "w") as f:
        json.dump({"motor_coordinator_config": cfg}, f)
    log_path = path + ".log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "app.py"), "--config", path],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def output() -> str:
        with open(log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    try:
        # A worker process has started, and not every worker has said it is ready.
        assert wait_until(lambda: "Starting worker" in output(), timeout_s=60, interval_s=0.01), output()
        assert output().count("Worker ready") < 3
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(20)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                "the Coordinator did not exit within 20 s of SIGTERM during start-up:\n" + output()
            ) from None
        assert code == 128 + signal.SIGTERM, output()

        def group_gone() -> bool:
            return subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True).returncode != 0

        assert wait_until(group_gone, timeout_s=10), "processes of the Coordinator are left"
    finally:
        if proc.poll() is None or subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True).returncode == 0:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(5)
        for p in (path, log_path):
            os.unlink(p)


def _take_the_lock_and_die(shared) -> None:
    shared.lock.acquire()
    os._exit(9)  # like the OOM killer: no finally, no release


def test_the_shared_lock_a_dead_worker_held_is_released():
    """What the supervisor does for a dead worker, on a real semaphore: a process killed inside a critical
    section leaves the lock taken for good (every worker would block on it), and `release_if_stuck` frees it;
    a lock that is free or only briefly taken is left alone."""
    import multiprocessing

    from state.shared import SharedState

    shared = SharedState.create()
    assert not shared.release_if_stuck(0.1)  # free: left alone
    taker = multiprocessing.get_context("spawn").Process(target=_take_the_lock_and_die, args=(shared,))
    taker.start()
    taker.join(60)
    assert taker.exitcode == 9
    assert not shared.lock.acquire(timeout=0.2)  # stuck: nobody will ever release it
    assert shared.release_if_stuck(0.2)
    assert shared.lock.acquire(timeout=1)
    threading.Timer(0.2, shared.lock.release).start()  # taken, but by a live holder that lets go in time
    assert not shared.release_if_stuck(5)
    assert shared.lock.acquire(timeout=1)
    shared.lock.release()


# -- the supervisor's decisions, on real processes and a real semaphore, with Sanic's manager stood in for ---


class _OS:
    """An OS process as a WorkerProcess holds it (`_current_process`): a restart swaps in a new one."""

    def __init__(self, pid: int | None, exitcode: int | None = None):
        self.pid, self.exitcode = pid, exitcode


class _Process:
    """What the supervisor reads of one of Sanic's WorkerProcess objects."""

    def __init__(self, name: str, state, current: _OS):
        self.name, self.state, self._current_process = name, state, current


class _Manager:
    def __init__(self, processes: list):
        self.transient_processes = processes
        self.sent: list[str] = []
        self.monitor_publisher = self

    def send(self, name: str) -> None:
        self.sent.append(name)


def _take_the_lock_and_be_killed(shared) -> None:
    shared.lock.acquire()
    os.kill(os.getpid(), signal.SIGKILL)


def test_the_supervisor_releases_the_lock_only_of_a_worker_killed_by_a_signal():
    import multiprocessing

    from sanic.worker.constants import ProcessState

    from state.shared import SharedState
    from workers.supervisor import Supervisor

    shared = SharedState.create()
    taker = multiprocessing.get_context("spawn").Process(target=_take_the_lock_and_be_killed, args=(shared,))
    taker.start()
    taker.join(60)
    assert taker.exitcode == -9 and not shared.lock.acquire(timeout=0.1)
    # Still marked FAILED while Sanic's restart has already swapped in the new, unstarted process: not a death.
    swapping = _Manager([_Process("Sanic-Server-1-0", ProcessState.FAILED, _OS(None))])
    Supervisor(swapping, shared, watchdog_timeout_s=30)._check()
    assert swapping.sent == []
    # A worker that exited by itself (code 0) left its critical sections through their `with`: not its lock.
    clean = _Manager([_Process("Sanic-Server-1-0", ProcessState.COMPLETED, _OS(taker.pid, 0))])
    Supervisor(clean, shared, watchdog_timeout_s=30)._check()
    assert clean.sent == ["Sanic-Server-1-0"] and not shared.lock.acquire(timeout=0.1)
    killed = _Manager([_Process("Sanic-Server-1-0", ProcessState.FAILED, _OS(taker.pid, -9))])
    supervisor = Supervisor(killed, shared, watchdog_timeout_s=30)
    supervisor._check()
    assert killed.sent == ["Sanic-Server-1-0"] and shared.lock.acquire(timeout=1)
    shared.lock.release()
    supervisor._check()  # handled once: no second restart for the same death
    assert killed.sent == ["Sanic-Server-1-0"]


@contextmanager
def _watched_workers(ages_s: tuple[float, ...]):
    """Live processes standing in for workers whose heartbeats are `ages_s` old (same instant: same age),
    with the shared state and the manager a Supervisor watches them through."""
    from sanic.worker.constants import ProcessState

    from state.shared import SharedState

    shared = SharedState.create()
    sleepers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) for _ in ages_s]
    try:
        now_ms = int(time.monotonic() * 1000)
        for worker, age_s in enumerate(ages_s):
            shared.workers[worker].heartbeat_ms = now_ms - int(age_s * 1000)
        processes = [_Process(f"Sanic-Server-{i}-0", ProcessState.ACKED, _OS(p.pid)) for i, p in enumerate(sleepers)]
        yield shared, _Manager(processes), sleepers
    finally:
        for p in sleepers:
            p.kill()
            p.wait()


def test_the_watchdog_kills_the_stalest_silent_worker_one_at_a_time():
    """A worker stopped inside a critical section blocks the others on the lock, so their heartbeats stop
    too: one is killed per pass, the stalest, and no other until that death is handled and the workers that
    were blocked have had a heartbeat's time."""
    from sanic.worker.constants import ProcessState

    from workers.supervisor import Supervisor

    with _watched_workers((12, 20, 0.5)) as (shared, manager, sleepers):  # silent 12 s, silent 20 s, beating
        processes = manager.transient_processes
        supervisor = Supervisor(manager, shared, watchdog_timeout_s=10)
        supervisor._check()
        assert sleepers[1].wait(10) == -signal.SIGKILL
        assert sleepers[0].poll() is None and sleepers[2].poll() is None
        supervisor._check()  # killed, but its death is not handled yet (Sanic has not reaped it): no other kill
        time.sleep(0.5)
        assert sleepers[0].poll() is None
        processes[1].state, processes[1]._current_process.exitcode = ProcessState.FAILED, -9
        supervisor._check()  # its death handled (and its restart asked for); the others get time to beat
        assert manager.sent == ["Sanic-Server-1-0"] and sleepers[0].poll() is None
        quiet_until = supervisor.quiet_until
        assert quiet_until > time.monotonic()

        def next_pass() -> bool:  # the supervisor's cadence (every 0.5 s)
            supervisor._check()
            return sleepers[0].poll() is not None

        # Still silent after that time: the next one goes.
        assert wait_until(next_pass, timeout_s=15, interval_s=0.4) and time.monotonic() >= quiet_until
        assert sleepers[0].wait(10) == -signal.SIGKILL and sleepers[2].poll() is None


def test_the_watchdog_picks_one_of_two_workers_silent_since_the_same_moment():
    """Heartbeats written in the same millisecond: the choice must not compare the processes themselves."""
    from workers.supervisor import Supervisor

    with _watched_workers((20, 20)) as (shared, manager, sleepers):
        Supervisor(manager, shared, watchdog_timeout_s=10)._check()
        assert wait_until(lambda: any(p.poll() is not None for p in sleepers), timeout_s=10)
        time.sleep(0.2)
        assert sorted(p.poll() is None for p in sleepers) == [False, True]  # one killed, one left
