"""Fault knobs (FAULT_KNOBS): the failures tests inject before a request's first byte, mid-stream and on /health."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from .config import FAULT_KNOBS
from .errors import ApiError, error_type_for_status


class SimulatedClose(Exception):
    """The close_mid_stream_after_n fault dropped the connection on purpose."""


class Faults:
    def __init__(self, knobs: dict[str, Any] | None = None):
        self.knobs: dict[str, Any] = dict(knobs or {})

    def set(self, **knobs) -> None:
        """Set knobs; a None value removes one."""
        unknown = set(knobs) - set(FAULT_KNOBS)
        if unknown:
            raise ValueError(f"unknown fault knobs: {sorted(unknown)}")
        for k, v in knobs.items():
            if v is None:
                self.knobs.pop(k, None)
            else:
                self.knobs[k] = v

    def clear(self) -> None:
        self.knobs.clear()

    @property
    def eos_on_prefill(self) -> bool:
        return bool(self.knobs.get("eos_on_prefill"))

    async def health_status(self) -> int:
        slow = self.knobs.get("slow_health_s")
        if slow:
            await asyncio.sleep(float(slow))
        return int(self.knobs.get("health_status") or 200)

    async def before_first_byte(self) -> None:
        """Fail (fail_status, fail_first_n), hang or wait, as the knobs say, before a request is served."""
        f = self.knobs
        if f.get("fail_status"):
            raise self._injected_failure(int(f["fail_status"]))
        n = f.get("fail_first_n")
        if n:
            f["fail_first_n"] = int(n) - 1
            raise self._injected_failure(int(f.get("fail_status") or 500))
        if f.get("hang_before_first_byte"):
            await asyncio.Event().wait()
        s = f.get("slow_first_byte_s")
        if s:
            await asyncio.sleep(float(s))

    def _injected_failure(self, status: int) -> ApiError:
        e = ApiError(status, f"simulated failure (status {status})", error_type_for_status(status))
        if self.knobs.get("fail_body") is not None:
            e.raw_body = str(self.knobs["fail_body"])
        if self.knobs.get("fail_retry_after") is not None:
            e.headers["Retry-After"] = str(self.knobs["fail_retry_after"])
        return e

    def cuts_event(self, n: int) -> bool:
        """Whether the network cuts the n-th SSE event in two (partial_event_at_n)."""
        v = self.knobs.get("partial_event_at_n")
        return v is not None and n == int(v)

    async def before_event(self, n: int, request: web.Request, resp: web.StreamResponse) -> None:
        """Stall, close or write a malformed chunk before the n-th SSE event, as the knobs say."""
        f = self.knobs
        v = f.get("stall_mid_stream_after_n")
        if v is not None and n >= int(v):
            await asyncio.Event().wait()
        v = f.get("close_mid_stream_after_n")
        if v is not None and n >= int(v):
            if request.transport is not None:
                request.transport.abort()
            raise SimulatedClose()
        v = f.get("malformed_chunk_after_n")
        if v is not None and n == int(v):
            await resp.write(b"data: {not json\n\n")
