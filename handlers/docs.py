"""OpenAPI documentation of the inference port: sanic-ext's spec at /docs/openapi.json, ReDoc at /docs.

The dataclasses below only describe bodies for readers of the spec; nothing validates against them.
OpenAI and Anthropic bodies carry fields the Coordinator does not model and must pass them through to
the engines, which sanic-ext's `@validate` would refuse (it rejects unknown fields). Of sanic-ext only
the OpenAPI extension is loaded: injection, CORS and the automatic HEAD/OPTIONS routes would add work
to every request. The docs routes belong to the inference plane, so the plane guard serves them there
and nowhere else. The ReDoc page loads its script from a CDN in the reader's browser; the Coordinator
itself fetches nothing (the Swagger UI, whose OAuth2 page the server would fetch, is off).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sanic import Sanic
from sanic_ext import openapi
from sanic_ext.extensions.openapi.builders import OperationStore
from sanic_ext.extensions.openapi.extension import OpenAPIExtension

from handlers import anthropic, management, metaserver, models, observability, openai
from handlers.ids import REQUEST_ID
from handlers.planes import INFER

DOCS_PREFIX = "/docs"


@dataclass
class ChatMessage:
    role: str  # system, developer, user, assistant or tool
    content: str | list[dict[str, Any]]


@dataclass
class StreamOptions:
    include_usage: bool = False


@dataclass
class ChatCompletionRequest:
    """Any other field (tools, response_format, top_k, ...) is passed to the engine unchanged."""

    model: str
    messages: list[ChatMessage]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None


@dataclass
class CompletionRequest:
    """Any other field is passed to the engine unchanged."""

    model: str
    prompt: str | list[str] | list[int]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


@dataclass
class ChatChoice:
    index: int
    message: ChatMessage
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
class MessagesRequest:
    """Anthropic Messages; any other field is passed to the engine unchanged."""

    model: str
    messages: list[ChatMessage]
    max_tokens: int
    system: str | list[dict[str, Any]] | None = None
    stream: bool = False
    temperature: float | None = None
    stop_sequences: list[str] | None = None
    tools: list[dict[str, Any]] | None = None


@dataclass
class CountTokensRequest:
    model: str
    messages: list[ChatMessage]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None


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
class KvTransferParams:
    request_id: str
    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_host: str | None = None
    remote_port: int | str | None = None


@dataclass
class MetaserverRequest:
    """An engine's PD forwarding call (pd_dispatch: trigger); the target must be a registered instance."""

    model: str
    kv_transfer_params: KvTransferParams
    messages: list[ChatMessage] | None = None
    prompt: str | list[str] | list[int] | None = None
    stream: bool = False


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


def _document(handler, summary: str, tag: str, body: Any, ok: Any, error: Any, **kw) -> None:
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
        OperationStore()[handler].body({"application/json": body})


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
        ChatCompletionRequest,
        ChatCompletion,
        OpenAIError,
    )
    _document(openai.completions, "Text completion (JSON or SSE)", "OpenAI", CompletionRequest, Completion, OpenAIError)
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
        anthropic.messages, "Anthropic Messages (JSON or SSE)", "Anthropic", MessagesRequest, Message, AnthropicError
    )
    _document(
        anthropic.count_tokens,
        "Count the tokens of a Messages request",
        "Anthropic",
        CountTokensRequest,
        TokenCount,
        AnthropicError,
    )
    _document(
        metaserver.metaserver,
        "PD forwarding for engines (pd_dispatch: trigger)",
        "Internal",
        MetaserverRequest,
        ChatCompletion,
        OpenAIError,
        statuses=(400, 403, 404, 413, 415, 502, 503, 504),
    )
