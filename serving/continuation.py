"""Mid-stream continuation (`exception_config.reschedule_config`): a stream whose engine fails after the client
has seen output goes on on another instance, and the client sees one unbroken answer.

While the first engine streams, it is asked for token ids (vLLM's `return_token_ids`): its first chunk
names the prompt's ids, each later one its tokens' ids. They are kept here and taken out of what the client
gets unless it asked for them itself (set to null: what vLLM writes when they were not asked for). When
that engine dies, resets the connection, ends the stream with an in-band 5xx error event, or stalls past
`stream_idle_timeout`, `Retries.resume` (serving/retries.py) takes the request: another healthy instance
that can serve the model whole and has not failed the request (a second decode instance, a union one, or a
prefill one, in that order; it computes the prompt itself: see docs/reliability.md) gets a /v1/completions request
whose prompt is the prompt's ids followed by the generated ones, with the remaining `max_tokens`,
`min_tokens` less what was generated, and the client's sampling parameters and seed. Its chunks are
written in the client's family's shape (its family's `continued`: chat chunks, completions chunks or
Anthropic events in the open text block or the next one), with the first answer's id, created time and
model, and usage that counts the prompt once (P's counts in PD) and every completion token once.

What cannot be continued exactly is refused up front and fails as any broken stream does (one SSE error
event): see its family's `continuation_refusal`. Every continuation and every refusal is counted
(serving/observe.py).
"""

from __future__ import annotations

import ujson

from engines import Body, holds, joined, parts_of
from errors import EngineStatusError, UpstreamError, json_bytes
from serving.families.completions import COMPLETIONS
from serving.job import Job
from serving.usage import UsageFix

# The client's sampling fields a continuation keeps (vLLM reads them the same way on both routes). Presence
# and frequency penalties count only a request's own output tokens (the generated ones become the prompt):
# they are refused; repetition_penalty counts prompt and output alike and stays exact.
_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "repetition_penalty",
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "priority",
    "user",
    "cache_salt",
    "vllm_xargs",
)


def refusal(job: Job, engine_type: str) -> str | None:
    """Why this request's stream cannot be continued exactly (the reason it is counted under), or None: its
    family's judgement (serving/families/base.py `continuation_refusal`)."""
    return job.family.continuation_refusal(job.body, engine_type)


class Continuation:
    """One streamed request's token ids and stream shape, kept while its engine streams (`relay`), and the
    continuation of its answer on another engine when that one fails (`Retries.resume` drives its tries)."""

    __slots__ = (
        "before",
        "block",
        "broken",
        "client_ids",
        "complete",
        "count",
        "done",
        "finish",
        "fix",
        "head",
        "include_usage",
        "injected",
        "job",
        "out_ids",
        "prompt_ids",
        "reason",
        "resuming",
        "shown",
        "usage_sent",
    )

    def __init__(self, job: Job, engine_type: str):
        self.job = job
        self.reason = refusal(job, engine_type)  # why not (counted when a failure comes), None: it can be
        self.client_ids = bool(job.body.get("return_token_ids"))  # the client asked for the ids itself
        # The engine was asked for ids the client did not ask for: every event is read to strip them, even once
        # the stream turns out not to be continuable (a tool block, reasoning).
        self.injected = self.reason is None and not self.client_ids
        self.include_usage = job.include_usage
        self.prompt_ids: list[int] | None = None
        self.out_ids: list[int] = []
        self.before = 0  # generated ids when the running continuation began
        # The generated ids up to the last one whose chunk carried text. vLLM holds back the text of a token that
        # ends inside a UTF-8 character (its chunk has the id and no text) and of skipped special tokens; a
        # continuation goes on from the last shown one and generates the held ones again, so their text comes
        # out whole. (A prompt whose text ends inside a character also trips vLLM's detokenizer: its first chunk
        # would repeat the whole prompt's text, tokenizers' DecodeStream prefill.)
        self.shown = 0
        self.head: dict = {}  # the first answer's id, created time and model, written on every chunk after it
        self.block: int | None = None  # Anthropic: the open content block's index (None: none open)
        self.count = 0  # Anthropic: content blocks started so far
        self.finish: str | None = None  # the finish reason, once seen
        self.done = False  # the answer is whole (finished; what follows is framing)
        self.usage_sent = False
        self.complete = False  # the client's stream is whole (a continuation wrote its [DONE] or message_stop)
        self.broken: UpstreamError | None = None  # an in-band 5xx error event ended the stream
        self.resuming = False
        self.fix: UsageFix | None = None  # PD: P's counts for the continuation's usage

    # -- while the first engine streams ------------------------------------------------------------------

    def request(self, route: str, body: Body) -> tuple[str, Body]:
        """What a try sends: the first engine the client's body asking for ids, a continuation its own (a
        completions request)."""
        if self.resuming:
            return COMPLETIONS.route, self._continuation_body()
        if not self.injected:
            return route, body
        if holds(body, b'"return_token_ids"'):  # the client's own key (false or null): set in the parsed body
            return route, json_bytes({**ujson.loads(joined(body)), "return_token_ids": True})
        # A streamed body's first part is bytes: the client's body, or the decode leg's ticket.
        head, *rest = parts_of(body)
        return route, (b'{"return_token_ids":true,', memoryview(head)[head.index(b"{") + 1 :], *rest)

    def relay(self, block: bytes) -> bytes:
        """Whole SSE events from the engine, as the client gets them (ids kept, and stripped where not asked
        for; a continuation's chunks in the client's shape). An in-band 5xx ends them: `broken` is set and
        the events before it are returned."""
        if self.reason is not None and not self.injected and not self.resuming:
            return block
        out = []
        for event in block.split(b"\n\n"):
            if not event.strip():
                continue
            mapped = self._translate(event) if self.resuming else self._observe(event)
            if self.broken is not None:
                break
            if mapped:
                out.append(mapped)
        return b"".join(e + b"\n\n" for e in out)

    def _observe(self, event: bytes) -> bytes:
        obj = _data(event)
        if not isinstance(obj, dict):
            return event
        if self._failed_in_band(obj, event):
            return b""
        return _event_with(event, obj) if self.job.family.observe(self, obj) else event

    def ids_or_not(self) -> None:
        """After the first event: an engine that sent no prompt ids in it sends none (vLLM 0.32's Messages route
        ignores `return_token_ids`); its events then pass unread."""
        if self.prompt_ids is None:
            self.reason, self.injected = "no_token_ids", False

    def take_prompt(self, obj: dict) -> bool:
        """The prompt's ids, if `obj` holds them; True when they were stripped."""
        ids = obj.get("prompt_token_ids")
        if isinstance(ids, list) and self.prompt_ids is None:
            self.prompt_ids = ids
        if ids is not None and not self.client_ids:
            self.job.family.strip(obj, "prompt_token_ids")
            return True
        return False

    def take_ids(self, obj: dict) -> bool:
        """Generated ids, if `obj` holds them; True when they were stripped."""
        ids = obj.get("token_ids")
        if isinstance(ids, list):
            self.out_ids.extend(ids)
        if ids is not None and not self.client_ids:
            self.job.family.strip(obj, "token_ids")
            return True
        return False

    def _failed_in_band(self, obj: dict, event: bytes) -> bool:
        """An error event in the stream: a 5xx ends it (`broken`); a 4xx is the request's own and passes."""
        status = self.job.family.in_band_failure(obj)
        if status is not None:
            self.broken = EngineStatusError(status, _payload(event))
        return status is not None

    # -- on another engine ------------------------------------------------------------------------------

    def why_not(self, err: UpstreamError) -> str | None:
        """Why the stream broken by `err` is not continued, or None (it is)."""
        if isinstance(err, EngineStatusError) and err.relayed:
            return "client_error"  # a 4xx is the request's own answer: never hidden by a continuation
        if self.reason is not None:
            return self.reason
        if self.done:
            return "after_finish"  # the answer was whole: only its framing was lost
        if self.prompt_ids is None:
            return "no_token_ids"  # the engine returned none (vLLM's /v1/messages has no return_token_ids)
        return None

    def begin(self, fix: UsageFix | None) -> None:
        """The stream goes on on other engines from now on (`Retries.resume`); `fix`: P's counts, in PD."""
        self.resuming, self.fix = True, fix

    def next_try(self) -> None:
        """A continuation try starts: the ids whose text the client has not seen are generated again."""
        del self.out_ids[self.shown :]
        self.broken, self.before = None, len(self.out_ids)

    def _continuation_body(self) -> bytes:
        b, generated = self.job.body, len(self.out_ids)
        body: dict = {k: b[k] for k in _SAMPLING if k in b}
        body["model"] = self.job.model
        body["prompt"] = (self.prompt_ids or []) + self.out_ids
        limit = self.job.family.output_limit(b)
        body["max_tokens"] = None if limit is None else max(1, limit - generated)  # null: the rest of the context
        if b.get("min_tokens"):
            body["min_tokens"] = max(0, b["min_tokens"] - generated)
        body["stream"] = True
        body["stream_options"] = options = {"include_usage": True}
        asked = b.get("stream_options")
        if isinstance(asked, dict) and asked.get("continuous_usage_stats"):  # each chunk's running counts, as asked
            options["continuous_usage_stats"] = True
        body["return_token_ids"] = True
        return json_bytes(body)

    def _translate(self, event: bytes) -> bytes:
        """One event of the continuation's completions stream, in the client's family's shape (b"": nothing)."""
        payload = _payload(event)
        if payload == b"[DONE]":
            self.complete = True
            return self.job.family.continued_done(self)
        obj = _data(event)
        if not isinstance(obj, dict) or self._failed_in_band(obj, event):
            return b""
        if isinstance(obj.get("error"), dict):  # a 4xx in the stream: the request's own error
            raise EngineStatusError(obj["error"].get("code") or 400, payload)
        out: list[bytes] = []
        tail = {"system_fingerprint": obj["system_fingerprint"]} if "system_fingerprint" in obj else {}
        for choice in obj.get("choices") or ():
            if isinstance(choice, dict):
                out.extend(self._choice(choice, obj.get("usage"), tail))
        if not obj.get("choices") and isinstance(obj.get("usage"), dict):
            out.extend(self._usage_events(obj["usage"], tail))
        return b"\n\n".join(out)

    def _choice(self, choice: dict, usage: object, tail: dict) -> list[bytes]:
        ids = choice.get("token_ids") if isinstance(choice.get("token_ids"), list) else []
        self.out_ids.extend(ids)
        text, finish = choice.get("text") or "", choice.get("finish_reason")
        if text:
            self.shown = len(self.out_ids)
        if finish:
            self.finish, self.done = finish, True
        return self.job.family.continued(self, text, finish, choice, ids, usage, tail)

    def chunk(self, choice: dict, usage: object, tail: dict) -> bytes:
        """An OpenAI chunk of a continuation holding `choice`, with the first answer's head and the client's
        usage when the engine's chunk had one (continuous_usage_stats: each chunk's running counts)."""
        chunk = {**self.head, "choices": [choice]}
        if isinstance(usage, dict):
            chunk["usage"] = self._client_usage(usage)
        return b"data: " + json_bytes({**chunk, **tail})

    def _usage_events(self, usage: dict, tail: dict) -> list[bytes]:
        """The continuation's usage, once, in its family's events (the client's usage chunk when it asked for one,
        Anthropic's message_delta and message_stop)."""
        if self.usage_sent:
            return []
        self.usage_sent = True
        return self.job.family.continued_usage(self, self._client_usage(usage), tail)

    def _client_usage(self, usage: dict) -> dict:
        """The continuation's usage as the client's: the prompt once (the first engine's count, P's in PD), and
        every completion token once (those before the failure and the continuation's)."""
        prompt = len(self.prompt_ids or ())
        counted = usage.get("completion_tokens")
        completion = self.before + counted if isinstance(counted, int) else len(self.out_ids)
        p_usage = self.fix.counts() if self.fix is not None else None
        return self.job.family.client_usage(usage, prompt, completion, p_usage)


def _payload(event: bytes) -> bytes:
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            return line[5:].strip()
    return b""


def _data(event: bytes) -> object:
    payload = _payload(event)
    if not payload or payload == b"[DONE]":
        return None
    try:
        return ujson.loads(payload)
    except ValueError:
        return None


def _event_with(event: bytes, obj: dict) -> bytes:
    """The event with its data line written from `obj` (its `event:` line kept)."""
    lines = [b"data: " + json_bytes(obj) if ln.startswith(b"data:") else ln for ln in event.split(b"\n")]
    return b"\n".join(lines)
