"""/v1/completions: OpenAI's completions family (a prompt as text, tokens or embeddings)."""

from __future__ import annotations

from scheduling.tokens import COMPLETION as COMPLETION_PROMPT
from serving.families.base import Family
from serving.protocol import Request
from serving.protocol.openai import CompletionBody, CompletionRequest


class Completions(Family):
    route = "/v1/completions"
    request_model, engine_model = CompletionRequest, CompletionBody
    prompt_kind = COMPLETION_PROMPT
    trigger = True
    stream_framing = 1  # `[DONE]` (a usage chunk, when asked for, adds one)
    last_event = b"data: [DONE]"
    continuable = True

    def decode_computes_prompt(self, request: Request) -> bool:
        r = request
        if super().decode_computes_prompt(r) or (r.echo is True and r.logprobs is not None):
            return True
        if r.echo_only:  # a prompt alone: nothing to decode after it, no KV to move
            return True
        prompt, embeds = r.prompt, r.prompt_embeds
        if isinstance(prompt, list) and len(prompt) > 1 and not all(isinstance(x, int) for x in prompt):
            return True  # a list of strings or of token lists (one list of ints is one prompt)
        return isinstance(embeds, list) and len(embeds) > 1

    def one_prompt(self, b: dict) -> bool:
        prompt = b.get("prompt")
        if isinstance(prompt, str):
            return True
        if isinstance(prompt, list) and prompt and all(isinstance(x, int) for x in prompt):
            return True
        return isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list))

    def output_limit(self, b: dict) -> int | None:
        return b.get("max_tokens", 16)  # vLLM's completions default

    def continued(self, cont, text: str, finish: str | None, choice: dict, ids: list, usage: object, tail: dict):
        ch = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        ch["stop_reason"] = choice.get("stop_reason")
        ch["prompt_token_ids"] = None
        ch["token_ids"] = ids if cont.client_ids else None
        return [cont.chunk(ch, usage, tail)]


COMPLETIONS = Completions()
