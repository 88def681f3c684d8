"""The one place that talks to engines: a pooled aiohttp session per worker, deadlines, error mapping.

Deadlines per leg: connect (`connect_timeout`), first byte (`first_token_timeout`: response headers and,
when streaming, the first chunk), idle gap between chunks (`stream_idle_timeout`) and total
(`infer_timeout`). aiohttp's own 300 s total and 100-connection defaults are replaced: LLM streams are
long and many. Every aiohttp or timeout exception becomes an `errors.Upstream*` here and nowhere else.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import AsyncIterator

import aiohttp

from config import Settings
from errors import EngineStatusError, UpstreamConnectError, UpstreamError, UpstreamProtocolError, UpstreamTimeout

MAX_ERROR_BODY = 64 * 1024
MAX_JSON_BODY = 256 * 1024 * 1024


def _map(exc: BaseException, url: str, phase: str) -> UpstreamError:
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return UpstreamTimeout(f"engine {url} timed out ({phase})")
    if isinstance(exc, aiohttp.ClientConnectorError):
        return UpstreamConnectError(f"engine {url} unreachable: {exc.os_error or exc}")
    if isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError)):
        return UpstreamConnectError(f"engine {url} dropped the connection ({phase}): {exc}")
    if isinstance(exc, aiohttp.ClientResponseError):
        return UpstreamProtocolError(f"engine {url} sent a bad response: {exc.message}")
    return UpstreamConnectError(f"engine {url} failed ({phase}): {exc!r}")


class EngineStream:
    """An open streaming response: `chunks()` yields raw bytes as they arrive, under the idle and total deadlines."""

    def __init__(self, resp: aiohttp.ClientResponse, url: str, idle_s: float, first_s: float, total_deadline: float):
        self.resp, self.url = resp, url
        self.status = resp.status
        self.idle_s, self.first_s, self.total_deadline = idle_s, first_s, total_deadline

    async def chunks(self, keepalive_s: float = 0.0) -> AsyncIterator[bytes]:
        """The body as it arrives. While the engine is silent an empty chunk is yielded every `keepalive_s`
        (0: never), so the caller can keep the client's connection busy; the deadlines keep running."""
        content = self.resp.content
        loop = asyncio.get_running_loop()
        wait = self.first_s
        phase = "first chunk"
        while True:
            deadline = min(loop.time() + wait, self.total_deadline)
            while True:
                wake = min(deadline, loop.time() + keepalive_s) if keepalive_s > 0 else deadline
                try:
                    async with asyncio.timeout_at(wake):
                        chunk = await content.readany()
                    break
                except asyncio.TimeoutError as e:
                    if wake >= deadline:
                        raise _map(e, self.url, phase) from None
                except aiohttp.ClientError as e:
                    raise _map(e, self.url, phase) from None
                yield b""
            if not chunk:
                return
            yield chunk
            wait, phase = self.idle_s, "idle gap"


class EngineClient:
    """Per-worker: made in `before_server_start`, closed in `after_server_stop`."""

    def __init__(self, settings: Settings):
        self.s = settings
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=75, ttl_dns_cache=300)
        self.session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, connect=settings.connect_timeout_s, sock_connect=settings.connect_timeout_s),
            auto_decompress=False,
            # Bodies are relayed as bytes: ask engines for identity encoding, never decompress.
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )

    async def close(self) -> None:
        await self.session.close()

    def _headers(self, request_id: str) -> dict:
        return {"Content-Type": "application/json", "X-Request-Id": request_id}

    async def post(self, url: str, body: bytes, request_id: str, *, timeout_s: float) -> tuple[int, bytes]:
        """A non-streaming exchange; raises EngineStatusError on a non-2xx answer."""
        try:
            async with asyncio.timeout(timeout_s):
                async with self.session.post(url, data=body, headers=self._headers(request_id)) as resp:
                    data = await resp.read()
                    status = resp.status
        except (asyncio.TimeoutError, aiohttp.ClientError) as e:
            raise _map(e, url, "response") from None
        if status >= 300:
            raise EngineStatusError(status, data[:MAX_ERROR_BODY])
        return status, data

    async def get(self, url: str, timeout_s: float) -> tuple[int, bytes]:
        try:
            async with asyncio.timeout(timeout_s):
                async with self.session.get(url) as resp:
                    return resp.status, await resp.read()
        except (asyncio.TimeoutError, aiohttp.ClientError) as e:
            raise _map(e, url, "get") from None

    @asynccontextmanager
    async def stream(self, url: str, body: bytes, request_id: str) -> AsyncIterator[EngineStream]:
        """Open a streaming exchange; the body is read with `EngineStream.chunks()` inside the block."""
        s = self.s
        loop = asyncio.get_running_loop()
        total_deadline = loop.time() + s.infer_timeout_s
        try:
            async with asyncio.timeout_at(min(total_deadline, loop.time() + s.first_token_timeout_s)):
                resp = await self.session.post(url, data=body, headers=self._headers(request_id))
        except (asyncio.TimeoutError, aiohttp.ClientError) as e:
            raise _map(e, url, "response headers") from None
        try:
            if resp.status >= 300:
                try:
                    async with asyncio.timeout(s.connect_timeout_s):
                        data = await resp.content.read(MAX_ERROR_BODY)
                except (asyncio.TimeoutError, aiohttp.ClientError):
                    data = b""
                raise EngineStatusError(resp.status, data)
            yield EngineStream(resp, url, s.stream_idle_timeout_s, s.first_token_timeout_s, total_deadline)
        finally:
            # Closing (not releasing) on an unfinished body aborts the engine request at once.
            if not resp.content.at_eof():
                resp.close()
            else:
                resp.release()

