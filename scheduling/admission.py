"""SLO admission (`scheduler_config.admission`): what happens when no engine can meet a request's budget.

The policy's plan carries a verdict (scheduling/policies.py). `off` serves every plan. `reject`
refuses a plan predicted to miss its TTFT or TPOT budget (`OverBudget`: the Coordinator answers 429
with Retry-After) instead of piling more work on engines that are already late. `queue` parks it in a
bounded wait list and plans it again every tick (and at once when a request of this worker finishes); it
leaves the list when a plan meets the budget that is left, or with `OverBudget` when the list is full or
the budget left is below the predicted TTFT on empty queues (no wait can help any more).

The list is served in order of x-priority class (interactive, standard, batch), within a class by tenant,
the least virtual counter of tokens served first (scheduling/fairness.py: the Coordinator's counters, so a
tenant served much by another worker waits behind one served little), and within a tenant earliest
deadline (arrival + TTFT budget) first. A request that arrives while one of its class or a higher one waits
here joins the list rather than pass it, and in a tick no request of a model is let in after one of a
higher class of that model was not.

Each worker keeps its own list; their total length is bounded across workers: each worker counts its
waiting requests in its own row of shared memory, and the bound is checked on the sum of the rows (a
dead worker's row is zeroed by the main process, app.py). A
verdict of None (the model does not know the engines yet) always admits, and so does a plan whose engines
have nothing in flight (scheduler.py).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable

from scheduling import clock
from scheduling.fairness import FairShare
from scheduling.policies import MARGIN
from state.shared import SharedState, worker_rows

OFF, QUEUE, REJECT = "off", "queue", "reject"


class OverBudget(Exception):
    """No engine can meet the request's SLO budget now."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class AdmissionQueue:
    """This worker's requests waiting for a plan within budget: by class, tenant's fair share, then deadline."""

    def __init__(
        self,
        shared: SharedState,
        size: int,
        tick_s: float = 0.005,
        tries_per_tick: int = 8,
        worker: int = 0,
        num_workers: int = 1,
    ):
        self.lock = shared.lock
        self.mine = shared.workers[worker]  # this worker's row: its queued count
        self.rows = worker_rows(shared, worker, num_workers)
        self.size = size
        self.tick_s = tick_s
        self.tries = tries_per_tick
        self.heap: list = []  # [deadline, seq, future, job, plan_fn]
        self.seq = itertools.count()
        self.fair = FairShare(shared, worker, num_workers)  # the tenants' counters the list is ordered by
        self.waiting = [0, 0, 0]  # requests waiting here, by class
        self.pump: asyncio.Task | None = None
        self.wake = asyncio.Event()

    def __len__(self) -> int:
        return sum(1 for e in self.heap if not e[2].done())

    async def wait(self, job, plan: Callable[[], object]):
        """Park `job` until `plan()` returns a plan (None: not let in yet); returns that plan."""
        mine = self.mine
        with self.lock:
            if sum(row.queued for row in self.rows) >= self.size:
                raise OverBudget(f"the SLO admission queue is full ({self.size} requests)", job.retry_after_s)
            mine.queued += 1
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        heapq.heappush(self.heap, [job.arrived + job.slo_ttft_ms / 1000.0, next(self.seq), fut, job, plan])
        self.waiting[job.priority] += 1
        if self.pump is None or self.pump.done():
            self.pump = loop.create_task(self._pump())
        self.wake.set()  # it may be let in now (it waited only behind its betters)
        try:
            return await fut
        finally:
            if not fut.done():
                fut.cancel()
            mine.queued -= 1  # only this worker writes its row
            self.waiting[job.priority] -= 1

    def ahead(self, job) -> bool:
        """Does a request of `job`'s class or a higher one wait here (`job` then waits too, in its order)?"""
        return any(self.waiting[: job.priority + 1])

    def _order(self) -> list:
        """The waiting entries in the order they are served: class, tenant's counter, deadline."""
        counters: dict[str, float] = {}  # each tenant's counter read once (a sum over the workers)

        def counter(tenant: str) -> float:
            found = counters.get(tenant)
            if found is None:
                found = counters[tenant] = self.fair.counter(tenant)
            return found

        return sorted(
            (e for e in self.heap if not e[2].done()),
            key=lambda e: (e[3].priority, counter(e[3].tenant), e[0], e[1]),
        )

    def poke(self) -> None:
        """Capacity was freed: try the waiting requests now rather than at the next tick."""
        if self.heap:
            self.wake.set()

    async def _pump(self) -> None:
        while self.heap:
            self.wake.clear()
            try:
                await asyncio.wait_for(self.wake.wait(), self.tick_s)
            except TimeoutError:
                pass
            heap = self.heap
            while heap and heap[0][2].done():
                heapq.heappop(heap)
            held: dict[str, int] = {}  # model -> the highest class of it not let in this tick
            for entry in self._order()[: self.tries]:
                fut, job, plan = entry[2], entry[3], entry[4]
                if fut.done():
                    continue
                if held.get(job.model, job.priority) < job.priority:
                    continue
                try:
                    result = plan()
                except Exception as e:  # NoCapacity and the like: the waiting request answers it
                    fut.set_exception(e)
                    continue
                if result is not None:
                    self.fair.admitted(job)
                    fut.set_result(result)
                    # Let the admitted request take its leases before the next one is judged.
                    await asyncio.sleep(0)
                    continue
                left = job.slo_ttft_ms / 1000.0 - (clock.now() - job.arrived)
                if MARGIN * left < job.floor_s:
                    fut.set_exception(
                        OverBudget("the SLO budget ran out while the request waited for capacity", job.retry_after_s)
                    )
                    continue
                held.setdefault(job.model, job.priority)
