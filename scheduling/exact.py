"""Exact prompt token ids, off the event loop: the model's chat template and tokenizer, as vLLM applies them.

A model with `models[].tokenizer_path` gets a TokenizerMeter. Every prompt of it is counted twice: at once by
the estimate (scheduling/tokens.py, one multiply), and exactly in a thread pool (`submit`), where the chat is
rendered with the model's template and encoded with `tokenizers`' `encode_batch`, which releases the GIL
(`Tokenizer.encode` holds it: a 1 MiB prompt would hold the worker's loop about a second). The request waits
for its ids at most EXACT_WAIT_S before it is planned (Scheduler.prepare); past that it is planned on the
estimate, and its encoding still finishes into the cache below, so that its conversation's next turn is exact.

**Rendering, as vLLM's chat_utils and transformers' apply_chat_template do**: the template from
`tokenizer_config.json`'s `chat_template` (a list: the one named "default") or `chat_template.jinja` beside
it, in jinja2's immutable sandbox with trimmed blocks, loop controls and transformers' helpers (`tojson`,
`raise_exception`, `strftime_now`), given `messages`, `tools`, `add_generation_prompt=True` and the special
tokens. A message's content is handed over as vLLM detects the template wants it: a list of text parts when
the template loops over `message['content']` ("openai" format), else its text parts joined with newlines
("string" format). An Anthropic request's `system` becomes a leading system message and its tools OpenAI
function tools, as vLLM's Messages route maps them; a tool call's JSON `arguments` is parsed for the
template, as vLLM does. Encoded without added special tokens (the template holds them); completions with them.
A prompt with a part that is not text (an image, audio, a file) is not rendered: the engine expands it to
tokens the Coordinator cannot know.

**Not from scratch on each turn.** The rendered text is cut before each special token the tokenizer
extracts whole (`<|im_start|>`, ...): the tokenizer encodes the text between such tokens on its own, so the
ids of the whole are the ids of the pieces end to end (checked on a probe conversation when the meter is
made; where it does not hold, prompts are encoded whole and nothing is cached). Each piece's ids are kept
in a bounded LRU cache keyed by the piece's text hash and length, so turn N+1 of a conversation encodes only
the messages turn N did not have. Ids are kept as 4-byte little-endian integers, the form the KV index's
keys hash (scheduling/kv_index.py): the prompt's key bytes are the pieces' bytes joined, with no Python
integers on the way.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import re
import threading
from collections import OrderedDict
from itertools import pairwise

from scheduling.tokens import (
    COMPLETION,
    PromptMeter,
    _chat_parts,
    _part_text,
    _text_only,
    completion_text,
    ids_bytes,
    render_chatml,
)

log = logging.getLogger("coordinator.tokens")

# How long a request waits for its ids before it is planned on the estimate. At the measured ~1 ms of CPU per
# KiB encoded (docs/kv-events.md) this covers any turn of a cached conversation and a new prompt up to about
# 200 KiB; beyond, or when other requests' long prompts fill the pool, waiting would cost more TTFT than the
# exact prediction is worth, and no tenant's long prompts can hold another's planning longer than this.
EXACT_WAIT_S = 0.25
POOL_THREADS = 2  # encode_batch spreads a batch over tokenizers' own threads; two keep a long prompt from blocking
MAX_PENDING_BYTES = 32 << 20  # prompt text queued for encoding per process; past it, prompts keep the estimate
CACHE_BYTES = 64 << 20  # ids kept per meter (4 bytes a token: 16 M tokens)

_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(POOL_THREADS, thread_name_prefix="tokenize")
        return _pool


class IdsCache:
    """Ids of rendered pieces by (hash, length) of their text, least recently used dropped past `limit` bytes."""

    def __init__(self, limit: int = CACHE_BYTES):
        self.limit, self.size = limit, 0
        self.entries: OrderedDict[tuple[int, int], bytes] = OrderedDict()
        self.lock = threading.Lock()
        self.hits = self.misses = 0  # pieces (bench/exact_tokens.py reads them)

    def get(self, key: tuple[int, int]) -> bytes | None:
        with self.lock:
            data = self.entries.get(key)
            if data is not None:
                self.entries.move_to_end(key)
            return data

    def put(self, key: tuple[int, int], data: bytes) -> None:
        if len(data) > self.limit:
            return
        with self.lock:
            old = self.entries.pop(key, None)
            if old is not None:
                self.size -= len(old)
            self.entries[key] = data
            self.size += len(data)
            while self.size > self.limit:
                self.size -= len(self.entries.popitem(last=False)[1])


class TokenizerMeter(PromptMeter):
    """The estimate at once (PromptMeter), and the exact ids from a local tokenizer.json and the model's chat
    template in the pool (`submit`); exact counts calibrate the estimate."""

    exact = True

    def __init__(self, path: str, block_tokens: int = 16):
        super().__init__(block_tokens)
        from tokenizers import Tokenizer  # optional dependency: only models with a tokenizer_path need it

        file = path if os.path.isfile(path) else os.path.join(path, "tokenizer.json")
        self.tokenizer = Tokenizer.from_file(file)
        self._encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)  # no offsets
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
        # vLLM's content-format detection: a template that iterates over a message's content takes parts
        self.parts_format = isinstance(source, str) and bool(_LOOPS_OVER_CONTENT.search(source))
        self.specials = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        self.cache = IdsCache()
        self.pending_bytes = 0
        self._pending_lock = threading.Lock()
        self.cut = _cut_tokens(self.tokenizer)
        if self.cut is not None and not self._cuts_are_exact():
            log.info("tokenizer %s: pieces between special tokens do not encode alone; encoding prompts whole", path)
            self.cut = None

    # -- on the loop -----------------------------------------------------------------------------------

    def submit(self, kind: str, body: dict) -> concurrent.futures.Future | None:
        """Start encoding the prompt in the pool; its result is the ids as 4-byte integers. None: it will not be
        known exactly (a part that is not text, the request's own template, too much already queued)."""
        if kind == COMPLETION:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):  # token ids are count_ids'; lists of prompts are several prompts
                return None
            return self._start(len(prompt), self._encode_completion, prompt)
        if body.get("chat_template") is not None:
            return None
        messages, tools, system = _chat_parts(kind, body)
        if not _text_only(system) or not all(_text_only(m.get("content")) for m in messages):
            return None
        size = sum(len(m["content"]) if isinstance(m.get("content"), str) else 64 for m in messages)
        # The list is copied so that the request's own later changes do not reach the thread.
        return self._start(size, self._encode_chat, list(messages), tools, system)

    def _start(self, size: int, fn, *args) -> concurrent.futures.Future | None:
        with self._pending_lock:
            if self.pending_bytes + size > MAX_PENDING_BYTES:
                return None
            self.pending_bytes += size
        future = _executor().submit(fn, *args)
        future.add_done_callback(lambda _: self._release(size))
        return future

    def _release(self, size: int) -> None:
        with self._pending_lock:
            self.pending_bytes -= size

    async def wait(self, future: concurrent.futures.Future) -> bytes | None:
        """The ids if they are in within EXACT_WAIT_S, else None (a queued encoding is then called off; a running
        one finishes into the cache)."""
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), EXACT_WAIT_S)
        except TimeoutError:
            return None
        except Exception as e:  # a tokenizer that fails on this text: the estimate stands
            log.debug("exact tokenizing failed (%s): the estimate stands", e)
            return None

    # -- in the pool -----------------------------------------------------------------------------------

    def render(self, messages: list, tools: object, system: object) -> str:
        """The chat as the engine renders it (the ChatML layout when the model has no template)."""
        msgs = [{"role": "system", "content": _flat(system)}] if system else []
        msgs += [self._message(m) for m in messages]
        if tools:
            tools = [_openai_tool(t) for t in tools if isinstance(t, dict)]
        if self.template is None:
            return render_chatml(messages, tools, system)
        try:
            return self.template.render(messages=msgs, tools=tools, add_generation_prompt=True, **self.specials)
        except Exception as e:  # a template that rejects this conversation: count it the generic way
            log.debug("chat template failed (%s); counting the ChatML rendering", e)
            return render_chatml(messages, tools, system)

    def _message(self, m: dict) -> dict:
        m, content = dict(m), m.get("content")
        if self.parts_format:
            texts = [content] if isinstance(content, str) else _texts(content)
            m["content"] = [{"type": "text", "text": t} for t in texts]
        else:
            m["content"] = _flat(content)
        calls = m.get("tool_calls")
        if isinstance(calls, list):  # vLLM hands templates the arguments parsed
            m["tool_calls"] = [_parsed_call(c) for c in calls]
        return m

    def _encode_chat(self, messages: list, tools: object, system: object) -> bytes:
        return self.encode_text(self.render(messages, tools, system))

    def encode_text(self, text: str) -> bytes:
        """A rendered chat's ids, its pieces from the cache where they are there."""
        if self.cut is None:
            return ids_bytes(self._encode([text], add_special_tokens=False)[0].ids)
        starts = _cuts(text, self.cut)
        if not starts or starts[0] != 0:
            starts.insert(0, 0)
        starts.append(len(text))
        pieces = [text[a:b] for a, b in pairwise(starts)]
        keys = [(hash(p), len(p)) for p in pieces]
        cache, found, missing = self.cache, [], {}
        for key, piece in zip(keys, pieces):
            data = cache.get(key)
            found.append(data)
            if data is None:
                missing.setdefault(key, piece)
        cache.hits += len(pieces) - len(missing)
        cache.misses += len(missing)
        if missing:
            encoded = self._encode(list(missing.values()), add_special_tokens=False)
            new = {key: ids_bytes(e.ids) for key, e in zip(missing, encoded)}
            for key, data in new.items():
                cache.put(key, data)
            found = [data if data is not None else new[key] for key, data in zip(keys, found)]
        return b"".join(found)

    def _encode_completion(self, prompt: str) -> bytes:
        return ids_bytes(self._encode([completion_text(prompt)], add_special_tokens=True)[0].ids)

    def _cuts_are_exact(self) -> bool:
        probe = self.render(
            [
                {"role": "user", "content": "Hello,  world!\n\n  indented\tline é 中文 <b>x</b>"},
                {"role": "assistant", "content": " leading space and trailing \n"},
                {"role": "user", "content": "\n"},
            ],
            None,
            "You are a helpful assistant.",
        )
        whole = ids_bytes(self._encode([probe], add_special_tokens=False)[0].ids)
        cached = self.cache
        self.cache = IdsCache()
        try:
            return self.encode_text(probe) == whole
        finally:
            self.cache = cached


def _cuts(text: str, tokens: tuple[str, ...]) -> list[int]:
    """Where the special tokens (longest first) start in `text`, as a scan from the left taking the longest token
    at each point finds them. The scan looks for their first characters with str.find, a memchr (a regex
    alternation, or a find of each whole token, held the GIL about 8 ms per MiB); Python works per occurrence."""
    starts, covered = [], 0
    for first in {t[0] for t in tokens}:
        candidates = [t for t in tokens if t[0] == first]
        i = text.find(first)
        while i >= 0:
            token = next((t for t in candidates if text.startswith(t, i)), None)
            if token is not None:
                starts.append((i, len(token)))
            i = text.find(first, i + 1)
    out = []
    for i, length in sorted(starts):
        if i >= covered:  # not inside a token already found
            out.append(i)
            covered = i + length
    return out


_LOOPS_OVER_CONTENT = re.compile(r"\{%-?\s*for\s+\w+\s+in\s+\w+(\[['\"]content['\"]\]|\.content)\s*-?%\}")


def _cut_tokens(tokenizer) -> tuple[str, ...] | None:
    """Where a rendered chat may be cut: before a special token the tokenizer splits out before normalizing
    (no strip or single-word rule reaching across the cut)."""
    try:
        added = json.loads(tokenizer.to_str()).get("added_tokens") or []
    except (ValueError, AttributeError):
        return None
    safe = [
        a["content"]
        for a in added
        if a.get("special")
        and a.get("content")
        and not (a.get("lstrip") or a.get("rstrip") or a.get("single_word") or a.get("normalized"))
    ]
    return tuple(sorted(safe, key=len, reverse=True)) or None


def _texts(content: object) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    return [_part_text(p) for p in (content if isinstance(content, list) else [content])]


def _flat(content: object) -> str:
    """vLLM's "string" content format: text parts joined by newlines."""
    return content if isinstance(content, str) else "\n".join(_texts(content))


def _openai_tool(tool: dict) -> dict:
    """A tool as vLLM hands it to the template: an OpenAI function tool (an Anthropic tool's `input_schema` and a
    Responses function tool's flat fields moved under `function`, as vLLM's Messages and Responses routes do)."""
    if "function" in tool:
        return tool
    schema = tool.get("parameters", tool.get("input_schema"))
    fn = {"name": tool.get("name"), "description": tool.get("description"), "parameters": schema}
    return {"type": "function", "function": fn}


def _parsed_call(call: object) -> object:
    if isinstance(call, dict) and isinstance(call.get("function"), dict):
        args = call["function"].get("arguments")
        if isinstance(args, str):
            try:
                return {**call, "function": {**call["function"], "arguments": json.loads(args)}}
            except ValueError:
                pass
    return call


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
