"""One client connection at the HTTP edge: deadlines for a request's head and body, a cap on open connections, and
request heads whose framing is unambiguous.

Sanic's REQUEST_TIMEOUT bounds the silence between two bytes of a head, never the head's whole time, and only
RESPONSE_TIMEOUT (hours) bounds a body's: a client sending a byte a second holds its connection forever.
`EdgeProtocol` (Sanic's HttpProtocol) gives the head `request_head_timeout` from the segment that brought its first
byte, and the body `request_body_timeout` from the head's end. Sanic's own timer per connection checks them; what
a request pays is a coroutine frame, two attribute copies, and four scans and a regular expression search over its
head (`head_fault`). A reader waiting past its deadline gets a 408 in its route's API shape (the body's reader is
the route, which answers it) and the connection closes.

`max_connections_per_worker` caps the connections each port of a worker keeps open (Sanic's set per server): one
more gets a 503 and is closed, without a task or a parser made for it. Each port counts its own, so a flood on the
inference port leaves the management port's probes answered.

A head is refused with 400, and its connection closed (RFC 9112 sections 2.2, 5.1, 5.2 and 11.2), when a header
name is not a token right before its colon: whitespace before the colon (`Transfer-Encoding : chunked`, which Sanic
would not read as framing, so that a body could pass for the next request), a line folded onto the one before
(obs-fold), an empty name; and when it holds a CR or LF that is not a CRLF line end, or a NUL. Sanic splits a head
at CRLF only, so `X-Foo: a<LF>Content-Length: 61` is one header to it and two to a proxy that splits at LF: the
two would frame the bytes after the head differently (request smuggling). A head that cannot be HTTP/1.1 is
refused as soon as its first bytes are in, not after the deadline: a TLS ClientHello on a plain port, a request
line ending in a bare LF.
"""

from __future__ import annotations

import asyncio
import logging
import re
from time import monotonic

from sanic.headers import format_http1_response
from sanic.http import Http, Stage
from sanic.server.protocols.http_protocol import HttpProtocol

from errors import OPENAI, InvalidRequest, RequestTimeout, ServiceUnavailable, render

log = logging.getLogger("coordinator.connection")

TCHARS = b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"  # RFC 9110 token
# A header line whose name is not a token followed at once by its colon. Sanic's head excludes its final CRLF:
# every header line follows a CRLF.
_BAD_FIELD_LINE = re.compile(rb"\r\n(?![" + re.escape(TCHARS) + rb"]+:)").search
REFUSAL_LINGER_S = 1.0  # how long a refused connection waits for its client to read the 503 and close
REFUSAL_LOG_EVERY_S = 10.0


class StrictHttp(Http):
    """Sanic's HTTP/1.1 reader, with the start of each request's head noted and its header names checked."""

    __slots__ = ()

    async def http1_request_header(self):
        protocol = self.protocol
        protocol.head_since = protocol._time  # the arrival of the segment with this head's first byte
        await super().http1_request_header()
        if why := head_fault(self.request.head):
            self.request_body = None  # its framing is unknown: nothing more is read from this connection
            raise InvalidRequest(why)
        protocol.body_since = protocol._time


def head_fault(head: bytes) -> str:
    """Why a complete request head (Sanic's: without its final CRLF) is refused, or "" when it is not."""
    # Every CR and every LF is one of the CRLFs (scans at C speed: a regular expression for it costs ten times more).
    crlfs = head.count(b"\r\n")
    if head.count(b"\n") != crlfs or head.count(b"\r") != crlfs or b"\0" in head:
        return "malformed request head: a CR or LF may only be part of a CRLF line end, and a NUL may not appear"
    if _BAD_FIELD_LINE(head):
        return "malformed header field: a header name must be a token followed at once by a colon"
    return ""


def check_head_start(buf: bytearray) -> None:
    """An incomplete head that can never become an HTTP/1.1 one: a 400 now, rather than after the deadline."""
    if buf and buf[0] not in TCHARS:  # a method is a token; 0x16 starts a TLS handshake
        raise InvalidRequest("not an HTTP/1.1 request (a TLS handshake on a plain-HTTP port?)")
    lf = buf.find(b"\n")
    if lf == 0 or (lf > 0 and buf[lf - 1] != 0x0D):
        raise InvalidRequest("the request line must end with CRLF")


class EdgeProtocol(HttpProtocol):
    """Sanic's HTTP/1.1 connection, with the head and body deadlines and the cap on open connections."""

    HTTP_CLASS = StrictHttp
    __slots__ = ("body_since", "body_timeout", "head_since", "head_timeout", "late", "max_connections")

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        s = self.app.ctx.live.s
        self.head_timeout, self.body_timeout = s.request_head_timeout_s, s.request_body_timeout_s
        self.max_connections = s.max_connections_per_worker
        self.head_since = self.body_since = 0.0
        self.late: RequestTimeout | None = None  # a deadline passed: what the waiting reader raises

    def connection_made(self, transport):
        if len(self.connections) >= self.max_connections:
            transport.set_protocol(Refusal(transport, self.loop))
            return
        super().connection_made(transport)

    def check_timeouts(self):
        """Sanic's timer, every half of the shortest of its timeouts (REQUEST_TIMEOUT is the head's deadline)."""
        http = self._http
        if self._task and http is not None and (why := self._overdue(http)):
            if self.late is None and http.stage in (Stage.REQUEST, Stage.HANDLER):
                # The reader raises it (receive_more): the client hears a 408, and the connection closes.
                self.late = RequestTimeout(why)
                http.keep_alive = False
                self._data_received.set()
            else:  # the answer is out and only the rest of an unread body was awaited, or the reader never woke
                self.close()
                return
        super().check_timeouts()

    def _overdue(self, http: Http) -> str:
        now = monotonic()
        if http.stage is Stage.REQUEST:
            if now - self.head_since > self.head_timeout:
                return f"request head not received within {self.head_timeout:g} s"
        # (Sanic sets request_body when the first request starts, after the timer's first run)
        elif getattr(http, "request_body", None) and now - self.body_since > self.body_timeout:
            return f"request body not received within {self.body_timeout:g} s"
        return ""

    async def receive_more(self):
        """Sanic's wait for more bytes (only when what a reader needs is not in yet), with the deadlines' end."""
        http = self._http
        if http.stage is Stage.REQUEST:
            check_head_start(self.recv_buffer)
        if self.late is None:
            self.transport.resume_reading()
            self._data_received.clear()
            await self._data_received.wait()
        if self.late is not None:
            http.request_body = None  # the rest of the body is not waited for, nor read as a next request
            raise self.late


def _over_capacity_answer() -> bytes:
    err = ServiceUnavailable("too many open connections to this Coordinator worker", reason="connections")
    status, body, headers = render(err, OPENAI, "")
    headers |= {"Content-Length": str(len(body)), "Connection": "close"}
    return format_http1_response(status, [(k.encode(), v.encode()) for k, v in headers.items()]) + body


class Refusal(asyncio.Protocol):
    """A connection past the cap: a 503 at once, closed when the client closes or after REFUSAL_LINGER_S. What the
    client sends meanwhile is read and dropped: a socket closed with unread bytes is reset, and the reset could
    reach the client before it read the 503."""

    ANSWER = _over_capacity_answer()
    logged_at = -REFUSAL_LOG_EVERY_S

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        transport.write(self.ANSWER)
        self.closer = loop.call_later(REFUSAL_LINGER_S, transport.close)
        now = monotonic()
        if now - Refusal.logged_at >= REFUSAL_LOG_EVERY_S:  # a flood of refusals is one line every few seconds
            Refusal.logged_at = now
            log.warning("a connection was refused with 503: max_connections_per_worker are open on its port")

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> None:
        return None  # the transport closes

    def connection_lost(self, exc: Exception | None) -> None:
        self.closer.cancel()
