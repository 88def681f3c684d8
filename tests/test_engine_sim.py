"""Tests of engine_sim, the vLLM-faithful engine simulator (fast: speedup / zero-latency)."""

import json
import threading
import time

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_sim import SimConfig, launch
from engine_sim.tokens import count_text_tokens, decode_token_ids, render_chat_prompt

pytestmark = pytest.mark.timeout(30)

MSG = [{"role": "user", "content": "Tell me about rivers."}]


@pytest.fixture(scope="module")
def union():
    with launch(SimConfig(role="union", model="m", speedup=50)) as h:
        yield h


@pytest.fixture
def fresh():
    hs = []

    def make(**kw):
        kw.setdefault("model", "m")
        kw.setdefault("speedup", 50)
        h = launch(SimConfig(**kw))
        hs.append(h)
        return h

    yield make
    for h in hs:
        h.stop()


def sse_events(text):
    """Split an SSE body into (event, data) pairs."""
    out = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        ev, data = None, None
        for line in block.split("\n"):
            if line.startswith("event: "):
                ev = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
        out.append((ev, data))
    return out


def oa(h):
    return openai.OpenAI(base_url=h.url + "/v1", api_key="x", max_retries=0)


def an(h):
    return anthropic.Anthropic(base_url=h.url, api_key="x", max_retries=0)


# ---------------------------------------------------------------------------- tokens.py
def test_token_estimate_and_template():
    assert count_text_tokens("") == 0
    assert count_text_tokens("a") == 1
    assert count_text_tokens("abcd") == 1 and count_text_tokens("abcde") == 2
    assert count_text_tokens("é") == 1  # 2 utf-8 bytes
    p = render_chat_prompt([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert p == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with_tools = render_chat_prompt([{"role": "user", "content": "hi"}], tools=[{"name": "t"}])
    assert with_tools.startswith("<|im_start|>system\n") and '"name": "t"' in with_tools


# ---------------------------------------------------------------------------- OpenAI routes
def test_models_and_health(union):
    r = httpx.get(union.url + "/health")
    assert r.status_code == 200 and r.content == b""
    d = httpx.get(union.url + "/v1/models").json()
    assert d["object"] == "list"
    m = d["data"][0]
    assert m["id"] == "m" and m["owned_by"] == "vllm" and m["root"] == "m"
    assert m["max_model_len"] == 8192 and m["parent"] is None and m["permission"]


def test_chat_json_shape_via_sdk(union):
    r = oa(union).chat.completions.with_raw_response.create(
        model="m", messages=MSG, max_tokens=5, extra_headers={"X-Request-Id": "req-42"}
    )
    assert r.headers["x-request-id"] == "req-42"
    c = r.parse()
    assert c.id == "chatcmpl-req-42" and c.object == "chat.completion"
    assert c.choices[0].finish_reason == "length"
    assert c.usage.completion_tokens == 5
    assert c.usage.prompt_tokens == count_text_tokens(render_chat_prompt(MSG))
    raw = json.loads(r.text)
    msg = raw["choices"][0]["message"]
    assert msg["role"] == "assistant" and msg["refusal"] is None and "reasoning" in msg
    assert raw["kv_transfer_params"] is None
    assert raw["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert raw["choices"][0]["stop_reason"] is None


def test_chat_stream_shape(union):
    r = httpx.post(
        union.url + "/v1/chat/completions",
        json={
            "model": "m",
            "messages": MSG,
            "stream": True,
            "max_tokens": 6,
            "stream_options": {"include_usage": True},
        },
    )
    assert r.headers["content-type"].startswith("text/event-stream")
    ev = sse_events(r.text)
    assert ev[-1] == (None, "[DONE]")
    chunks = [json.loads(d) for _, d in ev[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    choice_chunks = [c for c in chunks if c["choices"]]
    assert all(c["choices"][0]["finish_reason"] is None for c in choice_chunks[:-1])
    assert choice_chunks[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in choice_chunks)
    # same request non-streamed gives the same text
    j = httpx.post(union.url + "/v1/chat/completions", json={"model": "m", "messages": MSG, "max_tokens": 6}).json()
    assert j["choices"][0]["message"]["content"] == text


def test_chat_stream_sdk_and_n2(union):
    s = oa(union).chat.completions.create(
        model="m", messages=MSG, stream=True, n=2, max_tokens=4, stream_options={"include_usage": True}
    )
    texts, finishes, usage = {0: "", 1: ""}, {}, None
    for ch in s:
        if ch.usage:
            usage = ch.usage
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert finishes == {0: "length", 1: "length"}
    assert usage.completion_tokens == 8
    assert texts[0] and texts[1]


def test_completions_json_and_stream(union):
    c = oa(union).completions.create(model="m", prompt="Once upon a time", max_tokens=4)
    assert c.id.startswith("cmpl-") and c.object == "text_completion"
    assert c.choices[0].logprobs is None and c.choices[0].finish_reason == "length"
    assert c.usage.prompt_tokens == count_text_tokens("Once upon a time")
    ev = sse_events(
        httpx.post(
            union.url + "/v1/completions",
            json={"model": "m", "prompt": "Once upon a time", "max_tokens": 4, "stream": True},
        ).text
    )
    assert ev[-1][1] == "[DONE]"
    chunks = [json.loads(d) for _, d in ev[:-1]]
    assert "".join(x["choices"][0]["text"] for x in chunks) == c.choices[0].text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    tok = oa(union).completions.create(model="m", prompt=[1, 2, 3, 4, 5], max_tokens=1)
    assert tok.usage.prompt_tokens == 5


def test_determinism_seed_and_stop(union):
    cl = oa(union)
    a = cl.chat.completions.create(model="m", messages=MSG, seed=7, max_tokens=20, extra_body={"ignore_eos": True})
    b = cl.chat.completions.create(model="m", messages=MSG, seed=7, max_tokens=20, extra_body={"ignore_eos": True})
    c = cl.chat.completions.create(model="m", messages=MSG, seed=8, max_tokens=20, extra_body={"ignore_eos": True})
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].message.content != c.choices[0].message.content
    words = a.choices[0].message.content.split()
    stop = words[3]
    s = cl.chat.completions.create(
        model="m", messages=MSG, seed=7, max_tokens=20, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert s.choices[0].finish_reason == "stop"
    assert stop not in s.choices[0].message.content
    assert json.loads(s.model_dump_json())["choices"][0]["stop_reason"] == stop
    # without ignore_eos the sim stops on its own EOS (finish 'stop') well before 500 tokens
    e = cl.chat.completions.create(model="m", messages=MSG, max_tokens=500)
    assert e.choices[0].finish_reason == "stop" and 8 <= e.usage.completion_tokens <= 64


def test_logprobs(union):
    c = oa(union).chat.completions.create(model="m", messages=MSG, max_tokens=3, logprobs=True, top_logprobs=2)
    lp = c.choices[0].logprobs.content
    assert len(lp) == 3 and len(lp[0].top_logprobs) == 2 and lp[0].logprob <= 0


def test_validation_errors(union):
    u = union.url
    r = httpx.post(u + "/v1/chat/completions", json={"model": "m"})
    assert r.status_code == 400
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["code"] == 400
    r = httpx.post(
        u + "/v1/chat/completions", json={"model": "m", "messages": MSG, "stream_options": {"include_usage": True}}
    )
    assert r.status_code == 400 and "stream" in r.json()["error"]["message"]
    r = httpx.post(u + "/v1/chat/completions", json={"model": "nope", "messages": MSG})
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    r = httpx.post(u + "/v1/completions", json={"model": "m", "prompt": "x" * 40000})
    assert r.status_code == 400
    assert "maximum context length is 8192 tokens" in r.json()["error"]["message"]
    r = httpx.post(u + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": "a"})
    assert r.status_code == 400
    r = httpx.post(u + "/v1/completions", json={"model": "m"})
    assert r.status_code == 400
    with pytest.raises(openai.NotFoundError):
        oa(union).chat.completions.create(model="zzz", messages=MSG)


def test_numbers_and_booleans_are_read_as_pydantic_reads_them(union):
    """vLLM's request models run in pydantic's lax mode: "3" and 3.0 are integers, "yes" is true; the
    rest is vLLM's RequestValidationError, every error listed, `param` the first one's location."""
    u = union.url
    j = httpx.post(u + "/v1/chat/completions", json={"model": "m", "messages": MSG, "max_tokens": "3", "n": 2.0})
    assert j.status_code == 200 and j.json()["usage"]["completion_tokens"] == 6 and len(j.json()["choices"]) == 2
    c = httpx.post(u + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 1, "echo": "yes"})
    assert c.status_code == 200 and c.json()["choices"][0]["text"].startswith("hi")
    bad = httpx.post(u + "/v1/chat/completions", json={"model": "m", "messages": MSG, "max_tokens": 2.5})
    e = bad.json()["error"]
    assert bad.status_code == 400 and e["type"] == "Bad Request" and e["param"] == "body.max_tokens"
    assert e["message"] == (
        "1 validation error:\n  {'type': 'int_from_float', 'loc': ('body', 'max_tokens'), "
        "'msg': 'Input should be a valid integer, got a number with a fractional part', 'input': 2.5}"
    )
    two = httpx.post(u + "/v1/chat/completions", json={"model": "m", "messages": MSG, "max_tokens": 2.5, "n": "x"})
    assert two.status_code == 400 and two.json()["error"]["message"].startswith("2 validation errors:\n")


def test_unknown_fields_recorded(union):
    union.reset()
    oa(union).chat.completions.create(model="m", messages=MSG, max_tokens=1, extra_body={"my_custom_field": {"a": 1}})
    recs = union.requests()
    assert recs[-1]["path"] == "/v1/chat/completions"
    assert recs[-1]["body"]["my_custom_field"] == {"a": 1}
    assert union.stats()["received"] == 1 and union.stats()["completed"] == 1


def test_a_prompt_that_cannot_be_encoded_is_a_400(union):
    """A lone surrogate (valid JSON, not UTF-8): vLLM's tokenizer raises a ValueError, which it answers with 400."""
    for path, body in (
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "\ud800"}], "max_tokens": 2}),
        ("/v1/messages", {"model": "m", "messages": [{"role": "user", "content": "\ud800"}], "max_tokens": 2}),
        ("/v1/messages/count_tokens", {"model": "m", "messages": [{"role": "user", "content": "\ud800"}]}),
    ):
        r = httpx.post(union.url + path, content=json.dumps(body), headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (path, r.text)


def test_prefix_cache_hits(union):
    long = [{"role": "user", "content": "shared system context " * 40}]
    a = oa(union).chat.completions.create(model="m", messages=long, max_tokens=1)
    b = oa(union).chat.completions.create(model="m", messages=long, max_tokens=1)
    assert a.usage.prompt_tokens_details.cached_tokens == 0
    cached = b.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 16 == 0 and cached < b.usage.prompt_tokens


def test_a_cache_salt_scopes_the_prefix_cache_as_vllms(union):
    """vLLM's cache_salt enters a prompt's first block hash: the same prompt under another salt, or none, hits
    nothing; under its own it hits. A salt vLLM refuses (empty, over 128 characters, '/') is refused so."""
    long = [{"role": "user", "content": "salted system context " * 40}]

    def hit(salt):
        extra = {"cache_salt": salt} if salt else None
        r = oa(union).chat.completions.create(model="m", messages=long, max_tokens=1, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens

    assert hit("tenant-a") == 0
    assert hit(None) == 0 and hit("tenant-b") == 0
    assert hit("tenant-a") > 0 and hit(None) > 0
    for bad in ("", "x" * 129, "a/b", 7):
        r = httpx.post(union.url + "/v1/completions", json={"model": "m", "prompt": "hi", "cache_salt": bad})
        assert r.status_code == 400 and "cache_salt" in r.text, (bad, r.text)


# ---------------------------------------------------------------------------- Anthropic
def test_messages_json_and_stream_sdk(union):
    cl = an(union)
    m = cl.messages.create(
        model="m",
        max_tokens=10,
        system=[{"type": "text", "text": "be brief"}],
        messages=[{"role": "user", "content": "hi"}],
        stop_sequences=["zzzz"],
        extra_body={"whatever": 1, "top_k": 5},
    )
    assert m.type == "message" and m.role == "assistant"
    assert m.content[0].type == "text" and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens <= 10
    with cl.messages.stream(model="m", max_tokens=10, messages=[{"role": "user", "content": "hi"}]) as s:
        events = [e.type for e in s]
        final = s.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert final.content[0].text and 0 < final.usage.output_tokens <= 10
    raw = httpx.post(
        union.url + "/v1/messages",
        json={"model": "m", "max_tokens": 10, "stream": True, "messages": [{"role": "user", "content": "hi"}]},
    ).text
    names = [e for e, _ in sse_events(raw)]
    assert names[0] == "message_start" and names[1] == "content_block_start"
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert "[DONE]" not in raw
    md = json.loads(sse_events(raw)[-2][1])
    assert md["delta"]["stop_reason"] in ("end_turn", "max_tokens") and md["usage"]["output_tokens"] > 0


def test_messages_tool_use_and_thinking(union):
    tools = [
        {
            "name": "get_weather",
            "description": "w",
            "input_schema": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        }
    ]
    m = an(union).messages.create(
        model="m", max_tokens=100, tools=tools, messages=[{"role": "user", "content": "weather?"}]
    )
    assert m.stop_reason == "tool_use"
    tu = [b for b in m.content if b.type == "tool_use"][0]
    assert tu.name == "get_weather" and tu.input == {"city": "sample", "days": 1}
    raw = httpx.post(
        union.url + "/v1/messages",
        json={
            "model": "m",
            "max_tokens": 2048,
            "stream": True,
            "tools": tools,
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "messages": [{"role": "user", "content": "weather?"}],
        },
    ).text
    ev = [(e, json.loads(d)) for e, d in sse_events(raw)]
    starts = [d["content_block"]["type"] for e, d in ev if e == "content_block_start"]
    assert starts == ["thinking", "tool_use"]
    deltas = {d["delta"]["type"] for e, d in ev if e == "content_block_delta"}
    assert {"thinking_delta", "signature_delta", "input_json_delta"} <= deltas
    pj = "".join(
        d["delta"]["partial_json"]
        for e, d in ev
        if e == "content_block_delta" and d["delta"]["type"] == "input_json_delta"
    )
    assert json.loads(pj) == {"city": "sample", "days": 1}
    assert ev[-2][1]["delta"]["stop_reason"] == "tool_use"
    none = an(union).messages.create(
        model="m",
        max_tokens=20,
        tools=tools,
        tool_choice={"type": "none"},
        messages=[{"role": "user", "content": "weather?"}],
    )
    assert all(b.type == "text" for b in none.content)


WEATHER = [
    {
        "name": "get_weather",
        "description": "w",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]


def test_messages_named_tool_cut_by_max_tokens_is_vllms_400(union):
    """A named tool choice makes the answer the call's arguments and vLLM json.loads them: a call cut by
    max_tokens is a JSONDecodeError, answered 400 in vLLM's Anthropic envelope. "any" ("required") lets
    the unparsable call go: one empty text block. Streamed, nothing is parsed: max_tokens."""
    named = {"type": "tool", "name": "get_weather"}
    with pytest.raises(anthropic.BadRequestError) as e:
        an(union).messages.create(model="m", max_tokens=2, tools=WEATHER, tool_choice=named, messages=MSG)
    assert e.value.status_code == 400
    assert set(e.value.body) == {"type", "error"} and e.value.body["error"]["type"] == "BadRequestError"
    assert e.value.body["error"]["message"] == "Expecting value: line 1 column 9 (char 8)"  # json.loads('{"city":')
    m = an(union).messages.create(model="m", max_tokens=2, tools=WEATHER, tool_choice={"type": "any"}, messages=MSG)
    assert m.stop_reason == "max_tokens" and [b.model_dump(exclude_none=True) for b in m.content] == [
        {"type": "text", "text": ""}
    ]
    with an(union).messages.stream(model="m", max_tokens=2, tools=WEATHER, tool_choice=named, messages=MSG) as s:
        assert s.get_final_message().stop_reason == "max_tokens"
    whole = an(union).messages.create(model="m", max_tokens=64, tools=WEATHER, tool_choice=named, messages=MSG)
    assert whole.stop_reason == "tool_use" and whole.content[0].input == {"city": "sample"}
    r = httpx.post(
        union.url + "/v1/messages",
        json={
            "model": "m",
            "max_tokens": 64,
            "tools": WEATHER,
            "messages": MSG,
            "tool_choice": {"type": "tool", "name": "nope"},
        },
    )
    assert r.status_code == 400 and r.json()["error"]["message"] == "Tool 'nope' has not been passed in `tools`."


def test_messages_thinking_budget_is_validated_like_vllm(fresh):
    """budget_tokens: an integer >= 1024, and below max_tokens except on a prefill leg (do_remote_decode)."""
    p = fresh(role="prefill")

    def post(thinking, max_tokens, **extra):
        return httpx.post(
            p.url + "/v1/messages",
            json={"model": "m", "max_tokens": max_tokens, "messages": MSG, "thinking": thinking, **extra},
        )

    low = post({"type": "enabled", "budget_tokens": 16}, 24)
    assert low.status_code == 400 and low.json()["error"]["param"] == "body.thinking.enabled.budget_tokens"
    assert "greater than or equal to 1024" in low.json()["error"]["message"]
    for budget, max_tokens in ((2048, 2048), (4096, 100)):
        r = post({"type": "enabled", "budget_tokens": budget}, max_tokens)
        assert r.status_code == 400 and r.json()["error"]["type"] == "Bad Request"
        assert "thinking.budget_tokens must be less than max_tokens" in r.json()["error"]["message"]
    leg = post({"type": "enabled", "budget_tokens": 2048}, 1, kv_transfer_params=PREFILL_KVP)
    assert leg.status_code == 200 and leg.json()["kv_transfer_params"]["do_remote_prefill"] is True
    assert post({"type": "enabled", "budget_tokens": 2048}, 16, kv_transfer_params=PREFILL_KVP).status_code == 200
    assert post({"type": "enabled", "budget_tokens": 16}, 1, kv_transfer_params=PREFILL_KVP).status_code == 400
    assert post({"type": "enabled", "budget_tokens": 1024}, 1025).status_code == 200
    assert post({"type": "enabled", "budget_tokens": "2000"}, 4000).status_code == 200  # pydantic's lax int
    assert post({"type": "enabled", "budget_tokens": 2000.5}, 4000).status_code == 400
    assert post({"type": "enabled"}, 4000).status_code == 400
    assert post({"type": "sometimes"}, 4000).status_code == 400
    assert post({"type": "adaptive"}, 4).status_code == post({"type": "disabled"}, 4).status_code == 200


def test_messages_cache_usage_is_vllms(fresh):
    """With cache details vLLM's input_tokens is the prompt less the cache reads (and writes); message_start
    carries the whole prompt and no cache fields (its usage comes from the stream's first chunk)."""
    u = fresh(role="union", anthropic_cache_usage=True)
    msgs = [{"role": "user", "content": "cache me " * 40}]
    prompt = an(u).messages.count_tokens(model="m", messages=msgs).input_tokens
    first = an(u).messages.create(model="m", max_tokens=4, messages=msgs).usage
    assert (first.input_tokens, first.cache_read_input_tokens, first.cache_creation_input_tokens) == (prompt, 0, 0)
    second = an(u).messages.create(model="m", max_tokens=4, messages=msgs).usage
    assert 0 < second.cache_read_input_tokens < prompt
    assert second.input_tokens == prompt - second.cache_read_input_tokens
    raw = httpx.post(
        u.url + "/v1/messages", json={"model": "m", "max_tokens": 4, "messages": msgs, "stream": True}
    ).text
    ev = {e: json.loads(d) for e, d in sse_events(raw)}
    assert ev["message_start"]["message"]["usage"] == {"input_tokens": prompt, "output_tokens": 0}
    usage = ev["message_delta"]["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == prompt and usage["cache_read_input_tokens"] > 0


def test_count_tokens_and_images(union):
    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is this"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
            ],
        }
    ]
    r = an(union).messages.count_tokens(model="m", messages=msgs)
    raw = httpx.post(union.url + "/v1/messages/count_tokens", json={"model": "m", "messages": msgs}).json()
    assert raw == {"input_tokens": r.input_tokens, "context_management": {"original_input_tokens": r.input_tokens}}
    txt = an(union).messages.count_tokens(model="m", messages=[{"role": "user", "content": "what is this"}])
    assert r.input_tokens >= txt.input_tokens + 60  # an image counts ~64 tokens
    m = an(union).messages.create(model="m", max_tokens=1, messages=msgs)
    assert m.usage.input_tokens == r.input_tokens
    bad = httpx.post(union.url + "/v1/messages", json={"model": "zzz", "max_tokens": 3, "messages": msgs})
    assert bad.status_code == 404 and bad.json()["type"] == "error"
    assert bad.json()["error"]["type"] == "NotFoundError"
    missing = httpx.post(union.url + "/v1/messages", json={"model": "m", "messages": msgs})
    assert missing.status_code == 400


# ---------------------------------------------------------------------------- PD
PREFILL_KVP = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def test_pd_handoff(fresh):
    p = fresh(role="prefill")
    d = fresh(role="decode")
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "pd prompt " * 30}],
        "max_tokens": 1,
        "kv_transfer_params": PREFILL_KVP,
    }
    pr = httpx.post(p.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": "pd-1"}).json()
    kvp = pr["kv_transfer_params"]
    assert set(kvp) == {
        "do_remote_prefill",
        "do_remote_decode",
        "remote_block_ids",
        "remote_engine_id",
        "remote_request_id",
        "remote_host",
        "remote_port",
        "tp_size",
        "dcp_size",
        "pp_size",
        "remote_num_tokens",
        "remote_blocks_expiry_time",
        "transfer_mode",
        "remote_prefill_cached_tokens",
    }
    assert kvp["do_remote_prefill"] is True and kvp["remote_engine_id"] == p.engine_id
    assert kvp["remote_port"] == p.port and kvp["transfer_mode"] == "pull"
    assert kvp["remote_num_tokens"] == pr["usage"]["prompt_tokens"]
    assert isinstance(kvp["remote_block_ids"][0], list)
    assert p.stats()["held_kv_tickets"] == 1 and p.stats()["kv_used_tokens"] > 0
    dbody = dict(body, max_tokens=5, stream=True, stream_options={"include_usage": True}, kv_transfer_params=kvp)
    ev = sse_events(httpx.post(d.url + "/v1/chat/completions", json=dbody, headers={"X-Request-Id": "pd-1"}).text)
    usage = json.loads(ev[-2][1])["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == kvp["remote_num_tokens"]
    assert p.stats()["kv_pulled"] == 1 and p.stats()["held_kv_tickets"] == 0
    assert d.stats()["remote_kv_hits"] == 1 and d.stats()["recomputes"] == 0
    metrics = httpx.get(d.url + "/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(metrics)}
    xfer = [s for s in fams["vllm:nixl_xfer_time_seconds"].samples if s.name.endswith("_count")]
    assert xfer[0].value == 1
    src = {s.labels["source"]: s.value for s in fams["vllm:prompt_tokens_by_source"].samples}
    assert src["external_kv_transfer"] == kvp["remote_num_tokens"]
    # the same ticket again: already pulled → D recomputes, still answers
    j = httpx.post(d.url + "/v1/chat/completions", json=dict(body, max_tokens=2, kv_transfer_params=kvp)).json()
    assert j["choices"][0]["message"]["content"] is not None and j["kv_transfer_params"] is None
    assert d.stats()["recomputes"] == 1


def test_pd_no_ticket_paths_and_release(fresh):
    p = fresh(role="prefill")
    d = fresh(role="decode")
    body = {"model": "m", "messages": MSG, "max_tokens": 1, "kv_transfer_params": PREFILL_KVP}
    p.set_faults(eos_on_prefill=True)
    r = httpx.post(p.url + "/v1/chat/completions", json=body).json()
    assert r["kv_transfer_params"] is None and p.stats()["held_kv_tickets"] == 0
    p.clear_faults()
    # a prefill leg that ends on EOS (not the length cap) returns no ticket either
    r = httpx.post(p.url + "/v1/chat/completions", json=dict(body, max_tokens=200)).json()
    assert r["choices"][0]["finish_reason"] == "stop" and r["kv_transfer_params"] is None
    assert p.stats()["held_kv_tickets"] == 0 and p.stats()["prefill_without_ticket"] == 2
    # release frees the held ticket; pulling it afterwards is a 404
    kvp = httpx.post(p.url + "/v1/chat/completions", json=body).json()["kv_transfer_params"]
    assert (
        httpx.post(p.url + "/sim/kv/release", json={"remote_request_id": kvp["remote_request_id"]}).status_code == 200
    )
    assert p.stats()["kv_released"] == 1 and p.stats()["held_kv_tickets"] == 0
    assert (
        httpx.post(
            p.url + "/sim/kv/pull",
            json={"remote_request_id": kvp["remote_request_id"], "remote_engine_id": p.engine_id},
        ).status_code
        == 404
    )
    # Anthropic traffic through P and D
    mb = {"model": "m", "max_tokens": 1, "messages": MSG, "kv_transfer_params": PREFILL_KVP}
    mp = httpx.post(p.url + "/v1/messages", json=mb).json()
    assert mp["kv_transfer_params"]["do_remote_prefill"] is True
    md = httpx.post(
        d.url + "/v1/messages", json=dict(mb, max_tokens=4, kv_transfer_params=mp["kv_transfer_params"])
    ).json()
    assert "kv_transfer_params" not in md and d.stats()["remote_kv_hits"] == 1
    # P dead → D answers 500 at once
    kvp = httpx.post(p.url + "/v1/chat/completions", json=body).json()["kv_transfer_params"]
    p.stop()
    r = httpx.post(d.url + "/v1/chat/completions", json=dict(body, max_tokens=3, kv_transfer_params=kvp))
    assert r.status_code == 500 and r.json()["error"]["code"] == 500


def test_ticket_expiry(fresh):
    p = fresh(role="prefill", kv_hold_timeout_s=0.2, speedup=1)
    body = {"model": "m", "messages": MSG, "max_tokens": 1, "kv_transfer_params": PREFILL_KVP}
    httpx.post(p.url + "/v1/chat/completions", json=body)
    assert p.stats()["held_kv_tickets"] == 1
    time.sleep(0.4)
    s = p.stats()
    assert s["held_kv_tickets"] == 0 and s["kv_expired"] == 1


def test_union_ignores_kv_transfer_params(union):
    r = httpx.post(
        union.url + "/v1/chat/completions",
        json={"model": "m", "messages": MSG, "max_tokens": 1, "kv_transfer_params": PREFILL_KVP},
    ).json()
    assert r["kv_transfer_params"] is None


# ---------------------------------------------------------------------------- aborts & faults
def test_abort_recorded_on_disconnect(fresh):
    h = fresh(role="union", speedup=1, decode_step_ms=20)
    with httpx.stream(
        "POST",
        h.url + "/v1/chat/completions",
        headers={"X-Request-Id": "gone"},
        json={"model": "m", "messages": MSG, "stream": True, "max_tokens": 200, "extra": 1, "ignore_eos": True},
    ) as r:
        it = r.iter_lines()
        got = 0
        for line in it:
            if line.startswith("data: "):
                got += 1
            if got >= 3:
                break
    deadline = time.time() + 5
    while time.time() < deadline and h.stats()["aborted"] == 0:
        time.sleep(0.02)
    s = h.stats()
    assert s["aborted"] == 1 and s["aborted_request_ids"] == ["gone"]
    assert s["running"] == 0 and s["completed"] == 0


def test_fault_knobs(fresh):
    h = fresh(role="union", faults={"fail_first_n": 2})
    c = openai.OpenAI(base_url=h.url + "/v1", api_key="x", max_retries=0)
    for _ in range(2):
        with pytest.raises(openai.InternalServerError):
            c.chat.completions.create(model="m", messages=MSG, max_tokens=1)
    assert c.chat.completions.create(model="m", messages=MSG, max_tokens=1).choices
    h.set_faults(fail_status=503)
    r = httpx.post(h.url + "/v1/chat/completions", json={"model": "m", "messages": MSG})
    assert r.status_code == 503 and r.json()["error"]["code"] == 503
    assert httpx.get(h.url + "/health").status_code == 200  # faults spare /health
    h.clear_faults()
    httpx.post(h.url + "/sim/faults", json={"health_status": 503})
    assert httpx.get(h.url + "/health").status_code == 503
    httpx.delete(h.url + "/sim/faults")
    h.set_faults(malformed_chunk_after_n=2)
    txt = httpx.post(
        h.url + "/v1/chat/completions", json={"model": "m", "messages": MSG, "stream": True, "max_tokens": 4}
    ).text
    assert "data: {not json\n\n" in txt
    h.clear_faults()
    h.set_faults(close_mid_stream_after_n=2)
    with pytest.raises(httpx.HTTPError):
        httpx.post(
            h.url + "/v1/chat/completions",
            json={"model": "m", "messages": MSG, "stream": True, "max_tokens": 10, "ignore_eos": True},
        )
    h.clear_faults()
    h.set_faults(hang_before_first_byte=True)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(h.url + "/v1/chat/completions", json={"model": "m", "messages": MSG}, timeout=0.3)
    h.set_faults(hang_before_first_byte=None, stall_mid_stream_after_n=1)
    got = []
    with pytest.raises(httpx.ReadTimeout):
        with httpx.stream(
            "POST",
            h.url + "/v1/chat/completions",
            timeout=0.5,
            json={"model": "m", "messages": MSG, "stream": True, "max_tokens": 10},
        ) as r:
            for line in r.iter_lines():
                if line:
                    got.append(line)
    assert len(got) == 1


def test_metrics_parse(union):
    oa(union).chat.completions.create(model="m", messages=MSG, max_tokens=3)
    text = httpx.get(union.url + "/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:prompt_tokens_by_source",
    ):
        assert name in fams, name
    s = fams["vllm:num_requests_running"].samples[0]
    assert s.labels == {"model_name": "m", "engine": "0"}
    ttft = [x for x in fams["vllm:time_to_first_token_seconds"].samples if x.name.endswith("_count")][0]
    assert ttft.value >= 1
    gen = fams["vllm:generation_tokens"].samples[0]
    assert gen.name == "vllm:generation_tokens_total" and gen.value >= 3
    assert "vllm:prompt_tokens_total{" in text and "vllm:num_requests_waiting{" in text


def test_timing_long_prompt_slower_and_queueing(fresh):
    h = fresh(role="union", speedup=2, prefill_tokens_per_s=8000, max_num_seqs=2)

    def ttft(content):
        t0 = time.perf_counter()
        with httpx.stream(
            "POST",
            h.url + "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": content}], "stream": True, "max_tokens": 2},
        ) as r:
            for line in r.iter_lines():
                if '"content":""' not in line and line.startswith("data: {"):
                    return time.perf_counter() - t0

    short = min(ttft("hi %d" % i) for i in range(3))
    long = ttft("unique long prompt " * 1500)  # ~7.1k tokens ≈ 0.9 s / 2
    assert long > short * 2
    # more running requests than max_num_seqs → some wait
    results = []

    def slow():
        results.append(
            httpx.post(
                h.url + "/v1/chat/completions",
                timeout=20,
                json={"model": "m", "messages": MSG, "max_tokens": 40, "ignore_eos": True},
            ).status_code
        )

    ts = [threading.Thread(target=slow) for _ in range(5)]
    for t in ts:
        t.start()
    seen_waiting = 0
    while any(t.is_alive() for t in ts):
        seen_waiting = max(seen_waiting, h.stats()["waiting"])
        time.sleep(0.005)
    assert results == [200] * 5 and seen_waiting >= 1


def test_zero_latency_and_cli_free_port():
    with launch(SimConfig(model="z", zero_latency=True)) as h:
        for _ in range(20):
            r = httpx.post(
                h.url + "/v1/chat/completions",
                json={"model": "z", "messages": MSG, "max_tokens": 50, "ignore_eos": True},
            )
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 50
        assert h.stats()["completed"] == 20
        assert h.address == f"127.0.0.1:{h.port}" and h.port > 0


def test_abort_non_streaming_and_kv_pressure(fresh):
    # a non-streaming request whose client gives up is aborted in the engine too
    h = fresh(role="prefill", speedup=1, prefill_tokens_per_s=2000)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            h.url + "/v1/completions",
            timeout=0.2,
            headers={"X-Request-Id": "nb"},
            json={"model": "m", "prompt": "z" * 20000, "max_tokens": 1, "kv_transfer_params": PREFILL_KVP},
        )
    deadline = time.time() + 5
    while time.time() < deadline and h.stats()["aborted"] == 0:
        time.sleep(0.02)
    s = h.stats()
    assert s["aborted_request_ids"] == ["nb"] and s["held_kv_tickets"] == 0
    # held KV blocks admission: capacity for one prompt only
    p = fresh(role="prefill", kv_capacity_tokens=512)
    body = {"model": "m", "prompt": "q" * 1200, "max_tokens": 1, "kv_transfer_params": PREFILL_KVP}
    kvp = httpx.post(p.url + "/v1/completions", json=body).json()["kv_transfer_params"]
    assert 0.5 < p.stats()["kv_cache_usage_perc"] <= 1.0
    out = []
    t = threading.Thread(
        target=lambda: out.append(
            httpx.post(p.url + "/v1/completions", timeout=10, json=dict(body, prompt="r" * 1200)).json()
        )
    )
    t.start()
    deadline = time.time() + 3
    while time.time() < deadline and p.stats()["waiting"] == 0:
        time.sleep(0.01)
    assert p.stats()["waiting"] == 1 and not out
    httpx.post(
        p.url + "/sim/kv/pull", json={"remote_request_id": kvp["remote_request_id"], "remote_engine_id": p.engine_id}
    )
    t.join(5)
    assert out and out[0]["kv_transfer_params"]["do_remote_prefill"] is True


# -- token ids and the mid-stream faults that break a stream after k tokens --------------------------------


def stream_chunks(h, path: str, body: dict) -> list[dict]:
    r = httpx.post(h.url + path, json={**body, "stream": True}, timeout=10)
    assert r.status_code == 200, r.text
    return [json.loads(d) for _, d in sse_events(r.text) if d and d != "[DONE]"]


def test_return_token_ids_as_vllm_places_them(union):
    body = {"model": "m", "messages": MSG, "max_tokens": 12, "seed": 3, "return_token_ids": True}
    js = httpx.post(union.url + "/v1/chat/completions", json=body, timeout=10).json()
    assert len(js["prompt_token_ids"]) == js["usage"]["prompt_tokens"]
    assert len(js["choices"][0]["token_ids"]) == js["usage"]["completion_tokens"]
    chunks = stream_chunks(union, "/v1/chat/completions", body | {"stream_options": {"include_usage": True}})
    assert chunks[0]["prompt_token_ids"] == js["prompt_token_ids"]  # once, at the top of the first chunk
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    streamed = [t for c in chunks[1:] for ch in c["choices"] for t in ch["token_ids"]]
    assert streamed == js["choices"][0]["token_ids"]
    text = "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"])
    assert text == js["choices"][0]["message"]["content"]

    plain = httpx.post(union.url + "/v1/chat/completions", json=body | {"return_token_ids": None}, timeout=10).json()
    assert plain["prompt_token_ids"] is None and plain["choices"][0]["token_ids"] is None
    chunks = stream_chunks(union, "/v1/completions", {"model": "m", "prompt": "rivers", "return_token_ids": True})
    assert chunks[0]["choices"][0]["prompt_token_ids"] == [int.from_bytes(b"\x01rive", "big"), 0x01727300 >> 8]
    assert all(c["choices"][0]["prompt_token_ids"] is None for c in chunks[1:])
    assert all(len(c["choices"][0]["token_ids"]) == 1 for c in chunks)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_prompt_of_the_ids_so_far_goes_on_as_the_unbroken_run(union, path):
    """The sim's model is autoregressive over token ids: the prompt's ids and the first k generated ones,
    sent as a completions prompt, generate exactly what the unbroken run generated after its k-th token."""
    first = {"messages": MSG} if path == "/v1/chat/completions" else {"prompt": "Tell me about rivers."}
    body = {"model": "m", **first, "max_tokens": 40, "seed": 11, "temperature": 0.7, "return_token_ids": True}
    js = httpx.post(union.url + path, json=body, timeout=10).json()
    choice = js["choices"][0]
    prompt_ids = js.get("prompt_token_ids") or choice["prompt_token_ids"]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    ids = choice["token_ids"]
    for k in (1, 5, len(ids) - 1):
        rest = {"model": "m", "prompt": prompt_ids + ids[:k], "max_tokens": 40 - k, "seed": 11, "temperature": 0.7}
        cont = httpx.post(union.url + "/v1/completions", json=rest | {"return_token_ids": True}, timeout=10).json()
        c = cont["choices"][0]
        assert c["token_ids"] == ids[k:]
        assert decode_token_ids(ids[:k]) + c["text"] == text
        assert c["finish_reason"] == choice["finish_reason"]
        assert cont["usage"]["prompt_tokens"] == len(prompt_ids) + k


@pytest.mark.parametrize("kind", ["die", "reset", "error", "stall"])
def test_mid_stream_faults_after_k_tokens(fresh, kind):
    h = fresh(role="union")
    h.set_faults(mid_stream_fault=kind, mid_stream_fault_after_tokens=3)
    body = {"model": "m", "messages": MSG, "max_tokens": 10, "ignore_eos": True, "stream": True}
    got = b""
    try:
        with httpx.stream("POST", h.url + "/v1/chat/completions", json=body, timeout=1.0) as r:
            for part in r.iter_bytes():
                got += part
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.ReadTimeout):
        pass
    tokens = [json.loads(d) for _, d in sse_events(got.decode()) if d and d != "[DONE]"]
    content = [c for c in tokens if c.get("choices") and c["choices"][0]["delta"].get("content")]
    assert len(content) == 3
    if kind == "error":
        assert tokens[-1]["error"]["code"] == 500 and got.endswith(b"data: [DONE]\n\n")
    alive = kind != "die"
    assert (httpx.get(h.url + "/health", timeout=2).status_code == 200) if alive else _unreachable(h.url + "/health")
    h.clear_faults()
    assert httpx.get(h.url + "/health", timeout=2).status_code == 200


def _unreachable(url: str) -> bool:
    try:
        httpx.get(url, timeout=2)
    except httpx.HTTPError:
        return True
    return False


def test_bytes_per_token_is_the_engines_tokenizer_everywhere(fresh):
    """Another tokenizer (3 bytes a token): usage, count_tokens, the context check, the prompt's ids and the
    prefix cache's blocks all count the prompt at its ratio."""
    h = fresh(bytes_per_token=3, max_model_len=400, anthropic_cache_usage=True)
    text = "abcdef" * 100  # 600 bytes: 200 tokens
    r = httpx.post(
        h.url + "/v1/completions", json={"model": "m", "prompt": text, "max_tokens": 2, "return_token_ids": True}
    ).json()
    assert r["usage"]["prompt_tokens"] == count_text_tokens(text, 3) == 200
    assert (
        len(r["choices"][0]["prompt_token_ids"]) == 200
        and decode_token_ids(r["choices"][0]["prompt_token_ids"]) == text
    )
    again = httpx.post(h.url + "/v1/completions", json={"model": "m", "prompt": text, "max_tokens": 2}).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 192  # 12 blocks of 16 tokens (48 bytes)
    messages = [{"role": "user", "content": text}]
    counted = anthropic.Anthropic(base_url=h.url, api_key="x").messages.count_tokens(model="m", messages=messages)
    assert counted.input_tokens == count_text_tokens(render_chat_prompt(messages), 3)
    r = httpx.post(
        h.url + "/v1/completions", json={"model": "m", "prompt": "abc" * 401}
    )  # 401 tokens (at 4 bytes a token 301: it would fit)
    assert r.status_code == 400 and "maximum context length is 400 tokens" in r.json()["error"]["message"]
