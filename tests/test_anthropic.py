"""Anthropic Messages through the Coordinator: the real anthropic SDK and raw HTTP, union and P/D.

The engines are vLLM simulators, which speak /v1/messages natively; the Coordinator must relay their
answers event by event, send P and D the legs of vLLM's handoff protocol, answer every error in
Anthropic's envelope and keep /v1/messages* to vLLM engines.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import anthropic
import httpx
import openai
import pytest
from aiohttp import web

from harness.clients import anthropic_client as sdk, async_anthropic_client as async_sdk
from harness.configs import api_keys, coordinator_config, instance
from harness.coordinator import Coordinator
from harness.loopback import free_port, wait_until
from harness.threaded_app import ThreadedApp
from serving.legs import PREFILL_TICKET
from tests.conftest import MODEL

WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Current weather of a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
}
# One pixel PNG: image blocks must reach the engine untouched.
PIXEL = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="


def sse(raw: str) -> list[tuple[str, dict]]:
    """(event name, parsed data) of every event of an Anthropic SSE body, in order."""
    out = []
    for block in raw.replace("\r\n", "\n").split("\n\n"):
        lines = block.split("\n")
        name = next((ln[6:].strip() for ln in lines if ln.startswith("event:")), None)
        data = next((ln[5:].strip() for ln in lines if ln.startswith("data:")), None)
        if name is not None or data is not None:
            out.append((name, json.loads(data) if data else None))
    return out


def posts(engine, path: str) -> list[dict]:
    return [r for r in engine.requests() if r["path"] == path]


def header(record: dict, name: str) -> str | None:
    return {k.lower(): v for k, v in record["headers"].items()}.get(name)


@pytest.fixture(scope="module")
def pd(module_sims):
    """A prefill and a decode engine behind one Coordinator; P's tickets carry a field newer vLLMs add."""
    p = module_sims("prefill", ticket_extra={"vendor_hint": {"nic": [0, 1]}})
    d = module_sims("decode")
    cfg = coordinator_config([instance(1, "prefill", MODEL, p.address), instance(2, "decode", MODEL, d.address)])
    with Coordinator(cfg) as coord:
        coord.engines = {"prefill": p, "decode": d}
        yield coord


@pytest.fixture(params=["union", "pd"])
def cluster(request):
    """Each SDK test runs against a union engine and against a P/D pair."""
    coord = request.getfixturevalue("union_cluster" if request.param == "union" else "pd")
    for engine in coord.engines.values():
        engine.reset()
    return coord


# -- the SDK, JSON and streaming ---------------------------------------------------------------------


def test_sdk_create(cluster):
    c = sdk(cluster)
    msg = c.messages.create(
        model=MODEL, max_tokens=12, system="You are terse.", messages=[{"role": "user", "content": "Hello there"}]
    )
    assert msg.type == "message" and msg.role == "assistant"
    assert msg.id.startswith("chatcmpl-")
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text.strip()
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert 0 < msg.usage.output_tokens <= 12
    counted = c.messages.count_tokens(
        model=MODEL, system="You are terse.", messages=[{"role": "user", "content": "Hello there"}]
    )
    assert msg.usage.input_tokens == counted.input_tokens > 0


def test_sdk_stream(cluster):
    with sdk(cluster).messages.stream(
        model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "stream please"}]
    ) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert events[1] == "content_block_start" and "content_block_stop" in events
    assert events[-2] == "message_delta"
    deltas = [e for e in events if e == "content_block_delta"]
    assert 0 < len(deltas) <= final.usage.output_tokens
    assert final.content[0].type == "text" and final.content[0].text.strip()
    assert final.stop_reason in ("end_turn", "max_tokens")


def test_async_sdk(cluster):
    async def run():
        c = async_sdk(cluster)
        msg = await c.messages.create(model=MODEL, max_tokens=6, messages=[{"role": "user", "content": "async one"}])
        async with c.messages.stream(
            model=MODEL, max_tokens=6, messages=[{"role": "user", "content": "async one"}]
        ) as s:
            text = "".join([t async for t in s.text_stream])
            final = await s.get_final_message()
        counted = await c.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "async one"}])
        await c.close()
        return msg, text, final, counted

    msg, text, final, counted = asyncio.run(run())
    # The same prompt and (greedy) parameters give the same answer, whole or streamed.
    assert text == msg.content[0].text == final.content[0].text
    assert final.usage.input_tokens == msg.usage.input_tokens == counted.input_tokens


def test_tool_use_round_trip(cluster):
    c = sdk(cluster)
    question = {"role": "user", "content": "Weather in Paris?"}
    first = c.messages.create(
        model=MODEL,
        max_tokens=64,
        tools=[WEATHER_TOOL],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[question],
    )
    assert first.stop_reason == "tool_use"
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("chatcmpl-tool-") and isinstance(call.input["city"], str)

    # The same call streamed: input_json_delta pieces add up to the same input.
    with c.messages.stream(
        model=MODEL,
        max_tokens=64,
        tools=[WEATHER_TOOL],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[question],
    ) as s:
        kinds = [e.delta.type for e in s if e.type == "content_block_delta"]
        streamed = s.get_final_message()
    assert kinds and set(kinds) == {"input_json_delta"}
    assert streamed.content[-1].type == "tool_use" and streamed.content[-1].input == call.input

    turn = [
        question,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18 C, sunny"}]},
    ]
    second = c.messages.create(
        model=MODEL, max_tokens=16, tools=[WEATHER_TOOL], tool_choice={"type": "none"}, messages=turn
    )
    assert second.content[0].type == "text" and second.stop_reason in ("end_turn", "max_tokens")
    engine = cluster.engines.get("decode") or cluster.engines["union"]
    assert posts(engine, "/v1/messages")[-1]["body"]["messages"] == json.loads(json.dumps(turn))


def test_thinking_stream_has_thinking_and_signature(cluster):
    r = httpx.post(
        cluster.url + "/v1/messages",
        json={
            "model": MODEL,
            "max_tokens": 1100,
            "stream": True,
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "messages": [{"role": "user", "content": "think first"}],
        },
        timeout=30,
    )
    assert r.status_code == 200
    deltas = [d["delta"]["type"] for name, d in sse(r.text) if name == "content_block_delta"]
    assert "thinking_delta" in deltas and "signature_delta" in deltas and "text_delta" in deltas
    assert deltas.index("signature_delta") < deltas.index("text_delta")


def test_thinking_budget_not_below_max_tokens_is_refused_at_the_edge(cluster):
    """vLLM exempts prefill legs from `budget_tokens < max_tokens`: P would prefill and hold the KV, and only
    D would refuse. The Coordinator refuses it first, with vLLM's message, whole or disaggregated."""
    ask = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "think"}],
        "thinking": {"type": "enabled", "budget_tokens": 2048},
    }
    for max_tokens in (2048, 16):
        with pytest.raises(anthropic.BadRequestError) as e:
            sdk(cluster).messages.create(max_tokens=max_tokens, **ask)
        assert e.value.body["error"] == {
            "type": "invalid_request_error",
            "message": "thinking.budget_tokens must be less than max_tokens",
        }
    with pytest.raises(anthropic.BadRequestError) as e:
        with sdk(cluster).messages.stream(
            max_tokens=4096, **{**ask, "thinking": {"type": "enabled", "budget_tokens": 1000}}
        ):
            pass
    assert e.value.body["error"]["message"] == "'thinking.budget_tokens' must be an integer >= 1024"
    assert all(engine.requests() == [] for engine in cluster.engines.values())
    assert sdk(cluster).messages.create(max_tokens=2049, **ask).content[0].type == "thinking"


@pytest.mark.parametrize("budget, max_tokens", [(2048.0, 4096), ("2048", "4096"), (2048, 4096.0)])
def test_integer_fields_are_read_as_vllm_reads_them(cluster, budget, max_tokens):
    """vLLM's request models read integers in pydantic's lax mode: 2048.0 and "2048" are 2048 (a client that
    computes a budget as max_tokens * 0.5 sends a float). The Coordinator's own checks agree, whole or split."""
    body = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "thinking": {"type": "enabled", "budget_tokens": budget},
        "messages": [{"role": "user", "content": "think"}],
    }
    r = httpx.post(cluster.url + "/v1/messages", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert [block["type"] for block in r.json()["content"]][0] == "thinking"
    for bad in (2048.5, "2048.5", True, "many"):
        r = httpx.post(
            cluster.url + "/v1/messages",
            json={**body, "thinking": {"type": "enabled", "budget_tokens": bad}},
            timeout=30,
        )
        assert r.status_code == 400 and "budget_tokens" in r.json()["error"]["message"], (bad, r.text)


def test_sdk_reads_the_request_id(cluster):
    """Anthropic's SDK takes the id from the `request-id` header: JSON, streams, count_tokens and errors."""
    c = sdk(cluster)
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "which request?"}]}
    sent = {"X-Request-Id": "anth-rid-1"}
    assert c.messages.create(**body, extra_headers=sent)._request_id == "anth-rid-1"
    assert (
        c.messages.count_tokens(model=MODEL, messages=body["messages"], extra_headers=sent)._request_id == "anth-rid-1"
    )
    with c.messages.stream(**body, extra_headers=sent) as s:
        assert s.request_id == "anth-rid-1" and s.get_final_message().content
    raw = c.messages.with_raw_response.create(**body)  # no id sent: the one the Coordinator made
    assert (
        raw.request_id == raw.headers["x-request-id"]
        and len(raw.request_id) == 32
        and raw.parse()._request_id == raw.request_id
    )
    with pytest.raises(anthropic.NotFoundError) as e:
        c.messages.create(**{**body, "model": "no-such-model"}, extra_headers=sent)
    assert e.value.request_id == e.value.body["request_id"] == "anth-rid-1"


def test_sdk_lists_and_retrieves_models_in_anthropics_shape(sims):
    """The Anthropic SDK's models.list/retrieve (it sends `anthropic-version`): Anthropic's fields and paging,
    its x-api-key, its error envelope; the OpenAI SDK on the same path keeps OpenAI's shape."""
    u = sims("union")
    cfg = coordinator_config(
        [instance(1, "union", MODEL, u.address)],
        api_key_config=api_keys("k-one"),
    )
    with Coordinator(cfg) as coord:
        c = sdk(coord, api_key="k-one")  # sent as x-api-key
        page = c.models.list()
        assert [m.id for m in page.data] == [MODEL] and page.has_more is False
        assert page.first_id == page.last_id == MODEL
        one = c.models.retrieve(MODEL)
        assert (one.type, one.display_name) == ("model", MODEL) and one.created_at.year >= 2026
        assert one.model_extra["d_instances_num"] == 1
        with pytest.raises(anthropic.NotFoundError) as e:
            c.models.retrieve("no-such-model")
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
        with pytest.raises(anthropic.AuthenticationError):
            sdk(coord, api_key="bad").models.list()
        listed = openai.OpenAI(base_url=coord.url + "/v1", api_key="k-one", max_retries=0).models.list()
        assert [(m.id, m.object, m.owned_by) for m in listed.data] == [(MODEL, "model", "motor")]


def test_request_id_on_answers_refused_before_the_body_is_read(sims):
    """401, 413 (over the configured limit, and over Sanic's own), 415 and 405 carry the id too, as the
    header and in the body, whether the handler or the app's error handler answers them."""
    u = sims("union")
    cfg = coordinator_config(
        [instance(1, "union", MODEL, u.address)],
        api_key_config=api_keys("k-one"),
        rate_limit_config={"max_request_body_size": 64 * 1024},
    )
    with Coordinator(cfg) as coord:
        with pytest.raises(anthropic.AuthenticationError) as e:
            sdk(coord, api_key="bad").messages.create(
                model=MODEL, max_tokens=2, messages=USER, extra_headers={"X-Request-Id": "anth-401"}
            )
        assert e.value.request_id == e.value.body["request_id"] == "anth-401"
        assert e.value.response.headers["www-authenticate"] == "Bearer"
        with pytest.raises(anthropic.ContentTooLargeError) as e:
            sdk(coord, api_key="k-one").messages.create(
                model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x" * 100_000}]
            )
        assert e.value.request_id == e.value.body["request_id"] and e.value.type == "request_too_large"
        key = {"x-api-key": "k-one"}
        for size in (100_000, 12 * 1024 * 1024):
            r = httpx.post(
                coord.url + "/v1/messages",
                json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x" * size}]},
                headers=key,
                timeout=30,
            )
            assert r.status_code == 413 and error_of(r)["type"] == "request_too_large"
        r = httpx.post(
            coord.url + "/v1/messages/count_tokens", content=b"model=x", headers={**key, "Content-Type": "text/plain"}
        )
        assert r.status_code == 415 and error_of(r)["type"] == "invalid_request_error"
        r = httpx.get(coord.url + "/v1/messages", headers={**key, "X-Request-Id": "anth-405"})
        assert (
            r.status_code == 405
            and error_of(r)["type"] == "invalid_request_error"
            and r.headers["request-id"] == "anth-405"
        )
        # The OpenAI routes keep their own envelope and header.
        r = httpx.post(
            coord.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": USER},
            headers={"X-Request-Id": "oai-401"},
        )
        assert r.status_code == 401 and set(r.json()) == {"error"} and "request-id" not in r.headers
        assert r.headers["x-request-id"] == "oai-401"
        assert u.requests() == []


# -- what reaches the engines ------------------------------------------------------------------------

FULL_BODY = {
    "model": MODEL,
    "max_tokens": 20,
    "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
    "messages": [
        {
            "role": "user",
            "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PIXEL}},
                {"type": "text", "text": "What is in the picture?"},
            ],
        },
        {"role": "assistant", "content": "A pixel."},
        {"role": "user", "content": "And the weather?"},
    ],
    "tools": [WEATHER_TOOL],
    "tool_choice": {"type": "auto"},
    "stop_sequences": ["\n\nHuman:"],
    "top_k": 5,
    "top_p": 0.9,
    "temperature": 0.2,
    "metadata": {"user_id": "u-1"},
    "vendor_extension": {"nested": [1, {"deep": True}]},
}


def test_union_engine_gets_the_body_as_sent(union_cluster):
    engine = union_cluster.engines["union"]
    engine.reset()
    # This SDK has no sampling parameters of its own: they and unknown fields go in extra_body.
    typed = ("model", "max_tokens", "system", "messages", "tools", "tool_choice", "stop_sequences", "metadata")
    sdk(union_cluster, api_key="client-secret").messages.create(
        **{k: v for k, v in FULL_BODY.items() if k in typed},
        extra_body={k: v for k, v in FULL_BODY.items() if k not in typed},
        extra_headers={"X-Request-Id": "anth-pass-1"},
    )
    (seen,) = posts(engine, "/v1/messages")
    assert seen["body"] == FULL_BODY
    assert header(seen, "x-api-key") is None and header(seen, "authorization") is None
    assert header(seen, "x-request-id") == "anth-pass-1"


def test_union_stream_is_the_engines_bytes(union_cluster):
    """Relayed, not re-synthesised: the same request straight to the engine gives the same bytes."""
    engine = union_cluster.engines["union"]
    body = {**FULL_BODY, "stream": True, "tool_choice": {"type": "tool", "name": "get_weather"}}
    headers = {"X-Request-Id": "anth-bytes-1"}
    via = httpx.post(union_cluster.url + "/v1/messages", json=body, headers=headers, timeout=30)
    direct = httpx.post(engine.url + "/v1/messages", json=body, headers=headers, timeout=30)
    assert via.status_code == direct.status_code == 200
    assert via.headers["content-type"].startswith("text/event-stream")
    assert via.content == direct.content
    names = [name for name, _ in sse(via.text)]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert "input_json_delta" in via.text


def test_pd_legs(pd):
    p, d = pd.engines["prefill"], pd.engines["decode"]
    p.reset()
    d.reset()
    r = httpx.post(pd.url + "/v1/messages", json=FULL_BODY, headers={"X-Request-Id": "anth-legs-1"}, timeout=30)
    assert r.status_code == 200
    assert "kv_transfer_params" not in r.json()

    (p_leg,) = posts(p, "/v1/messages")
    (d_leg,) = posts(d, "/v1/messages")
    pb, db = p_leg["body"], d_leg["body"]
    # No stop sequences: the client's at the engine's default (its bytes with the leg's changes appended).
    assert pb["max_tokens"] == 1 and pb["stream"] is False and pb["stop_sequences"] is None
    assert pb["kv_transfer_params"] == PREFILL_TICKET
    assert {
        k: v for k, v in pb.items() if k not in ("max_tokens", "stream", "kv_transfer_params", "stop_sequences")
    } == {k: v for k, v in FULL_BODY.items() if k not in ("max_tokens", "stop_sequences")}
    # D: the client's body, plus P's ticket exactly as P issued it (fields the Coordinator does not know included).
    ticket = db.pop("kv_transfer_params")
    assert db == FULL_BODY
    assert ticket["do_remote_prefill"] is True and ticket["remote_engine_id"] == p.engine_id
    assert ticket["remote_port"] == p.port and ticket["vendor_hint"] == {"nic": [0, 1]}
    assert header(p_leg, "x-request-id") == header(d_leg, "x-request-id") == "anth-legs-1"
    assert wait_until(lambda: d.stats()["remote_kv_hits"] == 1 and p.stats()["held_kv_tickets"] == 0)


def test_pd_named_tool_choice_reaches_prefill_as_any(pd):
    """With a named tool vLLM takes P's one token as the whole call's arguments and json.loads them: a 400.
    P gets {"type": "any"} with the same tools (the same prompt); D gets the client's choice and makes the call."""
    p, d = pd.engines["prefill"], pd.engines["decode"]
    p.reset()
    d.reset()
    named = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    ask = {
        "model": MODEL,
        "max_tokens": 64,
        "tools": [WEATHER_TOOL],
        "tool_choice": named,
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
    }
    msg = sdk(pd).messages.create(**ask)
    assert (
        msg.stop_reason == "tool_use" and msg.content[-1].type == "tool_use" and msg.content[-1].name == "get_weather"
    )
    with sdk(pd).messages.stream(**ask) as s:
        assert s.get_final_message().content[-1].input == msg.content[-1].input
    p_legs, d_legs = posts(p, "/v1/messages"), posts(d, "/v1/messages")
    assert [leg["body"]["tool_choice"] for leg in p_legs] == [{"type": "any", "disable_parallel_tool_use": True}] * 2
    assert [leg["body"]["tool_choice"] for leg in d_legs] == [named] * 2
    assert all(leg["body"]["tools"] == [WEATHER_TOOL] for leg in p_legs + d_legs)
    assert p.stats()["failed"] == 0
    assert wait_until(lambda: d.stats()["remote_kv_hits"] == 2 and p.stats()["held_kv_tickets"] == 0)


def test_pd_stream_legs_and_event_order(pd):
    """P runs non-streaming; the client's events are D's, in D's order, with the same content."""
    p, d = pd.engines["prefill"], pd.engines["decode"]
    p.reset()
    d.reset()
    body = {**FULL_BODY, "stream": True}
    headers = {"X-Request-Id": "anth-order-1"}
    via = httpx.post(pd.url + "/v1/messages", json=body, headers=headers, timeout=30)
    assert via.status_code == 200 and "kv_transfer_params" not in via.text
    (p_leg,) = posts(p, "/v1/messages")
    (d_leg,) = posts(d, "/v1/messages")
    assert p_leg["body"]["stream"] is False and d_leg["body"]["stream"] is True
    assert d_leg["body"]["kv_transfer_params"]["do_remote_prefill"] is True

    direct = httpx.post(d.url + "/v1/messages", json=body, headers=headers, timeout=30)
    assert sse(via.text) == sse(direct.text)
    names = [name for name, _ in sse(via.text)]
    assert names[:2] == ["message_start", "content_block_start"] and names[-2:] == ["message_delta", "message_stop"]


class DecodeRelay(ThreadedApp):
    """A decode engine that reports usage the way Anthropic's own API does, in front of a real decode sim.

    It counts the transferred prompt as cache reads (`input_tokens` 0, `cache_read_input_tokens` the
    prompt) and echoes a ticket in the message, the two things the Coordinator must undo for the client.
    Every other route (/health, /metrics) and byte is the sim's.
    """

    ECHO = {"do_remote_prefill": False, "echoed": True}

    def __init__(self, upstream: str):
        self.upstream = upstream
        super().__init__()

    async def _started(self) -> None:
        self.session = aiohttp.ClientSession()

    async def _stopping(self) -> None:
        await self.session.close()

    @classmethod
    def rewrite(cls, obj: dict) -> dict:
        for holder in (obj, obj.get("message")):
            if isinstance(holder, dict) and isinstance(holder.get("usage"), dict):
                usage = holder["usage"]
                usage["cache_read_input_tokens"], usage["input_tokens"] = usage["input_tokens"], 0
        if obj.get("type") == "message":
            obj["kv_transfer_params"] = cls.ECHO
        if obj.get("type") == "message_start":
            obj["message"]["kv_transfer_params"] = cls.ECHO
        return obj

    def _rewrite_event(self, event: bytes) -> bytes:
        lines = event.split(b"\n")
        return b"\n".join(
            b"data: " + json.dumps(self.rewrite(json.loads(ln[5:]))).encode() if ln.startswith(b"data:") else ln
            for ln in lines
        )

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "x-request-id")}
        body = await request.read()
        async with self.session.request(
            request.method, self.upstream + request.path_qs, data=body or None, headers=headers
        ) as up:
            if request.path != "/v1/messages" or up.status != 200:
                return web.Response(body=await up.read(), status=up.status, content_type=up.content_type)
            if up.content_type != "text/event-stream":
                return web.json_response(self.rewrite(await up.json()))
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            tail = b""
            async for chunk in up.content.iter_any():
                *events, tail = (tail + chunk).split(b"\n\n")
                for event in events:
                    await resp.write(self._rewrite_event(event) + b"\n\n")
            await resp.write_eof()
            return resp


def test_pd_usage_is_prefills_and_tickets_never_reach_the_client(sims):
    p, d = sims("prefill"), sims("decode")
    relay = DecodeRelay(d.url)
    try:
        cfg = coordinator_config(
            [instance(1, "prefill", MODEL, p.address), instance(2, "decode", MODEL, relay.address)]
        )
        with Coordinator(cfg) as coord:
            body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "count my input"}]}
            prompt = httpx.post(p.url + "/v1/messages/count_tokens", json=body).json()["input_tokens"]
            # The relay really reports what the Coordinator must undo.
            raw_d = httpx.post(relay.url + "/v1/messages", json=body, timeout=30).json()
            assert raw_d["usage"] == {
                "input_tokens": 0,
                "cache_read_input_tokens": prompt,
                "output_tokens": raw_d["usage"]["output_tokens"],
            }
            assert raw_d["kv_transfer_params"] == DecodeRelay.ECHO

            msg = sdk(coord).messages.create(**body)
            assert msg.usage.input_tokens == prompt and msg.usage.cache_read_input_tokens is None
            assert "kv_transfer_params" not in httpx.post(coord.url + "/v1/messages", json=body, timeout=30).json()

            r = httpx.post(coord.url + "/v1/messages", json={**body, "stream": True}, timeout=30)
            events = dict(sse(r.text))
            assert events["message_start"]["message"]["usage"] == {"input_tokens": prompt, "output_tokens": 0}
            assert "kv_transfer_params" not in events["message_start"]["message"]
            assert events["message_delta"]["usage"]["input_tokens"] == prompt
            assert "cache_read_input_tokens" not in events["message_delta"]["usage"]
            with sdk(coord).messages.stream(**body) as s:
                assert s.get_final_message().usage.input_tokens == prompt
            assert d.stats()["remote_kv_hits"] >= 3
    finally:
        relay.stop()


def test_pd_usage_with_vllms_cache_details(sims):
    """Engines reporting cache details as vLLM 0.32 does (input_tokens = prompt less cache reads and writes):
    the client gets P's three input counts, which add up to the prompt, while D counts the transferred
    prompt as read from cache."""
    p, d = sims("prefill", anthropic_cache_usage=True), sims("decode", anthropic_cache_usage=True)
    cfg = coordinator_config([instance(1, "prefill", MODEL, p.address), instance(2, "decode", MODEL, d.address)])
    with Coordinator(cfg) as coord:
        body = {"model": MODEL, "max_tokens": 6, "messages": [{"role": "user", "content": "cache me please " * 30}]}
        prompt = sdk(coord).messages.count_tokens(model=MODEL, messages=body["messages"]).input_tokens

        def inputs(usage) -> tuple:
            return usage["input_tokens"], usage["cache_read_input_tokens"], usage["cache_creation_input_tokens"]

        first = sdk(coord).messages.create(**body).usage
        assert (first.input_tokens, first.cache_read_input_tokens, first.cache_creation_input_tokens) == (prompt, 0, 0)
        # The same prompt again: P's prefix cache hits, and that is what the client is billed as cache reads.
        second = sdk(coord).messages.create(**body).usage
        assert 0 < second.cache_read_input_tokens < prompt
        assert second.input_tokens + second.cache_read_input_tokens + second.cache_creation_input_tokens == prompt
        d_view = httpx.post(d.url + "/v1/messages", json=body, timeout=30).json()["usage"]  # D alone (a recompute)
        assert d_view["input_tokens"] + d_view["cache_read_input_tokens"] == prompt

        r = httpx.post(coord.url + "/v1/messages", json={**body, "stream": True}, timeout=30)
        events = dict(sse(r.text))
        start, delta = events["message_start"]["message"]["usage"], events["message_delta"]["usage"]
        assert inputs(start) == inputs(delta) == (second.input_tokens, second.cache_read_input_tokens, 0)
        with sdk(coord).messages.stream(**body) as s:
            final = s.get_final_message().usage
        assert final.input_tokens + final.cache_read_input_tokens == prompt and final.cache_read_input_tokens > 0
        assert d.stats()["remote_kv_hits"] >= 4


# -- count_tokens --------------------------------------------------------------------------------------


def test_count_tokens_goes_to_exactly_one_engine(cluster):
    body = {
        "model": MODEL,
        "system": "sys",
        "tools": [WEATHER_TOOL],
        "messages": [{"role": "user", "content": "how many tokens?"}],
    }
    r = httpx.post(cluster.url + "/v1/messages/count_tokens", json=body)
    assert r.status_code == 200
    engines = list(cluster.engines.values())
    got = [posts(e, "/v1/messages/count_tokens") for e in engines]
    assert sorted(len(g) for g in got) == [0] * (len(engines) - 1) + [1]
    assert all(posts(e, "/v1/messages") == [] for e in engines)  # never through P and D
    (leg,) = [g[0] for g in got if g]
    assert leg["body"] == body
    direct = httpx.post(engines[0].url + "/v1/messages/count_tokens", json=body).json()
    assert r.json() == direct and set(direct) == {"input_tokens", "context_management"}


# -- errors --------------------------------------------------------------------------------------------

USER = [{"role": "user", "content": "x"}]
BAD_BODIES = [
    ("/v1/messages", b"{not json"),
    ("/v1/messages", b"[1, 2]"),
    ("/v1/messages", b""),
    ("/v1/messages", json.dumps({"max_tokens": 5, "messages": USER}).encode()),
    ("/v1/messages", json.dumps({"model": "", "max_tokens": 5, "messages": USER}).encode()),
    ("/v1/messages", json.dumps({"model": MODEL, "messages": USER}).encode()),
    ("/v1/messages", json.dumps({"model": MODEL, "max_tokens": 0, "messages": USER}).encode()),
    ("/v1/messages", json.dumps({"model": MODEL, "max_tokens": -3, "messages": USER}).encode()),
    ("/v1/messages", json.dumps({"model": MODEL, "max_tokens": "five", "messages": USER}).encode()),
    ("/v1/messages", json.dumps({"model": MODEL, "max_tokens": 2.5, "messages": USER}).encode()),
    ("/v1/messages", json.dumps({"model": MODEL, "max_tokens": False, "messages": USER}).encode()),  # 0 to vLLM
    ("/v1/messages", json.dumps({"model": MODEL, "max_tokens": 5, "messages": []}).encode()),
    ("/v1/messages", json.dumps({"model": MODEL, "max_tokens": 5, "messages": "hi"}).encode()),
    ("/v1/messages", json.dumps({"model": MODEL, "max_tokens": 5, "messages": [{"role": 5, "content": "x"}]}).encode()),
    (
        "/v1/messages",
        json.dumps({"model": MODEL, "max_tokens": 5, "messages": [{"role": "", "content": "x"}]}).encode(),
    ),
    ("/v1/messages", json.dumps({"model": MODEL, "max_tokens": 5, "messages": [{"content": "x"}]}).encode()),
    ("/v1/messages", json.dumps({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user"}]}).encode()),
    (
        "/v1/messages",
        json.dumps({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": None}]}).encode(),
    ),
    (
        "/v1/messages",
        json.dumps({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": 7}]}).encode(),
    ),
    ("/v1/messages", json.dumps({"model": MODEL, "max_tokens": 5, "messages": USER, "stream": "yes"}).encode()),
    ("/v1/messages", json.dumps({"model": MODEL, "max_tokens": 5, "messages": USER, "tools": 1}).encode()),
    ("/v1/messages/count_tokens", json.dumps({"model": MODEL, "messages": USER, "tools": "x"}).encode()),
    ("/v1/messages/count_tokens", b"{not json"),
    ("/v1/messages/count_tokens", json.dumps({"messages": USER}).encode()),
    ("/v1/messages/count_tokens", json.dumps({"model": MODEL, "messages": []}).encode()),
    ("/v1/messages/count_tokens", json.dumps({"model": MODEL, "messages": [{"role": None, "content": "x"}]}).encode()),
]


def test_roles_are_the_engines_to_judge(union_cluster):
    """Claude Code sends `system` turns inside `messages` (vLLM 0.23+ takes them, and `ctx`/`msg`): they
    reach the engine; a role the engine refuses comes back as its 400, in Anthropic's shape."""
    engine = union_cluster.engines["union"]
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "system", "content": "Available agent types: none"},
        {"role": "ctx", "content": "context"},
        {"role": "msg", "content": "more"},
    ]
    m = sdk(union_cluster).messages.create(model=MODEL, max_tokens=4, messages=messages)
    assert m.content[0].text and [x["role"] for x in engine.requests()[-1]["body"]["messages"]] == [
        "user",
        "system",
        "ctx",
        "msg",
    ]
    count = sdk(union_cluster).messages.count_tokens(model=MODEL, messages=messages)
    assert count.input_tokens > 0
    r = httpx.post(
        union_cluster.url + "/v1/messages",
        json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "tool", "content": "x"}]},
    )
    assert r.status_code == 400 and error_of(r)["type"] == "invalid_request_error"
    assert engine.requests()[-1]["body"]["messages"] == [{"role": "tool", "content": "x"}]  # the engine judged it


def error_of(r: httpx.Response) -> dict:
    """The inner error of an Anthropic error answer, checked to be Anthropic's envelope with the request id."""
    body = r.json()
    assert set(body) == {"type", "error", "request_id"} and body["type"] == "error"
    assert body["request_id"] == r.headers["request-id"] == r.headers["x-request-id"]
    assert set(body["error"]) == {"type", "message"} and body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize("path,body", BAD_BODIES)
def test_malformed_body_is_400_at_the_edge(union_cluster, path, body):
    engine = union_cluster.engines["union"]
    engine.reset()
    r = httpx.post(union_cluster.url + path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    assert error_of(r)["type"] == "invalid_request_error"
    assert engine.requests() == []  # rejected before any engine was touched


def test_wrong_content_type_and_unknown_model(union_cluster):
    r = httpx.post(union_cluster.url + "/v1/messages", content=b"model=x", headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and error_of(r)["type"] == "invalid_request_error"
    for path, extra in (("/v1/messages", {"max_tokens": 5}), ("/v1/messages/count_tokens", {})):
        r = httpx.post(union_cluster.url + path, json={"model": "no-such-model", "messages": USER, **extra})
        assert r.status_code == 404
        err = error_of(r)
        assert err["type"] == "not_found_error" and "no-such-model" in err["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        sdk(union_cluster).messages.create(model="no-such-model", max_tokens=5, messages=USER)
    assert e.value.body["error"]["type"] == "not_found_error"


def test_engine_errors_come_back_in_anthropic_shape(union_cluster):
    """vLLM answers schema errors on /v1/messages in OpenAI's shape; the client gets Anthropic's, same status and message."""
    engine = union_cluster.engines["union"]
    bad_choice = {"model": MODEL, "max_tokens": 5, "messages": USER, "tool_choice": "bad"}
    raw = httpx.post(engine.url + "/v1/messages", json=bad_choice)
    assert raw.status_code == 400 and "error" in raw.json() and "type" not in raw.json()  # OpenAI's shape
    r = httpx.post(union_cluster.url + "/v1/messages", json=bad_choice)
    assert r.status_code == 400
    assert error_of(r) == {"type": "invalid_request_error", "message": raw.json()["error"]["message"]}
    # Streaming fails the same way before the stream starts.
    with pytest.raises(anthropic.BadRequestError) as e:
        with sdk(union_cluster).messages.stream(model=MODEL, max_tokens=5, messages=USER, tool_choice="bad"):
            pass
    assert e.value.body["error"]["type"] == "invalid_request_error"
    # vLLM's own Anthropic envelope carries OpenAI's type names; the Coordinator gives Anthropic's.
    too_long = {"model": MODEL, "max_tokens": 10**6, "messages": USER}
    assert httpx.post(engine.url + "/v1/messages", json=too_long).json()["error"]["type"] == "BadRequestError"
    r = httpx.post(union_cluster.url + "/v1/messages", json=too_long)
    assert r.status_code == 400 and error_of(r)["type"] == "invalid_request_error"
    assert "maximum context length" in error_of(r)["message"]


def test_engine_failure_before_and_after_the_first_byte(sims):
    engine = sims("union")
    # A breaker that stays closed: this test is about what the client sees, not about failing over.
    cfg = coordinator_config(
        [instance(1, "union", MODEL, engine.address)], scheduler_config={"breaker_failure_threshold": 100}
    )
    body = {"model": MODEL, "max_tokens": 30, "messages": [{"role": "user", "content": "fail me"}], "stream": True}
    with Coordinator(cfg) as coord:
        engine.set_faults(fail_status=500)
        r = httpx.post(coord.url + "/v1/messages", json=body, timeout=30)
        assert r.status_code == 502 and r.headers["content-type"].startswith("application/json")
        assert error_of(r)["type"] == "api_error"
        with pytest.raises(anthropic.InternalServerError):
            sdk(coord).messages.create(**{**body, "stream": False})

        engine.clear_faults()
        engine.set_faults(close_mid_stream_after_n=4)
        r = httpx.post(coord.url + "/v1/messages", json=body, timeout=30)
        assert r.status_code == 200
        events = sse(r.text)
        assert [n for n, _ in events[:4]] == [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
        ]
        name, data = events[-1]
        assert name == "error" and set(data) == {"type", "error", "request_id"} and data["error"]["type"] == "api_error"
        assert data["request_id"] == r.headers["request-id"] == r.headers["x-request-id"]
        with pytest.raises(anthropic.APIStatusError):
            with sdk(coord).messages.stream(**{k: v for k, v in body.items() if k != "stream"}) as s:
                for _ in s:
                    pass
        engine.clear_faults()
        assert sdk(coord).messages.create(model=MODEL, max_tokens=2, messages=USER).content


def test_error_type_follows_the_status_the_client_gets(sims):
    """The type names the status the client got, not the engine's: every attempt answered 503 is the
    Coordinator's 502 (`api_error`, not `overloaded_error`), a missed deadline its 504 (`timeout_error`),
    an engine's 408 is relayed as a 408 (`timeout_error`); the SDK raises the class of that status."""
    engine = sims("union")
    cfg = coordinator_config(
        [instance(1, "union", MODEL, engine.address)],
        exception_config={
            "retry_delay": 0.01,
            "max_retry": 1,
            "first_token_timeout": 0.5,
            "infer_timeout": 0.5,
            "stream_idle_timeout": 0.5,
        },
        scheduler_config={"breaker_failure_threshold": 100},
    )
    body = {"model": MODEL, "max_tokens": 30, "messages": USER}
    with Coordinator(cfg) as coord:
        c = sdk(coord)
        for faults, status, cls, etype in (
            ({"fail_status": 503}, 502, anthropic.InternalServerError, "api_error"),
            ({"fail_status": 408}, 408, anthropic.RequestTimeoutError, "timeout_error"),
            ({"hang_before_first_byte": True}, 504, anthropic.GatewayTimeoutError, "timeout_error"),
        ):
            engine.clear_faults()
            engine.set_faults(**faults)
            for stream in (False, True):
                with pytest.raises(cls) as e:
                    if stream:
                        with c.messages.stream(**body):
                            pass
                    else:
                        c.messages.create(**body)
                assert (e.value.status_code, e.value.type) == (status, etype), (faults, stream)

        # A stream that stalls after its first events ends with one error event: the deadline's timeout_error.
        engine.clear_faults()
        engine.set_faults(stall_mid_stream_after_n=3)
        with pytest.raises(anthropic.APIStatusError) as e:
            with c.messages.stream(**body) as s:
                for _ in s:
                    pass
        assert e.value.type == "timeout_error"
        engine.clear_faults()


def test_engine_kinds_and_no_healthy_instance(sims):
    """Only vLLM engines serve /v1/messages*; a model without one is the client's error, not a 500."""
    a, b, c = sims("union", model="mixed"), sims("union", model="mixed"), sims("union", model="sg")
    d = sims("union", model="sg-inst")
    cfg = coordinator_config(
        [
            instance(1, "union", "mixed", a.address),
            instance(2, "union", "mixed", b.address, engine_type="sglang"),
            instance(3, "union", "sg", c.address),
            instance(4, "union", "sg-inst", d.address, engine_type="mindie"),
            instance(5, "union", "gone", f"127.0.0.1:{free_port()}"),
        ],
        models=[{"id": "sg", "engine_type": "sglang"}],
        scheduler_config={"scheduler_type": "round_robin"},  # both engines of "mixed" are candidates in turn
    )
    with Coordinator(cfg) as coord:
        for model in ("sg", "sg-inst"):
            for path, extra in (("/v1/messages", {"max_tokens": 5}), ("/v1/messages/count_tokens", {})):
                r = httpx.post(coord.url + path, json={"model": model, "messages": USER, **extra})
                assert r.status_code == 400, (model, path)
                err = error_of(r)
                assert err["type"] == "invalid_request_error" and "vLLM" in err["message"]
        with pytest.raises(anthropic.BadRequestError):
            sdk(coord).messages.create(model="sg", max_tokens=5, messages=USER)
        assert c.requests() == [] and d.requests() == []
        # The OpenAI routes of those models still work.
        oai = openai.OpenAI(base_url=coord.url + "/v1", api_key="x", max_retries=0)
        assert oai.chat.completions.create(model="sg", messages=USER, max_tokens=2).choices

        # A model with both kinds: Anthropic traffic only on the vLLM one, OpenAI traffic on both.
        for i in range(6):
            sdk(coord).messages.create(model="mixed", max_tokens=2, messages=[{"role": "user", "content": f"m{i}"}])
        for i in range(6):
            oai.chat.completions.create(model="mixed", messages=[{"role": "user", "content": f"c{i}"}], max_tokens=2)
        sdk(coord).messages.count_tokens(model="mixed", messages=USER)
        assert len(posts(a, "/v1/messages")) == 6 and posts(b, "/v1/messages") == []
        assert len(posts(a, "/v1/messages/count_tokens")) == 1 and posts(b, "/v1/messages/count_tokens") == []
        assert posts(b, "/v1/chat/completions")

        # No healthy engine: overloaded, in Anthropic's shape, before and instead of any stream.
        def gone_is_down():
            models = httpx.get(coord.url + "/v1/models").json()["data"]
            return [m["d_instances_num"] for m in models if m["id"] == "gone"] == [0]

        assert wait_until(gone_is_down, timeout_s=15)
        for body in ({"max_tokens": 5}, {"max_tokens": 5, "stream": True}, {}):
            path = "/v1/messages" if body else "/v1/messages/count_tokens"
            r = httpx.post(coord.url + path, json={"model": "gone", "messages": USER, **body})
            assert r.status_code == 503 and error_of(r)["type"] == "overloaded_error"
        with pytest.raises(anthropic.InternalServerError) as e:
            sdk(coord).messages.create(model="gone", max_tokens=5, messages=USER)
        assert e.value.body["error"]["type"] == "overloaded_error"


# -- auth and admission --------------------------------------------------------------------------------


def test_api_keys_on_anthropic_and_openai_routes(sims):
    u = sims("union")
    cfg = coordinator_config(
        [instance(1, "union", MODEL, u.address)],
        api_key_config=api_keys("k-one", "k-two"),
    )
    with Coordinator(cfg) as coord:
        assert (
            sdk(coord, api_key="k-one").messages.create(model=MODEL, max_tokens=2, messages=USER).content
        )  # x-api-key
        assert (
            sdk(coord, api_key=None, auth_token="k-two")
            .messages.create(model=MODEL, max_tokens=2, messages=USER)
            .content
        )  # Bearer
        assert sdk(coord, api_key="k-two").messages.count_tokens(model=MODEL, messages=USER).input_tokens > 0
        with sdk(coord, api_key="k-one").messages.stream(model=MODEL, max_tokens=3, messages=USER) as s:
            assert s.get_final_message().content

        for headers in (
            {},
            {"x-api-key": "wrong"},
            {"x-api-key": "k-on"},
            {"Authorization": "Bearer nope"},
            {"Authorization": "k-one"},
        ):
            for path, extra in (("/v1/messages", {"max_tokens": 2}), ("/v1/messages/count_tokens", {})):
                r = httpx.post(coord.url + path, json={"model": MODEL, "messages": USER, **extra}, headers=headers)
                assert r.status_code == 401, (headers, path)
                assert error_of(r)["type"] == "authentication_error"
        with pytest.raises(anthropic.AuthenticationError):
            sdk(coord, api_key="bad").messages.create(model=MODEL, max_tokens=2, messages=USER)
        with pytest.raises(anthropic.AuthenticationError):
            with sdk(coord, api_key="bad").messages.stream(model=MODEL, max_tokens=2, messages=USER):
                pass

        # x-api-key is an Anthropic convention: the OpenAI routes take only the configured header.
        chat = {"model": MODEL, "messages": USER, "max_tokens": 2}
        r = httpx.post(coord.url + "/v1/chat/completions", json=chat, headers={"x-api-key": "k-one"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert (
            httpx.post(
                coord.url + "/v1/chat/completions", json=chat, headers={"Authorization": "Bearer k-one"}
            ).status_code
            == 200
        )
        # The scheme is case-insensitive (RFC 9110); the key is not.
        assert (
            httpx.post(
                coord.url + "/v1/chat/completions", json=chat, headers={"Authorization": "bearer k-one"}
            ).status_code
            == 200
        )
        assert (
            httpx.post(
                coord.url + "/v1/chat/completions", json=chat, headers={"Authorization": "BEARER k-one"}
            ).status_code
            == 200
        )
        assert (
            httpx.post(
                coord.url + "/v1/chat/completions", json=chat, headers={"Authorization": "Bearer K-ONE"}
            ).status_code
            == 401
        )
        assert all(
            "k-one" not in json.dumps(r["headers"]) and "k-two" not in json.dumps(r["headers"]) for r in u.requests()
        )


def test_custom_auth_header_and_x_api_key(sims):
    u = sims("union")
    cfg = coordinator_config(
        [instance(1, "union", MODEL, u.address)],
        api_key_config=api_keys("sekrit", header="X-Api-Token", prefix=""),
    )
    with Coordinator(cfg) as coord:
        body = {"model": MODEL, "max_tokens": 2, "messages": USER}
        assert httpx.post(coord.url + "/v1/messages", json=body, headers={"X-Api-Token": "sekrit"}).status_code == 200
        assert httpx.post(coord.url + "/v1/messages", json=body, headers={"x-api-key": "sekrit"}).status_code == 200
        assert (
            httpx.post(coord.url + "/v1/messages", json=body, headers={"Authorization": "Bearer sekrit"}).status_code
            == 401
        )


def test_rate_limited_is_rate_limit_error(sims):
    u = sims("union")
    cfg = coordinator_config([instance(1, "union", MODEL, u.address)], rate_limit_config={"requests_per_second": 0.01})
    with Coordinator(cfg) as coord:
        body = {"model": MODEL, "max_tokens": 2, "messages": USER}
        statuses = [httpx.post(coord.url + "/v1/messages", json=body) for _ in range(3)]
        assert statuses[0].status_code == 200
        limited = statuses[-1]
        assert limited.status_code == 429 and int(limited.headers["retry-after"]) >= 1
        assert error_of(limited)["type"] == "rate_limit_error"
        with pytest.raises(anthropic.RateLimitError):
            sdk(coord).messages.create(**body)
