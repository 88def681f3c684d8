"""What an inference request asks besides its route: its JSON body, read under the limit, and its SLO headers."""

from __future__ import annotations

from sanic import Request
from sanic.exceptions import BadRequest as SanicBadRequest, PayloadTooLarge as SanicPayloadTooLarge

from errors import InvalidRequest, PayloadTooLarge, UnsupportedMediaType


def check_json_type(request: Request) -> None:
    """The request says its body is JSON. A browser sends text/plain or a form without a preflight (a "simple request"),
    so a page could not make its visitor's browser post to a route that requires this."""
    content_type = request.headers.get("content-type", "")
    if content_type != "application/json" and content_type.split(";", 1)[0].strip().lower() != "application/json":
        raise UnsupportedMediaType("Content-Type must be application/json")


async def read_body(request: Request, limit: int) -> bytes:
    """The JSON body, read under the inference limit.

    Inference routes are streaming routes to Sanic, so the body is read here, not before the handler:
    Sanic's REQUEST_MAX_SIZE is one limit for every port, and a declared length over this one is refused
    before a byte of the body is read.
    """
    check_json_type(request)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        # The 413 says the connection closes, and the body is not read. A client that sent `Expect: 100-continue`
        # waits for a 100 before it sends the body: it gets the 413 alone (Sanic's writer would put a 100 in
        # front of any answer), and no body is waited for. Any other client's body is on its way, and Sanic
        # stops at once at the limit instead of reading it.
        stream = request.stream
        stream.keep_alive = False
        if stream.expecting_continue:
            stream.expecting_continue = False
            stream.request_body = None
        else:
            stream.request_max_size = limit
        raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
    request.stream.request_max_size = limit
    try:
        await request.receive_body()
    except SanicPayloadTooLarge:
        raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes") from None
    except SanicBadRequest as e:
        raise InvalidRequest(f"unreadable request body: {e}") from None
    # The caller's reference is the only one: Sanic keeps a connection's last request until the next one's head,
    # and a prompt of megabytes would stay with it on every idle keep-alive connection.
    raw, request.body = request.body or b"", b""
    return raw


def slo_header(request: Request, name: str) -> float:
    value = request.headers.get(name)
    if value is None:
        return 0.0
    try:
        v = float(value)
    except ValueError:
        raise InvalidRequest(f"header {name} must be a number of milliseconds") from None
    if not v > 0:
        raise InvalidRequest(f"header {name} must be positive")
    return v
