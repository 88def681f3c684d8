"""Per-slot health: the active check's verdict, a circuit breaker, and the engine's scraped load.

The breaker opens after `failure_threshold` consecutive transport errors or 5xx answers (never 4xx,
never a prompt-too-long error: callers decide what counts), rejects for `open_s`, then lets one probe
through (half-open); the probe's success closes it, its failure reopens it. The probe is claimed when a
request is actually sent (`attempt`), not when the scheduler merely looks at the slot, so a recovered
instance that the policy did not pick stays eligible. State lives in the shared health table, so a
breaker opened by one worker stops traffic in every worker on their next pick.
"""

from __future__ import annotations

import time

from scheduling.shared import (
    BREAKER_CLOSED,
    BREAKER_HALF_OPEN,
    BREAKER_OPEN,
    H_BREAKER,
    H_FAILURES,
    H_HEALTHY,
    H_KV_USAGE,
    H_OPEN_UNTIL,
    H_RUNNING,
    H_SCRAPED_AT,
    H_WAITING,
    HEALTH_FIELDS,
    SharedState,
)

BREAKER_NAMES = {BREAKER_CLOSED: "closed", BREAKER_OPEN: "open", BREAKER_HALF_OPEN: "half_open"}


class Health:
    def __init__(self, shared: SharedState, failure_threshold: int = 3, open_s: float = 5.0):
        self.h = shared.health
        self.failure_threshold = failure_threshold
        self.open_s = open_s

    def usable(self, slot: int) -> bool:
        """May a new request go to this slot now? An open breaker admits a probe once its open time is over."""
        h, base = self.h, slot * HEALTH_FIELDS
        if h[base + H_HEALTHY] < 0.5:
            return False
        return h[base + H_BREAKER] == BREAKER_CLOSED or time.time() >= h[base + H_OPEN_UNTIL]

    def attempt(self, slot: int) -> None:
        """A request is being sent to this slot: past an open breaker's open time, it is the half-open probe.

        Until the probe answers (or `open_s` passes without an answer) no other request is let through.
        """
        h, base = self.h, slot * HEALTH_FIELDS
        if h[base + H_BREAKER] != BREAKER_CLOSED:
            now = time.time()
            if now >= h[base + H_OPEN_UNTIL]:
                h[base + H_BREAKER] = BREAKER_HALF_OPEN
                h[base + H_OPEN_UNTIL] = now + self.open_s

    def record_success(self, slot: int) -> None:
        h, base = self.h, slot * HEALTH_FIELDS
        if h[base + H_FAILURES] or h[base + H_BREAKER] != BREAKER_CLOSED:
            h[base + H_FAILURES] = 0
            h[base + H_BREAKER] = BREAKER_CLOSED

    def record_failure(self, slot: int) -> None:
        h, base = self.h, slot * HEALTH_FIELDS
        failures = h[base + H_FAILURES] + 1
        h[base + H_FAILURES] = failures
        if h[base + H_BREAKER] == BREAKER_HALF_OPEN or failures >= self.failure_threshold:
            h[base + H_OPEN_UNTIL] = time.time() + self.open_s
            h[base + H_BREAKER] = BREAKER_OPEN

    def set_healthy(self, slot: int, healthy: bool) -> None:
        self.h[slot * HEALTH_FIELDS + H_HEALTHY] = 1.0 if healthy else 0.0

    def is_healthy(self, slot: int) -> bool:
        return self.h[slot * HEALTH_FIELDS + H_HEALTHY] >= 0.5

    def breaker(self, slot: int) -> str:
        return BREAKER_NAMES.get(int(self.h[slot * HEALTH_FIELDS + H_BREAKER]), "closed")

    def set_engine_load(self, slot: int, running: float, waiting: float, kv_usage: float) -> None:
        h, base = self.h, slot * HEALTH_FIELDS
        h[base + H_RUNNING] = running
        h[base + H_WAITING] = waiting
        h[base + H_KV_USAGE] = kv_usage
        h[base + H_SCRAPED_AT] = time.time()

    def engine_load(self, slot: int) -> tuple[float, float, float]:
        h, base = self.h, slot * HEALTH_FIELDS
        return h[base + H_RUNNING], h[base + H_WAITING], h[base + H_KV_USAGE]

    def get(self, slot: int, field: int) -> float:
        return self.h[slot * HEALTH_FIELDS + field]

    def put(self, slot: int, field: int, value: float) -> None:
        self.h[slot * HEALTH_FIELDS + field] = value
