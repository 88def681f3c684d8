"""One inference request as the Coordinator sees it: the parsed body, its route and what routing needs.

The body is checked against its route's model (serving/protocol/): what routing and the prefill-leg
rewrite need, and what the spec marks required; everything else is the engine's to judge (unknown fields
pass through untouched).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import orjson
import ujson

from errors import InvalidRequest, json_bytes, unreadable_json
from serving.protocol import (
    Request,
    validate,
)
from serving.protocol.anthropic import CountTokensRequest, MessagesRequest
from serving.protocol.metaserver import MetaserverCall
from serving.protocol.openai import (
    ChatCompletionBody,
    ChatCompletionRequest,
    CompletionBody,
    CompletionRequest,
    PlainChat,
    read_plain_chat,
)
from serving.protocol.responses import ResponsesRequest
from serving.protocol.tokenize import DetokenizeRequest, TokenizeRequest

CHAT, COMPLETIONS, MESSAGES, COUNT_TOKENS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
)
RESPONSES = "/v1/responses"
METASERVER = "/v1/metaserver"
TOKENIZE, DETOKENIZE = "/tokenize", "/detokenize"  # vLLM's, at the root as vLLM serves them
# Routes one engine of the model answers at once, generating nothing (no P/D split, nothing leased).
ONE_ENGINE = frozenset({COUNT_TOKENS, TOKENIZE, DETOKENIZE})


@dataclass
class Job:
    route: str  # one of the paths above
    api: str  # errors.OPENAI or errors.ANTHROPIC
    raw: bytes  # the client's body, forwarded as is when nothing changes
    body: dict
    model: str
    stream: bool
    request_id: str
    max_tokens: int
    slo_ttft_ms: float = 0.0
    slo_tpot_ms: float = 0.0
    metaserver: dict | None = None  # the PD control object of a /v1/metaserver call
    request: Request | PlainChat | None = None  # the body as its route's model (or the plain chat reader) read it

    @property
    def prompt_body(self) -> dict:
        """The body whose prompt the scheduler counts: a Responses body's as a chat body."""
        return self.request.conversation() if self.route == RESPONSES else self.body

    @property
    def response_id(self) -> str:
        """A Responses request's id: the client's `request_id`, else the one `job_from_body` gave it."""
        return self.body["request_id"]

    @property
    def include_usage(self) -> bool:
        opts = self.body.get("stream_options")
        return isinstance(opts, dict) and bool(opts.get("include_usage"))

    @property
    def decode_computes_prompt(self) -> bool:
        """A request that vLLM's KV handoff cannot serve: one ticket carries one prompt's KV to one sequence.

        Several prompts in one completions request get the first prompt's ticket on every prompt (wrong
        text after the first); `n` or `best_of` above 1 makes every child sequence pull the same blocks, which
        P frees after the first; prompt logprobs (asked for directly, or by `echo` with `logprobs`) skip
        reading the transferred KV, so P's would stay pinned; `echo` with `max_tokens` 0 generates nothing to
        hand over to. D computes the prompt of these itself.
        """
        r = self.request
        if r.children > 1 or r.prompt_logprobs is not None:
            return True
        # Chat's `echo` asks for prompt logprobs too: vLLM takes `top_logprobs` (0 unless given as null) for them.
        if self.route == CHAT and r.echo is True and r.top_logprobs is not None:
            return True
        if self.route == COMPLETIONS:
            if r.echo is True and r.logprobs is not None:
                return True
            if r.echo_only:  # a prompt alone: nothing to decode after it, no KV to move
                return True
            prompt, embeds = r.prompt, r.prompt_embeds
            if isinstance(prompt, list) and len(prompt) > 1 and not all(isinstance(x, int) for x in prompt):
                return True  # a list of strings or of token lists (one list of ints is one prompt)
            if isinstance(embeds, list) and len(embeds) > 1:
                return True
        return False


_INT64 = float(2**63)


def parse_body(raw: bytes) -> dict:
    if not raw:
        raise InvalidRequest("request body is empty: expected a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        body = _read_lax(raw)
    else:
        if isinstance(body, dict) and any(type(v) is float and not -_INT64 <= v < _INT64 for v in body.values()):
            body = _read_lax(raw)  # orjson reads an integer beyond 64 bits as a float: 10**30 is no 1e30
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    return body


def _read_lax(raw: bytes) -> object:
    """A body orjson refuses, read as Python's and vLLM's JSON readers read it: ujson takes a lone UTF-16
    surrogate (a client cut an emoji in two), NaN and Infinity, and refuses the rest, saying why.

    orjson reads a body at about twice ujson's speed (0.7 against 1.6 µs per KiB), which is most of what a long
    prompt costs the Coordinator. It reads an integer beyond 64 bits as a float: a body with such a number at
    its top level (a `max_tokens` of 10**30) is read again here, so that the field stays the integer it is."""
    try:
        return ujson.loads(raw)
    except (ValueError, TypeError) as e:
        raise InvalidRequest(f"request body is not valid JSON: {unreadable_json(e)}") from None


_REQUESTS: dict[str, type[Request]] = {
    CHAT: ChatCompletionRequest,
    COMPLETIONS: CompletionRequest,
    MESSAGES: MessagesRequest,
    COUNT_TOKENS: CountTokensRequest,
    RESPONSES: ResponsesRequest,
    TOKENIZE: TokenizeRequest,
    DETOKENIZE: DetokenizeRequest,
}
# A metaserver call's body is an engine's rewrite of a client body, checked already: what the prefill leg
# leaves out is not checked again.
_ENGINE_BODIES: dict[str, type[Request]] = {CHAT: ChatCompletionBody, COMPLETIONS: CompletionBody}


def job_from_body(route: str, api: str, raw: bytes, body: dict, request_id: str, from_engine: bool = False) -> Job:
    """`from_engine`: a metaserver call's body, the engine's rewrite of a client body (checked already)."""
    if route == METASERVER:
        return _metaserver_job(raw, body)
    request = read_plain_chat(body) if route == CHAT else None
    if request is None:
        request = validate((_ENGINE_BODIES if from_engine else _REQUESTS)[route], body)
    stream = route not in ONE_ENGINE and bool(request.stream)
    if route == RESPONSES and request.request_id is None:
        raw, body = _with_response_id(raw, body)
    model = request.model or ""  # (only /tokenize and /detokenize may leave it out: serving/dispatch.py)
    return Job(route, api, raw, body, model, stream, request_id, request.max_output, request=request)


def _with_response_id(raw: bytes, body: dict) -> tuple[bytes, dict]:
    """The body with a response id of the Coordinator's (vLLM's own shape, `resp_<hex>`), so that it knows the
    response's id before any engine answers, and every leg and retry gives the response that one id."""
    response_id = "resp_" + uuid.uuid4().hex
    new = {**body, "request_id": response_id}
    if "request_id" in body:  # a null one: written anew
        return json_bytes(new), new
    # Put in front of the client's own bytes (no re-serialisation); the key is absent, so this is its one value.
    return b'{"request_id":' + json_bytes(response_id) + b"," + raw[raw.index(b"{") + 1 :], new


def _metaserver_job(raw: bytes, body: dict) -> Job:
    """A metaserver call is a chat or completions request plus the PD control object."""
    call = validate(MetaserverCall, body)
    route = CHAT if "messages" in body else COMPLETIONS if "prompt" in body or "prompt_embeds" in body else None
    if route is None:
        raise InvalidRequest("one of 'messages' or 'prompt' is required", param="messages")
    job = job_from_body(route, "openai", raw, body, call.kv_transfer_params.request_id, from_engine=True)
    job.metaserver = body["kv_transfer_params"]
    return job
