"""The request shapes of the inference routes: one pydantic model per body, which validates it and which the
OpenAPI document (handlers/docs.py) is generated from. One module per endpoint family: `openai`,
`anthropic`, `metaserver`.

A model holds the fields the Coordinator reads (to route, to count the prompt, to rewrite the prefill leg)
with their types and bounds, read in pydantic's lax mode as vLLM's request models read them ("4" and 4.0
are 4, "yes" is true). Every other field is the engine's to judge: `extra="allow"`, and the engine gets
the client's own bytes. A refusal is one `InvalidRequest` with the field's path as `param`; its one-line
message is the field's `Refusal` (or a validator's `refuse`), and `validate` is the one place that turns
pydantic's errors into it: the first error, in field order.

pydantic checks every route but one body shape: bench/protocol.py puts a tiny chat body at about 4.4 µs of
CPU and 40 k instructions, 8 % of the whole request's 500 k
(bench/instructions.py), over the 5 % a body check may take on the hot path. So a plain chat body (a model,
up to 32 role/content strings, stream, a cap; `openai.read_plain_chat`) is read by a few exact-type tests
(1.6 µs), and every other body, every refusal among them, by the model; tests/test_protocol.py checks on
thousands of bodies that the two read alike. The other routes stay with pydantic: a 32 KiB chat at 13 µs
(beside 48 to parse it), a completion at 3 and a Messages body with tools at 7, each within 5 % of its
request's CPU. What keeps them there: no Python runs per message (messages are TypedDicts, and a union says
which may omit their content), the cross-field rules are field validators that run only when their field
is present, and `validate` calls the compiled validator itself.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from operator import itemgetter
from typing import Annotated, Any, NotRequired, Required, TypeVar, get_args, get_origin, get_type_hints

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    TypeAdapter,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WithJsonSchema,
    WrapValidator,
)
from pydantic_core import PydanticCustomError, PydanticKnownError
from typing_extensions import is_typeddict

from errors import InvalidRequest

# Printable ASCII without spaces: a request id (an X-Request-Id header, and a `key=value` field of log lines,
# which spaces or line breaks would forge), or a logged value shown as it is.
VISIBLE = re.compile(r"[!-~]+")


@dataclass(frozen=True, slots=True)
class Refusal:
    """How a field's refusal reads; `{param}` is the field's path (`messages[2].role`).

    `missing`: the message when the field is absent or null, where that reads differently; `item`: the
    message for an item of a list field that is not the object it should be."""

    message: str
    missing: str | None = None
    item: str | None = None


def refuse(message: str, param: str | None = None, at: str | None = None) -> PydanticCustomError:
    """A validator's refusal: its message as is and its `param` (else the checked field's path); or, given
    `at` (a path below the checked field: `content`, `[2].role`), a message template whose `{param}`, and the
    param, are that path in full."""
    return PydanticCustomError("refused", "{message}", {"message": message, "param": param, "at": at})


class Body(BaseModel):
    """A request body: the fields modelled are checked, the rest is the engine's (and kept for it)."""

    model_config = ConfigDict(extra="allow")


# A conversation's messages (and other nested shapes) are TypedDicts, which pydantic checks several times
# faster than models (no instance each); the keys they do not name are left out of the checked copy, which
# nothing reads (the engine gets the client's bytes), and the spec says they pass.
OPEN_SHAPE = ConfigDict(json_schema_extra={"additionalProperties": True})


M = TypeVar("M", bound=BaseModel)


def validate(model: type[M], body: dict) -> M:
    """The body read by `model`, or the InvalidRequest its first error makes."""
    try:
        return model.__pydantic_validator__.validate_python(body)  # (model_validate's Python layer: +0.6 µs)
    except ValidationError as e:
        raise _invalid(model, e.errors(include_url=False)[0]) from None


def _invalid(model: type[BaseModel], error: dict) -> InvalidRequest:
    refusal, param = _refusal(model, error["loc"])
    if error["type"] == "refused":
        ctx = error["ctx"]
        if ctx["at"]:
            at = param + ("" if ctx["at"].startswith("[") else ".") + ctx["at"]
            return InvalidRequest(ctx["message"].format(param=at), param=at)
        return InvalidRequest(ctx["message"], param=ctx["param"] or param)
    if refusal is None:  # a model's own shape (the body itself is checked before any model sees it)
        return InvalidRequest(error["msg"], param=param or None)
    missing = error["type"] == "missing" or error.get("input", ...) is None
    return InvalidRequest(
        (refusal.missing if missing and refusal.missing else refusal.message).format(param=param), param=param
    )


def _refusal(model: type[BaseModel], loc: tuple) -> tuple[Refusal | None, str]:
    """The deepest Refusal along an error's location, and that location as a path (`messages[0].role`).

    A location names fields, list indexes and, inside a union, the member that failed (by its class name)."""
    found, path, found_at, node = None, "", "", model
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
            if found is not None and found.item is not None:
                found, found_at = Refusal(found.item), path
            continue
        shapes = _shapes_in(node)
        shape = next((c for c in shapes if part in _fields(c)), None)
        if shape is None:
            node = next((c for c in shapes if c.__name__ == part), None)  # a union member's tag
            if node is None:
                break
            continue
        node, metadata = _fields(shape)[part]
        path = f"{path}.{part}" if path else part
        marked = next((m for m in metadata if isinstance(m, Refusal)), None)
        if marked is not None:
            found, found_at = marked, path
    return found, found_at or path


def _shapes_in(annotation: Any) -> list[type]:
    """The models and TypedDicts an annotation holds (itself, a list's items, a union's members)."""
    if isinstance(annotation, type) and (issubclass(annotation, BaseModel) or is_typeddict(annotation)):
        return [annotation]
    return [shape for arg in get_args(annotation) for shape in _shapes_in(arg)]


def _fields(shape: type) -> dict[str, tuple[Any, list]]:
    """A model's or TypedDict's fields: name -> (annotation, the metadata of its Annotated layers)."""
    if issubclass(shape, BaseModel):
        return {name: (f.annotation, f.metadata) for name, f in shape.model_fields.items()}
    out = {}
    for name, hint in get_type_hints(shape, include_extras=True).items():
        metadata = []
        while get_origin(hint) in (Annotated, NotRequired, Required):
            if get_origin(hint) is Annotated:
                metadata += hint.__metadata__
            hint = get_args(hint)[0]
        out[name] = (hint, metadata)
    return out


def read(kind: type) -> Any:
    """A field the Coordinator reads but leaves to the engine to judge: its value as pydantic's lax mode reads
    `kind` when it can, else as it came (which the reader ignores and the engine refuses)."""
    return Annotated[kind | Any, Field(union_mode="left_to_right"), WithJsonSchema(TypeAdapter(kind).json_schema())]


def passed(kind: Any, description: str | None = None) -> Any:
    """A field documented for the reader of the spec alone: any value passes, the engine judges it."""
    return Annotated[Any, WithJsonSchema(TypeAdapter(kind).json_schema()), Field(description=description)]


# pydantic's own length and pattern checks read a string as UTF-8, so they refuse one with a lone surrogate
# ("\ud800", which JSON may carry): such a model name is the Coordinator's 404, such a message the engine's
# to judge. A non-empty string is checked in Python instead (in one pass over a conversation's roles).
def _non_empty(value: str) -> str:
    if not value:
        raise PydanticKnownError("string_too_short", {"min_length": 1})
    return value


NonEmpty = (AfterValidator(_non_empty), WithJsonSchema({"type": "string", "minLength": 1}))
ROLE = Refusal("{param} is required and must be a non-empty string")
Role = Annotated[str, WithJsonSchema({"type": "string", "minLength": 1}), ROLE]
_role = itemgetter("role")


def _roles_named(messages: Any, handler: ValidatorFunctionWrapHandler) -> list:
    """Every message's role non-empty, and the first fault in message order the one reported."""
    try:
        checked = handler(messages)
    except ValidationError:
        if isinstance(messages, list):
            _refuse_an_earlier_empty_role(messages, handler)
        raise
    if "" in map(_role, checked):
        _refuse_an_earlier_empty_role(messages, handler)
    return checked


def _refuse_an_earlier_empty_role(messages: list, handler: ValidatorFunctionWrapHandler) -> None:
    empty = next((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == ""), None)
    if empty is not None:
        if empty:
            handler(messages[:empty])  # a fault before it comes first
        raise refuse(ROLE.message, at=f"[{empty}].role")


def messages(item: Any) -> Any:
    """A conversation: a non-empty list of `item` (a message TypedDict, whose role is a `Role`)."""
    return Annotated[
        list[item],
        Field(min_length=1),
        WrapValidator(_roles_named),
        Refusal(
            "'messages' is required and must be a non-empty list",
            item="{param} must be an object with 'role' and 'content'",
        ),
    ]


ModelName = Annotated[str, *NonEmpty, Refusal("'model' is required and must be a non-empty string")]
Stream = Annotated[StrictBool | None, Refusal("'stream' must be a boolean")]
Tools = Annotated[
    list[Any] | None,
    Refusal("'tools' must be a list"),
    Field(
        description="tool objects, rendered into the prompt the scheduler counts; their shape is the engine's to judge"
    ),
]
MaxTokens = Annotated[int | None, Field(ge=1), Refusal("'{param}' must be a positive integer")]


class Request(Body):
    """What every inference body holds: its model, and what vLLM's KV handoff cannot serve (more than one
    sequence, prompt logprobs: see serving/job.py's Job.decode_computes_prompt), read on every route."""

    model: ModelName
    n: read(int) = None
    best_of: read(int) = None
    prompt_logprobs: passed(int | None) = None

    @property
    def children(self) -> int:
        """The sequences the request asks for (`n` or `best_of`): 1 when it sets none, or none readable."""
        return max((v for v in (self.n, self.best_of) if isinstance(v, int)), default=1)
