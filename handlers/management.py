"""Management port: Kubernetes probes and live instance management (MindIE-PyMotor's routes and replies)."""

from __future__ import annotations

import logging

import ujson
from sanic import Blueprint, Request, json

from errors import Unauthorized, UnsupportedMediaType, unreadable_json
from handlers.body import check_json_type
from handlers.planes import MGMT
from scheduling.registry import RefreshError, parse_refresh_body
from scheduling.status import instances_json

log = logging.getLogger("coordinator.management")
bp = Blueprint("management")
MAX_REFRESH_BYTES = 10 * 1024 * 1024


def _probe(message: str, **extra):
    return json({"status": "ok", "message": message, **extra})


@bp.get("/startup", ctx_plane=MGMT, ctx_keyless=True)
async def startup(request: Request):
    return _probe("started")


@bp.get("/liveness", ctx_plane=MGMT, ctx_keyless=True)
async def liveness(request: Request):
    return _probe("alive")


@bp.get("/readiness", ctx_plane=MGMT, ctx_keyless=True)
async def readiness(request: Request):
    ctx = request.app.ctx
    if ctx.door.draining:
        return json({"status": "ok", "message": "draining", "ready": False}, status=503)
    if ctx.cluster is not None and not ctx.shared.globals.first_synced:
        message = "starting: the cluster store's instance set is not read yet"
        return json({"status": "ok", "message": message, "ready": False}, status=503)
    view = ctx.registry.view()
    servable = _servable_models(view, ctx.health)
    n = len(view.instances)
    if not servable:
        # 200 all the same: the Coordinator itself is up, and /instances/refresh is how it gets an instance.
        return _probe(f"not ready: no model has a schedulable instance ({n} instances registered)", ready=False)
    return _probe(f"ready, {n} instances registered; models served: {', '.join(servable)}", ready=True)


def _servable_models(view, health) -> list[str]:
    """The models a request could be scheduled for now: some instance of the model not paused, healthy and its
    breaker not open. With a prefill and a decode that is a PD pair; a union, or a prefill or decode alone,
    serves requests whole (the scheduler's fallback)."""
    return [
        model
        for model in view.models()
        if any(
            not t.paused and health.usable(t.slot)
            for role in ("union", "prefill", "decode")
            for t in view.pool(model, role)
        )
    ]


def _refused(status: int, message: str, event: str | None = None, headers: dict | None = None):
    return json(
        {"request_id": "refresh_request", "status": "failed", "message": message, "data": {"event_type": event}},
        status=status,
        headers=headers,
    )


@bp.exception(Unauthorized)
def refused_key(request: Request, e: Unauthorized):
    """The management key (`mgmt_api_key_config`, checked by handlers/__init__.py's guard) missing or wrong, in
    the route's own answer: /instances/refresh's, or the short one."""
    message = "missing or invalid management key"
    if request.path == "/instances/refresh":
        return _refused(401, message, headers=e.headers)
    return json({"status": "failed", "message": message}, status=401, headers=e.headers)


@bp.get("/instances", ctx_plane=MGMT)
async def instances(request: Request):
    ctx = request.app.ctx
    view = ctx.registry.view()
    body = {
        "version": view.version,
        "instances": instances_json(view, ctx.ledger, ctx.health, ctx.shared.kv_endpoints),
        "prompt_tokens": ctx.scheduler.token_sources(view.models()),
    }
    if ctx.cluster is not None:  # which replica answered, and whether it shares the cluster's state now
        body["cluster"] = ctx.cluster.status()
    return json(body)


@bp.post("/instances/refresh", ctx_plane=MGMT)
async def refresh(request: Request):
    try:
        check_json_type(request)  # with the management key off, no web page may post here
    except UnsupportedMediaType as e:
        return _refused(e.status, e.message)
    raw = request.body or b""
    if len(raw) > MAX_REFRESH_BYTES:
        return _refused(413, f"body exceeds {MAX_REFRESH_BYTES} bytes")
    try:
        body = ujson.loads(raw)
    except ValueError as e:
        return _refused(400, f"body is not valid JSON: {unreadable_json(e)}")
    event = body.get("event") if isinstance(body, dict) else None
    try:
        event, items = parse_refresh_body(body)
        result = await request.app.ctx.registry.change(event, items)
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
