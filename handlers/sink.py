"""The response side of a request: the sink the dispatcher writes the client's answer to, and error answers."""

from __future__ import annotations

import asyncio
import logging
import math
import time

from sanic import HTTPResponse, Request
from sanic.helpers import has_message_body

from errors import ANTHROPIC, OPENAI, Api, CoordinatorError, render
from serving.observe import RequestRecord, log_value

log = logging.getLogger("coordinator.handlers")


def error_response(err: CoordinatorError, api: Api, rid: str) -> HTTPResponse:
    status, body, headers = render(err, api, rid)
    headers.update(dict.fromkeys(api.id_headers, rid))
    return HTTPResponse(
        body, status=status, headers=headers, content_type=headers.pop("Content-Type", "application/json")
    )


class RelayResponse(HTTPResponse):
    """A response whose headers the Coordinator wrote: a plain dict, written without Sanic's sanitizing.

    HTTPResponse's constructor makes Sanic's `Header` multidict twice, and Sanic strips CR, LF and NUL from
    every header name and value (a `str.translate` each): together about 6 µs of a JSON answer. Here the
    names are constants and the values are constants, numbers and the request id, which `request_id`
    accepts only when printable, so there is nothing to strip; and Sanic's writer only tests, sets and pops
    lowercase names on `headers`, which a dict does as well as a multidict.
    """

    __slots__ = ()

    def __init__(self, body: bytes, status: int, headers: dict[str, str], content_type: str):
        self.asgi, self.stream, self._cookies = False, None, None
        self.body, self.status, self.headers, self.content_type = body, status, headers, content_type

    @property
    def processed_headers(self):
        if has_message_body(self.status):
            self.headers.setdefault("content-type", self.content_type)
        return [(name.encode(), f"{value}".encode()) for name, value in self.headers.items()]


class SanicSink:
    """The dispatcher's view of the client connection; what goes out is noted on the request's record.

    A stream's client may read slower than its engine writes. What Sanic's writer would wait for goes to
    the connection's buffer at once instead, up to `max_stream_buffer_size`, so the relay keeps taking the
    engine's answer and gives the engine back when it ends; the end itself waits for the client as long as
    for a silent engine. A client past either bound, or a stream older than `stream_total_timeout`, is cut.
    """

    __slots__ = (
        "api",
        "deadline",
        "ended",
        "headers",
        "rec",
        "request",
        "response",
        "rid",
        "started",
        "whole",
        "writable",
    )

    def __init__(self, request: Request, rid: str, api: Api, rec: RequestRecord):
        self.request, self.rid, self.api, self.rec = request, rid, api, rec
        self.headers = dict.fromkeys(api.id_headers, rid)  # the headers of its one answer, JSON or stream
        # ended: nothing more goes out; whole: the stream's end was written (the client may close at once after it)
        self.started = self.ended = self.whole = False
        self.response = None

    def json(self, status: int, body: bytes) -> None:
        self.rec.answered(body)
        self.response = RelayResponse(body, status, self.headers, "application/json")

    async def start_stream(self) -> None:
        self.headers["Cache-Control"] = "no-cache"
        self.response = await self.request.respond(RelayResponse(b"", 200, self.headers, "text/event-stream"))
        # Set while the client's connection takes more bytes (Sanic's protocol clears it when the send
        # buffer is full: its `send` then waits for the client to read).
        self.writable = self.request.transport.get_protocol()._can_write
        total_s = self.request.app.ctx.live.s.stream_total_timeout_s
        self.deadline = time.monotonic() + total_s if total_s > 0 else math.inf
        self.started = True

    async def send(self, data: bytes, last: bool = False) -> None:
        if self.ended:
            return
        self.ended = last
        if not self.writable.is_set() or time.monotonic() > self.deadline:
            await self._send_to_a_slow_client(data, last)
        else:
            # Straight to the connection's writer (Sanic's Http.send), past the response's own send, which only
            # normalises its arguments: one coroutine fewer per relayed chunk.
            await self.response.stream.send(data, last)
        self.whole = last  # (a cut raises instead)

    async def _send_to_a_slow_client(self, data: bytes, last: bool) -> None:
        s, transport = self.request.app.ctx.live.s, self.request.transport
        left_s = self.deadline - time.monotonic()
        if left_s <= 0:
            return await self._cut(f"its stream ran past stream_total_timeout ({s.stream_total_timeout_s:g} s)")
        if not last and self.response.stream.response_func == self.response.stream.http1_response_chunked:
            buffered = transport.get_write_buffer_size() + len(data)
            if buffered > s.max_stream_buffer_bytes:
                return await self._cut(
                    f"it reads slower than the engine writes: {buffered} bytes would wait for it, over"
                    f" max_stream_buffer_size ({s.max_stream_buffer_bytes})"
                )
            if data:  # one chunk of the chunked body, as Sanic's writer frames it, without waiting for the client
                transport.write(b"%x\r\n%b\r\n" % (len(data), data))
            return
        # The end of the stream: wait for the client as long as for a silent engine (`stream_idle_timeout`).
        try:
            async with asyncio.timeout(min(s.stream_idle_timeout_s, left_s)):
                await self.response.stream.send(data, last)
        except TimeoutError:
            await self._cut("it stopped reading")

    async def _cut(self, why: str) -> None:
        """Drop the client's connection, which Sanic answers by cancelling the request: it ends as a disconnect,
        and its engine request and capacity are given back (otherwise they were held until the client left)."""
        self.ended = True
        log.warning("request_id=%s: the client's stream is cut: %s", log_value(self.rid), why)
        self.request.transport.abort()
        await asyncio.sleep(1.0)  # Sanic cancels this task once the connection is lost
        raise asyncio.CancelledError from None


def api_of(request: Request) -> Api:
    """The API a request speaks, for its key headers and its error envelope: Anthropic's on /v1/messages*, and on
    /v1/models* for a client that sends `anthropic-version` (the Anthropic SDK always does)."""
    path = request.path
    if path.startswith("/v1/messages") or (path.startswith("/v1/models") and "anthropic-version" in request.headers):
        return ANTHROPIC
    return OPENAI
