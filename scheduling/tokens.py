"""Prompt token counts and prefix block hashes for scheduling.

Two ways to count, chosen per model:

* **exact**: `models[].tokenizer_path` names a Hugging Face `tokenizer.json` (or the directory holding
  it) and the optional `tokenizers` package is installed: scheduling/exact.py renders and encodes every
  prompt off the event loop, whatever its size, and the request is planned on the exact ids once they are
  in. Until then (and if they are not in soon enough) the estimate below stands.
* **estimate** (no tokenizer, or it cannot be loaded): the prompt is rendered with a ChatML template
  (tools as a leading system block, the system prompt, every message, the opened assistant turn: the
  layout of Qwen-style templates and of engine_sim) and counted at the model's calibrated tokens per byte
  of that rendering, one token per 4 UTF-8 bytes until calibrated. An image counts 64 tokens.

**Calibration.** An estimate is one multiply: the rendering's bytes times the meter's `tokens_per_byte`.
Each meter learns that ratio from the engines' own counts: when an engine's usage arrives with the
prompt's tokens (P's answer in a PD handoff, a whole request's or a decode-alone request's answer, a
stream's first usage that counts the prompt; `engine_prompt` reads OpenAI, Responses and Anthropic usage), the scheduler's `calibrate` hands the meter
the bytes it measured for that prompt and the engine's count, a few arithmetic operations off the
per-KiB path. A TokenizerMeter also learns from its own exact counts.
Each count moves the ratio LEARN_WEIGHT of the way to the count's own ratio, clamped to
[MIN_TOKENS_PER_BYTE, MAX_TOKENS_PER_BYTE] so that one odd engine cannot poison it; a count within a
token of the estimate teaches nothing (it is right, to rounding). From 1/4 to a tokenizer's 1/3, the
estimate is within 5 % after 16 counts (tests/test_scheduling.py). Only text prompts of at least
LEARN_MIN_BYTES teach: not token-id prompts, not prompts with images or other media (their placeholder is a
guess), not those the engine truncates or renders with the request's own template (`count`'s third value
is 0 for them), and not a Responses request that continues a stored one (the engine's prompt holds the
stored conversation). An OpenAI stream teaches only when its client asked for usage. Each worker,
and each replica, learns on its own, from the requests it serves.

Accuracy against exact counts (docs/performance.md, "Long prompts"; measured once): chat prompts of 8 KiB to
1 MiB cut from this repository's Python and docs, the e2e model's 4,096-token BPE. The fixed 1/4 was 30-45 %
low; calibrated on 40 other prompts of that kind it is within 4 % at 128 KiB and up (-0.0 to +3.6 %), on
mixed code and English traffic within 7 % (-2.3 to +6.8 %). A shorter prompt's own text can be denser than
the model's mean: at 8 and 32 KiB an English cut (a table-heavy passage) was 15 and 6.6 % low, code 5.0 and
2.7 %.

Every request of a prompt route is counted once, by its model's meter, before it is planned; the
count is what the request line and metrics report when the engine's answer carries no usage.

Block hashes are over the ChatML rendering (a completion's text; a token-id prompt's ids) whichever the
meter, so that the turns of one conversation share them however each was counted. They are chained: block k's hash covers the whole prompt up to the end of block k (system
prompt and tools included), so two prompts share block k's hash exactly when they share that prefix.
Prompts of agents run to megabytes, so a prompt is not hashed at every block: the hashes cover each
prefix up to 16 blocks, then 8 prefix lengths per doubling (`BOUNDARIES`), and a cached prefix is found to
within 1/8 of its length. The hash is the prefix's CRC-32 beside its length in blocks (64 bits, computed
in one pass): not cryptographic; a collision only misroutes one request.
"""

from __future__ import annotations

import json
import math
import zlib
from array import array
from bisect import bisect_right
from functools import lru_cache
from itertools import repeat

BYTES_PER_TOKEN = 4
# Calibration: counts (exact ones, the engines') of prompts of LEARN_MIN_BYTES up move the tokens per byte
# LEARN_WEIGHT of the way to theirs, each count's ratio clamped to this range (byte-level BPE gives at most a
# token per byte; 16 bytes a token is beyond what vocabularies merge, outside runs of one character).
LEARN_MIN_BYTES = 256
LEARN_WEIGHT = 0.1
MIN_TOKENS_PER_BYTE, MAX_TOKENS_PER_BYTE = 1 / 16, 1.0
IMAGE_TOKENS = 64
IMAGE_PLACEHOLDER = "<|image|>" + "#" * (IMAGE_TOKENS * BYTES_PER_TOKEN - len("<|image|>"))

# The prompt shapes of the inference routes.
CHAT, MESSAGES, COMPLETION = "chat", "messages", "completion"


# -- rendering ---------------------------------------------------------------------------------


def _dumps(obj: object) -> str:
    return json.dumps(obj, sort_keys=True, ensure_ascii=False)


def _part_text(part: object) -> str:
    if isinstance(part, str):
        return part
    if not isinstance(part, dict):
        return str(part)
    kind = part.get("type")
    if kind in ("text", "input_text", "output_text"):
        return str(part.get("text") or "")
    if kind in ("image_url", "image", "input_image"):
        return IMAGE_PLACEHOLDER
    if kind == "thinking":
        return str(part.get("thinking") or "")
    if kind == "tool_use":
        return _dumps({"name": part.get("name"), "input": part.get("input")})
    if kind == "tool_result":
        return content_text(part.get("content"))
    if kind == "redacted_thinking":
        return ""
    if "text" in part:
        return str(part.get("text") or "")
    return _dumps(part)


def content_text(content: object) -> str:
    """Message content (a string, a list of parts, None) as the text a text-only model sees."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_part_text(p) for p in content)
    return _part_text(content)


def _chat_parts(kind: str, body: dict) -> tuple[list, object, object]:
    """(messages, tools, system) of a chat or Anthropic body."""
    messages = body.get("messages")
    messages = [m for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []
    return messages, body.get("tools") or None, body.get("system") if kind == MESSAGES else None


def render_chatml(messages: list, tools: object = None, system: object = None) -> str:
    """The conversation in ChatML, ending with the opened assistant turn."""
    out = []
    if tools:
        out.append("<|im_start|>system\n# Tools\n" + _dumps(list(tools)) + "<|im_end|>\n")
    if system:
        out.append("<|im_start|>system\n" + content_text(system) + "<|im_end|>\n")
    for m in messages:
        body = content_text(m.get("content"))
        if m.get("tool_calls"):
            body += _dumps(m["tool_calls"])
        out.append("<|im_start|>" + str(m.get("role") or "user") + "\n" + body + "<|im_end|>\n")
    out.append("<|im_start|>assistant\n")
    return "".join(out)


def completion_text(prompt: object) -> str:
    if isinstance(prompt, str):
        return prompt
    if prompt is None:  # prompt_embeds instead: not text, and not counted
        return ""
    if isinstance(prompt, list):
        return "\n".join(completion_text(p) for p in prompt)
    return str(prompt)


def _token_list(prompt: object) -> list[int] | None:
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    return None


# -- block hashes ------------------------------------------------------------------------------


def _boundaries(dense: int, per_octave: int, limit: int) -> list[int]:
    """Every block count up to `dense`, then `per_octave` counts per doubling, up to `limit`."""
    out, step, c = list(range(1, dense + 1)), dense // per_octave, dense
    while c < limit:
        for _ in range(per_octave):
            c += step
            out.append(c)
        step *= 2
    return out


# The prefixes a prompt's hashes cover, in blocks: each block up to DENSE_BLOCKS (1 KiB of text at 16-token
# blocks), then 8 per doubling, so that a prompt of n blocks has about 16 + 8 log2(n / 16) hashes (96 for
# 1 MiB) and a cached prefix is found to within 1/8 of its length (never longer than it is). The same counts
# for every prompt, so that two prompts sharing a prefix share its hashes.
DENSE_BLOCKS, PER_OCTAVE = 16, 8
BOUNDARIES = _boundaries(DENSE_BLOCKS, PER_OCTAVE, 1 << 26)


def chained_hashes(data: bytes, block_bytes: int) -> list[int]:
    """64-bit hashes of the prefixes of `data` that end at the BOUNDARIES' block counts (full blocks only).

    One CRC-32 runs through the data once, in C (about 0.25 µs per KiB); Python works once per boundary, not
    per block. A hash is the prefix's CRC-32 above its length in blocks."""
    blocks, view, out = len(data) // block_bytes, memoryview(data), []
    crc, start = 0, 0
    for count in BOUNDARIES:
        if count > blocks:
            break
        end = count * block_bytes
        crc = zlib.crc32(view[start:end], crc)
        out.append((crc << 32) | count)
        start = end
    return out


def salted_hashes(hashes: list[int], salt: object) -> list[int]:
    """A prompt's prefix hashes in the scope of its `cache_salt` (vLLM's, which enters its first block's hash):
    each hash's CRC half mixed with the salt's CRC-32, so that the same prompt under another salt shares none of
    them (a hash keeps its block count, and stays non-zero)."""
    mix = _salt_mix(str(salt))
    return [h ^ mix for h in hashes]


@lru_cache(maxsize=4096)
def _salt_mix(salt: str) -> int:
    """A salt's CRC-32 above a hash's block count: made once per salt (per tenant)."""
    return zlib.crc32(salt.encode("utf-8", "surrogatepass")) << 32


def blocks_covered(held: int) -> int:
    """The blocks of prompt covered by its first `held` hashes."""
    return BOUNDARIES[held - 1] if held > 0 else 0


def hashes_covering(blocks: int) -> int:
    """How many of a prompt's hashes cover exactly its first `blocks` blocks (a count blocks_covered made)."""
    return bisect_right(BOUNDARIES, blocks)


def ids_bytes(ids: list[int]) -> bytes:
    """Token ids as the bytes a prompt's block hashes and its KV keys (scheduling/kv_index.py) cover: 4-byte
    integers, little-endian (vocabularies are under 2^32; an id past 32 bits, the simulator's, is taken modulo
    2^32). TypeError/OverflowError for an id that is no token (a negative one). `fromlist` takes half the time
    of array's constructor on a list (2 ms for 256 Ki ids)."""
    out = array("I")
    try:
        out.fromlist(ids)
    except OverflowError:
        out = array("I", [i & 0xFFFFFFFF if i >= 0 else -1 for i in ids])
    return out.tobytes()


def _masked_bytes(ids: list[int]) -> bytes:
    """A prompt's ids that are not all tokens (`ids_bytes` refused them), each taken modulo 2^32: what its block
    hashes cover."""
    return array("I", [i & 0xFFFFFFFF for i in ids]).tobytes()


# -- per-model meters --------------------------------------------------------------------------


class PromptMeter:
    """Counts a request's prompt tokens and hashes its prefix blocks the way one model's engine sees them.

    `tokens_per_byte` is calibrated from the engines' counts (`calibrate`), in each worker on its own."""

    exact = False

    def __init__(self, block_tokens: int = 16):
        self.block_tokens = block_tokens
        self.tokens_per_byte = 1 / BYTES_PER_TOKEN  # until counts say otherwise

    def count(self, kind: str, body: dict, hashes: bool = True) -> tuple[int, list[int], int]:
        """(prompt tokens, chained block hashes, learnable bytes): the last is the byte length of the prompt's
        rendering when an engine's count of this prompt may teach the meter (`calibrate`), else 0."""
        if kind == COMPLETION:
            prompt = body.get("prompt")
            ids = _token_list(prompt)
            if ids is not None:
                return self._token_ids(ids, True)[:3] if hashes else (len(ids), [], 0)
            learnable = isinstance(prompt, str) and body.get("truncate_prompt_tokens") is None
            return self._text(completion_text(prompt), hashes, True, learnable)
        messages, tools, system = _chat_parts(kind, body)
        return self._chat(messages, tools, system, hashes, _template_as_ours(body))

    def count_ids(self, kind: str, body: dict, hashes: bool = True) -> tuple[int, list[int], int, bytes | None]:
        """`count`'s, and a token-id prompt's ids as `ids_bytes` gives them (what PromptKeys are made of); None
        for a text prompt (a TokenizerMeter's `submit` encodes it) and for ids that are no tokens."""
        if kind == COMPLETION:
            ids = _token_list(body.get("prompt"))
            if ids is not None:
                return self._token_ids(ids, hashes)
        return (*self.count(kind, body, hashes), None)

    def _token_ids(self, ids: list[int], hashes: bool) -> tuple[int, list[int], int, bytes | None]:
        """A token-id prompt's count, block hashes ([] unless `hashes`), learnable bytes (none: it teaches
        nothing) and `ids_bytes` (None: not all of them are tokens; its hashes are over the ids modulo 2^32)."""
        try:
            data = ids_bytes(ids)
        except (OverflowError, TypeError):
            data = None
        if not hashes:
            return len(ids), [], 0, data
        return len(ids), chained_hashes(_masked_bytes(ids) if data is None else data, self.block_tokens * 4), 0, data

    def calibrate(self, prompt_bytes: int, prompt_tokens: int) -> None:
        """An engine counted `prompt_tokens` for a prompt whose rendering measured `prompt_bytes` (`count`'s
        learnable bytes; 0: it cannot teach). A few arithmetic operations: it runs when usage arrives."""
        if prompt_bytes >= LEARN_MIN_BYTES and prompt_tokens > 0:
            self._learn(prompt_bytes, prompt_tokens)

    def _learn(self, prompt_bytes: int, prompt_tokens: int) -> None:
        """Move the tokens per byte toward one count's (an engine's, an exact one), clamped."""
        tpb = self.tokens_per_byte
        if abs(prompt_tokens - prompt_bytes * tpb) <= 1.0:  # right to rounding: an engine that rounds up stays put
            return
        ratio = min(max(prompt_tokens / prompt_bytes, MIN_TOKENS_PER_BYTE), MAX_TOKENS_PER_BYTE)
        self.tokens_per_byte = tpb + LEARN_WEIGHT * (ratio - tpb)

    def _chat(
        self, messages: list, tools: object, system: object, hashes: bool, learnable: bool
    ) -> tuple[int, list[int], int]:
        data = render_chatml(messages, tools, system).encode("utf-8", "ignore")
        return self._estimated(data, hashes, _learn_bytes(len(data), learnable, messages, system))

    def _block_hashes(self, data: bytes, hashes: bool) -> list[int]:
        """The prefix hashes of a prompt's text (its ChatML rendering, a completion's text); [] unless `hashes`."""
        return chained_hashes(data, self.block_tokens * BYTES_PER_TOKEN) if hashes else []

    def _text(self, text: str, hashes: bool, special: bool, learnable: bool) -> tuple[int, list[int], int]:
        data = text.encode("utf-8", "ignore")
        return self._estimated(data, hashes, len(data) if learnable and len(data) >= LEARN_MIN_BYTES else 0)

    def _estimated(self, data: bytes, hashes: bool, learn: int) -> tuple[int, list[int], int]:
        """The estimate: one multiply (ceil(n / 4) exactly while uncalibrated)."""
        return math.ceil(len(data) * self.tokens_per_byte), self._block_hashes(data, hashes), learn


# Parts whose rendering is the text the engine reads; any other (an image, audio, a file) stands in a guess.
_TEXT_PARTS = frozenset(("text", "input_text", "output_text", "thinking", "redacted_thinking", "tool_use"))


def _text_only(content: object) -> bool:
    """Is this message content text alone (no image, audio or file part, at any depth of tool results)?"""
    if content is None or isinstance(content, str):
        return True
    for part in content if isinstance(content, list) else (content,):
        if isinstance(part, dict):
            kind = part.get("type")
            if kind == "tool_result":
                if not _text_only(part.get("content")):
                    return False
            elif kind not in _TEXT_PARTS:
                return False
    return True


_PLAIN_CONTENT = frozenset((str, type(None)))


def _learn_bytes(length: int, learnable: bool, messages: list, system: object) -> int:
    """A chat prompt's rendered length when its engine count may calibrate the meter, else 0 (too short, the
    request's own template, a part that is not text). Looks at the parts only of prompts long enough to teach."""
    if length < LEARN_MIN_BYTES or not learnable or not _text_only(system):
        return 0
    # Most long prompts' messages are strings: one pass in C says so (30 µs for 588 messages, a third of a loop's).
    if not set(map(type, map(dict.get, messages, repeat("content")))) <= _PLAIN_CONTENT and not all(
        _text_only(m.get("content")) for m in messages
    ):
        return 0
    return length


def _template_as_ours(body: dict) -> bool:
    """The engine renders this chat with the model's template (no `chat_template` of the request's own)."""
    return body.get("chat_template") is None


def engine_prompt(usage: object) -> int:
    """The prompt's tokens as an engine counted them, cached ones included, from its OpenAI (`prompt_tokens`),
    Responses (`input_tokens` with its details) or Anthropic usage (`input_tokens` plus the cache reads and
    writes it leaves out); -1 when absent. What `calibrate` is told."""
    if not isinstance(usage, dict):
        return -1
    prompt = usage.get("prompt_tokens")
    if isinstance(prompt, int):
        return prompt
    prompt = usage.get("input_tokens")
    if not isinstance(prompt, int):
        return -1
    if isinstance(usage.get("input_tokens_details"), dict):  # a Responses usage: input_tokens is the whole prompt
        return prompt
    for key in ("cache_read_input_tokens", "cache_creation_input_tokens"):
        extra = usage.get(key)
        if isinstance(extra, int) and extra > 0:
            prompt += extra
    return prompt


def engine_cached(usage: object) -> int:
    """The prompt tokens an engine's cache held, from its OpenAI (`prompt_tokens_details`), Responses
    (`input_tokens_details`) or Anthropic usage (`cache_read_input_tokens`); -1 when absent."""
    if not isinstance(usage, dict):
        return -1
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else usage.get("cache_read_input_tokens")
    return cached if isinstance(cached, int) and cached >= 0 else -1


def engine_uncached(usage: object) -> int:
    """The prompt tokens an engine computed (prompt minus cached), from its OpenAI, Responses or Anthropic usage; -1 when
    absent. vLLM's Anthropic `input_tokens` is the prompt less the tokens its cache held and those it wrote to
    the cache (`cache_creation_input_tokens`), which it computed too."""
    if not isinstance(usage, dict):
        return -1
    prompt = usage.get("prompt_tokens")
    if not isinstance(prompt, int) and isinstance(usage.get("input_tokens_details"), dict):  # a Responses usage
        prompt, usage = usage.get("input_tokens"), {"prompt_tokens_details": usage["input_tokens_details"]}
        if not isinstance(prompt, int):
            return -1
    if not isinstance(prompt, int):
        uncached, created = usage.get("input_tokens"), usage.get("cache_creation_input_tokens")
        if not isinstance(uncached, int):
            return -1
        return uncached + (created if isinstance(created, int) and created > 0 else 0)
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else 0
    return prompt - cached if isinstance(cached, int) and 0 <= cached <= prompt else prompt
