"""Background work done by one worker for all: active health checks and engine /metrics scraping.

Each is a named periodic loop (`Loop`) registered with `Background.register`: its pass, then the wait its
interval setting says, read before every wait (a reload may change it). `start` starts every registered loop.

Results land in the shared health table, so every worker routes by them. A refused connection or an
answer other than 200 marks the endpoint unhealthy at once; a check that times out (no connection or no
answer within max(1 s, health_check_interval)) only does after `health_check_timeout_failures` in a row,
because a busy engine (a real vLLM on a loaded CPU) can answer late, and a connection can take a dropped
SYN's one-second retransmit: dropping it would send its traffic elsewhere for nothing. A passing check
marks it healthy again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from config import Live
from engines import EngineClient
from errors import UpstreamError, UpstreamTimeout
from scheduling.health import Health
from scheduling.registry import Registry, Target
from scheduling.scrape import EngineScrapes, parse_engine_metrics

log = logging.getLogger("coordinator.background")


@dataclass(frozen=True)
class Loop:
    """A periodic loop: `run` (one pass), then a wait of the setting named `interval` (seconds)."""

    name: str
    interval: str  # a Settings attribute, read before each wait
    run: Callable[[], Awaitable[None]]


class Background:
    def __init__(self, live: Live, registry: Registry, health: Health, client: EngineClient):
        self.live, self.registry, self.health, self.client = live, registry, health, client
        self.scrapes = EngineScrapes(health)
        self.timeouts: dict[tuple[int, str], int] = {}  # late answers since the last pass, per (slot, url)
        self.loops: list[Loop] = []
        self.tasks: list[asyncio.Task] = []
        self.register("health_check", "health_check_interval_s", self._every_target(self._check))
        self.register("metrics_scrape", "metrics_scrape_interval_s", self._every_target(self._scrape))

    def register(self, name: str, interval: str, run: Callable[[], Awaitable[None]]) -> None:
        """One more periodic loop, started with the others."""
        self.loops.append(Loop(name, interval, run))

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._every(loop), name=f"background {loop.name}") for loop in self.loops]

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _every(self, loop: Loop) -> None:
        while True:
            await loop.run()
            await asyncio.sleep(getattr(self.live.s, loop.interval))

    def _every_target(self, job: Callable[[Target], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
        """A pass of `job` over the registered engines, as the instance set is at the pass's start."""

        def run() -> Awaitable[None]:
            return asyncio.gather(*(job(t) for t in self.registry.view().targets), return_exceptions=True)

        return run

    async def _check(self, t: Target) -> None:
        key, why = (t.slot, t.url), ""
        try:
            status, _ = await self.client.get(
                t.url + "/health", timeout_s=max(1.0, self.live.s.health_check_interval_s)
            )
            healthy = status == 200
        except UpstreamError as e:
            healthy = False
            if isinstance(e, UpstreamTimeout):  # no answer in time: maybe only busy
                late = self.timeouts[key] = self.timeouts.get(key, 0) + 1
                if late < self.live.s.health_check_timeout_failures:
                    return
        except Exception as e:  # a check that cannot be made (a bug, a closed client) proves nothing healthy
            healthy, why = False, f" (the check failed: {e!r})"
        self.timeouts.pop(key, None)  # the run of late answers ends: a pass, another failure, or its last one
        if healthy != self.health.is_healthy(t.slot):
            log.warning(
                "instance %d endpoint %s is now %s%s",
                t.instance_id,
                t.address,
                "healthy" if healthy else "unhealthy",
                why,
            )
        self.health.set_healthy(t.slot, healthy)

    async def _scrape(self, t: Target) -> None:
        try:
            status, body = await self.client.get(
                t.url + "/metrics", timeout_s=max(1.0, self.live.s.metrics_scrape_interval_s)
            )
        except UpstreamError:
            return
        if status != 200:
            return
        self.scrapes.update(t.slot, parse_engine_metrics(body.decode("utf-8", "replace")), t.role == "decode")
