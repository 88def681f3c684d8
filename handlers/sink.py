"""The response side of a request: the sink the dispatcher writes the client's answer to, and error answers."""

from __future__ import annotations

import asyncio
import logging

from sanic import HTTPResponse, Request
from sanic.helpers import has_message_body

from errors import ANTHROPIC, OPENAI, CoordinatorError, render
from handlers.ids import ANTHROPIC_REQUEST_ID, REQUEST_ID
from serving.observe import RequestRecord

log = logging.getLogger("coordinator.handlers")


def error_response(err: CoordinatorError, api: str, rid: str) -> HTTPResponse:
    status, body, headers = render(err, api, rid)
    headers[REQUEST_ID] = rid
    if api == ANTHROPIC:
        headers[ANTHROPIC_REQUEST_ID] = rid
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
    """The dispatcher's view of the client connection; what goes out is noted on the request's record."""

    __slots__ = ("api", "ended", "headers", "rec", "request", "response", "rid", "started", "writable")

    def __init__(self, request: Request, rid: str, api: str, rec: RequestRecord):
        self.request, self.rid, self.api, self.rec = request, rid, api, rec
        # The headers of its one answer, JSON or stream.
        self.headers = {REQUEST_ID: rid, ANTHROPIC_REQUEST_ID: rid} if api == ANTHROPIC else {REQUEST_ID: rid}
        self.started = self.ended = False
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
        self.started = True

    async def send(self, data: bytes, last: bool = False) -> None:
        if self.ended:
            return
        self.ended = last
        if not self.writable.is_set():
            return await self._send_to_a_full_buffer(data, last)
        # Straight to the connection's writer (Sanic's Http.send), past the response's own send, which only
        # normalises its arguments: one coroutine fewer per relayed chunk.
        await self.response.stream.send(data, last)

    async def _send_to_a_full_buffer(self, data: bytes, last: bool) -> None:
        """The client is not reading: wait for it as long as for a silent engine (`stream_idle_timeout`), then
        drop its connection, which Sanic answers by cancelling the request: it ends as a disconnect, and its
        engine request and capacity are given back (otherwise they were held until the client left)."""
        try:
            async with asyncio.timeout(self.request.app.ctx.settings.stream_idle_timeout_s):
                await self.response.stream.send(data, last)
        except TimeoutError:
            self.ended = True
            log.warning("request_id=%s: the client stopped reading; its connection is dropped", self.rid)
            self.request.transport.abort()
            await asyncio.sleep(1.0)  # Sanic cancels this task once the connection is lost
            raise asyncio.CancelledError from None


def api_of_path(path: str) -> str:
    return ANTHROPIC if path.startswith("/v1/messages") else OPENAI
