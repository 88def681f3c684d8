"""The Coordinator's error tree and the one place that renders it into OpenAI's or Anthropic's envelope.

    CoordinatorError                 base: an HTTP status and a message
    ├── InvalidRequest               400: the body or a field is wrong
    │   └── UnsupportedMediaType     415: the body is not application/json
    ├── Unauthorized                 401: missing or wrong API key
    ├── Forbidden                    403: the request names a target it may not use
    ├── NotFound                     404: unknown model or route
    ├── RequestTimeout               408: the client's head or body took longer than its deadline
    ├── PayloadTooLarge              413: the body exceeds the configured limit
    ├── HeaderFieldsTooLarge         431: the request's head exceeds Sanic's limit
    ├── RateLimited                  429: over the in-flight cap, the rate limit or the SLO budget
    ├── ServiceUnavailable           503: no usable engine instance, or shutting down
    └── UpstreamError                502: an engine failed
        ├── UpstreamConnectError     502: the engine could not be reached
        ├── UpstreamTimeout          504: the engine missed a deadline
        ├── UpstreamProtocolError    502: the engine answered something unparseable
        └── EngineStatusError        the engine answered an error status (relayed as is when 4xx)

OpenAI's envelope's `code` is a string or null for the Coordinator's own errors; an engine's error relayed
as is keeps the engine's own (vLLM's: the HTTP status, an integer), and one put into the envelope here
carries the status the client gets, an integer too (the OpenAPI document says so: handlers/docs.py).
An error's envelope describes the status the client gets (`client_status`), which for an engine's 5xx is
the Coordinator's 502, not the engine's status. Anthropic's envelope carries the request id at its top
level, as Anthropic's API does (the id is also the `request-id` header of every Anthropic-route answer).
"""

from __future__ import annotations

import math
import sys
from datetime import UTC
from email.utils import format_datetime, parsedate_to_datetime

import ujson

# Anthropic's error types by the HTTP status the client gets (https://docs.anthropic.com/en/api/errors).
# A 503 is only ever the Coordinator's own (no capacity, draining; an engine's 503 reaches the client as
# 502): Anthropic's `overloaded_error`, which its API sends with 529. Any other 5xx is an `api_error`.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
_ANTHROPIC_TYPE_NAMES = frozenset(_ANTHROPIC_TYPES.values()) | {"api_error", "billing_error"}


def anthropic_type(status: int) -> str:
    """Anthropic's error type for an HTTP status: any other 4xx is the client's fault, any 5xx the server's."""
    return _ANTHROPIC_TYPES.get(status) or ("invalid_request_error" if 400 <= status < 500 else "api_error")


class CoordinatorError(Exception):
    """Base of every error the Coordinator answers with."""

    status = 500
    openai_type = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = headers or {}

    @property
    def anthropic_type(self) -> str:
        return anthropic_type(client_status(self))


class InvalidRequest(CoordinatorError):
    """The request body or one of its fields is invalid."""

    status = 400
    openai_type = "invalid_request_error"


class UnsupportedMediaType(InvalidRequest):
    """The request does not carry Content-Type: application/json."""

    status = 415


class Unauthorized(CoordinatorError):
    """The API key is missing or wrong."""

    status = 401
    openai_type = "authentication_error"
    code = "invalid_api_key"
    CHALLENGE = {"WWW-Authenticate": "Bearer"}  # a 401 names the scheme it wants (RFC 9110 11.6.1)

    def __init__(self, message: str, **kw):
        super().__init__(message, **kw)
        self.headers = {**self.CHALLENGE, **self.headers}


class Forbidden(CoordinatorError):
    """The request names a target that is not a registered instance."""

    status = 403
    openai_type = "permission_error"
    code = "forbidden"


class NotFound(CoordinatorError):
    """The model (or route) does not exist."""

    status = 404
    openai_type = "invalid_request_error"
    code = "model_not_found"


class RequestTimeout(CoordinatorError):
    """The request's head or body did not arrive within its deadline (inference_workers_config)."""

    status = 408
    openai_type = "invalid_request_error"
    code = "request_timeout"


class PayloadTooLarge(CoordinatorError):
    """The body exceeds rate_limit_config.max_request_body_size."""

    status = 413
    openai_type = "invalid_request_error"
    code = "request_too_large"


class HeaderFieldsTooLarge(CoordinatorError):
    """The request's header fields exceed what Sanic reads of a request head."""

    status = 431
    openai_type = "invalid_request_error"
    code = "request_header_fields_too_large"


def _retry_after_header(seconds: float) -> dict[str, str]:
    """Retry-After in whole seconds, rounded up, at least 1 (a 0 would invite an immediate retry)."""
    return {"Retry-After": str(max(1, int(seconds + 0.999)))}


class RateLimited(CoordinatorError):
    """Too many requests: the in-flight cap, the rate limit or the SLO admission said no."""

    status = 429
    openai_type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_s: float = 1.0, reason: str = "rate_limit"):
        super().__init__(message, headers=_retry_after_header(retry_after_s))
        self.reason = reason

    @classmethod
    def by_rate(cls, message: str, status: int, retry_after_s: float) -> RateLimited:
        """The rate limit's refusal, in rate_limit_config's words and status (429 unless set otherwise)."""
        err = cls(message, retry_after_s=retry_after_s, reason="rate_limit")
        err.status = status
        return err

    @classmethod
    def by_quota(cls, kind: str, message: str, retry_after_s: float, reason: str) -> RateLimited:
        """A tenant's quota refusal: OpenAI's shape, whose `type` says which quota ("requests" or "tokens")."""
        err = cls(message, retry_after_s=retry_after_s, reason=reason)
        err.openai_type = kind
        return err


class ServiceUnavailable(CoordinatorError):
    """No engine instance can take the request, or the Coordinator is draining."""

    status = 503
    openai_type = "server_error"
    code = "service_unavailable"

    def __init__(self, message: str, *, reason: str = "no_capacity", retry_after_s: float = 1.0):
        # The SDKs wait as long as Retry-After says (up to a minute) before their retry, instead of their own
        # half-second backoff: long enough for a breaker to half-open or a health check to pass again.
        super().__init__(message, headers=_retry_after_header(retry_after_s))
        self.reason = reason

    @classmethod
    def draining(cls) -> ServiceUnavailable:
        return cls("the Coordinator is shutting down", reason="draining")


class UpstreamError(CoordinatorError):
    """An engine failed to serve the request."""

    status = 502
    openai_type = "server_error"
    code = "upstream_error"
    retryable = True

    def __init__(self, message: str, *, detail: str = "", **kw):
        # The client gets `message`; `detail` (which engine, the OS error, the engine's error body) is for
        # the log only: engine addresses and internals are the operator's, not the client's.
        super().__init__(message, **kw)
        self.detail = detail

    def __str__(self) -> str:
        return f"{self.message} [{self.detail}]" if self.detail else self.message


class UpstreamConnectError(UpstreamError):
    """The engine could not be reached."""


class UpstreamTimeout(UpstreamError):
    """The engine missed the connect, first-byte, idle or total deadline."""

    status = 504
    code = "upstream_timeout"


class UpstreamProtocolError(UpstreamError):
    """The engine answered something the Coordinator could not parse."""

    retryable = False


class EngineStatusError(UpstreamError):
    """The engine answered an error status; its body is kept to relay 4xx answers (408 and 429 once their
    retries are spent), with the engine's Retry-After when it sent one.

    A prompt longer than the model's context is the client's error whatever status the engine gave it
    (older vLLM answered it with a 500): it is a 400, never retried, and never counts against the engine.
    """

    RETRYABLE_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
    # vLLM's own wordings (renderers/params.py, v1/engine/input_processor.py) and Anthropic's.
    PROMPT_TOO_LONG = (b"maximum context length", b"longer than the maximum model length", b"prompt is too long")

    def __init__(self, status: int, body: bytes, retry_after: str | None = None):
        super().__init__(f"engine answered HTTP {status}", detail=body[:300].decode("utf-8", "replace"))
        self.engine_status = status
        if status >= 500 and any(m in body for m in self.PROMPT_TOO_LONG):
            status = 400
        self.status = status
        self.body = body
        self.retryable = status in self.RETRYABLE_STATUSES
        self.retry_after = _retry_after(retry_after) if status in (429, 503) else None
        if self.retry_after:
            self.headers["Retry-After"] = self.retry_after

    @property
    def relayed(self) -> bool:
        """Is this answer the request's own (relayed with its status and message), not the engine's failure?
        A 4xx, and a 501: vLLM answers that for what it does not implement (its NotImplementedError),
        promptly and every time. Neither counts against the engine's breaker."""
        return 400 <= self.status < 500 or self.status == 501


def _retry_after(value: str | None) -> str | None:
    """An engine's Retry-After in a form HTTP allows: whole seconds (a fraction rounded up) or an HTTP date
    (written anew, in GMT); anything else, a negative delay among it, is dropped rather than relayed."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = parsedate_to_datetime(value)
            if when.tzinfo is None:  # no zone given: HTTP dates are GMT
                when = when.replace(tzinfo=UTC)
            return format_datetime(when.astimezone(UTC), usegmt=True)
        except Exception:  # the parser raises TypeError, ValueError or OverflowError on what is not a date
            return None
    return str(math.ceil(seconds)) if math.isfinite(seconds) and seconds >= 0 else None


ECHO_CHARS = 256  # of a client's value quoted in an error message or a log line


def clip(text: str, limit: int = ECHO_CHARS) -> str:
    """A client's value as an error message or a log line quotes it: at most `limit` characters, and then a marker
    that says how many were left out (a name can be as long as the body limit)."""
    return text if len(text) <= limit else f"{text[:limit]}...[{len(text) - limit} more characters]"


def unreadable_json(e: ValueError) -> str:
    """Why a JSON document could not be read, in words for its sender. Python's words for an integer over its
    digit limit name an interpreter setting (`sys.set_int_max_str_digits`), which is nothing a client can change."""
    if "int_max_str_digits" in str(e):
        return f"an integer has more than {sys.get_int_max_str_digits()} digits"
    return str(e)


def json_bytes(obj: object) -> bytes:
    """Compact JSON bytes, non-ASCII and slashes as they are (every body the Coordinator writes).

    A lone UTF-16 surrogate (JSON allows `"\\ud83d"`: a client cut an emoji in two) has no UTF-8 form:
    such a document is written with every non-ASCII character escaped, which JSON reads back the same.
    """
    try:
        return ujson.dumps(obj, ensure_ascii=False, escape_forward_slashes=False).encode()
    except UnicodeEncodeError:
        return ujson.dumps(obj, ensure_ascii=True, escape_forward_slashes=False).encode()


class Api:
    """One API's conventions on the wire: its error envelope (OpenAI's here, Anthropic's in `_Anthropic`), the SSE
    event that ends a stream with an error, the headers that echo the request id, and the headers besides the
    configured one that may carry a client's key. A request's endpoint family names its API
    (serving/families/); /v1/models answers a client that sends `anthropic-version` in Anthropic's."""

    __slots__ = ("id_headers", "key_headers", "name")

    def __init__(self, name: str, id_headers: tuple[str, ...], key_headers: tuple[str, ...] = ()):
        self.name, self.id_headers, self.key_headers = name, id_headers, key_headers

    def __repr__(self) -> str:
        return self.name

    def error_body(self, err: CoordinatorError, rid: str) -> dict:
        return {"error": {"message": err.message, "type": err.openai_type, "param": err.param, "code": err.code}}

    def engine_error(self, err: EngineStatusError, rid: str) -> bytes:
        return _openai_engine_error(err)

    def error_event(self, body: bytes) -> bytes:
        return b"data: " + body + b"\n\n"


class _Anthropic(Api):
    __slots__ = ()

    def error_body(self, err: CoordinatorError, rid: str) -> dict:
        return _anthropic_error(err.anthropic_type, err.message, rid)

    def engine_error(self, err: EngineStatusError, rid: str) -> bytes:
        return _anthropic_engine_error(err, rid)

    def error_event(self, body: bytes) -> bytes:
        return b"event: error\ndata: " + body + b"\n\n"


REQUEST_ID = "X-Request-Id"  # every answer's: the client's own id when it sent a usable one (handlers/ids.py)
OPENAI = Api("openai", (REQUEST_ID,))
# Anthropic's answers carry the id as `request-id` too, which Anthropic's SDK reads (`message._request_id`,
# `APIStatusError.request_id`); its clients may present their key in `x-api-key`.
ANTHROPIC = _Anthropic("anthropic", (REQUEST_ID, "request-id"), ("x-api-key",))


def _anthropic_error(etype: str, message: str, rid: str) -> dict:
    return {"type": "error", "error": {"type": etype, "message": message}, "request_id": rid}


def _anthropic_engine_error(err: EngineStatusError, rid: str) -> bytes:
    """An engine's 4xx or 501 in Anthropic's envelope, its status and message kept.

    vLLM answers schema errors on /v1/messages in OpenAI's shape, and its Anthropic-shaped errors carry
    OpenAI's type names (`BadRequestError`); the client gets Anthropic's types either way.
    """
    body, inner, message = _engine_error_parts(err)
    etype = inner.get("type") if inner is not None and body.get("type") == "error" else None
    if not isinstance(etype, str) or etype not in _ANTHROPIC_TYPE_NAMES:
        etype = anthropic_type(err.status)
    return json_bytes(_anthropic_error(etype, message, rid))


def _openai_engine_error(err: EngineStatusError) -> bytes:
    """An engine's 4xx or 501 on an OpenAI route: vLLM's own error object as it is, anything else (a proxy's page,
    FastAPI's `{"detail": ...}`, an error object whose 5xx is the client's 400) put into OpenAI's envelope with
    its text as the message and the status the client gets as its code."""
    _, inner, message = _engine_error_parts(err)
    if inner is not None and inner.get("message") == message and err.engine_status == err.status:
        return err.body
    etype = "invalid_request_error" if err.status < 500 else "server_error"
    return json_bytes({"error": {"message": message, "type": etype, "param": None, "code": err.status}})


def _engine_error_parts(err: EngineStatusError) -> tuple[dict | None, dict | None, str]:
    """An engine's error body: the parsed object, its `error` object, and the message a client should read
    (the error's message, else FastAPI's `detail`, else the body's text)."""
    try:
        body = ujson.loads(err.body)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        body = None
    inner = body.get("error") if body is not None and isinstance(body.get("error"), dict) else None
    if inner is not None:
        message = inner.get("message")
    else:  # older vLLM: {"object": "error", "message": ...}; FastAPI: {"detail": ...}
        message = (body.get("message") or body.get("detail")) if body is not None else None
        if isinstance(message, list):  # FastAPI's validation errors: [{"loc": [...], "msg": ..., ...}]
            message = "; ".join(str(d.get("msg")) for d in message if isinstance(d, dict) and d.get("msg")) or None
    if not isinstance(message, str) or not message:
        message = err.body.decode("utf-8", "replace").strip() or f"engine answered HTTP {err.status}"
    return body, inner, message


def render(err: CoordinatorError, api: Api, rid: str) -> tuple[int, bytes, dict]:
    """Status, body bytes and headers of an error answered before any byte of a response was sent.

    A 4xx or 501 from an engine keeps its status and message: vLLM's error object as it is on OpenAI routes
    (the engine speaks that protocol), Anthropic's envelope on Anthropic routes.
    """
    headers = {"Content-Type": "application/json", **err.headers}
    if isinstance(err, EngineStatusError) and err.relayed:
        return err.status, api.engine_error(err, rid), headers
    return client_status(err), json_bytes(api.error_body(err, rid)), headers


def client_status(err: CoordinatorError) -> int:
    """The status the client is answered with: an engine's 5xx but 501 (or a redirect, which the Coordinator
    does not follow) is the Coordinator's 502 (bad gateway)."""
    if isinstance(err, EngineStatusError) and not err.relayed:
        return 502
    return err.status


def sse_error_event(err: CoordinatorError, api: Api, rid: str) -> bytes:
    """The one SSE event that ends a stream which already started."""
    return api.error_event(json_bytes(api.error_body(err, rid)))
