"""Retries before the first byte, the breaker's bookkeeping of each try, and the answer when no engine is left.

A leg is retried only before the first byte reaches the client: connect errors, timeouts before the first
byte, and engine 408/429/5xx, each try with a fresh engine request id and on another instance when one
exists (`Leg.move`), backing off from `retry_delay`. After the first byte a stream is continued on another
instance when `exception_config.reschedule_config` allows it: `resume` tries it, serving/continuation.py keeps
what it needs; otherwise, or when that fails too, the error becomes one SSE error event (handlers/lifetime.py).
"""

from __future__ import annotations

import asyncio
from functools import partial
from typing import TYPE_CHECKING

from config import Live, Settings
from errors import EngineStatusError, RateLimited, ServiceUnavailable, UpstreamError
from scheduling.admission import OverBudget
from scheduling.health import Health
from scheduling.registry import Target
from scheduling.scheduler import NoCapacity
from serving.call import Call, T
from serving.observe import Observer
from serving.relay import relay

if TYPE_CHECKING:  # imported only when tracing is on (it loads the OpenTelemetry SDK)
    from serving.tracing import Tracing


def refusal(e: NoCapacity | OverBudget, settings: Settings) -> ServiceUnavailable | RateLimited:
    """Why a request gets no engine, as its answer: no usable instance (503) or over the SLO budget (429).

    With no usable instance, the client is told to come back when an open breaker lets a probe through or
    the next health check may have found an engine back.
    """
    if isinstance(e, OverBudget):
        return RateLimited(str(e), retry_after_s=e.retry_after_s, reason="slo_budget")
    return ServiceUnavailable(str(e), retry_after_s=max(settings.breaker_open_s, settings.health_check_interval_s))


class Retries:
    def __init__(self, live: Live, health: Health, observer: Observer):
        self.live, self.health, self.obs = live, health, observer
        self.tracing: Tracing | None = None  # each attempt a span (serving/tracing.py), when tracing is on

    def record(self, target: Target, err: Exception | None) -> None:
        """Feed the breaker: transport errors and 5xx count, 4xx (a prompt too long among them) and 501 do not."""
        if err is None:
            self.health.record_success(target.slot)
        elif isinstance(err, EngineStatusError):
            if not err.relayed:
                self.health.record_failure(target.slot)
            else:
                self.health.record_success(target.slot)
        elif isinstance(err, UpstreamError):
            self.health.record_failure(target.slot)

    async def run(self, call: Call[T]) -> T:
        """Try `call` until it succeeds, or fails in a way no retry can help; its last error is raised."""
        job, leg, rec, sink = call.job, call.leg, call.rec, call.sink
        attempt, exclude = 0, set()
        while True:
            target = leg.target
            rid = job.request_id if attempt == 0 else f"{job.request_id}-{attempt}"
            self.health.attempt(target.slot)
            try:
                if self.tracing is None:
                    result = await call.attempt(rid)
                else:
                    result = await self.tracing.attempt(leg.kind, target, attempt, rid, partial(call.attempt, rid))
            except UpstreamError as e:
                call.failed(e)
                leg.job.failed.add(target.slot)  # a continuation goes to none of them
                if target.slot not in exclude:  # one request retried on one engine is one failure to its breaker
                    self.record(target, e)
                if sink.started and call.cont is not None:  # the client has output: its stream goes on elsewhere
                    return await self.resume(call, e)
                if not e.retryable or sink.started or attempt >= self.live.s.max_retry:
                    raise
                exclude.add(target.slot)
                if getattr(e, "retry_after", None) not in (None, "0") and not leg.can_move(exclude):
                    raise  # no other engine, and this one asked for time (429/503 with Retry-After): the client waits it
                await asyncio.sleep(self.live.s.backoff_s(attempt))
                if not leg.move(exclude):  # (an open breaker): no retry happens, so none is counted
                    raise e from None
                attempt += 1
                rec.retries += 1
                self.obs.retry(job, target, e)
                continue
            self.record(target, None)
            return result

    async def resume(self, call: Call[None], err: UpstreamError) -> None:
        """Continue a client's broken stream on other engines (serving/continuation.py), up to `max_continuations`
        tries, never on one that failed the request (`Leg.continue_elsewhere`); `err` is raised when no
        continuation happens (the client then gets its one SSE error event, as without continuation)."""
        cont, obs, rec, leg, s = call.cont, call.up.obs, call.rec, call.leg, call.up.live.s
        reason = cont.why_not(err)
        if reason is not None:
            rec.continuation_refused = reason
            obs.continuation_refused(call.job, leg.target, reason, err)
            raise err
        cont.begin(getattr(call, "fix", None))
        reason = "limit"
        for n in range(1, s.reschedule.max_continuations + 1):
            if not leg.continue_elsewhere():
                reason = "no_instance"
                break
            target = leg.target
            rec.continuations += 1
            rec.target = target
            cont.next_try()
            obs.continuation(call.job, target, err, cont.before)
            self.health.attempt(target.slot)
            try:
                await relay(call, f"{call.job.request_id}-c{n}", None, cont)
            except UpstreamError as e:
                self.record(target, e)
                if isinstance(e, EngineStatusError) and e.relayed:
                    raise  # the continuation's own 4xx: the client's error, as it came
                err = e
                leg.job.failed.add(target.slot)
                if cont.done:
                    break
                continue
            self.record(target, None)
            return
        rec.continuation_refused = "after_finish" if cont.done else reason
        obs.continuation_refused(call.job, leg.target, rec.continuation_refused, err)
        raise err
