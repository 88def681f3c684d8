"""Thin HTTP handlers, one module per endpoint family; `register(app)` mounts them all.

Each route is tagged with the plane (port) that serves it: inference, management or observability.
A request for a route of another plane gets 404, so management routes never answer on the inference
port and the reverse.

Sanic runs no middleware at all for a route that has none, which saves the inference routes 3-4 %
of their cost. So the plane guard and the request-id stamp are named middleware of every route except
those tagged `ctx_self_guarded` (the inference routes), whose handler does both itself (serve_inference).
A route that has neither at start-up stops the worker from starting (fail closed). The inference
handlers are plain functions returning serve_inference's coroutine, which Sanic awaits: a coroutine
layer fewer per request.
"""

from sanic import Request, Sanic

from handlers import anthropic, docs, management, metaserver, models, observability, openai, responses
from handlers.ids import REQUEST_ID, request_id
from handlers.planes import check_plane


# Plain functions, not coroutines: Sanic calls them without a coroutine to create and await.
def plane_guard(request: Request) -> None:
    if request.route is not None:
        check_plane(request, getattr(request.route.ctx, "plane", None))


def stamp_request_id(request: Request, response) -> None:
    # Handlers that know the request id set it; this covers probes, /metrics, the docs pages.
    if REQUEST_ID not in response.headers:
        response.headers[REQUEST_ID] = request_id(request)


def register(app: Sanic) -> None:
    for module in (openai, anthropic, responses, models, metaserver, management, observability):
        app.blueprint(module.bp)
    docs.mount(app)
    guarded = [r.name for r in app.router.routes if not getattr(r.ctx, "self_guarded", False)]
    app.register_named_middleware(plane_guard, guarded, "request", priority=100)
    app.register_named_middleware(stamp_request_id, guarded, "response", priority=100)
    app.before_server_start(check_guarded)


def check_guarded(app: Sanic) -> None:
    """At start-up (middleware finalized): a route added after `register` would have neither."""
    for route in app.router.routes:
        if getattr(route.ctx, "self_guarded", False):
            continue
        if plane_guard not in [m.func for m in route.extra.request_middleware]:
            raise RuntimeError(f"route {route.name} ({route.path}) has no plane guard")
        if stamp_request_id not in [m.func for m in route.extra.response_middleware]:
            raise RuntimeError(f"route {route.name} ({route.path}) has no request-id stamp")
