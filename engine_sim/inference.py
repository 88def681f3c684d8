"""The inference routes' common flow: read and record the body, apply the fault knobs, parse the request,
then run it through the engine (prefix cache, remote KV, batching) and answer in its route's shape."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from aiohttp import web

from . import anthropic_serving, openai_serving, responses_serving, tokenization, tokens as T
from .engine import Seq
from .errors import ApiError, body_validation_failure, error_response, validation_failure
from .faults import SimulatedClose, drop
from .generation import Generation, eos_at_once, generate
from .json_text import dumps
from .kv_transfer import is_decode_leg, is_prefill_leg, pull_remote_prefill
from .request import SimRequest, parse_request
from .sse import SSE_HEADERS, SseWriter
from .state import SimState

SERVING = {
    "chat": openai_serving,
    "completions": openai_serving,
    "messages": anthropic_serving,
    "responses": responses_serving,
}
ANTHROPIC_ROUTES = ("messages", "count_tokens")
# Routes that generate nothing: answered at once, with no stats and no faults.
COUNTING = {
    "count_tokens": anthropic_serving.count_tokens,
    "tokenize": tokenization.tokenize,
    "detokenize": tokenization.detokenize,
}


async def serve(sim: SimState, request: web.Request, kind: str) -> web.StreamResponse:
    """Answer one request of a route: kind is chat, completions, messages, responses or one of COUNTING."""
    if sim.faults.dead:  # a dead engine: the connection goes with no answer
        drop(request)
        raise ConnectionResetError("the engine is dead (mid_stream_fault: die)")
    body, unreadable = await _read_body(sim, request)
    counted = kind not in COUNTING
    if counted:
        sim.engine.stats["received"] += 1
    xrid = request.headers.get("X-Request-Id")
    headers = {"X-Request-Id": xrid} if xrid else {}
    try:
        if unreadable:
            raise unreadable
        if not counted:
            return COUNTING[kind](sim, body, headers)
        await sim.faults.before_first_byte()
        if kind == "responses":  # its id is the body's `request_id` (or a fresh one), not the X-Request-Id
            req = responses_serving.parse(sim, body)
        else:
            req = parse_request(kind, body, sim.cfg)
            req.id = ("cmpl-" if kind == "completions" else "chatcmpl-") + (xrid or uuid.uuid4().hex)
    except (ApiError, UnicodeError) as e:
        if isinstance(e, UnicodeError):  # a lone surrogate, say: vLLM answers a ValueError in the prompt with 400
            e = ApiError(400, str(e), "BadRequestError")
        return _failed(sim, kind, e, headers, counted)
    req.log_id = xrid or req.id
    try:
        return await _run(sim, request, req, headers)
    except ApiError as e:
        return _failed(sim, kind, e, headers, counted)


def _failed(sim: SimState, kind: str, e: ApiError, headers: dict, counted: bool) -> web.Response:
    if counted:
        sim.engine.stats["failed"] += 1
    resp = error_response(e, kind in ANTHROPIC_ROUTES)
    resp.headers.update(headers)
    return resp


async def _read_body(sim: SimState, request: web.Request) -> tuple[dict, ApiError | None]:
    """The JSON object sent, or the 400 it is answered with; recorded for /sim/requests (an invalid one raw)."""
    raw = await request.read()
    record = {"path": request.path, "headers": dict(request.headers.items()), "body": None}
    try:
        body = json.loads(raw) if raw else None
    except Exception as e:
        sim.records.append({**record, "raw": raw.decode("utf-8", "replace"), "time": time.time()})
        pos = getattr(e, "pos", 0)
        detail = {
            "type": "json_invalid",
            "loc": f"body.{pos}",
            "msg": "JSON decode error",
            "input": "<dict of 0 items>",
            "ctx": {"error": getattr(e, "msg", str(e))},
        }
        return {}, validation_failure([detail], f"body.{pos}")
    sim.records.append({**record, "body": body, "time": time.time()})
    if not isinstance(body, dict):
        return {}, body_validation_failure((), "Input should be a valid dictionary", "model_attributes_type", body)
    return body, None


async def _run(sim: SimState, request: web.Request, req: SimRequest, headers: dict) -> web.StreamResponse:
    eng, cfg = sim.engine, sim.cfg
    if req.priority and cfg.scheduling_policy != "priority":  # vLLM's engine refuses it so (a 400)
        raise ApiError(400, f"Got priority {req.priority} but Priority scheduling is not enabled.", "BadRequestError")
    g = eos_at_once(req) if is_prefill_leg(sim, req) and sim.faults.eos_on_prefill else generate(req)
    remote_hit = await pull_remote_prefill(sim, req) if is_decode_leg(sim, req) else 0
    hashes = T.block_hashes(req.prompt_text, cfg.block_size, cfg.bytes_per_token, req.cache_salt)
    prefix_hit = 0
    if not remote_hit:
        # As vLLM: at least the last prompt token is computed, so a hit is whole blocks of the first n - 1.
        reusable = max(req.prompt_tokens - 1, 0) // cfg.block_size
        prefix_hit = eng.prefix_match(hashes[:reusable]) * cfg.block_size
    eng.account_prompt(req.prompt_tokens, prefix_hit if not remote_hit else 0, remote_hit)
    req.cached_tokens = max(prefix_hit, remote_hit)
    out_lens = [len(p) for p in g.pieces]
    ids = T.text_token_ids(req.prompt_text, cfg.bytes_per_token) if eng.kv_events is not None and hashes else None
    seq = Seq(req.id, req.prompt_tokens, req.cached_tokens, out_lens, hashes, ids)
    seq.priority, seq.cache_salt = req.priority, req.cache_salt
    if cfg.zero_latency:
        seq.emitted = seq.max_len
        seq.done = True
        eng.stats["generation_tokens"] += sum(out_lens)
        if hashes:
            eng.prefix_insert(hashes, ids, req.cache_salt)
    else:
        eng.submit(seq)
    serving = SERVING[req.kind]
    try:
        if req.stream:
            return await _stream(sim, request, req, g, seq, headers)
        if req.responses is not None and req.responses.background:
            body = responses_serving.queued(sim, req, g, seq)
            return web.Response(text=dumps(body), content_type="application/json", headers=headers)
        await seq.wait_emitted(seq.max_len)
        body = serving.final_body(sim, req, g)
        eng.stats["completed"] += 1
        eng.success[g.finish[0]] += 1
        return web.Response(text=dumps(body), content_type="application/json", headers=headers)
    except (asyncio.CancelledError, ConnectionResetError, ConnectionError):
        if not seq.done:
            eng.abort(seq, req.log_id)
        raise


async def _stream(
    sim: SimState, request: web.Request, req: SimRequest, g: Generation, seq: Seq, headers: dict
) -> web.StreamResponse:
    resp = web.StreamResponse(status=200, headers={**SSE_HEADERS, **headers})
    await resp.prepare(request)
    sim.faults.streams[id(request)] = request
    try:
        await SERVING[req.kind].stream(sim, SseWriter(request, resp, sim.faults), req, g, seq)
    except SimulatedClose:
        sim.engine.drop(seq)
        return resp
    finally:
        sim.faults.streams.pop(id(request), None)
    sim.engine.stats["completed"] += 1
    sim.engine.success[g.finish[0]] += 1
    await sim.faults.linger()
    await resp.write_eof()
    return resp
