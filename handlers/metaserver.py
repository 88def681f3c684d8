"""POST /v1/metaserver: engines ask the Coordinator to run the other half of a PD request.

The target is always a registered instance: one named by `remote_host`/`remote_port` or
`remote_engine_id` must be registered with the right role (its host in any spelling: an engine reports
its IP address where the deployer registered it by name), or the call is refused with 403 and nothing
is sent anywhere; one named by nothing is picked by the scheduler.

A call from the address of a registered instance is an engine's: it needs no API key (engines send
none) and is not admitted again (in-flight cap, rate limit, drain), being half of a client request that
was admitted already. Any other caller is treated as a client: with `enable_api_key` it needs a valid
key, and it is admitted like any request (the route runs a full generation when asked for a decode).
Instance host names are resolved when the registered set changes (serving/resolve.py); a caller that
matches none makes them resolve again after `RECHECK_AFTER_S` (an engine pod restarted with a new
address). The check trusts the host: anything that reaches the Coordinator from an engine's address
(a proxy on an engine host, traffic NATed to a node IP that an engine is registered by) counts as that
engine.
"""

from __future__ import annotations

from sanic import Blueprint, Request

from handlers.lifetime import serve_inference
from handlers.planes import INFER, check_plane
from serving.families import METASERVER

bp = Blueprint("metaserver")


@bp.post(METASERVER.route, ctx_plane=INFER, ctx_self_guarded=True, stream=True)
async def metaserver(request: Request):
    check_plane(request, INFER)
    engine = await from_registered_instance(request)
    return await serve_inference(request, METASERVER, from_client=not engine)


async def from_registered_instance(request: Request) -> bool:
    """Does the call come from the host of a registered instance?"""
    caller = request.conn_info.client_ip if request.conn_info else ""
    return await request.app.ctx.dispatcher.addresses.knows(caller)
