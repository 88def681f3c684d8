"""One inference request as the simulator serves it: its validated fields, its prompt and its token limits.

`parse_request` validates a body with its route's protocol model, then applies what vLLM checks after the
schema: the served model's name, one prompt per request, the prompt and `max_tokens` against the context.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from . import tokens as T
from .config import SimConfig
from .errors import ApiError, from_validation_error
from .protocol import REQUEST_MODELS, AnthropicMessagesRequest, ChatCompletionRequest, CompletionRequest


@dataclass(slots=True)
class SimRequest:
    kind: str  # chat | completions | messages | responses
    body: dict
    stream: bool
    prompt_text: str
    prompt_tokens: int
    max_tokens: int
    n: int
    stop: tuple[str, ...]
    seed: int | None
    temperature: float | None
    ignore_eos: bool
    min_tokens: int
    kv_transfer_params: dict | None
    include_usage: bool = True
    continuous_usage: bool = False
    echo: bool = False
    echo_only: bool = False  # completions' echo with max_tokens 0: prompt scoring, the prompt alone answered
    logprobs: bool = False
    top_logprobs: int = 0
    tools: list[dict] = field(default_factory=list)
    tool_choice: dict | None = None
    thinking: bool = False
    return_token_ids: bool = False  # prompt_token_ids and each chunk's token_ids in the answer
    prompt_ids: list[int] | None = None  # a completions prompt given as token ids
    bytes_per_token: int = T.BYTES_PER_TOKEN  # the server's tokenizer (SimConfig.bytes_per_token)
    answered: int = 0  # how many words of an answer the prompt already ends with (tokens.split_answer)
    prompt_key: int = 0
    # set when it is served
    id: str = ""
    log_id: str = ""  # the X-Request-Id, else the response id
    cached_tokens: int = 0
    priority: int = 0  # vLLM's `priority` (the Anthropic route has none)
    cache_salt: str | None = None  # vLLM's: in the prompt's first block hash, and in its KV event's extra keys
    responses: Any = None  # /v1/responses: what its answer echoes and stores (responses_serving)

    def prompt_token_ids(self) -> list[int]:
        return (
            self.prompt_ids if self.prompt_ids is not None else T.text_token_ids(self.prompt_text, self.bytes_per_token)
        )


def validated(kind: str, body: dict) -> BaseModel:
    try:
        return REQUEST_MODELS[kind].model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e) from None


def check_served_model(name: str | None, cfg: SimConfig) -> None:
    if name and name != cfg.model:
        raise ApiError(404, f"The model `{name}` does not exist. Valid aliases: {cfg.model}.", "NotFoundError", "model")


def anthropic_prompt_text(messages: list, tools: Any, system: Any) -> str:
    """The rendered prompt of an Anthropic body: its tools as OpenAI functions, its system prompt first."""
    functions = None
    if tools:
        functions = [
            {
                "type": "function",
                "function": {
                    "name": t.get("name"),
                    "description": t.get("description"),
                    "parameters": t.get("input_schema"),
                },
            }
            for t in tools
            if isinstance(t, dict)
        ]
    return T.render_chat_prompt([m for m in messages if isinstance(m, dict)], tools=functions, system=system)


def parse_request(kind: str, body: dict, cfg: SimConfig) -> SimRequest:
    r = validated(kind, body)
    check_served_model(r.model, cfg)
    bpt = cfg.bytes_per_token
    if kind == "chat":
        req = _chat_request(r, body, bpt)
    elif kind == "completions":
        req = _completion_request(r, body, bpt)
    else:
        req = _messages_request(r, body, bpt)
        req.return_token_ids = cfg.messages_token_ids and bool(body.get("return_token_ids"))
    _apply_limits(req, r, cfg)
    if req.prompt_ids is not None:
        context, req.answered = T.split_answer(req.prompt_ids)
        req.prompt_key = T.prompt_key(T.decode_token_ids(context))
    else:
        req.prompt_key = T.prompt_key(req.prompt_text)
    return req


def _new_request(
    r, body: dict, kind: str, prompt_text: str, prompt_tokens: int | None = None, bpt: int = T.BYTES_PER_TOKEN
) -> SimRequest:
    """The request with the fields every generating route reads; prompt_tokens defaults to the text's count at
    `bpt` bytes per token (SimConfig.bytes_per_token)."""
    kvp = r.kv_transfer_params
    return SimRequest(
        kind=kind,
        body=body,
        stream=bool(r.stream),
        prompt_text=prompt_text,
        prompt_tokens=T.count_text_tokens(prompt_text, bpt) if prompt_tokens is None else prompt_tokens,
        max_tokens=0,
        n=1,
        stop=(),
        seed=r.seed,
        temperature=r.temperature,
        ignore_eos=bool(r.ignore_eos),
        min_tokens=r.min_tokens,
        kv_transfer_params=kvp if isinstance(kvp, dict) else None,
        bytes_per_token=bpt,
        priority=getattr(r, "priority", 0),
        cache_salt=r.cache_salt,
    )


def _openai_fields(req: SimRequest, r) -> None:
    options = r.stream_options or {}
    req.include_usage = bool(options.get("include_usage"))
    req.continuous_usage = bool(options.get("continuous_usage_stats"))
    req.stop = r.stop
    req.return_token_ids = bool(r.return_token_ids)


def _chat_request(r: ChatCompletionRequest, body: dict, bpt: int) -> SimRequest:
    req = _new_request(r, body, "chat", T.render_chat_prompt(r.messages, tools=r.tools), bpt=bpt)
    _openai_fields(req, r)
    req.logprobs = bool(r.logprobs)
    top = r.top_logprobs or 0
    req.top_logprobs = int(top) if isinstance(top, int) else 0
    return req


def _completion_request(r: CompletionRequest, body: dict, bpt: int) -> SimRequest:
    prompt = r.prompt
    if isinstance(prompt, list) and len(prompt) > 1 and not all(isinstance(x, int) for x in prompt):
        raise ApiError(
            400, "Sim serves one prompt per request; batched prompts are not supported", "BadRequestError", "prompt"
        )
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        prompt = prompt[0]
    text, tokens = T.completion_prompt_text(prompt), T.completion_prompt_tokens(prompt, bpt)
    req = _new_request(r, body, "completions", text, tokens, bpt)
    if isinstance(prompt, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
        req.prompt_ids = prompt
    _openai_fields(req, r)
    lp = r.logprobs
    req.logprobs = lp is not None and lp is not False
    req.top_logprobs = int(lp) if isinstance(lp, int) and not isinstance(lp, bool) else 0
    return req


def _messages_request(r: AnthropicMessagesRequest, body: dict, bpt: int) -> SimRequest:
    req = _new_request(r, body, "messages", anthropic_prompt_text(r.messages, r.tools, r.system), bpt=bpt)
    req.stop = r.stop_sequences
    req.tool_choice = r.tool_choice
    req.tools = [t for t in (r.tools or []) if isinstance(t, dict)]
    req.thinking = r.thinking is not None and r.thinking.type in ("enabled", "adaptive")
    tc = r.tool_choice
    if tc and tc.get("type") == "tool" and req.tools and not any(t.get("name") == tc["name"] for t in req.tools):
        # the tool parser's adjust_request (get_json_schema_from_tools): a ValueError, 400
        raise ApiError(400, f"Tool '{tc['name']}' has not been passed in `tools`.", "BadRequestError")
    return req


def _requested_max_tokens(r) -> int | None:
    if isinstance(r, ChatCompletionRequest) and r.max_completion_tokens is not None:
        return r.max_completion_tokens
    return r.max_tokens


def _apply_limits(req: SimRequest, r, cfg: SimConfig) -> None:
    """max_tokens, n and the context length, checked as vLLM's sampling parameters and its renderer do."""
    mt = _requested_max_tokens(r)
    if req.kind != "messages":
        req.echo = req.kind == "completions" and r.echo
        req.echo_only = req.echo and mt == 0
        if req.echo_only:  # vLLM runs prompt scoring with max_tokens 1
            mt = 1
        if mt is not None and mt < 1:
            raise ApiError(400, f"max_tokens must be at least 1, got {mt}.", "BadRequestError", "max_tokens")
        req.n = 1 if r.n is None else r.n
        if req.n < 1:
            raise ApiError(400, f"n must be at least 1, got {req.n}.", "BadRequestError", "n")
    P, L = req.prompt_tokens, cfg.max_model_len
    if P > L or (P == L and mt is None):
        raise ApiError(
            400,
            f"This model's maximum context length is {L} tokens. However, "
            f"your request has {P} input tokens. Please reduce the length of the "
            f"input messages.",
            "BadRequestError",
            "input_tokens",
        )
    if mt is not None and mt > L - P:
        raise ApiError(
            400,
            f"'max_tokens' or 'max_completion_tokens' is too large: {mt}. "
            f"This model's maximum context length is {L} tokens and your request "
            f"has {P} input tokens ({mt} > {L} - {P}).",
            "BadRequestError",
            "max_tokens",
        )
    req.max_tokens = mt if mt is not None else L - P
