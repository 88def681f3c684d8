"""Usage fix-up for disaggregated requests and the SSE event splitter that finds the usage event.

D may report the transferred prompt as cached tokens, so the client's usage takes the prompt and cached
counts from P and the completion count from D, totals recomputed: where a family's usage is and how its counts
are taken is its family's (`fix_response`, serving/families/). Only the events that carry usage (or a ticket
to strip) are parsed; every other byte is relayed as it came.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable

import ujson

from errors import json_bytes
from serving.families import Family
from state.shared import PREFILL_USAGE_SLOTS, SharedState


def prefill_usage(p_response: dict) -> dict | None:
    usage = p_response.get("usage")
    return usage if isinstance(usage, dict) else None


# What a trigger-mode decode reports when P's usage is not found: D's prompt count, and none of it cached
# (D counts the transferred KV as cached: the client would be billed as if the whole prompt were).
NO_CACHED_PROMPT = {"prompt_tokens_details": {"cached_tokens": 0}}


class PrefillUsages:
    """P's usage in trigger mode, between workers: D asks this Coordinator's /v1/metaserver for the prefill, and
    that call may reach another worker than the client request whose decode leg then reports usage.

    Entries are keyed by the id of the ticket D was handed (serving/trigger.py `trigger_ticket_id`), which
    D's metaserver call carries back: random bits this Coordinator chose, never a client's request id (two
    clients sending one id at once were billed each other's prompts). Each worker writes its own row of
    slots (a slot per ticket id hash; a later request may take it over, and the reader then finds nothing);
    a reader looks in every worker's row. A slot's key is written last and checked again after its counts
    are read, so a reader never takes counts from two requests. An entry counts only if written after the
    reader's request began, and the newest such one wins (a decode retry's metaserver call comes again).
    """

    def __init__(self, shared: SharedState, worker: int, num_workers: int):
        table = shared.prefill_usage
        self.mine = table[worker].slots  # this worker's row
        self.rows = [table[row].slots for row in range(max(num_workers, worker + 1))]
        # Cluster mode: (ticket id, prompt, cached) to the other replicas, whose decode leg may be the reader.
        self.share: Callable[[str, int, int | None], None] | None = None

    @staticmethod
    def _place(request_id: str) -> tuple[int, int]:
        """(key, slot): stable across processes (str hashes are salted per process); the key is never 0
        (an empty slot) and fits int64, the slot comes from other bits of the hash than the key's low ones."""
        h = int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little")
        return h >> 2 | 1, h % PREFILL_USAGE_SLOTS

    def put(self, request_id: str, answer: bytes) -> None:
        """P answered the metaserver's prefill for ticket id `request_id`: keep its prompt and cached counts."""
        try:
            usage = prefill_usage(ujson.loads(answer))
        except (ValueError, AttributeError):  # not JSON, or not an object
            return
        prompt = usage.get("prompt_tokens") if usage else None
        if not isinstance(prompt, int) or prompt < 0:
            return
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        cached = cached if isinstance(cached, int) and 0 <= cached <= prompt else None
        self.put_counts(request_id, prompt, cached)
        if self.share is not None:
            self.share(request_id, prompt, cached)

    def put_counts(self, request_id: str, prompt: int, cached: int | None) -> None:
        """Keep P's prompt and cached counts for ticket id `request_id` (None: its answer had no cached count)."""
        key, slot = self._place(request_id)
        e = self.mine[slot]
        e.key = 0
        e.prompt_tokens = prompt
        e.cached_plus_one = 0 if cached is None else cached + 1
        e.written_ns = time.monotonic_ns()  # CLOCK_MONOTONIC: one clock for every process of the machine
        e.key = key

    def get(self, request_id: str, since_ns: int) -> dict | None:
        """P's usage for `request_id` as its answer had it (prompt and cached counts), if a worker kept it at
        `since_ns` (time.monotonic_ns()) or later."""
        key, slot = self._place(request_id)
        newest, found = since_ns - 1, None
        for row in self.rows:
            e = row[slot]
            if e.key == key:
                prompt, cached, stamp = e.prompt_tokens, e.cached_plus_one, e.written_ns
                if e.key == key and stamp > newest:
                    newest, found = stamp, (prompt, cached)
        if found is None:
            return None
        usage: dict = {"prompt_tokens": found[0]}
        if found[1]:
            usage["prompt_tokens_details"] = {"cached_tokens": found[1] - 1}
        return usage


class UsageFix:
    """How a decode leg's answer is made fit for the client: P's prompt counts in D's usage, P's ticket out.

    P's usage is given (handoff: P's answer had it; None: nothing to put in), or in trigger mode looked up
    when the first usage-bearing event comes (`PrefillUsages`, kept by the worker that relayed P's answer
    to D; none of the prompt cached while not found). A D that computed the prompt itself (`own_prompt`)
    reports its own counts. Token events carry no usage: they pass without a lookup or a parse.
    """

    __slots__ = ("family", "p_usage", "request_id", "since_ns", "usages")

    def __init__(self, p_usage: dict | None, family: Family):
        self.p_usage, self.family = p_usage, family
        self.usages: PrefillUsages | None = None  # set by `from_trigger`: P's usage is looked up there
        self.request_id, self.since_ns = "", 0

    @classmethod
    def from_trigger(cls, usages: PrefillUsages, request_id: str, family: Family) -> UsageFix:
        """P's usage written by D's metaserver call for ticket id `request_id`, which comes after now."""
        fix = cls(None, family)
        fix.usages, fix.request_id, fix.since_ns = usages, request_id, time.monotonic_ns()
        return fix

    @property
    def own_counts(self) -> bool:
        """D's usage is its own count of the prompt (it computed it: no P counts to put in)."""
        return self.p_usage is None and self.usages is None

    def own_prompt(self) -> None:
        """D computes the prompt itself now (its body leaves P's ticket out): no trigger-mode lookup."""
        self.usages = None

    def counts(self) -> dict | None:
        """P's usage for D's answer (None: D's own counts stand)."""
        if self.usages is not None and self.p_usage is None:
            self.p_usage = self.usages.get(self.request_id, self.since_ns)
            return self.p_usage or NO_CACHED_PROMPT
        return self.p_usage

    def response(self, obj: dict) -> dict:
        return self.family.fix_response(obj, self.counts())

    def event(self, event: bytes) -> bytes:
        """One complete SSE event (without its blank-line terminator); untouched unless it carries usage or a
        ticket."""
        return _fix_event(event, self.counts(), self.family) if needs_fix(event) else event

    def events(self, block: bytes) -> bytes:
        """Complete SSE events, each ended by a blank line, with the usage-bearing ones fixed up.

        Only the events holding a marker are cut out and parsed; the bytes between them pass as they are
        (a fast engine's whole stream can arrive as one block with its usage event last).
        """
        marker = _next_marker(block, 0)
        return block if marker < 0 else _fix_events_from(block, marker, self.counts(), self.family)


def _fix_event(event: bytes, p_usage: dict | None, family: Family) -> bytes:
    lines = event.split(b"\n")
    for i, line in enumerate(lines):
        if line.startswith(b"data:"):
            payload = line[5:].strip()
            try:
                obj = ujson.loads(payload)
            except ValueError:
                return event
            if isinstance(obj, dict):
                lines[i] = b"data: " + json_bytes(family.fix_response(obj, p_usage))
    return b"\n".join(lines)


_KEYS = (b'"usage"', b'"kv_transfer_params"')


def needs_fix(data: bytes) -> bool:
    """Does this stretch of SSE carry usage or a ticket? (Most token events do not: they pass as bytes.)"""
    return _next_marker(data, 0) >= 0


def _next_marker(data: bytes, start: int) -> int:
    """Where the first usage or ticket object at or after `start` begins (the key, then `:` and `{` with any
    blanks between), or -1.

    One scan per key (a scan of a 2 KB block costs about a microsecond), each hit checked for an object
    after it: `"usage":null` or a key inside a string is not a marker.
    """
    found = -1
    for key in _KEYS:
        i = data.find(key, start)
        while i >= 0 and (found < 0 or i < found):
            after = data[i + len(key) : i + len(key) + 16].lstrip()
            if after[:1] == b":" and after[1:].lstrip()[:1] == b"{":
                found = i
                break
            i = data.find(key, i + len(key))
    return found


def _fix_events_from(block: bytes, marker: int, p_usage: dict | None, family: Family) -> bytes:
    """`UsageFix.events` from the first marker on (found by the caller)."""
    out, pos = [], 0
    while marker >= 0:
        start = block.rfind(b"\n\n", pos, marker)
        start = pos if start < 0 else start + 2
        end = block.find(b"\n\n", marker)
        end = len(block) if end < 0 else end
        out.append(block[pos:start])
        out.append(_fix_event(block[start:end], p_usage, family))  # a marker is in it: no second scan
        pos = end
        marker = _next_marker(block, pos)
    out.append(block[pos:])
    return b"".join(out)


class EventSplitter:
    """Cuts a byte stream at SSE event boundaries, keeping a partial tail for the next chunk."""

    __slots__ = ("tail",)

    def __init__(self) -> None:
        self.tail = b""

    def complete(self, chunk: bytes) -> bytes:
        """The complete events now available (with their terminators); a partial last one waits for the rest."""
        if not self.tail and chunk.endswith(b"\n\n"):  # the usual chunk: whole events (CRLF framing ends in \r\n)
            return chunk
        data = self.tail + chunk if self.tail else chunk
        if b"\r\n" in data:
            data = data.replace(b"\r\n", b"\n")
        end = data.rfind(b"\n\n")
        if end < 0:
            self.tail = data
            return b""
        block, self.tail = data[: end + 2], data[end + 2 :]
        return block
