"""aiohttp application of the simulated vLLM server (routes, shapes, faults, PD)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import uuid
from decimal import Decimal, InvalidOperation
from typing import Any

import aiohttp
from aiohttp import web

try:
    import ujson as _fastjson

    def dumps(o) -> str:
        return _fastjson.dumps(o, ensure_ascii=False, escape_forward_slashes=False)
except Exception:  # pragma: no cover

    def dumps(o) -> str:
        return json.dumps(o, ensure_ascii=False, separators=(",", ":"))


from . import tokens as T
from .config import FAULT_KNOBS, SimConfig
from .engine import Engine, Seq

log = logging.getLogger("engine_sim")

SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, etype: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.etype, self.param = status, message, etype, param
        self.raw_body: str | None = None  # an injected failure's body, sent as it is (`fail_body`)
        self.headers: dict[str, str] = {}  # an injected failure's extra headers (`fail_retry_after`)


def openai_error(status: int, message: str, etype: str, param=None) -> web.Response:
    body = {"error": {"message": message, "type": etype, "param": param, "code": status}}
    return web.Response(status=status, text=dumps(body), content_type="application/json")


def anthropic_error(status: int, message: str, etype: str) -> web.Response:
    body = {"type": "error", "error": {"type": etype, "message": message}}
    return web.Response(status=status, text=dumps(body), content_type="application/json")


def pydantic_style_error(loc: tuple, msg: str, etype: str, inp: Any = None) -> ApiError:
    """vLLM's RequestValidationError handler: type 'Bad Request', param = dotted loc."""
    err = {"type": etype, "loc": ("body",) + tuple(loc), "msg": msg, "input": inp}
    message = "1 validation error:\n  " + repr(err)
    return ApiError(400, message, "Bad Request", ".".join(("body",) + tuple(str(x) for x in loc)))


def pydantic_int(v: Any, loc: tuple) -> int:
    """An `int` field as pydantic's lax mode reads it (vLLM's request models): a bool is 0 or 1, an integral
    float or a string of an integer (or of an integral float) is taken; anything else is its 400."""
    if isinstance(v, int):
        return int(v)
    if not isinstance(v, (str, float)):
        raise pydantic_style_error(loc, "Input should be a valid integer", "int_type", v)
    try:
        exact = Decimal(v.strip() if isinstance(v, str) else v)
    except InvalidOperation:
        exact = None
    if exact is not None and exact.is_finite() and exact == exact.to_integral_value():
        return int(exact)
    if isinstance(v, str):
        raise pydantic_style_error(
            loc, "Input should be a valid integer, unable to parse string as an integer", "int_parsing", v
        )
    raise pydantic_style_error(
        loc, "Input should be a valid integer, got a number with a fractional part", "int_from_float", v
    )


_BOOL_WORDS = {
    "0": False,
    "off": False,
    "f": False,
    "false": False,
    "n": False,
    "no": False,
    "1": True,
    "on": True,
    "t": True,
    "true": True,
    "y": True,
    "yes": True,
}


def pydantic_bool(v: Any, loc: tuple) -> bool:
    """A `bool` field as pydantic's lax mode reads it: a bool, 0 or 1, or one of its words ("true", "no", ...)."""
    if isinstance(v, bool):
        return v
    if isinstance(v, (int, float)) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in _BOOL_WORDS:
        return _BOOL_WORDS[v.strip().lower()]
    raise pydantic_style_error(loc, "Input should be a valid boolean", "bool_parsing", v)


def _thinking_budget(th: Any) -> int | None:
    """`thinking` as vLLM 0.32's AnthropicThinkingConfig validates it; the budget of an enabled one, else None.

    `budget_tokens` is `int = Field(ge=1024)` in pydantic's lax mode: an integral float or a numeric
    string is taken, a bool is 0 or 1.
    """
    if th is None:
        return None
    if not isinstance(th, dict):
        raise pydantic_style_error(
            ("thinking",),
            "Input should be a valid dictionary or object to extract fields from",
            "model_attributes_type",
            th,
        )
    kind = th.get("type")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise pydantic_style_error(
            ("thinking",),
            f"Input tag '{kind}' found using 'type' does not "
            "match any of the expected tags: 'enabled', 'disabled', 'adaptive'",
            "union_tag_invalid",
            th,
        )
    if kind != "enabled":
        return None
    loc = ("thinking", "enabled", "budget_tokens")
    if "budget_tokens" not in th:
        raise pydantic_style_error(loc, "Field required", "missing", th)
    b = pydantic_int(th["budget_tokens"], loc)
    if b < 1024:
        raise pydantic_style_error(
            loc, "Input should be greater than or equal to 1024", "greater_than_equal", th["budget_tokens"]
        )
    return int(b)


def _schema_value(schema: Any, depth: int = 0) -> Any:
    if not isinstance(schema, dict) or depth > 3:
        return "sample"
    if schema.get("enum"):
        return schema["enum"][0]
    t = schema.get("type")
    if isinstance(t, list):
        t = next((x for x in t if x != "null"), "string")
    if t == "integer":
        return 1
    if t == "number":
        return 1.5
    if t == "boolean":
        return True
    if t == "array":
        return [_schema_value(schema.get("items"), depth + 1)] if schema.get("items") else []
    if t == "object" or "properties" in schema:
        return {k: _schema_value(v, depth + 1) for k, v in (schema.get("properties") or {}).items()}
    return "sample"


class Gen:
    """What one request will produce: choices of pieces plus accounting."""

    __slots__ = ("finish", "kinds", "pieces", "stop_reason", "texts", "thinking_n", "tool")

    def __init__(self):
        self.pieces: list[tuple[str, ...]] = []
        self.texts: list[str] = []
        self.finish: list[str] = []
        self.stop_reason: list[Any] = []
        self.kinds = None  # messages: per-piece block kind
        self.tool = None  # messages: (id, name, input)
        self.thinking_n = 0


class SimServer:
    def __init__(self, cfg: SimConfig):
        self.cfg = cfg
        self.engine = Engine(cfg)
        self.faults: dict[str, Any] = dict(cfg.faults or {})
        self.records: list[dict] = []
        self.port = cfg.port
        self.host = cfg.host
        self.created = int(time.time())
        self.session: aiohttp.ClientSession | None = None
        self.runner: web.AppRunner | None = None
        self._models_body = None

    # ------------------------------------------------------------------ lifecycle
    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        r = app.router
        r.add_get("/health", self.h_health)
        r.add_get("/v1/models", self.h_models)
        r.add_get("/metrics", self.h_metrics)
        r.add_post("/v1/chat/completions", self.h_chat)
        r.add_post("/v1/completions", self.h_completions)
        r.add_post("/v1/messages", self.h_messages)
        r.add_post("/v1/messages/count_tokens", self.h_count_tokens)
        r.add_get("/sim/stats", self.h_sim_stats)
        r.add_get("/sim/requests", self.h_sim_requests)
        r.add_post("/sim/faults", self.h_sim_faults)
        r.add_delete("/sim/faults", self.h_sim_faults_clear)
        r.add_post("/sim/reset", self.h_sim_reset)
        r.add_post("/sim/kv/pull", self.h_kv_pull)
        r.add_post("/sim/kv/release", self.h_kv_release)
        r.add_get("/sim/kv/tickets", self.h_kv_tickets)
        return app

    async def start(self):
        self.runner = web.AppRunner(self.build_app(), handler_cancellation=True, access_log=None, shutdown_timeout=0.5)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.cfg.host, self.cfg.port, reuse_address=True)
        await site.start()
        sock = site._server.sockets[0]  # type: ignore[union-attr]
        self.port = sock.getsockname()[1]
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10, connect=2))
        if not self.cfg.zero_latency:
            self.engine.start()
        return self.runner

    async def stop(self):
        await self.engine.stop()
        if self.session:
            await self.session.close()
        if self.runner:
            await self.runner.cleanup()

    # ------------------------------------------------------------------ faults / records
    def set_faults(self, **knobs):
        unknown = set(knobs) - set(FAULT_KNOBS)
        if unknown:
            raise ValueError(f"unknown fault knobs: {sorted(unknown)}")
        for k, v in knobs.items():
            if v is None:
                self.faults.pop(k, None)
            else:
                self.faults[k] = v

    def clear_faults(self):
        self.faults.clear()

    def reset(self):
        self.records.clear()
        self.engine.reset_stats()

    def stats(self) -> dict:
        return self.engine.snapshot()

    # ------------------------------------------------------------------ simple routes
    async def h_health(self, request):
        slow = self.faults.get("slow_health_s")
        if slow:
            await asyncio.sleep(float(slow))
        st = self.faults.get("health_status")
        if st:
            return web.Response(status=int(st))
        return web.Response(status=200)

    async def h_models(self, request):
        if self._models_body is None:
            c = self.created
            self._models_body = dumps(
                {
                    "object": "list",
                    "data": [
                        {
                            "id": self.cfg.model,
                            "object": "model",
                            "created": c,
                            "owned_by": "vllm",
                            "root": self.cfg.model,
                            "parent": None,
                            "max_model_len": self.cfg.max_model_len,
                            "permission": [
                                {
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
                            ],
                        }
                    ],
                }
            )
        return web.Response(text=self._models_body, content_type="application/json")

    async def h_metrics(self, request):
        from .metrics import render

        return web.Response(text=render(self), content_type="text/plain", charset="utf-8", headers={"X-Sim": "1"})

    async def h_sim_stats(self, request):
        return web.json_response(self.stats())

    async def h_sim_requests(self, request):
        return web.json_response(self.records)

    async def h_sim_faults(self, request):
        try:
            knobs = await request.json()
            self.set_faults(**knobs)
        except Exception as e:
            return web.json_response({"error": str(e)}, status=400)
        return web.json_response({"faults": self.faults})

    async def h_sim_faults_clear(self, request):
        self.clear_faults()
        return web.json_response({"faults": self.faults})

    async def h_sim_reset(self, request):
        self.reset()
        return web.json_response({"ok": True})

    async def _kv_body(self, request):
        try:
            b = await request.json()
            return b if isinstance(b, dict) else {}
        except Exception:
            return {}

    async def h_kv_pull(self, request):
        b = await self._kv_body(request)
        rid = b.get("remote_request_id")
        eid = b.get("remote_engine_id")
        if eid not in (None, self.cfg.engine_id):
            return web.json_response({"error": "unknown engine"}, status=404)
        t = self.engine.pull_ticket(rid) if rid else None
        if t is None:
            return web.json_response({"error": "unknown, expired or already pulled"}, status=404)
        return web.json_response({"remote_request_id": rid, "num_tokens": t.tokens, "block_ids": t.block_ids})

    async def h_kv_release(self, request):
        b = await self._kv_body(request)
        rid = b.get("remote_request_id")
        ok = self.engine.release_ticket(rid) if rid else False
        return web.json_response({"released": ok}, status=200 if ok else 404)

    async def h_kv_tickets(self, request):
        self.engine.expire_tickets()
        return web.json_response(
            {rid: {"num_tokens": t.tokens, "block_ids": t.block_ids} for rid, t in self.engine.tickets.items()}
        )

    # ------------------------------------------------------------------ inference routes
    async def h_chat(self, request):
        return await self._infer(request, "chat")

    async def h_completions(self, request):
        return await self._infer(request, "completions")

    async def h_messages(self, request):
        return await self._infer(request, "messages")

    async def h_count_tokens(self, request):
        return await self._infer(request, "count_tokens")

    def _error(self, kind: str, e: ApiError) -> web.Response:
        if e.raw_body is not None:
            resp = web.Response(status=e.status, text=e.raw_body, content_type="application/json")
        elif kind in ("messages", "count_tokens") and e.etype != "Bad Request":
            resp = anthropic_error(e.status, e.message, e.etype)
        else:
            resp = openai_error(e.status, e.message, e.etype, e.param)
        resp.headers.update(e.headers)
        return resp

    async def _read(self, request, kind) -> tuple[dict, ApiError | None]:
        raw = await request.read()
        hdrs = dict(request.headers.items())
        try:
            body = json.loads(raw) if raw else None
        except Exception as e:
            body = None
            pos = getattr(e, "pos", 0)
            detail = {
                "type": "json_invalid",
                "loc": f"body.{pos}",
                "msg": "JSON decode error",
                "input": "<dict of 0 items>",
                "ctx": {"error": getattr(e, "msg", str(e))},
            }
            err = ApiError(400, "1 validation error:\n  " + repr(detail), "Bad Request", f"body.{pos}")
            self.records.append(
                {
                    "path": request.path,
                    "headers": hdrs,
                    "body": None,
                    "raw": raw.decode("utf-8", "replace"),
                    "time": time.time(),
                }
            )
            return {}, err
        self.records.append({"path": request.path, "headers": hdrs, "body": body, "time": time.time()})
        if not isinstance(body, dict):
            return {}, pydantic_style_error((), "Input should be a valid dictionary", "model_attributes_type", body)
        return body, None

    async def _apply_pre_faults(self, kind):
        f = self.faults
        if f.get("fail_status"):
            raise self._injected_failure(int(f["fail_status"]))
        n = f.get("fail_first_n")
        if n:
            f["fail_first_n"] = int(n) - 1
            raise self._injected_failure(int(f.get("fail_status") or 500))
        if f.get("hang_before_first_byte"):
            await asyncio.Event().wait()
        s = f.get("slow_first_byte_s")
        if s:
            await asyncio.sleep(float(s))

    def _injected_failure(self, status: int) -> ApiError:
        e = ApiError(status, f"simulated failure (status {status})", _etype(status))
        if self.faults.get("fail_body") is not None:
            e.raw_body = str(self.faults["fail_body"])
        if self.faults.get("fail_retry_after") is not None:
            e.headers["Retry-After"] = str(self.faults["fail_retry_after"])
        return e

    async def _infer(self, request: web.Request, kind: str):
        eng = self.engine
        body, err = await self._read(request, kind)
        if kind != "count_tokens":
            eng.stats["received"] += 1
        xrid = request.headers.get("X-Request-Id")
        hdrs = {"X-Request-Id": xrid} if xrid else {}
        try:
            if err:
                raise err
            if kind != "count_tokens":
                await self._apply_pre_faults(kind)
            if kind == "count_tokens":
                return self._count_tokens(body, hdrs)
            req = self._parse(kind, body)
        except (ApiError, UnicodeError) as e:
            if isinstance(e, UnicodeError):  # a lone surrogate, say: vLLM answers a ValueError in the prompt with 400
                e = ApiError(400, str(e), "BadRequestError")
            if kind != "count_tokens":
                eng.stats["failed"] += 1
            resp = self._error(kind, e)
            resp.headers.update(hdrs)
            return resp
        base = xrid or uuid.uuid4().hex
        req["id"] = ("cmpl-" if kind == "completions" else "chatcmpl-") + base
        req["log_id"] = xrid or req["id"]
        try:
            return await self._run(request, kind, req, hdrs)
        except ApiError as e:
            eng.stats["failed"] += 1
            resp = self._error(kind, e)
            resp.headers.update(hdrs)
            return resp

    # ------------------------------------------------------------------ parsing
    def _check_model(self, body, kind):
        m = body.get("model")
        if kind in ("messages", "count_tokens") and not m:
            raise pydantic_style_error(("model",), "Field required", "missing", body)
        if m is not None and not isinstance(m, str):
            raise pydantic_style_error(("model",), "Input should be a valid string", "string_type", m)
        if m and m != self.cfg.model:
            raise ApiError(
                404, f"The model `{m}` does not exist. Valid aliases: {self.cfg.model}.", "NotFoundError", "model"
            )

    def _count_tokens(self, body, hdrs):
        self._check_model(body, "count_tokens")
        msgs = body.get("messages")
        if not isinstance(msgs, list):
            raise pydantic_style_error(
                ("messages",), "Field required" if msgs is None else "Input should be a valid list", "missing", body
            )
        n = T.chat_prompt_tokens(
            self._anthropic_messages(msgs), tools=self._anthropic_tools(body), system=body.get("system")
        )
        return web.Response(
            text=dumps({"input_tokens": n, "context_management": {"original_input_tokens": n}}),
            content_type="application/json",
            headers=hdrs,
        )

    @staticmethod
    def _anthropic_messages(msgs):
        return [m for m in msgs if isinstance(m, dict)]

    @staticmethod
    def _anthropic_tools(body):
        tools = body.get("tools")
        if not tools:
            return None
        return [
            {
                "type": "function",
                "function": {
                    "name": t.get("name"),
                    "description": t.get("description"),
                    "parameters": t.get("input_schema"),
                },
            }
            for t in tools
            if isinstance(t, dict)
        ]

    def _parse(self, kind: str, body: dict) -> dict:
        self._check_model(body, kind)
        req: dict[str, Any] = {"kind": kind, "body": body}
        stream = body.get("stream", False)
        if stream is not None and not isinstance(stream, bool):
            raise pydantic_style_error(("stream",), "Input should be a valid boolean", "bool_type", stream)
        req["stream"] = bool(stream)
        so = body.get("stream_options")
        if kind != "messages" and so is not None:
            if not isinstance(so, dict):
                raise pydantic_style_error(("stream_options",), "Input should be a valid dictionary", "model_type", so)
            if so and not stream:  # vLLM refuses only non-empty ones
                raise pydantic_style_error(
                    (), "Value error, Stream options can only be defined when `stream=True`.", "value_error", body
                )
        so = so or {}
        req["include_usage"] = bool(so.get("include_usage")) if kind != "messages" else True
        req["continuous_usage"] = bool(so.get("continuous_usage_stats")) if kind != "messages" else False

        if kind == "chat":
            msgs = body.get("messages")
            if msgs is None:
                raise pydantic_style_error(("messages",), "Field required", "missing", body)
            if not isinstance(msgs, list):
                raise pydantic_style_error(("messages",), "Input should be a valid list", "list_type", msgs)
            for i, m in enumerate(msgs):
                if not isinstance(m, dict) or "role" not in m:
                    raise pydantic_style_error(
                        ("messages", i), "Input should be a valid message with a role", "model_type", m
                    )
            tools = body.get("tools")
            if tools is not None and not isinstance(tools, list):
                raise pydantic_style_error(("tools",), "Input should be a valid list", "list_type", tools)
            req["prompt_text"] = T.render_chat_prompt(msgs, tools=tools)
            req["prompt_tokens"] = T.count_text_tokens(req["prompt_text"])
            mt = body.get("max_completion_tokens")
            if mt is None:
                mt = body.get("max_tokens")
        elif kind == "completions":
            prompt = body.get("prompt")
            if prompt is None:
                raise pydantic_style_error(("prompt",), "Field required", "missing", body)
            if not isinstance(prompt, (str, list)) or (isinstance(prompt, list) and not prompt):
                raise pydantic_style_error(("prompt",), "Input should be a valid string or list", "string_type", prompt)
            if isinstance(prompt, list) and not all(isinstance(x, int) for x in prompt) and len(prompt) > 1:
                raise ApiError(
                    400,
                    "Sim serves one prompt per request; batched prompts are not supported",
                    "BadRequestError",
                    "prompt",
                )
            if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
                prompt = prompt[0]
            req["prompt_text"] = T.completion_prompt_text(prompt)
            req["prompt_tokens"] = T.completion_prompt_tokens(prompt)
            mt = body.get("max_tokens", 16)
        else:  # messages
            msgs = body.get("messages")
            if msgs is None:
                raise pydantic_style_error(("messages",), "Field required", "missing", body)
            if not isinstance(msgs, list):
                raise pydantic_style_error(("messages",), "Input should be a valid list", "list_type", msgs)
            for i, m in enumerate(msgs):
                if (
                    not isinstance(m, dict)
                    or m.get("role") not in ("user", "assistant", "system", "ctx", "msg")
                    or not isinstance(m.get("content"), (str, list))
                ):
                    raise pydantic_style_error(("messages", i), "Input should be a valid message", "model_type", m)
            mt = body.get("max_tokens")
            if mt is None:
                raise pydantic_style_error(("max_tokens",), "Field required", "missing", body)
            mt = pydantic_int(mt, ("max_tokens",))
            if mt <= 0:
                raise pydantic_style_error(
                    ("max_tokens",), "Value error, max_tokens must be positive", "value_error", mt
                )
            tools = self._anthropic_tools(body)
            req["prompt_text"] = T.render_chat_prompt(
                self._anthropic_messages(msgs), tools=tools, system=body.get("system")
            )
            req["prompt_tokens"] = T.count_text_tokens(req["prompt_text"])
            tc = body.get("tool_choice")
            if tc is not None and (not isinstance(tc, dict) or tc.get("type") not in ("auto", "any", "tool", "none")):
                raise pydantic_style_error(("tool_choice",), "Input should be a valid tool choice", "model_type", tc)
            if isinstance(tc, dict) and tc.get("type") == "tool" and not tc.get("name"):
                raise pydantic_style_error(
                    ("tool_choice",), "Value error, tool_choice.name is required when type is 'tool'", "value_error", tc
                )
            req["tool_choice"] = tc
            req["tools"] = [t for t in (body.get("tools") or []) if isinstance(t, dict)]
            th = body.get("thinking")
            budget = _thinking_budget(th)
            req["thinking"] = isinstance(th, dict) and th.get("type") in ("enabled", "adaptive")
            ss = body.get("stop_sequences")
            if ss is not None and (not isinstance(ss, list) or not all(isinstance(x, str) for x in ss)):
                raise pydantic_style_error(("stop_sequences",), "Input should be a valid list", "list_type", ss)
            body_stop = ss or []
            kvp = body.get("kv_transfer_params")
            # vLLM's validate_thinking_budget (a model validator: after every field passed) exempts
            # prefill legs, which are sent with max_tokens 1; the decode leg is still checked.
            if budget is not None and budget >= mt and not (isinstance(kvp, dict) and kvp.get("do_remote_decode")):
                raise pydantic_style_error(
                    (), "Value error, thinking.budget_tokens must be less than max_tokens", "value_error", body
                )
            if (
                isinstance(tc, dict)
                and tc.get("type") == "tool"
                and req["tools"]
                and not any(t.get("name") == tc["name"] for t in req["tools"])
            ):
                # the tool parser's adjust_request (get_json_schema_from_tools): a ValueError, 400
                raise ApiError(400, f"Tool '{tc['name']}' has not been passed in `tools`.", "BadRequestError")

        if mt is not None:
            mt = pydantic_int(mt, ("max_tokens",))
        # vLLM's echo without generation: `echo` and max_tokens 0 on completions run with max_tokens 1 and
        # answer the prompt alone (lm-eval-style prompt scoring).
        echo = kind != "messages" and pydantic_bool(body.get("echo", False), ("echo",))  # (not a Messages field)
        echo_only = kind == "completions" and echo and mt == 0
        if echo_only:
            mt = 1
        if mt is not None and mt < 1 and kind != "messages":
            raise ApiError(400, f"max_tokens must be at least 1, got {mt}.", "BadRequestError", "max_tokens")
        n = body.get("n", 1) if kind != "messages" else 1
        n = 1 if n is None else pydantic_int(n, ("n",))
        if n < 1:
            raise ApiError(400, f"n must be at least 1, got {n}.", "BadRequestError", "n")
        for key in ("temperature", "top_p"):
            v = body.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise pydantic_style_error((key,), "Input should be a valid number", "float_type", v)
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise pydantic_style_error(("seed",), "Input should be a valid integer", "int_type", seed)
        if kind != "messages":
            stop = body.get("stop")
            if stop is None:
                stop = []
            elif isinstance(stop, str):
                stop = [stop]
            elif not (isinstance(stop, list) and all(isinstance(x, str) for x in stop)):
                raise pydantic_style_error(("stop",), "Input should be a valid string or list", "string_type", stop)
            body_stop = stop
        mn = pydantic_int(body.get("min_tokens", 0), ("min_tokens",))  # null too is refused

        P, L = req["prompt_tokens"], self.cfg.max_model_len
        if P > L or (P == L and mt is None):
            raise ApiError(
                400,
                f"This model's maximum context length is {L} tokens. However, "
                f"your request has {P} input tokens. Please reduce the length of the "
                f"input messages.",
                "BadRequestError",
                "input_tokens",
            )
        if mt is not None and mt > L - P:
            raise ApiError(
                400,
                f"'max_tokens' or 'max_completion_tokens' is too large: {mt}. "
                f"This model's maximum context length is {L} tokens and your request "
                f"has {P} input tokens ({mt} > {L} - {P}).",
                "BadRequestError",
                "max_tokens",
            )
        req["max_tokens"] = mt if mt is not None else L - P
        req["n"] = n
        req["stop"] = tuple(body_stop)
        req["seed"] = seed
        t = body.get("temperature")
        req["temperature"] = float(t) if t is not None else None
        req["ignore_eos"] = bool(body.get("ignore_eos", False))
        req["min_tokens"] = mn
        req["echo"] = echo and kind == "completions"
        req["echo_only"] = echo_only
        lp = body.get("logprobs")
        if kind == "chat":
            req["logprobs"] = bool(lp)
            tlp = body.get("top_logprobs") or 0
            req["top_logprobs"] = int(tlp) if isinstance(tlp, int) else 0
        elif kind == "completions":
            req["logprobs"] = lp is not None and lp is not False
            req["top_logprobs"] = int(lp) if isinstance(lp, int) and not isinstance(lp, bool) else 0
        else:
            req["logprobs"] = False
            req["top_logprobs"] = 0
        kvp = body.get("kv_transfer_params")
        req["kvp"] = kvp if isinstance(kvp, dict) else None
        return req

    # ------------------------------------------------------------------ generation
    def _generate(self, req) -> Gen:
        g = Gen()
        pkey = T.prompt_key(req["prompt_text"])
        req["pkey"] = pkey
        role = self.cfg.role
        kvp = req["kvp"]
        remote_decode = role == "prefill" and kvp and kvp.get("do_remote_decode")
        req["remote_decode"] = bool(remote_decode)
        if remote_decode and self.faults.get("eos_on_prefill"):
            for _ in range(req["n"]):
                g.pieces.append(("",))
                g.texts.append("")
                g.finish.append("stop")
                g.stop_reason.append(None)
            return g
        if req["kind"] == "messages":
            return self._generate_messages(req, g, pkey)
        for c in range(req["n"]):
            pieces, text, fin, sr = T.generate(
                pkey,
                req["seed"],
                req["temperature"],
                c,
                req["max_tokens"],
                req["ignore_eos"],
                req["min_tokens"],
                req["stop"],
            )
            if req["echo_only"]:  # vLLM generates one token and answers the prompt alone
                pieces, text = tuple("" for _ in pieces), ""
            g.pieces.append(pieces)
            g.texts.append(text)
            g.finish.append(fin)
            g.stop_reason.append(sr)
        return g

    def _generate_messages(self, req, g: Gen, pkey) -> Gen:
        mt = req["max_tokens"]
        kinds: list[str] = []
        pieces: list[str] = []
        if req["thinking"]:
            th, _, _, _ = T.generate(pkey ^ 0x5A5A, req["seed"], req["temperature"], 0, min(8, mt), True, 0, ())
            g.thinking_n = len(th)
            pieces.extend(th)
            kinds.extend(["thinking"] * len(th))
        tc = req["tool_choice"] or {}
        tools = req["tools"]
        use_tool = bool(tools) and tc.get("type") != "none"
        finish, stop_reason = "stop", None
        if use_tool and len(pieces) < mt:
            tool = tools[0]
            if tc.get("type") == "tool":  # _parse made sure it is one of them
                tool = next(t for t in tools if t.get("name") == tc.get("name"))
            args = _schema_value(tool.get("input_schema") or {"type": "object"})
            if not isinstance(args, dict):
                args = {}
            tool_id = "chatcmpl-tool-" + T._h64("tool", req["id"]).to_bytes(8, "little").hex()
            g.tool = (tool_id, tool.get("name") or "", args)
            js = dumps(args)
            k = max(1, T.count_text_tokens(js))
            step = max(1, -(-len(js) // k)) if js else 1
            chunks = [js[i : i + step] for i in range(0, len(js), step)] or [""]
            while len(chunks) < k:
                chunks.append("")
            if len(pieces) + k > mt:  # cut by max_tokens: the call's first tokens only
                k = mt - len(pieces)
                finish = "length"
            pieces.extend(chunks[:k])
            kinds.extend(["tool"] * k)
            if finish != "length":
                finish = "tool_calls"
        else:
            rest = mt - len(pieces)
            if rest > 0:
                p2, text, finish, stop_reason = T.generate(
                    pkey, req["seed"], req["temperature"], 0, rest, req["ignore_eos"], req["min_tokens"], req["stop"]
                )
                pieces.extend(p2)
                kinds.extend(["text"] * len(p2))
            else:
                finish = "length"
        g.pieces.append(tuple(pieces))
        g.kinds = kinds
        g.texts.append("".join(p for p, k in zip(pieces, kinds) if k == "text"))
        g.finish.append(finish)
        g.stop_reason.append(stop_reason)
        return g

    # ------------------------------------------------------------------ PD (decode side)
    async def _pull_remote(self, req) -> int:
        """Returns the number of prompt tokens obtained from P (0 = recompute)."""
        kvp = req["kvp"]
        eng = self.engine
        if kvp.get("metaserver") and not kvp.get("remote_request_id"):
            kvp = await self._trigger_prefill(req, kvp)
        host, port = kvp.get("remote_host"), kvp.get("remote_port")
        rid = kvp.get("remote_request_id")
        if not host or not port or not rid:
            eng.stats["recomputes"] += 1
            return 0
        t0 = time.monotonic()
        try:
            async with self.session.post(
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
        n = min(n, req["prompt_tokens"])
        if self.cfg.kv_transfer_tokens_per_s > 0 and not self.cfg.zero_latency:
            await asyncio.sleep(n / self.cfg.kv_transfer_tokens_per_s / self.cfg.speedup)
        eng.xfer.observe(time.monotonic() - t0)
        eng.stats["remote_kv_hits"] += 1
        return n

    async def _trigger_prefill(self, req, kvp: dict) -> dict:
        """Trigger mode: ask the gateway's metaserver for the prefill; returns P's ticket ({} = none)."""
        body = {k: v for k, v in req["body"].items() if k in ("model", "messages", "prompt")}
        body["stream"] = False
        body["kv_transfer_params"] = {
            "request_id": kvp.get("request_id") or req["id"],
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": kvp.get("remote_engine_id"),
            "remote_host": kvp.get("remote_host"),
            "remote_port": kvp.get("remote_port"),
        }
        try:
            async with self.session.post(kvp["metaserver"], json=body) as r:
                data = await r.json(content_type=None) if r.status == 200 else None
                status = r.status
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as e:
            raise ApiError(
                500, f"metaserver {kvp['metaserver']} failed: {type(e).__name__}", "InternalServerError"
            ) from None
        self.engine.stats["metaserver_calls"] += 1
        if status != 200 or not isinstance(data, dict):
            raise ApiError(500, f"metaserver answered HTTP {status}", "InternalServerError")
        ticket = data.get("kv_transfer_params")
        return ticket if isinstance(ticket, dict) else {}

    # ------------------------------------------------------------------ run one request
    async def _run(self, request: web.Request, kind: str, req: dict, hdrs: dict):
        eng = self.engine
        cfg = self.cfg
        g = self._generate(req)
        remote_hit = 0
        kvp = req["kvp"]
        if cfg.role == "decode" and kvp and kvp.get("do_remote_prefill"):
            remote_hit = await self._pull_remote(req)
        hashes = T.block_hashes(req["prompt_text"], cfg.block_size)
        prefix_hit = 0
        if not remote_hit:
            prefix_hit = eng.prefix_match(hashes) * cfg.block_size
            prefix_hit = min(prefix_hit, max(req["prompt_tokens"] - 1, 0))
        cached = max(prefix_hit, remote_hit)
        eng.account_prompt(req["prompt_tokens"], prefix_hit if not remote_hit else 0, remote_hit)
        req["cached"] = cached
        out_lens = [len(p) for p in g.pieces]
        seq = Seq(req["id"], req["prompt_tokens"], cached, out_lens, hashes)
        if cfg.zero_latency:
            seq.emitted = seq.max_len
            seq.done = True
            eng.stats["generation_tokens"] += sum(out_lens)
            if hashes:
                eng.prefix_insert(hashes)
        else:
            eng.submit(seq)
        try:
            if req["stream"]:
                return await self._stream(request, kind, req, g, seq, hdrs)
            await _wait(seq, seq.max_len)
            body = self._final_body(kind, req, g, seq)
            eng.stats["completed"] += 1
            eng.success[g.finish[0]] += 1
            return web.Response(text=dumps(body), content_type="application/json", headers=hdrs)
        except (asyncio.CancelledError, ConnectionResetError, ConnectionError):
            self._on_abort(seq, req)
            raise

    def _on_abort(self, seq: Seq, req):
        if not seq.done:
            self.engine.abort(seq, req["log_id"])

    def _maybe_ticket(self, req, g: Gen) -> dict | None:
        if not req.get("remote_decode"):
            return None
        if g.finish[0] != "length":
            self.engine.stats["prefill_without_ticket"] += 1
            return None
        t = self.engine.issue_ticket(req["id"], req["prompt_tokens"], time.monotonic())
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(t.block_ids)],
            "remote_engine_id": self.cfg.engine_id,
            "remote_request_id": req["id"],
            "remote_host": self.cfg.host,
            "remote_port": self.port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": req["prompt_tokens"],
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": 0,
            **self.cfg.ticket_extra,
        }

    def _usage(self, req, completion: int, chat: bool, stream: bool = False) -> dict:
        """Usage as vLLM 0.32 started with --enable-prompt-tokens-details serializes it, field for field."""
        p = req["prompt_tokens"]
        details = {"cached_tokens": req["cached"]}
        if chat:
            details["created_cache_tokens"] = 0
        elif not stream:
            details["created_cache_tokens"] = None
        if not stream:
            details["multimodal_tokens"] = None
        usage = {
            "prompt_tokens": p,
            "total_tokens": p + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": details,
        }
        if not stream:
            usage["completion_tokens_details"] = None
        return usage

    def _anthropic_usage(self, req, completion: int) -> dict:
        """vLLM's _build_anthropic_usage: with cache details, `input_tokens` is the prompt less the cache
        reads and writes (Anthropic's total input is their sum). The sim reports no cache writes.
        (message_start is built from the stream's first chunk, which has no details: the whole prompt.)"""
        if not self.cfg.anthropic_cache_usage:
            return {"input_tokens": req["prompt_tokens"], "output_tokens": completion}
        return {
            "input_tokens": max(0, req["prompt_tokens"] - req["cached"]),
            "output_tokens": completion,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": req["cached"],
        }

    @property
    def fingerprint(self) -> str:
        """vLLM's `system_fingerprint`: the version and a hash of the engine's configuration."""
        return "vllm-0.32.0-" + hashlib.sha256(self.cfg.engine_id.encode()).hexdigest()[:8]

    def _chat_logprobs(self, req, c, pieces):
        if not req["logprobs"]:
            return None
        pk, k = req["pkey"], req["top_logprobs"]
        content = []
        for i, p in enumerate(pieces):
            lp = T.token_logprob(pk, c, i)
            top = [
                {
                    "token": p if r == 0 else T.token_word(pk, 1000 + r, None, c, i),
                    "logprob": T.token_logprob(pk, c, i, r),
                    "bytes": list((p if r == 0 else T.token_word(pk, 1000 + r, None, c, i)).encode()),
                }
                for r in range(k)
            ]
            content.append({"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": top})
        return {"content": content}

    def _cmpl_logprobs(self, req, c, pieces, offset0=0):
        if not req["logprobs"]:
            return None
        pk, k = req["pkey"], req["top_logprobs"]
        offs, lps, toks, tops = [], [], [], []
        off = offset0
        for i, p in enumerate(pieces):
            offs.append(off)
            off += len(p)
            lps.append(T.token_logprob(pk, c, i))
            toks.append(p)
            d = {p: T.token_logprob(pk, c, i)}
            for r in range(1, k):
                d.setdefault(T.token_word(pk, 1000 + r, None, c, i), T.token_logprob(pk, c, i, r))
            tops.append(d)
        return {"text_offset": offs, "token_logprobs": lps, "tokens": toks, "top_logprobs": tops}

    def _final_body(self, kind, req, g: Gen, seq: Seq) -> dict:
        completion = sum(len(p) for p in g.pieces)
        kvt = self._maybe_ticket(req, g)
        model = self.cfg.model
        created = int(time.time())
        if kind == "chat":
            choices = []
            for c, pieces in enumerate(g.pieces):
                choices.append(
                    {
                        "index": c,
                        "message": {
                            "role": "assistant",
                            "content": g.texts[c],
                            "refusal": None,
                            "annotations": None,
                            "audio": None,
                            "function_call": None,
                            "reasoning": None,
                        },
                        "logprobs": self._chat_logprobs(req, c, pieces),
                        "finish_reason": g.finish[c],
                        "stop_reason": g.stop_reason[c],
                        "token_ids": None,
                        "routed_experts": None,
                    }
                )
            return {
                "id": req["id"],
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": choices,
                "service_tier": None,
                "system_fingerprint": self.fingerprint,
                "usage": self._usage(req, completion, True),
                "prompt_logprobs": None,
                "prompt_token_ids": None,
                "prompt_text": None,
                "kv_transfer_params": kvt,
                "ec_transfer_params": None,
                "metrics": None,
            }
        if kind == "completions":
            choices = []
            for c, pieces in enumerate(g.pieces):
                text = (req["prompt_text"] + g.texts[c]) if req["echo"] else g.texts[c]
                choices.append(
                    {
                        "index": c,
                        "text": text,
                        "logprobs": self._cmpl_logprobs(req, c, pieces),
                        "finish_reason": g.finish[c],
                        "stop_reason": g.stop_reason[c],
                        "token_ids": None,
                        "prompt_logprobs": None,
                        "prompt_token_ids": None,
                        "routed_experts": None,
                    }
                )
            return {
                "id": req["id"],
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": choices,
                "service_tier": None,
                "system_fingerprint": self.fingerprint,
                "usage": self._usage(req, completion, False),
                "kv_transfer_params": kvt,
                "ec_transfer_params": None,
                "metrics": None,
            }
        # messages (vLLM dumps with exclude_none)
        content = []
        pieces, kinds = g.pieces[0], g.kinds or []
        tc = req["tool_choice"]
        if g.tool and g.finish[0] == "length" and isinstance(tc, dict) and tc.get("type") == "tool":
            # A named tool choice makes the whole answer the call's arguments, and vLLM's converter
            # json.loads them: a call cut by max_tokens raises a JSONDecodeError, a ValueError that
            # vLLM answers as 400 (after generating, and with any prefill leg's KV held for D).
            try:
                json.loads("".join(p for p, k in zip(pieces, kinds) if k == "tool"))
            except ValueError as e:
                raise ApiError(400, str(e), "BadRequestError") from None
        if g.thinking_n:
            content.append(
                {
                    "type": "thinking",
                    "thinking": "".join(p for p, k in zip(pieces, kinds) if k == "thinking"),
                    "signature": uuid.uuid4().hex,
                }
            )
        if g.texts[0]:
            content.append({"type": "text", "text": g.texts[0]})
        if g.tool and g.finish[0] == "tool_calls":
            content.append({"type": "tool_use", "id": g.tool[0], "name": g.tool[1], "input": g.tool[2]})
        if not content:  # vLLM's canonical empty completion: one empty text block
            content.append({"type": "text", "text": ""})
        out = {
            "id": req["id"],
            "type": "message",
            "role": "assistant",
            "content": content,
            "model": model,
            "stop_reason": _anthropic_stop(g)[0],
            "usage": self._anthropic_usage(req, completion),
        }
        if _anthropic_stop(g)[1] is not None:
            out["stop_sequence"] = _anthropic_stop(g)[1]
        if kvt is not None:
            out["kv_transfer_params"] = kvt
        return out

    # ------------------------------------------------------------------ streaming
    async def _stream(self, request, kind, req, g: Gen, seq: Seq, hdrs):
        eng = self.engine
        resp = web.StreamResponse(status=200, headers={**SSE_HEADERS, **hdrs})
        await resp.prepare(request)
        w = _Writer(self, request, resp)
        try:
            if kind == "messages":
                await self._stream_messages(w, req, g, seq)
            else:
                await self._stream_openai(w, kind, req, g, seq)
        except SimulatedClose:
            eng.drop(seq)
            return resp
        eng.stats["completed"] += 1
        eng.success[g.finish[0]] += 1
        await resp.write_eof()
        return resp

    async def _stream_openai(self, w, kind, req, g: Gen, seq: Seq):
        created = int(time.time())
        model = self.cfg.model
        rid = req["id"]
        chat = kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = f'{{"id":{dumps(rid)},"object":"{obj}","created":{created},"model":{dumps(model)},'
        cont = req["continuous_usage"] and req["include_usage"]
        done_tokens = [0] * len(g.pieces)

        def usage_now():
            return self._usage(req, sum(done_tokens), chat, stream=True)

        if chat:
            for c in range(len(g.pieces)):
                ch = {
                    "index": c,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                extra = f',"usage":{dumps(usage_now())}' if cont else ""
                await w.data(head + f'"choices":[{dumps(ch)}]{extra},"prompt_token_ids":null,"prompt_text":null}}')
        elif req["echo"]:
            for c in range(len(g.pieces)):
                ch = {
                    "index": c,
                    "text": req["prompt_text"],
                    "logprobs": None,
                    "finish_reason": None,
                    "stop_reason": None,
                }
                await w.data(head + f'"choices":[{dumps(ch)}]}}')
        total = seq.max_len
        # vLLM puts `system_fingerprint` on the stream's last chunk: the usage chunk, else the last choice chunk.
        final_k = max(len(p) for p in g.pieces)
        final = (final_k, max(c for c, p in enumerate(g.pieces) if len(p) == final_k))
        for k in range(1, total + 1):
            await _wait(seq, k)
            for c, pieces in enumerate(g.pieces):
                if len(pieces) < k:
                    continue
                i = k - 1
                piece = pieces[i]
                done_tokens[c] = k
                last = k == len(pieces)
                if not piece and not last:
                    continue
                lp = None
                if req["logprobs"]:
                    lp = self._chat_logprobs(req, c, [piece]) if chat else self._cmpl_logprobs(req, c, [piece])
                if chat:
                    ch = {
                        "index": c,
                        "delta": {"content": piece},
                        "logprobs": lp,
                        "finish_reason": g.finish[c] if last else None,
                    }
                else:
                    ch = {"index": c, "text": piece, "logprobs": lp, "finish_reason": g.finish[c] if last else None}
                if last:
                    ch["stop_reason"] = g.stop_reason[c]
                elif not chat:
                    ch["stop_reason"] = None
                if not chat:
                    ch["prompt_token_ids"] = None
                ch["token_ids"] = None
                extra = f',"usage":{dumps(usage_now())}' if cont else ""
                if (k, c) == final and not req["include_usage"]:
                    extra += f',"system_fingerprint":{dumps(self.fingerprint)}'
                await w.data(head + f'"choices":[{dumps(ch)}]{extra}}}')
        if req["include_usage"]:
            await w.data(
                head
                + f'"choices":[],"usage":{dumps(self._usage(req, sum(len(p) for p in g.pieces), chat, stream=True))},'
                f'"system_fingerprint":{dumps(self.fingerprint)}}}'
            )
        self._maybe_ticket(req, g)
        await w.raw(b"data: [DONE]\n\n")

    async def _stream_messages(self, w, req, g: Gen, seq: Seq):
        model = self.cfg.model
        P = req["prompt_tokens"]
        await w.event(
            "message_start",
            {
                "type": "message_start",
                "message": {
                    "id": req["id"],
                    "type": "message",
                    "role": "assistant",
                    "content": [],
                    "model": model,
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {"input_tokens": P, "output_tokens": 0},
                },
            },
        )
        pieces, kinds = g.pieces[0], g.kinds or []
        idx = -1
        cur = None
        signature = None
        for k in range(1, len(pieces) + 1):
            await _wait(seq, k)
            piece, kd = pieces[k - 1], kinds[k - 1]
            if not piece and kd != "tool":
                continue
            if kd != cur:
                if cur is not None:
                    await self._close_block(w, idx, cur, signature)
                idx += 1
                cur = kd
                if kd == "thinking":
                    signature = uuid.uuid4().hex
                    blk = {"type": "thinking", "thinking": ""}
                elif kd == "text":
                    blk = {"type": "text", "text": ""}
                else:
                    blk = {"type": "tool_use", "id": g.tool[0], "name": g.tool[1], "input": {}}
                await w.event(
                    "content_block_start", {"type": "content_block_start", "content_block": blk, "index": idx}
                )
            if not piece:
                continue
            if kd == "thinking":
                delta = {"type": "thinking_delta", "thinking": piece}
            elif kd == "text":
                delta = {"type": "text_delta", "text": piece}
            else:
                delta = {"type": "input_json_delta", "partial_json": piece}
            await w.event("content_block_delta", {"type": "content_block_delta", "delta": delta, "index": idx})
        if cur is not None:
            await self._close_block(w, idx, cur, signature)
        completion = len(pieces)
        await w.event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": _anthropic_stop(g)[0], "stop_sequence": _anthropic_stop(g)[1]},
                "usage": self._anthropic_usage(req, completion),
            },
        )
        self._maybe_ticket(req, g)
        await w.event("message_stop", {"type": "message_stop"})

    async def _close_block(self, w, idx, kind, signature):
        if kind == "thinking":
            await w.event(
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "delta": {"type": "signature_delta", "signature": signature},
                    "index": idx,
                },
            )
        await w.event("content_block_stop", {"type": "content_block_stop", "index": idx})


class SimulatedClose(Exception):
    """The close_mid_stream_after_n fault dropped the connection on purpose."""


_ANTH_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _anthropic_stop(g: Gen) -> tuple[str, str | None]:
    """vLLM's (stop_reason, stop_sequence): a matched stop string is reported as `stop_sequence`."""
    if g.finish[0] == "stop" and isinstance(g.stop_reason[0], str):
        return "stop_sequence", g.stop_reason[0]
    return _ANTH_STOP.get(g.finish[0], "end_turn"), None


def _etype(status: int) -> str:
    return {
        400: "BadRequestError",
        401: "AuthenticationError",
        403: "PermissionDeniedError",
        404: "NotFoundError",
        422: "UnprocessableEntityError",
        429: "RateLimitError",
        501: "NotImplementedError",
        503: "ServiceUnavailableError",
    }.get(status, "InternalServerError" if status >= 500 else "BadRequestError")


async def _wait(seq: Seq, k: int):
    while seq.emitted < k and not seq.aborted:
        seq.event.clear()
        if seq.emitted >= k:
            break
        await seq.event.wait()


class _Writer:
    """Writes SSE frames and applies the mid-stream fault knobs."""

    def __init__(self, server: SimServer, request: web.Request, resp: web.StreamResponse):
        self.s, self.request, self.resp = server, request, resp
        self.n = 0

    async def _fault_gate(self):
        f = self.s.faults
        n = self.n
        v = f.get("stall_mid_stream_after_n")
        if v is not None and n >= int(v):
            await asyncio.Event().wait()
        v = f.get("close_mid_stream_after_n")
        if v is not None and n >= int(v):
            tr = self.request.transport
            if tr is not None:
                tr.abort()
            raise SimulatedClose()
        v = f.get("malformed_chunk_after_n")
        if v is not None and n == int(v):
            await self.resp.write(b"data: {not json\n\n")

    async def raw(self, b: bytes):
        await self.resp.write(b)

    async def data(self, s: str):
        await self._emit(b"data: " + s.encode() + b"\n\n")

    async def event(self, name: str, obj: dict):
        await self._emit(b"event: " + name.encode() + b"\ndata: " + dumps(obj).encode() + b"\n\n")

    async def _emit(self, frame: bytes):
        v = self.s.faults.get("partial_event_at_n")
        if v is not None and self.n == int(v):  # the network cut this event: its first half goes out alone
            half = len(frame) // 2
            await self.resp.write(frame[:half])
            frame = frame[half:]
        await self._fault_gate()
        self.n += 1
        await self.resp.write(frame)
