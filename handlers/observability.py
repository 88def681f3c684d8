"""Observability port: GET /health and GET /metrics (Prometheus text, summed across workers); neither takes a key."""

from sanic import Blueprint, HTTPResponse, Request, json

from handlers.planes import OBS

bp = Blueprint("observability")


@bp.get("/health", ctx_plane=OBS, ctx_keyless=True)
async def health(request: Request):
    return json({"status": "ok"})


@bp.get("/metrics", ctx_plane=OBS, ctx_keyless=True)
async def metrics(request: Request):
    body, content_type = request.app.ctx.observer.exposition()
    return HTTPResponse(body, content_type=content_type)
