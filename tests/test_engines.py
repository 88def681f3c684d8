"""engines.EngineClient, the pooled HTTP/1.1 client, against scripted raw HTTP servers on 127.0.0.1.

Each server is a bare `asyncio.start_server` whose connections run a script that writes exact bytes, so
every test controls the framing: keep-alive reuse and the pool, stale idle connections, `Connection:
close`, bodies ended by the connection's close, chunked streaming, error statuses, every deadline,
refused, garbled and dropped connections, aborts by closing, backpressure and the request's own bytes.
The https ones serve a certificate for 127.0.0.1 that a throwaway CA, made per module, signed.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import gc
import hashlib
import random
import socket
import ssl
import weakref
from collections.abc import Awaitable, Callable

import pytest
import uvloop

from config import Live, Settings
from engines import MAX_HEAD, STREAM_BUFFER, EngineClient
from errors import EngineStatusError, UpstreamConnectError, UpstreamProtocolError, UpstreamTimeout
from tests.certs import Certs, make_certs

PATH = "/v1/chat/completions"
RID = "req-7f3a"
BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}'
OK_BODY = b'{"ok":1}'
EVENTS = [b'data: {"i":%d}\n\n' % i for i in range(5)] + [b"data: [DONE]\n\n"]
SCENARIO_LIMIT_S = 8.0  # a hung scenario fails instead of waiting for pytest's timeout


# -- scripted loopback servers --------------------------------------------------------------------


class Peer:
    """The server's side of one accepted connection."""

    def __init__(self, server: Loopback, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.server, self.reader, self.writer = server, reader, writer

    async def request(self) -> tuple[bytes, bytes] | None:
        """The next request's (head, body), also recorded in `server.requests`; None once the client hung up."""
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
            body = await self.reader.readexactly(int(parse_head(head)[1].get("content-length", 0)))
        except (asyncio.IncompleteReadError, ConnectionError):
            self.server.hangups += 1
            return None
        self.server.requests.append((head, body))
        return head, body

    async def send(self, data: bytes, piece: int | None = None) -> None:
        """Write `data` at once, or `piece` bytes at a time with a pause between writes."""
        step = piece or len(data) or 1
        for i in range(0, len(data), step):
            self.writer.write(data[i : i + step])
            await self.writer.drain()
            if piece:
                await asyncio.sleep(0.001)


Script = Callable[[Peer], Awaitable[None]]


class Loopback:
    """A raw HTTP server on 127.0.0.1 whose i-th accepted connection runs scripts[i] (the last one repeats).

    With `tls` (a server context) it serves https: a connection is accepted, and its script run, only once
    its TLS handshake succeeded. A connection is closed when its script returns; a script failing (other
    than by the client going away) fails the test when the server stops.
    """

    def __init__(self, *scripts: Script, tls: ssl.SSLContext | None = None):
        self.scripts = scripts
        self.tls = tls
        self.connections = 0  # accepted so far
        self.hangups = 0  # connections the client closed (EOF or reset seen by a script's read)
        self.requests: list[tuple[bytes, bytes]] = []
        self.errors: list[Exception] = []
        self._tasks: set[asyncio.Task] = set()

    async def __aenter__(self) -> Loopback:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0, ssl=self.tls)
        self.port = self._server.sockets[0].getsockname()[1]
        self.origin = ("127.0.0.1", self.port, self.tls is not None)
        self.base = f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"
        self.url = self.base + PATH
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        self._server.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._server.wait_closed()
        if exc_type is None and self.errors:
            raise AssertionError(f"a server script failed: {self.errors[0]!r}") from self.errors[0]

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A plain callback running the script in a task of our own: cancelling a task asyncio made for a
        # coroutine callback logs a spurious error on Python 3.11.
        script = self.scripts[min(self.connections, len(self.scripts) - 1)]
        self.connections += 1
        task = asyncio.create_task(self._run(script, Peer(self, reader, writer)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, script: Script, peer: Peer) -> None:
        try:
            await script(peer)
        except ConnectionError:
            pass  # the client went away while the script wrote
        except Exception as e:
            self.errors.append(e)
        finally:
            peer.writer.close()


def serve_each(*replies: bytes | None, close_after: int = 0, piece: int | None = None) -> Script:
    """A script answering the n-th request of its connection with replies[n] (the last repeats; None: read
    it, answer nothing) until the client hangs up, or closing once `close_after` requests were handled."""

    async def script(peer: Peer) -> None:
        handled = 0
        while await peer.request() is not None:
            reply = replies[min(handled, len(replies) - 1)] if replies else None
            if reply is not None:
                await peer.send(reply, piece)
            handled += 1
            if handled == close_after:
                return

    return script


def parse_head(head: bytes) -> tuple[str, dict[str, str]]:
    """The start line and the headers (names lowercased) of a request or response head."""
    start, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    return start, headers


def response(body: bytes, status: bytes = b"200 OK", extra: bytes = b"") -> bytes:
    """A Content-Length framed HTTP/1.1 response; `extra` holds more header lines, each ending in CRLF."""
    head = b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n" % (status, len(body), extra)
    return head + body


def unframed(body: bytes, version: bytes) -> bytes:
    """A response whose body ends where the connection does: no Content-Length, not chunked."""
    return b"%s 200 OK\r\nContent-Type: application/json\r\n\r\n%s" % (version, body)


def chunked(*pieces: bytes, end: bool = True) -> bytes:
    """`pieces` in chunked encoding, followed by the terminating chunk when `end`."""
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + (b"0\r\n\r\n" if end else b"")


def streamed(*pieces: bytes, status: bytes = b"200 OK", end: bool = True) -> bytes:
    """A chunked HTTP/1.1 response carrying `pieces` as its chunks."""
    head = b"HTTP/1.1 %s\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n" % status
    return head + chunked(*pieces, end=end)


# -- the client's side ----------------------------------------------------------------------------


def settings(**overrides) -> Settings:
    """Default Settings with short deadlines (a wrong wait fails fast), then `overrides`."""
    short = dict(connect_timeout_s=2.0, first_token_timeout_s=2.0, stream_idle_timeout_s=2.0, infer_timeout_s=5.0)
    return dataclasses.replace(Settings(), **{**short, **overrides})


class Engine:
    """A Loopback server (https with `server_tls`) and an EngineClient for it, both closed on exit."""

    def __init__(self, *scripts: Script, server_tls: ssl.SSLContext | None = None, **overrides):
        self.srv = Loopback(*scripts, tls=server_tls)
        self.client = EngineClient(Live(settings(**overrides)))

    async def __aenter__(self) -> tuple[Loopback, EngineClient]:
        return await self.srv.__aenter__(), self.client

    async def __aexit__(self, *exc) -> None:
        await self.client.close()
        await self.srv.__aexit__(*exc)


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), SCENARIO_LIMIT_S))


async def post(client: EngineClient, url: str, timeout_s: float = 2.0) -> tuple[int, bytes]:
    return await client.post(url, BODY, RID, timeout_s=timeout_s)


async def collect(
    client: EngineClient, url: str, got: list[bytes], keepalive_s: float = 0.0, pause_s: float = 0.0
) -> None:
    """Stream `url`, appending every chunk to `got` (kept when the stream fails part way)."""
    async with client.stream(url, BODY, RID) as es:
        async for data in es.chunks(keepalive_s):
            got.append(data)
            if pause_s:
                await asyncio.sleep(pause_s)


async def call(kind: str, client: EngineClient, url: str, got: list[bytes] | None = None) -> None:
    """One exchange of `kind`: "post" or "stream"."""
    if kind == "post":
        await post(client, url)
    else:
        await collect(client, url, [] if got is None else got)


async def eventually(predicate: Callable[[], object], timeout_s: float = 1.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, f"not within {timeout_s} s"
        await asyncio.sleep(0.01)


def pooled(client: EngineClient, srv: Loopback) -> int:
    """How many idle connections to `srv` the client holds."""
    return len(client.pool.get(srv.origin, ()))


# -- keep-alive and the pool ----------------------------------------------------------------------


def test_keep_alive_reuses_one_connection():
    async def scenario():
        async with Engine(serve_each(response(OK_BODY))) as (srv, client):
            assert await post(client, srv.url) == (200, OK_BODY)
            assert pooled(client, srv) == 1
            assert await post(client, srv.url) == (200, OK_BODY)
            assert srv.connections == 1 and len(srv.requests) == 2
            assert pooled(client, srv) == 1

    run(scenario)


def test_concurrent_exchanges_get_their_own_connections_then_share_the_pool():
    async def echo_request_id(peer: Peer) -> None:
        while (request := await peer.request()) is not None:
            await asyncio.sleep(0.05)  # all three exchanges are in flight at once
            await peer.send(response(parse_head(request[0])[1]["x-request-id"].encode()))

    async def scenario():
        async with Engine(echo_request_id) as (srv, client):
            rids = ["a", "b", "c"]

            async def exchanges():
                return await asyncio.gather(*(client.post(srv.url, BODY, rid, timeout_s=2.0) for rid in rids))

            assert await exchanges() == [(200, rid.encode()) for rid in rids]
            assert srv.connections == 3 and pooled(client, srv) == 3
            assert await exchanges() == [(200, rid.encode()) for rid in rids]
            assert srv.connections == 3 and pooled(client, srv) == 3

    run(scenario)


@pytest.mark.parametrize(
    "first_connection, resent",
    [
        # closes as soon as it answered: the client may or may not have seen the FIN before the next request
        pytest.param(serve_each(response(OK_BODY), close_after=1), None, id="closes-after-answering"),
        # reads the next request, then closes without a byte: the client must send it again, on a new connection
        pytest.param(serve_each(response(OK_BODY), None, close_after=2), True, id="closes-on-next-request"),
    ],
)
def test_stale_idle_connection_is_replaced(first_connection, resent):
    async def scenario():
        async with Engine(first_connection, serve_each(response(OK_BODY))) as (srv, client):
            assert await post(client, srv.url) == (200, OK_BODY)
            assert await post(client, srv.url) == (200, OK_BODY)
            assert srv.connections == 2
            if resent:
                assert [r[1] for r in srv.requests] == [BODY, BODY, BODY]

    run(scenario)


@pytest.mark.parametrize("stray", [response(b"WRONG"), b"HTTP/1.1 200 OK\r\nContent-Le"], ids=["whole", "partial"])
def test_bytes_after_a_response_are_not_taken_and_the_connection_is_dropped(stray):
    async def scenario():
        async with Engine(serve_each(response(OK_BODY) + stray)) as (srv, client):
            assert await post(client, srv.url) == (200, OK_BODY)
            assert pooled(client, srv) == 0  # a connection that sent what nobody asked for is not reused
            assert await post(client, srv.url) == (200, OK_BODY)
            assert srv.connections == 2

    run(scenario)


def test_connection_close_response_is_not_pooled():
    async def scenario():
        async with Engine(serve_each(response(OK_BODY, extra=b"Connection: close\r\n"))) as (srv, client):
            assert await post(client, srv.url) == (200, OK_BODY)
            assert pooled(client, srv) == 0
            await eventually(lambda: srv.hangups == 1)  # the server kept it open: the client closed it
            assert await post(client, srv.url) == (200, OK_BODY)
            assert srv.connections == 2

    run(scenario)


BIG = bytes(range(256)) * 40  # 10 KiB: spans several reads when trickled


@pytest.mark.parametrize("piece", [None, 5], ids=["whole", "trickled"])
@pytest.mark.parametrize(
    "reply, close_after, keeps_connection",
    [
        pytest.param(response(BIG[:300]), 0, True, id="content-length"),
        pytest.param(streamed(BIG[:100], BIG[100:101], BIG[101:300]), 0, True, id="chunked"),
        pytest.param(unframed(BIG[:300], b"HTTP/1.0"), 1, False, id="http1.0-until-close"),
        pytest.param(unframed(BIG[:300], b"HTTP/1.1"), 1, False, id="http1.1-until-close"),
    ],
)
def test_post_reads_every_framing(reply, close_after, keeps_connection, piece):
    async def scenario():
        async with Engine(serve_each(reply, close_after=close_after, piece=piece)) as (srv, client):
            assert await post(client, srv.url) == (200, BIG[:300])
            assert pooled(client, srv) == (1 if keeps_connection else 0)

    run(scenario)


# -- streaming ------------------------------------------------------------------------------------


def test_chunked_stream_yields_as_it_arrives_then_pools_the_connection():
    first_seen = asyncio.Event()

    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.send(streamed(EVENTS[0], end=False))
        await asyncio.wait_for(first_seen.wait(), 2.0)  # the first chunk reached the client before the rest went out
        await peer.send(chunked(*EVENTS[1:]))
        await serve_each(response(OK_BODY))(peer)

    async def scenario():
        async with Engine(script) as (srv, client):
            got = []
            async with client.stream(srv.url, BODY, RID) as es:
                assert es.status == 200
                async for data in es.chunks():
                    got.append(data)
                    first_seen.set()
            assert b"".join(got) == b"".join(EVENTS) and b"" not in got
            assert pooled(client, srv) == 1
            assert await post(client, srv.url) == (200, OK_BODY)
            assert srv.connections == 1

    run(scenario)


def test_backpressure_delivers_every_byte_to_a_slow_reader():
    payload = random.Random(7).randbytes(4 << 20)
    pieces = [payload[i : i + (64 << 10)] for i in range(0, len(payload), 64 << 10)]

    async def scenario():
        async with Engine(serve_each(streamed(*pieces))) as (srv, client):
            got = []
            await collect(client, srv.url, got, pause_s=0.01)
            data = b"".join(got)
            assert len(data) == len(payload)
            assert hashlib.sha256(data).digest() == hashlib.sha256(payload).digest()
            # Reading stops once STREAM_BUFFER bytes wait unread: no chunk holds much more than that (a
            # socket read is at most 256 KiB), where an unpaused reader would hand over megabytes at once.
            assert max(map(len, got)) <= STREAM_BUFFER + (512 << 10)
            assert pooled(client, srv) == 1

    run(scenario)


# -- error statuses -------------------------------------------------------------------------------


def test_post_error_status_raises_with_the_body():
    error = b'{"error":"overloaded"}'

    async def scenario():
        async with Engine(serve_each(response(error, b"503 Service Unavailable"))) as (srv, client):
            with pytest.raises(EngineStatusError) as e:
                await post(client, srv.url)
            assert e.value.status == 503 and e.value.body == error and e.value.retryable

    run(scenario)


@pytest.mark.parametrize("later", [False, True], ids=["at_once", "rest_later"])
def test_stream_error_status_raises_with_the_body(later):
    """The whole error body, also when only its first part came with the head (vLLM echoing a long input)."""
    error = b'{"error":{"message":"bad field"}}'
    answer = streamed(error[:10], error[10:], status=b"400 Bad Request")
    cut = answer.index(error[:10]) + 10

    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.send(answer[:cut] if later else answer)
        if later:
            await asyncio.sleep(0.1)
            await peer.send(answer[cut:])
        await serve_each()(peer)

    async def scenario():
        async with Engine(script) as (srv, client):
            with pytest.raises(EngineStatusError) as e:
                await collect(client, srv.url, [])
            assert e.value.status == 400 and e.value.body == error and e.value.relayed

    run(scenario)


def test_a_connection_paused_when_its_stream_ended_is_pooled_reading():
    """An answer may end in the read that filled the stream buffer (reading paused), and its reader leave
    without taking it: the pooled connection must read the next answer."""

    async def scenario():
        async with Engine(serve_each(streamed(*EVENTS), response(OK_BODY))) as (srv, client):
            async with client.stream(srv.url, BODY, RID) as es:
                await eventually(lambda: es.conn.complete)
                es.conn.paused = True  # as on_body leaves it when the buffer filled up
                es.conn.transport.pause_reading()
            assert pooled(client, srv) == 1
            assert await post(client, srv.url, timeout_s=1.0) == (200, OK_BODY)
            assert srv.connections == 1

    run(scenario)


# -- deadlines ------------------------------------------------------------------------------------


def test_post_times_out_when_the_engine_never_answers():
    async def scenario():
        async with Engine(serve_each(None)) as (srv, client):
            loop = asyncio.get_running_loop()
            start = loop.time()
            with pytest.raises(UpstreamTimeout):
                await post(client, srv.url, timeout_s=0.3)
            assert 0.2 <= loop.time() - start < 2.0  # its own timeout, not the 5 s total of these settings
            await eventually(lambda: srv.hangups == 1)  # the timed-out connection was closed
            assert pooled(client, srv) == 0

    run(scenario)


@pytest.mark.parametrize(
    "reply, limits, phase, before",
    [
        pytest.param(None, {"first_token_timeout_s": 0.3}, "response headers", b"", id="no-headers"),
        pytest.param(streamed(end=False), {"first_token_timeout_s": 0.3}, "first chunk", b"", id="no-first-chunk"),
        pytest.param(
            streamed(EVENTS[0], end=False), {"stream_idle_timeout_s": 0.3}, "idle gap", EVENTS[0], id="idle-gap"
        ),
    ],
)
def test_stream_times_out_when_the_engine_stalls(reply, limits, phase, before):
    async def scenario():
        async with Engine(serve_each(reply), **limits) as (srv, client):
            loop = asyncio.get_running_loop()
            start, got = loop.time(), []
            with pytest.raises(UpstreamTimeout) as e:
                await collect(client, srv.url, got)
            assert 0.2 <= loop.time() - start < 5.0
            assert phase in str(e.value) and b"".join(got) == before
            await eventually(lambda: srv.hangups == 1)

    run(scenario)


def test_a_pooled_connections_deadline_is_each_waits_own():
    """The connection's one timer, left armed by an exchange, neither cuts a later, longer wait short nor
    delays a shorter one."""

    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.send(response(OK_BODY))  # at once: the 0.3 s deadline stays armed
        await peer.request()
        await asyncio.sleep(0.6)  # past that deadline, within this request's 3 s
        await peer.send(response(OK_BODY))
        await peer.request()  # never answered: its 0.3 s, not the 3 s still armed
        await asyncio.sleep(SCENARIO_LIMIT_S)

    async def scenario():
        async with Engine(script) as (srv, client):
            loop = asyncio.get_running_loop()
            assert await post(client, srv.url, timeout_s=0.3) == (200, OK_BODY)
            assert await post(client, srv.url, timeout_s=3.0) == (200, OK_BODY)
            start = loop.time()
            with pytest.raises(UpstreamTimeout):
                await post(client, srv.url, timeout_s=0.3)
            assert 0.25 <= loop.time() - start < 1.5
            assert srv.connections == 1  # one connection served all three

    run(scenario)


def test_stream_total_deadline_holds_despite_steady_chunks():
    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.send(streamed(end=False))
        while True:
            await peer.send(chunked(EVENTS[0], end=False))
            await asyncio.sleep(0.05)

    async def scenario():
        async with Engine(script, infer_timeout_s=0.4) as (srv, client):
            loop = asyncio.get_running_loop()
            start, got = loop.time(), []
            with pytest.raises(UpstreamTimeout) as e:
                await collect(client, srv.url, got)
            assert 0.3 <= loop.time() - start < 2.0 and "total" in str(e.value)
            assert len(b"".join(got)) >= 2 * len(EVENTS[0])

    run(scenario)


def test_a_stream_whose_headers_come_late_gets_no_second_first_token_timeout():
    async def script(peer: Peer) -> None:
        await peer.request()
        await asyncio.sleep(0.9)  # headers within the 1 s first-token deadline ...
        await peer.send(streamed(end=False))
        await asyncio.sleep(SCENARIO_LIMIT_S)  # ... and no token after them

    async def scenario():
        async with Engine(script, first_token_timeout_s=1.0) as (srv, client):
            loop = asyncio.get_running_loop()
            start = loop.time()
            with pytest.raises(UpstreamTimeout) as e:
                await collect(client, srv.url, [])
            assert "first chunk" in str(e.value)
            assert loop.time() - start < 1.7  # the request's 1 s, not 0.9 s + another 1 s

    run(scenario)


def test_keepalive_yields_empty_chunks_until_the_deadline():
    async def scenario():
        async with Engine(serve_each(streamed(end=False)), first_token_timeout_s=0.5) as (srv, client):
            got = []
            with pytest.raises(UpstreamTimeout) as e:
                await collect(client, srv.url, got, keepalive_s=0.05)
            assert len(got) >= 4 and set(got) == {b""}  # about one per 0.05 s of the 0.5 s wait
            assert "first chunk" in str(e.value)

    run(scenario)


# -- broken engines -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["post", "stream"])
def test_refused_connection_is_unreachable(kind):
    async def scenario():
        with socket.socket() as sock:  # a port nothing listens on any more
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        client = EngineClient(Live(settings()))
        with pytest.raises(UpstreamConnectError) as e:
            await call(kind, client, f"http://127.0.0.1:{port}{PATH}")
        assert "unreachable" in str(e.value)
        await client.close()

    run(scenario)


@pytest.mark.parametrize("kind", ["post", "stream"])
def test_garbage_response_is_a_protocol_error(kind):
    async def scenario():
        async with Engine(serve_each(b"NOT HTTP\r\n\r\n")) as (srv, client):
            with pytest.raises(UpstreamProtocolError):
                await call(kind, client, srv.url)
            assert srv.connections == 1 and pooled(client, srv) == 0

    run(scenario)


@pytest.mark.parametrize(
    "kind, reply, before",
    [
        pytest.param("post", response(BIG[:100])[:-60], None, id="post-short-content-length"),
        pytest.param(
            "stream", streamed(EVENTS[0], EVENTS[1], end=False), EVENTS[0] + EVENTS[1], id="stream-no-last-chunk"
        ),
    ],
)
def test_connection_dropped_mid_body(kind, reply, before):
    async def scenario():
        async with Engine(serve_each(reply, close_after=1)) as (srv, client):
            got = []
            with pytest.raises(UpstreamConnectError) as e:
                await call(kind, client, srv.url, got)
            assert "dropped" in str(e.value)
            if before is not None:
                assert b"".join(got) == before
            assert srv.connections == 1 and pooled(client, srv) == 0

    run(scenario)


# -- aborting by closing --------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["break", "cancel"])
def test_leaving_a_stream_early_closes_its_connection(how):
    async def scenario():
        async with Engine(serve_each(streamed(EVENTS[0], end=False))) as (srv, client):
            got = []
            if how == "break":
                async with client.stream(srv.url, BODY, RID) as es:
                    async for data in es.chunks():
                        got.append(data)
                        break
            else:
                task = asyncio.create_task(collect(client, srv.url, got))
                await eventually(lambda: got)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            assert got == [EVENTS[0]]
            await eventually(lambda: srv.hangups == 1)  # the engine sees the request's connection end
            assert pooled(client, srv) == 0

    run(scenario)


# -- the request's bytes --------------------------------------------------------------------------


@pytest.mark.parametrize("size", [len(BODY), 100_000], ids=["small", "large"])
def test_request_line_headers_and_body(size):
    body = (BODY * (size // len(BODY) + 1))[:size]

    async def scenario():
        async with Engine(serve_each(response(OK_BODY))) as (srv, client):
            assert await client.post(srv.url, body, RID, timeout_s=2.0) == (200, OK_BODY)
            [(head, got)] = srv.requests
            start, headers = parse_head(head)
            assert start == f"POST {PATH} HTTP/1.1"
            assert headers["host"] == f"127.0.0.1:{srv.port}"
            assert headers["x-request-id"] == RID
            assert headers["content-type"] == "application/json"
            assert headers["content-length"] == str(size)
            assert got == body

    run(scenario)


@pytest.mark.parametrize("size", [len(BODY), 100_000], ids=["small", "large"])
def test_a_body_in_parts_is_sent_as_their_bytes_in_turn(size):
    """A leg's body is the client's bytes (a view of them) beside its changes: one body, one Content-Length."""
    whole = (BODY * (size // len(BODY) + 1))[:size]
    parts = (whole[:10], memoryview(whole)[10 : size - 1], whole[size - 1 :])

    async def scenario():
        async with Engine(serve_each(response(OK_BODY))) as (srv, client):
            assert await client.post(srv.url, parts, RID, timeout_s=2.0) == (200, OK_BODY)
            [(head, got)] = srv.requests
            assert parse_head(head)[1]["content-length"] == str(size) and got == whole

    run(scenario)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_pooled_connection_keeps_nothing_of_the_request_that_used_it(loop):
    """Sanic's current request (and its body, a prompt of megabytes) is in the context of every task of its
    handler: a connection's timer, which stays armed in the pool, must not hold that context."""
    request = contextvars.ContextVar("request")

    class Prompt:
        pass

    async def scenario():
        async with Engine(serve_each(response(OK_BODY))) as (srv, client):

            async def handler() -> weakref.ref:
                prompt = Prompt()
                request.set(prompt)
                assert await post(client, srv.url) == (200, OK_BODY)
                return weakref.ref(prompt)

            held = await asyncio.get_running_loop().create_task(handler(), context=contextvars.Context())
            assert pooled(client, srv) == 1  # its timer armed for a later wait
            await asyncio.sleep(0)  # (the loop lets go of the handle that woke this task)
            gc.collect()
            assert held() is None

    if loop == "uvloop":  # the workers' loop: its transports keep the context they were made in
        uvloop.run(asyncio.wait_for(scenario(), SCENARIO_LIMIT_S))
    else:
        run(scenario)


def test_get_sends_no_body_and_returns_any_status():
    async def scenario():
        async with Engine(serve_each(response(b"no such route", b"404 Not Found"))) as (srv, client):
            assert await client.get(srv.base + "/v1/models?x=1", timeout_s=2.0) == (404, b"no such route")
            [(head, body)] = srv.requests
            start, headers = parse_head(head)
            assert start == "GET /v1/models?x=1 HTTP/1.1" and body == b""
            assert "content-length" not in headers and "x-request-id" not in headers

    run(scenario)


# -- closing the client ---------------------------------------------------------------------------


def test_closed_client_refuses_requests_and_closes_idle_connections():
    async def scenario():
        async with Engine(serve_each(response(OK_BODY))) as (srv, client):
            await post(client, srv.url)
            assert pooled(client, srv) == 1
            await client.close()
            await eventually(lambda: srv.hangups == 1)
            with pytest.raises(RuntimeError):
                await post(client, srv.url)
            assert srv.connections == 1

    run(scenario)


# -- https engines --------------------------------------------------------------------------------
#
# The client trusts what `ssl.create_default_context()` loads, made on its first https connection: the
# tests point SSL_CERT_FILE (which OpenSSL reads then) at the throwaway CA, or at another one.


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("engine-tls"))


def test_https_post_pools_its_tls_connection(certs, monkeypatch):
    monkeypatch.setenv("SSL_CERT_FILE", certs.ca)

    async def scenario():
        async with Engine(serve_each(response(OK_BODY)), server_tls=certs.server_context()) as (srv, client):
            assert srv.url.startswith("https://127.0.0.1:")
            assert await post(client, srv.url) == (200, OK_BODY)
            [conn] = client.pool[srv.origin]
            assert conn.transport.get_extra_info("ssl_object") is not None
            assert await post(client, srv.url) == (200, OK_BODY)
            assert srv.connections == 1 and len(srv.requests) == 2  # one handshake, two exchanges
            assert client.pool[srv.origin] == [conn]
            assert parse_head(srv.requests[1][0])[1]["host"] == f"127.0.0.1:{srv.port}"

    run(scenario)


def test_https_stream_yields_every_chunk(certs, monkeypatch):
    monkeypatch.setenv("SSL_CERT_FILE", certs.ca)

    async def scenario():
        # trickled: the chunks arrive over many TLS records
        async with Engine(serve_each(streamed(*EVENTS), piece=16), server_tls=certs.server_context()) as (srv, client):
            got = []
            await collect(client, srv.url, got)
            assert b"".join(got) == b"".join(EVENTS)
            assert pooled(client, srv) == 1 and srv.connections == 1

    run(scenario)


@pytest.mark.parametrize("kind", ["post", "stream"])
@pytest.mark.parametrize("trusted", ["other-ca", "system-store"])
def test_https_untrusted_certificate_is_unreachable(certs, monkeypatch, trusted, kind):
    if trusted == "other-ca":
        monkeypatch.setenv("SSL_CERT_FILE", certs.other_ca)
    else:
        monkeypatch.delenv("SSL_CERT_FILE", raising=False)

    async def scenario():
        async with Engine(serve_each(response(OK_BODY)), server_tls=certs.server_context()) as (srv, client):
            loop = asyncio.get_running_loop()
            start = loop.time()
            with pytest.raises(UpstreamConnectError) as e:
                await call(kind, client, srv.url)
            assert loop.time() - start < 1.0  # refused at the handshake, not at a deadline
            assert e.value.status == 502
            assert "unreachable" in str(e.value) and "certificate verify failed" in str(e.value)
            assert srv.connections == 0 and not srv.requests and pooled(client, srv) == 0

    run(scenario)


# -- what a misbehaving server or proxy can send ------------------------------------------------------


INTERIM = b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\nRetry-After: 99\r\n\r\n"
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


@pytest.mark.parametrize("interim", [CONTINUE, INTERIM, CONTINUE + INTERIM], ids=["100", "103", "both"])
def test_interim_answers_are_skipped_for_the_final_one(interim):
    """A 1xx was taken for the answer: (103, b'') as a success, a stream with nothing in it."""

    async def scenario():
        async with Engine(serve_each(interim + response(OK_BODY))) as (srv, client):
            assert await post(client, srv.url) == (200, OK_BODY)
            assert pooled(client, srv) == 1  # the connection is fine to reuse
        async with Engine(serve_each(interim + streamed(*EVENTS))) as (srv, client):
            got = []
            await collect(client, srv.url, got)
            assert b"".join(got) == b"".join(EVENTS)
        async with Engine(serve_each(interim + response(b'{"error":"boom"}', b"500 Internal Server Error"))) as (
            srv,
            client,
        ):
            with pytest.raises(EngineStatusError) as e:
                await post(client, srv.url)
            assert e.value.status == 500 and e.value.body == b'{"error":"boom"}' and e.value.retry_after is None

    run(scenario)


def test_a_response_head_past_the_limit_is_refused():
    """httptools grows a header value by concatenation: megabytes of it cost the worker seconds of CPU."""
    huge = b"HTTP/1.1 200 OK\r\nX-Junk: " + b"a" * (2 * MAX_HEAD) + b"\r\nContent-Length: 2\r\n\r\nok"

    async def scenario():
        async with Engine(serve_each(huge, piece=8192)) as (srv, client):
            with pytest.raises(UpstreamProtocolError, match="response head over"):
                await post(client, srv.url)
            assert pooled(client, srv) == 0

    run(scenario)


def test_a_streams_long_error_body_is_read_whole_at_once():
    """A 400 whose body is over the stream buffer (vLLM echoing a long input) paused the read and waited out
    connect_timeout, then lost the message."""
    error = b'{"error":{"message":"' + b"x" * (2 * STREAM_BUFFER) + b'"}}'

    async def scenario():
        async with Engine(serve_each(streamed(error, status=b"400 Bad Request")), connect_timeout_s=3.0) as (
            srv,
            client,
        ):
            started = asyncio.get_running_loop().time()
            with pytest.raises(EngineStatusError) as e:
                await collect(client, srv.url, [])
            assert asyncio.get_running_loop().time() - started < 1.5
            assert e.value.status == 400 and e.value.body == error[: Settings().upstream_error_body_max_bytes]

    run(scenario)


def test_a_transfer_coding_other_than_chunked_is_read_to_the_close():
    """RFC 9112 6.3: such a body ends where the connection does. It was called a dropped connection."""
    answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: identity\r\n\r\n" + OK_BODY

    async def scenario():
        async with Engine(serve_each(answer, close_after=1)) as (srv, client):
            assert await post(client, srv.url) == (200, OK_BODY)
            assert pooled(client, srv) == 0

    run(scenario)


def test_a_request_the_engine_may_have_run_is_not_sent_again():
    """A pooled connection the engine drops after working on the request for a while: it may have run it.
    It was sent again on every pooled connection in turn, unseen by the dispatcher's retries."""

    async def read_work_drop(peer: Peer) -> None:
        assert await peer.request() is not None
        await peer.send(response(OK_BODY))
        assert await peer.request() is not None
        await asyncio.sleep(0.5)  # works on it, then goes away without a word

    async def scenario():
        async with Engine(read_work_drop) as (srv, client):
            assert await post(client, srv.url) == (200, OK_BODY)
            with pytest.raises(UpstreamConnectError):
                await post(client, srv.url)
            assert len(srv.requests) == 2 and srv.connections == 1

    run(scenario)


def test_a_stale_connection_is_replaced_once_not_by_every_pooled_one():
    """Every pooled connection closed by the engine at the next request: one resend, on a new connection."""

    async def scenario():
        async with Engine(serve_each(response(OK_BODY), None, close_after=2)) as (srv, client):
            await asyncio.gather(*(post(client, srv.url) for _ in range(4)))  # four pooled connections
            assert pooled(client, srv) == 4
            assert await post(client, srv.url) == (200, OK_BODY)
            assert len(srv.requests) == 4 + 2 and srv.connections == 5  # one stale try, one new connection

    run(scenario)


def test_an_unasked_protocol_switch_fails_the_exchange_quietly():
    """A 101 with Upgrade made httptools raise its upgrade signal out of data_received: an ERROR traceback
    in the log for each such answer."""
    switch = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"

    async def scenario():
        errors: list[dict] = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
        async with Engine(serve_each(switch)) as (srv, client):
            with pytest.raises(UpstreamProtocolError, match="101"):
                await post(client, srv.url)
        assert errors == []

    run(scenario)
