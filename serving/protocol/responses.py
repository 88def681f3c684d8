"""OpenAI's Responses body (`POST /v1/responses`), as the Coordinator reads it.

What routing reads: the model, `stream`, the output cap (`max_output_tokens`), the prompt the scheduler
counts (`input` and `instructions`), `previous_response_id` (the follow-up goes to the instance that holds
that response), `store` and the response id the Coordinator gives the engine (`request_id`, vLLM's own
field). What the prefill leg leaves out or changes (serving/legs.py) is checked as vLLM checks it, so that
the decode engine does not refuse it after P computed the prompt: `stop`, `stop_token_ids`, `background`
with `store` false, a `prompt` template. Every other field is the engine's to judge.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, InstanceOf, StrictInt, ValidationInfo, field_validator

from serving.protocol import MaxTokens, NonEmpty, Refusal, Request, Stream, Tools, passed, read, refuse
from serving.protocol.openai import DEFAULT_MAX_TOKENS

ResponseId = Annotated[str | None, *NonEmpty, Refusal("'{param}' must be a non-empty string")]


class ResponsesRequest(Request):
    """A Responses request; any other field (text, reasoning, tool_choice, ...) is passed to the engine unchanged."""

    stream: Stream = False
    input: Annotated[
        str | InstanceOf[list],
        Field(description="a string (one user message) or a list of input items: messages, function calls and outputs"),
        Refusal("'input' is required and must be a string or a list of input items"),
    ]
    instructions: passed(str | None, "a system message put before the conversation") = None
    max_output_tokens: MaxTokens = None
    previous_response_id: Annotated[
        ResponseId,
        Field(description="continue a stored response: served by the instance that holds it (see docs/responses.md)"),
    ] = None
    store: read(bool) = True
    background: read(bool) = False
    request_id: Annotated[
        ResponseId, Field(description="the response id (vLLM's field); the Coordinator sets one when absent")
    ] = None
    tools: Tools = None
    temperature: passed(float | None) = None
    top_p: passed(float | None) = None
    stop: Annotated[str | list[str] | None, Refusal("'stop' must be a string or a list of strings")] = None
    stop_token_ids: Annotated[list[StrictInt] | None, Refusal("'stop_token_ids' must be a list of integers")] = None
    prompt: passed(dict | None, "a prompt template: vLLM refuses it") = None

    @field_validator("input")
    @classmethod
    def _items_are_objects(cls, value: Any) -> Any:
        if isinstance(value, list):
            bad = next((i for i, item in enumerate(value) if not isinstance(item, dict)), None)
            if bad is not None:
                raise refuse("{param} must be an input item (an object)", at=f"[{bad}]")
        return value

    @field_validator("background")
    @classmethod
    def _background_is_stored(cls, value: Any, info: ValidationInfo) -> Any:
        if value is True and info.data.get("store") is False:
            raise refuse("background can only be used when `store` is true", param="background")
        return value

    @field_validator("prompt")
    @classmethod
    def _no_template(cls, value: Any) -> Any:
        if value is not None:
            raise refuse("prompt template is not supported", param="prompt")
        return value

    @property
    def max_output(self) -> int:
        return DEFAULT_MAX_TOKENS if self.max_output_tokens is None else self.max_output_tokens

    @property
    def stored(self) -> bool:
        """Does the engine keep this response (when it stores any: vLLM's VLLM_ENABLE_RESPONSES_API_STORE)?"""
        return self.store is not False

    def conversation(self) -> dict:
        """The prompt as a chat body (`messages`, `system`, `tools`), which the scheduler counts: a string input
        is one user message; a message item keeps its role and content, a function call and its output become
        an assistant and a tool turn. (A stored previous conversation is the engine's: not counted.)"""
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else []
        for item in self.input if isinstance(self.input, list) else ():
            kind = item.get("type")
            if kind == "function_call":
                items.append({"role": "assistant", "content": str(item.get("arguments") or "")})
            elif kind == "function_call_output":
                items.append({"role": "tool", "content": str(item.get("output") or "")})
            elif "content" in item:
                items.append({"role": str(item.get("role") or "user"), "content": item["content"]})
        return {"messages": items, "system": self.instructions, "tools": self.tools}
