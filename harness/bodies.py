"""Request bodies the tests and benchmarks send, and the reader of the SSE streams that come back."""

from __future__ import annotations

from engine_sim import tokens

# The benchmarks' prompt vocabulary: the simulator's first 66 words (the list they were written with; the
# simulator's has grown since, and a longer list would change the prompts they replay).
WORDS = tokens.WORDS[:66]


def chat_body(
    model: str, stream: bool = False, max_tokens: int = 8, content: str = "hi", *, usage: bool = False, **extra
) -> dict:
    """A chat completions body with one user message; `extra` adds fields. `stream` asks for SSE, and `usage`
    then for the usage chunk before [DONE] (stream_options.include_usage)."""
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **extra}
    if stream:
        body["stream"] = True
        if usage:
            body["stream_options"] = {"include_usage": True}
    return body


def sse_events(raw: bytes | str) -> list[str]:
    """The data payloads of an SSE body, in order."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    return [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
