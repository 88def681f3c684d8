"""Instance selection policies (`scheduler_config.scheduler_type`).

A policy gets the usable candidates of one role and the request's `JobInfo` and returns one target;
`choose_pair` picks a prefill and a decode target together (policies that model the pair override it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduling.health import Health
from scheduling.ledger import Ledger
from scheduling.registry import Target
from scheduling.shared import G_RR, SharedState


@dataclass
class JobInfo:
    """What the scheduler knows about one request."""

    model: str
    prompt_tokens: int
    max_tokens: int
    slo_ttft_ms: float
    slo_tpot_ms: float
    prompt_text: str = ""
    block_hashes: list[int] = field(default_factory=list)
    engine_type: str | None = None  # only engines of this kind may serve it (Anthropic routes: vllm)


class Policy:
    name = "base"

    def __init__(self, shared: SharedState, ledger: Ledger, health: Health):
        self.shared, self.ledger, self.health = shared, ledger, health

    def choose(self, cands: list[Target], job: JobInfo) -> Target:
        raise NotImplementedError

    def choose_pair(self, ps: list[Target], ds: list[Target], job: JobInfo) -> tuple[Target, Target]:
        return self.choose(ps, job), self.choose(ds, job)

    def observe_prefill(self, target: Target, job: JobInfo) -> None:
        """Called once a prefill on `target` finished (affinity policies remember the prefix)."""


class RoundRobin(Policy):
    """Rotate through the candidates with one counter shared by every worker."""

    name = "round_robin"

    def choose(self, cands: list[Target], job: JobInfo) -> Target:
        g = self.shared.globals
        n = g[G_RR]
        g[G_RR] = n + 1
        return cands[n % len(cands)]


class LoadBalance(Policy):
    """Least load: the ledger's in-flight requests and tokens, plus the engine's own queue from /metrics."""

    name = "load_balance"

    def score(self, t: Target) -> float:
        requests, prompt_tokens, decode_tokens, _ = self.ledger.load(t.slot)
        running, waiting, kv_usage = self.health.engine_load(t.slot)
        # Our own in-flight count is exact and fresh; the engine's waiting queue covers traffic that
        # does not come through this Coordinator. Prompt tokens weigh the prefill work ahead.
        return requests + waiting + prompt_tokens / 2048.0 + decode_tokens / 8192.0 + 4.0 * kv_usage

    def choose(self, cands: list[Target], job: JobInfo) -> Target:
        if len(cands) == 1:
            return cands[0]
        g = self.shared.globals
        start = g[G_RR]
        g[G_RR] = start + 1
        n = len(cands)
        best, best_score = None, float("inf")
        for k in range(n):  # start at a rotating offset so ties spread evenly
            t = cands[(start + k) % n]
            s = self.score(t)
            if s < best_score:
                best, best_score = t, s
        return best


POLICIES: dict[str, type[Policy]] = {RoundRobin.name: RoundRobin, LoadBalance.name: LoadBalance}


def make_policy(name: str, shared: SharedState, ledger: Ledger, health: Health) -> Policy:
    return POLICIES.get(name, LoadBalance)(shared, ledger, health)
