"""The management port: Kubernetes probes, GET /instances and live refresh (set, add, del, pause, resume).

Most tests share one two-worker Coordinator in front of three union engines; an autouse fixture puts the
instance set back to engines 1 and 2 before each test. Requests go out on fresh connections (one httpx
call each), so both workers serve them; the per-request log lines name the worker's process id.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from harness import ROOT
from harness.bodies import chat_body, sse_events
from harness.clients import openai_client
from harness.configs import coordinator_config, instance
from harness.coordinator import Coordinator, logged_request_pids as worker_pids
from harness.loopback import wait_until
from harness.metrics import by_label
from tests.conftest import MODEL

WORKERS = 2
BASELINE = (1, 2)
LONG_STREAM_TOKENS = 400  # 10 ms per token at speedup 2: about 2 s


@pytest.fixture(scope="module")
def cluster(module_sims):
    engines = {i: module_sims("union", speedup=2.0) for i in (1, 2, 3)}
    cfg = coordinator_config(
        [instance(i, "union", MODEL, engines[i].address) for i in BASELINE],
        inference_workers_config={"num_workers": WORKERS},
    )
    with Coordinator(cfg) as coord:
        coord.engines = engines
        coord.definitions = {i: instance(i, "union", MODEL, e.address) for i, e in engines.items()}
        yield coord


@pytest.fixture(autouse=True)
def baseline(request):
    if "cluster" not in request.fixturenames:
        yield
        return
    coord = request.getfixturevalue("cluster")
    assert coord.refresh("set", [coord.definitions[i] for i in BASELINE]).status_code == 200
    assert coord.refresh("resume", list(BASELINE)).status_code == 200
    for e in coord.engines.values():
        e.clear_faults()
        e.reset()
    yield


# One client for the requests of this module: a fresh connection each time (no keep-alive), so both workers
# serve them, but not a new SSL context each time (about 0.3 s of a loaded machine's time).
HTTP = httpx.Client(timeout=30, limits=httpx.Limits(max_keepalive_connections=0))


def chat(coord, max_tokens: int = 2, **extra) -> httpx.Response:
    body = chat_body(MODEL, max_tokens=max_tokens, **extra)
    return HTTP.post(coord.url + "/v1/chat/completions", json=body)


def received(coord) -> dict[int, int]:
    return {i: e.stats()["received"] for i, e in coord.engines.items()}


def instances(coord) -> dict[int, dict]:
    r = httpx.get(coord.mgmt + "/instances")
    assert r.status_code == 200
    return {i["id"]: i for i in r.json()["instances"]}


def version(coord) -> int:
    return httpx.get(coord.mgmt + "/instances").json()["version"]


# -- probes ------------------------------------------------------------------------------------------


def test_probes_answer_ok_and_carry_a_request_id(cluster):
    for path, message in (("/startup", "started"), ("/liveness", "alive")):
        r = httpx.get(cluster.mgmt + path)
        assert r.status_code == 200
        assert r.json() == {"status": "ok", "message": message}
        assert r.headers["x-request-id"]
    r = httpx.get(cluster.mgmt + "/readiness", headers={"X-Request-Id": "probe-7"})
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ok" and body["ready"] is True and body["message"]
    assert r.headers["x-request-id"] == "probe-7"


def readiness(coord) -> dict:
    r = httpx.get(coord.mgmt + "/readiness")
    assert r.status_code == 200  # not ready is still an answer: the port is up for /instances/refresh
    body = r.json()
    assert body["status"] == "ok" and body["message"]
    return body


def test_readiness_is_false_while_no_instance_can_take_a_request(cluster):
    assert readiness(cluster)["ready"] is True
    assert cluster.refresh("pause", list(BASELINE)).status_code == 200
    assert readiness(cluster)["ready"] is False
    assert cluster.refresh("resume", [2]).status_code == 200
    assert readiness(cluster)["ready"] is True

    assert cluster.refresh("set", []).status_code == 200
    body = readiness(cluster)
    assert body["ready"] is False and "0 instances" in body["message"]

    # Registered but unhealthy: nothing listens at the address, the health check finds out.
    assert cluster.refresh("add", [instance(9, "union", MODEL, "127.0.0.1:9")]).status_code == 200
    assert wait_until(lambda: instances(cluster)[9]["healthy"] is False)
    assert readiness(cluster)["ready"] is False
    assert cluster.refresh("add", [cluster.definitions[1]]).status_code == 200
    assert readiness(cluster)["ready"] is True


INFER_ROUTES = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("POST", "/v1/metaserver"),
    ("GET", "/v1/models"),
    ("GET", "/docs"),
    ("GET", "/docs/openapi.json"),
    ("GET", "/docs/redoc"),
]
MGMT_ROUTES = [
    ("GET", "/startup"),
    ("GET", "/liveness"),
    ("GET", "/readiness"),
    ("GET", "/instances"),
    ("POST", "/instances/refresh"),
]
OBS_ROUTES = [("GET", "/health"), ("GET", "/metrics")]


def test_every_route_is_served_on_its_own_port_only(cluster):
    ports = {"infer": cluster.url, "mgmt": cluster.mgmt, "obs": cluster.obs}
    planes = {"infer": INFER_ROUTES, "mgmt": MGMT_ROUTES, "obs": OBS_ROUTES}
    counted_400 = requests_counted(cluster, "400")
    answered_400 = 0
    for plane, routes in planes.items():
        for method, path in routes:
            for port_plane, base in ports.items():
                # An empty JSON object: inference routes answer 400 on their own port, never 404.
                r = httpx.request(method, base + path, json={} if method == "POST" else None)
                if port_plane == plane:
                    assert r.status_code != 404, (method, path, port_plane)
                    answered_400 += plane == "infer" and method == "POST" and r.status_code == 400
                else:
                    assert r.status_code == 404, (method, path, port_plane)
                    assert "on this port" in r.json()["error"]["message"]
                    assert r.headers["x-request-id"]
    # Nothing reached an engine: the inference routes on their own port had invalid bodies.
    assert sum(received(cluster).values()) == 0
    # Requests refused for the port are not inference requests: no 404 in the request metrics. Each worker
    # writes its counts within 50 ms of a request, later on a loaded machine: wait until the 400s are counted.
    assert answered_400 > 0
    assert wait_until(lambda: requests_counted(cluster, "400") >= counted_400 + answered_400, timeout_s=15)
    assert requests_counted(cluster, "404") == 0


def requests_counted(coord, status: str) -> float:
    """The sum of motor_requests_total over every route and model, for one status."""
    lines = [
        line for line in httpx.get(coord.obs + "/metrics").text.splitlines() if line.startswith("motor_requests_total{")
    ]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if f'status="{status}"' in line)


GUARD_CHECK = """
import json
from sanic import HTTPResponse
import app as app_module
from config import Settings
from handlers import check_guarded

app = app_module.create_app(Settings())
app.finalize_middleware()
bare = sorted(r.path.strip("/") for r in app.router.routes if not r.extra.request_middleware and not r.extra.response_middleware)
check_guarded(app)  # the app as made starts
app.get("/late")(lambda request: HTTPResponse(b""))
app.finalize_middleware()
try:
    check_guarded(app)
    late = "started"
except RuntimeError as e:
    late = str(e)
print(json.dumps({"bare": bare, "late": late}))
"""


def test_only_the_self_guarded_routes_run_without_middleware_and_a_new_route_without_a_guard_stops_start_up(tmp_path):
    """The inference routes and the status page's document (polled every second) skip middleware: each checks its
    plane itself (and the inference routes the key); any other route without a guard stops the start."""
    # In a process of its own: importing app.py sets the metrics directory for the process (here, one of the test's).
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", GUARD_CHECK], capture_output=True, text=True, timeout=60, cwd=ROOT, env=env
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bare"] == [
        "detokenize",
        "status.json",
        "tokenize",
        "v1/chat/completions",
        "v1/completions",
        "v1/messages",
        "v1/messages/count_tokens",
        "v1/metaserver",
        "v1/responses",
    ]
    assert "late" in result["late"] and "no plane guard" in result["late"]


# -- GET /instances ----------------------------------------------------------------------------------


def test_instances_show_role_model_endpoints_health_breaker_and_load(cluster):
    insts = instances(cluster)
    assert set(insts) == set(BASELINE)
    one = insts[1]
    assert (one["role"], one["model_name"], one["paused"], one["healthy"], one["schedulable"]) == (
        "union",
        MODEL,
        False,
        True,
        True,
    )
    (ep,) = one["endpoints"]
    assert ep["address"] == cluster.engines[1].address and ep["id"] == 0
    assert ep["healthy"] is True and ep["breaker"] == "closed"
    assert set(ep["load"]) >= {
        "inflight_requests",
        "inflight_prompt_tokens",
        "inflight_decode_tokens",
        "engine_running",
        "engine_waiting",
        "engine_kv_cache_usage",
    }
    assert ep["load"]["inflight_requests"] == 0


def test_instances_show_the_load_of_a_request_in_flight(cluster):
    cluster.refresh("pause", [2])
    with httpx.stream(
        "POST",
        cluster.url + "/v1/chat/completions",
        timeout=30,
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": LONG_STREAM_TOKENS,
            "stream": True,
            "ignore_eos": True,
        },
    ) as r:
        lines = r.iter_lines()  # kept: a dropped iterator closes the stream
        next(lines)
        load = instances(cluster)[1]["endpoints"][0]["load"]
        assert load["inflight_requests"] == 1 and load["inflight_decode_tokens"] > 0
        # The engine's own gauge arrives with the next scrape.
        assert wait_until(lambda: instances(cluster)[1]["endpoints"][0]["load"]["engine_running"] >= 1)
    assert wait_until(lambda: instances(cluster)[1]["endpoints"][0]["load"]["inflight_requests"] == 0)


def test_instances_show_the_decode_engines_learned_cap_once_it_was_full_twice(sims):
    """A decode engine that runs 2 sequences at most (max_num_seqs) while more wait: /instances and /metrics show
    the cap the scrapes learned, nothing for the prefill engine or before it was full, and nothing again once the
    engine fails its health check."""
    p, d = sims("prefill", speedup=10.0), sims("decode", speedup=10.0, max_num_seqs=2)
    cfg = coordinator_config([instance(1, "prefill", MODEL, p.address), instance(2, "decode", MODEL, d.address)])

    def caps(coord) -> dict[int, object]:
        return {i: e["endpoints"][0]["load"]["engine_seq_cap"] for i, e in instances(coord).items()}

    def stream() -> None:
        body = chat_body(MODEL, max_tokens=300, ignore_eos=True, stream=True)
        with httpx.stream("POST", coord.url + "/v1/chat/completions", json=body, timeout=60) as r:
            r.read()

    with Coordinator(cfg) as coord:
        assert caps(coord) == {1: None, 2: None}
        threads = [threading.Thread(target=stream) for _ in range(6)]
        for t in threads:
            t.start()
        try:
            assert wait_until(lambda: caps(coord)[2] == 2, timeout_s=20)
            assert caps(coord)[1] is None
            assert by_label(coord, "motor_engine_seq_cap", "instance") == {"1": 0.0, "2": 2.0}
        finally:
            for t in threads:
                t.join(60)
        # An engine that fails its health check may come back restarted with another max_num_seqs.
        d.set_faults(health_status=503)
        assert wait_until(lambda: caps(coord)[2] is None, timeout_s=10)


# -- POST /instances/refresh -------------------------------------------------------------------------


def test_refresh_events_reply_in_motor_shape(cluster):
    d = cluster.definitions
    r = cluster.refresh("add", [d[3]])
    assert r.status_code == 200
    body = r.json()
    assert body["request_id"] == "refresh_request" and body["status"] == "success" and body["message"]
    assert body["data"] == {"event_type": "add", "instance_count": 1}
    assert set(instances(cluster)) == {1, 2, 3}

    r = cluster.refresh("del", [{"id": 3}, 2])
    assert r.status_code == 200 and r.json()["data"] == {"event_type": "del", "instance_count": 2}
    assert set(instances(cluster)) == {1}

    r = cluster.refresh("set", [d[2], d[3]])
    assert r.status_code == 200 and r.json()["data"] == {"event_type": "set", "instance_count": 2}
    assert set(instances(cluster)) == {2, 3}


def test_add_of_a_registered_identical_instance_is_idempotent(cluster):
    before = instances(cluster)
    for _ in range(2):
        r = cluster.refresh("add", [cluster.definitions[1]])
        assert r.status_code == 200 and r.json()["status"] == "success"
    assert instances(cluster) == before


def test_set_keeps_the_pause_state_of_instances_it_keeps(cluster):
    cluster.refresh("pause", [1])
    cluster.refresh("set", [cluster.definitions[1], cluster.definitions[3]])
    insts = instances(cluster)
    assert insts[1]["paused"] is True and insts[3]["paused"] is False


def test_set_replaces_an_instance_whose_endpoints_moved(cluster):
    """A controller re-sends the whole set after instance 2's pod moved (engine 3's address now): 2 is
    replaced, its traffic goes to the new address, and its old engine gets nothing more."""
    d = cluster.definitions
    moved = {**d[2], "endpoints": d[3]["endpoints"]}
    r = cluster.refresh("set", [d[1], moved])
    assert r.status_code == 200 and "1 replaced" in r.json()["message"], r.text
    insts = instances(cluster)
    assert set(insts) == {1, 2} and insts[2]["endpoints"][0]["address"] == cluster.engines[3].address
    before = received(cluster)
    for _ in range(8):
        assert chat(cluster).status_code == 200
    after = received(cluster)
    assert after[2] == before[2] and after[3] > before[3] and after[1] > before[1]
    assert cluster.refresh("add", [d[2]]).status_code == 409  # add never replaces


REFUSED = [
    pytest.param(b"{not json", 400, "not valid JSON", id="malformed-json"),
    pytest.param(b"[1, 2]", 400, "JSON object", id="not-an-object"),
    pytest.param({"event": "replace", "instances": []}, 400, "event", id="unknown-event"),
    pytest.param({"event": "set"}, 400, "instances", id="no-instances"),
    pytest.param(
        {"event": "add", "instances": [{"id": 9, "model_name": MODEL, "endpoints": [{"address": "127.0.0.1:9"}]}]},
        400,
        "instances[0].role",
        id="missing-role",
    ),
    pytest.param(
        {
            "event": "add",
            "instances": [{"id": 9, "role": "union", "model_name": MODEL, "endpoints": [{"address": "nohost"}]}],
        },
        400,
        "instances[0].endpoints[0].address",
        id="bad-address",
    ),
    pytest.param({"event": "pause", "instances": ["one"]}, 400, "instances[0]", id="bad-id"),
    pytest.param(
        {
            "event": "add",
            "instances": [
                {
                    "id": 9,
                    "role": "union",
                    "model_name": MODEL,
                    "endpoints": [{"id": 0, "address": "127.0.0.1:9"}, {"id": 0, "address": "127.0.0.1:8"}],
                }
            ],
        },
        400,
        "instances[0].endpoints[1].id: duplicate endpoint id 0",
        id="duplicate-endpoint-ids",
    ),
    pytest.param("duplicate", 400, "duplicate", id="duplicate-ids"),
    pytest.param("other-role", 409, "different role", id="id-reused-other-role"),
    pytest.param(
        "other-endpoints", 409, "different role, model or endpoints", id="id-added-again-with-other-endpoints"
    ),
    pytest.param("address-taken", 409, "registered twice", id="address-of-another-instance"),
    pytest.param({"event": "pause", "instances": [42]}, 404, "42", id="pause-unknown"),
    # Ids are kept in 64-bit slots: 2^64 + 50 would be instance 50 there.
    pytest.param(
        {"event": "set", "instances": [instance(2**64 + 50, "union", MODEL, "127.0.0.1:9")]},
        400,
        f"instances[0].id: must be 0..{2**63 - 1}",
        id="id-over-2^63",
    ),
    pytest.param(
        {"event": "add", "instances": [instance(-1, "union", MODEL, "127.0.0.1:9")]},
        400,
        "instances[0].id: must be 0..",
        id="negative-id",
    ),
    pytest.param(
        {
            "event": "add",
            "instances": [
                {"id": 9, "role": "union", "model_name": MODEL, "endpoints": [{"id": 2**63, "address": "127.0.0.1:9"}]}
            ],
        },
        400,
        "instances[0].endpoints[0].id: must be 0..",
        id="endpoint-id-over-2^63",
    ),
    pytest.param(
        {"event": "pause", "instances": [1, 2**64 + 1]},
        400,
        "instances[1]: must be an instance id",
        id="pause-id-over-2^63",
    ),
    pytest.param(
        {"event": "set", "instances": [instance(9, "prefill", MODEL, "127.0.0.1:9", engine_type="sglang")]},
        400,
        "instances[0].engine_type: a prefill instance must be vllm",
        id="sglang-prefill",
    ),
    pytest.param(
        {"event": "add", "instances": [instance(9, "decode", MODEL, "127.0.0.1:9", engine_type="mindie")]},
        400,
        "instances[0].engine_type: a decode instance must be vllm",
        id="mindie-decode",
    ),
]


@pytest.mark.parametrize("body,status,words", REFUSED)
def test_refresh_refusals_change_nothing(cluster, body, status, words):
    d = cluster.definitions
    special = {
        "duplicate": {"event": "add", "instances": [d[3], {**d[3]}]},
        "other-role": {"event": "add", "instances": [{**d[1], "role": "prefill"}]},
        "other-endpoints": {
            "event": "add",
            "instances": [{**d[1], "endpoints": [{"id": 0, "address": "127.0.0.1:1"}]}],
        },
        "address-taken": {"event": "add", "instances": [{**d[3], "endpoints": d[1]["endpoints"]}]},
    }
    body = special.get(body, body) if isinstance(body, str) else body
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    before = version(cluster)
    r = httpx.post(cluster.mgmt + "/instances/refresh", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == status
    reply = r.json()
    assert reply["request_id"] == "refresh_request" and reply["status"] == "failed"
    assert words in reply["message"]
    assert version(cluster) == before and set(instances(cluster)) == set(BASELINE)


def test_the_largest_ids_serve_and_a_stored_response_is_found_on_its_instance(cluster):
    """Instance and endpoint id 2^63-1 fit the shared tables: GET /v1/responses/{id} goes back to it."""
    big = 2**63 - 1
    inst = {**cluster.definitions[3], "id": big, "endpoints": [{**cluster.definitions[3]["endpoints"][0], "id": big}]}
    assert cluster.refresh("set", [inst]).status_code == 200
    (shown,) = instances(cluster).values()
    assert shown["id"] == big and shown["endpoints"][0]["id"] == big
    sdk = openai_client(cluster)
    r = sdk.responses.create(model=MODEL, input="keep this", max_output_tokens=2)
    assert sdk.responses.retrieve(r.id).output_text == r.output_text  # the one engine holding it was asked


def test_a_union_instance_of_another_engine_type_serves_whole_requests(cluster):
    """sglang's and MindIE's PD protocols are not spoken here, but a union instance of them takes whole requests."""
    assert cluster.refresh("set", [{**cluster.definitions[3], "engine_type": "sglang"}]).status_code == 200
    reply = openai_client(cluster).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert reply.choices[0].message.content
    (served,) = [q for q in cluster.engines[3].requests() if q["path"] == "/v1/chat/completions"]
    assert "kv_transfer_params" not in served["body"]


def test_refresh_body_over_10_mib_is_413(cluster):
    padding = "x" * (10 * 1024 * 1024)
    r = httpx.post(
        cluster.mgmt + "/instances/refresh", json={"event": "add", "instances": [], "pad": padding}, timeout=30
    )
    assert r.status_code == 413
    assert r.json()["status"] == "failed"
    assert set(instances(cluster)) == set(BASELINE)


def test_set_reroutes_every_worker_at_once(cluster):
    # Both workers serve requests on the old set...
    mark = len(cluster.output())
    for _ in range(16):
        assert chat(cluster).status_code == 200
    assert wait_until(lambda: len(worker_pids(cluster, mark)) == WORKERS)
    old = received(cluster)
    assert old[1] + old[2] == 16 and old[3] == 0
    # ...and right after the refresh answers, not one request reaches the engines it removed.
    assert cluster.refresh("set", [cluster.definitions[3]]).status_code == 200
    mark = len(cluster.output())
    for _ in range(24):
        assert chat(cluster).status_code == 200
    assert wait_until(lambda: len(worker_pids(cluster, mark)) == WORKERS)
    now = received(cluster)
    assert (now[1], now[2]) == (old[1], old[2])
    assert now[3] == 24


def _long_stream(coord, out: dict, tokens: int = LONG_STREAM_TOKENS) -> None:
    body = chat_body(MODEL, True, tokens, "long", ignore_eos=True)
    with httpx.stream("POST", coord.url + "/v1/chat/completions", json=body, timeout=60) as r:
        out["status"] = r.status_code
        out["events"] = sse_events(r.read())


def test_paused_instance_finishes_its_stream_takes_nothing_new_and_resumes(cluster):
    a, b = cluster.engines[1], cluster.engines[2]
    cluster.refresh("pause", [2])
    out: dict = {}
    # Twice the usual stream: it must outlast two refreshes and ten requests, which took 2.8 s of its 5 s on a
    # loaded machine (and longer than the whole stream with a new client, SSL context and all, per request).
    tokens = 2 * LONG_STREAM_TOKENS
    stream = threading.Thread(target=_long_stream, args=(cluster, out, tokens))
    stream.start()
    try:
        assert wait_until(lambda: a.stats()["running"] == 1, timeout_s=10)
        # Drain engine 1 (the first step of its rolling restart) and bring engine 2 back.
        assert cluster.refresh("pause", [1]).status_code == 200
        assert cluster.refresh("resume", [2]).status_code == 200
        insts = instances(cluster)
        assert (
            insts[1]["paused"]
            and not insts[1]["schedulable"]
            and insts[1]["endpoints"][0]["load"]["inflight_requests"] == 1
        )
        for _ in range(10):
            assert chat(cluster).status_code == 200
        assert a.stats()["received"] == 1 and b.stats()["received"] == 10
        assert a.stats()["running"] == 1  # still streaming while the others went elsewhere
    finally:
        stream.join(60)
    assert out["status"] == 200 and out["events"][-1] == "[DONE]"
    chunks = [json.loads(e) for e in out["events"][:-1]]
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")) == tokens
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert a.stats()["aborted"] == 0

    assert cluster.refresh("resume", [1]).status_code == 200
    for _ in range(10):
        assert chat(cluster).status_code == 200
    assert a.stats()["received"] > 1  # back in the rotation


def test_pausing_every_instance_of_a_model_is_503_until_resumed(cluster):
    cluster.refresh("pause", list(BASELINE))
    r = chat(cluster)
    assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
    assert sum(received(cluster).values()) == 0
    cluster.refresh("resume", [2])
    assert chat(cluster).status_code == 200


# -- management key ----------------------------------------------------------------------------------


def test_management_key_protects_instances_but_never_the_probes(sims):
    u = sims("union")
    cfg = coordinator_config(
        [instance(1, "union", MODEL, u.address)],
        mgmt_api_key_config={"enable_api_key": True, "valid_keys": ["m-key"]},
    )
    with Coordinator(cfg) as coord:
        for path in ("/startup", "/liveness", "/readiness"):
            assert httpx.get(coord.mgmt + path).status_code == 200
        body = {"event": "del", "instances": [1]}
        for headers in (
            {},
            {"X-Motor-Management-Key": "wrong"},
            {"X-Motor-Management-Key": "m-ke"},
            {"Authorization": "Bearer m-key"},
            {"X-Motor-Management-Key": "m-k\xe9y".encode("latin-1")},
        ):
            r = httpx.get(coord.mgmt + "/instances", headers=headers)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            r = httpx.post(coord.mgmt + "/instances/refresh", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["status"] == "failed"
            assert r.headers["www-authenticate"] == "Bearer"
        good = {"X-Motor-Management-Key": "m-key"}
        assert [i["id"] for i in httpx.get(coord.mgmt + "/instances", headers=good).json()["instances"]] == [1]
        assert httpx.post(coord.mgmt + "/instances/refresh", json=body, headers=good).status_code == 200
        assert httpx.get(coord.mgmt + "/instances", headers=good).json()["instances"] == []


# -- probes through start-up and shutdown ------------------------------------------------------------


def _poll(url: str, stop: threading.Event, seen: list) -> None:
    while not stop.is_set():
        try:
            r = httpx.get(url, timeout=2)
            seen.append((r.status_code, r.json()))
        except httpx.TransportError:
            seen.append(None)
        time.sleep(0.02)


def test_probes_during_start_up_answer_ok_from_their_first_answer(sims):
    u = sims("union")
    cfg = coordinator_config([instance(1, "union", MODEL, u.address)])
    mgmt = f"http://127.0.0.1:{cfg['api_config']['coordinator_api_mgmt_port']}"
    stop = threading.Event()
    seen = {p: [] for p in ("/startup", "/liveness", "/readiness")}
    pollers = [threading.Thread(target=_poll, args=(mgmt + p, stop, seen[p])) for p in seen]
    for t in pollers:
        t.start()
    try:
        with Coordinator(cfg):
            assert wait_until(lambda: all(any(s for s in v) for v in seen.values()))
            stop.set()  # before the stop: a drain's 503 is not start-up's
            for t in pollers:
                t.join()
    finally:
        stop.set()
        for t in pollers:
            t.join()
    for path, answers in seen.items():
        answered = [a for a in answers if a is not None]
        assert answered, path
        # Not listening yet is a refused connection; once it answers, it answers 200 (never a 5xx).
        assert all(status == 200 and body["status"] == "ok" for status, body in answered), (path, answered[:3])
    assert all(body["ready"] is True for _, body in (a for a in seen["/readiness"] if a is not None))


def test_probes_while_draining_say_not_ready_but_alive(sims):
    u = sims("union", speedup=2.0)
    cfg = coordinator_config(
        [instance(1, "union", MODEL, u.address)],
        shutdown_config={"drain_timeout": 30},
        inference_workers_config={"num_workers": WORKERS},
    )
    coord = Coordinator(cfg)
    out: dict = {}
    stream = threading.Thread(target=_long_stream, args=(coord, out))
    try:
        # A SIGTERM is drained only by workers that finished starting (sanic #2997): wait until each served one.
        mark = len(coord.output())
        assert wait_until(
            lambda: chat(coord).status_code == 200 and len(worker_pids(coord, mark)) == WORKERS, timeout_s=20
        )
        assert coord.every_worker_started()
        stream.start()
        assert wait_until(lambda: u.stats()["running"] == 1, timeout_s=10)
        coord.proc.send_signal(signal.SIGTERM)
        readiness, liveness = [], []

        failed: list[str] = []

        def drained() -> bool:
            try:
                readiness.append(httpx.get(coord.mgmt + "/readiness", timeout=2))
                liveness.append(httpx.get(coord.mgmt + "/liveness", timeout=2))
            except httpx.TransportError as e:
                failed.append(repr(e))
            return bool(readiness) and readiness[-1].status_code == 503

        # (what the probes got, and the Coordinator's last words, for a run where draining never showed)
        assert wait_until(drained, timeout_s=10), (
            [r.status_code for r in readiness],
            failed[-3:],
            coord.output()[-3000:],
        )
        assert readiness[-1].json()["ready"] is False
        assert liveness[-1].status_code == 200 and liveness[-1].json()["status"] == "ok"
        assert u.stats()["running"] == 1  # the stream is still being served
        # New requests are refused while the stream already in flight finishes.
        r = chat(coord)
        assert r.status_code == 503
        stream.join(60)
        assert out["status"] == 200 and out["events"][-1] == "[DONE]"
        assert coord.proc.wait(30) == 0
    finally:
        stream.join(60)
        coord.stop()
