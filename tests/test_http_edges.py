"""Inputs at the edges of JSON and HTTP: each is a clear 4xx in the route's API shape, never a 500, and the
Coordinator keeps serving (and logging) afterwards."""

from __future__ import annotations

import json

import httpx
import pytest

from harness import bodies
from harness.configs import coordinator_config, instance
from harness.coordinator import Coordinator
from harness.loopback import wait_until
from tests.conftest import MODEL
from tests.raw_http import exchange

JSON = {"content-type": "application/json"}


def raw(port: int, data: bytes, timeout_s: float = 3.0) -> bytes:
    """What the Coordinator answers to these bytes, read until it closes or goes quiet."""
    return exchange(port, data, timeout_s)[0]


def chat_body(content: str = "hi", model: str = MODEL) -> bytes:
    return json.dumps(bodies.chat_body(model, max_tokens=4, content=content)).encode()


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/messages"])
def test_a_lone_surrogate_through_the_pd_legs_is_the_engines_400(pd_cluster, route):
    # JSON may carry "\ud83d" (half an emoji); it has no UTF-8 form, so the legs' bodies are written escaped.
    r = httpx.post(pd_cluster.url + route, content=chat_body("cut emoji \ud83d"), headers=JSON, timeout=30)
    assert r.status_code == 400, r.text
    assert "surrogates not allowed" in r.text  # the engine's own verdict, relayed
    assert "internal error" not in r.text


@pytest.mark.parametrize("route,shape", [("/v1/chat/completions", "error"), ("/v1/messages", "type")])
def test_a_lone_surrogate_in_an_error_message_and_the_log_line(union_cluster, route, shape):
    r = httpx.post(union_cluster.url + route, content=chat_body(model="no-such-\ud800"), headers=JSON, timeout=30)
    assert r.status_code == 404, r.text
    assert shape in r.json()
    assert r.json()["error"]["message"] == "The model `no-such-\ud800` does not exist."
    rid = r.headers["x-request-id"]
    # The request line is written (with the surrogate escaped), and the batch it was in is not lost.
    ok = httpx.post(union_cluster.url + "/v1/chat/completions", content=chat_body(), headers=JSON, timeout=30)
    assert ok.status_code == 200
    assert wait_until(
        lambda: f"request_id={rid} " in union_cluster.output() and ok.headers["x-request-id"] in union_cluster.output()
    )
    assert 'model="no-such-\\ud800"' in union_cluster.output()
    assert "UnicodeEncodeError" not in union_cluster.output()


@pytest.mark.parametrize(
    "route,body",
    [
        ("/v1/completions", '{"model":"%s","max_tokens":4,"prompt":%s"a"%s}' % (MODEL, "[" * 990, "]" * 990)),
        (
            "/v1/chat/completions",
            '{"model":"%s","max_tokens":4,"messages":[{"role":"user","content":"hi"}],'
            '"tools":[{"type":"function","function":{"name":"f","parameters":%s1%s}}]}'
            % (MODEL, "[" * 1000, "]" * 1000),
        ),
        (
            "/v1/messages",
            '{"model":"%s","max_tokens":4,"messages":[{"role":"user","content":[%s]}]}'
            % (
                MODEL,
                '{"type":"tool_result","tool_use_id":"t","content":[' * 480 + '{"type":"text","text":"x"}' + "]}" * 480,
            ),
        ),
    ],
    ids=["completions-prompt", "chat-tools", "messages-tool-result"],
)
def test_a_body_nested_near_jsons_limit_is_a_400(union_cluster, route, body):
    r = httpx.post(union_cluster.url + route, content=body.encode(), headers=JSON, timeout=30)
    assert r.status_code == 400, r.text[:300]
    assert "nested too deeply" in r.text
    assert (
        httpx.post(
            union_cluster.url + "/v1/chat/completions", content=chat_body(), headers=JSON, timeout=30
        ).status_code
        == 200
    )


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/messages"])
def test_a_wrong_method_is_a_405_that_says_what_is_allowed(union_cluster, route):
    r = httpx.get(union_cluster.url + route, timeout=10)
    assert r.status_code == 405
    assert r.headers["allow"] == "POST"
    assert ("type" in r.json()) == (route == "/v1/messages")


def test_oversized_request_headers_are_a_431(union_cluster):
    answer = raw(
        union_cluster.infer_port,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        + b"".join(b"H%d: v\r\n" % i for i in range(2000))
        + b"\r\n",
    )
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 ")
    assert json.loads(body)["error"]["code"] == "request_header_fields_too_large"


def test_expect_continue_over_the_limit_gets_the_413_without_a_100(sims):
    u = sims("union")
    cfg = coordinator_config(
        [instance(1, "union", MODEL, u.address)], rate_limit_config={"max_request_body_size": 1024}
    )
    with Coordinator(cfg) as c:
        answer = raw(
            c.infer_port,
            b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Expect: 100-continue\r\nContent-Length: 5000\r\n\r\n",
        )
        assert answer.startswith(b"HTTP/1.1 413 "), answer[:100]
        assert b"100 Continue" not in answer
        assert b"connection: close" in answer.lower()
        # Within the limit, the 100 comes and the request is served.
        body = chat_body()
        answer = raw(
            c.infer_port,
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Expect: 100-continue\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body,
        )
        assert answer.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 "), answer[:100]
