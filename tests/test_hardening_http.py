"""What an outside probe found at the HTTP edge (issue 26): slow clients, connection floods, ambiguous framing, and
small leaks. Raw sockets on loopback where the bytes matter; every loop is bounded."""

from __future__ import annotations

import json
import select
import socket
import ssl
import time

import httpx
import pytest

from harness.configs import coordinator_config, instance
from harness.coordinator import Coordinator
from harness.loopback import wait_until
from tests.conftest import MODEL
from tests.raw_http import connect, exchange, read_until_closed, statuses

KEY, MGMT_KEY = "sk-edge", "mgmt-edge"
HEAD_S, BODY_S = 2.0, 2.0  # the deadlines under test; Sanic's timer looks every half of the shorter
SLACK_S = 1.0 + 1.5  # that timer's period, and a loaded machine
AUTH = {"authorization": f"Bearer {KEY}"}
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def edge(module_sims):
    u = module_sims("union")
    cfg = coordinator_config(
        [instance(1, "union", MODEL, u.address)],
        inference_workers_config={"num_workers": 1, "request_head_timeout": HEAD_S, "request_body_timeout": BODY_S},
        api_key_config={"enable_api_key": True, "valid_keys": [KEY]},
        mgmt_api_key_config={"enable_api_key": True, "valid_keys": [MGMT_KEY]},
    )
    with Coordinator(cfg) as coord:
        yield coord


def trickle(s: socket.socket, data: bytes, every_s: float = 0.5) -> tuple[bytes, float]:
    """Send `data` a byte every `every_s` until the server answers or closes: what it sent, and when (seconds
    from the first byte) it closed. Bounded by len(data)."""
    start = time.monotonic()
    s.settimeout(every_s)
    for byte in data:
        try:
            s.send(bytes([byte]))
            chunk = s.recv(65536)
        except TimeoutError:
            continue
        except OSError:  # reset: closed
            return b"", time.monotonic() - start
        rest, closed = read_until_closed(s, 3.0)
        assert closed, "the server answered but kept the connection open"
        return chunk + rest, time.monotonic() - start
    raise AssertionError(f"still open after {time.monotonic() - start:.1f} s of trickling")


def error_lines(coord: Coordinator) -> list[str]:
    return [line for line in coord.output().splitlines() if " ERROR" in line or "Traceback" in line]


# -- slow clients ------------------------------------------------------------------------------------------


def test_a_head_sent_a_byte_at_a_time_is_cut_at_its_deadline(edge):
    """Sanic's REQUEST_TIMEOUT restarted on every byte: one header byte a second kept a connection forever."""
    head = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"x" * 60
    with connect(edge.infer_port) as s:
        answer, closed_after = trickle(s, head)
    assert statuses(answer) == [b"408"], answer
    assert HEAD_S - 0.3 < closed_after < HEAD_S + SLACK_S, closed_after
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"
    assert not error_lines(edge)


def test_many_slow_heads_are_all_cut(edge):
    """300 slow connections were all still open after 60 s. Here 20 at once, each a byte every half second."""
    socks = [connect(edge.mgmt_port if i % 2 else edge.infer_port) for i in range(20)]
    start = time.monotonic()
    open_socks = dict.fromkeys(socks, 0)
    head = b"GET /liveness HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"x" * 60
    try:
        while open_socks and time.monotonic() - start < HEAD_S + SLACK_S + 2:
            for s, sent in list(open_socks.items()):
                try:
                    s.send(head[sent : sent + 1])
                    open_socks[s] = sent + 1
                except OSError:
                    del open_socks[s]
            readable, _, _ = select.select(list(open_socks), [], [], 0.5)
            for s in readable:
                if s in open_socks:
                    _, closed = read_until_closed(s, 2.0)
                    assert closed
                    del open_socks[s]
        assert not open_socks, f"{len(open_socks)} of 20 still open after {time.monotonic() - start:.1f} s"
        assert time.monotonic() - start < HEAD_S + SLACK_S + 1
    finally:
        for s in socks:
            s.close()


@pytest.mark.parametrize(
    "route,headers,code",
    [
        ("/v1/chat/completions", b"Authorization: Bearer %s\r\n" % KEY.encode(), "request_timeout"),
        ("/v1/messages", b"x-api-key: %s\r\n" % KEY.encode(), "timeout_error"),
    ],
)
def test_a_body_sent_a_byte_at_a_time_is_a_408_at_its_deadline(edge, route, headers, code):
    """Only RESPONSE_TIMEOUT (hours) bounded a body's time. The route answers it, in its API's shape."""
    body = json.dumps({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x" * 200}]})
    with connect(edge.infer_port) as s:
        s.sendall(
            b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n"
            % (route.encode(), headers, len(body))
        )
        answer, closed_after = trickle(s, body.encode())
    assert statuses(answer) == [b"408"], answer
    assert b"connection: close" in answer.lower()
    assert closed_after < BODY_S + SLACK_S, closed_after
    err = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
    assert code in (err.get("code"), err.get("type")), err
    rid = dict(line.split(b": ", 1) for line in answer.partition(b"\r\n\r\n")[0].split(b"\r\n")[1:])[
        b"X-Request-Id"
    ].decode()
    assert wait_until(lambda: f"request_id={rid} " in edge.output())
    [line] = [line for line in edge.output().splitlines() if f"request_id={rid} " in line]
    assert " status=408 " in line, line  # the log line says what the client got, not a disconnect
    assert not error_lines(edge)


def test_an_unread_body_trickled_after_the_answer_is_cut_too(edge):
    """A GET route ignores its body and Sanic reads it away after the answer: under the body's deadline."""
    with connect(edge.infer_port) as s:
        s.sendall(
            b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\nContent-Length: 100\r\n\r\n"
            % KEY.encode()
        )
        assert statuses(s.recv(65536)) == [b"200"]  # at once: the route does not wait for the body
        rest, closed_after = trickle(s, b"y" * 100)
    assert rest == b"" and closed_after < BODY_S + SLACK_S, (rest, closed_after)
    assert not error_lines(edge)


# -- connections per worker -------------------------------------------------------------------------------


def test_connections_past_the_cap_get_a_503_and_are_closed(sims):
    cap = 3
    u = sims("union")
    cfg = coordinator_config(
        [instance(1, "union", MODEL, u.address)],
        inference_workers_config={"num_workers": 1, "max_connections_per_worker": cap},
    )
    with Coordinator(cfg) as c:
        get = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
        held = [connect(c.infer_port) for _ in range(cap)]
        try:
            for s in held:  # each is served, and stays open (keep-alive)
                s.sendall(get)
                assert s.recv(65536).startswith(b"HTTP/1.1 200 ")
            answer, closed, _ = exchange(c.infer_port, get)
            assert closed and statuses(answer) == [b"503"], answer
            head, _, body = answer.partition(b"\r\n\r\n")
            assert b"Connection: close" in head and b"Retry-After: 1" in head
            assert json.loads(body)["error"]["code"] == "service_unavailable"
            # The management port counts its own: its probes still answer.
            assert httpx.get(c.mgmt + "/liveness", timeout=5).status_code == 200
            held.pop().close()
            assert wait_until(lambda: statuses(exchange(c.infer_port, get, timeout_s=1)[0]) == [b"200"])
        finally:
            for s in held:
                s.close()
        assert "refused with 503" in c.output()
        assert not error_lines(c)


# -- framing ----------------------------------------------------------------------------------------------

HIDDEN = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n\r\n" % KEY.encode()


@pytest.mark.parametrize(
    "fields",
    [
        b"Transfer-Encoding : chunked\r\nContent-Length: 0\r\n",  # the probe's: Sanic read no framing from the first
        b"Transfer-Encoding\t: chunked\r\nContent-Length: 0\r\n",
        b"Content-Length : 0\r\n",
        b"X-Pad: a\r\n Transfer-Encoding: chunked\r\nContent-Length: 0\r\n",  # obs-fold
        b"X-Pad: a\r\n\tchunked\r\nContent-Length: 0\r\n",  # obs-fold without a colon
        b": no-name\r\nContent-Length: 0\r\n",
    ],
    ids=["space-before-colon", "tab-before-colon", "length-space", "obs-fold-field", "obs-fold-value", "empty-name"],
)
def test_a_malformed_header_field_is_a_400_that_closes_the_connection(edge, fields):
    """The 400 kept the connection, and the GET hidden in the body was answered 200 as the next request."""
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer %s\r\n%s\r\n" % (KEY.encode(), fields)
    )
    answer, closed, _ = exchange(edge.infer_port, request + HIDDEN)
    assert statuses(answer) == [b"400"], answer  # the hidden request is never answered
    assert closed and b"connection: close" in answer.lower()
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["type"] == "invalid_request_error"


CHAT = json.dumps({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "smuggled"}]}).encode()
SMUGGLED_CHAT = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer %s\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (KEY.encode(), len(CHAT), CHAT)
)
# A field that hides another, and fields with a lone CR or a NUL. A proxy in front that splits lines at LF reads
# `Content-Length` in the first, so to it the request after the head is that request's body.
FAULTS = {
    "bare-lf": b"X-Foo: a\nContent-Length: %d\r\n" % len(SMUGGLED_CHAT),
    "bare-cr": b"X-Foo: a\rContent-Length: %d\r\n" % len(SMUGGLED_CHAT),
    "nul-in-value": b"X-Foo: a\0b\r\n",
    "nul-in-name": b"X-F\0oo: a\r\n",
}


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize(
    "port,path", [("infer_port", b"/v1/models"), ("mgmt_port", b"/liveness"), ("obs_port", b"/metrics")]
)
def test_a_bare_cr_lf_or_nul_in_a_head_is_a_400_and_what_follows_is_not_served(edge, module_sims, port, path, fault):
    """`X-Foo: a<LF>Content-Length: 61` was one header to Sanic: it answered the GET and then served the bytes
    after it as a second request, which reached the engine."""
    (engine,) = module_sims.handles
    received = engine.stats()["received"]
    head = b"GET %s HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n%s\r\n" % (path, KEY.encode(), FAULTS[fault])
    answer, closed, _ = exchange(getattr(edge, port), head + SMUGGLED_CHAT)
    assert statuses(answer) == [b"400"], answer  # one answer: the smuggled request is never read
    assert closed and b"connection: close" in answer.lower()
    err = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
    assert err["type"] == "invalid_request_error" and "CR or LF" in err["message"], err
    assert engine.stats()["received"] == received


def test_a_bare_lf_on_an_anthropic_route_is_refused_in_its_envelope(edge):
    head = (
        b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nx-api-key: %s\r\nContent-Type: application/json\r\n"
        b"X-Foo: a\nContent-Length: %d\r\n\r\n" % (KEY.encode(), len(SMUGGLED_CHAT))
    )
    answer, closed, _ = exchange(edge.infer_port, head + SMUGGLED_CHAT)
    assert statuses(answer) == [b"400"] and closed, answer
    body = json.loads(answer.partition(b"\r\n\r\n")[2])
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body


def test_a_well_formed_pipeline_is_still_answered_in_order(edge):
    answer, _, _ = exchange(
        edge.infer_port, HIDDEN + HIDDEN.replace(b"/v1/models", b"/v1/models/" + MODEL.encode()), 1.0
    )
    assert statuses(answer) == [b"200", b"200"], answer


def client_hello() -> bytes:
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname="localhost")
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


@pytest.mark.parametrize("port", ["infer_port", "mgmt_port"])
@pytest.mark.parametrize("what", ["tls-client-hello", "bare-lf"])
def test_what_cannot_be_http_is_a_prompt_400(edge, port, what):
    """A TLS ClientHello on a plain port, or a request line ending in a bare LF, waited for the timeout."""
    data = client_hello() if what == "tls-client-hello" else b"GET /liveness HTTP/1.1\nHost: x\n\n"
    assert data[0] == 0x16 or what == "bare-lf"
    answer, closed, took = exchange(getattr(edge, port), data)
    assert statuses(answer) == [b"400"], answer
    assert closed and took < HEAD_S / 2, took  # not the head's deadline


# -- smaller ones -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "route,headers,extra",
    [("/v1/chat/completions", AUTH, {}), ("/v1/messages", {"x-api-key": KEY}, {"max_tokens": 4})],
)
def test_a_huge_model_name_is_not_echoed_whole(edge, route, headers, extra):
    model = "m" * 100_000
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}
    r = httpx.post(edge.url + route, json=body, headers=headers, timeout=10)
    assert r.status_code == 404
    assert len(r.content) < 1000 and "[99744 more characters]" in r.text, r.text[:300]
    rid = r.headers["x-request-id"]
    assert wait_until(lambda: f"request_id={rid} " in edge.output())
    [line] = [line for line in edge.output().splitlines() if f"request_id={rid} " in line]
    assert len(line) < 2000, len(line)


def test_a_get_with_a_body_writes_no_error_line(edge):
    """Sanic logged `body not consumed` at ERROR for any 2xx GET that carried a body."""
    for url, headers in (
        (edge.mgmt + "/liveness", {}),
        (edge.mgmt + "/readiness", {}),
        (edge.obs + "/metrics", {}),
        (edge.url + "/v1/models", AUTH),
        (edge.url + "/v1/models", {}),
        (edge.mgmt + "/instances", {"X-Motor-Management-Key": MGMT_KEY}),
    ):
        r = httpx.request("GET", url, content=b"x" * 10, headers=headers, timeout=10)
        assert r.status_code in (200, 401), (url, r.status_code)
    time.sleep(0.5)
    assert not error_lines(edge), error_lines(edge)


def test_a_refresh_that_is_not_json_is_a_415(sims):
    """A browser posts text/plain or a form to any origin without asking (no preflight): with the management key
    off, any web page could have changed the instance set."""
    u = sims("union")
    with Coordinator(coordinator_config([instance(1, "union", MODEL, u.address)])) as c:
        body = json.dumps({"event": "set", "instances": []}).encode()
        for content_type in (None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
            headers = {"content-type": content_type} if content_type else {}
            r = httpx.post(c.mgmt + "/instances/refresh", content=body, headers=headers, timeout=10)
            assert r.status_code == 415, (content_type, r.text)
            assert r.json() == {
                "request_id": "refresh_request",
                "status": "failed",
                "message": "Content-Type must be application/json",
                "data": {"event_type": None},
            }
        assert len(httpx.get(c.mgmt + "/instances", timeout=10).json()["instances"]) == 1  # unchanged
        r = httpx.post(
            c.mgmt + "/instances/refresh", content=body, headers={"content-type": "application/json; charset=utf-8"}
        )
        assert r.status_code == 200, r.text
        assert httpx.get(c.mgmt + "/instances", timeout=10).json()["instances"] == []


def test_a_huge_integer_is_a_400_that_names_no_interpreter_setting(edge):
    huge = "1" + "0" * 5000
    chat = '{"model":"%s","max_tokens":%s,"messages":[{"role":"user","content":"hi"}]}' % (MODEL, huge)
    for url, headers in (
        (edge.url + "/v1/chat/completions", AUTH),
        (edge.url + "/v1/messages", {"x-api-key": KEY}),
        (edge.mgmt + "/instances/refresh", {"X-Motor-Management-Key": MGMT_KEY}),
    ):
        r = httpx.post(url, content=chat.encode(), headers={**JSON, **headers}, timeout=10)
        assert r.status_code == 400, r.text
        assert "an integer has more than 4300 digits" in r.text
        assert "set_int_max_str_digits" not in r.text


def test_every_401_names_its_scheme(edge):
    for method, url, headers in (
        ("POST", edge.url + "/v1/chat/completions", {}),
        ("POST", edge.url + "/v1/messages", {"x-api-key": "wrong"}),
        ("GET", edge.url + "/v1/models", {"authorization": "Bearer wrong"}),
        ("GET", edge.mgmt + "/instances", {}),
        ("POST", edge.mgmt + "/instances/refresh", {"X-Motor-Management-Key": "wrong"}),
    ):
        r = httpx.request(method, url, json={}, headers=headers, timeout=10)
        assert r.status_code == 401, (url, r.text)
        assert r.headers["www-authenticate"] == "Bearer", url
