"""OpenAPI documentation of the inference port: sanic-ext's spec at /docs/openapi.json, ReDoc at /docs.

Request bodies are the JSON schemas of the models that validate them (serving/protocol/), turned into
OpenAPI 3.0's dialect; their fields are what the Coordinator reads, and any other field is passed to the
engines (`additionalProperties`). The dataclasses below describe answers for readers of the spec alone:
the Coordinator relays the engines' answers and renders its own errors (errors/). Of sanic-ext only
the OpenAPI extension is loaded: injection, CORS and the automatic HEAD/OPTIONS routes would add work
to every request. The docs routes belong to the inference plane, so the plane guard serves them there
and nowhere else. The ReDoc page loads its script from a CDN in the reader's browser; the Coordinator
itself fetches nothing (the Swagger UI, whose OAuth2 page the server would fetch, is off).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from sanic import Sanic
from sanic_ext import openapi
from sanic_ext.extensions.openapi.builders import OperationStore, SpecificationBuilder
from sanic_ext.extensions.openapi.extension import OpenAPIExtension

from handlers import anthropic, management, metaserver, models, observability, openai
from handlers.ids import REQUEST_ID
from handlers.planes import INFER
from serving.protocol import anthropic as anthropic_protocol, openai as openai_protocol
from serving.protocol.metaserver import MetaserverCall

DOCS_PREFIX = "/docs"


@dataclass
class AssistantMessage:
    role: str  # assistant
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


@dataclass
class ChatChoice:
    index: int
    message: AssistantMessage
    finish_reason: str | None


@dataclass
class ChatCompletion:
    """With `stream: true` the answer is `text/event-stream`: `data: <chat.completion.chunk>` events, then `data: [DONE]`."""

    id: str
    object: str  # chat.completion
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


@dataclass
class CompletionChoice:
    index: int
    text: str
    finish_reason: str | None


@dataclass
class Completion:
    """With `stream: true` the answer is `text/event-stream`, ended by `data: [DONE]`."""

    id: str
    object: str  # text_completion
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


@dataclass
class OpenAIErrorBody:
    message: str
    type: str
    param: str | None
    code: str | None


@dataclass
class OpenAIError:
    error: OpenAIErrorBody


@dataclass
class AnthropicUsage:
    input_tokens: int
    output_tokens: int


@dataclass
class Message:
    """With `stream: true` the answer is `text/event-stream`: message_start ... message_stop events."""

    id: str
    type: str  # message
    role: str  # assistant
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None
    usage: AnthropicUsage


@dataclass
class TokenCount:
    input_tokens: int


@dataclass
class AnthropicErrorBody:
    type: str
    message: str


@dataclass
class AnthropicError:
    type: str  # error
    error: AnthropicErrorBody
    request_id: str  # the request's id, also sent as the `request-id` and X-Request-Id headers


@dataclass
class ModelCard:
    id: str
    object: str  # model
    owned_by: str  # motor
    created: int
    p_max_seqlen: int
    d_max_seqlen: int
    slo_ttft: int  # ms
    slo_tpot: int  # ms
    p_instances_num: int  # live, healthy prefill (and union) instances
    d_instances_num: int  # live, healthy decode (and union) instances


@dataclass
class ModelList:
    object: str  # list
    data: list[ModelCard] = field(default_factory=list)


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


def _responses(ok: Any, error: Any, statuses: tuple[int, ...] = _INFERENCE_ERRORS) -> list:
    out = [openapi.definitions.Response({"application/json": ok}, status=200, description="OK")]
    out += [
        openapi.definitions.Response({"application/json": error}, status=s, description=_ERRORS[s]) for s in statuses
    ]
    return out


def openapi_schema(model: type[BaseModel]) -> tuple[dict, dict]:
    """A request model's JSON schema in OpenAPI 3.0's dialect, and the schemas it refers to (components)."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    components = {name: _oas30(sub) for name, sub in schema.pop("$defs", {}).items()}
    return _oas30(schema), components


def request_schema(model: type[BaseModel]) -> dict:
    """A request body's schema for the spec, the schemas it refers to added to its components."""
    schema, components = openapi_schema(model)
    for name, sub in components.items():
        SpecificationBuilder().add_component("schemas", name, sub)
    return schema


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


def _document(handler, summary: str, tag: str, body: dict | None, ok: Any, error: Any, **kw) -> None:
    openapi.definition(
        summary=summary,
        description=_PASS_THROUGH if body is not None else None,
        tag=tag,
        parameter=[
            openapi.definitions.Parameter(
                REQUEST_ID, str, "header", description="echoed on every response; made up when absent"
            )
        ],
        response=_responses(ok, error, **kw),
    )(handler)
    if body is not None:
        # Straight to the builder: `openapi.body` would wrap the handler, one more call on every request.
        OperationStore()[handler].body({"application/json": {"schema": body}}, required=True)


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
    for route in app.router.routes:
        if route.name.startswith(f"{app.name}.openapi."):
            route.ctx.plane = INFER
    for bp in (management.bp, observability.bp):  # other ports: documented in docs/operations.md
        openapi.exclude(bp=bp)

    _document(
        openai.chat_completions,
        "Chat completion (JSON or SSE)",
        "OpenAI",
        request_schema(openai_protocol.ChatCompletionRequest),
        ChatCompletion,
        OpenAIError,
    )
    _document(
        openai.completions,
        "Text completion (JSON or SSE)",
        "OpenAI",
        request_schema(openai_protocol.CompletionRequest),
        Completion,
        OpenAIError,
    )
    _document(
        models.list_models,
        "Served models with SLOs and live instance counts (Anthropic's shape when the "
        "request carries anthropic-version)",
        "OpenAI",
        None,
        ModelList,
        OpenAIError,
        statuses=(401,),
    )
    _document(
        models.retrieve_model,
        "One served model (the SDKs' models.retrieve; Anthropic's shape when the request carries anthropic-version)",
        "OpenAI",
        None,
        ModelCard,
        OpenAIError,
        statuses=(401, 404),
    )
    _document(
        anthropic.messages,
        "Anthropic Messages (JSON or SSE)",
        "Anthropic",
        request_schema(anthropic_protocol.MessagesRequest),
        Message,
        AnthropicError,
    )
    _document(
        anthropic.count_tokens,
        "Count the tokens of a Messages request",
        "Anthropic",
        request_schema(anthropic_protocol.CountTokensRequest),
        TokenCount,
        AnthropicError,
    )
    _document(
        metaserver.metaserver,
        "PD forwarding for engines (pd_dispatch: trigger)",
        "Internal",
        # The control object, on a chat or completions body as an engine rewrote it.
        {
            "allOf": [
                request_schema(MetaserverCall),
                {
                    "anyOf": [
                        request_schema(openai_protocol.ChatCompletionBody),
                        request_schema(openai_protocol.CompletionBody),
                    ]
                },
            ]
        },
        ChatCompletion,
        OpenAIError,
        statuses=(400, 403, 404, 413, 415, 502, 503, 504),
    )
