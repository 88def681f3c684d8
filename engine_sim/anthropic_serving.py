"""Anthropic /v1/messages answers as vLLM 0.32's Anthropic serving writes them (JSON and SSE events),
and /v1/messages/count_tokens."""

from __future__ import annotations

import json
import uuid

from aiohttp import web

from . import tokens as T
from .engine import Seq
from .errors import ApiError
from .generation import Generation
from .json_text import dumps
from .kv_transfer import prefill_leg_ticket
from .request import SimRequest, anthropic_prompt_text, check_served_model, validated
from .sse import SseWriter
from .state import SimState

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def stop_reason(g: Generation) -> tuple[str, str | None]:
    """vLLM's (stop_reason, stop_sequence): a matched stop string is reported as `stop_sequence`."""
    if g.finish[0] == "stop" and isinstance(g.stop_reason[0], str):
        return "stop_sequence", g.stop_reason[0]
    return _STOP_REASONS.get(g.finish[0], "end_turn"), None


def usage(sim: SimState, req: SimRequest, completion: int) -> dict:
    """vLLM's _build_anthropic_usage: with cache details, `input_tokens` is the prompt less the cache
    reads and writes (Anthropic's total input is their sum). The sim reports no cache writes.
    (message_start is built from the stream's first chunk, which has no details: the whole prompt.)"""
    if not sim.cfg.anthropic_cache_usage:
        return {"input_tokens": req.prompt_tokens, "output_tokens": completion}
    return {
        "input_tokens": max(0, req.prompt_tokens - req.cached_tokens),
        "output_tokens": completion,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": req.cached_tokens,
    }


def _joined(g: Generation, kind: str) -> str:
    return "".join(p for p, k in zip(g.pieces[0], g.kinds or []) if k == kind)


def final_body(sim: SimState, req: SimRequest, g: Generation) -> dict:
    """The message, dumped with exclude_none as vLLM does."""
    kvt = prefill_leg_ticket(sim, req, g)
    tc = req.tool_choice
    if g.tool and g.finish[0] == "length" and isinstance(tc, dict) and tc.get("type") == "tool":
        # A named tool choice makes the whole answer the call's arguments, and vLLM's converter
        # json.loads them: a call cut by max_tokens raises a JSONDecodeError, a ValueError that
        # vLLM answers as 400 (after generating, and with any prefill leg's KV held for D).
        try:
            json.loads(_joined(g, "tool"))
        except ValueError as e:
            raise ApiError(400, str(e), "BadRequestError") from None
    content = []
    if g.thinking_n:
        content.append({"type": "thinking", "thinking": _joined(g, "thinking"), "signature": uuid.uuid4().hex})
    if g.texts[0]:
        content.append({"type": "text", "text": g.texts[0]})
    if g.tool and g.finish[0] == "tool_calls":
        content.append({"type": "tool_use", "id": g.tool[0], "name": g.tool[1], "input": g.tool[2]})
    if not content:  # vLLM's canonical empty completion: one empty text block
        content.append({"type": "text", "text": ""})
    reason, sequence = stop_reason(g)
    out = {
        "id": req.id,
        "type": "message",
        "role": "assistant",
        "content": content,
        "model": sim.cfg.model,
        "stop_reason": reason,
        "usage": usage(sim, req, g.completion_tokens),
    }
    if sequence is not None:
        out["stop_sequence"] = sequence
    if kvt is not None:
        out["kv_transfer_params"] = kvt
    return out


def _block_start(g: Generation, kind: str) -> dict:
    if kind == "thinking":
        return {"type": "thinking", "thinking": ""}
    if kind == "text":
        return {"type": "text", "text": ""}
    return {"type": "tool_use", "id": g.tool[0], "name": g.tool[1], "input": {}}


def _block_delta(kind: str, piece: str) -> dict:
    if kind == "thinking":
        return {"type": "thinking_delta", "thinking": piece}
    if kind == "text":
        return {"type": "text_delta", "text": piece}
    return {"type": "input_json_delta", "partial_json": piece}


async def _close_block(w: SseWriter, idx: int, kind: str, signature: str | None) -> None:
    if kind == "thinking":
        delta = {"type": "signature_delta", "signature": signature}
        await w.event("content_block_delta", {"type": "content_block_delta", "delta": delta, "index": idx})
    await w.event("content_block_stop", {"type": "content_block_stop", "index": idx})


async def stream(sim: SimState, w: SseWriter, req: SimRequest, g: Generation, seq: Seq) -> None:
    """message_start, content blocks (start, deltas, stop), message_delta, message_stop: no ping, no [DONE]."""
    message = {
        "id": req.id,
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": sim.cfg.model,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": req.prompt_tokens, "output_tokens": 0},
    }
    if req.return_token_ids:  # (SimConfig.messages_token_ids: an engine that has them on this route)
        message["prompt_token_ids"] = req.prompt_token_ids()
    await w.event("message_start", {"type": "message_start", "message": message})
    pieces, kinds = g.pieces[0], g.kinds or []
    idx = -1
    cur = None
    signature = None
    for k in range(1, len(pieces) + 1):
        await seq.wait_emitted(k)
        piece, kind = pieces[k - 1], kinds[k - 1]
        if not piece and kind != "tool":
            continue
        if kind != cur:
            if cur is not None:
                await _close_block(w, idx, cur, signature)
            idx += 1
            cur = kind
            if kind == "thinking":
                signature = uuid.uuid4().hex
            start = {"type": "content_block_start", "content_block": _block_start(g, kind), "index": idx}
            await w.event("content_block_start", start)
        if piece:
            await w.before_token(k, anthropic=True)
            delta = {"type": "content_block_delta", "delta": _block_delta(kind, piece), "index": idx}
            if req.return_token_ids:
                delta["token_ids"] = [g.ids[0][k - 1]]
            await w.event("content_block_delta", delta)
    if cur is not None:
        await _close_block(w, idx, cur, signature)
    reason, sequence = stop_reason(g)
    await w.event(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage(sim, req, len(pieces)),
        },
    )
    prefill_leg_ticket(sim, req, g)
    await w.event("message_stop", {"type": "message_stop"})


def count_tokens(sim: SimState, body: dict, headers: dict) -> web.Response:
    r = validated("count_tokens", body)
    check_served_model(r.model, sim.cfg)
    n = T.count_text_tokens(anthropic_prompt_text(r.messages, r.tools, r.system), sim.cfg.bytes_per_token)
    return web.Response(
        text=dumps({"input_tokens": n, "context_management": {"original_input_tokens": n}}),
        content_type="application/json",
        headers=headers,
    )
