"""vLLM's own routes /tokenize and /detokenize, sent to one engine of the body's model (vLLM engines only)."""

from collections.abc import Callable

from pydantic import BaseModel, ConfigDict
from sanic import Blueprint, Request

from handlers.lifetime import serve_inference
from handlers.planes import INFER
from serving.families import DETOKENIZE, TOKENIZE
from serving.protocol.tokenize import DetokenizeRequest, TokenizeRequest

bp = Blueprint("tokenize")


@bp.post(TOKENIZE.route, ctx_plane=INFER, ctx_self_guarded=True, stream=True)
def tokenize(request: Request):
    return serve_inference(request, TOKENIZE)


@bp.post(DETOKENIZE.route, ctx_plane=INFER, ctx_self_guarded=True, stream=True)
def detokenize(request: Request):
    return serve_inference(request, DETOKENIZE)


class Tokens(BaseModel):
    """vLLM's TokenizeResponse."""

    model_config = ConfigDict(extra="allow")
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class Text(BaseModel):
    """vLLM's DetokenizeResponse."""

    model_config = ConfigDict(extra="allow")
    prompt: str


def document(document: Callable, schema_of: Callable, answer: Callable, route: dict) -> None:
    """The two routes in the OpenAPI document (handlers/docs.py's helpers, and its OpenAI route's keys)."""
    examples = {"prompt": {"prompt": "Hello!"}, "chat": {"messages": [{"role": "user", "content": "Hello!"}]}}
    document(
        tokenize,
        "vLLM's /tokenize: a prompt's, or a conversation's, token ids from an engine of the model",
        body=schema_of(TokenizeRequest),
        ok=answer(Tokens),
        examples=examples,
        **route,
    )
    document(
        detokenize,
        "vLLM's /detokenize: token ids' text from an engine of the model",
        body=schema_of(DetokenizeRequest),
        ok=answer(Text),
        examples={"ids": {"tokens": [1, 2, 3]}},
        **route,
    )
