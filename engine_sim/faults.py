"""Fault knobs (FAULT_KNOBS): the failures tests inject before a request's first byte, mid-stream and on /health.

Mid-stream faults count either SSE events (`*_after_n`) or generated tokens (`mid_stream_fault`, after
`mid_stream_fault_after_tokens` of them): a stream may fail after its k-th token, which is what a gateway
continuing a broken answer from its token ids needs to be tested with.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from .config import FAULT_KNOBS, MID_STREAM_FAULTS
from .errors import ApiError, error_type_for_status
from .json_text import dumps


class SimulatedClose(Exception):
    """A fault dropped the connection on purpose, or ended the stream with an error event."""


def drop(request: web.Request) -> None:
    if request.transport is not None:
        request.transport.abort()


class Faults:
    def __init__(self, knobs: dict[str, Any] | None = None):
        self.knobs: dict[str, Any] = dict(knobs or {})
        self.dead = False  # the die fault fired: every connection is dropped until the faults are cleared
        self.streams: dict[int, web.Request] = {}  # the open streams (by id) a death takes with it

    def set(self, **knobs) -> None:
        """Set knobs; a None value removes one."""
        unknown = set(knobs) - set(FAULT_KNOBS)
        if unknown:
            raise ValueError(f"unknown fault knobs: {sorted(unknown)}")
        if knobs.get("mid_stream_fault") not in (None, *MID_STREAM_FAULTS):
            raise ValueError(f"mid_stream_fault must be one of {', '.join(MID_STREAM_FAULTS)}")
        for k, v in knobs.items():
            if v is None:
                self.knobs.pop(k, None)
            else:
                self.knobs[k] = v

    def clear(self) -> None:
        self.knobs.clear()
        self.dead = False

    @property
    def held_text_token(self) -> int:
        """held_text_token k: the k-th token's chunk carries its id and no text, which comes with the next chunk
        (what vLLM does with a token that ends inside a UTF-8 character); 0: none."""
        return int(self.knobs.get("held_text_token") or 0)

    @property
    def eos_on_prefill(self) -> bool:
        return bool(self.knobs.get("eos_on_prefill"))

    async def health_status(self) -> int:
        slow = self.knobs.get("slow_health_s")
        if slow:
            await asyncio.sleep(float(slow))
        return int(self.knobs.get("health_status") or 200)

    async def linger(self) -> None:
        """linger_after_end_s: a stream's connection stays open this long after its last event (a proxy or
        server that is slow to end a chunked body): its client has the whole answer before the engine's EOF."""
        s = self.knobs.get("linger_after_end_s")
        if s:
            await asyncio.sleep(float(s))

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

    async def before_token(self, k: int, request: web.Request, resp: web.StreamResponse, anthropic: bool) -> None:
        """Before a stream's k-th token (1-based) goes out: the mid_stream_fault once k-1 tokens are out."""
        kind, after = self.knobs.get("mid_stream_fault"), self.knobs.get("mid_stream_fault_after_tokens")
        if kind is None or after is None or k <= int(after):
            return
        if kind == "stall":
            await asyncio.Event().wait()
        if kind == "error":  # vLLM's in-band error: its ErrorResponse (or Anthropic's error event), then the end
            message = "simulated engine failure mid-stream"
            if anthropic:
                err = {"type": "error", "error": {"type": "internal_error", "message": message}}
                await resp.write(b"event: error\ndata: " + dumps(err).encode() + b"\n\n")
            else:
                err = {"error": {"message": message, "type": "InternalServerError", "param": None, "code": 500}}
                await resp.write(b"data: " + dumps(err).encode() + b"\n\ndata: [DONE]\n\n")
            raise SimulatedClose()
        if kind == "die":
            self.dead = True
            for other in list(self.streams.values()):
                drop(other)
        drop(request)
        raise SimulatedClose()

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
