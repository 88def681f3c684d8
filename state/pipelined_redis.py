"""A small Redis client for what a request waits for: RESP2 on one asyncio connection, commands pipelined.

redis-py's asyncio client cost a request about 220 µs of CPU per round trip (bench/overhead.py --cluster: its
command machinery, connection lock and reply parser, written for every command there is); the cluster-wide cap
and rate check is one script call a request. This client writes the command's bytes and reads the replies it
needs (integers, strings, arrays of them, errors), in order, over one connection: a worker's commands run in
the order it sends them. The rest of cluster mode (the sync, the instance set, the events channel) uses redis-py.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from urllib.parse import unquote, urlsplit


class RespError(Exception):
    """An error reply (`-ERR ...`), or the connection failed or timed out."""


def encode(*args: bytes | str | int | float) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%b\r\n" % (len(b), b))
    return b"".join(out)


def _parse(buf: bytes, at: int):
    """(reply, the offset after it), or None when `buf` does not hold all of it yet."""
    end = buf.find(b"\r\n", at)
    if end < 0:
        return None
    kind, line = buf[at : at + 1], buf[at + 1 : end]
    at = end + 2
    if kind == b":":
        return int(line), at
    if kind == b"$":
        n = int(line)
        if n < 0:
            return None, at
        if len(buf) < at + n + 2:
            return None
        return buf[at : at + n], at + n + 2
    if kind == b"*":
        n = int(line)
        if n < 0:
            return None, at
        items = []
        for _ in range(n):
            got = _parse(buf, at)
            if got is None:
                return None
            item, at = got
            items.append(item)
        return items, at
    if kind == b"+":
        return line, at
    if kind == b"-":
        return RespError(line.decode(errors="replace")), at
    raise RespError(f"unreadable reply from the store: {buf[at - len(line) - 3 : at][:40]!r}")


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiters: deque[asyncio.Future] = deque()
        self.buf = b""
        self.lost = False
        self.oldest = 0.0  # when the oldest reply still due was asked for (loop time), while one is

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.loop = asyncio.get_running_loop()

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        at = 0
        try:
            while self.waiters and at < len(buf):
                got = _parse(buf, at)
                if got is None:
                    break
                reply, at = got
                fut = self.waiters.popleft()
                if not fut.done():
                    fut.set_result(reply)
                self.oldest = self.loop.time() if self.waiters else 0.0  # progress: the next is due from now
        except (RespError, ValueError) as e:
            self._fail(RespError(str(e)))
            self.transport.close()
            return
        self.buf = buf[at:]

    def connection_lost(self, exc) -> None:
        self.lost = True
        self._fail(RespError(f"connection lost ({exc or 'closed'})"))

    def _fail(self, err: Exception) -> None:
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_exception(err)


class Resp:
    """One pipelined connection to the Redis of `url` (redis:// or rediss://, password and db from the URL unless
    `password` is given), made on first use and again after a failure.

    `send` is what a request uses: it writes and returns the replies' futures, with no coroutine and no timer of
    its own; a reply overdue by `timeout_s` is found by `check` (the owner's timer), which closes the connection
    and so fails every reply still due. `call` is the awaitable form, for everything else.
    """

    def __init__(self, url: str, password: str | None, timeout_s: float):
        u = urlsplit(url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 6379
        self.user = unquote(u.username) if u.username else None
        self.password = password or (unquote(u.password) if u.password else None)
        self.db = int(u.path.lstrip("/") or 0)
        self.tls = ssl.create_default_context() if u.scheme == "rediss" else None
        self.timeout_s = timeout_s
        self.proto: _Protocol | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._connecting: asyncio.Task | None = None

    @property
    def connected(self) -> bool:
        return self.proto is not None and not self.proto.lost

    async def _connect(self) -> _Protocol:
        loop = self.loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.timeout_s):
            _, proto = await loop.create_connection(
                _Protocol, self.host, self.port, ssl=self.tls, server_hostname=self.host if self.tls else None
            )
            hello = []
            if self.password:
                hello.append(encode("AUTH", *((self.user,) if self.user else ()), self.password))
            if self.db:
                hello.append(encode("SELECT", self.db))
            for reply in [await f for f in self._write(proto, hello)]:
                if isinstance(reply, RespError):
                    proto.transport.close()
                    raise reply
        return proto

    def _write(self, proto: _Protocol, commands: list[bytes]) -> list[asyncio.Future]:
        loop = self.loop
        futs = [loop.create_future() for _ in commands]
        if not proto.waiters:
            proto.oldest = loop.time()
        proto.waiters.extend(futs)
        proto.transport.write(b"".join(commands))
        return futs

    def send(self, *commands: bytes) -> list[asyncio.Future]:
        """The futures of the replies to `commands` (each `encode`d), sent at once; RespError when not connected."""
        proto = self.proto
        if proto is None or proto.lost:
            raise RespError("not connected")
        return self._write(proto, list(commands))

    async def connect(self) -> None:
        """Connect now if not connected (one attempt at a time)."""
        if self.connected:
            return
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
        connecting = self._connecting
        try:
            self.proto = await asyncio.shield(connecting)
        except (OSError, TimeoutError) as e:
            raise RespError(f"cannot connect to the store at {self.host}:{self.port} ({e or 'timed out'})") from None
        finally:
            if self._connecting is connecting and connecting.done():
                self._connecting = None

    async def call(self, *commands: bytes) -> list:
        """The replies to `commands`, sent together; an error reply is returned, not raised."""
        await self.connect()
        futs = self.send(*commands)
        try:
            async with asyncio.timeout(self.timeout_s):
                return [await f for f in futs]
        except TimeoutError:
            self.close()  # replies still due would answer the next commands
            raise RespError(f"no reply within {self.timeout_s:g} s") from None

    def check(self) -> None:
        """Close the connection when its oldest reply still due is overdue (each failing with RespError)."""
        proto = self.proto
        if proto is not None and proto.waiters and self.loop.time() - proto.oldest > self.timeout_s:
            self.close()

    def close(self) -> None:
        if self.proto is not None and self.proto.transport is not None:
            self.proto.transport.close()
