"""The scheduler: from a model and a request, a plan naming the engine(s) that serve it.

A model with prefill and decode instances is served disaggregated (a P/D pair). When it has no usable
decode instance the request is served whole on a prefill or union instance (fallback); with only union
instances whole requests go to one engine. Paused instances, unhealthy ones and those whose breaker is
open are never chosen; `exclude` keeps retries off the slots that already failed, and a job that names
an engine kind sees only engines of that kind.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduling.health import Health
from scheduling.ledger import Ledger
from scheduling.policies import JobInfo, Policy
from scheduling.registry import Registry, Target


class NoCapacity(Exception):
    """No usable instance of the model."""


@dataclass
class Plan:
    prefill: Target | None  # set for a P/D pair
    target: Target  # the decode target of a pair, or the one engine of a whole request

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not None


class Scheduler:
    def __init__(self, registry: Registry, ledger: Ledger, health: Health, policy: Policy):
        self.registry, self.ledger, self.health, self.policy = registry, ledger, health, policy

    def _usable(self, pool: list[Target], exclude: frozenset[int], job: JobInfo) -> list[Target]:
        usable, kind = self.health.usable, job.engine_type
        return [
            t for t in pool
            if not t.paused and t.slot not in exclude and usable(t.slot) and (kind is None or t.engine_type == kind)
        ]

    def plan(self, job: JobInfo, exclude: frozenset[int] = frozenset(), allow_pd: bool = True) -> Plan:
        view = self.registry.view()
        model = job.model
        p_pool, d_pool, u_pool = view.pool(model, "prefill"), view.pool(model, "decode"), view.pool(model, "union")
        if allow_pd and p_pool and d_pool:
            ps, ds = self._usable(p_pool, exclude, job), self._usable(d_pool, exclude, job)
            if ps and ds:
                p, d = self.policy.choose_pair(ps, ds, job)
                return Plan(p, d)
            whole = self._usable(u_pool, exclude, job) or ps or ds
        else:
            whole = self._usable(u_pool, exclude, job) or self._usable(p_pool, exclude, job) or self._usable(d_pool, exclude, job)
        if not whole:
            raise NoCapacity(f"no healthy instance of model {model!r} is available")
        return Plan(None, self.policy.choose(whole, job))

    def pick_one(self, model: str, job: JobInfo, roles: tuple[str, ...], exclude: frozenset[int] = frozenset()) -> Target:
        """One engine of the model, preferring roles in order (count_tokens, metaserver)."""
        view = self.registry.view()
        for role in roles:
            cands = self._usable(view.pool(model, role), exclude, job)
            if cands:
                return self.policy.choose(cands, job)
        raise NoCapacity(f"no healthy instance of model {model!r} is available")
