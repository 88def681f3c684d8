"""Anthropic Messages routes: /v1/messages and /v1/messages/count_tokens (vLLM engines only)."""

from sanic import Blueprint, Request

from errors import ANTHROPIC
from handlers.lifetime import serve_inference
from handlers.planes import INFER
from serving.job import COUNT_TOKENS, MESSAGES

bp = Blueprint("anthropic")


@bp.post(MESSAGES, ctx_plane=INFER, ctx_self_guarded=True, stream=True)
def messages(request: Request):
    return serve_inference(request, MESSAGES, ANTHROPIC)


@bp.post(COUNT_TOKENS, ctx_plane=INFER, ctx_self_guarded=True, stream=True)
def count_tokens(request: Request):
    return serve_inference(request, COUNT_TOKENS, ANTHROPIC)
