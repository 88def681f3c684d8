"""OpenAPI documentation of the inference port: sanic-ext's spec at /docs/openapi.json, ReDoc at /docs.

Request bodies are the JSON schemas of the models that validate them (serving/protocol/), turned into
OpenAPI 3.0's dialect; their fields are what the Coordinator reads, and any other field is passed to the
engines (`additionalProperties`). The `Answer` models below describe answers, for the spec alone (the
Coordinator relays the engines' answers and renders its own errors, errors/): what every answer of a
kind carries is required, null where an engine or the Coordinator writes null, and a streaming route's
`text/event-stream` is documented beside its JSON. The key schemes are declared per route as
handlers/auth.py reads keys, and only when api_key_config.enable_api_key is on. Of sanic-ext only
the OpenAPI extension is loaded: injection, CORS and the automatic HEAD/OPTIONS routes would add work
to every request. The docs routes belong to the inference plane, so the plane guard serves them there
and nowhere else, and take no key. The ReDoc page loads its script from a CDN in the reader's browser; the
Coordinator itself fetches nothing (the Swagger UI, whose OAuth2 page the server would fetch, is off).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from sanic import Sanic
from sanic_ext import openapi
from sanic_ext.extensions.openapi.builders import OperationStore, SpecificationBuilder
from sanic_ext.extensions.openapi.definitions import RequestBody
from sanic_ext.extensions.openapi.extension import OpenAPIExtension

from config import ApiKeyConfig
from handlers import anthropic, management, metaserver, models, observability, openai, responses, tokenize
from handlers.ids import REQUEST_ID
from handlers.planes import INFER
from serving.protocol import (
    anthropic as anthropic_protocol,
    openai as openai_protocol,
    responses as responses_protocol,
)
from serving.protocol.metaserver import MetaserverCall

DOCS_PREFIX = "/docs"


class Answer(BaseModel):
    """An answer's shape, for the spec alone (nothing validates answers): the fields every answer of its kind
    carries are required; engines add fields of their own (vLLM's `service_tier`, `kv_transfer_params`, ...)."""

    model_config = ConfigDict(extra="allow")


Count = dict[str, int | None]  # token counts by kind; vLLM writes null for a kind it does not count


class Usage(Answer):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Count | None = None
    completion_tokens_details: Count | None = None


class AssistantMessage(Answer):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning: str | None = None


class ChatChoice(Answer):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None


class ChatCompletion(Answer):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(Answer):
    index: int
    text: str
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None


class Completion(Answer):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class OpenAIErrorBody(Answer):
    message: str
    type: str
    param: str | None
    code: Annotated[
        str | int | None,
        Field(
            description="the Coordinator's own errors: a string (`invalid_api_key`, `model_not_found`, ...) or "
            "null; an engine's error relayed as is: the engine's code (vLLM's: the HTTP status, an integer)"
        ),
    ]


class OpenAIError(Answer):
    error: OpenAIErrorBody


class ResponseUsage(Answer):
    input_tokens: int
    input_tokens_details: dict[str, Any] = Field(description="cached_tokens (and vLLM's per-turn counts)")
    output_tokens: int
    output_tokens_details: dict[str, Any] | None = None
    total_tokens: int


class ResponseObject(Answer):
    id: str = Field(description="resp_...: the response id, which previous_response_id, GET, DELETE and cancel name")
    object: Literal["response"]
    created_at: int
    model: str
    status: str = Field(description="completed, incomplete (max_output_tokens reached), queued, in_progress, cancelled")
    output: list[dict[str, Any]]
    previous_response_id: str | None = None
    usage: ResponseUsage | None = None


class ResponseDeleted(Answer):
    id: str
    object: Literal["response"]
    deleted: bool


class AnthropicUsage(Answer):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int | None = None
    cache_read_input_tokens: int | None = None


class Message(Answer):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None
    stop_sequence: str | None = None
    usage: AnthropicUsage


class TokenCount(Answer):
    input_tokens: int


class AnthropicErrorBody(Answer):
    type: str
    message: str


class AnthropicError(Answer):
    type: Literal["error"]
    error: AnthropicErrorBody
    request_id: Annotated[str, Field(description="the request's id, also its `request-id` and X-Request-Id headers")]


class _Served(Answer):
    """What both APIs' model entries carry: the Coordinator's own fields."""

    id: str
    p_max_seqlen: int
    d_max_seqlen: int
    slo_ttft: Annotated[int, Field(description="ms")]
    slo_tpot: Annotated[int, Field(description="ms")]
    p_instances_num: Annotated[int, Field(description="live, healthy prefill (and union) instances")]
    d_instances_num: Annotated[int, Field(description="live, healthy decode (and union) instances")]


class ModelCard(_Served):
    object: Literal["model"]
    owned_by: Literal["motor"]
    created: int


class ModelList(Answer):
    object: Literal["list"]
    data: list[ModelCard]


class AnthropicModelCard(_Served):
    type: Literal["model"]
    display_name: str
    created_at: Annotated[str, Field(description="RFC 3339")]


class AnthropicModelList(Answer):
    data: list[AnthropicModelCard]
    has_more: bool
    first_id: str | None
    last_id: str | None


_PASS_THROUGH = (
    "Fields not listed here are passed to the engine unchanged; the engine judges them. "
    "An engine's own 4xx answer is relayed as is."
)

# Statuses the Coordinator itself answers on inference routes; an engine's own 4xx is relayed as is.
_ERRORS = {
    400: "Invalid body or field",
    401: "Missing or invalid API key (when api_key_config.enable_api_key)",
    403: "Metaserver target is not a registered instance",
    404: "Unknown model",
    413: "Body over rate_limit_config.max_request_body_size",
    415: "Content-Type is not application/json",
    429: "Over the in-flight cap or the rate limit (Retry-After set)",
    502: "An engine failed or could not be reached",
    503: "No healthy instance of the model, or the Coordinator is draining",
    504: "An engine missed a deadline",
}

_INFERENCE_ERRORS = (400, 401, 404, 413, 415, 429, 502, 503, 504)

# The streaming routes' `stream: true` answer, one server-sent event at a time. An error after the first
# byte is the stream's last event.
_OPENAI_STREAM = {
    "type": "object",
    "description": "With `stream: true`: `data:` events (no `event:` field), the last one `data: [DONE]`.",
    "properties": {
        "data": {
            "type": "string",
            "description": "a chunk object (chat.completion.chunk, text_completion) as JSON, or [DONE]; an error "
            "after the stream started is the stream's last chunk, an OpenAIError",
        }
    },
    "required": ["data"],
}
_RESPONSES_STREAM = {
    "type": "object",
    "description": "With `stream: true`: `event:` and `data:` pairs, response.created ... response.completed (no [DONE]); "
    "the data's `sequence_number` counts from 0.",
    "properties": {
        "event": {
            "type": "string",
            "description": "the event's type: response.created, response.in_progress, then per output item its "
            "added, delta and done events (response.output_text.delta for text), then response.completed (its "
            "usage is the whole request's); an error after the stream started is an `error` event",
        },
        "data": {"type": "string", "description": "the event object as JSON (its `type` is the event's name)"},
    },
    "required": ["event", "data"],
}
_ANTHROPIC_STREAM = {
    "type": "object",
    "description": "With `stream: true`: `event:` and `data:` pairs, message_start ... message_stop.",
    "properties": {
        "event": {
            "type": "string",
            "enum": [
                "message_start",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop",
                "ping",
                "error",
            ],
        },
        "data": {
            "type": "string",
            "description": "the event object, of the event's type, as JSON; an error after the stream started "
            "is the stream's last event, an AnthropicError",
        },
    },
    "required": ["event", "data"],
}

# Security schemes, by the API whose clients present them (handlers/auth.py reads them).
OPENAI_KEY, ANTHROPIC_KEY = "api_key", "anthropic_api_key"


def security_schemes(cfg: ApiKeyConfig) -> dict[str, dict]:
    """The configured key header, and Anthropic's `x-api-key` (read on Anthropic requests beside it)."""
    if cfg.header_name.lower() == "authorization" and cfg.key_prefix.lower() == "bearer ":
        configured = {"type": "http", "scheme": "bearer", "description": "api_key_config.valid_keys"}
    else:
        prefix = f" after the prefix {cfg.key_prefix!r}" if cfg.key_prefix else ""
        configured = {
            "type": "apiKey",
            "in": "header",
            "name": cfg.header_name,
            "description": f"api_key_config.valid_keys, in {cfg.header_name}{prefix}",
        }
    anthropic_key = {
        "type": "apiKey",
        "in": "header",
        "name": "x-api-key",
        "description": "api_key_config.valid_keys, on Anthropic routes (and /v1/models with anthropic-version)",
    }
    return {OPENAI_KEY: configured, ANTHROPIC_KEY: anthropic_key}


# Per route: alternatives, any one of which admits the request.
_OPENAI_SECURITY = ({OPENAI_KEY: []},)
_ANTHROPIC_SECURITY = ({OPENAI_KEY: []}, {ANTHROPIC_KEY: []})
_MODELS_SECURITY = _OPENAI_SECURITY  # and x-api-key with anthropic-version (which OpenAPI cannot say)
_METASERVER_SECURITY = ({OPENAI_KEY: []}, {})  # a registered instance's call needs none

_ANTHROPIC_VERSION = openapi.definitions.Parameter(
    "anthropic-version",
    str,
    "header",
    description="selects Anthropic's shapes (the answer's and the error envelope) and admits x-api-key",
)


def openapi_schema(model: type[BaseModel]) -> tuple[dict, dict]:
    """A model's JSON schema in OpenAPI 3.0's dialect, and the schemas it refers to (components)."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    components = {name: _oas30(sub) for name, sub in schema.pop("$defs", {}).items()}
    return _oas30(schema), components


def schema_of(*models: type[BaseModel], inline: bool = False) -> dict:
    """A body's schema for the spec (any one of `models`): the schemas it refers to added to the spec's
    components, or with `inline` written out in place (an answer, read where it is documented)."""
    schemas = []
    for model in models:
        schema, components = openapi_schema(model)
        if inline:
            schema = _inline(schema, components)
        else:
            for name, sub in components.items():
                SpecificationBuilder().add_component("schemas", name, sub)
        schemas.append(schema)
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def answer(*models: type[BaseModel]) -> dict:
    """An answer's schema (any one of `models`), written out in place."""
    return schema_of(*models, inline=True)


def _inline(node: Any, components: dict) -> Any:
    """`node` with each reference to one of `components` replaced by that schema (answers nest no cycles)."""
    if isinstance(node, list):
        return [_inline(x, components) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _inline(v, components) for k, v in node.items() if k != "$ref"}
    if "$ref" in node:  # the referred schema, with what the reference says beside it (a description)
        return {**_inline(components[node["$ref"].rsplit("/", 1)[1]], components), **out}
    return out


def _oas30(node: Any) -> Any:
    """pydantic writes JSON Schema 2020-12; OpenAPI 3.0 spells a null alternative `nullable` and a constant `enum`."""
    if isinstance(node, list):
        return [_oas30(x) for x in node]
    if not isinstance(node, dict):
        return node
    node = {k: _oas30(v) for k, v in node.items()}
    if "const" in node:
        node["enum"] = [node.pop("const")]
    alternatives = node.get("anyOf")
    if alternatives and {"type": "null"} in alternatives:
        rest = [x for x in alternatives if x != {"type": "null"}]
        del node["anyOf"]
        node["nullable"] = True
        if len(rest) == 1:
            node.update({"allOf": rest} if "$ref" in rest[0] else rest[0])
        else:
            node["anyOf"] = rest
    return node


class _MediaType(openapi.definitions.MediaType):
    """sanic-ext's media type knows one `example`; OpenAPI's also holds named `examples`."""

    examples: dict[str, dict] | None


# Request examples: what a reader may send as it is (with a model the Coordinator serves), one per way to ask.
EXAMPLE_MODEL = "Qwen/Qwen3-8B"
_HELLO = [{"role": "user", "content": "Hello!"}]
_CHAT_EXAMPLES = {
    "chat": {"model": EXAMPLE_MODEL, "messages": _HELLO, "max_tokens": 16},
    "stream": {
        "model": EXAMPLE_MODEL,
        "messages": _HELLO,
        "max_tokens": 16,
        "stream": True,
        "stream_options": {"include_usage": True},
    },
}
_COMPLETION_EXAMPLES = {
    "completion": {"model": EXAMPLE_MODEL, "prompt": "Once upon a time", "max_tokens": 16},
    "stream": {"model": EXAMPLE_MODEL, "prompt": "Once upon a time", "max_tokens": 16, "stream": True},
}
_MESSAGES_EXAMPLES = {
    "message": {"model": EXAMPLE_MODEL, "max_tokens": 16, "messages": _HELLO},
    "stream": {"model": EXAMPLE_MODEL, "max_tokens": 16, "messages": _HELLO, "stream": True},
}
_COUNT_TOKENS_EXAMPLES = {"count": {"model": EXAMPLE_MODEL, "messages": _HELLO}}
_RESPONSES_EXAMPLES = {
    "response": {"model": EXAMPLE_MODEL, "input": "Hello!", "max_output_tokens": 16},
    "stream": {"model": EXAMPLE_MODEL, "input": "Hello!", "max_output_tokens": 16, "stream": True},
    "follow-up": {
        "model": EXAMPLE_MODEL,
        "input": "And then?",
        "previous_response_id": "resp_0123456789abcdef0123456789abcdef",
        "max_output_tokens": 16,
    },
}


def _document(
    handler,
    summary: str,
    *,
    tag: str,
    ok: dict,
    error: dict,
    security: tuple[dict, ...] | None,
    body: dict | None = None,
    statuses: tuple[int, ...] = _INFERENCE_ERRORS,
    stream: dict | None = None,
    headers: tuple = (),
    examples: dict[str, dict] | None = None,
) -> None:
    ok_content = {"application/json": {"schema": ok}}
    if stream is not None:
        ok_content["text/event-stream"] = {"schema": stream}
    openapi.definition(
        summary=summary,
        description=_PASS_THROUGH if body is not None else None,
        tag=tag,
        parameter=[
            openapi.definitions.Parameter(
                REQUEST_ID, str, "header", description="echoed on every response; made up when absent"
            ),
            *headers,
        ],
        response=[
            openapi.definitions.Response(ok_content, status=200, description="OK"),
            *(
                openapi.definitions.Response({"application/json": {"schema": error}}, status=s, description=_ERRORS[s])
                for s in statuses
            ),
        ],
    )(handler)
    # Straight to the builder: `openapi.body` would wrap the handler, one more call on every request.
    operation = OperationStore()[handler]
    if body is not None:
        named = {"examples": {k: {"value": v} for k, v in examples.items()}} if examples else {}
        operation.requestBody = RequestBody({"application/json": _MediaType(body, **named)}, required=True)
    for alternative in security or ():
        operation.secured(alternative)


def mount(app: Sanic) -> None:
    """Load sanic-ext's OpenAPI extension alone and document the inference routes."""
    app.config.API_TITLE = "MindIE Motor Coordinator"
    app.config.API_DESCRIPTION = "OpenAI- and Anthropic-compatible inference in front of prefill/decode engines."
    app.config.API_VERSION = "1"
    app.extend(
        built_in_extensions=False,
        extensions=[OpenAPIExtension],
        config={"oas_url_prefix": DOCS_PREFIX, "oas_ui_default": "redoc", "oas_ui_swagger": False, "cors": False},
    )
    for r in app.router.routes:
        if r.name.startswith(f"{app.name}.openapi."):
            r.ctx.plane, r.ctx.keyless = INFER, True  # the API's description is public
    for bp in (management.bp, observability.bp):  # other ports: documented in docs/operations.md
        openapi.exclude(bp=bp)

    # Keys are declared where they are checked: with api_key_config.enable_api_key off, every route is open.
    keys = app.ctx.live.s.api_key
    if keys.enable_api_key:
        for name, scheme in security_schemes(keys).items():
            SpecificationBuilder().add_component("securitySchemes", name, scheme)

    def secured(alternatives: tuple[dict, ...]) -> tuple[dict, ...] | None:
        return alternatives if keys.enable_api_key else None

    openai_route = {
        "tag": "OpenAI",
        "error": answer(OpenAIError),
        "security": secured(_OPENAI_SECURITY),
        "stream": _OPENAI_STREAM,
    }
    models_route = {
        "tag": "OpenAI",
        "error": answer(OpenAIError, AnthropicError),
        "security": secured(_MODELS_SECURITY),
        "headers": (_ANTHROPIC_VERSION,),
    }
    anthropic_route = {"tag": "Anthropic", "error": answer(AnthropicError), "security": secured(_ANTHROPIC_SECURITY)}
    _document(
        openai.chat_completions,
        "Chat completion (JSON or SSE)",
        body=schema_of(openai_protocol.ChatCompletionRequest),
        ok=answer(ChatCompletion),
        examples=_CHAT_EXAMPLES,
        **openai_route,
    )
    _document(
        openai.completions,
        "Text completion (JSON or SSE)",
        body=schema_of(openai_protocol.CompletionRequest),
        ok=answer(Completion),
        examples=_COMPLETION_EXAMPLES,
        **openai_route,
    )
    _document(
        responses.create_response,
        "OpenAI Responses (JSON or SSE events); a follow-up (previous_response_id) goes to the instance holding it",
        body=schema_of(responses_protocol.ResponsesRequest),
        ok=answer(ResponseObject),
        examples=_RESPONSES_EXAMPLES,
        **{**openai_route, "stream": _RESPONSES_STREAM},
    )
    stored = {k: v for k, v in openai_route.items() if k != "stream"}
    for handler, summary, ok in (
        (responses.retrieve_response, "A stored response, from the instance that holds it", ResponseObject),
        (
            responses.delete_response,
            "Delete a stored response (see docs/responses.md: vLLM 0.32 keeps it)",
            ResponseDeleted,
        ),
        (responses.cancel_response, "Cancel a background response on the instance that holds it", ResponseObject),
    ):
        _document(handler, summary, ok=answer(ok), statuses=(400, 401, 404, 429, 502, 503, 504), **stored)
    tokenize.document(_document, schema_of, answer, stored)
    _document(
        models.list_models,
        "Served models with SLOs and live instance counts (Anthropic's shape when the "
        "request carries anthropic-version)",
        ok=answer(ModelList, AnthropicModelList),
        statuses=(401,),
        **models_route,
    )
    _document(
        models.retrieve_model,
        "One served model (the SDKs' models.retrieve; Anthropic's shape when the request carries anthropic-version)",
        ok=answer(ModelCard, AnthropicModelCard),
        statuses=(401, 404),
        **models_route,
    )
    _document(
        anthropic.messages,
        "Anthropic Messages (JSON or SSE)",
        body=schema_of(anthropic_protocol.MessagesRequest),
        ok=answer(Message),
        stream=_ANTHROPIC_STREAM,
        examples=_MESSAGES_EXAMPLES,
        **anthropic_route,
    )
    _document(
        anthropic.count_tokens,
        "Count the tokens of a Messages request",
        body=schema_of(anthropic_protocol.CountTokensRequest),
        ok=answer(TokenCount),
        examples=_COUNT_TOKENS_EXAMPLES,
        **anthropic_route,
    )
    _document(
        metaserver.metaserver,
        "PD forwarding for engines (pd_dispatch: trigger)",
        # The control object, on a chat or completions body as an engine rewrote it.
        body={
            "allOf": [
                schema_of(MetaserverCall),
                schema_of(openai_protocol.ChatCompletionBody, openai_protocol.CompletionBody),
            ]
        },
        ok=answer(ChatCompletion, Completion),
        statuses=(400, 401, 403, 404, 413, 415, 429, 502, 503, 504),
        **{**openai_route, "tag": "Internal", "security": secured(_METASERVER_SECURITY)},
    )
