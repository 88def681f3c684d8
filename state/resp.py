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

    def connection_made(self, transport) -> None:
        self.transport = transport

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
    `password` is given), made on first use and again after a failure."""

    def __init__(self, url: str, password: str | None, timeout_s: float):
        u = urlsplit(url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 6379
        self.user = unquote(u.username) if u.username else None
        self.password = password or (unquote(u.password) if u.password else None)
        self.db = int(u.path.lstrip("/") or 0)
        self.tls = ssl.create_default_context() if u.scheme == "rediss" else None
        self.timeout_s = timeout_s
        self.proto: _Protocol | None = None
        self._connecting: asyncio.Task | None = None

    async def _connect(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.timeout_s):
            _, proto = await loop.create_connection(
                _Protocol, self.host, self.port, ssl=self.tls, server_hostname=self.host if self.tls else None
            )
        hello = []
        if self.password:
            hello.append(encode("AUTH", *((self.user,) if self.user else ()), self.password))
        if self.db:
            hello.append(encode("SELECT", self.db))
        if hello:
            for reply in await self._send(proto, hello):
                if isinstance(reply, RespError):
                    proto.transport.close()
                    raise reply
        return proto

    async def _send(self, proto: _Protocol, commands: list[bytes]) -> list:
        loop = asyncio.get_running_loop()
        futs = [loop.create_future() for _ in commands]
        proto.waiters.extend(futs)
        proto.transport.write(b"".join(commands))
        try:
            async with asyncio.timeout(self.timeout_s):
                return [await f for f in futs]
        except TimeoutError:
            proto.transport.close()  # replies still due would answer the next commands
            raise RespError(f"no reply within {self.timeout_s:g} s") from None

    async def call(self, *commands: bytes) -> list:
        """The replies to `commands` (each `encode`d), sent together; an error reply is returned, not raised."""
        proto = self.proto
        if proto is None or proto.lost:
            if self._connecting is None:
                self._connecting = asyncio.ensure_future(self._connect())
            connecting = self._connecting
            try:
                proto = self.proto = await asyncio.shield(connecting)
            except (OSError, TimeoutError) as e:
                raise RespError(f"cannot connect to the store at {self.host}:{self.port} ({e})") from None
            finally:
                if self._connecting is connecting and connecting.done():
                    self._connecting = None
        return await self._send(proto, list(commands))

    def close(self) -> None:
        if self.proto is not None and self.proto.transport is not None:
            self.proto.transport.close()
