"""POST /v1/metaserver: engines ask the Coordinator to run the other half of a PD request.

The target is always a registered instance: one named by `remote_host`/`remote_port` or
`remote_engine_id` must be registered with the right role (its host in any spelling: an engine reports
its IP address where the deployer registered it by name), or the call is refused with 403 and nothing
is sent anywhere; one named by nothing is picked by the scheduler.

A call from the address of a registered instance is an engine's: it needs no API key (engines send
none) and is not admitted again (in-flight cap, rate limit, drain), being half of a client request that
was admitted already. Any other caller is treated as a client: with `enable_api_key` it needs a valid
key, and it is admitted like any request (the route runs a full generation when asked for a decode).
Instance host names are resolved and cached (serving/resolve.py); a caller that matches no cached
address makes names older than `RECHECK_AFTER_S` resolve again (an engine pod restarted with a new
address). The check trusts the host: anything that reaches the Coordinator from an engine's address
(a proxy on an engine host, traffic NATed to a node IP that an engine is registered by) counts as that
engine.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

from sanic import Blueprint, Request

from errors import OPENAI
from handlers.lifetime import serve_inference
from handlers.planes import INFER, check_plane
from serving.job import METASERVER
from serving.resolve import RECHECK_AFTER_S, RESOLVED_FOR_S, addresses, normal

bp = Blueprint("metaserver")


@bp.post(METASERVER, ctx_plane=INFER, ctx_self_guarded=True, stream=True)
async def metaserver(request: Request):
    check_plane(request, INFER)
    engine = await from_registered_instance(request)
    return await serve_inference(request, METASERVER, OPENAI, from_client=not engine)


async def from_registered_instance(request: Request) -> bool:
    """Does the call come from the host of a registered instance?"""
    hosts = {urlsplit(t.url).hostname or "" for t in request.app.ctx.registry.view().targets}
    return await is_instance_address(request.conn_info.client_ip if request.conn_info else "", hosts)


async def is_instance_address(caller: str, hosts: set[str]) -> bool:
    """Is `caller` (an IP address) one of `hosts` (IP addresses and names, resolved here)?"""
    caller = normal(caller)
    if not caller:
        return False
    names = []
    for host in hosts:
        ip = normal(host)
        if ip == caller:
            return True
        if host and not ip:
            names.append(host)
    if not names:
        return False
    for max_age_s in (RESOLVED_FOR_S, RECHECK_AFTER_S):
        for found in await asyncio.gather(*(addresses(name, max_age_s) for name in names)):
            if caller in found:
                return True
    return False
