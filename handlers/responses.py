"""OpenAI's Responses API: POST /v1/responses (an inference route, like chat), and GET, DELETE and
POST .../cancel of a stored response, relayed to the engine that holds it (serving/responses.py)."""

from sanic import Blueprint, HTTPResponse, Request

from errors import OPENAI, CoordinatorError, client_status
from handlers.ids import REQUEST_ID, request_id
from handlers.lifetime import serve_inference
from handlers.planes import INFER
from handlers.sink import error_response
from serving.families import RESPONSES
from serving.observe import RequestRecord

bp = Blueprint("responses")

STORED = RESPONSES.route + "/<response_id:str>"


@bp.post(RESPONSES.route, ctx_plane=INFER, ctx_self_guarded=True, stream=True)
def create_response(request: Request):
    return serve_inference(request, RESPONSES)


@bp.get(STORED, ctx_plane=INFER)
def retrieve_response(request: Request, response_id: str):
    return _stored(request, "GET", response_id, RESPONSES.route + "/{id}")


@bp.delete(STORED, ctx_plane=INFER)
def delete_response(request: Request, response_id: str):
    return _stored(request, "DELETE", response_id, RESPONSES.route + "/{id}")


@bp.post(STORED + "/cancel", ctx_plane=INFER)
def cancel_response(request: Request, response_id: str):
    return _stored(request, "POST", response_id, RESPONSES.route + "/{id}/cancel")


async def _stored(request: Request, method: str, response_id: str, route: str) -> HTTPResponse:
    """A call about a stored response (its key checked by the guard): the door (drain, caps), the engine's answer
    as it gave it."""
    ctx, rid = request.app.ctx, request_id(request)
    rec = RequestRecord(rid, route)
    try:
        with ctx.door.admit():
            rec.tenant = request.ctx.tenant  # the guard's (handlers/auth.py)
            status, body = await ctx.dispatcher.responses.relay(
                method, response_id, request.query_string, rid, rec, rec.tenant
            )
        rec.status = status
        return HTTPResponse(body, status=status, headers={REQUEST_ID: rid}, content_type="application/json")
    except CoordinatorError as e:
        rec.status, rec.error = client_status(e), str(e)
        return error_response(e, OPENAI, rid)
    finally:
        ctx.observer.request_done(rec)
