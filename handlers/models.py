"""GET /v1/models and GET /v1/models/{model}: the served models with their SLO budgets and live, healthy
instance counts (the second is the SDKs' `models.retrieve`; ids may hold slashes, as Hugging Face names
do).

The path is the same for OpenAI and Anthropic clients; an `anthropic-version` header (which the Anthropic
SDK always sends) selects Anthropic's shape (`type`, `display_name`, `created_at`, and the list's paging
fields), its authentication header (`x-api-key` too, checked by the guard) and its error envelope
(handlers/sink.py's api_of). The Coordinator's own fields are in both.
"""

import time
from urllib.parse import unquote

from sanic import Blueprint, Request, json

from errors import ANTHROPIC, Api, NotFound
from handlers.ids import request_id
from handlers.planes import INFER
from handlers.sink import api_of

bp = Blueprint("models")


def _entries(ctx, api: Api) -> dict[str, dict]:
    """Every served model's entry, by id: the configured models, then any other an instance names."""
    view = ctx.registry.view()
    health = ctx.health
    models = {m.id: m for m in ctx.live.s.models}
    created_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ctx.started_at))  # Anthropic's RFC 3339
    out = {}
    for name in dict.fromkeys([*models, *view.models()]):
        m = models.get(name)

        def live(role: str, name: str = name) -> int:
            return len({t.instance_id for t in view.pool(name, role) if health.is_healthy(t.slot)})

        union = live("union")
        if api == ANTHROPIC:
            entry = {"type": "model", "id": name, "display_name": name, "created_at": created_at}
        else:
            entry = {"id": name, "object": "model", "owned_by": "motor", "created": ctx.started_at}
        out[name] = {
            **entry,
            "p_max_seqlen": m.p_max_seqlen if m else 8192,
            "d_max_seqlen": m.d_max_seqlen if m else 8192,
            "slo_ttft": m.slo_ttft_ms if m else 1000,
            "slo_tpot": m.slo_tpot_ms if m else 50,
            "p_instances_num": live("prefill") + union,
            "d_instances_num": live("decode") + union,
        }
    return out


@bp.get("/v1/models", ctx_plane=INFER)
async def list_models(request: Request):
    api, rid = api_of(request), request_id(request)
    data = list(_entries(request.app.ctx, api).values())
    if api == ANTHROPIC:  # one page holds them all
        first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
        body = {"data": data, "has_more": False, "first_id": first, "last_id": last}
    else:
        body = {"object": "list", "data": data}
    return json(body, headers=dict.fromkeys(api.id_headers, rid))


@bp.get("/v1/models/<model:path>", ctx_plane=INFER)
async def retrieve_model(request: Request, model: str):
    api, rid = api_of(request), request_id(request)
    model = unquote(model).strip("/")  # the SDKs send `org/name` as `org%2Fname`, which Sanic leaves encoded
    if not model:  # /v1/models/ names no model: the list
        return await list_models(request)
    entry = _entries(request.app.ctx, api).get(model)
    if entry is None:  # rendered by the app's error handler, in the same envelope
        raise NotFound(f"The model `{model}` does not exist.", param="model")
    return json(entry, headers=dict.fromkeys(api.id_headers, rid))
