"""vLLM's /tokenize and /detokenize bodies, as the Coordinator reads them.

A tokenize body holds a `prompt` (a string) or a conversation (`messages`, rendered by the engine's chat
template); a detokenize body a list of token ids. `model` may be left out, as vLLM allows: the Coordinator then
sends it to an engine of the one model it serves (serving/dispatch.py). What else they hold (`add_special_tokens`,
`add_generation_prompt`, `continue_final_message`, `return_token_strs`, `tools`, `chat_template`) is the engine's.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, model_validator

from serving.protocol import NonEmpty, Refusal, Request, passed, refuse

OptionalModel = Annotated[Annotated[str, *NonEmpty] | None, Refusal("'model' must be a non-empty string")]


class _Counting(Request):
    """A body the engine answers at once: no output, no stream."""

    model: OptionalModel = None

    @property
    def max_output(self) -> int:
        return 0


class TokenizeRequest(_Counting):
    """Tokenize a prompt, or a conversation rendered by the model's chat template; any other field is passed to the
    engine unchanged."""

    prompt: Annotated[str | None, Refusal("'prompt' must be a string")] = None
    messages: Annotated[list[dict[str, Any]] | None, Refusal("'messages' must be a list of message objects")] = None
    add_special_tokens: passed(bool) = None
    add_generation_prompt: passed(bool) = None
    continue_final_message: passed(bool) = None
    return_token_strs: passed(bool | None, "also return each token's text") = None

    @model_validator(mode="after")
    def _a_prompt(self) -> TokenizeRequest:
        if self.prompt is None and self.messages is None:
            raise refuse("one of 'prompt' or 'messages' is required", param="prompt")
        return self


class DetokenizeRequest(_Counting):
    """Turn token ids back into text; any other field is passed to the engine unchanged."""

    tokens: Annotated[
        list[Annotated[int, Field(ge=0, le=2**63 - 1)]],
        Refusal("'tokens' must be a list of token ids (integers from 0)", missing="'tokens' is required"),
    ]
