"""What every engine call of a request is made of: the client's sink, the worker's `Upstream`, and one leg's
call as `Retries` tries it.

A `Call` is one leg (scheduling.scheduler.Leg: where it goes, how it leases, where a retry goes) with
what its tries send and what they make of the answer; whole.py, handoff.py and trigger.py define them.
`attempt` is a plain function returning the coroutine of one try (the stream relay's, relay.py, or a
JSON exchange's), so a try costs no coroutine layer of its own.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable
from typing import Generic, Protocol, TypeVar

import ujson

from config import Live
from engines import Body, EngineClient
from errors import UpstreamError, UpstreamProtocolError
from scheduling.ledger import DECODE, Lease
from scheduling.scheduler import Leg
from serving.continuation import Continuation
from serving.job import Job
from serving.legs import engine_body
from serving.observe import Observer, RequestRecord
from serving.usage import PrefillUsages

T = TypeVar("T")


class Sink(Protocol):
    """Where the client's answer goes; implemented by the HTTP handler (handlers/sink.py)."""

    started: bool

    def json(self, status: int, body: bytes) -> None:
        """The whole JSON answer (sent when the handler returns: nothing here waits)."""

    async def start_stream(self) -> None: ...

    async def send(self, data: bytes, last: bool = False) -> None:
        """Relay stream bytes; `last` ends the response with them (one write fewer than a separate end)."""


class Upstream:
    """What every call of this worker uses: the engine client, the settings (timeouts, keep-alives), the
    observer (missed handoffs) and trigger mode's store of P's usage between workers (`usages`)."""

    __slots__ = ("client", "live", "obs", "usages")

    def __init__(self, client: EngineClient, live: Live, observer: Observer, usages: PrefillUsages):
        self.client, self.live, self.obs, self.usages = client, live, observer, usages


class Call(Generic[T]):
    """One leg's engine call, tried by `Retries.run` on each engine the leg is moved to; `body` is what a try
    sends (the client's own bytes, or a leg's body: serving/legs.py)."""

    __slots__ = ("body", "cont", "job", "leg", "rec", "sink", "up")
    engine = "engine"  # how its errors name the engine ("prefill engine", "decode engine")

    def __init__(self, up: Upstream, job: Job, leg: Leg, sink: Sink, rec: RequestRecord, body: Body):
        self.up, self.job, self.leg, self.sink, self.rec, self.body = up, job, leg, sink, rec, body
        self.cont: Continuation | None = None  # the running stream's, which `Retries` resumes after a failure

    def continuation(self) -> Continuation | None:
        """A fresh continuation state for a try of a client's stream (None when reschedule is off, and for a
        metaserver call)."""
        job = self.job
        on = self.up.live.s.reschedule.enable and job.stream and job.metaserver is None
        self.cont = Continuation(job, self.leg.target.engine_type) if on else None
        return self.cont

    def attempt(self, rid: str) -> Awaitable[T]:
        """One try on `leg.target`, with engine request id `rid` (a fresh one for each retry)."""
        raise NotImplementedError

    async def exchange(self, rid: str) -> None:
        """One try as a JSON exchange: the engine's whole answer, made the client's by `answer`. The lease is
        released in `finally` (errors and cancellation give the capacity back, as in the stream relay)."""
        rec, up = self.rec, self.up
        lease = self.leg.lease()
        try:
            _, data = await up.client.post(
                self.leg.target.url + self.job.family.route,
                engine_body(self.body, self.job, self.leg.target),
                rid,
                timeout_s=up.live.s.infer_timeout_s,
            )
            rec.first_token()
            self.answer(data, lease)
        finally:
            lease.release()
            if lease.kind == DECODE:  # the decode leg's time, for its histogram (serving/metrics.py)
                rec.decode_s = time.monotonic() - lease.started

    def answer(self, data: bytes, lease: Lease) -> None:
        """The engine's JSON answer (`exchange`) to the client, its lease marked a success."""
        raise NotImplementedError

    def failed(self, err: UpstreamError) -> None:
        """A try failed with `err`, before `Retries` decides whether to retry: what the next try sends may change."""

    def parsed(self, data: bytes) -> object:
        """An engine's JSON answer, parsed (invalid JSON is the engine's protocol error)."""
        try:
            return ujson.loads(data)
        except ValueError:
            raise UpstreamProtocolError(f"{self.engine} answered invalid JSON", detail=self.leg.target.url) from None
