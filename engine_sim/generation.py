"""What a request generates: each choice's token pieces, text and finish, a pure function of the request."""

from __future__ import annotations

from typing import Any

from . import tokens as T
from .json_text import dumps
from .request import SimRequest


class Generation:
    """What one request will produce: choices of pieces plus accounting."""

    __slots__ = ("finish", "ids", "kinds", "pieces", "stop_reason", "texts", "thinking_n", "tool")

    def __init__(self):
        self.pieces: list[tuple[str, ...]] = []
        self.ids: list[tuple[int, ...]] = []  # each piece's token id (return_token_ids)
        self.texts: list[str] = []
        self.finish: list[str] = []
        self.stop_reason: list[Any] = []
        self.kinds = None  # messages: per-piece block kind
        self.tool = None  # messages: (id, name, input)
        self.thinking_n = 0

    def add_choice(self, pieces: tuple[str, ...], text: str, finish: str, stop_reason: Any, ids: tuple) -> None:
        self.pieces.append(pieces)
        self.ids.append(ids)
        self.texts.append(text)
        self.finish.append(finish)
        self.stop_reason.append(stop_reason)

    @property
    def completion_tokens(self) -> int:
        return sum(len(p) for p in self.pieces)


def eos_at_once(req: SimRequest) -> Generation:
    """Every choice ends on EOS at its first token (the eos_on_prefill fault)."""
    g = Generation()
    for _ in range(req.n):
        g.add_choice(("",), "", "stop", None, (T.EOS_TOKEN_ID,))
    return g


def generate(req: SimRequest) -> Generation:
    if req.kind == "messages":
        return _generate_message(req)
    g = Generation()
    r = req.answered  # a prompt ending with an answer's first r words goes on from word r+1
    for c in range(req.n):
        pieces, text, fin, sr, ids = T.generate(
            req.prompt_key,
            req.seed,
            req.temperature,
            c,
            r + req.max_tokens,
            req.ignore_eos,
            r + req.min_tokens,
            req.stop,
        )
        if r:
            pieces, ids = pieces[r:], ids[r:]
            if not pieces:  # the prompt's answer had ended before it: EOS at once
                pieces, ids, fin, sr = ("",), (T.EOS_TOKEN_ID,), "stop", None
            text = "".join(pieces)
        if req.echo_only:  # vLLM generates one token and answers the prompt alone
            pieces, text = tuple("" for _ in pieces), ""
        g.add_choice(pieces, text, fin, sr, ids)
    return g


def _generate_message(req: SimRequest) -> Generation:
    g = Generation()
    mt = req.max_tokens
    kinds: list[str] = []
    pieces: list[str] = []
    ids: list[int] = []
    if req.thinking:
        th, _, _, _, th_ids = T.generate(req.prompt_key ^ 0x5A5A, req.seed, req.temperature, 0, min(8, mt), True, 0, ())
        g.thinking_n = len(th)
        pieces.extend(th)
        ids.extend(th_ids)
        kinds.extend(["thinking"] * len(th))
    tc = req.tool_choice or {}
    tools = req.tools
    use_tool = bool(tools) and tc.get("type") != "none"
    finish, stop_reason = "stop", None
    if use_tool and len(pieces) < mt:
        tool = tools[0]
        if tc.get("type") == "tool":  # parse_request made sure it is one of them
            tool = next(t for t in tools if t.get("name") == tc.get("name"))
        args = _sample_value(tool.get("input_schema") or {"type": "object"})
        if not isinstance(args, dict):
            args = {}
        g.tool = (T.tool_call_id(req.id), tool.get("name") or "", args)
        js = dumps(args)
        k = max(1, T.count_text_tokens(js))
        step = max(1, -(-len(js) // k)) if js else 1
        chunks = [js[i : i + step] for i in range(0, len(js), step)] or [""]
        while len(chunks) < k:
            chunks.append("")
        if len(pieces) + k > mt:  # cut by max_tokens: the call's first tokens only
            k = mt - len(pieces)
            finish = "length"
        pieces.extend(chunks[:k])
        ids.extend((T.text_token_ids(ch) or [T.EOS_TOKEN_ID])[0] for ch in chunks[:k])
        kinds.extend(["tool"] * k)
        if finish != "length":
            finish = "tool_calls"
    else:
        rest = mt - len(pieces)
        if rest > 0:
            p2, text, finish, stop_reason, ids2 = T.generate(
                req.prompt_key, req.seed, req.temperature, 0, rest, req.ignore_eos, req.min_tokens, req.stop
            )
            pieces.extend(p2)
            ids.extend(ids2)
            kinds.extend(["text"] * len(p2))
        else:
            finish = "length"
    g.kinds = kinds
    text = "".join(p for p, k in zip(pieces, kinds) if k == "text")
    g.add_choice(tuple(pieces), text, finish, stop_reason, tuple(ids))
    return g


def _sample_value(schema: Any, depth: int = 0) -> Any:
    """A value of a tool's JSON schema: the arguments of the simulated call."""
    if not isinstance(schema, dict) or depth > 3:
        return "sample"
    if schema.get("enum"):
        return schema["enum"][0]
    t = schema.get("type")
    if isinstance(t, list):
        t = next((x for x in t if x != "null"), "string")
    if t == "integer":
        return 1
    if t == "number":
        return 1.5
    if t == "boolean":
        return True
    if t == "array":
        return [_sample_value(schema.get("items"), depth + 1)] if schema.get("items") else []
    if t == "object" or "properties" in schema:
        return {k: _sample_value(v, depth + 1) for k, v in (schema.get("properties") or {}).items()}
    return "sample"
