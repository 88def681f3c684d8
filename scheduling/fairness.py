"""Weighted fair share of tokens between tenants (tenant_config's `weight`), in the spirit of VTC, and the headroom a
`batch` request leaves to the higher x-priority classes.

Each tenant has a virtual counter: the tokens it was served (its prompt's when a request is admitted, its output's
when it ends) divided by its weight. The SLO admission queue (scheduling/admission.py) serves, within a class, the
waiting request of the tenant with the least counter first. A tenant with nothing waiting or being served is not
active; when its next request comes, its counter is lifted to the least counter of the active tenants, so time spent
idle banks no credit.

The counters, the activity and when each class last came are the Coordinator's: shared memory (state/shared.py
`FairTable`, `FairCounts`) that every worker reads and adds to. A worker adds the tokens it serves and counts its
active requests in its own row, so the per-request steps take no lock; only a lift (a tenant coming back from idle
below the least active counter) and a tenant's first request in a worker, which claims or finds its row, take it.
"""

from __future__ import annotations

from scheduling import clock
from state.shared import MAX_FAIR_TENANTS, SharedState, tenant_hash

INTERACTIVE, STANDARD, BATCH = 0, 1, 2  # x-priority's classes (config.PRIORITIES), vLLM's `priority` values
# A batch request is admitted only while its plan is predicted within this share of the budget a higher class's may
# use (its TTFT and TPOT), when a request of a higher class came within HEADROOM_WINDOW_S: the rest is headroom, so
# that a batch flood cannot fill the engines to the brim an interactive request then finds.
BATCH_SHARE = 0.6
HEADROOM_WINDOW_S = 10.0


class FairShare:
    """One worker's view of the tenants' counters and activity (see the module docstring)."""

    def __init__(self, shared: SharedState, worker: int = 0, num_workers: int = 1):
        table, counts = shared.fair, shared.fair_counts
        self.table, self.lock = table, shared.hot_lock
        # Views of the columns, kept: making one costs more than reading through it.
        self.keys, self.lifts, self.seen = table.key, table.lift, table.seen
        workers = range(max(num_workers, worker + 1))
        self.served = tuple(counts[i].served for i in workers)
        self.active = tuple(counts[i].active for i in workers)
        self.my_served, self.my_active = counts[worker].served, counts[worker].active
        self.rows: dict[str, int] = {}  # tenant -> its row, as found (bounded by the tenants keys name)

    def row(self, tenant: str) -> int:
        """The tenant's row: found, else claimed (a full table's last row holds every tenant beyond it)."""
        found = self.rows.get(tenant)
        if found is not None:
            return found
        key, keys, table = tenant_hash(tenant) | 1, self.keys, self.table
        with self.lock:
            used = table.used
            at = next((i for i in range(used) if keys[i] == key), None)
            if at is None:
                at = min(used, MAX_FAIR_TENANTS - 1)
                if used < MAX_FAIR_TENANTS:
                    keys[at] = key
                    table.used = used + 1
        self.rows[tenant] = at
        return at

    def _counter(self, at: int) -> float:
        total = self.lifts[at]
        for column in self.served:
            total += column[at]
        return total

    def _active(self, at: int) -> int:
        """Whether row `at` has a request waiting or being served in some worker (0: none). A loop: any() over a
        generator costs twice as much for the few workers there are."""
        n = 0
        for column in self.active:
            n |= column[at]
        return n

    def arrive(self, tenant: str, priority: int) -> None:
        """A request of `tenant` comes in; a tenant not active until now is lifted to the active ones' least counter."""
        self.seen[priority] = clock.now()
        at = self.row(tenant)
        if not self._active(at):
            self._lift(at)
        self.my_active[at] += 1

    def _lift(self, at: int) -> None:
        least = None
        for r in range(self.table.used):
            if r != at and self._active(r):
                counter = self._counter(r)
                if least is None or counter < least:
                    least = counter
        if least is not None and self._counter(at) < least:
            with self.lock:  # two workers lifting one tenant at once lift it once
                gap = least - self._counter(at)
                if gap > 0:
                    self.lifts[at] += gap

    def charge(self, tenant: str, tokens: int, weight: float) -> None:
        """`tokens` served to `tenant`."""
        if tokens > 0:
            self.my_served[self.row(tenant)] += tokens / weight

    def admitted(self, job) -> None:
        """A request (its JobInfo) is let in: its prompt counts as served to its tenant."""
        self.charge(job.tenant, job.prompt_tokens, job.weight)

    def leave(self, tenant: str, output_tokens: int, weight: float) -> None:
        """A request of `tenant` ended, having generated `output_tokens`."""
        at = self.row(tenant)
        if output_tokens > 0:
            self.my_served[at] += output_tokens / weight
        self.my_active[at] -= 1

    def counter(self, tenant: str) -> float:
        return self._counter(self.row(tenant))

    def requests(self, tenant: str) -> int:
        """The tenant's requests waiting or being served, in every worker."""
        at = self.row(tenant)
        return sum(column[at] for column in self.active)

    def higher_class_seen(self, priority: int) -> bool:
        """Did a request of a class above `priority` come within HEADROOM_WINDOW_S?"""
        since = clock.now() - HEADROOM_WINDOW_S
        return any(0 < self.seen[c] >= since for c in range(priority))
