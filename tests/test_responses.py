"""The Responses API through the Coordinator, driven by the real `openai` SDK: union and PD models, the prefill
leg, the ticket relay, usage, events, stored responses (follow-ups, retrieve, delete, cancel) and their 404s."""

from __future__ import annotations

import httpx
import openai
import pytest

from harness.clients import openai_client as client
from harness.configs import api_keys, coordinator_config, instance
from harness.coordinator import Coordinator
from harness.loopback import wait_until
from tests.conftest import MODEL

PD = "qwen3-pd"
EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]


@pytest.fixture(scope="module")
def c(module_sims):
    """Two union engines of MODEL; one prefill and two decode engines of PD; two Coordinator workers."""
    u = [module_sims("union"), module_sims("union")]
    p, d = module_sims("prefill", model=PD), [module_sims("decode", model=PD), module_sims("decode", model=PD)]
    cfg = coordinator_config(
        [
            instance(1, "union", MODEL, u[0].address),
            instance(2, "union", MODEL, u[1].address),
            instance(3, "prefill", PD, p.address),
            instance(4, "decode", PD, d[0].address),
            instance(5, "decode", PD, d[1].address),
        ]
    )
    with Coordinator(cfg, workers=2) as coord:
        coord.u, coord.p, coord.d = u, p, d
        yield coord


def created(sim, response_id: str) -> list[dict]:
    """The bodies `sim` got for POST /v1/responses with this response id."""
    return [
        r["body"] for r in sim.requests() if r["path"] == "/v1/responses" and r["body"]["request_id"] == response_id
    ]


def holder(sims, response_id: str):
    (only,) = [s for s in sims if created(s, response_id)]
    return only


def test_a_union_response_is_the_engines_with_the_coordinators_id(c):
    r = client(c).responses.create(model=MODEL, input="Say something.", max_output_tokens=8, instructions="Be brief.")
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text and r.usage.output_tokens == 8
    assert r.usage.total_tokens == r.usage.input_tokens + 8
    sim = holder(c.u, r.id)  # the id the Coordinator gave the engine is the response's
    (body,) = created(sim, r.id)
    assert body["input"] == "Say something." and body["instructions"] == "Be brief."


def test_the_prefill_leg_is_one_unstored_token_and_d_gets_ps_ticket(c):
    r = client(c).responses.create(
        model=PD,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "tell me a story"}]}],
        max_output_tokens=12,
        temperature=0.5,
        extra_body={"stop": ["\n\n"], "stop_token_ids": [7], "custom_field": [1, 2]},
    )
    (pb,) = created(c.p, r.id)
    assert pb["max_output_tokens"] == 1 and pb["stream"] is False and pb["ignore_eos"] is True
    assert pb["store"] is False and pb["background"] is False
    # The client's stop conditions at the engine's defaults (its bytes with the leg's changes appended).
    assert pb["stop"] is None and pb["stop_token_ids"] is None and "max_tokens" not in pb
    assert pb["kv_transfer_params"]["do_remote_decode"] is True
    assert pb["custom_field"] == [1, 2] and pb["temperature"] == 0.5
    d = holder(c.d, r.id)
    (db,) = created(d, r.id)
    ticket = db["kv_transfer_params"]
    assert ticket["do_remote_prefill"] is True and ticket["remote_engine_id"] == c.p.engine_id
    assert ticket["remote_request_id"] == r.id  # P's ticket, as P answered it
    assert db["stop"] == ["\n\n"] and db["stop_token_ids"] == [7] and db["max_output_tokens"] == 12
    assert "store" not in db  # the client's body, as it sent it
    assert 0 < r.usage.output_tokens <= 12 and r.output_text


def test_pd_usage_bills_ps_prompt_once_in_json_and_in_response_completed(c):
    """D reports the transferred prompt as cached; the client gets P's input counts and D's output."""
    hits = sum(s.stats()["remote_kv_hits"] for s in c.d)
    r = client(c).responses.create(model=PD, input="count me " * 30, max_output_tokens=5)
    assert sum(s.stats()["remote_kv_hits"] for s in c.d) == hits + 1
    assert r.usage.input_tokens_details.cached_tokens == 0
    assert r.usage.total_tokens == r.usage.input_tokens + 5
    with client(c).responses.stream(model=PD, input="count me too " * 30, max_output_tokens=5) as s:
        for _ in s:
            pass
        final = s.get_final_response()
    assert final.usage.input_tokens_details.cached_tokens == 0 and final.usage.output_tokens == 5
    assert final.usage.total_tokens == final.usage.input_tokens + 5
    assert sum(s.stats()["remote_kv_hits"] for s in c.d) == hits + 2


def _missed(c) -> float:
    lines = httpx.get(c.obs + "/metrics", timeout=10).text.splitlines()
    return sum(
        float(ln.rsplit(" ", 1)[1]) for ln in lines if ln.startswith(f'motor_missed_handoffs_total{{model="{PD}"')
    )


def test_a_prefill_without_a_ticket_is_a_missed_handoff_and_d_computes_the_prompt(c):
    missed = _missed(c)
    c.p.set_faults(eos_on_prefill=True)  # P's one token is EOS: vLLM answers no kv_transfer_params
    try:
        r = client(c).responses.create(model=PD, input="no ticket", max_output_tokens=3)
    finally:
        c.p.clear_faults()
    (db,) = created(holder(c.d, r.id), r.id)
    assert "kv_transfer_params" not in db and r.output_text
    assert wait_until(lambda: _missed(c) == missed + 1)


@pytest.mark.parametrize("model", [MODEL, PD])
def test_events_come_in_order_with_their_sequence_numbers(c, model):
    with client(c).responses.stream(model=model, input="stream it", max_output_tokens=6) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    assert [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]] == EVENTS
    assert 1 <= kinds.count("response.output_text.delta") <= final.usage.output_tokens <= 6
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.output_text == text and final.id == events[0].response.id
    assert final.model_dump().get("kv_transfer_params") is None  # (P's ticket is not the client's)


def test_raw_events_are_relayed_with_their_names(c):
    body = {"model": PD, "input": "raw", "max_output_tokens": 3, "stream": True}
    with httpx.stream("POST", c.url + "/v1/responses", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    names = [ln[7:] for ln in text.splitlines() if ln.startswith("event: ")]
    assert names[0] == "response.created" and names[-1] == "response.completed" and "[DONE]" not in text


@pytest.mark.parametrize("model", [MODEL, PD])
def test_a_follow_up_turn_goes_to_the_instance_holding_the_previous_response(c, model):
    engines = c.u if model == MODEL else c.d
    sdk = client(c)
    first = sdk.responses.create(model=model, input="My name is Ada.", max_output_tokens=4)
    home = holder(engines, first.id)
    prefills = len(c.p.requests())
    previous = first
    for turn in range(4):  # each turn continues the last, wherever the load would have put it
        nxt = sdk.responses.create(
            model=model, input=f"turn {turn}", previous_response_id=previous.id, max_output_tokens=4
        )
        assert nxt.previous_response_id == previous.id
        assert holder(engines, nxt.id) is home
        (body,) = created(home, nxt.id)
        assert "kv_transfer_params" not in body  # the holder computes the new prompt itself
        # It continued the stored conversation: the prompt grew by the previous turn.
        assert nxt.usage.input_tokens > previous.usage.input_tokens
        previous = nxt
    assert len(c.p.requests()) == prefills  # follow-ups skip the prefill leg
    streamed = sdk.responses.create(model=model, input="last", previous_response_id=previous.id, stream=True)
    done = [e for e in streamed if e.type == "response.completed"]
    assert len(done) == 1 and holder(engines, done[0].response.id) is home


@pytest.mark.parametrize("model", [MODEL, PD])
def test_retrieve_and_delete_go_to_the_holder_and_delete_forgets(c, model):
    sdk = client(c)
    r = sdk.responses.create(model=model, input="keep this", max_output_tokens=3)
    got = sdk.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.status == r.status
    assert sdk.responses.delete(r.id) is None
    with pytest.raises(openai.NotFoundError) as e:
        sdk.responses.retrieve(r.id)
    assert e.value.body["param"] == "response_id" and r.id in e.value.body["message"]
    with pytest.raises(openai.NotFoundError) as e:
        sdk.responses.create(model=model, input="again", previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id"


def test_a_retried_response_is_remembered_where_it_was_served(c):
    """An engine failing before its first byte: the retry serves the response on the other one, and the id
    is found there (remembered when planned, moved on the retry)."""
    sdk, bad, good = client(c), c.u[0], c.u[1]
    bad.set_faults(fail_status=503)
    try:
        moved = None
        for _ in range(12):  # until the scheduler first placed one on the failing engine
            r = sdk.responses.create(model=MODEL, input="retry me", max_output_tokens=2)
            if created(bad, r.id):
                moved = r
                break
    finally:
        bad.clear_faults()
    assert moved is not None and created(good, moved.id)
    assert sdk.responses.retrieve(moved.id).id == moved.id
    nxt = sdk.responses.create(model=MODEL, input="next", previous_response_id=moved.id, max_output_tokens=2)
    assert holder(c.u, nxt.id) is good


def test_a_client_never_chooses_a_stored_responses_id(c):
    """A client's `request_id` (or X-Request-Id) is not the stored id: else it could name, and overwrite, another's."""
    sdk = client(c)
    for model in (MODEL, PD):
        r = sdk.responses.create(
            model=model,
            input="mine",
            max_output_tokens=2,
            extra_body={"request_id": "resp_my_own_1"},
            extra_headers={"X-Request-Id": "resp_my_own_2"},
        )
        assert r.id.startswith("resp_") and r.id not in ("resp_my_own_1", "resp_my_own_2")
        assert sdk.responses.retrieve(r.id).id == r.id
        for chosen in ("resp_my_own_1", "resp_my_own_2"):
            with pytest.raises(openai.NotFoundError):
                sdk.responses.retrieve(chosen)


def test_an_unknown_id_is_a_404_in_openais_shape_everywhere(c):
    sdk = client(c)
    for call in (
        lambda: sdk.responses.retrieve("resp_never"),
        lambda: sdk.responses.delete("resp_never"),
        lambda: sdk.responses.cancel("resp_never"),
        lambda: sdk.responses.create(model=MODEL, input="x", previous_response_id="resp_never"),
    ):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        err = e.value.body
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
        assert "resp_never" in err["message"]
    received = sum(s.stats()["received"] for s in [*c.u, c.p, *c.d])
    with pytest.raises(openai.NotFoundError):
        sdk.responses.create(model=PD, input="x", previous_response_id="resp_never")
    assert sum(s.stats()["received"] for s in [*c.u, c.p, *c.d]) == received  # no engine was asked


@pytest.fixture(scope="module")
def stored(c) -> str:
    return client(c).responses.create(model=MODEL, input="replay", max_output_tokens=2).id


# `?stream=1` and `?STREAM=%74rue` passed a substring check for `stream=true` and reached the engine.
@pytest.mark.parametrize(
    "query", ["stream=true", "stream=1", "STREAM=%74rue", "stream=false&stream=on", "Stream=+yes", "%73tream=T"]
)
def test_replaying_a_stored_stream_is_refused_clearly(c, stored, query):
    got = httpx.get(f"{c.url}/v1/responses/{stored}?{query}", timeout=10)
    assert got.status_code == 400, got.text
    err = got.json()["error"]
    assert err["param"] == "stream" and err["type"] == "invalid_request_error", err


@pytest.mark.parametrize("query", ["stream=false", "stream=0", "STREAM=off", "stream=", "streams=true"])
def test_a_stored_response_asked_for_without_a_stream_is_the_engines(c, stored, query):
    got = httpx.get(f"{c.url}/v1/responses/{stored}?{query}", timeout=10)
    assert got.status_code == 200 and got.json()["id"] == stored, got.text


def test_an_unstored_response_is_not_remembered(c):
    sdk = client(c)
    r = sdk.responses.create(model=MODEL, input="forget me", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError) as e:
        sdk.responses.retrieve(r.id)
    assert "did not serve it" in e.value.body["message"]


def test_a_background_response_is_cancelled_on_its_instance(c):
    sdk = client(c)
    r = sdk.responses.create(model=MODEL, input="a long one", max_output_tokens=4000, background=True)
    assert r.status == "queued"
    home = holder(c.u, r.id)
    cancelled = sdk.responses.cancel(r.id)
    assert cancelled.id == r.id and cancelled.status == "cancelled"
    assert wait_until(lambda: r.id in home.stats()["aborted_request_ids"] or home.stats()["aborted"] >= 1)
    assert sdk.responses.retrieve(r.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError) as e:  # the engine's own answer, relayed
        sdk.responses.cancel(sdk.responses.create(model=MODEL, input="done", max_output_tokens=2).id)
    assert "Cannot cancel a synchronous response" in e.value.body["message"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": MODEL}, "input"),
        ({"model": MODEL, "input": [1]}, "input[0]"),
        ({"model": MODEL, "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"model": MODEL, "input": "x", "stream": "yes"}, "stream"),
        ({"model": MODEL, "input": "x", "previous_response_id": ""}, "previous_response_id"),
        ({"model": MODEL, "input": "x", "background": True, "store": False}, "background"),
        ({"model": MODEL, "input": "x", "prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"model": PD, "input": "x", "stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"input": "x"}, "model"),
    ],
)
def test_bad_input_is_a_400_naming_the_field_before_any_engine(c, body, param):
    received = sum(s.stats()["received"] for s in [*c.u, c.p, *c.d])
    r = httpx.post(c.url + "/v1/responses", json=body, timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and "Traceback" not in err["message"]
    assert sum(s.stats()["received"] for s in [*c.u, c.p, *c.d]) == received


def test_the_request_line_and_metrics_count_responses(c):
    r = client(c).responses.create(model=PD, input="log me", max_output_tokens=7)
    with client(c).responses.stream(model=MODEL, input="log me too", max_output_tokens=5) as s:
        for _ in s:
            pass
        streamed = s.get_final_response().usage.output_tokens
    rid = _rid_of(c, r.id)

    def lines() -> list[str]:
        return [ln for ln in c.output().splitlines() if "route=/v1/responses " in ln]

    assert wait_until(lambda: any(f"request_id={rid} " in ln for ln in lines()))
    assert wait_until(lambda: any("stream=True" in ln and f"output_tokens={streamed} " in ln for ln in lines()))
    line = next(ln for ln in lines() if f"request_id={rid} " in ln)
    assert f"output_tokens={r.usage.output_tokens} " in line and "prefill=3/" in line
    metrics = httpx.get(c.obs + "/metrics").text
    assert 'motor_requests_total{model="qwen3-pd",route="/v1/responses",status="200"}' in metrics


def _rid_of(c, response_id: str) -> str:
    """The Coordinator's request id of a response (the X-Request-Id its decode engine got)."""
    for d in c.d:
        for r in d.requests():
            if r["path"] == "/v1/responses" and r["body"]["request_id"] == response_id:
                return {k.lower(): v for k, v in r["headers"].items()}["x-request-id"]
    raise AssertionError(response_id)


def test_the_openapi_document_has_the_routes(c):
    doc = httpx.get(c.url + "/docs/openapi.json", timeout=10).json()
    assert "post" in doc["paths"]["/v1/responses"]
    body = doc["paths"]["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    text = str(body) + str(doc.get("components", {}))
    assert "previous_response_id" in text and "max_output_tokens" in text
    stored = doc["paths"]["/v1/responses/{response_id}"]
    assert {"get", "delete"} <= set(stored)
    assert "post" in doc["paths"]["/v1/responses/{response_id}/cancel"]


def test_keys_guard_every_route_and_a_gone_instance_is_a_404(sims):
    u1, u2 = sims("union"), sims("union")
    instances = [instance(1, "union", MODEL, u1.address), instance(2, "union", MODEL, u2.address)]
    with Coordinator(coordinator_config(instances, api_key_config=api_keys("k1"))) as coord:
        for method, path in (
            ("POST", "/v1/responses"),
            ("GET", "/v1/responses/resp_x"),
            ("DELETE", "/v1/responses/resp_x"),
            ("POST", "/v1/responses/resp_x/cancel"),
        ):
            r = httpx.request(method, coord.url + path, json={"model": MODEL, "input": "x"}, timeout=10)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", (method, path)
        sdk = client(coord, key="k1")
        r = sdk.responses.create(model=MODEL, input="where am I", max_output_tokens=2)
        home = holder([u1, u2], r.id)
        iid = 1 if home is u1 else 2
        assert coord.refresh("del", [i for i in instances if i["id"] == iid]).status_code == 200
        assert wait_until(lambda: httpx.get(coord.mgmt + "/instances", timeout=5).json() is not None)

        def gone() -> bool:
            try:
                sdk.responses.retrieve(r.id)
            except openai.NotFoundError as e:
                return "no longer registered" in e.body["message"]
            return False

        assert wait_until(gone, timeout_s=10)
        with pytest.raises(openai.NotFoundError):
            sdk.responses.create(model=MODEL, input="still there?", previous_response_id=r.id)


@pytest.fixture
def slow_pd(sims):
    """A PD pair that takes seconds: 2,000 prompt tokens a second, 10 ms a token."""
    p = sims("prefill", model=PD, speedup=1.0, prefill_tokens_per_s=2000)
    d = sims("decode", model=PD, speedup=1.0)
    with Coordinator(
        coordinator_config([instance(1, "prefill", PD, p.address), instance(2, "decode", PD, d.address)])
    ) as coord:
        coord.p, coord.d = p, d
        yield coord


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_a_client_disconnect_cancels_the_leg_in_flight(slow_pd, phase):
    c = slow_pd
    words = " word" * 6000 if phase == "prefill" else " hi"
    body = {"model": PD, "input": "go" + words, "max_output_tokens": 3000, "stream": True}
    headers = {"X-Request-Id": f"bye-{phase}"}
    if phase == "prefill":  # no byte comes before P is done: the client gives up waiting (about 4 s)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(c.url + "/v1/responses", json=body, headers=headers, timeout=httpx.Timeout(30, read=1.0))
    else:
        with httpx.stream("POST", c.url + "/v1/responses", json=body, headers=headers, timeout=30) as r:
            for line in r.iter_lines():
                if "response.output_text.delta" in line:
                    break
    engine = c.p if phase == "prefill" else c.d
    assert wait_until(lambda: engine.stats()["aborted_request_ids"] == [f"bye-{phase}"], timeout_s=10)
    if phase == "prefill":
        assert not [r for r in c.d.requests() if r["path"] == "/v1/responses"]  # D was never asked
    assert wait_until(lambda: "status=499" in c.output())
    with pytest.raises(openai.NotFoundError):  # the engine stored nothing; the Coordinator forgot the id
        client(c).responses.create(model=PD, input="x", previous_response_id=_any_id(engine))


def _any_id(sim) -> str:
    return next(r["body"]["request_id"] for r in sim.requests() if r["path"] == "/v1/responses")


def test_the_shared_table_keeps_the_newest_ids_of_each_set():
    """Unit check of the table's bounds: a set holds RESPONSE_HOME_WAYS ids, a new one evicts its oldest."""
    from state.response_homes import SharedResponseHomes
    from state.shared import RESPONSE_HOME_WAYS, SharedState

    homes = SharedResponseHomes(SharedState.create())
    first_set = homes._place("resp_0")[1]
    same = [f"resp_{i}" for i in range(300_000) if homes._place(f"resp_{i}")[1] == first_set][: RESPONSE_HOME_WAYS + 1]
    assert len(same) == RESPONSE_HOME_WAYS + 1
    for n, rid in enumerate(same):
        homes.remember(rid, n, 0, owner=5)
    assert homes.home(same[0], 5) is None  # the oldest of its set, evicted by the newest
    assert [homes.home(rid, 5) for rid in same[1:]] == [(n, 0) for n in range(1, RESPONSE_HOME_WAYS + 1)]
    assert homes.home(same[1], 6) is None  # another owner's: not there
    homes.remember(same[1], 7, 1, owner=5)  # written again: moved, not added
    assert homes.home(same[1], 5) == (7, 1) and homes.home(same[2], 5) == (2, 0)
    homes.forget(same[1])
    assert homes.home(same[1], 5) is None and homes.home("resp_elsewhere", 5) is None
