"""OpenAI /v1/responses as vLLM 0.32 serves it without a reasoning or tool parser: the request, the response
object (JSON), its SSE events, usage, and the responses each instance stores in its own memory.

vLLM stores a response only when started with VLLM_ENABLE_RESPONSES_API_STORE=1 (SimConfig.responses_store);
otherwise `store` is silently ignored, and `background` is refused. A stored response is found again by
`previous_response_id` (its conversation, input and output, goes before the new input), `GET
/v1/responses/{id}` and `POST /v1/responses/{id}/cancel` (background responses only); any other id is
vLLM's 404. vLLM 0.32 has no DELETE route (FastAPI answers 405), and never frees stored responses.
A background request is answered at once (`queued`) and generated on; a streamed background request is
served as a plain stream here (vLLM also replays its events on GET ?stream=true, which the sim does not).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from aiohttp import web

from . import tokens as T
from .engine import Seq
from .errors import ApiError, error_response
from .generation import Generation
from .json_text import dumps
from .kv_transfer import prefill_leg_ticket
from .protocol import ResponsesRequest
from .request import SimRequest, _new_request, check_served_model, validated
from .sse import SseWriter
from .state import SimState, Stored

INVALID = "invalid_request_error"


def not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id}' not found.", INVALID, "response_id")


def input_messages(value: Any) -> list[dict]:
    """The request's `input` as chat messages: a string is one user message; items are messages, function
    calls and their outputs (what vLLM's renderer turns into the conversation)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    out = []
    for item in value:
        kind = item.get("type")
        if kind == "function_call":
            out.append({"role": "assistant", "content": str(item.get("arguments") or "")})
        elif kind == "function_call_output":
            out.append({"role": "tool", "content": str(item.get("output") or "")})
        elif kind in (None, "message"):
            out.append({"role": item.get("role") or "user", "content": item.get("content")})
    return out


def parse(sim: SimState, body: dict) -> SimRequest:
    """The request; its prompt renders the conversation (a stored previous one first, then `input`)."""
    r: ResponsesRequest = validated("responses", body)
    check_served_model(r.model, sim.cfg)
    store = bool(r.store) and sim.cfg.responses_store
    if r.background and not store:
        raise ApiError(
            400,
            "This vLLM engine does not support `store=True` and therefore does not support the background mode. "
            "To enable these features, set the environment variable `VLLM_ENABLE_RESPONSES_API_STORE=1` when "
            "launching the vLLM server.",
            INVALID,
            "background",
        )
    messages: list[dict] = []
    if r.previous_response_id is not None:
        prev = sim.responses.get(r.previous_response_id)
        if prev is None:
            raise not_found(r.previous_response_id)
        messages = list(prev.messages)
    messages += input_messages(r.input)
    text = T.render_chat_prompt(messages, tools=r.tools, system=r.instructions)
    req = _new_request(r, body, "responses", text, bpt=sim.cfg.bytes_per_token)
    req.stop = r.stop
    req.include_usage = False
    P, L = req.prompt_tokens, sim.cfg.max_model_len
    if P > L:  # the renderer's check
        raise ApiError(
            400,
            f"This model's maximum context length is {L} tokens. However, your prompt contains {P} input tokens, "
            "which exceeds this limit even without any output tokens. Please reduce the length of the input prompt.",
            "BadRequestError",
            "input_tokens",
        )
    if P == L:  # then serving's own, which leaves no room for a token
        raise ApiError(
            400,
            f"The engine prompt length {P} exceeds the max_model_len {L}. Please reduce prompt.",
            INVALID,
            "input",
        )
    mt = r.max_output_tokens
    if mt is not None and mt < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {mt}.", "BadRequestError", "max_tokens")
    req.max_tokens = L - P if mt is None else min(mt, L - P)  # vLLM caps it at the context, without an error
    req.prompt_key = T.prompt_key(req.prompt_text)
    req.id = r.request_id or "resp_" + uuid.uuid4().hex
    req.responses = _Responses(r, store, messages)
    return req


class _Responses:
    """What the response object echoes of the request, and whether it is stored."""

    __slots__ = ("background", "messages", "request", "store")

    def __init__(self, r: ResponsesRequest, store: bool, messages: list[dict]):
        self.request, self.store, self.messages, self.background = r, store, messages, bool(r.background)


def usage(req: SimRequest, output: int) -> dict:
    """vLLM's ResponseUsage as its SimpleContext fills it: no per-turn counts (those are for tool-calling turns)."""
    p, c = req.prompt_tokens, req.cached_tokens
    return {
        "input_tokens": p,
        "input_tokens_details": {
            "cached_tokens": c,
            "cache_write_tokens": 0,
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": output,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": p + output,
    }


def _text_part(text: str) -> dict:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": None}


def _message(item_id: str, text: str, status: str) -> dict:
    content = [_text_part(text)] if text else []
    return {"id": item_id, "content": content, "role": "assistant", "status": status, "type": "message", "phase": None}


def response_object(
    sim: SimState, req: SimRequest, status: str, output: list, use: dict | None, kvt: dict | None = None
) -> dict:
    r = req.responses.request
    return {
        "id": req.id,
        "created_at": int(time.time()),
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": r.instructions,
        "metadata": r.metadata,
        "model": sim.cfg.model,
        "object": "response",
        "output": output,
        "parallel_tool_calls": True if r.parallel_tool_calls is None else r.parallel_tool_calls,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "tool_choice": r.tool_choice if r.tools else ("none" if r.tool_choice == "auto" else r.tool_choice),
        "tools": r.tools,
        "top_p": 1.0 if r.top_p is None else r.top_p,
        "background": req.responses.background,
        "max_output_tokens": req.max_tokens,
        "max_tool_calls": r.max_tool_calls,
        "previous_response_id": r.previous_response_id,
        "prompt": None,
        "reasoning": r.reasoning,
        "service_tier": r.service_tier,
        "status": status,
        "text": r.text,
        "top_logprobs": None,
        "truncation": r.truncation,
        "usage": use,
        "user": r.user,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "kv_transfer_params": kvt,
        "ec_transfer_params": None,
        "input_messages": None,
        "output_messages": None,
    }


def _status(g: Generation) -> str:
    return "incomplete" if g.finish[0] == "length" else "completed"


def _remember(sim: SimState, req: SimRequest, response: dict, text: str) -> None:
    if not req.responses.store:
        return
    stored = sim.responses.get(req.id)
    if stored is not None and stored.response["status"] == "cancelled":
        return  # vLLM keeps a cancelled response as it is
    messages = [*req.responses.messages, {"role": "assistant", "content": text}]
    if stored is None:
        sim.responses[req.id] = Stored(response, messages)
    else:
        stored.response, stored.messages = response, messages


def final_body(sim: SimState, req: SimRequest, g: Generation) -> dict:
    kvt = prefill_leg_ticket(sim, req, g)
    output = [_message("msg_" + uuid.uuid4().hex, g.texts[0], "completed")]
    body = response_object(sim, req, _status(g), output, usage(req, g.completion_tokens), kvt)
    _remember(sim, req, body, g.texts[0])
    return body


def queued(sim: SimState, req: SimRequest, g: Generation, seq: Seq) -> dict:
    """A background request's answer: stored as queued, generated on in a task that stores the final object."""
    body = response_object(sim, req, "queued", [], None)
    sim.responses[req.id] = stored = Stored(body, req.responses.messages)

    async def finish() -> None:
        try:
            await seq.wait_emitted(seq.max_len)
        except asyncio.CancelledError:  # cancelled (POST .../cancel): the engine stops generating it
            sim.engine.abort(seq, req.log_id)
            raise
        if not seq.aborted:
            final_body(sim, req, g)

    stored.task = asyncio.get_running_loop().create_task(finish())
    stored.task.add_done_callback(lambda _: setattr(stored, "task", None))
    return body


async def stream(sim: SimState, w: SseWriter, req: SimRequest, g: Generation, seq: Seq) -> None:
    """response.created, response.in_progress, the message's item and part events with one delta per token,
    their done events, response.completed: each `event: <type>` with a sequence number, no [DONE]."""
    number = 0

    async def send(obj: dict) -> None:
        nonlocal number
        obj["sequence_number"] = number
        number += 1
        await w.event(obj["type"], obj)

    initial = response_object(sim, req, "in_progress", [], None)
    await send({"response": initial, "type": "response.created"})
    await send({"response": initial, "type": "response.in_progress"})
    item_id = "msg_" + uuid.uuid4().hex
    where = {"item_id": item_id, "output_index": 0, "content_index": 0}
    opened = False
    text = ""
    pieces = g.pieces[0]
    for k in range(1, len(pieces) + 1):
        await seq.wait_emitted(k)
        piece = pieces[k - 1]
        if not piece:
            continue
        if not opened:  # vLLM opens the message at its first text
            opened = True
            await send(
                {"item": _message(item_id, "", "in_progress"), "output_index": 0, "type": "response.output_item.added"}
            )
            part = {"annotations": [], "text": "", "type": "output_text", "logprobs": []}
            await send({**where, "part": part, "type": "response.content_part.added"})
        text += piece
        await send({**where, "delta": piece, "logprobs": [], "type": "response.output_text.delta"})
    output = []
    if opened:
        await send({**where, "logprobs": [], "text": text, "type": "response.output_text.done"})
        await send({**where, "part": _text_part(text), "type": "response.content_part.done"})
        done = _message(item_id, text, "completed")
        await send({"item": done, "output_index": 0, "type": "response.output_item.done"})
        output.append(done)
    kvt = prefill_leg_ticket(sim, req, g)
    final = response_object(sim, req, _status(g), output, usage(req, len(pieces)), kvt)
    _remember(sim, req, final, text)
    await send({"response": final, "type": "response.completed"})


def add_routes(router: web.UrlDispatcher, sim: SimState) -> None:
    """GET and cancel of a stored response; DELETE as vLLM 0.32 (no such route) answers it."""

    def answer(e: ApiError | None, obj: dict | None = None) -> web.Response:
        if e is not None:
            return error_response(e, False)
        return web.Response(text=dumps(obj), content_type="application/json")

    async def retrieve(request: web.Request) -> web.Response:
        rid = request.match_info["response_id"]
        stored = sim.responses.get(rid)
        return answer(None, stored.response) if stored else answer(not_found(rid))

    async def cancel(request: web.Request) -> web.Response:
        rid = request.match_info["response_id"]
        stored = sim.responses.get(rid)
        if stored is None:
            return answer(not_found(rid))
        if stored.response["status"] not in ("queued", "in_progress"):
            return answer(ApiError(400, "Cannot cancel a synchronous response.", INVALID, "response_id"))
        stored.response = {**stored.response, "status": "cancelled"}
        if stored.task is not None:
            stored.task.cancel()
        return answer(None, stored.response)

    async def delete(request: web.Request) -> web.Response:
        return web.json_response({"detail": "Method Not Allowed"}, status=405, headers={"Allow": "GET"})

    router.add_get("/v1/responses/{response_id}", retrieve)
    router.add_delete("/v1/responses/{response_id}", delete)
    router.add_post("/v1/responses/{response_id}/cancel", cancel)
