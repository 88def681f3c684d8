"""The observability port and what the Coordinator records about requests: /metrics, /health, the request
log line, the request id on every response, and the OpenAPI spec on the inference port.

One two-worker Coordinator serves a union model, a PD model and a slow union model (for streams that
last long enough to look at). Requests go out on fresh connections, so both workers serve them; the
metrics are read back through either worker and must add up to exactly what was sent.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import threading
import time
import types
from collections import defaultdict

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness import bodies
from harness.bodies import sse_events
from harness.configs import coordinator_config, instance
from harness.coordinator import Coordinator, logged_request_pids as worker_pids
from harness.loopback import wait_until
from tests import logfmt
from tests.conftest import MODEL

PD_MODEL, SLOW_MODEL = "pd-model", "slow-model"
WORKERS = 2
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def cluster(module_sims):
    u = module_sims("union")
    p, d = module_sims("prefill", model=PD_MODEL), module_sims("decode", model=PD_MODEL)
    slow = module_sims("union", model=SLOW_MODEL, speedup=1.0, decode_step_ms=20.0)
    cfg = coordinator_config(
        [
            instance(1, "union", MODEL, u.address),
            instance(2, "prefill", PD_MODEL, p.address),
            instance(3, "decode", PD_MODEL, d.address),
            instance(4, "union", SLOW_MODEL, slow.address),
        ],
        exception_config={"retry_delay": 0.01, "max_retry": 2},
        inference_workers_config={"num_workers": WORKERS},
    )
    with Coordinator(cfg) as coord:
        coord.engines = {"union": u, "prefill": p, "decode": d, "slow": slow}
        yield coord


@pytest.fixture
def c(cluster):
    for e in cluster.engines.values():
        e.clear_faults()
        e.reset()
    return cluster


class Metrics:
    """One scrape of /metrics: samples by name and labels."""

    def __init__(self, text: str):
        self.samples: dict[str, list[tuple[dict, float]]] = defaultdict(list)
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                self.samples[s.name].append((s.labels, s.value))

    def get(self, name: str, **labels) -> float:
        """The sum of the samples of `name` whose labels include `labels`."""
        want = {k: str(v) for k, v in labels.items()}
        return sum(v for lab, v in self.samples.get(name, []) if want.items() <= lab.items())


def scrape(coord) -> Metrics:
    r = httpx.get(coord.obs + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return Metrics(r.text)


def delta(before: Metrics, after: Metrics, name: str, **labels) -> float:
    return after.get(name, **labels) - before.get(name, **labels)


def scrape_after(coord, before: Metrics, requests: int, **labels) -> Metrics:
    """A scrape once `requests` more requests (of these labels) are counted: each worker writes its metrics
    within 50 ms of a request, and a scrape answered by one worker may not see the other's last requests."""
    assert wait_until(lambda: delta(before, scrape(coord), "motor_requests_total", **labels) >= requests, timeout_s=5)
    return scrape(coord)


def post(coord, path: str, body, **kw) -> httpx.Response:
    return httpx.post(coord.url + path, json=body, timeout=30, **kw)


# chat_body(model=MODEL, max_tokens=3, **extra): fields such as `stream` go into the body as given.
chat_body = functools.partial(bodies.chat_body, model=MODEL, max_tokens=3, content="count me")


# -- counts across workers ---------------------------------------------------------------------------


def test_request_counts_add_up_across_workers(c):
    before = scrape(c)
    mark = len(c.output())
    for _ in range(10):
        assert post(c, CHAT, chat_body()).status_code == 200
    for _ in range(8):
        r = post(c, COMPLETIONS, {"model": MODEL, "prompt": "abc", "max_tokens": 3, "stream": True})
        assert r.status_code == 200 and sse_events(r.content)[-1] == "[DONE]"
    for i in range(5):
        assert post(c, CHAT, chat_body(model=f"no-such-model-{i}")).status_code == 404
    for _ in range(4):
        assert post(c, CHAT, {"model": MODEL, "messages": "not a list"}).status_code == 400
    assert wait_until(lambda: len(worker_pids(c, mark)) == WORKERS)

    # Once written, every scrape, whichever worker answers it, sees the same totals.
    scrape_after(c, before, 10, route=CHAT, model=MODEL, status=200)
    scrape_after(c, before, 8, route=COMPLETIONS, model=MODEL, status=200)
    scrape_after(c, before, 5, route=CHAT, model="other", status=404)
    scrape_after(c, before, 4, route=CHAT, model="other", status=400)
    scrapes = [scrape(c) for _ in range(6)]
    for after in scrapes:
        assert delta(before, after, "motor_requests_total", route=CHAT, model=MODEL, status=200) == 10
        assert delta(before, after, "motor_requests_total", route=COMPLETIONS, model=MODEL, status=200) == 8
        assert delta(before, after, "motor_requests_total", route=CHAT, model="other", status=400) == 4  # no model read
        # Made-up model names do not become label values.
        assert delta(before, after, "motor_requests_total", route=CHAT, model="other", status=404) == 5
        assert not any(lab.get("model", "").startswith("no-such") for lab, _ in after.samples["motor_requests_total"])
        assert delta(before, after, "motor_e2e_seconds_count", model=MODEL) == 18
        assert delta(before, after, "motor_ttft_seconds_count", route=COMPLETIONS, model=MODEL) == 8
        assert (
            delta(before, after, "motor_ttft_seconds_count", route=CHAT, model=MODEL) == 0
        )  # JSON: no first token to see


def test_tokens_and_stream_latencies(c):
    before = scrape(c)
    usage = post(c, CHAT, chat_body(max_tokens=6, ignore_eos=True)).json()["usage"]
    r = post(c, CHAT, chat_body(max_tokens=9, ignore_eos=True, stream=True, stream_options={"include_usage": False}))
    tokens = [json.loads(e) for e in sse_events(r.content)[:-1]]
    streamed = sum(1 for t in tokens if t["choices"] and t["choices"][0]["delta"].get("content"))
    assert streamed == 9
    after = scrape_after(c, before, 2, route=CHAT, model=MODEL, status=200)
    assert (
        delta(before, after, "motor_generation_tokens_total", route=CHAT, model=MODEL) == usage["completion_tokens"] + 9
    )
    assert delta(before, after, "motor_prompt_tokens_total", route=CHAT, model=MODEL) >= usage["prompt_tokens"]
    assert delta(before, after, "motor_tpot_seconds_count", route=CHAT, model=MODEL) == 1
    ttft = delta(before, after, "motor_ttft_seconds_sum", route=CHAT, model=MODEL)
    tpot = delta(before, after, "motor_tpot_seconds_sum", route=CHAT, model=MODEL)
    e2e = delta(before, after, "motor_e2e_seconds_sum", route=CHAT, model=MODEL)
    assert 0 < ttft < e2e and 0 < tpot < e2e
    # With a usage chunk asked for (the OpenAI SDK's and most clients' way), it is not a token either.
    r = post(c, CHAT, chat_body(max_tokens=5, ignore_eos=True, stream=True, stream_options={"include_usage": True}))
    assert json.loads(sse_events(r.content)[-2])["usage"]["completion_tokens"] == 5
    later = scrape_after(c, after, 1, route=CHAT, model=MODEL, status=200)
    assert delta(after, later, "motor_generation_tokens_total", route=CHAT, model=MODEL) == 5


WEATHER_TOOL = {
    "name": "get_weather",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def message_stream(coord, model: str, rid: str, **extra) -> int:
    """One streamed /v1/messages request; the output_tokens of its message_delta, checked to differ from
    what counting its events would give (more content blocks than the one the framing count assumes)."""
    body = {
        "model": model,
        "max_tokens": 20,
        "stream": True,
        "messages": [{"role": "user", "content": "think, then answer"}],
        **extra,
    }
    r = post(coord, "/v1/messages", body, headers={"X-Request-Id": rid})
    assert r.status_code == 200
    events = [json.loads(e) for e in sse_events(r.content)]
    (usage,) = [e["usage"] for e in events if e["type"] == "message_delta"]
    assert len(events) - 5 != usage["output_tokens"] > 1
    return usage["output_tokens"]


@pytest.mark.parametrize("model", [MODEL, PD_MODEL])
def test_anthropic_stream_tokens_are_its_usage(c, model):
    """A Messages stream's output tokens are its message_delta's output_tokens (in PD the count the client
    gets), whatever its content blocks: a thinking block, then a text or a tool_use block."""
    route = "/v1/messages"
    before = scrape(c)
    thinking = message_stream(
        c, model, f"think-{model}", max_tokens=1040, thinking={"type": "enabled", "budget_tokens": 1024}
    )
    after = scrape_after(c, before, 1, route=route, model=model, status=200)
    assert delta(before, after, "motor_generation_tokens_total", route=route, model=model) == thinking
    # TPOT divides the time after the first token by the tokens after it: the same count.
    e2e = delta(before, after, "motor_e2e_seconds_sum", route=route, model=model)
    ttft = delta(before, after, "motor_ttft_seconds_sum", route=route, model=model)
    tpot = delta(before, after, "motor_tpot_seconds_sum", route=route, model=model)
    assert (e2e - ttft) / tpot + 1 == pytest.approx(thinking, rel=1e-6)
    tool = message_stream(
        c,
        model,
        f"tool-{model}",
        max_tokens=1040,
        thinking={"type": "enabled", "budget_tokens": 1024},
        tools=[WEATHER_TOOL],
    )
    later = scrape_after(c, after, 1, route=route, model=model, status=200)
    assert delta(after, later, "motor_generation_tokens_total", route=route, model=model) == tool
    for rid, tokens in ((f"think-{model}", thinking), (f"tool-{model}", tool)):  # and the request's log line
        assert wait_until(lambda rid=rid: f"request_id={rid} " in c.output())
        (line,) = [ln for ln in c.output().splitlines() if f"request_id={rid} " in ln]
        assert f" output_tokens={tokens} " in line


def test_count_tokens_serves_no_tokens(c):
    before = scrape(c)
    r = httpx.post(
        c.url + "/v1/messages/count_tokens",
        json={"model": MODEL, "messages": [{"role": "user", "content": "count me"}]},
    )
    assert r.status_code == 200 and r.json()["input_tokens"] > 0
    after = scrape_after(c, before, 1, route="/v1/messages/count_tokens", model=MODEL, status=200)
    assert delta(before, after, "motor_prompt_tokens_total", route="/v1/messages/count_tokens", model=MODEL) == 0


def test_tpot_follows_the_engines_decode_speed(c):
    """The slow model decodes at 20 ms a token, the fast one at 0.2 ms: the histogram must tell them apart."""
    before = scrape(c)
    for model in (MODEL, SLOW_MODEL):
        r = post(c, CHAT, chat_body(model=model, max_tokens=20, ignore_eos=True, stream=True))
        assert r.status_code == 200
    scrape_after(c, before, 1, model=MODEL, status=200)
    after = scrape_after(c, before, 1, model=SLOW_MODEL, status=200)
    fast = delta(before, after, "motor_tpot_seconds_sum", model=MODEL)
    slow = delta(before, after, "motor_tpot_seconds_sum", model=SLOW_MODEL)
    assert delta(before, after, "motor_tpot_seconds_count", model=SLOW_MODEL) == 1
    # The slow engine's 20 ms step is a floor whatever the machine's load; the fast one's jitter has no such bound.
    assert slow >= 0.019 and fast < slow


def test_pd_legs_and_missed_handoffs(c):
    before = scrape(c)
    for stream in (False, True):
        assert post(c, CHAT, chat_body(model=PD_MODEL, stream=stream)).status_code == 200
    c.engines["prefill"].set_faults(eos_on_prefill=True)
    assert post(c, CHAT, chat_body(model=PD_MODEL)).status_code == 200
    after = scrape_after(c, before, 3, model=PD_MODEL, status=200)
    assert delta(before, after, "motor_leg_seconds_count", leg="prefill", model=PD_MODEL) == 3
    assert delta(before, after, "motor_leg_seconds_count", leg="decode", model=PD_MODEL) == 3
    assert delta(before, after, "motor_missed_handoffs_total", model=PD_MODEL) == 1


def test_retries_and_breaker_state(c):
    u = c.engines["union"]
    before = scrape(c)
    u.set_faults(fail_first_n=1)
    assert post(c, CHAT, chat_body()).status_code == 200  # the retry succeeded
    after = scrape(c)
    assert delta(before, after, "motor_retries_total", model=MODEL) == 1
    assert after.get("motor_instance_breaker_state", instance=1) == 0

    u.set_faults(fail_status=500)
    assert post(c, CHAT, chat_body()).status_code == 502  # three attempts on the one engine, all failed:
    assert scrape(c).get("motor_instance_breaker_state", instance=1) == 0  # one request is one failure
    for _ in range(2):
        assert post(c, CHAT, chat_body()).status_code == 502
    assert scrape(c).get("motor_instance_breaker_state", instance=1) == 1  # the third failed request opens it
    failed = scrape_after(c, after, 3, route=CHAT, model=MODEL, status=502)  # the status the client got,
    assert delta(after, failed, "motor_requests_total", route=CHAT, model=MODEL, status=500) == 0  # not the engine's
    r = post(c, CHAT, chat_body())
    assert r.status_code == 503  # the breaker refuses before any engine is tried
    u.clear_faults()
    assert scrape(c).get("motor_rejections_total", reason="no_capacity") >= 1
    assert wait_until(lambda: post(c, CHAT, chat_body()).status_code == 200, timeout_s=15)  # half-open probe closes it
    assert scrape(c).get("motor_instance_breaker_state", instance=1) == 0


def _stream_slow(coord, out: dict, max_tokens: int = 100) -> None:
    body = chat_body(model=SLOW_MODEL, max_tokens=max_tokens, ignore_eos=True, stream=True)
    with httpx.stream("POST", coord.url + CHAT, json=body, timeout=60) as r:
        out["events"] = sse_events(r.read())


def test_inflight_and_engine_gauges(c):
    slow = c.engines["slow"]
    out: dict = {}
    t = threading.Thread(target=_stream_slow, args=(c, out))
    t.start()
    try:
        assert wait_until(lambda: slow.stats()["running"] == 1, timeout_s=10)
        m = scrape(c)
        assert m.get("motor_inflight_requests") == 1
        assert m.get("motor_instance_inflight_requests", instance=4, role="union", model=SLOW_MODEL) == 1
        assert m.get("motor_instance_inflight_requests", instance=1) == 0
        # The engine's own gauge, relabelled, arrives with the next scrape of the engine.
        assert wait_until(lambda: scrape(c).get("motor_engine_num_requests_running", instance=4, role="union") == 1)
        assert m.get("motor_instance_healthy", instance=4) == 1 and m.get("motor_queued_requests") == 0
    finally:
        t.join(60)
    assert out["events"][-1] == "[DONE]"
    m = scrape(c)
    assert m.get("motor_inflight_requests") == 0 and m.get("motor_instance_inflight_requests", instance=4) == 0


def test_client_disconnects_by_phase(c):
    slow = c.engines["slow"]
    before = scrape(c)
    with httpx.stream(
        "POST", c.url + CHAT, json=chat_body(model=SLOW_MODEL, max_tokens=200, ignore_eos=True, stream=True), timeout=30
    ) as r:
        lines = r.iter_lines()
        next(lines)
    assert wait_until(lambda: slow.stats()["aborted"] == 1)
    slow.set_faults(slow_first_byte_s=5)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(c.url + CHAT, json=chat_body(model=SLOW_MODEL), timeout=httpx.Timeout(30, read=0.5))
    assert wait_until(
        lambda: delta(before, scrape(c), "motor_client_disconnects_total", phase="before_first_byte") == 1
    )
    after = scrape_after(c, before, 2, model=SLOW_MODEL, status=499)
    assert delta(before, after, "motor_client_disconnects_total", phase="streaming") == 1
    assert delta(before, after, "motor_requests_total", model=SLOW_MODEL, status=499) == 2


def test_rejection_reasons(sims):
    u = sims("union")
    cfg = coordinator_config([instance(1, "union", MODEL, u.address)], rate_limit_config={"requests_per_second": 0.2})
    with Coordinator(cfg) as coord:
        codes = [post(coord, CHAT, chat_body()).status_code for _ in range(3)]
        assert codes == [200, 429, 429]
        m = scrape(coord)
        assert m.get("motor_rejections_total", reason="rate_limit") == 2
        assert m.get("motor_requests_total", status=429) == 2


def test_health_answers(c):
    r = httpx.get(c.obs + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


# -- request log line and request id -----------------------------------------------------------------


def test_one_structured_log_line_per_request(c):
    rid = "log-line-check-1"
    assert post(c, CHAT, chat_body(model=PD_MODEL), headers={"X-Request-Id": rid}).status_code == 200
    assert wait_until(lambda: f"request_id={rid} " in c.output())
    lines = [line for line in c.output().splitlines() if f"request_id={rid} " in line]
    assert len(lines) == 1
    line = lines[0]
    assert " INFO coordinator.request[" in line
    for field in (
        "route=/v1/chat/completions",
        f"model={PD_MODEL}",
        "prefill=2/0@",
        "decode=3/0@",
        "status=200",
        "ttft_ms=",
        "prompt_tokens=",
        "output_tokens=3",
        "duration_ms=",
    ):
        assert field in line, field
    # No access log by default (Sanic's would read "... INFO: 127.0.0.1:PORT POST http://... 200 ...").
    assert not re.search(r"(GET|POST) http://\S+ \d{3} ", c.output())


def test_client_values_cannot_forge_request_line_fields_or_lines(c):
    """A model name and a request id are the client's: a newline in one forged a whole log line (timestamp and
    all), spaces and `=` forged fields (a second status=)."""
    forged_line = "qwen3\n2099-01-01 00:00:00,000 INFO coordinator.request[1]: request_id=FORGED status=200"
    mark = len(c.output())
    r = post(c, CHAT, {**chat_body(), "model": forged_line}, headers={"X-Request-Id": "forge-1"})
    assert r.status_code == 404
    r = post(c, CHAT, chat_body(), headers={"X-Request-Id": "x route=/v1/fake model=evil status=200"})
    assert r.status_code == 200 and r.headers["x-request-id"] != "x route=/v1/fake model=evil status=200"
    assert wait_until(lambda: c.output().count(" INFO coordinator.request[", mark) >= 2)
    lines = [line for line in c.output()[mark:].splitlines() if "coordinator.request[" in line]
    assert not any(line.startswith("2099-") or "request_id=FORGED" in line.split(" model=")[0] for line in lines), lines
    # Quoted values are inert: the model and the error (always the last field), both in JSON's quoting.
    unquoted = [re.sub(r' model="(?:[^"\\]|\\.)*"', " model=Q", line).split(" error=")[0] for line in lines]
    assert all(line.count(" status=") == 1 and line.count(" route=") == 1 for line in unquoted), unquoted
    [forge] = [line for line in lines if "request_id=forge-1 " in line]
    assert ' model="qwen3\\n2099-01-01' in forge


# What a client chooses, in the request line, as a strict logfmt reader must read it back.
FORGERIES = [  # (X-Request-Id, model)
    ('"', "nomodel status=200 route=/forged"),  # the id's quote opened a value that the model's closed
    ('x"', MODEL),
    ("a=b", 'a"b'),
    ("\\", 'it\'s "quoted" status=200 route=/forged'),  # an error quoting both quotes: Python's repr used '...'
    ("t-5", "tab\there\x7fdel \u00e9\u2028"),
]


def test_a_strict_logfmt_reader_finds_only_the_coordinators_fields(c):
    mark = len(c.output())
    for rid, model in FORGERIES:
        r = post(c, CHAT, chat_body(model=model), headers={"X-Request-Id": rid})
        assert r.headers["x-request-id"] == rid and r.status_code == (200 if model == MODEL else 404), r.text

    def read() -> dict[str, dict[str, str]]:
        """The request lines written since `mark`, by request id. No key twice: a forged status= would be one."""
        lines = [line for line in c.output()[mark:].splitlines() if " INFO coordinator.request[" in line]
        return {(got := logfmt.fields(line.partition("]: ")[2]))["request_id"]: got for line in lines}

    assert wait_until(lambda: {rid for rid, _ in FORGERIES} <= read().keys())
    by_id = read()
    for rid, model in FORGERIES:
        got = by_id[rid]
        assert got["model"] == model and got["route"] == CHAT, got
        assert got["status"] == ("200" if model == MODEL else "404"), got
        assert {"stream", "prefill", "decode", "ttft_ms", "prompt_tokens", "duration_ms"} <= got.keys(), got
        assert ("error" in got) == (model != MODEL), got
        if model != MODEL:
            assert got["error"] == f"The model `{model}` does not exist.", got


def test_every_response_carries_a_request_id(c):
    calls = [
        ("GET", c.mgmt + "/startup", None),
        ("GET", c.mgmt + "/readiness", None),
        ("GET", c.mgmt + "/instances", None),
        ("POST", c.mgmt + "/instances/refresh", {"event": "nope"}),
        ("GET", c.mgmt + "/nowhere", None),
        ("GET", c.obs + "/metrics", None),
        ("GET", c.obs + "/health", None),
        ("GET", c.obs + "/nowhere", None),
        ("GET", c.url + "/v1/models", None),
        ("GET", c.url + "/nowhere", None),
        ("GET", c.url + "/docs", None),
        ("POST", c.url + CHAT, {"model": MODEL}),
        ("POST", c.url + CHAT, chat_body()),
        ("POST", c.url + "/v1/messages", {"model": MODEL}),
        ("DELETE", c.url + "/v1/models", None),
    ]
    for method, url, body in calls:
        r = httpx.request(method, url, json=body)
        assert r.headers.get("x-request-id"), (method, url, r.status_code)
        sent = httpx.request(method, url, json=body, headers={"X-Request-Id": "echo-me"})
        assert sent.headers["x-request-id"] == "echo-me", (method, url)
    with httpx.stream("POST", c.url + CHAT, json=chat_body(stream=True), headers={"X-Request-Id": "stream-id"}) as r:
        assert r.headers["x-request-id"] == "stream-id"
        r.read()


# -- OpenAPI -----------------------------------------------------------------------------------------


def test_openapi_spec_documents_the_inference_routes(c):
    spec = httpx.get(c.url + "/docs/openapi.json").json()
    assert set(spec["paths"]) == {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/metaserver",
        "/v1/models",
        "/v1/models/{model}",
        "/v1/responses",
        "/v1/responses/{response_id}",
        "/v1/responses/{response_id}/cancel",
        "/tokenize",
        "/detokenize",
    }
    chat = spec["paths"]["/v1/chat/completions"]["post"]
    body = chat["requestBody"]["content"]["application/json"]["schema"]["properties"]
    assert {"model", "messages", "stream", "max_tokens"} <= set(body)
    assert "passed to the engine unchanged" in chat["description"]
    responses = chat["responses"]
    assert {"200", "400", "401", "404", "413", "429", "502", "503"} <= set(responses)
    openai_error = responses["400"]["content"]["application/json"]["schema"]["properties"]["error"]["properties"]
    assert set(openai_error) == {"message", "type", "param", "code"}
    messages = spec["paths"]["/v1/messages"]["post"]["responses"]["400"]["content"]["application/json"]["schema"][
        "properties"
    ]
    assert set(messages) == {"type", "error", "request_id"}
    page = httpx.get(c.url + "/docs")
    assert page.status_code == 200 and "openapi.json" in page.text


def test_batched_histogram_writes_what_observe_would():
    """Observations counted into buckets and flushed once give the same samples as observing one by one."""
    from prometheus_client import CollectorRegistry, Histogram

    from serving.metrics import LATENCY_BUCKETS, _PendingHistogram

    values = [0.0, 0.003, 0.005, 0.0051, 0.3, 0.3, 2.5, 7.0, 599.0, 601.0, 1e6]
    registry = CollectorRegistry()
    direct = Histogram("direct_seconds", "d", ["k"], buckets=LATENCY_BUCKETS, registry=registry)
    batched = Histogram("batched_seconds", "b", ["k"], buckets=LATENCY_BUCKETS, registry=registry)
    pending = _PendingHistogram(batched.labels("x"))
    written = []
    for part in (values[:5], values[5:]):  # two batches: a flush must leave nothing behind for the next one
        for v in part:
            direct.labels("x").observe(v)
            pending.observe(v)
        written.append(registry.get_sample_value("batched_seconds_count", {"k": "x"}))
        pending.flush()
    pending.flush()  # a flush with nothing pending writes nothing
    assert written == [0, 5]  # nothing is written before a flush
    samples = [("_count", {}), ("_sum", {})] + [
        ("_bucket", {"le": le}) for le in [str(float(b)) for b in LATENCY_BUCKETS] + ["+Inf"]
    ]
    for suffix, labels in samples:
        want = registry.get_sample_value("direct_seconds" + suffix, {"k": "x", **labels})
        got = registry.get_sample_value("batched_seconds" + suffix, {"k": "x", **labels})
        assert want is not None and got == pytest.approx(want, rel=1e-12), (
            suffix,
            labels,
        )  # sums added in another order


def test_metrics_reach_the_files_by_the_timer_without_a_scrape():
    """A request's counts are written at the worker's next tick, not only when it answers a scrape."""
    from config import Live, Settings
    from scheduling.health import Health
    from scheduling.ledger import Ledger
    from scheduling.registry import Registry
    from serving.metrics import KV_PREDICTION, REQUESTS, PrometheusObserver
    from serving.observe import RequestRecord, Tick
    from state.shared import SharedState

    shared = SharedState.create()
    registry = Registry(shared)
    observer = PrometheusObserver(
        registry, Ledger(shared, 0, 1), Health(shared, Live(Settings(breaker_open_s=1.0))), Tick(0.02)
    )
    child = REQUESTS.labels("/v1/timer-test", "other", "200")
    exact = KV_PREDICTION.labels("other", "exact")

    def predicted(rid: str) -> RequestRecord:  # the KV events predicted its cached tokens, exactly
        rec = RequestRecord(rid, "/v1/timer-test", model="nobody", cached_tokens=16)
        rec.info = types.SimpleNamespace(cached_predicted=16, prompt_keys=b"")  # (its keys were made)
        return rec

    async def scenario() -> tuple[tuple[float, float], ...]:
        start = child._value.get(), exact._value.get()
        observer.request_done(predicted("rid"))
        observer.request_done(predicted("rid2"))
        at_once = child._value.get(), exact._value.get()
        await asyncio.sleep(0.2)
        return start, at_once, (child._value.get(), exact._value.get())

    start, at_once, later = asyncio.run(scenario())
    assert at_once == start  # batched: nothing written at the request
    assert later == (start[0] + 2, start[1] + 2)  # the timer wrote both, with no scrape and no close


def test_one_tick_flushes_each_writer_that_armed_it(caplog, capsys, monkeypatch, tmp_path):
    """A worker's batching writers share one timer: the request log, the metrics and the tenants' tpm charge each
    arm it, one timer is pending for the three, and its one tick writes what each of them held."""
    from config import Live, Settings
    from scheduling.health import Health
    from scheduling.ledger import Ledger
    from scheduling.registry import Registry
    from serving.metrics import REQUESTS, PrometheusObserver
    from serving.observe import RequestRecord, Tick
    from state.quotas import unit_ns
    from state.shared import SharedState

    caplog.set_level("INFO", logger="coordinator.request")  # (the request log writes its lines at INFO)
    # (an exposition registry of its own: the default one takes one observer's collector per process)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    shared, tick = SharedState.create(), Tick(0.02)
    observer = PrometheusObserver(
        Registry(shared), Ledger(shared, 0, 1), Health(shared, Live(Settings(breaker_open_s=1.0))), tick
    )
    # (a tpm of 1,000: the reservation keeps the bucket a second past full while the test looks)
    quotas, tenants, job = tpm_tenant(shared, tick, 1000)
    child = REQUESTS.labels("/v1/tick-test", "other", "200")

    async def scenario() -> tuple[int, float, int]:
        streaming = RequestRecord("streaming", "/v1/tick-test", tenant="t")
        with tenants.admit(job, streaming, {}) as place:  # its tokens charged at each tick while it streams
            row = quotas.rows[place.key]
            taken = row.tokens_full_ns
            streaming.output_tokens = 104  # 100 beyond the 4 it reserved
            before = child._value.get()
            observer.request_done(RequestRecord("tick-log", "/v1/tick-test", model="nobody"))
            pending = len(asyncio.get_running_loop()._scheduled)  # the timers the three writers armed
            await asyncio.sleep(0.2)
            return pending, child._value.get() - before, row.tokens_full_ns - taken

    pending, counted, charged = asyncio.run(scenario())
    assert pending == 1
    assert counted == 1  # the metrics
    assert charged == 100 * unit_ns(1000)  # the tenant's tpm bucket, full 100 tokens' time later
    assert "request_id=tick-log " in capsys.readouterr().out  # the request log


def tpm_tenant(shared, tick, tpm: int, max_tokens: int = 4):
    """A worker's tenants (`tick` their timer) with one tenant "t" of `tpm`, its quotas in `shared`, and a chat job of
    that tenant asking for `max_tokens`: (quotas, tenants, job)."""
    from config import Live
    from config.load import settings_from_dict
    from serving.families.chat import CHAT
    from serving.job import job_from_body, parse_body
    from serving.tenants import Tenants
    from state.quotas import TenantQuotas

    config = {
        "api_key_config": {"enable_api_key": True, "valid_keys": ["sk-other"]},
        "tenant_config": {"tenants": [{"name": "t", "keys": ["sk-t"], "tpm": tpm}]},
    }
    quotas = TenantQuotas(shared, 0, 1)
    tenants = Tenants(Live(settings_from_dict(config)), quotas, None, tick)
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": %d}' % max_tokens
    job = job_from_body(CHAT, body, parse_body(body), "tpm-test")
    job.tenant = "t"
    return quotas, tenants, job


def test_a_writer_whose_flush_fails_stops_no_other():
    """A tick flushes every writer armed since the last one, even after one's flush raised; and that one is
    flushed again at a later tick (not left armed for good)."""
    from serving.observe import Tick

    tick, calls = Tick(0.01), []

    def failing() -> None:
        calls.append("failing")
        raise OSError("disk full")

    first, second = tick.timer(failing), tick.timer(lambda: calls.append("second"))

    async def scenario() -> None:
        for _ in range(2):
            first.arm()
            second.arm()
            await asyncio.sleep(0.1)

    asyncio.run(scenario())
    assert calls == ["failing", "second", "failing", "second"]


def test_a_tpm_quota_admits_and_charges_without_an_event_loop():
    """With no running loop a batching writer flushes when armed; the tpm charge arms itself again while requests
    stream, and that must wait for the next arm, not flush again from within the flush (it recursed until Python's
    limit)."""
    from serving.observe import RequestRecord, Tick
    from state.quotas import unit_ns
    from state.shared import SharedState

    quotas, tenants, job = tpm_tenant(SharedState.create(), Tick(), 1000)
    rec = RequestRecord("no-loop", "/v1/chat/completions", tenant="t")
    with tenants.admit(job, rec, {}) as place:
        rec.output_tokens = 104  # 100 beyond what it reserved for its output
        taken = quotas.rows[place.key].tokens_full_ns
        tenants._timer.arm()  # (what the next request's admission would do)
        assert quotas.rows[place.key].tokens_full_ns - taken == 100 * unit_ns(1000)


def test_a_giant_max_tokens_reserves_at_most_a_minutes_tokens():
    """A request's output reservation is at most its tenant's tpm: a max_tokens of 10**30 (which vLLM refuses, after
    the quota was taken) holds a minute's tokens while it runs, not a number the bucket's clock cannot hold (the
    shared row's 64 bits would wrap, and the tenant's bucket read as anything, full included)."""
    from serving.observe import RequestRecord, Tick
    from state.quotas import Limits
    from state.shared import SharedState

    quotas, tenants, job = tpm_tenant(SharedState.create(), Tick(), 1000, max_tokens=10**30)
    with tenants.admit(job, RequestRecord("giant", "/v1/chat/completions", tenant="t"), {}) as place:
        ahead_ns = quotas.rows[place.key].tokens_full_ns - time.monotonic_ns()
        left = Limits(0, 1000, 0).levels(0, max(ahead_ns, 0))[1]
        assert -place.prompt * 1000 - 1000 <= left <= 0, left
