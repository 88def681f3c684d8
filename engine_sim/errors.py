"""The errors the simulated vLLM answers with: the exception a request raises, and its response body.

OpenAI routes answer `{"error": {"message", "type", "param", "code"}}`; body-schema errors are vLLM's
RequestValidationError handler's (type "Bad Request", `param` the dotted location of the first error,
on every route); the Anthropic routes' other errors are `{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web
from pydantic import ValidationError

from .json_text import dumps

REQUEST_VALIDATION_TYPE = "Bad Request"


class ApiError(Exception):
    def __init__(self, status: int, message: str, etype: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.etype, self.param = status, message, etype, param
        self.raw_body: str | None = None  # an injected failure's body, sent as it is (`fail_body`)
        self.headers: dict[str, str] = {}  # an injected failure's extra headers (`fail_retry_after`)


def error_type_for_status(status: int) -> str:
    return {
        400: "BadRequestError",
        401: "AuthenticationError",
        403: "PermissionDeniedError",
        404: "NotFoundError",
        422: "UnprocessableEntityError",
        429: "RateLimitError",
        501: "NotImplementedError",
        503: "ServiceUnavailableError",
    }.get(status, "InternalServerError" if status >= 500 else "BadRequestError")


def validation_failure(details: list[dict], param: str) -> ApiError:
    """The 400 of vLLM's RequestValidationError handler for these pydantic error details."""
    plural = "" if len(details) == 1 else "s"
    message = f"{len(details)} validation error{plural}:\n  " + "\n  ".join(repr(d) for d in details)
    return ApiError(400, message, REQUEST_VALIDATION_TYPE, param)


def body_validation_failure(loc: tuple, msg: str, error_type: str, inp: Any) -> ApiError:
    """One schema error of the body found before its model is validated (a body that is not an object)."""
    return validation_failure(
        [{"type": error_type, "loc": ("body", *loc), "msg": msg, "input": inp}], ".".join(("body", *map(str, loc)))
    )


def from_validation_error(exc: ValidationError) -> ApiError:
    errors = exc.errors(include_url=False)
    details = [{"type": e["type"], "loc": ("body", *e["loc"]), "msg": e["msg"], "input": e["input"]} for e in errors]
    return validation_failure(details, ".".join(map(str, details[0]["loc"])))


def error_response(e: ApiError, anthropic_route: bool) -> web.Response:
    if e.raw_body is not None:
        resp = web.Response(status=e.status, text=e.raw_body, content_type="application/json")
    elif anthropic_route and e.etype != REQUEST_VALIDATION_TYPE:
        body = {"type": "error", "error": {"type": e.etype, "message": e.message}}
        resp = web.Response(status=e.status, text=dumps(body), content_type="application/json")
    else:
        body = {"error": {"message": e.message, "type": e.etype, "param": e.param, "code": e.status}}
        resp = web.Response(status=e.status, text=dumps(body), content_type="application/json")
    resp.headers.update(e.headers)
    return resp
