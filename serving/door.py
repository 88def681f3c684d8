"""The door: draining, the global in-flight cap and the rate limit, held across all workers.

(SLO admission, which decides by predicted latency, is scheduling/admission.py.)

Each worker counts its requests in flight in its own row of shared memory (`SharedState.workers`); the cap
check sums the rows and takes a place under the shared lock, so N workers admit what the configuration
says, not N times it. Giving a place back is a store to the worker's own row (no lock). Since no worker
writes another's row, the main process can zero the row of a worker that died (app.py's supervisor), and
the places that worker held come back. The rate limit's token bucket is one shared bucket, changed under
the lock. Each worker also keeps its own admitted requests, so that on shutdown it can wait for them (the
drain window) and then end the rest.

Draining: the global flag is set by the main process when the whole Coordinator stops (app.py); a worker
that is stopped on its own (a signal to that process) drains alone, with its own flag.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from config import Live
from errors import RateLimited, ServiceUnavailable
from state.quotas import refill, wait_s
from state.shared import SharedState, worker_rows


class Admitted:
    """An admitted request's place: counted in flight, and known to this worker's drain, until released."""

    __slots__ = ("clustered", "door", "pending", "task", "tenant")

    def __init__(self, door: Door):
        # pending: the cluster-wide check still to await inside the block (cluster mode), which raises if refused
        # or sets `clustered`: the place is counted in the store too; `tenant`: its tenant's quota, asked in the
        # same round trip (serving/tenants.py's Ask)
        self.door, self.pending, self.task, self.clustered, self.tenant = door, None, None, False, None

    # A plain (not async) context manager: entering and leaving never wait, so they need no coroutines.
    def __enter__(self) -> Admitted:
        door = self.door
        if door.loop is None:
            door.loop = asyncio.get_running_loop()
        self.task = asyncio.current_task(door.loop)  # (3.11 finds the running loop with a getpid syscall)
        door.local.add(self.task)
        return self

    def __exit__(self, *exc) -> None:
        self.door._leave(self.task)
        if self.clustered:
            self.door.cluster.left()


class Attended(Admitted):
    """A request that takes no place but that this worker's drain waits for: an engine's metaserver call, part of
    a client request admitted (and counted) on whichever worker its client reached."""

    __slots__ = ()

    def __exit__(self, *exc) -> None:
        self.door.local.discard(self.task)


class Door:
    def __init__(
        self,
        live: Live,
        shared: SharedState,
        worker: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.live, self.shared, self.lock = live, shared, shared.hot_lock
        self.clock = clock
        self.loop: asyncio.AbstractEventLoop | None = None  # the worker's, known from its first request
        self.g = shared.globals
        self.mine = shared.workers[worker]  # this worker's row: its in-flight counter
        self.rows = worker_rows(shared, worker, live.s.num_workers)
        self.cluster = None  # cluster mode's serving/cluster.py Cluster: the cap and the rate hold for all replicas
        self.stopping = False  # this worker drains (its own stop signal, or the whole Coordinator's)
        self.local: set[asyncio.Task] = set()  # this worker's admitted requests
        self.cut: set[asyncio.Task] = set()  # those the drain window ended
        self._drain: asyncio.Task | None = None

    @property
    def draining(self) -> bool:
        """This worker refuses new requests: the Coordinator is shutting down, or this worker is."""
        return self.stopping or bool(self.g.draining)

    def set_draining(self) -> None:
        """This worker drains. The whole Coordinator's flag is the main process's to set (app.py)."""
        self.stopping = True

    def inflight(self) -> int:
        """Requests in flight, all workers."""
        return sum(row.inflight for row in self.rows)

    def _take_rate_token(self, rate: float | None = None, burst_milli: int | None = None) -> float:
        """0 when admitted, else seconds until a token is available (at `rate` with a bucket of `burst_milli`:
        this replica's share while the cluster store is away; the configured ones by default)."""
        if rate is None or burst_milli is None:
            rate, burst_milli = self.live.s.bucket
        g = self.g
        # The monotonic clock is one clock for every process on the host, and never steps back: with the
        # wall clock, an NTP correction of a minute refused every request for a minute.
        now_us = int(self.clock() * 1e6)
        with self.lock:
            tokens, stamp = refill(g.rate_tokens_milli, g.rate_stamp_us, now_us, rate, burst_milli)
            tokens, g.rate_stamp_us = int(tokens), int(stamp)  # (a float rate's whole floats)
            if tokens >= 1000:
                g.rate_tokens_milli = tokens - 1000
                return 0.0
            g.rate_tokens_milli = tokens
            return wait_s(tokens, 1000, rate)

    def admit(self) -> Admitted:
        """Let one request in, or raise why not: `with door.admit():` holds its place until the block ends."""
        if self.stopping or self.g.draining:
            raise ServiceUnavailable.draining()
        s, cluster = self.live.s, self.cluster  # a reload's limits from the next request on (the bucket's tokens stay)
        cap, (rate, burst_milli) = s.max_inflight_requests, s.bucket
        if cluster is not None and (cap or rate):
            if cluster.connected:  # one round trip, awaited in the block: `pending`
                self.mine.inflight += 1
                place = Admitted(self)
                place.pending = cluster.admit(place, cap, rate, burst_milli)
                return place
            # The store is away: this replica's share of the limits.
            cap = cluster.share(cap) if cap else 0
            rate, burst_milli = rate / cluster.replicas, max(1000, burst_milli // cluster.replicas)
        if rate > 0:
            waiting_s = self._take_rate_token(rate, burst_milli)
            if waiting_s > 0:
                raise RateLimited.by_rate(s.error_message, s.error_status_code, waiting_s)
        if cap:
            with self.lock:
                n = 0
                for row in self.rows:
                    n += row.inflight
                if n >= cap:
                    raise RateLimited(f"too many requests in flight (limit {cap})", reason="inflight_cap")
                self.mine.inflight += 1
        else:
            self.mine.inflight += 1  # only this worker writes its row: no lock without a cap to check
        return Admitted(self)

    def attend(self) -> Attended:
        """`with door.attend():` the drain waits for the block as for an admitted request; no place is taken,
        and a draining worker does not refuse it (the client request it belongs to is already in)."""
        return Attended(self)

    def _leave(self, task: asyncio.Task | None) -> None:
        self.local.discard(task)
        # Only this worker writes its row, and a stale read elsewhere can only over-count: no lock.
        self.mine.inflight -= 1

    async def drain(self, timeout_s: float) -> None:
        """Shutdown: refuse new requests, give this worker's in-flight ones `timeout_s`, then cancel the rest.

        Idempotent (Sanic runs the stop listeners once per served port); the cancelled requests are in
        `cut`, so their handlers can tell the client why the stream ends.
        """
        self.set_draining()
        if self._drain is None:
            self._drain = asyncio.get_running_loop().create_task(self._run_drain(timeout_s))
        await asyncio.shield(self._drain)

    async def _run_drain(self, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.local and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for task in list(self.local):
            self.cut.add(task)
            task.cancel()
        deadline = loop.time() + 1.0  # time to write the error events
        while self.local and loop.time() < deadline:
            await asyncio.sleep(0.02)

    def was_cut(self, task: asyncio.Task | None) -> bool:
        """Did the drain window end this request (rather than its client going away)?"""
        if task in self.cut:
            self.cut.discard(task)
            return True
        return False
