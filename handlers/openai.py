"""OpenAI-compatible inference routes: /v1/chat/completions and /v1/completions."""

from sanic import Blueprint, Request

from handlers.lifetime import serve_inference
from handlers.planes import INFER
from serving.families import CHAT, COMPLETIONS

bp = Blueprint("openai")


@bp.post(CHAT.route, ctx_plane=INFER, ctx_self_guarded=True, stream=True)
def chat_completions(request: Request):
    return serve_inference(request, CHAT)


@bp.post(COMPLETIONS.route, ctx_plane=INFER, ctx_self_guarded=True, stream=True)
def completions(request: Request):
    return serve_inference(request, COMPLETIONS)
