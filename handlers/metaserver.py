"""POST /v1/metaserver: engines ask the Coordinator to run the other half of a PD request.

The target is always a registered instance: one named by `remote_host`/`remote_port` or
`remote_engine_id` must be registered with the right role, or the call is refused with 403 and nothing
is sent anywhere; one named by nothing is picked by the scheduler.
"""

from sanic import Blueprint, Request

from errors import OPENAI
from handlers.common import INFER, serve_inference
from serving.job import METASERVER

bp = Blueprint("metaserver")


@bp.post(METASERVER, ctx_plane=INFER, ctx_self_guarded=True, stream=True)
def metaserver(request: Request):
    return serve_inference(request, METASERVER, OPENAI, authenticate=False)
