"""The request bodies of vLLM's routes as pydantic models: what the simulator validates and reads.

vLLM 0.32 validates each body with a pydantic model before serving it; these models declare the fields
the simulator uses, so pydantic's lax mode reads integers and booleans as vLLM does ("7" and 7.0 are
7, "true" is True). `stream`, `temperature`, `top_p` and `seed` are strict: the simulator has always
refused "true" or "0.5" there. Fields it only passes on or reads leniently are `Any`. The OpenAI models
keep unknown fields (vLLM's OpenAIBaseModel, extra="allow"); the Anthropic ones ignore them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

ANTHROPIC_ROLES = ("user", "assistant", "system", "ctx", "msg")
TOOL_CHOICE_TYPES = ("auto", "any", "tool", "none")


def _chat_message(m: Any) -> dict:
    if not isinstance(m, dict) or "role" not in m:
        raise PydanticCustomError("model_type", "Input should be a valid message with a role")
    return m


def _anthropic_message(m: Any) -> dict:
    if not isinstance(m, dict) or m.get("role") not in ANTHROPIC_ROLES or not isinstance(m.get("content"), (str, list)):
        raise PydanticCustomError("model_type", "Input should be a valid message")
    return m


def _stream_options(v: Any) -> Any:
    if v is not None and not isinstance(v, dict):
        raise PydanticCustomError("model_type", "Input should be a valid dictionary")
    return v


def _prompt(v: Any) -> Any:
    if not isinstance(v, (str, list)) or v == []:
        raise PydanticCustomError("string_type", "Input should be a valid string or list")
    return v


def _strings(v: Any, error_type: str, message: str) -> tuple[str, ...]:
    if v is None:
        return ()
    if isinstance(v, list) and all(isinstance(x, str) for x in v):
        return tuple(v)
    raise PydanticCustomError(error_type, message)


def _stop(v: Any) -> tuple[str, ...]:
    """OpenAI's `stop`: one string or a list of them."""
    return (v,) if isinstance(v, str) else _strings(v, "string_type", "Input should be a valid string or list")


def _stop_sequences(v: Any) -> tuple[str, ...]:
    return _strings(v, "list_type", "Input should be a valid list")


def _cache_salt(v: Any) -> Any:
    """vLLM's validate_cache_salt: a non-empty string of at most 128 characters, none of '@', '/', '\\', NUL."""
    if v is None:
        return None
    if not isinstance(v, str) or not v:
        raise ValueError("Parameter 'cache_salt' must be a non-empty string if provided.")
    if len(v) > 128 or any(c in "@/\\\x00" for c in v):
        raise ValueError(
            "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\\\', or NUL."
        )
    return v


def _tool_choice(v: Any) -> Any:
    if v is None:
        return None
    if not isinstance(v, dict) or v.get("type") not in TOOL_CHOICE_TYPES:
        raise PydanticCustomError("model_type", "Input should be a valid tool choice")
    if v.get("type") == "tool" and not v.get("name"):
        raise ValueError("tool_choice.name is required when type is 'tool'")
    return v


ChatMessage = Annotated[dict, BeforeValidator(_chat_message)]
AnthropicMessage = Annotated[dict, BeforeValidator(_anthropic_message)]
StopStrings = Annotated[tuple[str, ...], BeforeValidator(_stop)]


class ThinkingEnabled(BaseModel):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1024)


class ThinkingDisabled(BaseModel):
    type: Literal["disabled"]


class ThinkingAdaptive(BaseModel):
    type: Literal["adaptive"]


Thinking = Annotated[ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive, Field(discriminator="type")]


class SamplingRequest(BaseModel):
    """The fields every generating route reads."""

    stream: StrictBool | None = False
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    seed: StrictInt | None = None
    min_tokens: int = 0
    ignore_eos: Any = False
    kv_transfer_params: Any = None
    cache_salt: Annotated[Any, BeforeValidator(_cache_salt)] = None  # enters the prompt's first block hash


class OpenAIRequest(SamplingRequest):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    stream_options: Annotated[dict | None, BeforeValidator(_stream_options)] = None
    n: int | None = 1
    echo: bool = False
    stop: StopStrings = ()
    logprobs: Any = None
    return_token_ids: bool | None = None
    priority: int = 0  # vLLM's: lower runs first under --scheduling-policy priority

    @model_validator(mode="after")
    def _stream_options_only_when_streaming(self):
        if self.stream_options and not self.stream:  # vLLM refuses only non-empty ones
            raise ValueError("Stream options can only be defined when `stream=True`.")
        return self


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage]
    tools: list | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    top_logprobs: Any = 0


class CompletionRequest(OpenAIRequest):
    prompt: Annotated[str | list, BeforeValidator(_prompt)]
    max_tokens: int | None = 16


class AnthropicMessagesRequest(SamplingRequest):
    model: str
    messages: list[AnthropicMessage]
    max_tokens: int
    system: Any = None
    tools: Any = None
    tool_choice: Annotated[dict | None, BeforeValidator(_tool_choice)] = None
    thinking: Thinking | None = None
    stop_sequences: Annotated[tuple[str, ...], BeforeValidator(_stop_sequences)] = ()

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens_positive(cls, v: int) -> int:
        if v <= 0:
            raise ValueError("max_tokens must be positive")
        return v

    @model_validator(mode="after")
    def _thinking_budget_below_max_tokens(self):
        # vLLM's validate_thinking_budget exempts prefill legs, which are sent with max_tokens 1.
        kvp = self.kv_transfer_params
        prefill_leg = isinstance(kvp, dict) and kvp.get("do_remote_decode")
        if self.thinking_budget is not None and self.thinking_budget >= self.max_tokens and not prefill_leg:
            raise ValueError("thinking.budget_tokens must be less than max_tokens")
        return self

    @property
    def thinking_budget(self) -> int | None:
        return self.thinking.budget_tokens if isinstance(self.thinking, ThinkingEnabled) else None


class AnthropicCountTokensRequest(BaseModel):
    model: str
    messages: list
    system: Any = None
    tools: Any = None


def _response_item(v: Any) -> dict:
    """An input item: a message (`role` and `content`) or another typed item (function_call, ...)."""
    if not isinstance(v, dict) or not (("role" in v and "content" in v) or isinstance(v.get("type"), str)):
        raise PydanticCustomError("model_type", "Input should be a valid input item")
    return v


ResponseItem = Annotated[dict, BeforeValidator(_response_item)]


class ResponsesRequest(SamplingRequest):
    """vLLM's ResponsesRequest: the fields the simulator reads and echoes in the response object."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[ResponseItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    store: bool | None = True
    background: bool | None = False
    request_id: str | None = None
    stop: StopStrings = ()
    tools: list = Field(default_factory=list)
    tool_choice: Any = "auto"
    metadata: dict | None = None
    parallel_tool_calls: bool | None = True
    max_tool_calls: int | None = None
    reasoning: Any = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] = "auto"
    text: Any = None
    truncation: Literal["auto", "disabled"] | None = "disabled"
    user: str | None = None
    priority: int = 0
    prompt: Any = None

    @model_validator(mode="after")
    def _no_prompt_template(self):
        if self.prompt is not None:
            raise ValueError("prompt template is not supported")
        return self


class TokenizeCompletionRequest(BaseModel):
    """vLLM's /tokenize of a prompt."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(BaseModel):
    """vLLM's /tokenize of a conversation, rendered by the chat template."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    tools: list | None = None

    @model_validator(mode="before")
    @classmethod
    def _one_ending(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("continue_final_message") and data.get("add_generation_prompt"):
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        return data


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=2**63 - 1)]]


REQUEST_MODELS: dict[str, type[BaseModel]] = {
    "chat": ChatCompletionRequest,
    "completions": CompletionRequest,
    "messages": AnthropicMessagesRequest,
    "count_tokens": AnthropicCountTokensRequest,
    "responses": ResponsesRequest,
    "tokenize": TokenizeCompletionRequest,
    "tokenize_chat": TokenizeChatRequest,
    "detokenize": DetokenizeRequest,
}
