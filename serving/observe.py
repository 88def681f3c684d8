"""What the Coordinator records about each request: one structured log line, and the metrics hooks.

Token counts cost no parsing: a JSON answer's usage is found by searching its bytes from the end (usage
comes last), a Messages or Responses stream's in the bytes of its family's final usage event (as the client
gets them), and any other stream's output is its number of `data:` events less the events that carry no token
(its family's `stream_framing`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from config import DEFAULT_TENANT
from scheduling.registry import Target
from serving.families import Family

log = logging.getLogger("coordinator.request")

_OUTPUT_KEYS = (b'"completion_tokens":', b'"output_tokens":')
_MESSAGES_OUTPUT_KEY = (b'"output_tokens":',)
_INPUT_KEYS = (b'"prompt_tokens":', b'"input_tokens":')
_INT = re.compile(rb"\s*(\d+)")


# A value logfmt reads as it is: printable ASCII but the space, `"`, `=` and `\`.
_PLAIN = re.compile(r"[!#-<>-\[\]-~]+")


def log_value(value: str) -> str:
    """A value a client chose (its request id, a model name, an error that quotes one) for a `key=value` field, as
    logfmt readers read it: as it is when plain, else quoted with JSON's escapes (a quote, a backslash, control
    characters and anything not ASCII), which are logfmt's, so that no reader finds a field or a line in it."""
    return value if _PLAIN.fullmatch(value) else json.dumps(value)


def _last_int(body: bytes, keys: tuple[bytes, ...]) -> int | None:
    for key in keys:
        i = body.rfind(key)
        if i >= 0:
            m = _INT.match(body, i + len(key))
            if m:
                return int(m.group(1))
    return None


# What an answer's usage says its engine held (OpenAI's prompt_tokens_details, Anthropic's cache reads).
_CACHED_KEYS = (b'"cached_tokens":', b'"cache_read_input_tokens":')


def answer_prompt_tokens(body: bytes, family: Family) -> int:
    """The prompt tokens, cached ones included, that an engine's JSON answer reports (scheduling.tokens'
    `engine_prompt`, read from the bytes); -1 when absent. Its family names the keys (`prompt_keys`), and the
    cache counts its count leaves out (`cache_keys`: Anthropic's cache reads and writes)."""
    prompt = _last_int(body, family.prompt_keys)
    if prompt is None:
        return -1
    for key in family.cache_keys:
        prompt += _last_int(body, (key,)) or 0
    return prompt


# How a request was placed: a P/D pair, the pair's decode instance alone (it computed the prompt: conditional
# disaggregation, or a request the handoff cannot serve), or one instance whole (union, fallback).
PD, DECODE_ALONE, WHOLE_PLACEMENT = PLACEMENTS = ("pd", "decode_alone", "whole")


@dataclass(slots=True)
class RequestRecord:
    """Facts gathered while one request is served, for its log line and metrics."""

    request_id: str
    route: str
    tenant: str = DEFAULT_TENANT  # who the API key says sent it (handlers/auth.py); never the key
    model: str = ""
    stream: bool = False
    started: float = field(default_factory=time.monotonic)
    ttft_s: float | None = None
    prefill: Target | None = None
    target: Target | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    retries: int = 0
    continuations: int = 0  # times its stream went on on another engine after a failure (serving/continuation.py)
    continuation_refused: str = ""  # why a broken stream was not continued
    missed_handoff: bool = False
    placement: str = ""  # how the plan placed it: one of PLACEMENTS ("": not placed, e.g. refused)
    status: int = 200
    error: str = ""
    disconnect_phase: str = ""
    reject_reason: str = ""  # why admission refused it (rate_limit, inflight_cap, slo_budget, draining, no_capacity)
    prompt_tokens: int = 0  # the engine's count from a JSON answer's usage, else the scheduler's count (prepare)
    output_tokens: int | None = None  # from a JSON answer's usage, or a Messages stream's message_delta
    events: int = 0  # SSE `data:` events relayed
    usage_event: bool = False  # the client asked for a usage chunk (stream_options.include_usage)
    family: Family | None = None  # the endpoint family it came in by (None: a call of no family's)
    duration_s: float = 0.0  # set when the request is done
    # With KV events: the request's JobInfo (what its plan predicted the engine held: `cached_predicted`). What the
    # engine that computed its prompt reported it held (`prompt_tokens_details.cached_tokens`, Anthropic's cache
    # reads; -1: not said), for the tenant metrics and, with KV events, the prediction's outcome
    info: object = None
    cached_tokens: int = -1

    def first_token(self) -> None:
        if self.ttft_s is None:
            self.ttft_s = time.monotonic() - self.started

    def answered(self, body: bytes) -> None:
        """A JSON answer went out: take the token counts from its usage."""
        self.output_tokens = _last_int(body, _OUTPUT_KEYS)
        prompt = _last_int(body, _INPUT_KEYS)
        if prompt is not None:
            self.prompt_tokens = prompt
        self.engine_cached(body)

    def engine_cached(self, usage: bytes) -> None:
        """The cached tokens an engine's usage (an answer, or events holding it) reports, if it says."""
        cached = _last_int(usage, _CACHED_KEYS)
        if cached is not None:
            self.cached_tokens = cached

    @property
    def cached_tokens_predicted(self) -> int:
        info = self.info
        return info.cached_predicted if info is not None and info.prompt_keys is not None else -1

    def message_delta(self, block: bytes) -> None:
        """Relayed events that hold its family's `final_usage_event` (Messages' message_delta, Responses'
        response.completed): its usage is the output count (the last `output_tokens` of the block:
        message_start's comes before it, and nothing after it has one)."""
        self.output_tokens = _last_int(block, _MESSAGES_OUTPUT_KEY)

    @property
    def generated_tokens(self) -> int:
        if self.output_tokens is not None:
            return self.output_tokens
        framing = self.family.stream_framing if self.family is not None else 0
        return max(0, self.events - framing - self.usage_event)


TICK_S = 0.05  # how long a batching writer's batch waits at most: the request log's, the metrics', the tenants' tpm


class Tick:
    """One worker's one pending call for all its batching writers (the request log, the metrics, the tenants' tpm
    charge): `TICK_S` after the first of them armed it, it flushes each writer armed since the last tick.

    A timer per writer made two or three event-loop timers (each a heap entry, a handle, a cancel) per `TICK_S`;
    at a few requests per `TICK_S` that was a visible part of a request. Here every writer's `arm` is a flag and,
    for the first one, the one timer.
    """

    __slots__ = ("delay_s", "due", "handle")

    def __init__(self, delay_s: float = TICK_S):
        self.delay_s = delay_s
        self.due: list[FlushTimer] = []  # writers armed since the last tick (a disarmed one is skipped)
        self.handle: asyncio.TimerHandle | None = None

    def timer(self, flush: Callable[[], None]) -> FlushTimer:
        return FlushTimer(flush, self)

    def _run(self) -> None:
        self.handle = None
        due, self.due = self.due, []
        for timer in due:
            timer.queued = False
            if timer.armed:
                timer.armed = False
                try:
                    timer.flush()
                except Exception:  # one writer's failure is its own: the others flush, and it is armed again later
                    log.exception("a batching writer's flush failed")


class FlushTimer:
    """One writer's part of its worker's `Tick`: `flush` called at the next tick after `arm()`.

    With no running event loop (nothing would call back later) `arm()` flushes at once; an `arm()` from within
    that flush (the tpm charge arms again while requests stream) waits for the next one. The writer's
    `flush` calls `disarm()` first, so a flush for another reason (a full batch, a scrape, shutdown)
    leaves nothing for the tick.
    """

    __slots__ = ("armed", "flush", "flushing", "queued", "tick")

    def __init__(self, flush: Callable[[], None], tick: Tick):
        self.flush, self.tick = flush, tick
        self.armed = self.queued = False  # queued: in the tick's `due` (armed or not since)
        self.flushing = False  # in a flush `arm()` made at once (no loop)

    def arm(self) -> None:
        if self.armed:
            return
        tick = self.tick
        if tick.handle is None:
            try:
                tick.handle = asyncio.get_running_loop().call_later(tick.delay_s, tick._run)
            except RuntimeError:
                if not self.flushing:
                    self.flushing = True
                    try:
                        self.flush()
                    finally:
                        self.flushing = False
                return
        self.armed = True
        if not self.queued:
            self.queued = True
            tick.due.append(self)

    def disarm(self) -> None:
        self.armed = False


class RequestLog:
    """The one line per request, in the root handler's format, written to stdout in batches.

    Made through `logging`, the line cost about 75 µs of CPU in a loaded worker (a LogRecord, the handler's
    lock, a formatter, a write and a flush per line): a tenth of a streamed request. Here it is one
    %-format into a buffer, written out at the worker's next `Tick`, or once `max_lines` wait, and at shutdown. The
    `coordinator.request` logger's level still decides whether the line is made at all. Lines of other
    loggers are written at once, so a request line may follow one logged up to `TICK_S` after it.
    """

    def __init__(self, tick: Tick, max_lines: int = 256):
        self.max_lines = max_lines
        self.lines: list[str] = []
        self.prefix = f" INFO {log.name}[{os.getpid()}]: "
        self._second, self._stamp = -1, ""
        self._timer = tick.timer(self.flush)

    def enabled(self) -> bool:
        return log.isEnabledFor(logging.INFO)

    def write(self, message: str) -> None:
        now = time.time()
        second = int(now)
        if second != self._second:  # asctime's format, made once a second
            self._second, self._stamp = second, time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
        self.lines.append(f"{self._stamp},{int((now - second) * 1000):03d}{self.prefix}{message}\n")
        if len(self.lines) >= self.max_lines:
            self.flush()
        else:
            self._timer.arm()

    def flush(self) -> None:
        self._timer.disarm()
        if self.lines:
            out, self.lines = "".join(self.lines), []
            sys.stdout.write(out)
            sys.stdout.flush()


def _kv_fields(rec: RequestRecord) -> str:
    predicted, reported = rec.cached_tokens_predicted, rec.cached_tokens
    return f" cached_tokens_predicted={predicted if predicted >= 0 else '-'} cached_tokens={reported if reported >= 0 else '-'}"


def kv_outcome(rec: RequestRecord) -> str | None:
    """How the prediction of a request's cached tokens went, when the engine said what it held: exact, over,
    under, or unpredicted (its exact ids were not had in time: planned on the estimate)."""
    info, reported = rec.info, rec.cached_tokens
    if info is None or reported < 0:
        return None
    if info.prompt_keys is None:
        return "unpredicted"
    predicted = info.cached_predicted
    if predicted < 0:  # never leased to an engine that computes prompts
        return None
    return "exact" if predicted == reported else "over" if predicted > reported else "under"


def _name(t: Target | None) -> str:
    return t.label if t else "-"


class Observer:
    """Logs one line per request; subclasses add metrics."""

    def __init__(self, tick: Tick) -> None:
        self.request_log = RequestLog(tick)

    def request_done(self, rec: RequestRecord) -> None:
        rec.duration_s = time.monotonic() - rec.started
        if self.request_log.enabled():
            self.request_log.write(
                "request_id=%s route=%s tenant=%s model=%s stream=%s prefill=%s decode=%s status=%d ttft_ms=%s "
                "prompt_tokens=%d output_tokens=%d retries=%d missed_handoff=%s continuations=%d%s placement=%s "
                "duration_ms=%.1f%s%s"
                % (
                    log_value(rec.request_id),
                    rec.route,
                    rec.tenant,
                    log_value(rec.model) if rec.model else "-",
                    rec.stream,
                    _name(rec.prefill),
                    _name(rec.target),
                    rec.status,
                    f"{rec.ttft_s * 1000:.1f}" if rec.stream and rec.ttft_s is not None else "-",
                    rec.prompt_tokens,
                    rec.generated_tokens,
                    rec.retries,
                    rec.missed_handoff,
                    rec.continuations,
                    f" continuation_refused={rec.continuation_refused}" if rec.continuation_refused else "",
                    rec.placement or "-",
                    rec.duration_s * 1000,
                    _kv_fields(rec) if rec.info is not None else "",
                    f" error={log_value(rec.error)}" if rec.error else "",
                )
            )

    def close(self) -> None:
        """The worker stops: write out what is buffered."""
        self.request_log.flush()

    def retry(self, job, target: Target, err: Exception) -> None:
        log.warning(
            "request_id=%s retrying after=%s on %s", log_value(job.request_id), log_value(str(err)), _name(target)
        )

    def continuation(self, job, target: Target, err: Exception, kept: int) -> None:
        """`kept`: the generated tokens the client has seen, which the continuation goes on from."""
        log.warning(
            "request_id=%s stream continued on %s kept_tokens=%d after=%s",
            log_value(job.request_id),
            _name(target),
            kept,
            log_value(str(err)),
        )

    def continuation_refused(self, job, target: Target, reason: str, err: Exception) -> None:
        log.warning(
            "request_id=%s stream not continued (%s) after=%s on %s",
            log_value(job.request_id),
            reason,
            log_value(str(err)),
            _name(target),
        )

    def missed_handoff(self, job, rec: RequestRecord, why: str) -> None:
        log.warning(
            "request_id=%s missed handoff (prefill %s): %s; decode recomputes the prompt",
            log_value(job.request_id),
            _name(rec.prefill),
            why,
        )
