"""The PD side, NixlConnector-style: a prefill leg's KV ticket (`kv_transfer_params`), the decode leg's pull
of it from P (or, in trigger mode, the prefill it asks the gateway's metaserver for), and the side channel
P serves those pulls and releases on (/sim/kv/*)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
from aiohttp import web

from .errors import ApiError
from .generation import Generation
from .request import SimRequest
from .state import SimState


def is_prefill_leg(sim: SimState, req: SimRequest) -> bool:
    kvp = req.kv_transfer_params
    return sim.cfg.role == "prefill" and bool(kvp and kvp.get("do_remote_decode"))


def is_decode_leg(sim: SimState, req: SimRequest) -> bool:
    kvp = req.kv_transfer_params
    return sim.cfg.role == "decode" and bool(kvp and kvp.get("do_remote_prefill"))


def prefill_leg_ticket(sim: SimState, req: SimRequest, g: Generation) -> dict | None:
    """The kv_transfer_params a prefill leg answers: a held ticket when it ended on the length cap, else None."""
    if not is_prefill_leg(sim, req):
        return None
    if g.finish[0] != "length":
        sim.engine.stats["prefill_without_ticket"] += 1
        return None
    t = sim.engine.issue_ticket(req.id, req.prompt_tokens, time.monotonic())
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [list(t.block_ids)],
        "remote_engine_id": sim.cfg.engine_id,
        "remote_request_id": req.id,
        "remote_host": sim.cfg.host,
        "remote_port": sim.port,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": req.prompt_tokens,
        "remote_blocks_expiry_time": None,
        "transfer_mode": "pull",
        "remote_prefill_cached_tokens": 0,
        **sim.cfg.ticket_extra,
    }


async def pull_remote_prefill(sim: SimState, req: SimRequest) -> int:
    """A decode leg's KV pull from P: the number of prompt tokens obtained (0 = recompute them)."""
    kvp = req.kv_transfer_params
    eng = sim.engine
    if kvp.get("metaserver") and not kvp.get("remote_request_id"):
        kvp = await _trigger_prefill(sim, req, kvp)
    host, port = kvp.get("remote_host"), kvp.get("remote_port")
    rid = kvp.get("remote_request_id")
    if not host or not port or not rid:
        eng.stats["recomputes"] += 1
        return 0
    t0 = time.monotonic()
    try:
        async with sim.session.post(
            f"http://{host}:{port}/sim/kv/pull",
            json={"remote_request_id": rid, "remote_engine_id": kvp.get("remote_engine_id")},
        ) as r:
            status = r.status
            data = await r.json(content_type=None) if status == 200 else None
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        eng.stats["remote_kv_unreachable"] += 1
        raise ApiError(
            500, f"KV transfer from {host}:{port} failed: {type(e).__name__}", "InternalServerError"
        ) from None
    if status != 200 or not isinstance(data, dict):
        eng.stats["recomputes"] += 1
        return 0
    n = int(kvp.get("remote_num_tokens") or data.get("num_tokens") or 0)
    n = min(n, req.prompt_tokens)
    cfg = sim.cfg
    if cfg.kv_transfer_tokens_per_s > 0 and not cfg.zero_latency:
        await asyncio.sleep(n / cfg.kv_transfer_tokens_per_s / cfg.speedup)
    eng.xfer.observe(time.monotonic() - t0)
    eng.stats["remote_kv_hits"] += 1
    return n


async def _trigger_prefill(sim: SimState, req: SimRequest, kvp: dict) -> dict:
    """Trigger mode: ask the gateway's metaserver for the prefill; returns P's ticket ({} = none)."""
    body = {k: v for k, v in req.body.items() if k in ("model", "messages", "prompt")}
    body["stream"] = False
    body["kv_transfer_params"] = {
        "request_id": kvp.get("request_id") or req.id,
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": kvp.get("remote_engine_id"),
        "remote_host": kvp.get("remote_host"),
        "remote_port": kvp.get("remote_port"),
    }
    try:
        async with sim.session.post(kvp["metaserver"], json=body) as r:
            data = await r.json(content_type=None) if r.status == 200 else None
            status = r.status
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as e:
        raise ApiError(
            500, f"metaserver {kvp['metaserver']} failed: {type(e).__name__}", "InternalServerError"
        ) from None
    sim.engine.stats["metaserver_calls"] += 1
    if status != 200 or not isinstance(data, dict):
        raise ApiError(500, f"metaserver answered HTTP {status}", "InternalServerError")
    ticket = data.get("kv_transfer_params")
    return ticket if isinstance(ticket, dict) else {}


async def _json_object(request: web.Request) -> dict:
    try:
        b = await request.json()
        return b if isinstance(b, dict) else {}
    except Exception:
        return {}


def add_side_channel_routes(router: web.UrlDispatcher, sim: SimState) -> None:
    """P's KV side channel: D pulls a held ticket, a gateway releases one, tests list them."""

    async def pull(request: web.Request) -> web.Response:
        b = await _json_object(request)
        rid = b.get("remote_request_id")
        eid = b.get("remote_engine_id")
        if eid not in (None, sim.cfg.engine_id):
            return web.json_response({"error": "unknown engine"}, status=404)
        t = sim.engine.pull_ticket(rid) if rid else None
        if t is None:
            return web.json_response({"error": "unknown, expired or already pulled"}, status=404)
        return web.json_response({"remote_request_id": rid, "num_tokens": t.tokens, "block_ids": t.block_ids})

    async def release(request: web.Request) -> web.Response:
        rid = (await _json_object(request)).get("remote_request_id")
        ok = sim.engine.release_ticket(rid) if rid else False
        return web.json_response({"released": ok}, status=200 if ok else 404)

    async def tickets(request: web.Request) -> web.Response:
        sim.engine.expire_tickets()
        return web.json_response(
            {rid: {"num_tokens": t.tokens, "block_ids": t.block_ids} for rid, t in sim.engine.tickets.items()}
        )

    router.add_post("/sim/kv/pull", pull)
    router.add_post("/sim/kv/release", release)
    router.add_get("/sim/kv/tickets", tickets)
