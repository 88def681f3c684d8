"""The simulated vLLM server: its aiohttp application, routes, lifecycle and test-control endpoints.

Inference routes are served by `inference` (shapes in `openai_serving` and `anthropic_serving`), the KV
side channel by `kv_transfer`, the fault knobs by `faults`; `/metrics` is rendered by `metrics`. What the routes
read and change, the server's state, is `state.SimState`, which SimServer extends.
"""

from __future__ import annotations

import uuid

import aiohttp
from aiohttp import web

from . import inference, responses_serving
from .config import SimConfig
from .json_text import dumps
from .kv_events import KvEventPublisher
from .kv_transfer import add_side_channel_routes
from .metrics import render
from .state import SimState


class SimServer(SimState):
    def __init__(self, cfg: SimConfig):
        super().__init__(cfg)
        self.runner: web.AppRunner | None = None
        self._models_body: str | None = None

    # ------------------------------------------------------------------ lifecycle
    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        r = app.router
        r.add_get("/health", self.serve_health)
        r.add_get("/v1/models", self.serve_models)
        r.add_get("/metrics", self.serve_metrics)
        r.add_post("/v1/chat/completions", self._inference_route("chat"))
        r.add_post("/v1/completions", self._inference_route("completions"))
        r.add_post("/v1/messages", self._inference_route("messages"))
        r.add_post("/v1/messages/count_tokens", self._inference_route("count_tokens"))
        r.add_post("/v1/responses", self._inference_route("responses"))
        r.add_post("/tokenize", self._inference_route("tokenize"))
        r.add_post("/detokenize", self._inference_route("detokenize"))
        responses_serving.add_routes(r, self)
        r.add_get("/sim/stats", self.serve_stats)
        r.add_get("/sim/requests", self.serve_requests)
        r.add_post("/sim/faults", self.serve_set_faults)
        r.add_delete("/sim/faults", self.serve_clear_faults)
        r.add_post("/sim/reset", self.serve_reset)
        r.add_post("/reset_prefix_cache", self.serve_reset_prefix_cache)
        add_side_channel_routes(r, self)
        return app

    def _inference_route(self, kind: str):
        async def handler(request: web.Request) -> web.StreamResponse:
            return await inference.serve(self, request, kind)

        return handler

    async def start(self):
        self.runner = web.AppRunner(self.build_app(), handler_cancellation=True, access_log=None, shutdown_timeout=0.5)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.cfg.host, self.cfg.port, reuse_address=True)
        await site.start()
        sock = site._server.sockets[0]  # type: ignore[union-attr]
        self.port = sock.getsockname()[1]
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10, connect=2))
        kv = self.cfg.kv_events
        if kv.get("enable_kv_cache_events") and kv.get("publisher", "zmq") == "zmq":
            self.engine.kv_events = KvEventPublisher(kv)
        if not self.cfg.zero_latency:
            self.engine.start()
        return self.runner

    async def stop(self):
        await self.engine.stop()
        if self.engine.kv_events is not None:
            self.engine.kv_events.close()
            self.engine.kv_events = None
        if self.session:
            await self.session.close()
        if self.runner:
            await self.runner.cleanup()

    # ------------------------------------------------------------------ test control
    def set_faults(self, **knobs):
        self.faults.set(**knobs)

    def clear_faults(self):
        self.faults.clear()

    def reset(self):
        self.records.clear()
        self.engine.reset_stats()

    def stats(self) -> dict:
        return self.engine.snapshot()

    async def serve_stats(self, request):
        return web.json_response(self.stats())

    async def serve_requests(self, request):
        return web.json_response(self.records)

    async def serve_set_faults(self, request):
        try:
            knobs = await request.json()
            self.set_faults(**knobs)
        except Exception as e:
            return web.json_response({"error": str(e)}, status=400)
        return web.json_response({"faults": self.faults.knobs})

    async def serve_clear_faults(self, request):
        self.clear_faults()
        return web.json_response({"faults": self.faults.knobs})

    async def serve_reset(self, request):
        self.reset()
        return web.json_response({"ok": True})

    async def serve_reset_prefix_cache(self, request):
        # vLLM's (with VLLM_SERVER_DEV_MODE=1): drops every cached block, 200 with an empty body
        self.engine.prefix_reset()
        return web.Response(status=200)

    # ------------------------------------------------------------------ vLLM's other routes
    async def serve_health(self, request):
        if self.faults.dead:
            request.transport.abort()
            raise ConnectionResetError("the engine is dead (mid_stream_fault: die)")
        return web.Response(status=await self.faults.health_status())

    async def serve_models(self, request):
        if self._models_body is None:
            self._models_body = dumps({"object": "list", "data": [self._model_card()]})
        return web.Response(text=self._models_body, content_type="application/json")

    def _model_card(self) -> dict:
        c = self.created
        permission = {
            "id": "modelperm-" + uuid.uuid4().hex,
            "object": "model_permission",
            "created": c,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
        return {
            "id": self.cfg.model,
            "object": "model",
            "created": c,
            "owned_by": "vllm",
            "root": self.cfg.model,
            "parent": None,
            "max_model_len": self.cfg.max_model_len,
            "permission": [permission],
        }

    async def serve_metrics(self, request):
        return web.Response(text=render(self), content_type="text/plain", charset="utf-8", headers={"X-Sim": "1"})
