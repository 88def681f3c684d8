"""What every inference handler shares: request ids, auth, body checks, the response sink, error answers."""

from __future__ import annotations

import asyncio
import hmac
import logging
from random import getrandbits

from sanic import HTTPResponse, Request
from sanic.exceptions import BadRequest as SanicBadRequest, PayloadTooLarge as SanicPayloadTooLarge
from sanic.helpers import has_message_body

from config import ApiKeyConfig
from errors import (
    ANTHROPIC,
    OPENAI,
    CoordinatorError,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    ServiceUnavailable,
    Unauthorized,
    UnsupportedMediaType,
    UpstreamError,
    client_status,
    render,
    sse_error_event,
)
from serving.job import VISIBLE, job_from_body, parse_body
from serving.observe import RequestRecord

log = logging.getLogger("coordinator.handlers")
REQUEST_ID = "X-Request-Id"
# Anthropic routes send the same id as `request-id` too: Anthropic's SDK reads that header
# (`message._request_id`, `APIStatusError.request_id`).
ANTHROPIC_REQUEST_ID = "request-id"
INFER, MGMT, OBS = "infer", "mgmt", "obs"
# The 4xx statuses the OpenAI and Anthropic SDKs retry by default (besides every 5xx).
SDK_RETRIED = frozenset({408, 409, 429})


def check_plane(request: Request, plane: str | None) -> None:
    """A route is served only on its own plane's port; elsewhere (or with no plane: fail closed) it is a 404.

    The socket's own port decides: request.server_port comes from the Host header, which the client writes.
    """
    port = request.conn_info.server_port if request.conn_info else None
    if plane is None or plane != request.app.ctx.plane_by_port.get(port):
        raise NotFound(f"no route {request.method} {request.path} on this port", code="not_found")


def request_id(request: Request) -> str:
    rid = request.headers.get(REQUEST_ID)
    # A client's id is taken when it is at most 128 characters of printable ASCII without spaces: it goes into
    # every log line of the request as a `key=value` field, which spaces or line breaks in it would forge.
    # Otherwise 128 random bits, like uuid4().hex: an id must be unique, not unguessable, so no getrandom
    # syscall (each worker's generator is seeded from the OS when it starts).
    return rid if rid and len(rid) <= 128 and VISIBLE.fullmatch(rid) else "%032x" % getrandbits(128)


def presented_key(request: Request, cfg: ApiKeyConfig) -> str | None:
    """The key in the configured header after its prefix, if any. The prefix is an auth scheme ("Bearer "),
    which HTTP compares without regard to case (RFC 9110 11.1): "bearer KEY" is the same."""
    value = request.headers.get(cfg.header_name)
    if value is None:
        return None
    n = len(cfg.key_prefix)
    return value[n:] if value.startswith(cfg.key_prefix) or value[:n].lower() == cfg.key_prefix.lower() else None


def valid_key(cfg: ApiKeyConfig, key: str) -> bool:
    # Compare against every valid key so timing reveals neither the key nor which one matched.
    # Sanic decodes header bytes with surrogateescape: encoding back the same way gives the bytes sent
    # (a key that is not UTF-8 is simply wrong, not an error).
    presented = key.encode("utf-8", "surrogateescape")
    return any([hmac.compare_digest(presented, valid.encode()) for valid in cfg.valid_keys])  # noqa: C419 (all compared)


def check_api_key(request: Request, api: str) -> None:
    cfg = request.app.ctx.settings.api_key
    if not cfg.enable_api_key:
        return
    key = presented_key(request, cfg)
    presented = [] if key is None else [key]
    if api == ANTHROPIC and request.headers.get("x-api-key") is not None:
        presented.append(request.headers["x-api-key"])
    if any(valid_key(cfg, key) for key in presented):
        return
    raise Unauthorized("Missing or invalid API key." if presented else "Missing API key.")


async def read_body(request: Request, limit: int) -> bytes:
    """The JSON body, read under the inference limit.

    Inference routes are streaming routes to Sanic, so the body is read here, not before the handler:
    Sanic's REQUEST_MAX_SIZE is one limit for every port, and a declared length over this one is refused
    before a byte of the body is read.
    """
    content_type = request.headers.get("content-type", "")
    if content_type.split(";", 1)[0].strip().lower() != "application/json":
        raise UnsupportedMediaType("Content-Type must be application/json")
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
    return request.body or b""


def error_response(err: CoordinatorError, api: str, rid: str) -> HTTPResponse:
    status, body, headers = render(err, api, rid)
    headers[REQUEST_ID] = rid
    if api == ANTHROPIC:
        headers[ANTHROPIC_REQUEST_ID] = rid
    return HTTPResponse(
        body, status=status, headers=headers, content_type=headers.pop("Content-Type", "application/json")
    )


class RelayResponse(HTTPResponse):
    """A response whose headers the Coordinator wrote: a plain dict, written without Sanic's sanitizing.

    HTTPResponse's constructor makes Sanic's `Header` multidict twice, and Sanic strips CR, LF and NUL from
    every header name and value (a `str.translate` each): together about 6 µs of a JSON answer. Here the
    names are constants and the values are constants, numbers and the request id, which `request_id`
    accepts only when printable, so there is nothing to strip; and Sanic's writer only tests, sets and pops
    lowercase names on `headers`, which a dict does as well as a multidict.
    """

    __slots__ = ()

    def __init__(self, body: bytes, status: int, headers: dict[str, str], content_type: str):
        self.asgi, self.stream, self._cookies = False, None, None
        self.body, self.status, self.headers, self.content_type = body, status, headers, content_type

    @property
    def processed_headers(self):
        if has_message_body(self.status):
            self.headers.setdefault("content-type", self.content_type)
        return [(name.encode(), f"{value}".encode()) for name, value in self.headers.items()]


class SanicSink:
    """The dispatcher's view of the client connection; what goes out is noted on the request's record."""

    __slots__ = ("api", "ended", "headers", "rec", "request", "response", "rid", "started", "writable")

    def __init__(self, request: Request, rid: str, api: str, rec: RequestRecord):
        self.request, self.rid, self.api, self.rec = request, rid, api, rec
        # The headers of its one answer, JSON or stream.
        self.headers = {REQUEST_ID: rid, ANTHROPIC_REQUEST_ID: rid} if api == ANTHROPIC else {REQUEST_ID: rid}
        self.started = self.ended = False
        self.response = None

    def json(self, status: int, body: bytes) -> None:
        self.rec.answered(body)
        self.response = RelayResponse(body, status, self.headers, "application/json")

    async def start_stream(self) -> None:
        self.headers["Cache-Control"] = "no-cache"
        self.response = await self.request.respond(RelayResponse(b"", 200, self.headers, "text/event-stream"))
        # Set while the client's connection takes more bytes (Sanic's protocol clears it when the send
        # buffer is full: its `send` then waits for the client to read).
        self.writable = self.request.transport.get_protocol()._can_write
        self.started = True

    async def send(self, data: bytes, last: bool = False) -> None:
        if self.ended:
            return
        self.ended = last
        if not self.writable.is_set():
            return await self._send_to_a_full_buffer(data, last)
        # Straight to the connection's writer (Sanic's Http.send), past the response's own send, which only
        # normalises its arguments: one coroutine fewer per relayed chunk.
        await self.response.stream.send(data, last)

    async def _send_to_a_full_buffer(self, data: bytes, last: bool) -> None:
        """The client is not reading: wait for it as long as for a silent engine (`stream_idle_timeout`), then
        drop its connection, which Sanic answers by cancelling the request: it ends as a disconnect, and its
        engine request and capacity are given back (otherwise they were held until the client left)."""
        try:
            async with asyncio.timeout(self.request.app.ctx.settings.stream_idle_timeout_s):
                await self.response.stream.send(data, last)
        except TimeoutError:
            self.ended = True
            log.warning("request_id=%s: the client stopped reading; its connection is dropped", self.rid)
            self.request.transport.abort()
            await asyncio.sleep(1.0)  # Sanic cancels this task once the connection is lost
            raise asyncio.CancelledError from None


async def serve_inference(request: Request, route: str, api: str, from_client: bool = True):
    """Validate, authenticate and dispatch one inference request; the whole life of its response.

    `from_client` False: an engine's metaserver call, part of a client request that was authenticated
    and admitted already (counting it again would make a trigger-mode request take two in-flight places,
    and refuse its second half during a drain); this worker's drain still waits for it, as its client's
    worker waits for the client request.

    Its routes are `ctx_self_guarded`: Sanic runs no middleware for them (see handlers/__init__.py), so the
    plane check is here, before anything is recorded (the 404 is rendered by the app's error handler, like
    any route's), and every answer carries the request id.
    """
    check_plane(request, INFER)
    ctx = request.app.ctx
    rid = request_id(request)
    rec = RequestRecord(rid, route)
    sink = SanicSink(request, rid, api, rec)
    try:
        if from_client:
            check_api_key(request, api)
        raw = await read_body(request, ctx.settings.max_request_body_bytes)
        job = job_from_body(route, api, raw, parse_body(raw), rid)
        job.slo_ttft_ms = _slo_header(request, "x-slo-ttft-ms")
        job.slo_tpot_ms = _slo_header(request, "x-slo-tpot-ms")
        rec.model, rec.stream = job.model, job.stream
        if job.stream and api == OPENAI and job.include_usage:
            rec.usage_event = True
        with ctx.admission.admit() if from_client else ctx.admission.attend():
            await ctx.dispatcher.serve(job, sink, rec)
        if sink.started:
            await sink.response.eof()
            return None
        return sink.response
    except CoordinatorError as e:
        return await _fail(sink, rec, e, api, rid)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if not ctx.admission.was_cut(task):  # the client went away: nothing to answer
            rec.status = 499
            if from_client:  # an engine's metaserver call ends with its client's request, counted there
                rec.disconnect_phase = "streaming" if sink.started else "before_first_byte"
            raise
        task.uncancel()  # the drain window ended it: the client is still there and hears why
        return await _fail(sink, rec, ServiceUnavailable.draining(), api, rid)
    except Exception as e:  # never a traceback to the client
        log.exception("request_id=%s failed", rid)
        return await _fail(sink, rec, CoordinatorError(f"internal error: {type(e).__name__}"), api, rid)
    finally:
        ctx.observer.request_done(rec)


async def _fail(sink: SanicSink, rec: RequestRecord, err: CoordinatorError, api: str, rid: str) -> HTTPResponse | None:
    """An error answer: the error response, or one SSE error event once the stream has started."""
    rec.status, rec.error = client_status(err), str(err)  # what its error says, and for the log which engine
    if rec.target is None and rec.prefill is None:  # refused before reaching an engine
        rec.reject_reason = getattr(err, "reason", "")
    if sink.started:
        await sink.send(sse_error_event(err, api, rid))
        await sink.response.eof()
        return None
    if (
        isinstance(err, UpstreamError)
        and (rec.retries or not err.retryable)
        and (rec.status >= 500 or rec.status in SDK_RETRIED)
        and "Retry-After" not in err.headers
    ):
        # The Coordinator has retried already (on other engines when it had them), or judged a retry useless:
        # the SDKs' own retries, which obey this header, would multiply the load on failing engines and open
        # healthy ones' breakers. An engine that asked for time (Retry-After, relayed) gets the client back
        # after it instead.
        err.headers["x-should-retry"] = "false"
    if getattr(err, "reason", "") == "draining":
        # The client's retry must take a new connection, which the Service sends to a pod still serving.
        sink.request.stream.keep_alive = False
    return error_response(err, api, rid)


def _slo_header(request: Request, name: str) -> float:
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


def api_of_path(path: str) -> str:
    return ANTHROPIC if path.startswith("/v1/messages") else OPENAI
