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
from state.shared import BREAKER_CLOSED, BREAKER_HALF_OPEN, BREAKER_OPEN, SharedState, endpoint_rows

BREAKER_NAMES = {BREAKER_CLOSED: "closed", BREAKER_OPEN: "open", BREAKER_HALF_OPEN: "half_open"}


class Health:
    def __init__(self, shared: SharedState, live: Live | None = None):
        self.rows = endpoint_rows(shared)
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
        e = self.rows[slot]
        if e.healthy < 0.5:
            return False
        avoid = e.avoid_until  # another replica found it broken (cluster mode)
        if avoid and time.time() < avoid:
            return False
        return e.breaker == BREAKER_CLOSED or time.time() >= e.open_until

    def attempt(self, slot: int) -> None:
        """A request is being sent to this slot: past an open breaker's open time, it is the half-open probe.

        Until the probe answers (or `breaker_open_s` passes without an answer) no other request is let through.
        """
        e = self.rows[slot]
        if e.breaker != BREAKER_CLOSED:
            now = time.time()
            if now >= e.open_until:
                e.breaker = BREAKER_HALF_OPEN
                e.open_until = now + self.live.s.breaker_open_s

    def record_success(self, slot: int) -> None:
        e = self.rows[slot]
        if e.failures or e.breaker != BREAKER_CLOSED:
            e.failures = 0
            e.breaker = BREAKER_CLOSED

    def record_failure(self, slot: int) -> None:
        e = self.rows[slot]
        failures = e.failures + 1
        e.failures = failures
        if e.breaker == BREAKER_HALF_OPEN or 0 < self.live.s.breaker_failure_threshold <= failures:
            e.open_until = time.time() + self._open_for(failures)
            e.breaker = BREAKER_OPEN

    def set_healthy(self, slot: int, healthy: bool) -> None:
        e = self.rows[slot]
        e.healthy = 1.0 if healthy else 0.0
        if not healthy:
            e.seq_cap = 0.0  # an engine that fails its check may come back restarted with other limits: learn anew

    def is_healthy(self, slot: int) -> bool:
        return self.rows[slot].healthy >= 0.5

    def breaker(self, slot: int) -> str:
        return BREAKER_NAMES.get(int(self.rows[slot].breaker), "closed")

    def set_engine_load(self, slot: int, running: float, waiting: float, kv_usage: float) -> None:
        e = self.rows[slot]
        e.running = running
        e.waiting = waiting
        e.kv_usage = kv_usage
        e.scraped_at = time.time()

    def engine_load(self, slot: int) -> tuple[float, float, float]:
        e = self.rows[slot]
        return e.running, e.waiting, e.kv_usage

    def get(self, slot: int, field: str) -> float:
        """Field `field` (an EndpointRow field name) of `slot`'s row."""
        return getattr(self.rows[slot], field)

    def put(self, slot: int, field: str, value: float) -> None:
        setattr(self.rows[slot], field, value)
