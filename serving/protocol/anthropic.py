"""Anthropic's Messages and count_tokens bodies, as the Coordinator reads them.

A Messages request also holds what its prefill leg leaves out or changes (serving/legs.py), checked as
vLLM checks it: `stop_sequences` (dropped); a named tool choice (P gets "any") must name one of the tools;
an enabled thinking budget must be an integer of at least 1024 and below max_tokens (vLLM exempts prefill
legs from the second rule).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, InstanceOf, ValidationInfo, field_validator
from typing_extensions import TypedDict

from serving.protocol import OPEN_SHAPE, Refusal, Request, Role, Stream, Tools, messages, passed, read, refuse

MIN_THINKING_BUDGET = 1024


class AnthropicMessage(TypedDict):
    """`system` (which Claude Code sends inside `messages`), `user` or `assistant`: which roles exist is the
    engine's to judge. Other keys pass."""

    __pydantic_config__ = OPEN_SHAPE
    role: Annotated[Role, Field(description="user, assistant or system")]
    content: Annotated[
        str | InstanceOf[list],
        Field(description="a string or a list of content blocks"),
        Refusal("{param} must be a string or a list of parts", missing="{param} is required"),
    ]


class Thinking(TypedDict, total=False):
    """Extended thinking; its budget is checked when it is enabled."""

    __pydantic_config__ = OPEN_SHAPE
    type: passed(str, "enabled or disabled")
    budget_tokens: read(int)


class CountTokensRequest(Request):
    """Count the tokens of a Messages request; any other field is passed to the engine unchanged."""

    messages: messages(AnthropicMessage)
    tools: Tools = None
    system: passed(str | list[dict[str, Any]] | None) = None

    @property
    def max_output(self) -> int:
        return 0


class MessagesRequest(Request):
    """Anthropic Messages; any other field is passed to the engine unchanged."""

    stream: Stream = False
    max_tokens: Annotated[
        int,
        Field(ge=1),
        Refusal(
            "'max_tokens' must be a positive integer", missing="'max_tokens' is required and must be a positive integer"
        ),
    ]
    messages: messages(AnthropicMessage)
    tools: Tools = None
    system: passed(str | list[dict[str, Any]] | None) = None
    temperature: passed(float | None) = None
    stop_sequences: Annotated[list[str] | None, Refusal("'stop_sequences' must be a list of strings")] = None
    tool_choice: passed(dict[str, Any] | None, "auto, any, none, or tool with the name of one of `tools`") = None
    thinking: Annotated[read(Thinking), Field(description="budget_tokens >= 1024 and < max_tokens when enabled")] = None

    @property
    def max_output(self) -> int:
        return self.max_tokens

    @field_validator("tool_choice")
    @classmethod
    def _named_tool_is_passed(cls, choice: Any, info: ValidationInfo) -> Any:
        if isinstance(choice, dict) and choice.get("type") == "tool":
            name = choice.get("name")
            if not isinstance(name, str) or not name:
                raise refuse("tool_choice.name is required when type is 'tool'", param="tool_choice.name")
            if not any(isinstance(t, dict) and t.get("name") == name for t in info.data.get("tools") or ()):
                raise refuse(f"Tool '{name}' has not been passed in `tools`.", param="tool_choice")
        return choice

    @field_validator("thinking")
    @classmethod
    def _budget(cls, thinking: Any, info: ValidationInfo) -> Any:
        if isinstance(thinking, dict) and thinking.get("type") == "enabled":
            budget, param = thinking.get("budget_tokens"), "thinking.budget_tokens"
            if not isinstance(budget, int) or budget < MIN_THINKING_BUDGET:
                raise refuse(f"'thinking.budget_tokens' must be an integer >= {MIN_THINKING_BUDGET}", param=param)
            max_tokens = info.data.get("max_tokens")  # (absent: refused already)
            if max_tokens is not None and budget >= max_tokens:
                raise refuse("thinking.budget_tokens must be less than max_tokens", param=param)
        return thinking
