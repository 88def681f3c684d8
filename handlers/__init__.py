"""Thin HTTP handlers, one module per endpoint family; `register(app)` mounts them all.

Each route is tagged with the plane (port) that serves it: inference, management or observability.
A request for a route of another plane gets 404, so management routes never answer on the inference
port and the reverse.

The guard checks a route's plane and then its key: the inference port's routes take
`api_key_config`'s keys, the management and observability ports' `mgmt_api_key_config`'s, except a route
tagged `ctx_keyless` (the probes, /health, /metrics, the docs). No handler checks a key itself, so none
can forget to, nor forget to await a hashed key's check.

Sanic runs no middleware at all for a route that has none, which saves the inference routes 3-4 %
of their cost. So the guard and the request-id stamp are named middleware of every route except
those tagged `ctx_self_guarded` (the inference routes), whose handler does both itself (serve_inference).
A route that has neither at start-up stops the worker from starting (fail closed). The inference
handlers are plain functions returning serve_inference's coroutine, which Sanic awaits: a coroutine
layer fewer per request.
"""

from collections.abc import Awaitable

from sanic import Request, Sanic

from handlers import anthropic, docs, management, metaserver, models, observability, openai, responses, tokenize
from handlers.auth import check_key
from handlers.ids import REQUEST_ID, request_id
from handlers.planes import INFER, check_plane
from handlers.sink import api_of


# Plain functions, not coroutines: Sanic calls them without a coroutine to create and await, and awaits what
# they return when that is awaitable (a hashed key's check).
def guard(request: Request) -> Awaitable[None] | None:
    route = request.route
    if route is None:
        return None
    plane = getattr(route.ctx, "plane", None)
    check_plane(request, plane)
    if getattr(route.ctx, "keyless", False):
        return None
    s = request.app.ctx.live.s
    if plane == INFER:
        return check_key(request, s.api_key, api_of(request), s.key_owners)
    return check_key(request, s.mgmt_api_key, api_of(request), s.mgmt_key_owners)


def stamp_request_id(request: Request, response) -> None:
    # Handlers that know the request id set it; this covers probes, /metrics, the docs pages.
    if REQUEST_ID not in response.headers:
        response.headers[REQUEST_ID] = request_id(request)


def register(app: Sanic) -> None:
    for module in (openai, anthropic, responses, tokenize, models, metaserver, management, observability):
        app.blueprint(module.bp)
    docs.mount(app)
    guarded = [r.name for r in app.router.routes if not getattr(r.ctx, "self_guarded", False)]
    app.register_named_middleware(guard, guarded, "request", priority=100)
    app.register_named_middleware(stamp_request_id, guarded, "response", priority=100)
    app.before_server_start(check_guarded)


def check_guarded(app: Sanic) -> None:
    """At start-up (middleware finalized): a route added after `register` would have neither."""
    for r in app.router.routes:
        if getattr(r.ctx, "self_guarded", False):
            continue
        if guard not in [m.func for m in r.extra.request_middleware]:
            raise RuntimeError(f"route {r.name} ({r.path}) has no plane guard")
        if stamp_request_id not in [m.func for m in r.extra.response_middleware]:
            raise RuntimeError(f"route {r.name} ({r.path}) has no request-id stamp")
