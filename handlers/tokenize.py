"""vLLM's own routes /tokenize and /detokenize, sent to one engine of the body's model (vLLM engines only)."""

from sanic import Blueprint, Request

from errors import OPENAI
from handlers.lifetime import serve_inference
from handlers.planes import INFER
from serving.job import DETOKENIZE, TOKENIZE

bp = Blueprint("tokenize")


@bp.post(TOKENIZE, ctx_plane=INFER, ctx_self_guarded=True, stream=True)
def tokenize(request: Request):
    return serve_inference(request, TOKENIZE, OPENAI)


@bp.post(DETOKENIZE, ctx_plane=INFER, ctx_self_guarded=True, stream=True)
def detokenize(request: Request):
    return serve_inference(request, DETOKENIZE, OPENAI)
