"""OpenAI's chat completions and completions bodies, as the Coordinator reads them.

`ChatCompletionBody` and `CompletionBody` hold what routing and prompt counting read, and what the spec
marks required; they are all a metaserver call's body (an engine's rewrite of a client body) is checked
for. A client's request (`ChatCompletionRequest`, `CompletionRequest`) adds the fields a PD request's
prefill leg leaves out (serving/legs.py), checked as vLLM checks them: otherwise only the decode engine
would refuse them, after P computed the prompt and while it holds the KV.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired

from pydantic import ConfigDict, Field, InstanceOf, StrictInt, ValidationInfo, field_validator
from pydantic_core import PydanticKnownError
from typing_extensions import TypedDict

from serving.protocol import (
    OPEN_SHAPE,
    Body,
    MaxTokens,
    Refusal,
    Request,
    Role,
    Stream,
    Tools,
    messages,
    passed,
    read,
    refuse,
)

DEFAULT_MAX_TOKENS = 256  # the output budget of a request that sets none

Content = Annotated[str | InstanceOf[list] | None, Field(description="a string or a list of content parts")]


class ChatTurn(TypedDict):
    """A message: which roles exist is the engine's to judge (vLLM takes any role string, custom roles such
    as Llama's `ipython` too); null content is the engine's to judge. Other keys (name, tool_calls, ...) pass."""

    __pydantic_config__ = OPEN_SHAPE
    role: Annotated[Role, Field(description="system, developer, user, assistant, tool or a template's own role")]
    content: Annotated[Content, Refusal("{param} must be a string or a list of parts", missing="{param} is required")]


class AssistantTurn(TypedDict):
    """An assistant turn may omit its content (tool or function calls only)."""

    __pydantic_config__ = OPEN_SHAPE
    role: Literal["assistant"]
    content: NotRequired[Annotated[Content, Refusal("{param} must be a string or a list of parts")]]


# A message with its content, else an assistant's without: no Python runs per message.
ChatMessage = Annotated[ChatTurn | AssistantTurn, Field(union_mode="left_to_right")]


class _Sampling(Request):
    """What both routes read the same way."""

    stream: Stream = False
    temperature: passed(float | None) = None
    top_p: passed(float | None) = None
    seed: passed(int | None) = None

    @property
    def max_output(self) -> int:
        """The output budget the request takes in the ledger: the cap it set (`cap`, of the route's body)."""
        cap = self.cap(self.__dict__)
        return DEFAULT_MAX_TOKENS if cap is None else cap


class ChatCompletionBody(_Sampling):
    """A chat completion; any other field (response_format, top_k, ...) is passed to the engine unchanged."""

    messages: messages(ChatMessage)
    tools: Tools = None
    max_completion_tokens: MaxTokens = None
    max_tokens: Annotated[MaxTokens, Field(description="read when max_completion_tokens is not set")] = None
    echo: read(bool) = None
    top_logprobs: passed(int | None, "with echo, the prompt's logprobs (0 unless null)") = 0

    @field_validator("max_tokens", mode="wrap")
    @classmethod
    def _shadowed(cls, value: Any, handler, info: ValidationInfo) -> int | None:
        # The first one set is the cap; the other is not read, so not judged.
        return None if info.data.get("max_completion_tokens") is not None else handler(value)

    @staticmethod
    def cap(fields: dict) -> int | None:
        """The output cap the client set, from the fields validated so far (None: none set)."""
        first = fields.get("max_completion_tokens")
        return first if first is not None else fields.get("max_tokens")


class CompletionBody(_Sampling):
    """A text completion; any other field is passed to the engine unchanged."""

    # The spec says what `_prompt_or_embeds` checks: one of the two is required.
    model_config = ConfigDict(json_schema_extra={"anyOf": [{"required": ["prompt"]}, {"required": ["prompt_embeds"]}]})

    echo: read(bool) = None
    logprobs: passed(int | None, "with echo, the prompt's logprobs") = None
    prompt_embeds: passed(str | list[str] | None, "vLLM takes them in place of prompt when it enables them") = None
    prompt: Annotated[
        str | Annotated[InstanceOf[list], Field(min_length=1)] | None,
        Field(description="a string, a list of strings, a list of token ids or a list of token-id lists"),
        Refusal("'prompt' must be a string, a list of strings or a list of token ids"),
    ] = Field(None, validate_default=True)
    max_tokens: Annotated[
        int | None,
        Field(ge=0, description="at least 1, or 0 with echo (prompt scoring)"),
        Refusal("'max_tokens' must be a positive integer"),
    ] = None

    @field_validator("prompt")
    @classmethod
    def _prompt_or_embeds(cls, prompt: Any, info: ValidationInfo) -> Any:
        if prompt is None and info.data.get("prompt_embeds") is None:
            raise refuse("'prompt' is required", param="prompt")
        return prompt

    @field_validator("max_tokens")
    @classmethod
    def _positive_unless_echo(cls, n: int | None, info: ValidationInfo) -> int | None:
        if n == 0 and info.data.get("echo") is not True:
            raise PydanticKnownError("greater_than_equal", {"ge": 1})  # (the field's Refusal says it)
        return n

    @property
    def echo_only(self) -> bool:
        """`echo` with `max_tokens` 0 scores the prompt (lm-eval, HELM): vLLM runs it with max_tokens 1 and
        answers the prompt alone."""
        return self.echo is True and self.max_tokens == 0

    @staticmethod
    def cap(fields: dict) -> int | None:
        """The output cap the client set, from the fields validated so far (None: none set)."""
        if fields.get("echo") is True and fields.get("max_tokens") == 0:
            return 1  # (see echo_only)
        return fields.get("max_tokens")


class _LegChecked(Body):
    """The fields a prefill leg leaves out (serving/legs.py), added to a body's own to check a client's request.

    A request class names it first (`class R(_LegChecked, ChatCompletionBody)`): pydantic then orders its
    fields after the body's, the order the checks run and report in."""

    stream_options: Annotated[
        dict[str, Any] | None,
        Field(description="include_usage, continuous_usage_stats; only with stream: true"),
        Refusal("'stream_options' must be an object"),
    ] = None
    stop: Annotated[str | list[str] | None, Refusal("'stop' must be a string or a list of strings")] = None
    stop_token_ids: Annotated[list[StrictInt] | None, Refusal("'stop_token_ids' must be a list of integers")] = None
    min_tokens: Annotated[int, Field(ge=0), Refusal("'min_tokens' must be an integer >= 0")] = 0

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, options: dict | None, info: ValidationInfo) -> dict | None:
        if options and not info.data.get("stream"):  # vLLM refuses only non-empty ones
            raise refuse("Stream options can only be defined when `stream=True`.", param="stream_options")
        return options

    @field_validator("min_tokens")
    @classmethod
    def _not_over_max(cls, low: int, info: ValidationInfo) -> int:
        high = cls.cap(info.data)
        if high is not None and low > high:
            raise refuse(f"min_tokens must be less than or equal to max_tokens={high}, got {low}.", param="min_tokens")
        return low


class ChatCompletionRequest(_LegChecked, ChatCompletionBody):
    """A client's chat completion; any other field (response_format, top_k, ...) is passed to the engine unchanged."""


class CompletionRequest(_LegChecked, CompletionBody):
    """A client's text completion; any other field is passed to the engine unchanged."""


# -- the hot path's reader ---------------------------------------------------------------------------------
# pydantic's check of a tiny chat body costs about 40 k instructions (bench/protocol.py), 8 % of the whole
# request's 500 k: over the 5 % a body check may take on the hot path. Most chat bodies are plain (a model,
# a short list of role/content strings, stream, a token cap), and `read_plain_chat` reads those with a few
# exact-type tests; anything else, and every refusal, goes to `ChatCompletionRequest`. tests/test_protocol.py
# checks, on a table of bodies, that whatever this reader takes the model takes too and reads the same.

_PLAIN_MESSAGES = 32  # a longer conversation costs pydantic's compiled loop less than a Python one
_JUDGED_BY_MODEL_ONLY = frozenset(ChatCompletionRequest.model_fields) - {
    "model",
    "messages",
    "stream",
    "max_tokens",
    "max_completion_tokens",
    "stream_options",
    "n",
    "tools",
    # passed to the engine as they are (`passed`): the model reads any value
    "temperature",
    "top_p",
    "seed",
    "prompt_logprobs",
    "top_logprobs",
}


class PlainChat:
    """A plain chat body as `ChatCompletionRequest` reads it: the attributes serving/job.py uses."""

    __slots__ = ("max_output", "model", "n", "prompt_logprobs", "stream", "top_logprobs")
    echo = None
    best_of = None

    def __init__(self, model: str, stream: bool | None, max_output: int, n: int | None, body: dict):
        self.model, self.stream, self.max_output, self.n = model, stream, max_output, n
        self.prompt_logprobs = body.get("prompt_logprobs")
        self.top_logprobs = body.get("top_logprobs", 0)

    @property
    def children(self) -> int:
        return 1 if self.n is None else self.n


def _plain_cap(value: Any) -> bool:
    return value is None or (type(value) is int and value >= 1)


def read_plain_chat(body: dict) -> PlainChat | None:
    """The body read without pydantic when it is plain, else None (then the model reads it)."""
    if not body.keys().isdisjoint(_JUDGED_BY_MODEL_ONLY):
        return None
    model, messages, stream = body.get("model"), body.get("messages"), body.get("stream", False)
    if type(model) is not str or not model or type(messages) is not list or not messages:
        return None
    if len(messages) > _PLAIN_MESSAGES or (stream is not None and type(stream) is not bool):
        return None
    for message in messages:
        if type(message) is not dict:
            return None
        role = message.get("role")
        if type(role) is not str or not role or type(message.get("content")) is not str:
            return None
    cap = body.get("max_completion_tokens")
    if not _plain_cap(cap):
        return None
    if cap is None:
        cap = body.get("max_tokens")
        if not _plain_cap(cap):
            return None
    options, n, tools = body.get("stream_options"), body.get("n"), body.get("tools")
    if options is not None and (type(options) is not dict or (options and stream is not True)):
        return None
    if (n is not None and type(n) is not int) or (tools is not None and type(tools) is not list):
        return None
    return PlainChat(model, stream, DEFAULT_MAX_TOKENS if cap is None else cap, n, body)
