"""Admission at the door: draining, the global in-flight cap and the rate limit, held across all workers.

The in-flight count and the rate limit's token bucket live in shared memory and are changed under the
shared lock, so N workers admit what the configuration says, not N times it.
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from typing import AsyncIterator

from config import Settings
from errors import RateLimited, ServiceUnavailable
from scheduling.shared import G_DRAINING, G_INFLIGHT, G_RATE_STAMP_US, G_RATE_TOKENS_MILLI, SharedState


class Admission:
    def __init__(self, settings: Settings, shared: SharedState):
        self.s, self.shared = settings, shared
        self.cap = settings.max_inflight_requests
        self.rate = settings.requests_per_second
        self.burst_milli = int(max(1.0, self.rate) * 1000)

    @property
    def draining(self) -> bool:
        return bool(self.shared.globals[G_DRAINING])

    def set_draining(self) -> None:
        self.shared.globals[G_DRAINING] = 1

    def inflight(self) -> int:
        return int(self.shared.globals[G_INFLIGHT])

    def _take_rate_token(self) -> float:
        """0 when admitted, else seconds until a token is available."""
        g = self.shared.globals
        now_us = int(time.time() * 1e6)
        with self.shared.lock:
            stamp = g[G_RATE_STAMP_US]
            tokens = g[G_RATE_TOKENS_MILLI] if stamp else self.burst_milli
            tokens = min(self.burst_milli, tokens + int((now_us - stamp) * self.rate / 1000) if stamp else tokens)
            g[G_RATE_STAMP_US] = now_us
            if tokens >= 1000:
                g[G_RATE_TOKENS_MILLI] = tokens - 1000
                return 0.0
            g[G_RATE_TOKENS_MILLI] = tokens
            return (1000 - tokens) / (1000 * self.rate)

    @asynccontextmanager
    async def admit(self, job, rec) -> AsyncIterator[None]:
        g = self.shared.globals
        if g[G_DRAINING]:
            raise ServiceUnavailable("the Coordinator is shutting down")
        if self.rate > 0:
            wait_s = self._take_rate_token()
            if wait_s > 0:
                raise RateLimited("rate limit exceeded", retry_after_s=wait_s, reason="rate_limit")
        with self.shared.lock:
            if self.cap and g[G_INFLIGHT] >= self.cap:
                raise RateLimited(f"too many requests in flight (limit {self.cap})", reason="inflight_cap")
            g[G_INFLIGHT] += 1
        try:
            yield
        finally:
            with self.shared.lock:
                g[G_INFLIGHT] -= 1
