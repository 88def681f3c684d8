"""The one place that talks to engines: pooled keep-alive HTTP/1.1 connections per worker, deadlines, error mapping.

Each connection is an asyncio Protocol feeding httptools' (llhttp's) response parser, one exchange at a
time; idle connections wait in a per-origin pool for the next request. This replaced aiohttp's client,
whose request path was a third of the Coordinator's CPU per request (bench/overhead.py --profile): the
Coordinator only ever needs a status and the body's bytes, so no header objects, no cookie jar, no
tracing hooks, and one deadline timer per connection, moved lazily (see `_Connection.wait`).

Deadlines per leg: connect (`connect_timeout`), first byte (`first_token_timeout`: response headers and,
when streaming, the first chunk), idle gap between chunks (`stream_idle_timeout`) and total
(`infer_timeout`). Every socket, parse or timeout failure becomes an `errors.Upstream*` here and nowhere
else. Closing a connection whose response is unfinished is how an engine request is aborted (vLLM aborts
a request whose client went away), so an exchange that ends early never returns its connection to the pool.
"""

from __future__ import annotations

import asyncio
import contextvars
import ssl
from collections.abc import AsyncIterator, Awaitable
from contextvars import ContextVar
from functools import lru_cache
from urllib.parse import urlsplit

import httptools

from config import Live
from errors import EngineStatusError, UpstreamConnectError, UpstreamProtocolError, UpstreamTimeout

# The trace context (W3C `traceparent` / `tracestate` header lines) of the engine attempt this task is making,
# set by serving/tracing.py; sent only by a client whose `traced` is set (tracer_config has an endpoint).
TRACE_HEADERS: ContextVar[bytes] = ContextVar("motor_trace_headers", default=b"")
# A response head past this is refused: httptools grows each header value by concatenation, so an engine
# sending megabytes of header would cost the worker's event loop seconds of CPU.
MAX_HEAD = 64 * 1024
# A request sent on a pooled connection that the engine closes without a byte of answer is sent once more, on
# a new connection, only when the close came this soon: the engine closing an idle connection as the
# request went out (its keep-alive timer) closes at once; one that read the request and worked on it may
# have run it, and a second run would be the engine's work twice, unseen by retries and breakers.
STALE_CLOSE_S = 0.25
MAX_JSON_BODY = 256 * 1024 * 1024
STREAM_BUFFER = 1024 * 1024  # bytes of a stream held unread before the engine connection stops being read
# vLLM (uvicorn) closes a connection idle for 5 s; reusing one it is closing would fail the request.
IDLE_KEEPALIVE_S = 4.0
_HEADERS, _DATA, _COMPLETE = 0, 1, 2  # what a waiting exchange waits for

Origin = tuple[str, int, bool]  # host, port, TLS
# A request body: its bytes, or its parts in order (a leg's is the client's prompt bytes beside its changes),
# written one after another so that a prompt of megabytes is not copied to join it.
Body = bytes | tuple[bytes | memoryview, ...]


def parts_of(body: Body) -> tuple[bytes | memoryview, ...]:
    """A body's parts in order (bytes are one part)."""
    return (body,) if isinstance(body, bytes) else body


def joined(body: Body) -> bytes:
    """A body's bytes in one piece."""
    return body if isinstance(body, bytes) else b"".join(body)


def holds(body: Body, needle: bytes) -> bool:
    """Whether the body's bytes hold `needle` within one part. A view is searched in the bytes it views: the
    legs' views leave out only a brace and whitespace, where no key can be."""
    return any(needle in (p.obj if isinstance(p, memoryview) else p) for p in parts_of(body))


@lru_cache(maxsize=4096)
def _split(url: str) -> tuple[Origin, bytes, bytes]:
    """(origin, request target, Host header) of an engine URL; engine URLs are few, so each is parsed once."""
    parts = urlsplit(url)
    tls = parts.scheme == "https"
    host = parts.hostname or ""
    port = parts.port or (443 if tls else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return (host, port, tls), target.encode(), parts.netloc.rsplit("@", 1)[-1].encode()


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection to an engine and the state of its current exchange."""

    def __init__(self, client: EngineClient, origin: Origin):
        self.client, self.origin = client, origin
        self.loop = client.loop
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0  # when it last went back to the pool
        self.timer: asyncio.TimerHandle | None = None  # the one deadline timer (see wait)
        self.timer_at = self.deadline = 0.0
        self.begin(streaming=False)

    def begin(self, streaming: bool) -> None:
        """Reset the exchange state for the next request on this connection."""
        self.streaming = streaming
        self.status = 0
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.complete = False
        self.keep_alive = False
        self.framed = False  # Content-Length or chunked: the body's end is known without closing
        self.received = False
        self.error: str | None = None
        self.retry_after: str | None = None  # an error answer's Retry-After, relayed to the client
        self.waiter: asyncio.Future | None = None
        self.until = _COMPLETE
        self.paused = False
        self.head_bytes = 0  # bytes received before the final answer's head was complete
        self.interim = False  # the message being parsed is a 1xx (100 Continue, 103 Early Hints)

    # -- asyncio.Protocol ---------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        # Bytes after the answer was complete (in the pool, or before it went back): nobody asked for them,
        # so this connection cannot be trusted again.
        if self.complete:
            self.keep_alive = False
            self.close()
            return
        self.received = True
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as e:  # (an upgrade: after a 101, failed)
            self._fail(f"sent a bad response: {e}")
            self.close()
            return
        if not self.status and not self.closed:  # (one read is at most 256 KiB: the head is judged per read)
            self.head_bytes += len(data)
            if self.head_bytes > MAX_HEAD:
                self._fail(f"sent a response head over {MAX_HEAD} bytes")
                self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._disarm()
        self.client._forget(self)
        if not self.complete and self.error is None:
            if self.status and not self.framed:  # a body delimited by the connection's end (HTTP/1.0 style)
                self.complete = True
            else:
                self.error = "dropped the connection"
        self._wake()

    # -- httptools callbacks ------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.complete:  # more than one response to one request: never pooled again
            self.keep_alive = False

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-length":
            self.framed = True
        elif name == b"transfer-encoding":
            # Only a body whose last coding is chunked ends by itself; any other is read to the close (RFC 9112 6.3).
            self.framed = value.rsplit(b",", 1)[-1].strip().lower() == b"chunked"
        elif name == b"retry-after":
            self.retry_after = value.decode("latin-1").strip()

    def on_headers_complete(self) -> None:
        if self.complete:
            return
        status = self.parser.get_status_code()
        if status < 200:
            if status == 101:  # nothing asked to switch protocols: what follows is not HTTP
                self._fail("sent 101 Switching Protocols unasked")
                self.close()
                return
            # An interim answer (100 Continue, 103 Early Hints): the final one follows on this connection.
            self.interim, self.framed, self.retry_after = True, False, None
            return
        self.status = status
        if self.until == _HEADERS:
            self._wake()

    def on_body(self, body: bytes) -> None:
        if self.complete:
            return
        self.chunks.append(body)
        self.buffered += len(body)
        if self.streaming:
            if self.buffered > STREAM_BUFFER and not self.paused:
                self.paused = True  # the client reads slower than the engine writes: let TCP push back
                self.transport.pause_reading()
            if self.until == _DATA:
                # _wake() inlined: an SSE stream calls this once per event
                waiter = self.waiter
                if waiter is not None and not waiter.done():
                    waiter.set_result(None)
        elif self.buffered > MAX_JSON_BODY:
            self._fail(f"sent a body over {MAX_JSON_BODY} bytes")
            self.close()

    def on_message_complete(self) -> None:
        if self.complete:
            return
        if self.interim:
            self.interim = False
            return
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()
        self._wake()

    # -- the exchange -------------------------------------------------------------------------------

    def _fail(self, why: str) -> None:
        if self.error is None:
            self.error = why
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def ready(self, until: int) -> bool:
        if self.error is not None or self.complete:
            return True
        if until == _HEADERS:
            return bool(self.status)
        return until == _DATA and bool(self.chunks)  # _COMPLETE: only the end (part of a body is not all of it)

    async def wait(self, until: int, deadline: float) -> None:
        """Until `until` holds (or the exchange failed or ended); TimeoutError at `deadline`.

        The connection has one timer, moved lazily: a wait arms it only when none is armed or the armed
        one is due after `deadline`, and leaves it armed when it ends; a timer that fires before the
        current wait's deadline re-arms itself for it. Making and cancelling a uvloop timer costs about
        3 µs, and a stream waits once per chunk: now a connection's timer fires about once per timeout.
        """
        if self.ready(until):
            return
        fut = self.loop.create_future()
        self.waiter, self.until, self.deadline = fut, until, deadline
        if self.timer is None or self.timer_at > deadline:
            self._arm(deadline)
        try:
            await fut
        finally:
            self.waiter = None

    def _arm(self, at: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        # An empty context, not the request's: the timer stays armed in the pool (see _connect).
        self.timer, self.timer_at = self.loop.call_at(at, self._on_timer, at, context=contextvars.Context()), at

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _on_timer(self, at: float) -> None:
        self.timer = None
        waiter = self.waiter
        if waiter is None or waiter.done():
            return  # no wait in progress: the next one arms a timer of its own
        if self.deadline > at:
            self._arm(self.deadline)  # armed by an earlier wait: this wait ends later
        else:
            waiter.set_exception(TimeoutError())

    def take(self) -> bytes:
        """The body bytes received and not yet taken."""
        chunks = self.chunks
        if not chunks:
            return b""
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self.chunks, self.buffered = [], 0
        if self.paused:
            self.paused = False
            self.transport.resume_reading()
        return data

    def close(self) -> None:
        self.closed = True
        self._disarm()
        if self.transport is not None:
            self.transport.close()


class EngineStream:
    """An open streaming response: `chunks()` yields raw bytes as they arrive, under the idle and total deadlines."""

    def __init__(self, conn: _Connection, url: str, idle_s: float, first_deadline: float, total_deadline: float):
        self.conn, self.url = conn, url
        self.status = conn.status
        # The first chunk is due by the deadline the request's headers had: an engine that sends its headers
        # late must not get a second first_token_timeout for its first token.
        self.idle_s, self.first_deadline, self.total_deadline = idle_s, first_deadline, total_deadline

    @property
    def finished(self) -> bool:
        """The engine's answer is complete and every byte of it was yielded: the last chunk is out."""
        return self.conn.complete and not self.conn.chunks and self.conn.error is None

    async def rest(self, grace_s: float) -> None:
        """After the answer's last event: up to `grace_s` for the end of the body, so that the connection goes back
        to the pool (an engine that ends it later has its connection closed); what else comes is dropped."""
        conn = self.conn
        try:
            await conn.wait(_COMPLETE, conn.loop.time() + grace_s)
        except TimeoutError:
            pass
        conn.take()

    async def chunks(self, keepalive_s: float = 0.0) -> AsyncIterator[bytes]:
        """The body as it arrives. While the engine is silent an empty chunk is yielded every `keepalive_s`
        (0: never), so the caller can keep the client's connection busy; the deadlines keep running."""
        conn = self.conn
        loop = conn.loop
        deadline, phase = self.first_deadline, "first chunk"
        while True:
            if deadline >= self.total_deadline:
                deadline, phase = self.total_deadline, "total"
            while not conn.ready(_DATA):
                wake = min(deadline, loop.time() + keepalive_s) if keepalive_s > 0 else deadline
                try:
                    await conn.wait(_DATA, wake)
                except TimeoutError:
                    if wake >= deadline:
                        raise UpstreamTimeout(f"engine timed out ({phase})", detail=self.url) from None
                    yield b""
            chunk = conn.take()
            if chunk:
                yield chunk
            elif conn.error is not None:
                raise UpstreamConnectError(f"engine {conn.error} ({phase})", detail=self.url)
            elif conn.complete:
                return
            deadline, phase = loop.time() + self.idle_s, "idle gap"


class EngineClient:
    """Per-worker: made in `before_server_start`, closed in `after_server_stop`."""

    def __init__(self, live: Live):
        self.live = live
        self.traced = False  # send TRACE_HEADERS (tracing on)
        self.pool: dict[Origin, list[_Connection]] = {}
        self.is_closed = False
        self._tls: ssl.SSLContext | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        # Looked up once: on Python 3.11 every get_running_loop() is a getpid() system call.
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    async def close(self) -> None:
        self.is_closed = True
        for conns in self.pool.values():
            for conn in conns:
                conn.close()
        self.pool.clear()

    def _forget(self, conn: _Connection) -> None:
        """A connection closed: out of the idle pool if it was there."""
        idle = self.pool.get(conn.origin)
        if idle and conn in idle:
            idle.remove(conn)

    def _pooled(self, origin: Origin) -> _Connection | None:
        """An idle pooled connection young enough to reuse, if any (older ones are closed on the way)."""
        if self.is_closed:
            raise RuntimeError("the engine client is closed")
        idle = self.pool.get(origin)
        now = self.loop.time()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < IDLE_KEEPALIVE_S:
                return conn
            conn.close()
        return None

    async def _connect(self, origin: Origin, url: str, deadline: float) -> _Connection:
        """A new connection."""
        loop = self.loop
        now = loop.time()
        host, port, tls = origin
        if tls and self._tls is None:
            self._tls = ssl.create_default_context()
        try:
            # Made in an empty context: a transport keeps the context it was made in (uvloop's runs its protocol's
            # callbacks in it), and the request's holds Sanic's current request, whose body may be a prompt of
            # megabytes, for as long as the connection is pooled.
            made = loop.create_connection(lambda: _Connection(self, origin), host, port, ssl=self._tls if tls else None)
            async with asyncio.timeout_at(min(deadline, now + self.live.s.connect_timeout_s)):
                _, conn = await loop.create_task(made, context=contextvars.Context())
        except TimeoutError:
            raise UpstreamTimeout("engine timed out (connect)", detail=url) from None
        except OSError as e:
            raise UpstreamConnectError("engine unreachable", detail=f"{url}: {e}") from None
        return conn

    def _release(self, conn: _Connection) -> None:
        """Back to the pool when the exchange ended cleanly and both sides keep the connection; else closed."""
        if conn.complete and conn.keep_alive and conn.error is None and not conn.closed and not self.is_closed:
            if conn.paused:  # the answer ended in the read that filled the buffer, and its reader left
                conn.paused = False
                conn.transport.resume_reading()
            conn.idle_since = conn.loop.time()
            self.pool.setdefault(conn.origin, []).append(conn)
        else:
            conn.close()

    async def _exchange(
        self,
        method: bytes,
        url: str,
        body: Body | None,
        request_id: str | None,
        until: int,
        deadline: float,
        phase: str,
    ) -> _Connection:
        """Send one request and wait for `until` (headers or the whole response); the caller owns the connection."""
        try:
            origin, target, host = _split(url)
        except ValueError as e:  # an address no connection can be made to (`::1:8000`: IPv6 needs brackets)
            raise UpstreamConnectError("engine unreachable", detail=f"{url}: {e}") from None
        head = b"%s %s HTTP/1.1\r\nHost: %s\r\n" % (method, target, host)
        if request_id is not None:
            head += b"X-Request-Id: %s\r\n" % request_id.encode()
        parts = () if body is None else parts_of(body)
        size = sum(map(len, parts))  # a memoryview's len is its bytes: the legs' views are of bytes
        if body is not None:
            head += b"Content-Type: application/json\r\nContent-Length: %d\r\n" % size
        if self.traced:
            head += TRACE_HEADERS.get()
        head += b"\r\n"
        resent = False
        while True:
            # A pooled connection is taken without a coroutine: only opening a new one awaits.
            conn = None if resent else self._pooled(origin)
            reused = conn is not None
            if conn is None:
                conn = await self._connect(origin, url, deadline)
            conn.begin(streaming=until == _HEADERS)  # a stream is handed over once its headers are in
            sent_at = self.loop.time()
            if size < 65536:
                conn.transport.write(b"".join((head, *parts)))
            else:
                # One write per part: the socket takes what it can of each without a join (writelines joins
                # on 3.11), and the transport keeps only the rest.
                conn.transport.write(head)
                for part in parts:
                    conn.transport.write(part)
            try:
                await conn.wait(until, deadline)
            except TimeoutError:
                conn.close()
                raise UpstreamTimeout(f"engine timed out ({phase})", detail=url) from None
            except BaseException:
                conn.close()
                raise
            if conn.error is None:
                return conn
            conn.close()
            if reused and not conn.received and self.loop.time() - sent_at < STALE_CLOSE_S:
                resent = True  # the engine closed this idle connection as the request went out: once more, on a new one
                continue
            if conn.error.startswith("sent"):
                raise UpstreamProtocolError(f"engine {conn.error}", detail=url)
            raise UpstreamConnectError(f"engine {conn.error} ({phase})", detail=url)

    async def _read_all(
        self,
        method: bytes,
        url: str,
        body: Body | None,
        request_id: str | None,
        timeout_s: float,
        phase: str,
        check: bool,
    ) -> tuple[int, bytes]:
        """One exchange read to its end: (status, body); with `check`, a non-2xx answer raises EngineStatusError."""
        conn = await self._exchange(method, url, body, request_id, _COMPLETE, self.loop.time() + timeout_s, phase)
        status, data = conn.status, conn.take()
        self._release(conn)
        if check and status >= 300:
            raise EngineStatusError(status, data[: self.live.s.upstream_error_body_max_bytes], conn.retry_after)
        return status, data

    # post and get are plain functions returning the exchange's coroutine: awaiting them adds no coroutine of their own.

    def post(self, url: str, body: Body, request_id: str, *, timeout_s: float) -> Awaitable[tuple[int, bytes]]:
        """A non-streaming exchange; raises EngineStatusError on a non-2xx answer."""
        return self._read_all(b"POST", url, body, request_id, timeout_s, "response", True)

    def get(self, url: str, timeout_s: float) -> Awaitable[tuple[int, bytes]]:
        return self._read_all(b"GET", url, None, None, timeout_s, "get", False)

    def call(self, method: bytes, url: str, request_id: str, *, timeout_s: float) -> Awaitable[tuple[int, bytes]]:
        """A bodiless exchange of any method (a POST sends an empty body), answered whatever its status."""
        body = b"" if method == b"POST" else None
        return self._read_all(method, url, body, request_id, timeout_s, "response", False)

    def stream(self, url: str, body: Body, request_id: str) -> StreamExchange:
        """Open a streaming exchange: `async with client.stream(...) as es`, then `es.chunks()` inside the block."""
        return StreamExchange(self, url, body, request_id)


class StreamExchange:
    """The `async with` of one streaming exchange (a plain class: a generator-based context manager costs more)."""

    __slots__ = ("body", "client", "conn", "request_id", "url")

    def __init__(self, client: EngineClient, url: str, body: Body, request_id: str):
        self.client, self.url, self.body, self.request_id = client, url, body, request_id
        self.conn: _Connection | None = None

    async def __aenter__(self) -> EngineStream:
        client, s = self.client, self.client.live.s
        loop = client.loop
        total_deadline = loop.time() + s.infer_timeout_s
        first_deadline = min(total_deadline, loop.time() + s.first_token_timeout_s)
        conn = await client._exchange(
            b"POST", self.url, self.body, self.request_id, _HEADERS, first_deadline, "response headers"
        )
        if conn.status >= 300:
            conn.streaming = False  # an error body is read whole (a paused read would never complete it)
            if conn.paused:
                conn.paused = False
                conn.transport.resume_reading()
            try:
                try:
                    await conn.wait(_COMPLETE, loop.time() + s.connect_timeout_s)
                except TimeoutError:
                    pass
                raise EngineStatusError(
                    conn.status,
                    conn.take()[: s.upstream_error_body_max_bytes] if conn.complete else b"",
                    conn.retry_after,
                )
            finally:
                client._release(conn)
        self.conn = conn
        return EngineStream(conn, self.url, s.stream_idle_timeout_s, first_deadline, total_deadline)

    async def __aexit__(self, *exc) -> None:
        # Closing (not pooling) a connection with an unfinished body aborts the engine request at once.
        self.client._release(self.conn)
