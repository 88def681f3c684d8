"""The whole life of one inference request: checks, dispatch, its answer, and how it ends (error, disconnect, drain)."""

from __future__ import annotations

import asyncio
import logging
from contextlib import nullcontext

from sanic import HTTPResponse, Request

from errors import (
    Api,
    CoordinatorError,
    ServiceUnavailable,
    UpstreamError,
    client_status,
    clip,
    sse_error_event,
)
from handlers.auth import check_key
from handlers.body import read_body, slo_header
from handlers.ids import request_id
from handlers.planes import INFER, check_plane
from handlers.sink import SanicSink, error_response
from serving.families import Family
from serving.job import job_from_body, parse_body
from serving.observe import RequestRecord, log_value
from serving.tenants import NO_TENANT, quota_headers

log = logging.getLogger("coordinator.handlers")
# The 4xx statuses the OpenAI and Anthropic SDKs retry by default (besides every 5xx).
SDK_RETRIED = frozenset({408, 409, 429})


async def serve_inference(request: Request, family: Family, from_client: bool = True):
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
    api = family.api
    rec = RequestRecord(rid, family.route, family=family)
    sink = SanicSink(request, rid, api, rec)
    tracing = ctx.tracing  # None unless tracer_config has an endpoint (serving/tracing.py)
    traced = (
        tracing.start_request(request.method, request.path, request.headers, rid) if tracing and from_client else None
    )
    try:
        if not from_client:
            rec.tenant = NO_TENANT  # its client request is counted for its tenant where it came in
        else:
            s = ctx.live.s
            if (pending := check_key(request, s.api_key, api, s.key_owners)) is not None:
                await pending  # a hashed key's first check (handlers/auth.py)
            rec.tenant = request.ctx.tenant
        raw = await read_body(request, ctx.live.s.max_request_body_bytes)
        job = job_from_body(family, raw, parse_body(raw), rid)
        job.tenant = rec.tenant
        if from_client:
            ctx.tenants.classify(job, request.headers.get("x-priority"))
        else:  # an engine's call: the salt its trigger-mode ticket's URL gave (serving/trigger.py `salted_url`)
            job.cache_salt = request.args.get("cache_salt")
        job.slo_ttft_ms = slo_header(request, "x-slo-ttft-ms")
        job.slo_tpot_ms = slo_header(request, "x-slo-tpot-ms")
        rec.model, rec.stream = clip(job.model), job.stream  # the log line's: a name can be megabytes
        if job.stream and family.usage_chunk_option and job.include_usage:
            rec.usage_event = True
        ctx.dispatcher.check(job, rec)
        with ctx.door.admit() if from_client else ctx.door.attend() as place:
            with ctx.tenants.admit(job, rec, sink.headers, place) if from_client else nullcontext():
                if (
                    place.pending is not None
                ):  # cluster mode: the cap, the rate and the tenant's quota in one round trip
                    await place.pending
                await ctx.dispatcher.serve(job, sink, rec)
        if sink.started:
            await sink.response.eof()
            return None
        return sink.response
    except CoordinatorError as e:
        return await _fail(sink, rec, e, api, rid)
    except asyncio.CancelledError:
        if sink.whole:  # the client had the whole answer: closing then (an SDK does after [DONE]) is no abort
            raise
        task = asyncio.current_task()
        if not ctx.door.was_cut(task):  # the client went away: nothing to answer
            rec.status = 499
            if from_client:  # an engine's metaserver call ends with its client's request, counted there
                rec.disconnect_phase = "streaming" if sink.started else "before_first_byte"
            raise
        task.uncancel()  # the drain window ended it: the client is still there and hears why
        return await _fail(sink, rec, ServiceUnavailable.draining(), api, rid)
    except Exception as e:  # never a traceback to the client
        log.exception("request_id=%s failed", log_value(rid))
        return await _fail(sink, rec, CoordinatorError(f"internal error: {type(e).__name__}"), api, rid)
    finally:
        ctx.observer.request_done(rec)
        if traced is not None:
            tracing.end_request(*traced, rec)


async def _fail(sink: SanicSink, rec: RequestRecord, err: CoordinatorError, api: Api, rid: str) -> HTTPResponse | None:
    """An error answer: the error response (with the x-ratelimit-* headers of a request its tenant's quota counted),
    or one SSE error event once the stream has started."""
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
    response = error_response(err, api, rid)
    # A request its tenant's quota counted (admitted, or refused by it) is told the quota's levels whatever its
    # answer, as OpenAI tells them: the levels its admission left, which its 200 would have carried.
    response.headers.update(quota_headers(sink.headers))
    return response
