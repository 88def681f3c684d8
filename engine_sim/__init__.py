"""engine_sim: a fast, deterministic simulator of a vLLM 0.32 OpenAI-compatible server.

Usage in tests::

    from engine_sim import launch, SimConfig
    with launch(SimConfig(role="prefill", model="m", speedup=20)) as p:
        p.url, p.port, p.address, p.engine_id
        p.set_faults(fail_first_n=2); p.clear_faults()
        p.requests(); p.stats(); p.reset()

Standalone: ``python -m engine_sim --port 8000 --role union --model m``.
See engine_sim/README.md for the timing model, PD semantics and fault knobs.
"""

from __future__ import annotations

import asyncio
import copy
import threading

from .config import FAULT_KNOBS, SimConfig
from .server import SimServer

__all__ = ["FAULT_KNOBS", "SimConfig", "SimHandle", "SimServer", "launch", "serve"]


async def serve(config: SimConfig) -> SimServer:
    """Start a sim inside the running event loop; ``await server.stop()`` to end it."""
    srv = SimServer(config)
    try:
        await srv.start()
    except BaseException:
        await srv.stop()  # what started before the failure (its port, its client session) is not left open
        raise
    return srv


class SimHandle:
    """A sim running in a background thread with its own event loop."""

    def __init__(self, config: SimConfig, start_timeout: float = 10.0):
        self.config = config
        self._loop = asyncio.new_event_loop()
        self._server: SimServer | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name=f"engine_sim-{config.role}", daemon=True)
        self._thread.start()
        if not self._ready.wait(start_timeout):
            raise RuntimeError("engine_sim did not start in time")
        if self._error:
            raise self._error

    def _main(self):
        asyncio.set_event_loop(self._loop)
        try:
            self._server = self._loop.run_until_complete(serve(self.config))
        except BaseException as e:
            self._error = e
            self._loop.close()
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            try:
                self._loop.run_until_complete(self._server.stop())
            except Exception:
                pass
            self._loop.close()

    # ---------------------------------------------------------------- properties
    @property
    def port(self) -> int:
        return self._server.port

    @property
    def host(self) -> str:
        return self.config.host

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def engine_id(self) -> str:
        return self.config.engine_id

    @property
    def server(self) -> SimServer:
        return self._server

    # ---------------------------------------------------------------- control
    def _call(self, fn, *a, **kw):
        """Run fn(*a, **kw) on the sim's loop thread and return its result."""
        if threading.current_thread() is self._thread:
            return fn(*a, **kw)
        fut = asyncio.run_coroutine_threadsafe(_as_coro(fn, *a, **kw), self._loop)
        return fut.result(10)

    def set_faults(self, **knobs):
        self._call(self._server.set_faults, **knobs)

    def clear_faults(self):
        self._call(self._server.clear_faults)

    def requests(self) -> list:
        return self._call(lambda: copy.deepcopy(self._server.records))

    def stats(self) -> dict:
        return self._call(self._server.stats)

    def reset(self):
        self._call(self._server.reset)

    def stop(self):
        if not self._thread.is_alive():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    def __repr__(self):
        return f"<SimHandle {self.config.role} {self.config.model} {self.url}>"


async def _as_coro(fn, *a, **kw):
    return fn(*a, **kw)


def launch(config: SimConfig | None = None, **kwargs) -> SimHandle:
    """Start a sim in a background thread; ``launch(SimConfig(...))`` or ``launch(role=..., ...)``."""
    if config is None:
        config = SimConfig(**kwargs)
    elif kwargs:
        raise TypeError("pass either a SimConfig or keyword arguments")
    return SimHandle(config)
