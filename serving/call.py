"""What every engine call of a request is made of: the client's sink, and one leg's call as `Retries` tries it.

A `Call` is one leg (scheduling.scheduler.Leg: where it goes, how it leases, where a retry goes) with
what its tries send and what they make of the answer; whole.py, handoff.py and trigger.py define them.
`attempt` is a plain function returning the coroutine of one try (the stream relay's, relay.py, or a
JSON exchange's), so a try costs no coroutine layer of its own.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Generic, Protocol, TypeVar

import ujson

from config import Settings
from engines import EngineClient
from errors import UpstreamError, UpstreamProtocolError
from scheduling.scheduler import Leg
from serving.job import Job
from serving.observe import RequestRecord

T = TypeVar("T")


class Sink(Protocol):
    """Where the client's answer goes; implemented by the HTTP handler (handlers/sink.py)."""

    started: bool

    def json(self, status: int, body: bytes) -> None:
        """The whole JSON answer (sent when the handler returns: nothing here waits)."""

    async def start_stream(self) -> None: ...

    async def send(self, data: bytes, last: bool = False) -> None:
        """Relay stream bytes; `last` ends the response with them (one write fewer than a separate end)."""


class Call(Generic[T]):
    """One leg's engine call, tried by `Retries.run` on each engine the leg is moved to."""

    __slots__ = ("client", "job", "leg", "rec", "settings", "sink")
    engine = "engine"  # how its errors name the engine ("prefill engine", "decode engine")

    def __init__(self, client: EngineClient, settings: Settings, job: Job, leg: Leg, sink: Sink, rec: RequestRecord):
        self.client, self.settings, self.job, self.leg, self.sink, self.rec = client, settings, job, leg, sink, rec

    def attempt(self, rid: str) -> Awaitable[T]:
        """One try on `leg.target`, with engine request id `rid` (a fresh one for each retry)."""
        raise NotImplementedError

    def failed(self, err: UpstreamError) -> None:
        """A try failed with `err`, before `Retries` decides whether to retry: what the next try sends may change."""

    def parsed(self, data: bytes) -> object:
        """An engine's JSON answer, parsed (invalid JSON is the engine's protocol error)."""
        try:
            return ujson.loads(data)
        except ValueError:
            raise UpstreamProtocolError(f"{self.engine} answered invalid JSON", detail=self.leg.target.url) from None
