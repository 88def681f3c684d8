"""Prompt token counts for scheduling.

Without a tokenizer the count is an estimate: one token per 4 UTF-8 bytes of the text the engine will
see (the chat template adds about 4 tokens of role markers per message), which tracks BPE tokenizers of
English text within about 25 %. Scheduling needs relative sizes, not exact counts; the engines' own
counts (usage) are what the client is billed by.
"""

from __future__ import annotations

import ujson

BYTES_PER_TOKEN = 4
TOKENS_PER_MESSAGE = 4
TOKENS_PER_IMAGE = 256


def estimate_text_tokens(text: str) -> int:
    return (len(text.encode("utf-8", "ignore")) + BYTES_PER_TOKEN - 1) // BYTES_PER_TOKEN if text else 0


def _content_tokens(content: object) -> int:
    if isinstance(content, str):
        return estimate_text_tokens(content)
    if isinstance(content, list):
        total = 0
        for part in content:
            if isinstance(part, dict):
                kind = part.get("type")
                if kind in ("image", "image_url", "input_image"):
                    total += TOKENS_PER_IMAGE
                elif isinstance(part.get("text"), str):
                    total += estimate_text_tokens(part["text"])
                else:
                    total += estimate_text_tokens(ujson.dumps(part))
            elif isinstance(part, str):
                total += estimate_text_tokens(part)
        return total
    return 0


def estimate_chat_tokens(messages: list, tools: object = None) -> int:
    total = TOKENS_PER_MESSAGE  # the assistant turn the template opens
    for m in messages:
        total += TOKENS_PER_MESSAGE + _content_tokens(m.get("content"))
        if m.get("tool_calls"):
            total += estimate_text_tokens(ujson.dumps(m["tool_calls"]))
    if tools:
        total += estimate_text_tokens(ujson.dumps(tools))
    return total


def estimate_messages_tokens(messages: list, system: object = None, tools: object = None) -> int:
    total = estimate_chat_tokens(messages, tools)
    if system:
        total += TOKENS_PER_MESSAGE + _content_tokens(system)
    return total


def estimate_prompt_tokens(prompt: object) -> int:
    if isinstance(prompt, str):
        return estimate_text_tokens(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if isinstance(prompt, list):
        return sum(estimate_prompt_tokens(p) for p in prompt)
    return 0
