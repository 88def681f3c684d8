"""Anthropic Messages routes: /v1/messages and /v1/messages/count_tokens (vLLM engines only)."""

from sanic import Blueprint, Request

from handlers.lifetime import serve_inference
from handlers.planes import INFER
from serving.families import COUNT_TOKENS, MESSAGES

bp = Blueprint("anthropic")


@bp.post(MESSAGES.route, ctx_plane=INFER, ctx_self_guarded=True, stream=True)
def messages(request: Request):
    return serve_inference(request, MESSAGES)


@bp.post(COUNT_TOKENS.route, ctx_plane=INFER, ctx_self_guarded=True, stream=True)
def count_tokens(request: Request):
    return serve_inference(request, COUNT_TOKENS)
