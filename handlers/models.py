"""GET /v1/models and GET /v1/models/{model}: the served models with their SLO budgets and live, healthy
instance counts (the second is the OpenAI SDK's `models.retrieve`; ids may hold slashes, as Hugging Face
names do)."""

from urllib.parse import unquote

from sanic import Blueprint, Request, json

from errors import OPENAI, CoordinatorError, NotFound
from handlers.common import INFER, check_api_key, error_response, request_id

bp = Blueprint("models")


def _entries(ctx) -> dict[str, dict]:
    """Every served model's /v1/models entry, by id: the configured models, then any other an instance names."""
    view = ctx.registry.view()
    health = ctx.health
    models = {m.id: m for m in ctx.settings.models}
    out = {}
    for name in dict.fromkeys([*models, *view.models()]):
        m = models.get(name)

        def live(role: str) -> int:
            return len({t.instance_id for t in view.pool(name, role) if health.is_healthy(t.slot)})

        union = live("union")
        out[name] = {
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
    return out


@bp.get("/v1/models", ctx_plane=INFER)
async def list_models(request: Request):
    rid = request_id(request)
    try:
        check_api_key(request, OPENAI)
    except CoordinatorError as e:
        return error_response(e, OPENAI, rid)
    return json({"object": "list", "data": list(_entries(request.app.ctx).values())}, headers={"X-Request-Id": rid})


@bp.get("/v1/models/<model:path>", ctx_plane=INFER)
async def retrieve_model(request: Request, model: str):
    rid = request_id(request)
    model = unquote(model).strip("/")  # the SDK sends `org/name` as `org%2Fname`, which Sanic leaves encoded
    if not model:  # /v1/models/ : the list, as before this route existed
        return await list_models(request)
    try:
        check_api_key(request, OPENAI)
        entry = _entries(request.app.ctx).get(model)
        if entry is None:
            raise NotFound(f"The model `{model}` does not exist.", param="model")
    except CoordinatorError as e:
        return error_response(e, OPENAI, rid)
    return json(entry, headers={"X-Request-Id": rid})
