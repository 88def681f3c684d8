"""SSE framing of streamed answers: OpenAI's `data:` chunks and `[DONE]`, Anthropic's named events.

Every event counts toward the mid-stream fault knobs (`[DONE]` does not).
"""

from __future__ import annotations

from aiohttp import web

from .faults import Faults
from .json_text import dumps

SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}


class SseWriter:
    def __init__(self, request: web.Request, resp: web.StreamResponse, faults: Faults):
        self.request, self.resp, self.faults = request, resp, faults
        self.events_written = 0

    async def data(self, s: str) -> None:
        await self._emit(b"data: " + s.encode() + b"\n\n")

    async def event(self, name: str, obj: dict) -> None:
        await self._emit(b"event: " + name.encode() + b"\ndata: " + dumps(obj).encode() + b"\n\n")

    async def before_token(self, k: int, anthropic: bool = False) -> None:
        """The token-counted mid-stream faults, before the k-th token (1-based) is written."""
        await self.faults.before_token(k, self.request, self.resp, anthropic)

    async def done(self) -> None:
        await self.resp.write(b"data: [DONE]\n\n")

    async def _emit(self, frame: bytes) -> None:
        n = self.events_written
        if self.faults.cuts_event(n):  # its first half goes out alone
            half = len(frame) // 2
            await self.resp.write(frame[:half])
            frame = frame[half:]
        await self.faults.before_event(n, self.request, self.resp)
        self.events_written += 1
        await self.resp.write(frame)
