"""POST /v1/metaserver: engines ask the Coordinator to run the other half of a PD request.

The target is always a registered instance: one named by `remote_host`/`remote_port` or
`remote_engine_id` must be registered with the right role, or the call is refused with 403 and nothing
is sent anywhere; one named by nothing is picked by the scheduler.

Engines send no API key. With `enable_api_key` on, a call is let in when it comes from the address of
a registered instance (names resolved, and cached for `RESOLVED_FOR_S`) or carries a valid key; any
other caller gets 401, as on the other inference routes: the route runs a full generation when asked
for a decode, so it must not be a way around the keys. A call is not admitted again (in-flight cap,
rate limit, drain): it is half of a client request admitted already.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from urllib.parse import urlsplit

from sanic import Blueprint, Request

from errors import OPENAI
from handlers.common import INFER, check_api_key, check_plane, serve_inference
from serving.job import METASERVER

bp = Blueprint("metaserver")

RESOLVED_FOR_S = 60.0
_resolved: dict[str, tuple[float, frozenset[str]]] = {}  # per worker: host name -> (when, its addresses)


@bp.post(METASERVER, ctx_plane=INFER, ctx_self_guarded=True, stream=True)
async def metaserver(request: Request):
    check_plane(request, INFER)
    if request.app.ctx.settings.api_key.enable_api_key and not await from_registered_instance(request):
        check_api_key(request, OPENAI)
    return await serve_inference(request, METASERVER, OPENAI, from_client=False)


async def from_registered_instance(request: Request) -> bool:
    """Does the call come from the host of a registered instance?"""
    caller = request.conn_info.client_ip if request.conn_info else ""
    if not caller:
        return False
    hosts = {urlsplit(t.url).hostname or "" for t in request.app.ctx.registry.view().targets}
    if caller in hosts:
        return True
    names = [h for h in hosts if h and not _is_ip(h)]
    for addresses in await asyncio.gather(*(_addresses(h) for h in names)):
        if caller in addresses:
            return True
    return False


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


async def _addresses(host: str) -> frozenset[str]:
    now = time.monotonic()
    cached = _resolved.get(host)
    if cached is not None and now - cached[0] < RESOLVED_FOR_S:
        return cached[1]
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
        addresses = frozenset(info[4][0] for info in infos)
    except OSError:
        addresses = frozenset()
    _resolved[host] = (now, addresses)
    return addresses
