"""Observability port: GET /health, GET /metrics (Prometheus text, summed across workers), and the status page:
GET / (one self-contained HTML page) and GET /status.json (its document, made once a second for all workers by
serving/status.py). None takes a key: none shows a secret.

Every open browser asks for /status.json once a second, from whichever worker the kernel hands the connection: it
runs no middleware (`ctx_self_guarded`; the plane check and the request id are here) and its headers skip Sanic's
sanitizing (RelayResponse), as the inference routes' answers.
"""

import os

from sanic import Blueprint, HTTPResponse, Request, json

from handlers.ids import REQUEST_ID, request_id
from handlers.planes import OBS, check_plane
from handlers.sink import RelayResponse

bp = Blueprint("observability")

with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "status_page.html"), "rb") as _f:
    STATUS_PAGE = _f.read()
# The page runs its own inline script and style and may fetch only its own origin: nothing from elsewhere.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


@bp.get("/health", ctx_plane=OBS, ctx_keyless=True)
async def health(request: Request):
    return json({"status": "ok"})


@bp.get("/metrics", ctx_plane=OBS, ctx_keyless=True)
async def metrics(request: Request):
    body, content_type = request.app.ctx.observer.exposition()
    return HTTPResponse(body, content_type=content_type)


@bp.get("/", ctx_plane=OBS, ctx_keyless=True)
async def status_page(request: Request):
    return HTTPResponse(STATUS_PAGE, content_type="text/html; charset=utf-8", headers=PAGE_HEADERS)


@bp.get("/status.json", ctx_plane=OBS, ctx_self_guarded=True)
def status_json(request: Request):
    check_plane(request, OBS)
    headers = {"cache-control": "no-store", REQUEST_ID: request_id(request)}  # (constants and a checked id)
    return RelayResponse(request.app.ctx.status_reader.read(), 200, headers, "application/json")
