"""The inference port with OpenAI traffic on union engines, through the real openai SDK and raw HTTP."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import openai
import pytest

from harness import ROOT
from harness.bodies import sse_events
from harness.clients import openai_client as client
from harness.configs import api_keys, coordinator_config, instance
from harness.coordinator import Coordinator
from tests.conftest import MODEL


def test_chat_json(union_cluster):
    resp = client(union_cluster).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello there"}], max_tokens=8
    )
    assert resp.id.startswith("chatcmpl-")
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage.completion_tokens <= 8
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_completions_json(union_cluster):
    resp = client(union_cluster).completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6)
    assert resp.object == "text_completion"
    assert resp.choices[0].text
    assert resp.usage.completion_tokens <= 6


def test_echo_with_max_tokens_0_scores_the_prompt(union_cluster):
    """vLLM's echo without generation (lm-eval-style prompt scoring): the answer is the prompt alone; without
    `echo`, max_tokens 0 is a 400 at the edge."""
    c = client(union_cluster)
    resp = c.completions.create(model=MODEL, prompt="score this prompt", max_tokens=0, echo=True)
    assert resp.choices[0].text == "score this prompt" and resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 1
    chunks = list(c.completions.create(model=MODEL, prompt="score this prompt", max_tokens=0, echo=True, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == "score this prompt"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt="score this prompt", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"


def test_chat_stream_shape(union_cluster):
    stream = client(union_cluster).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "stream please"}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    choice_chunks = [c for c in chunks if c.choices]
    assert choice_chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert all(c.choices[0].finish_reason is None for c in choice_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(choice_chunks) - 1
    text = "".join(c.choices[0].delta.content or "" for c in choice_chunks)
    assert text.strip()


def test_completions_stream_raw_ends_with_done(union_cluster):
    with httpx.stream(
        "POST",
        union_cluster.url + "/v1/completions",
        json={"model": MODEL, "prompt": "abc", "max_tokens": 4, "stream": True},
        timeout=30,
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers.get("x-request-id")
        body = r.read()
    events = sse_events(body)
    assert events[-1] == "[DONE]"
    assert json.loads(events[0])["object"] == "text_completion"


def test_same_prompt_and_seed_give_same_text(union_cluster):
    c = client(union_cluster)
    args = dict(model=MODEL, messages=[{"role": "user", "content": "determinism"}], max_tokens=12, seed=7)
    assert (
        c.chat.completions.create(**args).choices[0].message.content
        == c.chat.completions.create(**args).choices[0].message.content
    )


def test_unknown_fields_reach_the_engine_and_client_key_does_not(union_cluster):
    engine = union_cluster.engines["union"]
    engine.reset()
    client(union_cluster, key="client-secret").chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "pass it on"}],
        max_tokens=3,
        temperature=0.3,
        extra_body={"top_k": 5, "repetition_penalty": 1.05, "vendor_extension": {"nested": [1, 2]}},
        extra_headers={"X-Request-Id": "rid-passthrough-1"},
    )
    seen = [r for r in engine.requests() if r["path"] == "/v1/chat/completions"][-1]
    assert seen["body"]["top_k"] == 5
    assert seen["body"]["repetition_penalty"] == 1.05
    assert seen["body"]["vendor_extension"] == {"nested": [1, 2]}
    assert seen["body"]["temperature"] == 0.3
    headers = {k.lower(): v for k, v in seen["headers"].items()}
    assert "authorization" not in headers
    assert headers["x-request-id"] == "rid-passthrough-1"


def test_first_chunk_arrives_before_generation_ends(sims):
    # A slow engine (50 ms per token, no speed-up) makes the stream last about a second.
    slow = sims("union", speedup=1.0, decode_step_ms=50.0)
    with Coordinator(coordinator_config([instance(1, "union", MODEL, slow.address)])) as coord:
        started = time.monotonic()
        arrivals = []
        with httpx.stream(
            "POST",
            coord.url + "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 20,
                "stream": True,
                "ignore_eos": True,
            },
            timeout=30,
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and '"content":"' in line and '"content":""' not in line:
                    arrivals.append(time.monotonic() - started)
        assert len(arrivals) == 20
        # Chunks trickle in as the engine makes them (one per 50 ms), not all at once at the end: the first
        # content token is seen at least half the 19 steps before the last. Measured from the first token, not
        # from the request: on a loaded machine the time to first token (a new client and connection, the
        # prefill) may be as long as the whole generation and says nothing about buffering.
        assert arrivals[-1] - arrivals[0] > 19 * 0.050 / 2


def test_models_lists_live_counts_and_slo(union_cluster):
    body = httpx.get(union_cluster.url + "/v1/models").json()
    assert body["object"] == "list"
    (m,) = [m for m in body["data"] if m["id"] == MODEL]
    assert m["owned_by"] == "motor" and m["object"] == "model"
    assert (m["slo_ttft"], m["slo_tpot"]) == (800, 40)
    assert m["p_instances_num"] == 1 and m["d_instances_num"] == 1
    assert isinstance(m["created"], int)
    assert {m.id for m in client(union_cluster).models.list()} == {MODEL}


def test_models_retrieve_answers_one_model_or_a_404(union_cluster):
    """The OpenAI SDK's models.retrieve: the list's entry for that id, or model_not_found; an id with a slash
    (a Hugging Face name, which the SDK sends as `org%2Fname`) is one path parameter."""
    c = client(union_cluster)
    listed = httpx.get(union_cluster.url + "/v1/models").json()["data"][0]
    assert c.models.retrieve(MODEL).id == MODEL
    assert httpx.get(union_cluster.url + f"/v1/models/{MODEL}").json() == listed
    assert httpx.get(union_cluster.url + f"/v1/models/{MODEL}/").json() == listed
    assert httpx.get(union_cluster.url + "/v1/models/").json()["data"] == [listed]
    for missing in ("no-such-model", "org/no-such-model"):
        with pytest.raises(openai.NotFoundError) as e:
            c.models.retrieve(missing)
        assert e.value.body["code"] == "model_not_found" and missing in e.value.body["message"]
    assert (
        httpx.get(union_cluster.url + "/v1/models/org/no-such-model").json()["error"]["message"]
        == "The model `org/no-such-model` does not exist."
    )


BAD_BODIES = [
    ("/v1/chat/completions", b"{not json", 400),
    ("/v1/chat/completions", b"[1, 2]", 400),
    ("/v1/chat/completions", b'"a string"', 400),
    ("/v1/chat/completions", b"", 400),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(), 400),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": "hi"}).encode(), 400),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": []}).encode(), 400),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": ["hi"]}).encode(), 400),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"content": "hi"}]}).encode(), 400),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"role": "user"}]}).encode(), 400),
    (
        "/v1/chat/completions",
        json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": "yes"}).encode(),
        400,
    ),
    (
        "/v1/chat/completions",
        json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}).encode(),
        400,
    ),
    ("/v1/completions", json.dumps({"model": MODEL}).encode(), 400),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": 42}).encode(), 400),
    # `tools` not a list: the scheduler renders tools into the prompt it counts (was a 500).
    (
        "/v1/chat/completions",
        json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": 1}).encode(),
        400,
    ),
    (
        "/v1/chat/completions",
        json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": "abc"}).encode(),
        400,
    ),
    (
        "/v1/chat/completions",
        json.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}).encode(),
        404,
    ),
]


@pytest.mark.parametrize("path,body,status", BAD_BODIES)
def test_bad_input_is_a_clear_4xx_in_openai_shape(union_cluster, path, body, status):
    engine = union_cluster.engines["union"]
    before = engine.stats()["received"]
    r = httpx.post(union_cluster.url + path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert err["message"] and err["type"]
    assert set(err) == {"message", "type", "param", "code"}
    assert engine.stats()["received"] == before  # rejected at the edge
    # The server keeps serving.
    assert client(union_cluster).completions.create(model=MODEL, prompt="still ok", max_tokens=2).choices


def test_what_vllm_accepts_reaches_the_engine(union_cluster):
    """Custom roles (vLLM takes any role string), an assistant turn with only a function call, and a
    completions request with `prompt_embeds` instead of `prompt` are the engine's to judge."""
    engine = union_cluster.engines["union"]
    messages = [
        {"role": "user", "content": "what is 2+2?"},
        {"role": "assistant", "function_call": {"name": "calc", "arguments": "{}"}},
        {"role": "ipython", "content": "4"},
    ]
    resp = client(union_cluster).chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    assert resp.choices[0].message.content
    assert [m["role"] for m in engine.requests()[-1]["body"]["messages"]] == ["user", "assistant", "ipython"]
    httpx.post(union_cluster.url + "/v1/completions", json={"model": MODEL, "prompt_embeds": "AAAA", "max_tokens": 2})
    assert engine.requests()[-1]["body"]["prompt_embeds"] == "AAAA"  # not refused at the edge


def test_wrong_content_type_is_415(union_cluster):
    r = httpx.post(
        union_cluster.url + "/v1/chat/completions",
        content=b"model=x",
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    assert r.status_code == 415
    assert "application/json" in r.json()["error"]["message"]


def test_unknown_model_via_sdk_is_404(union_cluster):
    with pytest.raises(openai.NotFoundError) as e:
        client(union_cluster).chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert e.value.body["code"] == "model_not_found"


def test_management_routes_are_not_on_the_inference_port(union_cluster):
    assert httpx.get(union_cluster.url + "/instances").status_code == 404
    assert httpx.get(union_cluster.url + "/readiness").status_code == 404
    assert httpx.post(union_cluster.mgmt + "/v1/chat/completions", json={}).status_code == 404
    assert httpx.get(union_cluster.mgmt + "/v1/models").status_code == 404


def test_body_over_limit_is_413(sims):
    u = sims("union")
    cfg = coordinator_config(
        [instance(1, "union", MODEL, u.address)], rate_limit_config={"max_request_body_size": 4096}
    )
    with Coordinator(cfg) as coord:
        big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 10_000}]}
        r = httpx.post(coord.url + "/v1/chat/completions", json=big)
        assert r.status_code == 413
        assert r.json()["error"]["code"] == "request_too_large"
        assert u.stats()["received"] == 0
        ok = httpx.post(
            coord.url + "/v1/chat/completions", json={**big, "messages": [{"role": "user", "content": "x"}]}
        )
        assert ok.status_code == 200


def test_api_key_auth(sims):
    u = sims("union")
    cfg = coordinator_config(
        [instance(1, "union", MODEL, u.address)],
        api_key_config=api_keys("k-one", "k-two"),
    )
    with Coordinator(cfg) as coord:
        for key in (None, "wrong", "k-on", "k-one-and-more"):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            r = httpx.post(coord.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}, headers=headers)
            assert r.status_code == 401, key
            assert r.json()["error"]["type"] == "authentication_error"
            assert r.headers["www-authenticate"] == "Bearer"  # the scheme it wants (RFC 9110 11.6.1)
        with pytest.raises(openai.AuthenticationError) as e:
            client(coord, "bad").completions.create(model=MODEL, prompt="x")
        assert e.value.response.headers["www-authenticate"] == "Bearer"
        assert client(coord, "k-two").completions.create(model=MODEL, prompt="x", max_tokens=2).choices
        assert httpx.get(coord.url + "/v1/models").status_code == 401
        assert httpx.get(coord.url + "/v1/models", headers={"Authorization": "Bearer k-one"}).status_code == 200
        assert all("k-two" not in json.dumps(r["headers"]) for r in u.requests())
        # A key that is not UTF-8 is a wrong key (was a 500, which the SDKs retry).
        latin1 = "Bearer k-\xf6ne".encode("latin-1")
        r = httpx.post(
            coord.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}, headers={"Authorization": latin1}
        )
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(coord.url + "/v1/models", headers={"Authorization": latin1}).status_code == 401
        r = httpx.post(
            coord.url + "/v1/messages",
            json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]},
            headers={"x-api-key": "k-\xf6ne".encode("latin-1")},
        )
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_custom_auth_header_and_prefix(sims):
    u = sims("union")
    cfg = coordinator_config(
        [instance(1, "union", MODEL, u.address)],
        api_key_config=api_keys("sekrit", header="X-Api-Token", prefix=""),
    )
    with Coordinator(cfg) as coord:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
        assert (
            httpx.post(coord.url + "/v1/completions", json=body, headers={"X-Api-Token": "sekrit"}).status_code == 200
        )
        assert (
            httpx.post(coord.url + "/v1/completions", json=body, headers={"Authorization": "Bearer sekrit"}).status_code
            == 401
        )


def test_two_workers_subprocess_serves_sdk_traffic(sims):
    a, b = sims("union"), sims("union")
    cfg = coordinator_config([instance(1, "union", MODEL, a.address), instance(2, "union", MODEL, b.address)])
    with Coordinator(cfg, workers=2) as coord:
        c = client(coord)
        for i in range(20):
            assert c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"n{i}"}], max_tokens=2
            ).choices
        served = [a.stats()["received"], b.stats()["received"]]
        assert sum(served) == 20 and min(served) >= 3  # both engines took a share
        # The request log lines come from worker processes, not from the main process.
        served_by = {
            int(w.split("[")[1].rstrip("]:")) for w in coord.output().split() if w.startswith("coordinator.request[")
        }
        assert served_by and served_by <= set(coord.worker_pids())
        assert coord.proc.pid not in served_by


def test_invalid_config_exits_nonzero_with_key_path(tmp_path):
    cfg = coordinator_config([])
    port = cfg["api_config"]["coordinator_api_infer_port"]
    cfg["api_config"]["coordinator_api_infer_port"] = 70000
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"motor_coordinator_config": cfg}))
    proc = subprocess.run(
        [sys.executable, "app.py", "--config", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode != 0
    assert "motor_coordinator_config.api_config.coordinator_api_infer_port: must be 1..65535" in proc.stderr
    assert "Goin' Fast" not in proc.stdout + proc.stderr and str(port) not in proc.stdout


def test_bare_coordinator_section_and_default_simulator():
    """The bare motor_coordinator_config object, no instances: the built-in simulator serves PD."""
    cfg = coordinator_config([], models=[{"id": "sim-model"}])
    with Coordinator(cfg, wrap=False) as coord:
        assert "built-in engine simulator" in coord.output()
        resp = client(coord).chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert resp.choices[0].message.content
        m = httpx.get(coord.url + "/v1/models").json()["data"][0]
        assert (m["p_instances_num"], m["d_instances_num"]) == (1, 1)
