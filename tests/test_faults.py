"""The fault matrix: engine faults x streaming/non-streaming x union/PD, and client disconnects in every phase.

One Coordinator serves a union model (two engines) and a PD model (two prefill, two decode engines), with
short deadlines so hung engines resolve fast. Every case asserts what the client got, what each engine
saw, that nothing leaked (engines idle, prefill KV freed, the Coordinator's ledger back to zero) and that
the next request succeeds.
"""

from __future__ import annotations

import functools
import http.server
import json
import socket
import threading
import time
import uuid

import anthropic
import httpx
import openai
import pytest

from harness import bodies
from harness.bodies import sse_events
from harness.configs import coordinator_config, instance
from harness.coordinator import Coordinator
from harness.ledger import ledger, ledger_is_zero
from harness.loopback import wait_until
from harness.metrics import by_label
from serving.dispatch import MAX_OUTPUT_BUDGET
from tests.conftest import MODEL

UNION, PD = "fault-union", "fault-pd"
INFER_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/messages")
MAX_RETRY = 2
TIMEOUTS = {"first_token_timeout": 1.0, "stream_idle_timeout": 0.5, "infer_timeout": 1.5, "connect_timeout": 1.0}


@pytest.fixture(scope="module")
def cluster(module_sims):
    # speedup 5: 2 ms per decode step; prefill engines are slow (2500 prompt tokens/s) so a long prompt
    # keeps the prefill leg busy long enough to disconnect during it.
    u = [module_sims("union", model=UNION, speedup=5) for _ in range(2)]
    p = [module_sims("prefill", model=PD, speedup=5, prefill_tokens_per_s=500) for _ in range(2)]
    d = [module_sims("decode", model=PD, speedup=5) for _ in range(2)]
    instances = [instance(i + 1, "union", UNION, s.address) for i, s in enumerate(u)]
    instances += [instance(i + 11, "prefill", PD, s.address) for i, s in enumerate(p)]
    instances += [instance(i + 21, "decode", PD, s.address) for i, s in enumerate(d)]
    cfg = coordinator_config(
        instances,
        exception_config={
            "max_retry": MAX_RETRY,
            "retry_delay": 0.01,
            "kv_release_path": "/sim/kv/release",
            "stream_keepalive_interval": 0.15,
            **TIMEOUTS,
        },
        # The matrix provokes many failures on purpose: the breaker has its own tests (test_limits.py).
        scheduler_config={
            "breaker_failure_threshold": 1000,
            "health_check_interval": 0.2,
            "metrics_scrape_interval": 0.2,
        },
    )
    with Coordinator(cfg) as coord:
        coord.sims = {"union": u, "prefill": p, "decode": d}
        yield coord


@pytest.fixture
def c(cluster):
    for group in cluster.sims.values():
        for s in group:
            s.clear_faults()
            s.reset()
    return cluster


# -- helpers ---------------------------------------------------------------------------------------


def model_of(where: str) -> str:
    return UNION if where == "union" else PD


# chat_body(model, stream, max_tokens=8, ...): the whole answer generated, and its usage chunk when streamed.
chat_body = functools.partial(bodies.chat_body, content="hello there", usage=True, ignore_eos=True)


def call(c, body: dict, path: str = "/v1/chat/completions") -> tuple[int, dict, str]:
    """Status, headers and raw body of one request (streamed bodies read to their end)."""
    with httpx.stream("POST", c.url + path, json=body, timeout=30) as r:
        return r.status_code, dict(r.headers), r.read().decode()


def assert_engine_kept_out_of_the_message(c, sims, message: str, rid: str) -> None:
    """The client's error message names no engine address; the request's log line says which engine it was."""
    assert message.startswith(("engine", "decode engine", "prefill engine")), message
    assert not any(s.address in message or "127.0.0.1" in message for s in sims), message
    assert wait_until(lambda: any(f"request_id={rid} " in ln and "status=" in ln for ln in c.output().splitlines()))
    line = next(ln for ln in c.output().splitlines() if f"request_id={rid} " in ln and "status=" in ln)
    assert any(s.address in line for s in sims), line


def attempts(sims) -> list[dict]:
    return [r for s in sims for r in s.requests() if r["path"] in INFER_PATHS]


def rid_of(record: dict) -> str:
    return {k.lower(): v for k, v in record["headers"].items()}["x-request-id"]


def total(sims, key: str) -> int:
    return sum(s.stats().get(key, 0) for s in sims)


def engines_idle(c) -> bool:
    for group in c.sims.values():
        for s in group:
            st = s.stats()
            if st["running"] or st["waiting"] or st["held_kv_tickets"]:
                return False
    return True


def assert_recovered(c, model: str, stream: bool) -> None:
    """No leak anywhere, and with the faults gone the next request succeeds."""
    for group in c.sims.values():
        for s in group:
            s.clear_faults()
    # (on a loaded machine the simulators can take seconds to settle after the faults)
    assert wait_until(lambda: engines_idle(c), 15), [s.stats() for g in c.sims.values() for s in g]
    assert wait_until(lambda: ledger_is_zero(c), 5), ledger(c)
    status, _, text = call(c, chat_body(model, stream))
    assert status == 200, text
    if stream:
        events = sse_events(text)
        assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == 8
    else:
        assert json.loads(text)["usage"]["completion_tokens"] == 8


def openai_error(text: str) -> dict:
    return json.loads(text)["error"]


STREAM = pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
WHERE = pytest.mark.parametrize("where", ["union", "prefill", "decode"])


# -- the matrix: faults before the first byte --------------------------------------------------------


@STREAM
@pytest.mark.parametrize(
    "where,status", [("union", 503), ("prefill", 503), ("decode", 503), ("union", 429), ("union", 408)]
)
def test_retryable_status_is_retried_on_each_instance_then_answered(c, where, stream, status):
    sims = c.sims[where]
    for s in sims:
        s.set_faults(fail_status=status)
    code, headers, text = call(c, chat_body(model_of(where), stream))
    seen = attempts(sims)
    assert len(seen) == 1 + MAX_RETRY
    ids = [rid_of(r) for r in seen]
    assert len(set(ids)) == len(ids)  # a fresh engine request id per attempt
    assert all(s.stats()["received"] >= 1 for s in sims)  # the retry went to the other instance
    # Nothing was streamed: a plain error answer in the OpenAI envelope, never SSE.
    assert not headers["content-type"].startswith("text/event-stream")
    if status < 500:  # the engine's last answer, its status and body: the envelope describes that status
        err = openai_error(text)
        assert code == status and (err["message"], err["code"]) == (f"simulated failure (status {status})", status)
    else:
        assert code == 502 and openai_error(text)["code"] == "upstream_error"
    if where == "decode":  # D never took P's KV: the Coordinator freed it
        assert wait_until(lambda: total(c.sims["prefill"], "kv_released") == 1)
    if where == "prefill":
        assert not attempts(c.sims["decode"])
    assert_recovered(c, model_of(where), stream)


@WHERE
@STREAM
def test_transient_failures_are_retried_until_success(c, where, stream):
    sims = c.sims[where]
    for s in sims:
        s.set_faults(fail_first_n=1)  # then HTTP 500 once
    code, _, text = call(c, chat_body(model_of(where), stream))
    assert code == 200, text
    seen = attempts(sims)
    assert len(seen) == 1 + MAX_RETRY  # fails on one instance, then on the other, then succeeds
    assert rid_of(seen[0]) != rid_of(seen[1]) and sorted(s.stats()["failed"] for s in sims) == [1, 1]
    if stream:
        assert sse_events(text)[-1] == "[DONE]"
    else:
        assert json.loads(text)["choices"][0]["message"]["content"]
    assert_recovered(c, model_of(where), stream)


@WHERE
@STREAM
def test_client_error_goes_straight_back(c, where, stream):
    sims = c.sims[where]
    for s in sims:
        s.set_faults(fail_status=400)
    code, _, text = call(c, chat_body(model_of(where), stream))
    assert code == 400
    assert len(attempts(sims)) == 1  # never retried
    err = openai_error(text)
    assert err["message"] == "simulated failure (status 400)" and err["code"] == 400  # the engine's own body
    if where == "decode":  # D refused the leg: P's KV is freed
        assert wait_until(lambda: total(c.sims["prefill"], "kv_released") == 1)
    assert_recovered(c, model_of(where), stream)


@WHERE
@STREAM
def test_engine_that_never_answers_hits_the_deadline_and_is_retried(c, where, stream):
    sims = c.sims[where]
    for s in sims:
        s.set_faults(hang_before_first_byte=True)
    code, headers, text = call(c, chat_body(model_of(where), stream))
    assert code == 504 and openai_error(text)["code"] == "upstream_timeout"
    assert len(attempts(sims)) == 1 + MAX_RETRY
    assert_engine_kept_out_of_the_message(c, sims, openai_error(text)["message"], headers["x-request-id"])
    if where == "decode":
        assert wait_until(lambda: total(c.sims["prefill"], "kv_released") == 1)
    assert_recovered(c, model_of(where), stream)


@WHERE
@STREAM
def test_slow_first_byte_within_the_deadline_is_served(c, where, stream):
    sims = c.sims[where]
    for s in sims:
        s.set_faults(slow_first_byte_s=0.3)
    code, _, text = call(c, chat_body(model_of(where), stream))
    assert code == 200, text
    assert len(attempts(sims)) == 1
    assert_recovered(c, model_of(where), stream)


@STREAM
def test_eos_on_prefill_is_a_missed_handoff_and_decode_recomputes(c, stream):
    for s in c.sims["prefill"]:
        s.set_faults(eos_on_prefill=True)
    before = _missed_handoffs(c)
    code, _, text = call(c, chat_body(PD, stream))
    assert code == 200, text
    assert total(c.sims["prefill"], "prefill_without_ticket") == 1
    d_req = attempts(c.sims["decode"])
    assert len(d_req) == 1 and "kv_transfer_params" not in d_req[0]["body"]
    assert _missed_handoffs(c) == before + 1
    assert_recovered(c, PD, stream)


# -- the matrix: faults after the first byte ------------------------------------------------------------


MID = pytest.mark.parametrize("where", ["union", "decode"])


# The engine's next event cut in two by the network before the fault: its first half must not reach the
# client, or the keep-alive comment and the error event would land inside it.
CUT = pytest.mark.parametrize("cut", [{}, {"partial_event_at_n": 2}], ids=["whole_events", "event_cut"])


@MID
@STREAM
@CUT
def test_stalled_stream_gets_keepalives_then_one_error_event(c, where, stream, cut):
    sims = c.sims[where]
    for s in sims:
        s.set_faults(stall_mid_stream_after_n=2, **cut)
    # Long enough that the engine is still generating when the idle deadline ends the stream.
    code, _, text = call(c, chat_body(model_of(where), stream, max_tokens=2000 if stream else 8))
    assert code == 200
    assert len(attempts(sims)) == 1  # after the first byte: never retried
    if stream:
        events = sse_events(text)
        assert len(events) == 3 and json.loads(events[0])["choices"]
        assert openai_error(events[-1])["code"] == "upstream_timeout"
        assert ": keep-alive" in text.split("\n\n", 2)[2]  # comments while the engine was silent
        assert wait_until(lambda: total(sims, "aborted") == 1)  # the Coordinator hung up: the engine aborted
    else:  # the knob acts on SSE events: a JSON answer is unaffected
        assert json.loads(text)["usage"]["completion_tokens"] == 8
    assert_recovered(c, model_of(where), stream)


@MID
@STREAM
@CUT
def test_connection_closed_mid_stream_ends_with_one_error_event(c, where, stream, cut):
    sims = c.sims[where]
    for s in sims:
        s.set_faults(close_mid_stream_after_n=2, **cut)
    code, headers, text = call(c, chat_body(model_of(where), stream, max_tokens=2000 if stream else 8))
    assert code == 200
    assert len(attempts(sims)) == 1
    if stream:
        events = sse_events(text)
        assert len(events) == 3 and openai_error(events[-1])["code"] == "upstream_error"
        assert_engine_kept_out_of_the_message(c, sims, openai_error(events[-1])["message"], headers["x-request-id"])
        assert total(sims, "dropped") == 1
    else:
        assert json.loads(text)["choices"][0]["finish_reason"] == "length"
    assert_recovered(c, model_of(where), stream)


@MID
@STREAM
def test_malformed_chunk_is_relayed_and_the_stream_completes(c, where, stream):
    sims = c.sims[where]
    for s in sims:
        s.set_faults(malformed_chunk_after_n=2)
    code, _, text = call(c, chat_body(model_of(where), stream))
    assert code == 200
    if stream:
        events = sse_events(text)
        assert "{not json" in events  # bytes are relayed, not re-parsed
        assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == 8
    else:
        assert json.loads(text)["usage"]["completion_tokens"] == 8
    assert total(sims, "completed") == 1
    assert_recovered(c, model_of(where), stream)


def test_sdk_sees_a_mid_stream_error_as_an_api_error(c):
    for s in c.sims["decode"]:
        s.set_faults(close_mid_stream_after_n=3)
    client = openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0, timeout=30)
    got = []
    with pytest.raises(openai.APIError):
        body = chat_body(PD, True, max_tokens=500)
        body["extra_body"] = {"ignore_eos": body.pop("ignore_eos")}
        got.extend(client.chat.completions.create(**body))
    assert len(got) == 3
    assert_recovered(c, PD, True)


def test_anthropic_stream_error_is_one_error_event_in_its_envelope(c):
    for s in c.sims["decode"]:
        s.set_faults(close_mid_stream_after_n=3)
    body = {
        "model": PD,
        "max_tokens": 500,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "ignore_eos": True,
    }
    code, _, text = call(c, body, "/v1/messages")
    assert code == 200
    last = text.strip().split("\n\n")[-1]
    assert last.startswith("event: error\n")
    err = json.loads(sse_events(last)[0])
    assert err["type"] == "error" and err["error"]["type"] == "api_error"
    assert len(sse_events(text)) == 4  # three relayed events, then the error
    client = anthropic.Anthropic(base_url=c.url, api_key="x", max_retries=0, timeout=30)
    with pytest.raises(anthropic.APIStatusError):
        with client.messages.stream(
            model=PD, max_tokens=500, messages=[{"role": "user", "content": "hi"}], extra_body={"ignore_eos": True}
        ) as stream:
            for _ in stream:
                pass
    assert_recovered(c, PD, True)


def test_sdk_sees_exhausted_retries_as_a_server_error(c):
    for s in c.sims["union"]:
        s.set_faults(fail_status=500)
    client = anthropic.Anthropic(base_url=c.url, api_key="x", max_retries=0, timeout=30)
    with pytest.raises(anthropic.InternalServerError) as exc:
        client.messages.create(model=UNION, max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert exc.value.status_code == 502 and exc.value.body["type"] == "error"
    assert len(attempts(c.sims["union"])) == 1 + MAX_RETRY
    assert_recovered(c, UNION, False)


# -- what the SDKs are told about retrying -----------------------------------------------------------


def test_spent_retries_tell_the_sdk_not_to_retry_them_again(c):
    for s in c.sims["union"]:
        s.set_faults(fail_status=500)
    client = openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=2, timeout=30)  # the SDK's default
    with pytest.raises(openai.InternalServerError) as exc:
        client.chat.completions.create(model=UNION, messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    assert exc.value.response.headers["x-should-retry"] == "false"
    assert len(attempts(c.sims["union"])) == 1 + MAX_RETRY  # the Coordinator's retries, not three times as many
    assert_recovered(c, UNION, False)


@pytest.mark.parametrize("status", [408, 429])
def test_a_spent_408_or_429_tells_the_sdk_not_to_retry_it_again(c, status):
    """The SDKs retry 408 and 429 too: without the header each of their attempts would get the
    Coordinator's retries again (3 x 4 engine attempts)."""
    for s in c.sims["union"]:
        s.set_faults(fail_status=status)
    client = anthropic.Anthropic(base_url=c.url, api_key="x", max_retries=2, timeout=30)  # the SDK's default
    with pytest.raises(anthropic.APIStatusError) as exc:
        client.messages.create(model=UNION, max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert exc.value.status_code == status and exc.value.response.headers["x-should-retry"] == "false"
    assert len(attempts(c.sims["union"])) == 1 + MAX_RETRY
    assert_recovered(c, UNION, False)


def test_an_engines_501_is_the_requests_answer(c):
    """vLLM answers 501 for what it does not implement, every time: the client reads the engine's message
    and status, and neither the Coordinator nor the SDK retries it (the breaker: test_limits.py)."""
    message = "logprobs are not supported with this sampler"
    for s in c.sims["union"]:
        s.set_faults(
            fail_status=501,
            fail_body=json.dumps(
                {"error": {"message": message, "type": "NotImplementedError", "param": None, "code": 501}}
            ),
        )
    client = openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=2, timeout=30)  # the SDK's default
    with pytest.raises(openai.APIStatusError) as exc:
        client.chat.completions.create(model=UNION, messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    assert exc.value.status_code == 501 and exc.value.response.headers["x-should-retry"] == "false"
    assert exc.value.body["message"] == message
    assert len(attempts(c.sims["union"])) == 1
    assert_recovered(c, UNION, False)


@pytest.mark.parametrize("status,client_status", [(429, 429), (503, 502)])
def test_an_engines_retry_after_is_relayed_and_ends_the_retries_once_every_engine_asked(c, status, client_status):
    for s in c.sims["union"]:
        s.set_faults(fail_status=status, fail_retry_after="7")
    code, headers, text = call(c, chat_body(UNION, False))
    assert code == client_status and headers["retry-after"] == "7"
    assert "x-should-retry" not in headers  # the SDK comes back after the engine's 7 s
    assert len(attempts(c.sims["union"])) == 2  # each engine once: the third attempt would only be told to wait
    assert_recovered(c, UNION, False)


@pytest.mark.parametrize(
    "sent,relayed",
    [
        ("1.5", "2"),
        ("Wed, 21 Oct 2037 07:28:00 GMT", "Wed, 21 Oct 2037 07:28:00 GMT"),
        ("21 Oct 2037 07:28:00 -0000", "Wed, 21 Oct 2037 07:28:00 GMT"),  # a date in another form: written as HTTP's
        ("soon", None),
        ("nan", None),
        ("-5", None),
        ("Wed, 21 Oct 99999999999999999999 07:28:00 GMT", None),
    ],
)
def test_an_engines_retry_after_is_relayed_only_in_a_form_http_allows(c, sent, relayed):
    for s in c.sims["union"]:
        s.set_faults(fail_status=429, fail_retry_after=sent)
    code, headers, _ = call(c, chat_body(UNION, False))
    assert code == 429 and headers.get("retry-after") == relayed
    assert_recovered(c, UNION, False)


@STREAM
def test_a_prompt_too_long_answered_with_a_500_is_the_clients_400(c, stream):
    message = "This model's maximum context length is 8192 tokens. However, you requested 9000 tokens."
    for s in c.sims["union"]:
        s.set_faults(
            fail_status=500,
            fail_body=json.dumps(
                {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 500}}
            ),
        )
    code, headers, text = call(c, chat_body(UNION, stream))
    assert code == 400 and openai_error(text) == {
        "message": message,
        "type": "invalid_request_error",
        "param": None,
        "code": 400,
    }
    assert len(attempts(c.sims["union"])) == 1  # not retried: no engine would take that prompt
    assert "x-should-retry" not in headers
    assert_recovered(c, UNION, stream)


def test_an_engine_error_in_another_shape_reaches_the_client_in_its_apis(c):
    for s in c.sims["union"]:
        s.set_faults(fail_status=404, fail_body='{"detail":"Not Found"}')  # FastAPI's own 404
    code, _, text = call(c, chat_body(UNION, False))
    assert code == 404 and openai_error(text) == {
        "message": "Not Found",
        "type": "invalid_request_error",
        "param": None,
        "code": 404,
    }
    client = anthropic.Anthropic(base_url=c.url, api_key="x", max_retries=0, timeout=30)
    with pytest.raises(anthropic.NotFoundError) as exc:
        client.messages.create(model=UNION, max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert exc.value.body["error"] == {"type": "not_found_error", "message": "Not Found"}
    # An older vLLM's error object, its message at the top level.
    for s in c.sims["union"]:
        s.set_faults(
            fail_status=400,
            fail_body='{"object":"error","message":"bad temperature","type":"BadRequestError","param":null,"code":400}',
        )
    code, _, text = call(c, chat_body(UNION, False))
    assert code == 400 and openai_error(text)["message"] == "bad temperature"
    # FastAPI's validation errors: a list of them.
    for s in c.sims["union"]:
        s.set_faults(
            fail_status=422,
            fail_body='{"detail":[{"loc":["body","n"],"msg":"Input should be a valid integer","type":"int_parsing"}]}',
        )
    code, _, text = call(c, chat_body(UNION, False))
    assert code == 422 and openai_error(text)["message"] == "Input should be a valid integer"
    # An Anthropic-shaped error whose type is not a name.
    for s in c.sims["union"]:
        s.set_faults(fail_status=400, fail_body='{"type":"error","error":{"type":["odd"],"message":"m"}}')
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(model=UNION, max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert exc.value.body["error"] == {"type": "invalid_request_error", "message": "m"}
    assert_recovered(c, UNION, False)


def test_an_engine_redirect_is_a_bad_gateway(c):
    for s in c.sims["union"]:
        s.set_faults(fail_status=307)
    code, _, text = call(c, chat_body(UNION, False))
    assert code == 502 and openai_error(text)["code"] == "upstream_error"
    assert len(attempts(c.sims["union"])) == 1
    assert_recovered(c, UNION, False)


# -- client disconnects, in every phase --------------------------------------------------------------


class RawClient:
    """One request on a raw socket, so the test decides exactly when the client goes away."""

    def __init__(self, c, path: str, body: dict):
        self.rid = "dc-" + uuid.uuid4().hex[:12]
        data = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {c.host}:{c.infer_port}\r\nContent-Type: application/json\r\n"
            f"X-Request-Id: {self.rid}\r\nContent-Length: {len(data)}\r\n\r\n"
        )
        self.sock = socket.create_connection((c.host, c.infer_port), timeout=10)
        self.sock.sendall(head.encode() + data)
        self.received = b""

    def read_until(self, marker: bytes) -> None:
        while marker not in self.received:
            chunk = self.sock.recv(65536)
            assert chunk, f"connection closed before {marker!r}: {self.received!r}"
            self.received += chunk

    def close(self) -> None:
        self.sock.close()


def body_for(api: str, model: str, stream: bool, max_tokens: int, content: str) -> tuple[str, dict]:
    if api == "anthropic":
        body = {
            "model": model,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": content}],
            "ignore_eos": True,
        }
        if stream:
            body["stream"] = True
        return "/v1/messages", body
    return "/v1/chat/completions", chat_body(model, stream, max_tokens=max_tokens, content=content)


def assert_aborted(sims, rid: str) -> None:
    """The engines recorded the abort of this request (a late disconnect may also abort a retry of it)."""
    assert wait_until(lambda: total(sims, "aborted") >= 1)
    ids = [i for s in sims for i in s.stats()["aborted_request_ids"]]
    assert ids[0] == rid and all(i.startswith(rid) for i in ids), ids


def running(sims) -> int:
    return sum(s.stats()["running"] for s in sims)


@pytest.mark.parametrize("api", ["openai", "anthropic"])
@STREAM
@pytest.mark.parametrize("phase", ["union", "prefill", "between", "decode"])
def test_client_disconnect_aborts_engine_requests(c, phase, stream, api):
    P, D, U = c.sims["prefill"], c.sims["decode"], c.sims["union"]
    model = UNION if phase == "union" else PD
    # 5000 prompt tokens take 2 s on the slow prefill engines; 2000 output tokens take 4 s.
    # A unique start defeats the engines' prefix cache, which would make the second long prefill instant.
    content = uuid.uuid4().hex + (" word" * 4000 if phase == "prefill" else " hello")
    if phase == "between":
        for s in D:
            s.set_faults(hang_before_first_byte=True)
    path, body = body_for(api, model, stream, 2000, content)
    client = RawClient(c, path, body)
    if phase in ("union", "decode") and stream:
        client.read_until(b"data:")
    elif phase in ("union", "decode"):
        assert wait_until(lambda: running(U if phase == "union" else D) == 1)
    elif phase == "prefill":
        # Received, not running: P may still be finishing the step of a request an earlier case aborted.
        assert wait_until(lambda: len(attempts(P)) == 1)
    elif phase == "between":
        assert wait_until(lambda: len(attempts(D)) == 1)
        assert total(P, "held_kv_tickets") == 1
    client.close()

    if phase == "union":
        assert_aborted(U, client.rid)
    elif phase == "prefill":
        assert_aborted(P, client.rid)
        time.sleep(0.2)
        assert not attempts(D)  # the decode leg never started
    elif phase == "between":  # D never pulled: P's held KV is released at once, not after its timeout
        assert wait_until(lambda: total(P, "kv_released") == 1)
        assert total(P, "held_kv_tickets") == 0
    else:
        assert_aborted(D, client.rid)
        assert total(P, "kv_pulled") == 1
    assert wait_until(lambda: ledger_is_zero(c), 5), ledger(c)
    assert_recovered(c, model, stream)


class FloodEngine(http.server.ThreadingHTTPServer):
    """An engine that streams SSE events as fast as the connection takes them, until it breaks (or 30 s)."""

    daemon_threads = True

    def __init__(self):
        self.hung_up = threading.Event()  # the stream's connection broke: the request was aborted
        super().__init__(("127.0.0.1", 0), FloodHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


class FloodHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:  # /health
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        event = b'data: {"choices":[{"index":0,"delta":{"content":"%s"}}]}\n\n' % (b"x" * 4000)
        chunk = b"%x\r\n%s\r\n" % (len(event) * 16, event * 16)
        deadline = time.monotonic() + 30
        try:
            while time.monotonic() < deadline:
                self.wfile.write(chunk)
        except OSError:
            self.server.hung_up.set()


def test_a_client_that_stops_reading_is_dropped_when_its_buffer_is_full():
    """A client that opens a stream and stops reading held its engine request and capacity until it left;
    now its connection is dropped once `max_stream_buffer_size` bytes wait for it (an engine that writes
    without end fills any buffer), and the engine request with it."""
    engine = FloodEngine()
    cfg = coordinator_config(
        [instance(1, "union", MODEL, f"127.0.0.1:{engine.server_address[1]}")],
        exception_config={"stream_idle_timeout": 3, "max_stream_buffer_size": 1 << 20},
    )
    try:
        with Coordinator(cfg) as coord:
            body = json.dumps(
                {"model": MODEL, "messages": [{"role": "user", "content": "flood"}], "stream": True}
            ).encode()
            with socket.create_connection(("127.0.0.1", coord.infer_port)) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                s.sendall(
                    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n" % len(body) + body
                )
                started = time.monotonic()
                assert s.recv(64).startswith(b"HTTP/1.1 200")  # then it reads nothing more
                assert engine.hung_up.wait(15)  # while the client is still connected
                assert time.monotonic() - started < 10
            assert wait_until(lambda: "max_stream_buffer_size (1048576)" in coord.output())
            assert wait_until(lambda: "status=499" in coord.output())
    finally:
        engine.shutdown()


def test_disconnects_are_counted_by_phase(c):
    before = _disconnects(c)
    client = RawClient(c, *body_for("openai", UNION, True, 2000, "count me"))
    client.read_until(b"data:")
    client.close()
    assert wait_until(lambda: _disconnects(c).get("streaming", 0) == before.get("streaming", 0) + 1)


@pytest.mark.parametrize("api", ["openai", "anthropic"])
@pytest.mark.parametrize("model", [UNION, PD])
def test_a_client_that_leaves_at_its_streams_end_was_answered(c, model, api):
    """The client's stream ends with the engine's last event ([DONE], message_stop), not with the end of the
    engine's body, which may come later (here 5 s later). A client that closes once it has the end (the SDKs
    do) had its whole answer: status 200, no disconnect counted, and the engine's share given back at once."""
    for s in c.sims["union" if model == UNION else "decode"]:
        s.set_faults(linger_after_end_s=5)
    before = _disconnects(c)
    client = RawClient(c, *body_for(api, model, True, 4, "leave at the end"))
    client.read_until(b"data: [DONE]\n\n" if api == "openai" else b"event: message_stop\n")
    client.read_until(b"\r\n0\r\n\r\n")  # the chunked body's end, while the engine's is still open
    assert wait_until(lambda: ledger_is_zero(c), timeout_s=2.5), ledger(c)
    client.close()
    assert wait_until(lambda: f"request_id={client.rid} " in c.output())
    line = next(ln for ln in c.output().splitlines() if f"request_id={client.rid} " in ln and "status=" in ln)
    assert " status=200 " in line and "error=" not in line, line
    assert _disconnects(c) == before
    assert_recovered(c, model, True)


def _missed_handoffs(c) -> float:
    prefix = f'motor_missed_handoffs_total{{model="{PD}"}} '
    lines = [line for line in httpx.get(c.obs + "/metrics").text.splitlines() if line.startswith(prefix)]
    return float(lines[0][len(prefix) :]) if lines else 0.0


def _disconnects(c) -> dict:
    return by_label(c, "motor_client_disconnects_total", "phase")


def test_a_huge_max_tokens_takes_a_bounded_budget_in_the_ledger(c):
    """The shared ledger counts in int64: a client's max_tokens of 10**30 once wrapped round in it and misled
    every worker's scheduling while the request lived. Its budget there is bounded (beyond any context)."""
    for s in c.sims["union"]:
        s.set_faults(slow_first_byte_s=1.0)
    answer = []
    t = threading.Thread(target=lambda: answer.append(call(c, {**chat_body(UNION, False), "max_tokens": 10**30})))
    t.start()
    try:
        assert wait_until(lambda: any(load["inflight_requests"] for load in ledger(c)), 5)
        decode_tokens = [load["inflight_decode_tokens"] for load in ledger(c)]
        assert 0 < max(decode_tokens) <= MAX_OUTPUT_BUDGET, decode_tokens
    finally:
        t.join(30)
    assert answer and answer[0][0] == 400  # the engine's own refusal, relayed
    assert_recovered(c, UNION, False)
