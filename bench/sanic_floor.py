"""The floor under the Coordinator: a bare Sanic app relaying chat requests through the project's engine client.

    python bench/sanic_floor.py PORT UPSTREAM_URL

No validation, no scheduling, no leases, no metrics, no logging, no middleware: one route that posts the
body to UPSTREAM_URL (or streams it back) with engines.EngineClient, in one process. bench/overhead.py
runs it beside the Coordinator, so the same run shows what Sanic and the relay cost before any of the
Coordinator's own work.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sanic import HTTPResponse, Request, Sanic

from config import Live, Settings
from engines import EngineClient


def make_app(upstream: str) -> Sanic:
    app = Sanic("sanic_floor")
    app.config.AUTO_EXTEND = False  # no sanic-ext
    app.config.MOTD = False

    @app.before_server_start
    async def start(app: Sanic):
        app.ctx.client = EngineClient(Live(Settings()))

    @app.post("/v1/chat/completions")
    async def relay(request: Request):
        client = app.ctx.client
        if b'"stream":true' not in request.body:
            _, data = await client.post(upstream, request.body, "floor", timeout_s=30)
            return HTTPResponse(data, content_type="application/json")
        response = None
        async with client.stream(upstream, request.body, "floor") as es:
            async for chunk in es.chunks():
                if response is None:
                    response = await request.respond(content_type="text/event-stream")
                await response.send(chunk, end_stream=es.finished)
        await response.eof()

    @app.get("/health")
    async def health(request: Request):
        return HTTPResponse(b"ok")

    return app


if __name__ == "__main__":
    port, upstream = int(sys.argv[1]), sys.argv[2]
    make_app(upstream).run(host="127.0.0.1", port=port, single_process=True, access_log=False)
