"""Per-slot health: the active check's verdict, a circuit breaker, and the engine's scraped load.

The breaker opens after `breaker_failure_threshold` consecutive transport errors or 5xx answers (never 4xx,
never a prompt-too-long error: callers decide what counts; 0: never), rejects for `breaker_open_s`, then lets one probe
through (half-open); the probe's success closes it, its failure reopens it, for twice as long each time up
to `breaker_max_open_s` (MindIE-PyMotor's circuit_config; 0: always `breaker_open_s`), as the live settings say. The probe is claimed when a
request is actually sent (`attempt`), not when the scheduler merely looks at the slot, so a recovered
instance that the policy did not pick stays eligible. State lives in the shared health table, so a
breaker opened by one worker stops traffic in every worker on their next pick.
"""

from __future__ import annotations

import time

from config import Live, Settings
from state.shared import (
    BREAKER_CLOSED,
    BREAKER_HALF_OPEN,
    BREAKER_OPEN,
    ENDPOINT_FIELDS,
    EP_AVOID_UNTIL,
    EP_BREAKER,
    EP_FAILURES,
    EP_HEALTHY,
    EP_KV_USAGE,
    EP_OPEN_UNTIL,
    EP_RUNNING,
    EP_SCRAPED_AT,
    EP_WAITING,
    SharedState,
)

BREAKER_NAMES = {BREAKER_CLOSED: "closed", BREAKER_OPEN: "open", BREAKER_HALF_OPEN: "half_open"}


class Health:
    def __init__(self, shared: SharedState, live: Live | None = None):
        self.h = shared.endpoints
        self.live = live or Live(Settings())  # the breaker's knobs

    def _open_for(self, failures: float) -> float:
        """How long the breaker stays open after `failures` in a row: the failures past the threshold are
        the half-open probes that failed, each doubling the time (the count is reset only by a success)."""
        s = self.live.s
        if s.breaker_max_open_s <= s.breaker_open_s:
            return s.breaker_open_s
        trips = max(0, int(failures) - s.breaker_failure_threshold)
        return min(s.breaker_open_s * 2 ** min(trips, 30), s.breaker_max_open_s)

    def usable(self, slot: int) -> bool:
        """May a new request go to this slot now? An open breaker admits a probe once its open time is over."""
        h, base = self.h, slot * ENDPOINT_FIELDS
        if h[base + EP_HEALTHY] < 0.5:
            return False
        avoid = h[base + EP_AVOID_UNTIL]  # another replica found it broken (cluster mode)
        if avoid and time.time() < avoid:
            return False
        return h[base + EP_BREAKER] == BREAKER_CLOSED or time.time() >= h[base + EP_OPEN_UNTIL]

    def attempt(self, slot: int) -> None:
        """A request is being sent to this slot: past an open breaker's open time, it is the half-open probe.

        Until the probe answers (or `breaker_open_s` passes without an answer) no other request is let through.
        """
        h, base = self.h, slot * ENDPOINT_FIELDS
        if h[base + EP_BREAKER] != BREAKER_CLOSED:
            now = time.time()
            if now >= h[base + EP_OPEN_UNTIL]:
                h[base + EP_BREAKER] = BREAKER_HALF_OPEN
                h[base + EP_OPEN_UNTIL] = now + self.live.s.breaker_open_s

    def record_success(self, slot: int) -> None:
        h, base = self.h, slot * ENDPOINT_FIELDS
        if h[base + EP_FAILURES] or h[base + EP_BREAKER] != BREAKER_CLOSED:
            h[base + EP_FAILURES] = 0
            h[base + EP_BREAKER] = BREAKER_CLOSED

    def record_failure(self, slot: int) -> None:
        h, base = self.h, slot * ENDPOINT_FIELDS
        failures = h[base + EP_FAILURES] + 1
        h[base + EP_FAILURES] = failures
        if h[base + EP_BREAKER] == BREAKER_HALF_OPEN or 0 < self.live.s.breaker_failure_threshold <= failures:
            h[base + EP_OPEN_UNTIL] = time.time() + self._open_for(failures)
            h[base + EP_BREAKER] = BREAKER_OPEN

    def set_healthy(self, slot: int, healthy: bool) -> None:
        self.h[slot * ENDPOINT_FIELDS + EP_HEALTHY] = 1.0 if healthy else 0.0

    def is_healthy(self, slot: int) -> bool:
        return self.h[slot * ENDPOINT_FIELDS + EP_HEALTHY] >= 0.5

    def breaker(self, slot: int) -> str:
        return BREAKER_NAMES.get(int(self.h[slot * ENDPOINT_FIELDS + EP_BREAKER]), "closed")

    def set_engine_load(self, slot: int, running: float, waiting: float, kv_usage: float) -> None:
        h, base = self.h, slot * ENDPOINT_FIELDS
        h[base + EP_RUNNING] = running
        h[base + EP_WAITING] = waiting
        h[base + EP_KV_USAGE] = kv_usage
        h[base + EP_SCRAPED_AT] = time.time()

    def engine_load(self, slot: int) -> tuple[float, float, float]:
        h, base = self.h, slot * ENDPOINT_FIELDS
        return h[base + EP_RUNNING], h[base + EP_WAITING], h[base + EP_KV_USAGE]

    def get(self, slot: int, field: int) -> float:
        return self.h[slot * ENDPOINT_FIELDS + field]

    def put(self, slot: int, field: int, value: float) -> None:
        self.h[slot * ENDPOINT_FIELDS + field] = value
