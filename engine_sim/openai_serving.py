"""OpenAI /v1/chat/completions and /v1/completions answers, field for field as vLLM 0.32 serializes them:
JSON bodies, SSE chunks, usage and logprobs."""

from __future__ import annotations

import time

from . import tokens as T
from .engine import Seq
from .generation import Generation
from .json_text import dumps
from .kv_transfer import prefill_leg_ticket
from .request import SimRequest
from .sse import SseWriter
from .state import SimState


def usage(req: SimRequest, completion: int, stream: bool = False) -> dict:
    """Usage as vLLM 0.32 started with --enable-prompt-tokens-details serializes it, field for field."""
    p = req.prompt_tokens
    details = {"cached_tokens": req.cached_tokens}
    if req.kind == "chat":
        details["created_cache_tokens"] = 0
    elif not stream:
        details["created_cache_tokens"] = None
    if not stream:
        details["multimodal_tokens"] = None
    out = {
        "prompt_tokens": p,
        "total_tokens": p + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": details,
    }
    if not stream:
        out["completion_tokens_details"] = None
    return out


def _top_word(req: SimRequest, c: int, i: int, rank: int) -> str:
    return T.token_word(req.prompt_key, 1000 + rank, None, c, i)


def chat_logprobs(req: SimRequest, c: int, pieces) -> dict | None:
    if not req.logprobs:
        return None
    pk, k = req.prompt_key, req.top_logprobs
    content = []
    for i, p in enumerate(pieces):
        top = []
        for r in range(k):
            token = p if r == 0 else _top_word(req, c, i, r)
            top.append({"token": token, "logprob": T.token_logprob(pk, c, i, r), "bytes": list(token.encode())})
        content.append(
            {"token": p, "logprob": T.token_logprob(pk, c, i), "bytes": list(p.encode()), "top_logprobs": top}
        )
    return {"content": content}


def completion_logprobs(req: SimRequest, c: int, pieces) -> dict | None:
    if not req.logprobs:
        return None
    pk, k = req.prompt_key, req.top_logprobs
    offs, lps, toks, tops = [], [], [], []
    off = 0
    for i, p in enumerate(pieces):
        offs.append(off)
        off += len(p)
        lps.append(T.token_logprob(pk, c, i))
        toks.append(p)
        d = {p: T.token_logprob(pk, c, i)}
        for r in range(1, k):
            d.setdefault(_top_word(req, c, i, r), T.token_logprob(pk, c, i, r))
        tops.append(d)
    return {"text_offset": offs, "token_logprobs": lps, "tokens": toks, "top_logprobs": tops}


def _ids(req: SimRequest, ids) -> list[int] | None:
    """What a `token_ids` or `prompt_token_ids` field holds: the ids when return_token_ids, else null."""
    return list(ids) if req.return_token_ids else None


def _chat_choices(req: SimRequest, g: Generation) -> list[dict]:
    return [
        {
            "index": c,
            "message": {
                "role": "assistant",
                "content": g.texts[c],
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "reasoning": None,
            },
            "logprobs": chat_logprobs(req, c, pieces),
            "finish_reason": g.finish[c],
            "stop_reason": g.stop_reason[c],
            "token_ids": _ids(req, g.ids[c]),
            "routed_experts": None,
        }
        for c, pieces in enumerate(g.pieces)
    ]


def _completion_choices(req: SimRequest, g: Generation) -> list[dict]:
    return [
        {
            "index": c,
            "text": (req.prompt_text + g.texts[c]) if req.echo else g.texts[c],
            "logprobs": completion_logprobs(req, c, pieces),
            "finish_reason": g.finish[c],
            "stop_reason": g.stop_reason[c],
            "token_ids": _ids(req, g.ids[c]),
            "prompt_logprobs": None,
            "prompt_token_ids": _ids(req, req.prompt_token_ids()) if req.return_token_ids else None,
            "routed_experts": None,
        }
        for c, pieces in enumerate(g.pieces)
    ]


def final_body(sim: SimState, req: SimRequest, g: Generation) -> dict:
    kvt = prefill_leg_ticket(sim, req, g)
    chat = req.kind == "chat"
    body = {
        "id": req.id,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": sim.cfg.model,
        "choices": _chat_choices(req, g) if chat else _completion_choices(req, g),
        "service_tier": None,
        "system_fingerprint": sim.fingerprint,
        "usage": usage(req, g.completion_tokens),
    }
    if chat:
        prompt_ids = _ids(req, req.prompt_token_ids()) if req.return_token_ids else None
        body.update(prompt_logprobs=None, prompt_token_ids=prompt_ids, prompt_text=None)
    body.update(kv_transfer_params=kvt, ec_transfer_params=None, metrics=None)
    return body


async def stream(sim: SimState, w: SseWriter, req: SimRequest, g: Generation, seq: Seq) -> None:
    chat = req.kind == "chat"
    obj = "chat.completion.chunk" if chat else "text_completion"
    head = f'{{"id":{dumps(req.id)},"object":"{obj}","created":{int(time.time())},"model":{dumps(sim.cfg.model)},'
    continuous = req.continuous_usage and req.include_usage
    done_tokens = [0] * len(g.pieces)

    def usage_so_far() -> str:
        return f',"usage":{dumps(usage(req, sum(done_tokens), stream=True))}' if continuous else ""

    # return_token_ids: the prompt's ids once, in chat's first chunk (at its top level) and in each completions
    # choice's first chunk (in the choice); every later chunk's `token_ids` are the ids of its delta.
    prompt_ids = dumps(req.prompt_token_ids()) if req.return_token_ids else "null"
    owed = set(range(len(g.pieces))) if req.return_token_ids and not chat else set()
    if chat:
        for c in range(len(g.pieces)):
            ch = {"index": c, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            await w.data(
                head + f'"choices":[{dumps(ch)}]{usage_so_far()},"prompt_token_ids":{prompt_ids},"prompt_text":null}}'
            )
    elif req.echo:
        for c in range(len(g.pieces)):
            ch = {"index": c, "text": req.prompt_text, "logprobs": None, "finish_reason": None, "stop_reason": None}
            if c in owed:
                owed.discard(c)
                ch["prompt_token_ids"], ch["token_ids"] = req.prompt_token_ids(), []
            await w.data(head + f'"choices":[{dumps(ch)}]}}')
    # vLLM puts `system_fingerprint` on the stream's last chunk: the usage chunk, else the last choice chunk.
    final_k = max(len(p) for p in g.pieces)
    final = (final_k, max(c for c, p in enumerate(g.pieces) if len(p) == final_k))
    hold, held = sim.faults.held_text_token, [""] * len(g.pieces)
    for k in range(1, seq.max_len + 1):
        await seq.wait_emitted(k)
        for c, pieces in enumerate(g.pieces):
            if len(pieces) < k:
                continue
            piece = pieces[k - 1]
            done_tokens[c] = k
            last = k == len(pieces)
            if held[c]:  # the text a held token's chunk went without comes with the next one
                piece, held[c] = held[c] + piece, ""
            if k == hold and not last:  # (vLLM's detokenizer waiting for the rest of a UTF-8 character)
                piece, held[c] = "", piece
            if not piece and not last and not req.return_token_ids:  # (vLLM sends it when ids are asked for)
                continue
            lp = None
            if req.logprobs:
                lp = chat_logprobs(req, c, [piece]) if chat else completion_logprobs(req, c, [piece])
            finish = g.finish[c] if last else None
            if chat:
                ch = {"index": c, "delta": {"content": piece}, "logprobs": lp, "finish_reason": finish}
            else:
                ch = {"index": c, "text": piece, "logprobs": lp, "finish_reason": finish}
            if last:
                ch["stop_reason"] = g.stop_reason[c]
            elif not chat:
                ch["stop_reason"] = None
            if not chat:
                ch["prompt_token_ids"] = None
                if c in owed:
                    owed.discard(c)
                    ch["prompt_token_ids"] = req.prompt_token_ids()
            ch["token_ids"] = [g.ids[c][k - 1]] if req.return_token_ids else None
            await w.before_token(k)
            extra = usage_so_far()
            if (k, c) == final and not req.include_usage:
                extra += f',"system_fingerprint":{dumps(sim.fingerprint)}'
            await w.data(head + f'"choices":[{dumps(ch)}]{extra}}}')
    if req.include_usage:
        await w.data(
            head + f'"choices":[],"usage":{dumps(usage(req, g.completion_tokens, stream=True))},'
            f'"system_fingerprint":{dumps(sim.fingerprint)}}}'
        )
    prefill_leg_ticket(sim, req, g)
    await w.done()
