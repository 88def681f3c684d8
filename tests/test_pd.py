"""Prefill/decode disaggregation: handoff legs, ticket relay, usage fix-up, trigger, metaserver, fallback."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from config import Endpoint, Instance
from harness.bodies import sse_events
from harness.clients import openai_client as client
from harness.configs import coordinator_config, instance
from harness.coordinator import Coordinator
from harness.loopback import wait_until
from scheduling.registry import Registry
from serving.resolve import InstanceAddresses
from serving.usage import PrefillUsages
from state.shared import PREFILL_USAGE_SLOTS, SharedState
from tests.conftest import MODEL

# A field a future vLLM might add to its ticket, with a float that a careless re-encoder could change.
TICKET_EXTRA = {"future_field": {"nested": [1.5, "x", None]}, "remote_blocks_expiry_time": 1764475200.123456}


def rid(req: dict) -> str | None:
    return {k.lower(): v for k, v in req["headers"].items()}.get("x-request-id")


def legs(p, d, path="/v1/chat/completions"):
    p_req = [r for r in p.requests() if r["path"] == path][-1]
    d_req = [r for r in d.requests() if r["path"] == path][-1]
    return p_req, d_req


@pytest.fixture(scope="module")
def cluster(module_sims):
    p = module_sims("prefill", ticket_extra=TICKET_EXTRA)
    d = module_sims("decode")
    cfg = coordinator_config([instance(1, "prefill", MODEL, p.address), instance(2, "decode", MODEL, d.address)])
    with Coordinator(cfg) as coord:
        coord.p, coord.d = p, d
        yield coord


@pytest.fixture
def fresh(cluster):
    cluster.p.reset()
    cluster.d.reset()
    cluster.p.clear_faults()
    return cluster


def test_prefill_leg_is_length_capped_and_decode_leg_is_the_client_body(fresh):
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "tell me"}],
        "max_completion_tokens": 12,
        "stop": ["\n\n"],
        "stop_token_ids": [7],
        "min_tokens": 2,
        "n": 1,
        "temperature": 0.5,
        "stream": True,
        "stream_options": {"include_usage": True},
        "custom_field": [1, 2],
    }
    with httpx.stream(
        "POST", fresh.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": "pd-rid-1"}, timeout=30
    ) as r:
        assert r.status_code == 200
        r.read()
    p_req, d_req = legs(fresh.p, fresh.d)
    pb = p_req["body"]
    # No stream options, stop conditions or minimum: each is overridden by its engine default (the client's
    # bytes are relayed with the changes appended; the last value of a key is the one read).
    assert pb["stream"] is False and pb["stream_options"] is None
    assert pb["max_tokens"] == 1 and pb["max_completion_tokens"] == 1
    assert pb["ignore_eos"] is True and pb["n"] == 1
    assert pb["stop"] is None and pb["stop_token_ids"] is None and pb["min_tokens"] == 0
    assert pb["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    assert pb["messages"] == body["messages"] and pb["custom_field"] == [1, 2] and pb["temperature"] == 0.5
    db = d_req["body"]
    ticket = db.pop("kv_transfer_params")
    assert db == body  # the client's own body, limits and stream options restored
    assert ticket["do_remote_prefill"] is True and ticket["remote_engine_id"] == fresh.p.engine_id
    assert ticket["remote_host"] == "127.0.0.1" and ticket["remote_port"] == fresh.p.port
    # Fields the Coordinator does not know are relayed unchanged, floats included.
    assert ticket["future_field"] == TICKET_EXTRA["future_field"]
    assert ticket["remote_blocks_expiry_time"] == TICKET_EXTRA["remote_blocks_expiry_time"]
    assert repr(ticket["remote_blocks_expiry_time"]) == "1764475200.123456"
    assert rid(p_req) == rid(d_req) == "pd-rid-1"
    # The KV really moved: D pulled P's ticket instead of recomputing.
    assert fresh.p.stats()["kv_pulled"] == 1
    assert fresh.d.stats()["remote_kv_hits"] == 1 and fresh.d.stats()["recomputes"] == 0


def test_ticket_is_relayed_byte_for_byte(fresh):
    """The ticket D receives is, as JSON text, the exact object P issued (no re-encoding drift)."""
    client(fresh).completions.create(model=MODEL, prompt="byte for byte", max_tokens=3)
    _, d_req = legs(fresh.p, fresh.d, "/v1/completions")
    ticket = d_req["body"]["kv_transfer_params"]
    issued = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": fresh.p.engine_id,
        "remote_host": "127.0.0.1",
        "remote_port": fresh.p.port,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "transfer_mode": "pull",
        "remote_prefill_cached_tokens": 0,
        **TICKET_EXTRA,
    }
    for key, value in issued.items():
        assert json.dumps(ticket[key]) == json.dumps(value), key
    assert ticket["remote_request_id"].startswith("cmpl-") and ticket["remote_block_ids"]


def test_json_usage_comes_from_both_legs_and_ticket_is_hidden(fresh):
    c = client(fresh)
    prompt = [{"role": "user", "content": "usage accounting " * 40}]
    first = c.chat.completions.create(model=MODEL, messages=prompt, max_tokens=6)
    raw = first.model_dump()
    assert "kv_transfer_params" not in raw or raw["kv_transfer_params"] is None
    assert "kv_transfer_params" not in (first.model_extra or {})
    p_prompt = fresh.p.stats()["prompt_tokens"]
    assert first.usage.prompt_tokens == p_prompt
    # D saw the whole prompt as transferred (cached) KV; the client is billed P's view: nothing cached yet.
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
    # Same prompt again: P's prefix cache hits, and that is what the client sees as cached.
    second = c.chat.completions.create(model=MODEL, messages=prompt, max_tokens=6)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens


def test_raw_json_has_no_ticket_key(fresh):
    r = httpx.post(fresh.url + "/v1/completions", json={"model": MODEL, "prompt": "hide", "max_tokens": 2})
    assert r.status_code == 200
    assert b"kv_transfer_params" not in r.content
    assert r.headers["x-request-id"]


def test_streamed_usage_chunk_is_fixed_up(fresh):
    stream = client(fresh).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "stream usage " * 30}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert usage.prompt_tokens == fresh.p.stats()["prompt_tokens"]
    assert usage.prompt_tokens_details.cached_tokens == 0  # D alone would have said the whole prompt
    assert usage.completion_tokens == sum(1 for c in chunks if c.choices and c.choices[0].delta.content)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_completions_stream_through_pd(fresh):
    with httpx.stream(
        "POST",
        fresh.url + "/v1/completions",
        json={"model": MODEL, "prompt": "pd stream", "max_tokens": 4, "stream": True},
        timeout=30,
    ) as r:
        events = sse_events(r.read())
    assert events[-1] == "[DONE]"
    texts = [json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"]]
    assert "".join(texts).strip()
    assert all("kv_transfer_params" not in e for e in events)


def test_decode_stream_is_incremental(sims):
    p = sims("prefill")
    d = sims("decode", speedup=1.0, decode_step_ms=50.0)
    cfg = coordinator_config([instance(1, "prefill", MODEL, p.address), instance(2, "decode", MODEL, d.address)])
    with Coordinator(cfg) as coord:
        started, arrivals = time.monotonic(), []
        with httpx.stream(
            "POST",
            coord.url + "/v1/chat/completions",
            timeout=30,
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "slow"}],
                "max_tokens": 16,
                "ignore_eos": True,
                "stream": True,
            },
        ) as r:
            for line in r.iter_lines():
                if '"content":"' in line and '"content":""' not in line:
                    arrivals.append(time.monotonic() - started)
        assert len(arrivals) == 16
        # D's tokens trickle in (one per 50 ms): the first is seen at least half the 15 steps before the last.
        # Measured from the first token: the time to it (a new client, the prefill leg) is no bound under load.
        assert arrivals[-1] - arrivals[0] > 15 * 0.050 / 2


def test_missed_handoff_is_served_and_counted(fresh):
    fresh.p.set_faults(eos_on_prefill=True)
    resp = client(fresh).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "eos"}], max_tokens=4
    )
    assert resp.choices[0].message.content
    _, d_req = legs(fresh.p, fresh.d)
    assert "kv_transfer_params" not in d_req["body"]  # D recomputes the prompt
    assert fresh.d.stats()["remote_kv_hits"] == 0
    metrics = httpx.get(fresh.obs + "/metrics").text
    line = [ln for ln in metrics.splitlines() if ln.startswith("motor_missed_handoffs_total{")]
    assert line and float(line[0].rsplit(" ", 1)[1]) >= 1
    assert "missed handoff" in fresh.output()


def test_a_ticket_decode_cannot_use_is_recomputed_on_decode_not_blamed_on_it(sims):
    """P died after answering (its ticket names a port nobody listens on): D answers 500 at once (field
    notes). The retry leaves the ticket out and D computes the prompt itself; D's breaker stays closed."""
    from harness.loopback import free_port

    p, d = sims("prefill", ticket_extra={"remote_port": free_port()}), sims("decode")
    cfg = coordinator_config(
        [instance(1, "prefill", MODEL, p.address), instance(2, "decode", MODEL, d.address)],
        exception_config={"retry_delay": 0.01},
    )
    with Coordinator(cfg) as coord:
        for stream in (False, True, False, True):
            resp = client(coord).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "p is gone"}], max_tokens=4, stream=stream
            )
            text = (
                "".join(c.choices[0].delta.content or "" for c in resp if c.choices)
                if stream
                else resp.choices[0].message.content
            )
            assert text.strip()
        legs = [r["body"] for r in d.requests() if r["path"] == "/v1/chat/completions"]
        assert len(legs) == 8 and all(("kv_transfer_params" in b) == (i % 2 == 0) for i, b in enumerate(legs))
        [inst] = [i for i in httpx.get(coord.mgmt + "/instances").json()["instances"] if i["role"] == "decode"]
        assert inst["endpoints"][0]["breaker"] == "closed"
        metrics = httpx.get(coord.obs + "/metrics").text
        assert [ln for ln in metrics.splitlines() if ln.startswith("motor_missed_handoffs_total{")][0].endswith(" 4.0")


@pytest.mark.parametrize(
    "route,extra",
    [
        ("/v1/chat/completions", {"n": 2}),
        ("/v1/completions", {"n": 3}),
        ("/v1/completions", {"echo": True, "logprobs": 1}),
        ("/v1/chat/completions", {"prompt_logprobs": 1}),
        ("/v1/completions", {"echo": True, "max_tokens": 0}),
        # vLLM reads integers in pydantic's lax mode: 2.0 and "3" children are children too.
        ("/v1/chat/completions", {"n": 2.0}),
        ("/v1/completions", {"n": "3"}),
        # Chat's echo asks for prompt logprobs (top_logprobs, 0 by default), which skip the transferred KV.
        ("/v1/chat/completions", {"echo": True}),
        ("/v1/completions", {"echo": "true", "max_tokens": 0}),  # vLLM reads booleans laxly too
    ],
    ids=[
        "chat_n",
        "completions_n",
        "echo_logprobs",
        "prompt_logprobs",
        "echo_without_generation",
        "chat_n_float",
        "completions_n_str",
        "chat_echo",
        "echo_str_without_generation",
    ],
)
def test_what_one_kv_ticket_cannot_carry_is_computed_on_decode(fresh, route, extra):
    """One ticket carries one prompt's KV to one sequence: n > 1 children would all pull blocks P frees after
    the first, prompt logprobs skip the transferred KV, and echo with max_tokens 0 generates nothing. No prefill
    leg: D computes the prompt itself."""
    body = {"model": MODEL, "max_tokens": 3, **extra}
    body.update(
        {"messages": [{"role": "user", "content": "one ticket"}]}
        if route.endswith("chat/completions")
        else {"prompt": "one ticket"}
    )
    r = httpx.post(fresh.url + route, json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == int(extra.get("n", 1))
    assert fresh.p.stats()["received"] == 0
    [leg] = [x["body"] for x in fresh.d.requests() if x["path"] == route]
    assert "kv_transfer_params" not in leg


def test_empty_stream_options_without_stream_are_accepted(fresh):
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}], "stream_options": {}}
    assert httpx.post(fresh.url + "/v1/chat/completions", json=body).status_code == 200


def test_a_retry_that_finds_no_engine_is_not_counted(sims):
    """D fails and its breaker opens (threshold 1): nothing is left to retry on, so no retry and no
    recompute happened, and neither the metrics nor the request line may say one did."""
    p, d = sims("prefill"), sims("decode")
    d.set_faults(fail_status=503)
    cfg = coordinator_config(
        [instance(1, "prefill", MODEL, p.address), instance(2, "decode", MODEL, d.address)],
        exception_config={"retry_delay": 0.01},
        scheduler_config={"breaker_failure_threshold": 1},
    )
    with Coordinator(cfg) as coord:
        r = httpx.post(
            coord.url + "/v1/chat/completions",
            json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "d fails"}]},
        )
        assert r.status_code == 502
        assert d.stats()["received"] == 1
        metrics = httpx.get(coord.obs + "/metrics").text
        counted = [
            ln for ln in metrics.splitlines() if ln.startswith(("motor_retries_total{", "motor_missed_handoffs_total{"))
        ]
        assert all(ln.endswith(" 0.0") for ln in counted), counted
        assert wait_until(lambda: "status=502" in coord.output())
        line = next(ln for ln in coord.output().splitlines() if "status=502" in ln)
        assert "retries=0 missed_handoff=False" in line and "missed handoff" not in coord.output()


@pytest.mark.parametrize(
    "extra",
    [
        {"stream_options": {"include_usage": True}},  # without stream: true
        {"stop": 5},
        {"stop": ["ok", 7]},
        {"stop_token_ids": ["x"]},
        {"min_tokens": -1},
        {"min_tokens": "two"},
        {"min_tokens": 9, "max_tokens": 4},
        {"min_tokens": None},
    ],
    ids=[
        "stream_options",
        "stop_int",
        "stop_list",
        "stop_token_ids",
        "min_tokens_negative",
        "min_tokens_str",
        "min_over_max",
        "min_tokens_null",
    ],
)
def test_what_only_decode_would_refuse_is_refused_before_the_prefill(fresh, extra):
    """The prefill leg leaves these fields out, so only D would see them: after P computed the prompt and
    while it holds the KV. They are checked first, as vLLM checks them."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **extra}
    r = httpx.post(fresh.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(extra))
    assert fresh.p.stats()["received"] == 0 and fresh.d.stats()["received"] == 0


@pytest.mark.parametrize("max_tokens, min_tokens", [("4", "2"), (4.0, 2.0), (" 4 ", "2.0")])
def test_integer_fields_are_read_as_vllm_reads_them(fresh, max_tokens, min_tokens):
    """vLLM's request models read integers in pydantic's lax mode ("4" and 4.0 are 4): so does every check
    the Coordinator makes before the prefill, and D gets the client's values as they were sent."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": max_tokens,
        "min_tokens": min_tokens,
    }
    r = httpx.post(fresh.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    [leg] = [x["body"] for x in fresh.d.requests() if x["path"] == "/v1/chat/completions"]
    assert (leg["max_tokens"], leg["min_tokens"]) == (max_tokens, min_tokens)
    r = httpx.post(fresh.url + "/v1/chat/completions", json={**body, "min_tokens": "5"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"  # 5 > 4, read as numbers


TOOLS = [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]


@pytest.mark.parametrize(
    "extra,message",
    [
        ({"stop_sequences": "END"}, "'stop_sequences' must be a list of strings"),
        # P gets {"type": "any"} for a named tool, which it would take with any name or none at all.
        (
            {"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
            "Tool 'nope' has not been passed in `tools`.",
        ),
        (
            {"tool_choice": {"type": "tool", "name": "get_weather"}},
            "Tool 'get_weather' has not been passed in `tools`.",
        ),
        ({"tools": TOOLS, "tool_choice": {"type": "tool"}}, "tool_choice.name is required when type is 'tool'"),
        # vLLM exempts the prefill leg from `budget_tokens < max_tokens`: P would prefill, and only D refuse.
        (
            {"thinking": {"type": "enabled", "budget_tokens": 1024}},
            "thinking.budget_tokens must be less than max_tokens",
        ),
        ({"thinking": {"type": "enabled", "budget_tokens": 16}}, "'thinking.budget_tokens' must be an integer >= 1024"),
        (
            {"thinking": {"type": "enabled", "budget_tokens": "lots"}},
            "'thinking.budget_tokens' must be an integer >= 1024",
        ),
    ],
    ids=["stop_sequences", "unknown_tool", "no_tools", "no_name", "budget_not_below_max", "budget_low", "budget_str"],
)
def test_what_only_decode_would_refuse_on_messages_is_refused_before_the_prefill(fresh, extra, message):
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}], **extra}
    r = httpx.post(fresh.url + "/v1/messages", json=body)
    assert r.status_code == 400 and r.json() == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": message},
        "request_id": r.headers["request-id"],
    }
    assert fresh.p.stats()["received"] == 0 and fresh.d.stats()["received"] == 0


def test_a_trigger_mode_disconnect_is_counted_once(sims):
    """The client leaves during the prefill: its request and D's metaserver call both end 499, but one
    client went away."""
    p, d = sims("prefill"), sims("decode")
    cfg = coordinator_config(
        [instance(1, "prefill", MODEL, p.address), instance(2, "decode", MODEL, d.address)],
        scheduler_config={"pd_dispatch": "trigger"},
    )
    with Coordinator(cfg) as coord:
        p.set_faults(slow_first_byte_s=5)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                coord.url + "/v1/chat/completions",
                timeout=httpx.Timeout(30, read=1.0),
                json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "bye"}]},
            )
        assert wait_until(lambda: coord.output().count("status=499") == 2, timeout_s=20)

        def disconnects() -> float:
            lines = httpx.get(coord.obs + "/metrics").text.splitlines()
            return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if ln.startswith("motor_client_disconnects_total{"))

        assert wait_until(lambda: disconnects() >= 1, timeout_s=10)
        assert disconnects() == 1


def test_trigger_mode_tells_decode_engines_an_address_they_can_reach(monkeypatch):
    """Bound to every interface (the deployer's 0.0.0.0), the metaserver URL in D's ticket is the pod's
    address (POD_IP, from the manifest), never loopback, which in a pod is the engine's own."""
    import dataclasses

    from config import Settings
    from serving.trigger import metaserver_url

    everywhere = dataclasses.replace(Settings(), host="0.0.0.0", infer_port=1025)
    monkeypatch.setenv("POD_IP", "10.4.0.17")
    assert metaserver_url(everywhere) == "http://10.4.0.17:1025/v1/metaserver"
    monkeypatch.setenv("POD_IP", "fd00::17")
    assert metaserver_url(dataclasses.replace(everywhere, host="::")) == "http://[fd00::17]:1025/v1/metaserver"
    assert metaserver_url(dataclasses.replace(everywhere, host="127.0.0.1")) == "http://127.0.0.1:1025/v1/metaserver"


def test_trigger_mode_decode_calls_metaserver(sims):
    p, d = sims("prefill"), sims("decode")
    cfg = coordinator_config(
        [instance(1, "prefill", MODEL, p.address), instance(2, "decode", MODEL, d.address)],
        scheduler_config={"pd_dispatch": "trigger"},
    )
    with Coordinator(cfg) as coord:
        for stream in (False, True):
            p.reset(), d.reset()
            resp = client(coord).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "trigger me"}], max_tokens=4, stream=stream
            )
            text = (
                "".join(c.choices[0].delta.content or "" for c in resp if c.choices)
                if stream
                else resp.choices[0].message.content
            )
            assert text.strip()
            d_req = [r for r in d.requests() if r["path"] == "/v1/chat/completions"][0]
            ktp = d_req["body"]["kv_transfer_params"]
            assert ktp["do_remote_prefill"] is True and ktp["metaserver"] == coord.url + "/v1/metaserver"
            assert (ktp["remote_host"], ktp["remote_port"]) == ("127.0.0.1", str(p.port))
            assert d.stats()["metaserver_calls"] == 1
            p_req = [r for r in p.requests() if r["path"] == "/v1/chat/completions"][0]
            assert p_req["body"]["max_tokens"] == 1 and p_req["body"]["kv_transfer_params"]["do_remote_decode"] is True
            assert p.stats()["kv_pulled"] == 1 and d.stats()["remote_kv_hits"] == 1


def test_trigger_mode_bills_what_p_had_cached_whichever_worker_served_the_metaserver_call(sims):
    """D counts the transferred KV as cached: trigger mode billed every prompt as if it were all cached. P's
    own counts are taken instead, also when D's metaserver call reached the other worker."""
    p, d = sims("prefill"), sims("decode")
    cfg = coordinator_config(
        [instance(1, "prefill", MODEL, p.address), instance(2, "decode", MODEL, d.address)],
        scheduler_config={"pd_dispatch": "trigger"},
        inference_workers_config={"num_workers": 2},
    )
    with Coordinator(cfg) as coord:
        c = client(coord)
        for i in range(6):  # new connections each time: the two workers share the requests and the calls
            prompt = [{"role": "user", "content": f"trigger billing {i} " * 30}]
            first = c.chat.completions.create(model=MODEL, messages=prompt, max_tokens=3)
            assert first.usage.prompt_tokens_details.cached_tokens == 0, first.usage  # nothing cached on P yet
            again = c.chat.completions.create(
                model=MODEL, messages=prompt, max_tokens=3, stream=True, stream_options={"include_usage": True}
            )
            usage = list(again)[-1].usage
            assert 0 < usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens, usage  # P's prefix hits
        assert d.stats()["metaserver_calls"] == 12


def test_prefill_usage_kept_by_one_worker_is_found_by_another():
    """Which worker D's metaserver call reaches is the connection's luck: the table is shared memory."""
    shared = SharedState.create()
    relaying, other, decoding = PrefillUsages(shared, 1, 3), PrefillUsages(shared, 2, 3), PrefillUsages(shared, 0, 3)
    began = time.monotonic_ns()
    relaying.put("req-a", b'{"usage":{"prompt_tokens":120,"prompt_tokens_details":{"cached_tokens":64}}}')
    relaying.put("req-b", b'{"usage":{"prompt_tokens":7}}')
    relaying.put("req-c", b"not json")
    assert decoding.get("req-a", began) == {"prompt_tokens": 120, "prompt_tokens_details": {"cached_tokens": 64}}
    assert decoding.get("req-b", began) == {"prompt_tokens": 7}
    assert decoding.get("req-c", began) is None and decoding.get("req-d", began) is None
    # A client reusing its request id: the request that began later gets its own prefill's counts, not the
    # entry an earlier one left (whichever worker row it sits in), and none while its own is not written.
    again = time.monotonic_ns()
    assert decoding.get("req-a", again) is None
    other.put("req-a", b'{"usage":{"prompt_tokens":50,"prompt_tokens_details":{"cached_tokens":0}}}')
    assert decoding.get("req-a", again) == {"prompt_tokens": 50, "prompt_tokens_details": {"cached_tokens": 0}}


def test_prefill_usage_slots_are_all_used():
    """Keys are odd (0 marks an empty slot): a slot taken from the key's low bits used half of them."""
    slots = {PrefillUsages._place(f"req-{i}")[1] for i in range(20_000)}
    assert len(slots) == PREFILL_USAGE_SLOTS


KEYS = {"enable_api_key": True, "valid_keys": ["k-meta"], "header_name": "Authorization", "key_prefix": "Bearer "}


def test_trigger_mode_with_api_keys_and_a_cap_lets_engines_in(sims):
    """Engines send no key: a metaserver call from a registered instance's address needs none; and it is
    not admitted again, so an in-flight cap of 1 still serves a trigger-mode request."""
    p, d = sims("prefill"), sims("decode")
    cfg = coordinator_config(
        [instance(1, "prefill", MODEL, p.address), instance(2, "decode", MODEL, d.address)],
        scheduler_config={"pd_dispatch": "trigger"},
        api_key_config=KEYS,
        rate_limit_config={"max_inflight_requests": 1},  # D's call is half of the one request in flight
    )
    with Coordinator(cfg) as coord:
        keyed = openai.OpenAI(base_url=coord.url + "/v1", api_key="k-meta", max_retries=0)
        resp = keyed.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert resp.choices[0].message.content and d.stats()["metaserver_calls"] == 1 and p.stats()["kv_pulled"] == 1


def test_metaserver_from_elsewhere_needs_a_key(sims):
    """No registered instance at the caller's address (loopback here): a call without a valid key is a 401,
    and one with a key is admitted like a client's: not a way around the keys or the limits."""
    cfg = coordinator_config(
        [instance(1, "decode", MODEL, "decode-0.invalid:8000")],
        api_key_config=KEYS,
        rate_limit_config={"requests_per_second": 0.2},
    )
    with Coordinator(cfg) as coord:
        ktp = {"request_id": "m-1", "do_remote_decode": True, "do_remote_prefill": False}
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "kv_transfer_params": ktp}
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.post(coord.url + "/v1/metaserver", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = httpx.post(coord.url + "/v1/metaserver", json=body, headers={"Authorization": "Bearer k-meta"})
        assert r.status_code == 503  # let in; its only engine is unreachable
        r = httpx.post(coord.url + "/v1/metaserver", json=body, headers={"Authorization": "Bearer k-meta"})
        assert r.status_code == 429  # and admitted like a client: the rate limit's one token is spent


def test_engine_addresses_match_in_any_spelling_and_by_name():
    def check(caller: str, hosts: list[str]) -> bool:
        registry = Registry(SharedState.create())
        registry.apply("set", [Instance(i, "union", MODEL, (Endpoint(0, f"{h}:8000"),)) for i, h in enumerate(hosts)])
        return asyncio.run(InstanceAddresses(registry).knows(caller))

    assert check("127.0.0.1", ["127.0.0.1"]) and check("::ffff:127.0.0.1", ["127.0.0.1"])  # a dual-stack listener
    assert check("fd00::1", ["[fd00:0:0::1]"])
    assert check("127.0.0.1", ["localhost"])  # resolved (no connection made)
    assert not check("127.0.0.1", ["10.1.2.3", "decode-0.invalid"])
    assert not check("", ["127.0.0.1"])


def _meta(coord, ktp: dict, **body):
    return httpx.post(
        coord.url + "/v1/metaserver",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "meta"}],
            "stream": False,
            "kv_transfer_params": {"request_id": "meta-1", **ktp},
            **body,
        },
        timeout=30,
    )


def test_metaserver_forwards_to_the_named_registered_instance(fresh):
    host, port = fresh.p.address.split(":")
    r = _meta(
        fresh,
        {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": "1",
            "remote_host": host,
            "remote_port": port,
        },
    )
    assert r.status_code == 200
    assert r.json()["kv_transfer_params"]["remote_engine_id"] == fresh.p.engine_id  # P's answer, passed through
    p_req = [x for x in fresh.p.requests() if x["path"] == "/v1/chat/completions"][-1]
    assert rid(p_req) == "meta-1"
    # Naming nothing: the scheduler picks a decode instance.
    fresh.d.reset()
    r = _meta(fresh, {"do_remote_decode": True, "do_remote_prefill": False}, max_tokens=3)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    assert fresh.d.stats()["received"] == 1


def test_metaserver_knows_an_instance_registered_by_name_from_its_address(sims):
    """Engines report the address they see (an IP); the deployer registers them by DNS name. A target named
    in another spelling of a registered instance's address is that instance; other hosts stay refused."""
    p, d = sims("prefill"), sims("decode")
    by_name = lambda s: "localhost:" + s.address.split(":")[1]  # noqa: E731
    cfg = coordinator_config([instance(1, "prefill", MODEL, by_name(p)), instance(2, "decode", MODEL, by_name(d))])
    with Coordinator(cfg) as coord:
        port = p.address.split(":")[1]
        for host, engine_id in (("127.0.0.1", "1"), ("::ffff:127.0.0.1", "1"), ("127.0.0.1", "")):
            r = _meta(
                coord,
                {
                    "do_remote_prefill": True,
                    "do_remote_decode": False,
                    "remote_host": host,
                    "remote_port": port,
                    "remote_engine_id": engine_id,
                },
            )
            assert r.status_code == 200, (host, r.text)
        assert p.stats()["received"] == 3
        r = _meta(
            coord, {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": d.address.split(":")[1]}
        )
        assert r.status_code == 403  # D's address: not a prefill instance, in any spelling
        assert p.stats()["received"] == 3 and d.stats()["received"] == 0


def test_metaserver_refuses_unregistered_targets(fresh, sims):
    stranger = sims("prefill")
    host, port = stranger.address.split(":")
    for ktp in (
        {"do_remote_prefill": True, "remote_host": host, "remote_port": port, "remote_engine_id": "engine-p-0"},
        {"do_remote_prefill": True, "remote_host": "127.0.0.2", "remote_port": "8000"},
        {"do_remote_prefill": True, "remote_engine_id": "999"},
        # A registered address, but of the wrong role.
        {
            "do_remote_prefill": True,
            "remote_host": fresh.d.address.split(":")[0],
            "remote_port": fresh.d.address.split(":")[1],
            "remote_engine_id": "2",
        },
    ):
        r = _meta(fresh, ktp)
        assert r.status_code == 403, ktp
        assert "not a registered" in r.json()["error"]["message"]
    assert stranger.stats()["received"] == 0


@pytest.mark.parametrize(
    "ktp",
    [
        {},
        {"do_remote_prefill": True},
        {"request_id": "x"},
        {"request_id": "x", "do_remote_prefill": True, "do_remote_decode": True},
        # The id becomes the engine request's X-Request-Id header: no CR/LF to inject a header with, no 1 MB id.
        {"request_id": "x\r\nX-Injected: 1", "do_remote_prefill": True},
        {"request_id": "x" * 129, "do_remote_prefill": True},
    ],
)
def test_metaserver_rejects_malformed_control_objects(fresh, ktp):
    r = httpx.post(
        fresh.url + "/v1/metaserver",
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "kv_transfer_params": ktp},
    )
    assert r.status_code == 400
    assert r.json()["error"]["message"]


def test_fallback_to_whole_requests_when_no_decode_is_healthy(sims):
    from harness.loopback import free_port

    p = sims("prefill")
    dead_decode = f"127.0.0.1:{free_port()}"
    cfg = coordinator_config([instance(1, "prefill", MODEL, p.address), instance(2, "decode", MODEL, dead_decode)])
    with Coordinator(cfg) as coord:
        assert wait_until(lambda: httpx.get(coord.url + "/v1/models").json()["data"][0]["d_instances_num"] == 0)
        resp = client(coord).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "fallback"}], max_tokens=5
        )
        assert resp.choices[0].message.content
        p_req = [r for r in p.requests() if r["path"] == "/v1/chat/completions"][-1]
        assert "kv_transfer_params" not in p_req["body"] and p_req["body"]["max_tokens"] == 5  # served whole
        # No usable instance at all: a clear 503.
        assert coord.refresh("set", [instance(2, "decode", MODEL, dead_decode)]).status_code == 200
        assert wait_until(lambda: httpx.get(coord.mgmt + "/instances").json()["instances"][0]["healthy"] is False)
        r = httpx.post(
            coord.url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
        )
        assert r.status_code == 503
        assert MODEL in r.json()["error"]["message"]
