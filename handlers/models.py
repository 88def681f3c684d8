"""GET /v1/models: the served models with their SLO budgets and live, healthy instance counts."""

from sanic import Blueprint, Request, json

from errors import OPENAI, CoordinatorError
from handlers.common import INFER, check_api_key, error_response, request_id

bp = Blueprint("models")


@bp.get("/v1/models", ctx_plane=INFER)
async def list_models(request: Request):
    rid = request_id(request)
    try:
        check_api_key(request, OPENAI)
    except CoordinatorError as e:
        return error_response(e, OPENAI, rid)
    ctx = request.app.ctx
    view = ctx.registry.view()
    health = ctx.health
    models = {m.id: m for m in ctx.settings.models}
    data = []
    for name in dict.fromkeys([*models, *view.models()]):
        m = models.get(name)

        def live(role: str) -> int:
            insts = {t.instance_id for t in view.pool(name, role) if health.is_healthy(t.slot)}
            return len(insts)

        union = live("union")
        data.append(
            {
                "id": name,
                "object": "model",
                "owned_by": "motor",
                "p_max_seqlen": m.p_max_seqlen if m else 8192,
                "d_max_seqlen": m.d_max_seqlen if m else 8192,
                "slo_ttft": m.slo_ttft_ms if m else 1000,
                "slo_tpot": m.slo_tpot_ms if m else 50,
                "p_instances_num": live("prefill") + union,
                "d_instances_num": live("decode") + union,
                "created": ctx.started_at,
            }
        )
    return json({"object": "list", "data": data}, headers={"X-Request-Id": rid})
