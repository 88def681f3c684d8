"""Deterministic token accounting shared by the engine simulator and the Coordinator.

Pure functions, no I/O, no dependencies beyond the standard library:

* ``count_text_tokens(text, bytes_per_token=4)``: the token count used everywhere in the sim:
  ``ceil(len(text.encode("utf-8")) / bytes_per_token)``, and 0 for the empty string. ``bytes_per_token`` is the
  server's tokenizer (SimConfig.bytes_per_token); prompt ids and prefix-cache blocks follow it.
* ``render_chat_prompt(messages, tools=None, system=None)``: a ChatML-like template
  (``<|im_start|>role\\ncontent<|im_end|>\\n`` per message, ``<|im_start|>assistant\\n`` last).
  ``content`` may be a string or a list of parts (OpenAI ``text``/``image_url`` parts, Anthropic
  ``text``/``image``/``tool_use``/``tool_result``/``thinking`` blocks). Each image counts as
  ``IMAGE_PLACEHOLDER`` (a fixed 256-byte marker = 64 tokens). Tools are serialised as JSON in a
  leading system block.
* ``chat_prompt_tokens(...)`` = ``count_text_tokens(render_chat_prompt(...))``.
* ``completion_prompt_tokens(prompt)``: string → estimate; list of ints → its length; list of
  strings / token lists → the sum.
* ``generate(...)``: the deterministic "model": the word sequence a request produces.
* Token ids (``return_token_ids``, token-id prompts): a prompt's text is its 4-byte chunks, each chunk's id
  the chunk's bytes behind a 0x01 marker read as one integer (256 and up: reversible, so an id prompt
  decodes to its text); a generated word's id is ``WORD_TOKEN_BASE`` plus its index in ``WORDS``; EOS is
  ``EOS_TOKEN_ID``. The "model" is autoregressive over these ids: an answer is the trailing run of word ids
  of a context, generated from the key of the text before it, so a prompt that ends with the first k
  words of an answer goes on with word k+1 (``split_answer``).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

BYTES_PER_TOKEN = 4
IMAGE_TOKENS = 64
IMAGE_PLACEHOLDER = "<|image|>" + "#" * (IMAGE_TOKENS * BYTES_PER_TOKEN - len("<|image|>"))

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "it",
    "for",
    "on",
    "with",
    "as",
    "was",
    "at",
    "by",
    "an",
    "be",
    "this",
    "from",
    "or",
    "have",
    "are",
    "not",
    "but",
    "had",
    "his",
    "they",
    "you",
    "were",
    "her",
    "she",
    "which",
    "one",
    "all",
    "their",
    "there",
    "we",
    "can",
    "has",
    "been",
    "if",
    "more",
    "when",
    "will",
    "would",
    "who",
    "so",
    "no",
    "model",
    "token",
    "engine",
    "cache",
    "prefill",
    "decode",
    "stream",
    "batch",
    "queue",
    "block",
    "latency",
    "river",
    "stone",
    "cloud",
    "light",
    "garden",
    "paper",
    "window",
    "music",
    "number",
    "table",
    "yellow",
    "quiet",
    "swift",
    "bright",
    "ocean",
    "forest",
    "mountain",
    "silver",
    "simple",
    "little",
    "market",
    "winter",
    "summer",
    "signal",
    "vector",
    "kernel",
]
_NWORDS = len(WORDS)


def count_text_tokens(text: str, bytes_per_token: int = BYTES_PER_TOKEN) -> int:
    """ceil(utf-8 bytes / bytes_per_token); at least 1 for a non-empty string, 0 for ''."""
    if not text:
        return 0
    n = len(text.encode("utf-8"))
    return (n + bytes_per_token - 1) // bytes_per_token


def _part_text(part: Any) -> str:
    if isinstance(part, str):
        return part
    if not isinstance(part, dict):
        return str(part)
    t = part.get("type")
    if t in ("text", "input_text", "output_text"):
        return str(part.get("text") or "")
    if t in ("image_url", "image", "input_image"):
        return IMAGE_PLACEHOLDER
    if t == "thinking":
        return str(part.get("thinking") or "")
    if t == "tool_use":
        return json.dumps({"name": part.get("name"), "input": part.get("input")}, sort_keys=True, ensure_ascii=False)
    if t == "tool_result":
        return content_text(part.get("content"))
    if t == "redacted_thinking":
        return ""
    if "text" in part:
        return str(part.get("text") or "")
    return json.dumps(part, sort_keys=True, ensure_ascii=False)


def content_text(content: Any) -> str:
    """Flatten message content (string, list of parts, None) to text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_part_text(p) for p in content)
    return _part_text(content)


def render_chat_prompt(messages: Sequence[dict], tools: Sequence[Any] | None = None, system: Any = None) -> str:
    """ChatML-like rendering of a conversation, ending with the generation prompt."""
    out = []
    if tools:
        out.append(
            "<|im_start|>system\n# Tools\n"
            + json.dumps(list(tools), sort_keys=True, ensure_ascii=False)
            + "<|im_end|>\n"
        )
    if system:
        out.append("<|im_start|>system\n" + content_text(system) + "<|im_end|>\n")
    for m in messages or ():
        if not isinstance(m, dict):
            continue
        role = str(m.get("role") or "user")
        body = content_text(m.get("content"))
        tc = m.get("tool_calls")
        if tc:
            body += json.dumps(tc, sort_keys=True, ensure_ascii=False)
        out.append("<|im_start|>" + role + "\n" + body + "<|im_end|>\n")
    out.append("<|im_start|>assistant\n")
    return "".join(out)


def chat_prompt_tokens(messages, tools=None, system=None) -> int:
    return count_text_tokens(render_chat_prompt(messages, tools=tools, system=system))


def completion_prompt_text(prompt: Any) -> str:
    """The text the sim treats as the prompt of a /v1/completions request."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        if all(isinstance(x, int) for x in prompt):
            return decode_token_ids(prompt)
        return "\n".join(completion_prompt_text(x) for x in prompt)
    return str(prompt)


EOS_TOKEN_ID = 2
WORD_TOKEN_BASE = 100  # word ids are 100..100+len(WORDS)-1; prompt chunk ids are 256 and up
_WORD_INDEX = {w: i for i, w in enumerate(WORDS)}


def text_token_ids(text: str, bytes_per_token: int = BYTES_PER_TOKEN) -> list[int]:
    """A text's ids: one per chunk of bytes_per_token bytes of its UTF-8 (so len(ids) == count_text_tokens(text))."""
    data = text.encode("utf-8", "surrogatepass")
    return [
        int.from_bytes(b"\x01" + data[i : i + bytes_per_token], "big") for i in range(0, len(data), bytes_per_token)
    ]


def word_token_id(piece: str) -> int:
    """The id of a generated word (its piece as `generate` makes it: a space and the word)."""
    return WORD_TOKEN_BASE + _WORD_INDEX[piece[1:]]


def _token_bytes(token: int) -> bytes:
    if token == EOS_TOKEN_ID:
        return b""
    if WORD_TOKEN_BASE <= token < WORD_TOKEN_BASE + _NWORDS:
        return (" " + WORDS[token - WORD_TOKEN_BASE]).encode()
    if token >= 256:
        return token.to_bytes((token.bit_length() + 7) // 8, "big")[1:]
    return f"<|{token}|>".encode()  # an id this vocabulary has no text for: a marker, so prompts stay distinct


def decode_token_ids(ids: Sequence[int]) -> str:
    return b"".join(_token_bytes(t) for t in ids).decode("utf-8", "replace")


def split_answer(ids: Sequence[int]) -> tuple[Sequence[int], int]:
    """(the context before its trailing run of generated words, the run's length): where an answer began."""
    n = len(ids)
    while n and WORD_TOKEN_BASE <= ids[n - 1] < WORD_TOKEN_BASE + _NWORDS:
        n -= 1
    return ids[:n], len(ids) - n


def completion_prompt_tokens(prompt: Any, bytes_per_token: int = BYTES_PER_TOKEN) -> int:
    if isinstance(prompt, str):
        return count_text_tokens(prompt, bytes_per_token)
    if isinstance(prompt, list):
        if all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
            return len(prompt)
        return sum(completion_prompt_tokens(x, bytes_per_token) for x in prompt)
    return count_text_tokens(str(prompt), bytes_per_token)


# --------------------------------------------------------------------------- generation


def _h64(*parts: Any) -> int:
    d = hashlib.blake2b(repr(parts).encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return struct.unpack("<Q", d)[0]


def tool_call_id(request_id: str) -> str:
    """A tool call's id shaped like vLLM's (`chatcmpl-tool-…`), a pure function of the request id."""
    return "chatcmpl-tool-" + _h64("tool", request_id).to_bytes(8, "little").hex()


def prompt_key(text: str) -> int:
    return _h64("p", text)


def eos_length(pkey: int, seed: int | None, temperature: float | None, choice: int) -> int:
    """Where the 'model' would emit EOS: 8..64 tokens, a pure function of its inputs."""
    return 8 + _h64("eos", pkey, seed, temperature, choice) % 57


def token_word(pkey: int, seed: int | None, temperature: float | None, choice: int, i: int) -> str:
    return " " + WORDS[_h64("w", pkey, seed, temperature, choice, i) % _NWORDS]


def token_logprob(pkey: int, choice: int, i: int, rank: int = 0) -> float:
    base = -((_h64("lp", pkey, choice, i) % 1000) / 1000.0) * 1.5
    return round(base - rank * 0.75, 6)


@lru_cache(maxsize=4096)
def generate(
    pkey: int,
    seed: int | None,
    temperature: float | None,
    choice: int,
    max_tokens: int,
    ignore_eos: bool = False,
    min_tokens: int = 0,
    stop: tuple = (),
) -> tuple:
    """Deterministic output of one choice.

    Returns ``(pieces, text, finish_reason, stop_reason, ids)``: ``pieces`` is one string per
    generated token (the streamed deltas; a piece may be '' or cut short where a stop string
    truncates the text), ``text`` the final text (= ''.join(pieces)), ``ids`` each token's id (the
    last one EOS_TOKEN_ID when the answer ended on EOS).
    """
    eos = None if ignore_eos else max(eos_length(pkey, seed, temperature, choice), min_tokens, 1)
    words, ids = [], []
    finish, stop_reason = "length", None
    acc = ""
    n = max(0, int(max_tokens))
    for i in range(n):
        if eos is not None and i + 1 == eos:
            # the EOS token itself is generated but not shown
            words.append("")
            ids.append(EOS_TOKEN_ID)
            finish = "stop"
            break
        w = token_word(pkey, seed, temperature, choice, i)
        words.append(w)
        ids.append(word_token_id(w))
        acc += w
        if stop and i + 1 >= min_tokens:
            hit = None
            for s in stop:
                if s:
                    k = acc.find(s)
                    if k >= 0 and (hit is None or k < hit[0]):
                        hit = (k, s)
            if hit is not None:
                finish, stop_reason = "stop", hit[1]
                acc = acc[: hit[0]]
                break
    # cut pieces so that they concatenate to the (possibly truncated) final text
    pieces, pos = [], 0
    total = len(acc)
    for w in words:
        end = min(pos + len(w), total)
        pieces.append(acc[pos:end] if pos < total else "")
        pos += len(w)
    return tuple(pieces), acc, finish, stop_reason, tuple(ids)


def block_hashes(
    text: str, block_tokens: int = 16, bytes_per_token: int = BYTES_PER_TOKEN, salt: str | None = None
) -> list:
    """Chained hashes of full blocks of the prompt (block = block_tokens * bytes_per_token utf-8 bytes). A cache
    `salt` enters the first block's hash, as vLLM's does (its extra keys): prompts of other salts share none."""
    data = text.encode("utf-8")
    step = block_tokens * bytes_per_token
    out = []
    prev = (
        hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=12, person=b"cache_salt").digest()
        if salt
        else b""
    )
    for off in range(0, len(data) - step + 1, step):
        prev = hashlib.blake2b(prev + data[off : off + step], digest_size=12).digest()
        out.append(prev)
    return out


__all__ = [
    "WORDS",
    "block_hashes",
    "chat_prompt_tokens",
    "completion_prompt_text",
    "completion_prompt_tokens",
    "content_text",
    "count_text_tokens",
    "decode_token_ids",
    "generate",
    "prompt_key",
    "render_chat_prompt",
    "split_answer",
    "text_token_ids",
]
