"""Weighted fair share of tokens between tenants (tenant_config's `weight`), in the spirit of VTC, and the headroom a
`batch` request leaves to the higher x-priority classes.

Each tenant has a virtual counter: the tokens it was served (its prompt's when a request is admitted, its output's
when it ends) divided by its weight. The SLO admission queue (scheduling/admission.py) serves, within a class, the
waiting request of the tenant with the least counter first. A tenant with nothing waiting or being served is not
active; when its next request comes, its counter is lifted to the least counter of the active tenants, so time spent
idle banks no credit. Counters are this worker's (each worker orders its own queue by what it served).
"""

from __future__ import annotations

from scheduling import clock

INTERACTIVE, STANDARD, BATCH = 0, 1, 2  # x-priority's classes (config.PRIORITIES), vLLM's `priority` values
# A batch request is admitted only while its plan is predicted within this share of the budget a higher class's may
# use (its TTFT and TPOT), when a request of a higher class came within HEADROOM_WINDOW_S: the rest is headroom, so
# that a batch flood cannot fill the engines to the brim an interactive request then finds.
BATCH_SHARE = 0.6
HEADROOM_WINDOW_S = 10.0


class FairShare:
    """This worker's tenants' virtual counters and activity (see the module docstring)."""

    def __init__(self):
        self.counters: dict[str, float] = {}  # tenant -> weighted tokens served (bounded by the tenants keys name)
        self.active: dict[str, int] = {}  # tenant -> its requests waiting or being served here
        self.seen = [float("-inf")] * 3  # when a request of each class last came (scheduling.clock)

    def arrive(self, tenant: str, priority: int) -> None:
        """A request of `tenant` comes in; a tenant not active until now is lifted to the active ones' least counter."""
        self.seen[priority] = clock.now()
        active = self.active
        n = active.get(tenant, 0)
        if not n:
            least = min((self.counters.get(t, 0.0) for t, k in active.items() if k), default=None)
            if least is not None and self.counters.get(tenant, 0.0) < least:
                self.counters[tenant] = least
        active[tenant] = n + 1

    def charge(self, tenant: str, tokens: int, weight: float) -> None:
        """`tokens` served to `tenant`."""
        if tokens > 0:
            self.counters[tenant] = self.counters.get(tenant, 0.0) + tokens / weight

    def admitted(self, job) -> None:
        """A request (its JobInfo) is let in: its prompt counts as served to its tenant."""
        self.charge(job.tenant, job.prompt_tokens, job.weight)

    def leave(self, tenant: str, output_tokens: int, weight: float) -> None:
        """A request of `tenant` ended, having generated `output_tokens`."""
        self.charge(tenant, output_tokens, weight)
        n = self.active.get(tenant, 0) - 1
        if n > 0:
            self.active[tenant] = n
        else:
            self.active.pop(tenant, None)

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def higher_class_seen(self, priority: int) -> bool:
        """Did a request of a class above `priority` come within HEADROOM_WINDOW_S?"""
        since = clock.now() - HEADROOM_WINDOW_S
        return any(t >= since for t in self.seen[:priority])
