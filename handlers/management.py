"""Management port: Kubernetes probes and live instance management (MindIE-PyMotor's routes and replies)."""

from __future__ import annotations

import logging

import ujson
from sanic import Blueprint, Request, json

from handlers.common import MGMT, presented_key, valid_key
from scheduling.registry import RefreshError, parse_refresh_body
from scheduling.status import instances_json

log = logging.getLogger("coordinator.management")
bp = Blueprint("management")
MAX_REFRESH_BYTES = 10 * 1024 * 1024


def _probe(message: str, **extra):
    return json({"status": "ok", "message": message, **extra})


@bp.get("/startup", ctx_plane=MGMT)
async def startup(request: Request):
    return _probe("started")


@bp.get("/liveness", ctx_plane=MGMT)
async def liveness(request: Request):
    return _probe("alive")


@bp.get("/readiness", ctx_plane=MGMT)
async def readiness(request: Request):
    ctx = request.app.ctx
    if ctx.admission.draining:
        return json({"status": "ok", "message": "draining", "ready": False}, status=503)
    n = len(ctx.registry.view().instances)
    return _probe(f"ready, {n} instances registered", ready=True)


def _refused(status: int, message: str, event: str | None = None):
    return json(
        {"request_id": "refresh_request", "status": "failed", "message": message, "data": {"event_type": event}},
        status=status,
    )


def _authorized(request: Request) -> bool:
    """The management key (`mgmt_api_key_config`), when enabled, guards /instances*; never the probes."""
    cfg = request.app.ctx.settings.mgmt_api_key
    if not cfg.enable_api_key:
        return True
    key = presented_key(request, cfg)
    return key is not None and valid_key(cfg, key)


@bp.get("/instances", ctx_plane=MGMT)
async def instances(request: Request):
    if not _authorized(request):
        return json({"status": "failed", "message": "missing or invalid management key"}, status=401)
    ctx = request.app.ctx
    view = ctx.registry.view()
    return json({"version": view.version, "instances": instances_json(view, ctx.ledger, ctx.health)})


@bp.post("/instances/refresh", ctx_plane=MGMT)
async def refresh(request: Request):
    if not _authorized(request):
        return _refused(401, "missing or invalid management key")
    raw = request.body or b""
    if len(raw) > MAX_REFRESH_BYTES:
        return _refused(413, f"body exceeds {MAX_REFRESH_BYTES} bytes")
    try:
        body = ujson.loads(raw)
    except ValueError as e:
        return _refused(400, f"body is not valid JSON: {e}")
    event = body.get("event") if isinstance(body, dict) else None
    try:
        event, items = parse_refresh_body(body)
        result = request.app.ctx.registry.apply(event, items)
    except RefreshError as e:
        return _refused(e.status, str(e), event)
    log.info("instances refresh %s: %s", event, result.message)
    return json(
        {
            "request_id": "refresh_request",
            "status": "success",
            "message": f"{event}: {result.message}",
            "data": {"event_type": event, "instance_count": result.instance_count},
        }
    )
