"""/v1/messages: Anthropic's Messages family (vLLM engines only), its envelope and its stream's events."""

from __future__ import annotations

from errors import ANTHROPIC, json_bytes
from scheduling.tokens import MESSAGES as MESSAGES_PROMPT
from serving.families.base import Family
from serving.protocol.anthropic import MessagesRequest

_ANTHROPIC_STOP = {"stop": "end_turn", "length": "max_tokens"}
_RETRYABLE_IN_BAND = ("api_error", "internal_error", "overloaded_error")  # Anthropic's 5xx error types


def fix_anthropic_usage(usage: dict, p_usage: dict | None) -> None:
    """The input side is P's: it processed the prompt. A cache count only D reports is the transferred KV.
    With cache details vLLM's `input_tokens` is the prompt less the cache reads and writes, so P's three counts
    are taken together."""
    if not p_usage:
        return
    for key in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"):
        if key in p_usage:
            usage[key] = p_usage[key]
        elif key != "input_tokens":
            usage.pop(key, None)


def named_event(name: str, obj: dict) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + json_bytes(obj)


class Messages(Family):
    route = "/v1/messages"
    api = ANTHROPIC
    request_model = MessagesRequest
    prompt_kind = MESSAGES_PROMPT
    vllm_only = True
    priority_field = False  # vLLM's Messages route makes its own chat request, without the body's `priority`
    # message_start, content_block_start/stop, message_delta and message_stop carry no token. Its count is its
    # message_delta's usage: each further content block adds events (start, stop, a thinking block's
    # signature_delta), so the events are only the fallback for a stream that ended before its message_delta
    # (or sent it in an unterminated last event).
    stream_framing = 5
    final_usage_event = b'"message_delta"'
    last_event = b"event: message_stop"
    usage_in_stream = True
    usage_chunk_option = False
    prompt_keys = (b'"input_tokens":',)
    cache_keys = (b'"cache_read_input_tokens":', b'"cache_creation_input_tokens":')  # not in its input_tokens
    nests = "message"  # message_start nests the message
    continuable = True
    dropped = {"stop_sequences": None}

    def cap_prefill(self, body: dict, changes: dict) -> None:
        # A named tool choice becomes {"type": "any"}: with a named tool vLLM takes P's one token as the whole
        # call's arguments and json.loads them (a 400), while "any" ("required") lets an unparsable call go; the
        # tools stay, so P renders the prompt D renders (vLLM's generic chat renderer does not pass the tool
        # choice to the template).
        choice = body.get("tool_choice")
        if isinstance(choice, dict) and choice.get("type") == "tool":
            changes["tool_choice"] = {"type": "any"}
            if "disable_parallel_tool_use" in choice:
                changes["tool_choice"]["disable_parallel_tool_use"] = choice["disable_parallel_tool_use"]

    def fix_usage(self, usage: dict, p_usage: dict | None) -> None:
        fix_anthropic_usage(usage, p_usage)

    def structured(self, b: dict) -> bool:
        return isinstance(b.get("output_config"), dict) and bool(b["output_config"].get("format"))

    def thinks(self, b: dict) -> bool:
        return isinstance(b.get("thinking"), dict) and b["thinking"].get("type") != "disabled"

    def observe(self, cont, obj: dict) -> bool:
        kind, changed = obj.get("type"), False
        if kind == "message_start" and isinstance(obj.get("message"), dict):
            cont.head = {"id": obj["message"].get("id")}
            changed = cont.take_prompt(obj["message"])
            cont.ids_or_not()
        elif kind == "content_block_start":
            cont.block, cont.count = obj.get("index"), cont.count + 1
            if (obj.get("content_block") or {}).get("type") != "text":
                cont.reason = "tools"  # a tool_use or thinking block: not continued as text
        elif kind == "content_block_delta":
            changed = cont.take_ids(obj)
            delta = obj.get("delta") or {}
            if delta.get("text") or delta.get("partial_json") or delta.get("thinking"):
                cont.shown = len(cont.out_ids)
        elif kind == "content_block_stop":
            cont.block = None
        elif kind == "message_delta":
            cont.done = True
        return changed

    def strip(self, obj: dict, key: str) -> None:
        del obj[key]  # (Anthropic's events have no such key)

    def in_band_failure(self, obj: dict) -> int | None:
        err = obj.get("error")
        if not isinstance(err, dict):
            return None
        return 500 if obj.get("type") == "error" and err.get("type") in _RETRYABLE_IN_BAND else None

    def continued(self, cont, text: str, finish: str | None, choice: dict, ids: list, usage: object, tail: dict):
        """Text in the open text block (or a new one, at the next index), which the finish closes."""
        out = []
        if text:
            if cont.block is None:
                cont.block, cont.count = cont.count, cont.count + 1
                start = {
                    "type": "content_block_start",
                    "index": cont.block,
                    "content_block": {"type": "text", "text": ""},
                }
                out.append(named_event("content_block_start", start))
            delta = {"type": "content_block_delta", "index": cont.block, "delta": {"type": "text_delta", "text": text}}
            out.append(named_event("content_block_delta", delta))
        if finish and cont.block is not None:
            out.append(named_event("content_block_stop", {"type": "content_block_stop", "index": cont.block}))
            cont.block = None
        return out

    def continued_done(self, cont) -> bytes:
        return b""  # (message_stop came with the usage)

    def continued_usage(self, cont, client: dict, tail: dict) -> list[bytes]:
        """message_delta, with the stop reason and the usage, and message_stop: the end of the stream."""
        reason = _ANTHROPIC_STOP.get(cont.finish or "stop", "end_turn")
        delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": None}, "usage": client}
        cont.complete = True
        return [named_event("message_delta", delta), named_event("message_stop", {"type": "message_stop"})]

    def client_usage(self, usage: dict, prompt: int, completion: int, p_usage: dict | None) -> dict:
        out = {"input_tokens": prompt, "output_tokens": completion}
        fix_anthropic_usage(out, p_usage)
        return out


MESSAGES = Messages()
