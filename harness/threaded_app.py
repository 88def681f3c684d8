"""An aiohttp server in a thread of its own (its own event loop) on a loopback port: the scripted engines a test
puts in place of, or in front of, a simulator, when it needs answers engine_sim does not give."""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web

from harness.loopback import free_ports


class ThreadedApp:
    """Serves every path with `_handle` from construction to `stop()`; `_started` and `_stopping` run in its loop
    before it listens and after it stops (a client session of its own, say)."""

    def __init__(self):
        self.port = free_ports(1)[0]
        self.address = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.address}"
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        self._thread = threading.Thread(target=self._main, args=(started,), daemon=True)
        self._thread.start()
        assert started.wait(10)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        raise NotImplementedError

    async def _started(self) -> None:
        pass

    async def _stopping(self) -> None:
        pass

    def _main(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)

        async def start():
            await self._started()
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", self._handle)
            self.runner = web.AppRunner(app)
            await self.runner.setup()
            await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

        self._loop.run_until_complete(start())
        started.set()
        self._loop.run_forever()

    def stop(self) -> None:
        async def shutdown():
            await self.runner.cleanup()
            await self._stopping()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
