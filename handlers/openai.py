"""OpenAI-compatible inference routes: /v1/chat/completions and /v1/completions."""

from sanic import Blueprint, Request

from errors import OPENAI
from handlers.lifetime import serve_inference
from handlers.planes import INFER
from serving.job import CHAT, COMPLETIONS

bp = Blueprint("openai")


@bp.post(CHAT, ctx_plane=INFER, ctx_self_guarded=True, stream=True)
def chat_completions(request: Request):
    return serve_inference(request, CHAT, OPENAI)


@bp.post(COMPLETIONS, ctx_plane=INFER, ctx_self_guarded=True, stream=True)
def completions(request: Request):
    return serve_inference(request, COMPLETIONS, OPENAI)
