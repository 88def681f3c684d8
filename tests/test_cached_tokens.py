"""The engines' cached prompt tokens as the Coordinator reports them, on every route, streamed or not, whole on a
union engine and through the PD handoff (D counts the pulled KV as cached: P's count is the one reported): the
client's usage, the request's log line (`cached_tokens`, beside `cached_tokens_predicted` with KV events) and the
tenant's `cached` and `prompt` token counters all say what the engine that computed the prompt said.

The relay reads a stream's cached count in its usage event only (serving/relay.py), and the handoff takes P's from
the usage it parsed: these tests pin that what is read is what was reported before that change.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re

import httpx
import pytest
from aiohttp import web

from harness.configs import coordinator_config
from harness.coordinator import Coordinator
from harness.loopback import free_ports, wait_until
from harness.threaded_app import ThreadedApp
from harness.tokenizer import tiny_tokenizer
from tests.logfmt import fields
from tests.test_kv_events import sim_with_events

UNION, PD, HELD = "u", "pd", "held"
ANTHROPIC = {"anthropic-version": "2023-06-01"}
TURN = "a question about the repository and its tests, long enough for a few blocks of the engine's cache " * 3
_ids = itertools.count()


def _instance(iid: int, role: str, model: str, sim, pub: int, replay: int) -> dict:
    events = {"endpoint": f"tcp://127.0.0.1:{pub}", "replay_endpoint": f"tcp://127.0.0.1:{replay}"}
    return {
        "id": iid,
        "role": role,
        "model_name": model,
        "endpoints": [{"id": 0, "address": sim.address, "kv_events": events}],
    }


@pytest.fixture(scope="module")
def coord(tmp_path_factory):
    """A union engine of UNION, a prefill and a decode engine of PD, all publishing KV events, and both models'
    prompts counted exactly (a tokenizer): the log line has `cached_tokens` only for a prompt whose cached tokens the
    KV events predicted; one worker."""
    pytest.importorskip("tokenizers")
    folder = str(tmp_path_factory.mktemp("tokenizer"))
    tiny_tokenizer(folder)
    ports = free_ports(6)
    roles = (("union", UNION), ("prefill", PD), ("decode", PD))
    sims = [
        sim_with_events(ports[2 * i], ports[2 * i + 1], role=role, model=model, anthropic_cache_usage=True)
        for i, (role, model) in enumerate(roles)
    ]
    instances = [
        _instance(i + 1, role, model, sim, ports[2 * i], ports[2 * i + 1])
        for i, ((role, model), sim) in enumerate(zip(roles, sims, strict=True))
    ]
    held = HeldBack()
    instances.append({"id": 4, "role": "union", "model_name": HELD, "endpoints": [{"id": 0, "address": held.address}]})
    try:
        cfg = coordinator_config(
            instances,
            models=[{"id": model, "tokenizer_path": folder} for model in (UNION, PD, HELD)],
            scheduler_config={"scheduler_type": "kv_cache_affinity"},
            kv_event_config={"enable": True},
        )
        with Coordinator(cfg) as c:
            yield c
    finally:
        held.stop()
        for sim in sims:
            sim.stop()


def _body(route: str, model: str, text: str, stream: bool, include_usage: bool) -> dict:
    if route == "/v1/chat/completions":
        body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    elif route == "/v1/completions":
        body = {"model": model, "prompt": text, "max_tokens": 4}
    elif route == "/v1/responses":
        body = {"model": model, "input": text, "max_output_tokens": 4}
    else:
        body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    if stream:
        body["stream"] = True
        if include_usage:
            body["stream_options"] = {"include_usage": True}
    return body


def _usage_of_events(text: str) -> dict | None:
    """The last usage of a stream's events (a chunk's, message_delta's, response.completed's response's)."""
    usage = None
    for line in text.splitlines():
        if not line.startswith("data:") or line.strip() == "data: [DONE]":
            continue
        obj = json.loads(line[5:])
        found = obj.get("usage") or (obj.get("response") or {}).get("usage")
        if found:
            usage = found
    return usage


def _cached(usage: dict) -> int:
    """The cached count of an OpenAI, Responses or Anthropic usage, as the client reads it."""
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    return details["cached_tokens"] if details is not None else usage["cache_read_input_tokens"]


def _counter(coord, kind: str) -> float:
    text = httpx.get(coord.obs + "/metrics", timeout=10).text
    m = re.search(r'motor_tenant_tokens_total\{kind="%s",tenant="default"\} (\S+)' % kind, text)
    return float(m[1]) if m else 0.0


def _line(coord, rid: str) -> dict[str, str] | None:
    for line in coord.output().splitlines():
        if f" request_id={rid} " in line:
            return fields(line.split(": ", 1)[1])
    return None


def serve(coord, route: str, model: str, text: str, stream: bool, include_usage: bool = True):
    """One request: (the client's usage, None when its stream had none; its log line's fields; what the tenant's
    cached and prompt counters grew by)."""
    rid = f"cached-{next(_ids)}"
    before = _counter(coord, "cached"), _counter(coord, "prompt")
    headers = {"X-Request-Id": rid, **(ANTHROPIC if route == "/v1/messages" else {})}
    r = httpx.post(
        coord.url + route, json=_body(route, model, text, stream, include_usage), headers=headers, timeout=30
    )
    assert r.status_code == 200, r.text
    usage = _usage_of_events(r.text) if stream else r.json()["usage"]
    assert wait_until(lambda: _line(coord, rid) is not None, 5), rid
    line = _line(coord, rid)
    # Both counters are written in one flush: the prompt's moves whenever a request is done.
    assert wait_until(lambda: _counter(coord, "prompt") > before[1], 5)
    grown = _counter(coord, "cached") - before[0], _counter(coord, "prompt") - before[1]
    return usage, line, grown


ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"]


@pytest.mark.parametrize("model", [UNION, PD])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("route", ROUTES)
def test_the_engines_cached_count_is_reported_in_usage_log_and_metrics(coord, route, stream, model):
    """A new prompt, then the same again: nothing cached, then its blocks (a PD request's are P's: D's usage says
    the whole prompt, which it pulled). The log line and the tenant's counters say what the client's usage says."""
    text = f"{route} {stream} {model}: {TURN}"
    seen = []
    for _ in range(2):
        usage, line, (cached_grown, prompt_grown) = serve(coord, route, model, text, stream)
        cached = _cached(usage)
        assert line["cached_tokens"] == str(cached), (line, usage)
        assert "cached_tokens_predicted" in line
        assert cached_grown == cached and prompt_grown == int(line["prompt_tokens"])
        if not stream:  # a JSON answer's prompt count is the engine's (a stream's is the scheduler's)
            prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
            assert line["prompt_tokens"] == str(prompt)
        seen.append(cached)
    assert seen[0] == 0 and seen[1] > 0, seen


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_a_stream_without_a_usage_chunk_reports_only_what_p_said(coord, route):
    """Without `include_usage` an OpenAI stream carries no usage: whole on one engine nothing is known of its cache
    (the line says `-`, the counter stays); through PD, P's answer said it."""
    text = f"{route} no usage: {TURN}"
    for model in (UNION, PD):
        serve(coord, route, model, text, False)  # its blocks cached on the engine (on P)
    usage, line, (cached_grown, _) = serve(coord, route, UNION, text, True, include_usage=False)
    assert usage is None and line["cached_tokens"] == "-" and cached_grown == 0
    p_said, _, _ = serve(coord, route, PD, text, False)
    usage, line, (cached_grown, _) = serve(coord, route, PD, text, True, include_usage=False)
    assert usage is None and int(line["cached_tokens"]) == _cached(p_said) > 0 and cached_grown == _cached(p_said)


# An engine's stream whose usage event comes in its own block, its last event a moment later: the cached count is
# then in the block before the last (the relay reads both). Each: the events, then the last one.
HELD_CACHED = 48
_CHUNK = '{"id":"c","object":"chat.completion.chunk","created":1,"model":"held","choices":[%s]%s}'
_OPENAI_USAGE = (
    ',"usage":{"prompt_tokens":80,"completion_tokens":1,"total_tokens":81,"prompt_tokens_details":{"cached_tokens":%d}}'
)
HELD_STREAMS = {
    "/v1/chat/completions": (
        [
            "data: "
            + _CHUNK % ('{"index":0,"delta":{"role":"assistant","content":"hi"},"finish_reason":"length"}', ""),
            "data: " + _CHUNK % ("", _OPENAI_USAGE % HELD_CACHED),
        ],
        "data: [DONE]",
    ),
    "/v1/messages": (
        [
            'event: message_start\ndata: {"type":"message_start","message":{"id":"m","type":"message","role":'
            '"assistant","content":[],"model":"held","usage":{"input_tokens":80,"output_tokens":0}}}',
            'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
            '"delta":{"type":"text_delta","text":"hi"}}',
            'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"max_tokens"},"usage":'
            '{"input_tokens":32,"output_tokens":1,"cache_creation_input_tokens":0,"cache_read_input_tokens":%d}}'
            % HELD_CACHED,
        ],
        'event: message_stop\ndata: {"type":"message_stop"}',
    ),
}


class HeldBack(ThreadedApp):
    """A union engine (its own thread and loop) that streams HELD_STREAMS, holding each stream's last event back
    a moment after the others (so that the relay reads them in two blocks); /health and /metrics answer."""

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if request.path not in HELD_STREAMS:
            return web.Response(text="")
        events, last = HELD_STREAMS[request.path]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write("".join(e + "\n\n" for e in events).encode())
        await asyncio.sleep(0.2)
        await resp.write(last.encode() + b"\n\n")
        await resp.write_eof()
        return resp


@pytest.mark.parametrize("route", list(HELD_STREAMS))
def test_a_usage_in_the_block_before_the_streams_last_is_read(coord, route):
    """The usage event (chat's usage chunk, Messages' message_delta) and the last event (`[DONE]`, message_stop)
    in two blocks: the count is the usage's."""
    usage, line, (cached_grown, _) = serve(coord, route, HELD, "a held stream", True)
    assert _cached(usage) == HELD_CACHED
    assert line["cached_tokens"] == str(HELD_CACHED) and cached_grown == HELD_CACHED
