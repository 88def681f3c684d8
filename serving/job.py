"""One inference request as the Coordinator sees it: the parsed body, its route and what routing needs.

Validation here is what routing and the prefill-leg rewrite need, and what the spec marks required;
everything else is the engine's to judge (unknown fields pass through untouched).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import ujson

from errors import InvalidRequest

CHAT, COMPLETIONS, MESSAGES, COUNT_TOKENS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
)
METASERVER = "/v1/metaserver"


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
        body = self.body
        for key in ("n", "best_of"):
            value = lax_int(body.get(key))
            if value is not None and value > 1:
                return True
        if body.get("prompt_logprobs") is not None:
            return True
        # Chat's `echo` asks for prompt logprobs too: vLLM takes `top_logprobs` (0 unless given as null) for them.
        if self.route == CHAT and lax_true(body.get("echo")) and body.get("top_logprobs", 0) is not None:
            return True
        if self.route == COMPLETIONS:
            if lax_true(body.get("echo")) and body.get("logprobs") is not None:
                return True
            if echo_without_generation(body):  # a prompt alone: nothing to decode after it, no KV to move
                return True
            prompt, embeds = body.get("prompt"), body.get("prompt_embeds")
            if isinstance(prompt, list) and len(prompt) > 1 and not all(isinstance(x, int) for x in prompt):
                return True  # a list of strings or of token lists (one list of ints is one prompt)
            if isinstance(embeds, list) and len(embeds) > 1:
                return True
        return False


def echo_without_generation(body: dict) -> bool:
    """A completions body that scores its prompt (lm-eval, HELM): `echo` with `max_tokens` 0, which vLLM
    accepts and answers with the prompt alone."""
    return lax_true(body.get("echo")) and lax_int(body.get("max_tokens")) == 0


def parse_body(raw: bytes) -> dict:
    if not raw:
        raise InvalidRequest("request body is empty: expected a JSON object")
    try:
        body = ujson.loads(raw)
    except (ValueError, TypeError) as e:
        raise InvalidRequest(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    return body


def _model(body: dict) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required and must be a non-empty string", param="model")
    return model


def _stream(body: dict) -> bool:
    stream = body.get("stream", False)
    if stream is None:
        return False
    if not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be a boolean", param="stream")
    return stream


# Printable ASCII without spaces: a request id (an X-Request-Id header, and a `key=value` field of log lines,
# which spaces or line breaks would forge), or a logged value shown as it is.
VISIBLE = re.compile(r"[!-~]+")


def lax_int(v: object) -> int | None:
    """An integer field's value read the way vLLM's request models read it (pydantic's lax mode): an int (a
    bool is 0 or 1), an integral float (2048.0) or a string of one ("2048", "2048.0"); None for anything else."""
    if isinstance(v, int):
        return int(v)
    if isinstance(v, str):
        try:
            return int(v)
        except ValueError:
            try:
                v = float(v)
            except ValueError:
                return None
    if isinstance(v, float):
        return int(v) if v.is_integer() else None
    return None


_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})


def lax_true(v: object) -> bool:
    """Does vLLM read this boolean field as true (pydantic's lax mode: True, 1, "true", "yes", "on", ...)?"""
    if isinstance(v, str):
        return v.strip().lower() in _TRUE
    return v is True or (type(v) in (int, float) and v == 1)


def _max_tokens(body: dict, *keys: str, required: bool = False) -> int:
    for key in keys:
        v = body.get(key)
        if v is None:
            continue
        n = lax_int(v)
        if n is None or n < 1:
            raise InvalidRequest(f"'{key}' must be a positive integer", param=key)
        return n
    if required:
        raise InvalidRequest(f"'{keys[0]}' is required and must be a positive integer", param=keys[0])
    return 256


def _checked_messages(body: dict, content_required: bool) -> list:
    """Messages as routing and prompt counting read them: objects with a role and a string or list content.

    Which roles exist is the engine's to judge: vLLM takes any role string on chat (custom roles such as
    Llama's `ipython`), and on /v1/messages `system` (which Claude Code sends inside `messages`) as well
    as `user` and `assistant`. An assistant turn may omit its content (tool or function calls only).
    """
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' is required and must be a non-empty list", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequest(f"messages[{i}] must be an object with 'role' and 'content'", param=f"messages[{i}]")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequest(
                f"messages[{i}].role is required and must be a non-empty string", param=f"messages[{i}].role"
            )
        content = m.get("content")
        if content is None and (content_required or (role != "assistant" and "content" not in m)):
            raise InvalidRequest(f"messages[{i}].content is required", param=f"messages[{i}].content")
        if content is not None and not isinstance(content, (str, list)):
            raise InvalidRequest(
                f"messages[{i}].content must be a string or a list of parts", param=f"messages[{i}].content"
            )
    return messages


def _check_leg_dropped_fields(body: dict, route: str, stream: bool, max_tokens: int | None) -> None:
    """What a PD request's prefill leg leaves out, changes or is exempt from, checked as vLLM checks it:
    otherwise only the decode engine would refuse it, after P computed the prompt and while it holds the KV.

    On /v1/messages: `stop_sequences` (dropped); a named tool choice (P gets "any") must name one of the
    tools; an enabled thinking budget must be an integer of at least 1024 and below max_tokens (vLLM
    exempts prefill legs from the second rule)."""
    if route == MESSAGES:
        stops = body.get("stop_sequences")
        if stops is not None and not (isinstance(stops, list) and all(isinstance(x, str) for x in stops)):
            raise InvalidRequest("'stop_sequences' must be a list of strings", param="stop_sequences")
        choice = body.get("tool_choice")
        if isinstance(choice, dict) and choice.get("type") == "tool":
            name, tools = choice.get("name"), body.get("tools") or ()
            if not isinstance(name, str) or not name:
                raise InvalidRequest("tool_choice.name is required when type is 'tool'", param="tool_choice.name")
            if not any(isinstance(t, dict) and t.get("name") == name for t in tools):
                raise InvalidRequest(f"Tool '{name}' has not been passed in `tools`.", param="tool_choice")
        thinking = body.get("thinking")
        if isinstance(thinking, dict) and thinking.get("type") == "enabled":
            budget = lax_int(thinking.get("budget_tokens"))
            if budget is None or budget < 1024:
                raise InvalidRequest(
                    "'thinking.budget_tokens' must be an integer >= 1024", param="thinking.budget_tokens"
                )
            if budget >= max_tokens:
                raise InvalidRequest(
                    "thinking.budget_tokens must be less than max_tokens", param="thinking.budget_tokens"
                )
        return
    if body.get("stream_options") is not None:
        if not isinstance(body["stream_options"], dict):
            raise InvalidRequest("'stream_options' must be an object", param="stream_options")
        if not stream and body["stream_options"]:  # vLLM refuses only non-empty ones
            raise InvalidRequest("Stream options can only be defined when `stream=True`.", param="stream_options")
    stop = body.get("stop")
    if (
        stop is not None
        and not isinstance(stop, str)
        and not (isinstance(stop, list) and all(isinstance(x, str) for x in stop))
    ):
        raise InvalidRequest("'stop' must be a string or a list of strings", param="stop")
    ids = body.get("stop_token_ids")
    if ids is not None and not (
        isinstance(ids, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in ids)
    ):
        raise InvalidRequest("'stop_token_ids' must be a list of integers", param="stop_token_ids")
    if "min_tokens" in body:  # (null too: vLLM's field is an int, 0 unless given)
        low = lax_int(body["min_tokens"])
        if low is None or low < 0:
            raise InvalidRequest("'min_tokens' must be an integer >= 0", param="min_tokens")
        if max_tokens is not None and low > max_tokens:
            raise InvalidRequest(
                f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {low}.", param="min_tokens"
            )


def _check_tools(body: dict) -> None:
    """Both APIs take `tools` as a list (the scheduler renders it into the prompt it counts)."""
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise InvalidRequest("'tools' must be a list", param="tools")


def job_from_body(route: str, api: str, raw: bytes, body: dict, request_id: str, from_engine: bool = False) -> Job:
    """`from_engine`: a metaserver call's body, the engine's rewrite of a client body (checked already)."""
    model = _model(body)
    if route == METASERVER:
        return _metaserver_job(raw, body)
    if route == CHAT:
        stream = _stream(body)
        _checked_messages(body, content_required=False)
        _check_tools(body)
        max_tokens = _max_tokens(body, "max_completion_tokens", "max_tokens")
        if not from_engine:
            _check_leg_dropped_fields(
                body, route, stream, lax_int(body.get("max_completion_tokens") or body.get("max_tokens"))
            )
    elif route == COMPLETIONS:
        stream = _stream(body)
        prompt = body.get("prompt")
        if prompt is None and body.get("prompt_embeds") is None:  # vLLM takes either (embeds when it enables them)
            raise InvalidRequest("'prompt' is required", param="prompt")
        if prompt is not None and (not isinstance(prompt, (str, list)) or (isinstance(prompt, list) and not prompt)):
            raise InvalidRequest("'prompt' must be a string, a list of strings or a list of token ids", param="prompt")
        echo_only = echo_without_generation(body)  # vLLM runs it with max_tokens 1 and answers the prompt alone
        max_tokens = 1 if echo_only else _max_tokens(body, "max_tokens")
        if not from_engine:
            _check_leg_dropped_fields(body, route, stream, 1 if echo_only else lax_int(body.get("max_tokens")))
    elif route == MESSAGES:
        stream = _stream(body)
        max_tokens = _max_tokens(body, "max_tokens", required=True)
        _checked_messages(body, content_required=True)
        _check_tools(body)
        _check_leg_dropped_fields(body, route, stream, max_tokens)
    else:  # count_tokens
        stream = False
        max_tokens = 0
        _checked_messages(body, content_required=True)
        _check_tools(body)
    return Job(route, api, raw, body, model, stream, request_id, max_tokens)


def _metaserver_job(raw: bytes, body: dict) -> Job:
    """A metaserver call is a chat or completions request plus the PD control object."""
    ktp = body.get("kv_transfer_params")
    if not isinstance(ktp, dict):
        raise InvalidRequest("'kv_transfer_params' is required and must be an object", param="kv_transfer_params")
    rid = ktp.get("request_id")
    if not isinstance(rid, str) or not rid:
        raise InvalidRequest("'kv_transfer_params.request_id' is required", param="kv_transfer_params.request_id")
    if len(rid) > 128 or not VISIBLE.fullmatch(rid):
        raise InvalidRequest(
            "'kv_transfer_params.request_id' must be at most 128 characters of printable ASCII without spaces",
            param="kv_transfer_params.request_id",
        )
    if bool(ktp.get("do_remote_prefill")) == bool(ktp.get("do_remote_decode")):
        raise InvalidRequest(
            "exactly one of kv_transfer_params.do_remote_prefill and do_remote_decode must be true",
            param="kv_transfer_params",
        )
    route = CHAT if "messages" in body else COMPLETIONS if "prompt" in body or "prompt_embeds" in body else None
    if route is None:
        raise InvalidRequest("one of 'messages' or 'prompt' is required", param="messages")
    job = job_from_body(route, "openai", raw, body, rid, from_engine=True)
    job.metaserver = ktp
    return job
