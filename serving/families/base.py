"""What every endpoint family declares: the `Family` class, whose attributes and methods its module overrides.

A request carries its family (`Job.family`); the flows, the relay, the usage fix-up, the continuation and the
log line read its attributes instead of testing the route. The defaults are OpenAI's (chat and completions
share most of them): a family states only where it differs. Nothing here imports serving/job.py, so that a
Job can name its family's type.
"""

from __future__ import annotations

from errors import OPENAI, Api, json_bytes
from serving.protocol import Request, validate

# The client's fields a prefill leg must not carry, as what the engine reads when they are absent: the leg's
# body is the client's bytes with its changes appended (JSON readers keep a key's last value, Python's and so
# vLLM's among them), so a dropped field is overridden rather than cut out of a prompt of megabytes.
_OPENAI_DROPPED = {"stream_options": None, "min_tokens": 0, "stop": None, "stop_token_ids": None}

# The client's sampling fields a continuation's structured-output refusal looks at.
_STRUCTURED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")


def fix_openai_usage(usage: dict, p_usage: dict | None) -> None:
    """An OpenAI usage: the prompt count and its cached tokens are P's, the total recomputed."""
    if not p_usage:
        return
    prompt = p_usage.get("prompt_tokens")
    if isinstance(prompt, int):
        usage["prompt_tokens"] = prompt
    p_details = p_usage.get("prompt_tokens_details") or {}
    cached = p_details.get("cached_tokens") if isinstance(p_details, dict) else None
    if isinstance(usage.get("prompt_tokens_details"), dict) or cached is not None:
        usage["prompt_tokens_details"] = {**(usage.get("prompt_tokens_details") or {}), "cached_tokens": cached or 0}
    completion = usage.get("completion_tokens") or 0
    usage["total_tokens"] = usage.get("prompt_tokens", 0) + completion


class Family:
    """One endpoint family: its route, its API's envelope, and every rule that differs between families."""

    route: str = ""
    api: Api = OPENAI  # its error envelope and headers (errors/)
    request_model: type[Request] | None = None  # its body's model (serving/protocol/)
    engine_model: type[Request] | None = None  # an engine's rewrite of its body (a metaserver call's), if any
    prompt_kind: str | None = None  # how the scheduler reads its prompt (scheduling.tokens), None: not counted
    streams = True  # `stream: true` makes it a stream
    vllm_only = False  # only vLLM engines serve it
    trigger = False  # MindIE's metaserver protocol (pd_dispatch: trigger) serves it; the others use the handoff
    stored = False  # its responses are remembered where they are served (serving/responses.py)
    counts_only = False  # the engine counts its prompt: one engine, nothing generated, no tokens served
    priority_field = True  # vLLM's route reads `priority` (the x-priority class, to priority-scheduling engines)
    # Its stream: the SSE events that carry no token, the event whose usage is its output count (None: its
    # events are counted), and the first line of its last event (the client's stream ends there).
    stream_framing = 0
    final_usage_event: bytes | None = None
    last_event = b"\n"  # (no event starts with a blank line)
    usage_in_stream = False  # its stream reports the prompt count unasked
    usage_chunk_option = True  # the client may ask for a usage chunk (`stream_options.include_usage`)
    # Where its answer reports the prompt count: the keys searched from the end, and cache counts it leaves out.
    prompt_keys: tuple[bytes, ...] = (b'"prompt_tokens":', b'"input_tokens":')
    cache_keys: tuple[bytes, ...] = ()
    nests: str | None = None  # the key of an event's object that holds its usage (a Responses event's response)
    continuable = False  # a broken stream of it may go on on another engine (serving/continuation.py)
    dropped: dict = _OPENAI_DROPPED  # what its prefill leg must not carry (at the engine's default)

    def __repr__(self) -> str:
        return f"<family {self.route}>"

    # -- the request ---------------------------------------------------------------------------------

    def call(self, body: dict) -> tuple[Family, dict, str] | None:
        """A call that is another family's body with a control object: (that family, the object, the request
        id it names); None for a client's body."""
        return None

    def read(self, body: dict, from_engine: bool) -> Request:
        """The body read by its model (`from_engine`: an engine's rewrite of a checked body)."""
        return validate(self.engine_model if from_engine else self.request_model, body)

    def identified(self, raw: bytes, body: dict, request: Request) -> tuple[bytes, dict]:
        """The body as it is served (a family that names its response before any engine answers changes it)."""
        return raw, body

    def prompt_body(self, body: dict, request: Request) -> dict:
        """The body whose prompt the scheduler counts."""
        return body

    def decode_computes_prompt(self, request: Request) -> bool:
        """A request vLLM's KV handoff cannot serve (see Job.decode_computes_prompt): more than one sequence,
        or prompt logprobs."""
        return request.children > 1 or request.prompt_logprobs is not None

    # -- the prefill leg -----------------------------------------------------------------------------

    def prefill_changes(self, body: dict) -> dict:
        """The fields the prefill leg sets in the client's body (a dropped one at its engine default), but the
        ticket (serving/legs.py)."""
        changes = {key: value for key, value in self.dropped.items() if key in body}
        self.cap_prefill(body, changes)
        changes["stream"] = False
        self.cap_tokens(changes)
        return changes

    def cap_prefill(self, body: dict, changes: dict) -> None:
        """The leg's own changes: one token, no end of sequence, one sequence."""
        changes["ignore_eos"] = True
        if "max_completion_tokens" in body:
            changes["max_completion_tokens"] = 1
        if "n" in body:
            changes["n"] = 1

    def cap_tokens(self, changes: dict) -> None:
        changes["max_tokens"] = 1

    # -- usage ---------------------------------------------------------------------------------------

    def fix_response(self, obj: dict, p_usage: dict | None) -> dict:
        """A decode response (JSON body or one SSE event's data) made fit for the client: P's ticket out, P's
        prompt counts in its usage."""
        obj.pop("kv_transfer_params", None)
        usage = obj.get("usage")
        if self.nests is not None and isinstance(obj.get(self.nests), dict):
            obj[self.nests].pop("kv_transfer_params", None)
            usage = obj[self.nests].get("usage")
        if isinstance(usage, dict):
            self.fix_usage(usage, p_usage)
        return obj

    def fix_usage(self, usage: dict, p_usage: dict | None) -> None:
        fix_openai_usage(usage, p_usage)

    # -- a continuation (serving/continuation.py) ----------------------------------------------------

    def continuation_refusal(self, b: dict, engine_type: str) -> str | None:
        """Why a stream of this body cannot be continued exactly (the reason it is counted under), or None."""
        if not self.continuable:
            return "route"
        if engine_type != "vllm":
            return "engine_type"  # only vLLM's routes are known to take token-id prompts and return ids
        if (b.get("n") or 1) > 1 or (b.get("best_of") or 1) > 1:
            return "n"
        fmt = b.get("response_format")
        if any(b.get(k) is not None for k in _STRUCTURED) or (isinstance(fmt, dict) and fmt.get("type") != "text"):
            return "structured_output"  # a grammar's state is not carried over
        if self.structured(b):
            return "structured_output"
        choice = b.get("tool_choice")
        if b.get("tools") and choice not in ("none", {"type": "none"}):
            return "tools"  # a tool parser's state is not carried over, and completions has none
        if b.get("logprobs") not in (None, False) or b.get("prompt_logprobs") is not None:
            return "logprobs"  # a recomputed prompt's logprobs differ in the last bits, and top-k shapes differ
        if b.get("stop") or b.get("stop_sequences"):
            return "stop_strings"  # vLLM holds back text that may start one: that text would be lost
        if b.get("presence_penalty") or b.get("frequency_penalty"):
            return "penalties"
        if self.thinks(b):
            return "thinking"  # completions has no reasoning parser: thinking and text would not be told apart
        if b.get("echo"):
            return "echo"
        if not self.one_prompt(b) or b.get("truncate_prompt_tokens") is not None:
            return "prompt"  # several prompts, embeddings, or a prompt truncated by the engine
        return None

    def structured(self, b: dict) -> bool:
        """A structured output of the family's own fields."""
        return False

    def thinks(self, b: dict) -> bool:
        """Reasoning the family's body turns on."""
        return False

    def one_prompt(self, b: dict) -> bool:
        return True

    def output_limit(self, b: dict) -> int | None:
        """The client's output cap, which a continuation lessens by what was generated (None: the context's)."""
        return b.get("max_completion_tokens", b.get("max_tokens"))

    # The stream's events as the continuation reads and writes them (`cont`: the Continuation, whose state
    # they change). The defaults read and write OpenAI chunks.

    def observe(self, cont, obj: dict) -> bool:
        """One event's data from the first engine: its ids kept (and stripped where the client did not ask for
        them: then True), and what makes the stream not continuable noted."""
        first = cont.prompt_ids is None  # the prompt's ids come once, in the first chunk
        if first:
            cont.head = {k: obj.get(k) for k in ("id", "object", "created", "model")}
        changed = first and cont.take_prompt(obj)
        for choice in obj.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            changed = (first and cont.take_prompt(choice)) or changed
            changed = cont.take_ids(choice) or changed
            delta = choice.get("delta")
            if delta.get("content") if isinstance(delta, dict) else choice.get("text"):
                cont.shown = len(cont.out_ids)
            if isinstance(delta, dict) and (delta.get("reasoning") or delta.get("reasoning_content")):
                cont.reason = "reasoning"  # a reasoning parser's split: completions would not make it
            if isinstance(delta, dict) and delta.get("tool_calls"):
                cont.reason = "tools"
            if choice.get("finish_reason"):
                cont.finish, cont.done = choice["finish_reason"], True
        if first:
            cont.ids_or_not()
        return changed

    def strip(self, obj: dict, key: str) -> None:
        """Ids the client did not ask for: null, as vLLM writes them then."""
        obj[key] = None

    def in_band_failure(self, obj: dict) -> int | None:
        """The status of an error event that fails the stream (a 5xx), None for any other event (a 4xx is the
        request's own)."""
        err = obj.get("error")
        if not isinstance(err, dict):
            return None
        code = err.get("code")
        status = code if isinstance(code, int) else 500
        return status if status >= 500 else None

    def continued(self, cont, text: str, finish: str | None, choice: dict, ids: list, usage: object, tail: dict):
        """A continuation's completions choice (its text, finish reason and token ids) as the client's events."""
        raise NotImplementedError(self.route)

    def continued_done(self, cont) -> bytes:
        """The continuation's `[DONE]` as the client's (b"": nothing)."""
        return b"data: [DONE]"

    def continued_usage(self, cont, client: dict, tail: dict) -> list[bytes]:
        """The continuation's usage chunk (`client`: its usage as the client's), when the client asked for one."""
        if not cont.include_usage:
            return []
        return [b"data: " + json_bytes({**cont.head, "choices": [], "usage": client, **tail})]

    def client_usage(self, usage: dict, prompt: int, completion: int, p_usage: dict | None) -> dict:
        """A continuation's usage (the engine's, with the prompt and completion counts the client is billed)."""
        out = dict(usage)
        out.update(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):  # what the continuation found cached of the first prompt
            out["prompt_tokens_details"] = {**details, "cached_tokens": min(details.get("cached_tokens") or 0, prompt)}
        self.fix_usage(out, p_usage)
        return out
