"""Usage fix-up for disaggregated requests and the SSE event splitter that finds the usage event.

D may report the transferred prompt as cached tokens, so the client's usage takes the prompt and cached
counts from P and the completion count from D, totals recomputed. On /v1/messages that is all of P's
input side: with cache details vLLM's `input_tokens` is the prompt less the cache reads and writes, so
P's three counts are taken together. Only the events that carry usage (or a ticket to strip) are parsed;
every other byte is relayed as it came.
"""

from __future__ import annotations

import ujson

from errors import dumps



def prefill_usage(p_response: dict) -> dict | None:
    usage = p_response.get("usage")
    return usage if isinstance(usage, dict) else None


def fix_openai_usage(usage: dict, p_usage: dict | None) -> None:
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


def fix_anthropic_usage(usage: dict, p_usage: dict | None) -> None:
    """The input side is P's: it processed the prompt. A cache count only D reports is the transferred KV."""
    if not p_usage:
        return
    for key in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"):
        if key in p_usage:
            usage[key] = p_usage[key]
        elif key != "input_tokens":
            usage.pop(key, None)


def fix_response(obj: dict, p_usage: dict | None, anthropic: bool) -> dict:
    """A decode response (JSON body or one SSE event's data) made fit for the client."""
    obj.pop("kv_transfer_params", None)
    usage = obj.get("usage")
    if anthropic and isinstance(obj.get("message"), dict):  # message_start nests the message
        obj["message"].pop("kv_transfer_params", None)
        usage = obj["message"].get("usage")
    if isinstance(usage, dict):
        (fix_anthropic_usage if anthropic else fix_openai_usage)(usage, p_usage)
    return obj


def fix_event(event: bytes, p_usage: dict | None, anthropic: bool) -> bytes:
    """One complete SSE event (without its blank-line terminator); untouched unless it carries usage or a ticket."""
    return _fix_event(event, p_usage, anthropic) if needs_fix(event) else event


def _fix_event(event: bytes, p_usage: dict | None, anthropic: bool) -> bytes:
    lines = event.split(b"\n")
    for i, line in enumerate(lines):
        if line.startswith(b"data:"):
            payload = line[5:].strip()
            try:
                obj = ujson.loads(payload)
            except ValueError:
                return event
            if isinstance(obj, dict):
                lines[i] = b"data: " + dumps(fix_response(obj, p_usage, anthropic))
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


def fix_events(block: bytes, p_usage: dict | None, anthropic: bool) -> bytes:
    """Complete SSE events, each ended by a blank line, with the usage-bearing ones fixed up.

    Only the events holding a marker are cut out and parsed; the bytes between them pass as they are
    (a fast engine's whole stream can arrive as one block with its usage event last).
    """
    marker = _next_marker(block, 0)
    if marker < 0:
        return block
    out, pos = [], 0
    while marker >= 0:
        start = block.rfind(b"\n\n", pos, marker)
        start = pos if start < 0 else start + 2
        end = block.find(b"\n\n", marker)
        end = len(block) if end < 0 else end
        out.append(block[pos:start])
        out.append(_fix_event(block[start:end], p_usage, anthropic))  # a marker is in it: no second scan
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
