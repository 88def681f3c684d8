"""Planes: the Coordinator's three ports (inference, management, observability), each serving only its routes.

A route is tagged with its plane (`ctx_plane`); handlers/__init__.py guards every route but the inference
ones, whose handler checks itself (handlers/lifetime.py).
"""

from __future__ import annotations

from sanic import Request

from errors import NotFound

INFER, MGMT, OBS = "infer", "mgmt", "obs"  # the plane of a route: the port (api, management, metrics) it answers on


def check_plane(request: Request, plane: str | None) -> None:
    """A route is served only on its own plane's port; elsewhere (or with no plane: fail closed) it is a 404.

    The socket's own port decides: request.server_port comes from the Host header, which the client writes.
    """
    port = request.conn_info.server_port if request.conn_info else None
    if plane is None or plane != request.app.ctx.plane_by_port.get(port):
        raise NotFound(f"no route {request.method} {request.path} on this port", code="not_found")
