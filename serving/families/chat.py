"""/v1/chat/completions: OpenAI's chat family."""

from __future__ import annotations

from scheduling.tokens import CHAT as CHAT_PROMPT
from serving.families.base import Family
from serving.protocol import Request
from serving.protocol.openai import ChatCompletionBody, ChatCompletionRequest, read_plain_chat


class Chat(Family):
    route = "/v1/chat/completions"
    request_model, engine_model = ChatCompletionRequest, ChatCompletionBody
    prompt_kind = CHAT_PROMPT
    trigger = True
    # Its role chunk and `[DONE]` carry no token (a usage chunk, when asked for, adds one: RequestRecord.usage_event).
    stream_framing = 2
    last_event = b"data: [DONE]"
    continuable = True

    def read(self, body: dict, from_engine: bool) -> Request:
        # A plain body is read by a few exact-type tests, without pydantic (serving/protocol/__init__.py).
        request = read_plain_chat(body)
        return super().read(body, from_engine) if request is None else request

    def decode_computes_prompt(self, request: Request) -> bool:
        # Chat's `echo` asks for prompt logprobs too: vLLM takes `top_logprobs` (0 unless given as null) for them.
        if super().decode_computes_prompt(request):
            return True
        return request.echo is True and request.top_logprobs is not None

    def continued(self, cont, text: str, finish: str | None, choice: dict, ids: list, usage: object, tail: dict):
        ch: dict = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
        if finish:
            ch["stop_reason"] = choice.get("stop_reason")
        ch["token_ids"] = ids if cont.client_ids else None
        return [cont.chunk(ch, usage, tail)]


CHAT = Chat()
