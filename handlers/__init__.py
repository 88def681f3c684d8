"""Thin HTTP handlers, one module per endpoint family; `register(app)` mounts them all.

Each route is tagged with the plane (port) that serves it: inference, management or observability.
A request for a route of another plane gets 404, so management routes never answer on the inference
port and the reverse.
"""

from sanic import Sanic

from handlers import anthropic, management, metaserver, models, observability, openai


def register(app: Sanic) -> None:
    for module in (openai, anthropic, models, metaserver, management, observability):
        app.blueprint(module.bp)
