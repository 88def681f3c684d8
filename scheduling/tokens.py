"""Prompt token counts and prefix block hashes for scheduling.

Two ways to count, chosen per model:

* **exact**: `models[].tokenizer_path` names a Hugging Face `tokenizer.json` (or the directory holding
  it) and the optional `tokenizers` package is installed. The prompt is rendered with the model's chat
  template (`chat_template` of the `tokenizer_config.json` beside it, or `chat_template.jinja`), through
  jinja2 with the helpers transformers gives templates, with the generation prompt added, and encoded
  without added special tokens, which is what vLLM does for chat. Completions prompts are encoded with
  special tokens, as vLLM does. A prompt over EXACT_MAX_BYTES (4 KiB) is estimated at the tokens per byte
  the exact counts found: encoding holds the event loop about 1 ms per KiB.
* **estimate** (no tokenizer, or it cannot be loaded): the prompt is rendered with a ChatML template
  (tools as a leading system block, the system prompt, every message, the opened assistant turn: the
  layout of Qwen-style templates and of engine_sim) and counted as one token per 4 UTF-8 bytes, which
  tracks BPE tokenizers on English text within about 25 %. An image counts 64 tokens.

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
import logging
import math
import os
import zlib
from array import array
from bisect import bisect_right

log = logging.getLogger("coordinator.tokens")

BYTES_PER_TOKEN = 4
# tokenizers' encode holds the GIL, so it runs on the event loop whatever thread calls it: about 1 ms per KiB
# for the e2e model's byte-level BPE on these CPUs (a 1 MiB prompt held the loop a second). A prompt longer than
# this is estimated instead, at the tokens per byte that the meter's exact counts of shorter prompts found
# (weighted LEARN_WEIGHT each, from prompts of LEARN_MIN_BYTES up), so the loop is held about 4 ms at most.
EXACT_MAX_BYTES = 4096
LEARN_MIN_BYTES = 256
LEARN_WEIGHT = 0.1
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


def blocks_covered(held: int) -> int:
    """The blocks of prompt covered by its first `held` hashes."""
    return BOUNDARIES[held - 1] if held > 0 else 0


def hashes_covering(blocks: int) -> int:
    """How many of a prompt's hashes cover exactly its first `blocks` blocks (a count blocks_covered made)."""
    return bisect_right(BOUNDARIES, blocks)


def _ids_bytes(ids: list[int]) -> bytes:
    return array("I", [i & 0xFFFFFFFF for i in ids]).tobytes()


# -- per-model meters --------------------------------------------------------------------------


class PromptMeter:
    """Counts a request's prompt tokens and hashes its prefix blocks the way one model's engine sees them."""

    exact = False

    def __init__(self, block_tokens: int = 16):
        self.block_tokens = block_tokens

    def measure(self, kind: str, body: dict, hashes: bool = True) -> tuple[int, list[int]]:
        """(prompt tokens, chained block hashes; empty unless `hashes`)."""
        if kind == COMPLETION:
            prompt = body.get("prompt")
            ids = _token_list(prompt)
            if ids is not None:
                return len(ids), chained_hashes(_ids_bytes(ids), self.block_tokens * 4) if hashes else []
            return self._text(completion_text(prompt), hashes, special=True)
        messages, tools, system = _chat_parts(kind, body)
        return self._chat(messages, tools, system, hashes)

    def _chat(self, messages: list, tools: object, system: object, hashes: bool) -> tuple[int, list[int]]:
        return self._text(render_chatml(messages, tools, system), hashes, special=False)

    def _block_hashes(self, data: bytes, hashes: bool) -> list[int]:
        """The prefix hashes of a prompt's text (its ChatML rendering, a completion's text); [] unless `hashes`."""
        return chained_hashes(data, self.block_tokens * BYTES_PER_TOKEN) if hashes else []

    def _text(self, text: str, hashes: bool, special: bool) -> tuple[int, list[int]]:
        data = text.encode("utf-8", "ignore")
        tokens = (len(data) + BYTES_PER_TOKEN - 1) // BYTES_PER_TOKEN
        return tokens, self._block_hashes(data, hashes)


class TokenizerMeter(PromptMeter):
    """Exact counts from a local tokenizer.json and the model's chat template, up to EXACT_MAX_BYTES of prompt;
    longer prompts at the tokens per byte the exact counts found (`tokens_per_byte`)."""

    exact = True

    def __init__(self, path: str, block_tokens: int = 16):
        super().__init__(block_tokens)
        from tokenizers import Tokenizer  # optional dependency: only models with a tokenizer_path need it

        file = path if os.path.isfile(path) else os.path.join(path, "tokenizer.json")
        self.tokenizer = Tokenizer.from_file(file)
        folder = os.path.dirname(os.path.abspath(file))
        config = _read_json(os.path.join(folder, "tokenizer_config.json"))
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: use "default"
            source = next(
                (t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None
            )
        jinja_file = os.path.join(folder, "chat_template.jinja")
        if not source and os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                source = f.read()
        self.template = _compile_template(source) if isinstance(source, str) and source else None
        self.specials = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        self.tokens_per_byte = 1 / BYTES_PER_TOKEN  # until exact counts say otherwise

    def _chat(self, messages: list, tools: object, system: object, hashes: bool) -> tuple[int, list[int]]:
        chatml = render_chatml(messages, tools, system)
        data = chatml.encode("utf-8", "ignore")
        if len(data) > EXACT_MAX_BYTES:
            return self._estimated(data, hashes)
        text = chatml
        if self.template is not None:
            msgs = [{"role": "system", "content": content_text(system)}] if system else []
            for m in messages:
                msg = {**m, "content": content_text(m.get("content"))}
                msgs.append(msg)
            try:
                text = self.template.render(messages=msgs, tools=tools, add_generation_prompt=True, **self.specials)
            except Exception as e:  # a template that rejects this conversation: count it the generic way
                log.debug("chat template failed (%s); counting the ChatML rendering", e)
        return self._counted(data, self.tokenizer.encode(text, add_special_tokens=False).ids, hashes)

    def _text(self, text: str, hashes: bool, special: bool) -> tuple[int, list[int]]:
        data = text.encode("utf-8", "ignore")
        if len(data) > EXACT_MAX_BYTES:
            return self._estimated(data, hashes)
        return self._counted(data, self.tokenizer.encode(text, add_special_tokens=special).ids, hashes)

    def _counted(self, data: bytes, ids: list[int], hashes: bool) -> tuple[int, list[int]]:
        """An exact count, which teaches the estimate of longer prompts their tokens per byte."""
        if len(data) >= LEARN_MIN_BYTES:
            self.tokens_per_byte += LEARN_WEIGHT * (len(ids) / len(data) - self.tokens_per_byte)
        return len(ids), self._block_hashes(data, hashes)

    def _estimated(self, data: bytes, hashes: bool) -> tuple[int, list[int]]:
        tokens = math.ceil(len(data) * self.tokens_per_byte)
        return tokens, self._block_hashes(data, hashes)


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _token_text(value: object) -> str:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older tokenizer_config files
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _compile_template(source: str):
    """A chat template compiled the way transformers does (sandboxed, trimmed blocks, its helpers)."""
    from datetime import datetime

    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def make_meter(tokenizer_path: str, block_tokens: int = 16) -> PromptMeter:
    """The exact meter when the tokenizer loads, else the estimate (with one warning saying why)."""
    if tokenizer_path:
        try:
            return TokenizerMeter(tokenizer_path, block_tokens)
        except ImportError:
            log.warning(
                "tokenizer_path %s set but the 'tokenizers' package is not installed: estimating token counts",
                tokenizer_path,
            )
        except Exception as e:
            log.warning("tokenizer %s could not be loaded (%s): estimating token counts", tokenizer_path, e)
    return PromptMeter(block_tokens)


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
