"""Limits and instance health across workers: in-flight cap, rate limit, body size, breaker, active health
check; and graceful shutdown (drain window) on SIGTERM.

Two-worker Coordinators throughout, because every limit must hold for the whole Coordinator, not per
worker. Connections are not reused between requests, so the kernel spreads them over both workers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import threading
import time

import httpx
import pytest

from config import Live, Settings
from harness.bodies import chat_body, sse_events
from harness.configs import coordinator_config, instance
from harness.coordinator import Coordinator
from harness.loopback import free_port, wait_until
from serving.door import Door
from state.shared import SharedState

MODEL, FLAKY, GONE = "lim", "lim-flaky", "lim-gone"
CAP = 4
OPEN_S = 3.0


def chat(model: str, max_tokens: int = 4, content: str = "hi", **extra) -> dict:
    return chat_body(model, max_tokens=max_tokens, content=content, **extra)


def post(c, body: dict, **kw) -> httpx.Response:
    # A fresh connection per request: the kernel picks the worker.
    with httpx.Client(timeout=30) as client:
        return client.post(c.url + "/v1/chat/completions", json=body, **kw)


def endpoints(c) -> dict[str, dict]:
    doc = httpx.get(c.mgmt + "/instances", timeout=5).json()
    return {ep["address"]: ep for inst in doc["instances"] for ep in inst["endpoints"]}


def breaker_metric(c, instance_id: str) -> float:
    for line in httpx.get(c.obs + "/metrics").text.splitlines():
        if line.startswith("motor_instance_breaker_state{") and f'instance="{instance_id}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no breaker metric for instance {instance_id}")


@pytest.fixture(scope="module")
def cluster(module_sims):
    u = module_sims("union", model=MODEL, speedup=5)
    good, bad = module_sims("union", model=FLAKY, speedup=5), module_sims("union", model=FLAKY, speedup=5)
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    cfg = coordinator_config(
        [
            instance(1, "union", MODEL, u.address),
            instance(2, "union", FLAKY, good.address),
            instance(3, "union", FLAKY, bad.address),
            instance(4, "union", GONE, dead),
        ],
        inference_workers_config={"num_workers": 2},
        rate_limit_config={"max_inflight_requests": CAP, "max_request_body_size": 64 * 1024},
        scheduler_config={"breaker_failure_threshold": 2, "breaker_open_time": OPEN_S, "health_check_interval": 0.2},
        exception_config={"retry_delay": 0.01, "max_retry": 1, "connect_timeout": 1.0},
    )
    with Coordinator(cfg) as coord:
        coord.u, coord.good, coord.bad, coord.dead = u, good, bad, dead
        yield coord


@pytest.fixture
def c(cluster):
    for s in (cluster.u, cluster.good, cluster.bad):
        s.clear_faults()
        s.reset()
    return cluster


def test_rate_limit_bucket_survives_a_stamp_ahead_of_the_clock():
    """Tokens refill with elapsed time; a stamp later than now (a clock stepped back) must not drain the
    bucket for as long as the step (it refused every request for a minute after an NTP correction)."""
    admission = Door(Live(dataclasses.replace(Settings(), requests_per_second=20.0)), SharedState.create())
    assert [admission._take_rate_token() == 0.0 for _ in range(21)] == [True] * 20 + [False]  # a burst of 20
    time.sleep(0.1)
    assert admission._take_rate_token() == 0.0  # refilled at 20 a second
    admission.shared.globals.rate_stamp_us = 2**52  # far ahead of any clock
    admission._take_rate_token()
    assert admission.shared.globals.rate_tokens_milli >= 0  # no negative time, no debt
    time.sleep(0.1)
    assert admission._take_rate_token() == 0.0


@pytest.mark.parametrize("rate, expected", [(5.0, 5 + 3 * 5), (1.0, 1 + 3 * 1), (20.0, 20 + 3 * 20)])
def test_rate_limit_refills_at_its_rate_however_often_it_is_asked(rate, expected):
    """Callers asking every 0.1 ms (10 000 a second, a busy Coordinator) for 3 s get the burst plus 3 s of
    refill. Each call's refill is a fraction of a milli-token here: the bucket once dropped it and moved its
    stamp to now anyway, so nothing refilled and only the burst was admitted. The clock is driven."""
    now = [1000.0]
    admission = Door(
        Live(dataclasses.replace(Settings(), requests_per_second=rate)), SharedState.create(), clock=lambda: now[0]
    )
    admitted = 0
    for _ in range(30_000):
        admitted += admission._take_rate_token() == 0.0
        now[0] += 0.0001
    assert expected - 1 <= admitted <= expected


def test_the_drain_waits_for_an_engines_metaserver_call_which_takes_no_place():
    """In trigger mode an engine's metaserver call may reach a worker with no client request of its own: that
    worker's drain must not stop it (it is half of a request another worker holds), nor count it in flight."""

    async def main() -> None:
        admission = Door(Live(Settings()), SharedState.create())
        release = asyncio.Event()

        async def metaserver_call() -> None:
            with admission.attend():
                await release.wait()

        call = asyncio.create_task(metaserver_call())
        await asyncio.sleep(0)
        assert admission.inflight() == 0
        drain = asyncio.create_task(admission.drain(5.0))
        await asyncio.sleep(0.3)
        assert not drain.done() and not call.done()  # the drain waits for it
        release.set()
        await asyncio.wait_for(drain, 2.0)
        assert call.done() and not call.cancelled() and admission.local == set()

    asyncio.run(main())


def test_inflight_cap_holds_across_workers(c):
    n = 2 * CAP
    results: list[httpx.Response] = []
    peak = [0]
    start = threading.Barrier(n + 1)
    # Made before the barrier: a new client's SSL context took about 0.3 s of a loaded machine, one thread
    # after another, which spread the requests over longer than an admitted one holds its place.
    clients = [httpx.Client(timeout=30) for _ in range(n)]

    def one(i: int):
        start.wait()
        # 1000 tokens at 2 ms per step: each admitted request holds its place for about 2 s.
        results.append(
            clients[i].post(c.url + "/v1/chat/completions", json=chat(MODEL, 1000, f"cap {i}", ignore_eos=True))
        )

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    try:
        start.wait()
        while any(t.is_alive() for t in threads):
            peak[0] = max(peak[0], c.u.stats()["running"])
            time.sleep(0.02)
    finally:
        for t in threads:
            t.join(60)
        for client in clients:
            client.close()
    ok = [r for r in results if r.status_code == 200]
    refused = [r for r in results if r.status_code == 429]
    assert len(ok) == CAP and len(refused) == n - CAP  # one cap for both workers, not one each
    assert peak[0] <= CAP and c.u.stats()["received"] == CAP
    for r in refused:
        assert r.json()["error"]["code"] == "rate_limit_exceeded" and "in flight" in r.json()["error"]["message"]
        assert int(r.headers["retry-after"]) >= 1
    assert post(c, chat(MODEL)).status_code == 200  # the cap frees up as requests end


def test_body_over_the_limit_is_refused_before_it_reaches_an_engine(c):
    for size in (200 * 1024, 12 * 1024 * 1024):  # over the configured limit; over Sanic's own too
        r = post(c, chat(MODEL, content="x" * size))
        assert r.status_code == 413
        assert r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(
        c.url + "/v1/messages",
        json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x" * 200_000}]},
    )
    assert r.status_code == 413 and r.json()["type"] == "error" and r.json()["error"]["type"] == "request_too_large"
    assert c.u.stats()["received"] == 0
    assert post(c, chat(MODEL)).status_code == 200


def test_host_header_cannot_move_a_route_to_another_port(c):
    r = httpx.get(c.url + "/instances", headers={"Host": f"127.0.0.1:{c.mgmt_port}"})
    assert r.status_code == 404
    r = httpx.post(c.mgmt + "/v1/chat/completions", json=chat(MODEL), headers={"Host": f"127.0.0.1:{c.infer_port}"})
    assert r.status_code == 404
    assert c.u.stats()["received"] == 0


def test_breaker_opens_on_5xx_stops_traffic_in_every_worker_and_recovers(c):
    c.bad.set_faults(fail_status=500)
    bad = endpoints(c)[c.bad.address]
    assert bad["breaker"] == "closed"
    # Every request succeeds (a failure on `bad` is retried on `good`) until the breaker opens.
    while endpoints(c)[c.bad.address]["breaker"] != "open":
        opened_after = time.monotonic()
        assert post(c, chat(FLAKY)).status_code == 200
        assert c.bad.stats()["received"] <= 2  # threshold 2: opened by the second failure
    seen = c.bad.stats()["received"]
    assert breaker_metric(c, "3") == 1.0  # 1 = open
    for _ in range(10):  # new connections, spread over both workers
        assert post(c, chat(FLAKY)).status_code == 200
    # Nothing but the half-open probes: one per open period at most (each fails and reopens the breaker).
    probes = int((time.monotonic() - opened_after) / OPEN_S)
    assert c.bad.stats()["received"] - seen <= probes

    c.bad.clear_faults()  # the engine recovers: after the open time one probe closes the breaker
    assert wait_until(
        lambda: post(c, chat(FLAKY)).status_code == 200 and endpoints(c)[c.bad.address]["breaker"] == "closed",
        3 * OPEN_S,
    )
    assert breaker_metric(c, "3") == 0.0
    before = c.bad.stats()["completed"]
    for _ in range(6):
        assert post(c, chat(FLAKY)).status_code == 200
    assert c.bad.stats()["completed"] > before  # back in rotation


def test_one_request_retried_on_its_only_engine_is_one_failure_to_its_breaker(c):
    """A request the engine fails every time (a poison input, say) must not open the breaker for everyone
    else by its retries alone: threshold 2, and this request tries the only engine twice."""
    c.u.set_faults(fail_status=500)
    assert post(c, chat(MODEL)).status_code >= 500
    assert c.u.stats()["received"] == 2
    c.u.clear_faults()
    assert endpoints(c)[c.u.address]["breaker"] == "closed"
    assert post(c, chat(MODEL)).status_code == 200


def test_client_errors_never_open_the_breaker(c):
    for s in (c.good, c.bad):
        s.set_faults(fail_status=400)
    for _ in range(6):
        assert post(c, chat(FLAKY)).status_code == 400
    for s in (c.good, c.bad):  # vLLM's answer to what it does not implement: the request's, every time
        s.set_faults(fail_status=501)
    for _ in range(6):
        assert post(c, chat(FLAKY)).status_code == 501
    # A prompt longer than the engine's context: vLLM's prompt-too-long answer.
    for s in (c.good, c.bad):
        s.clear_faults()
    for _ in range(4):
        r = post(c, chat(FLAKY, content="long " * 8000))
        assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    states = {addr: ep["breaker"] for addr, ep in endpoints(c).items() if addr in (c.good.address, c.bad.address)}
    assert set(states.values()) == {"closed"}
    assert c.good.stats()["received"] + c.bad.stats()["received"] == 16  # never retried either


def test_active_health_check_takes_an_instance_out_and_back(c):
    c.bad.set_faults(health_status=503)
    assert wait_until(lambda: not endpoints(c)[c.bad.address]["healthy"])
    before = c.bad.stats()["received"]
    for _ in range(6):
        assert post(c, chat(FLAKY)).status_code == 200
    assert c.bad.stats()["received"] == before
    c.bad.clear_faults()
    assert wait_until(lambda: endpoints(c)[c.bad.address]["healthy"])


def test_one_late_health_check_keeps_the_instance_a_run_of_them_takes_it_out(c):
    """A check times out after max(1 s, health_check_interval) = 1 s here. One late answer (a busy engine) must
    not take the instance out; `health_check_timeout_failures` (3) in a row do, and a pass brings it back."""
    c.bad.set_faults(slow_health_s=30)
    # Each timed-out check takes a 1 s timeout plus a 0.2 s interval: within 1.5 s at most two have ended.
    time.sleep(1.5)
    assert endpoints(c)[c.bad.address]["healthy"]
    assert wait_until(lambda: not endpoints(c)[c.bad.address]["healthy"], timeout_s=20)
    c.bad.clear_faults()
    assert wait_until(lambda: endpoints(c)[c.bad.address]["healthy"])


def test_health_check_verdict_per_kind_of_failure():
    """The check itself, in one process, against real sockets: a refused connection is out at the first
    check; a check that times out stays in until its third in a row, whether the engine accepted and answers
    late, never finishes a TLS handshake (its loop is busy), or the connection itself is not accepted in time
    (a full accept queue drops the SYN, as a lossy network does: the retransmit comes a second later)."""
    import asyncio
    import socket

    from engines import EngineClient
    from scheduling.health import Health
    from scheduling.registry import Target
    from serving.background import Background
    from state.shared import SharedState

    blackhole = socket.socket()
    blackhole.bind(("127.0.0.1", 0))
    blackhole.listen(0)
    filler = socket.create_connection(blackhole.getsockname())  # the one queued connection: later SYNs drop
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts (the kernel does) and never answers
    refused = free_port()
    addresses = {
        "blackhole": "http://127.0.0.1:%d" % blackhole.getsockname()[1],
        "silent": "http://127.0.0.1:%d" % silent.getsockname()[1],
        "silent TLS": "https://127.0.0.1:%d" % silent.getsockname()[1],  # connected; the handshake waits
        "refused": f"http://127.0.0.1:{refused}",
        "unusable address": "http://::1:8000",  # IPv6 without brackets: no port can be read from it
    }

    async def verdicts() -> dict[str, list[bool]]:
        settings = Live(Settings(health_check_interval_s=0.2, health_check_timeout_failures=3))
        shared = SharedState.create()
        health = Health(shared)
        client = EngineClient(settings)
        background = Background(settings, None, health, client)
        out: dict[str, list[bool]] = {}
        try:
            for slot, (name, url) in enumerate(addresses.items()):
                target = Target(slot, 0, slot, "union", "m", "vllm", url, url.split("//")[1], False)
                health.set_healthy(slot, True)
                out[name] = []
                for _ in range(3):
                    await background._check(target)
                    out[name].append(health.is_healthy(slot))
        finally:
            await client.close()
        return out

    try:
        assert asyncio.run(verdicts()) == {
            "blackhole": [True, True, False],
            "silent": [True, True, False],
            "silent TLS": [True, True, False],
            "refused": [False, False, False],
            "unusable address": [False, False, False],
        }
    finally:
        for sock in (filler, blackhole, silent):
            sock.close()


def test_a_health_check_that_fails_for_another_reason_marks_the_endpoint_unhealthy():
    """Not every failure is an engine's: a check the engine client cannot make at all (here: the worker is
    stopping and the client is closed) must not leave the endpoint looking healthy."""
    import asyncio

    from engines import EngineClient
    from scheduling.health import Health
    from scheduling.registry import Target
    from serving.background import Background
    from state.shared import SharedState

    async def verdict() -> bool:
        settings = Live(Settings(health_check_interval_s=0.2))
        health = Health(SharedState.create())
        client = EngineClient(settings)
        await client.close()
        url = f"http://127.0.0.1:{free_port()}"
        health.set_healthy(0, True)
        await Background(settings, None, health, client)._check(
            Target(0, 0, 0, "union", "m", "vllm", url, url[7:], False)
        )
        return health.is_healthy(0)

    assert asyncio.run(verdict()) is False


def test_unreachable_instance_answers_fast_with_an_error(c):
    assert wait_until(lambda: not endpoints(c)[c.dead]["healthy"])
    r = post(c, chat(GONE))
    assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
    # The SDKs wait this long before their retry: until a breaker half-opens (breaker_open_time).
    assert r.headers["retry-after"] == "%d" % OPEN_S


# -- rate limit and graceful shutdown (a second Coordinator, stopped by the last test) ---------------------

RPS = 4.0


@pytest.fixture(scope="module")
def limited(module_sims):
    """Rate-limited, two workers, a short drain window. `test_sigterm_drains...` ends it, so it runs last."""
    u = module_sims("union", model=MODEL, speedup=5)
    cfg = coordinator_config(
        [instance(1, "union", MODEL, u.address)],
        inference_workers_config={"num_workers": 2},
        rate_limit_config={"requests_per_second": RPS},
        shutdown_config={"drain_timeout": 2.0},
    )
    with Coordinator(cfg) as coord:
        coord.u = u
        yield coord


def test_rate_limit_holds_across_workers(limited):
    # All at once, each on a connection of its own: one after the other they came slower than the rate on a
    # loaded machine (0.45 s a request), and then every one was rightly admitted.
    n = 30
    clients = [httpx.Client(timeout=30) for _ in range(n)]  # made before the clock starts (an SSL context each)
    responses: list[httpx.Response | None] = [None] * n
    start = threading.Barrier(n + 1)

    def one(i: int) -> None:
        start.wait()
        responses[i] = clients[i].post(limited.url + "/v1/chat/completions", json=chat(MODEL, 1, f"rate {i}"))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    try:
        started = time.monotonic()  # before the barrier lets any request go: `elapsed` is never short
        start.wait()
        for t in threads:
            t.join(60)
        elapsed = time.monotonic() - started
    finally:
        for client in clients:
            client.close()
    statuses = [r.status_code for r in responses if r is not None]
    refused = [r for r in responses if r is not None and r.status_code == 429]
    admitted = statuses.count(200)
    assert admitted + len(refused) == n, statuses
    # One bucket for the whole Coordinator: the burst plus what refilled meanwhile (per-worker buckets would
    # admit twice that).
    assert 1 <= admitted <= RPS + RPS * elapsed + 1, (admitted, elapsed)
    assert refused, "requests beyond the rate must be refused"
    for r in refused:
        assert r.json()["error"]["code"] == "rate_limit_exceeded" and int(r.headers["retry-after"]) >= 1
    assert limited.u.stats()["received"] == admitted


def test_sigterm_drains_in_flight_streams_then_ends_the_rest(limited):
    time.sleep(1.0)  # the rate limit's bucket refills for the two streams
    u = limited.u
    u.reset()
    out: dict[str, str] = {}
    first: dict[str, threading.Event] = {"short": threading.Event(), "long": threading.Event()}

    def stream(name: str, max_tokens: int):
        body = chat(MODEL, max_tokens, name, ignore_eos=True, stream=True)
        with httpx.stream("POST", limited.url + "/v1/chat/completions", json=body, timeout=30) as r:
            text = ""
            for chunk in r.iter_text():
                text += chunk
                first[name].set()
        out[name] = text

    # At 2 ms per token: the short stream ends inside the 2 s drain window, the long one (6 s) does not.
    threads = [threading.Thread(target=stream, args=a) for a in (("short", 150), ("long", 3000))]
    for t in threads:
        t.start()
    assert all(e.wait(10) for e in first.values())
    limited.proc.send_signal(signal.SIGTERM)

    def not_ready() -> bool:
        try:
            r = httpx.get(limited.mgmt + "/readiness", timeout=1)
            return r.status_code != 200 or r.json().get("ready") is False
        except httpx.HTTPError:
            return True  # the management port stopped listening: not ready either

    assert wait_until(not_ready, 2)
    try:  # new work is refused while the in-flight streams drain
        r = post(limited, chat(MODEL))
        assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
        # The retry comes back on a new connection (which a Service sends to a pod still serving).
        assert r.headers["connection"] == "close" and r.headers["retry-after"] == "1"
    except httpx.ConnectError:
        pass
    for t in threads:
        t.join(20)
    short, long = sse_events(out["short"]), sse_events(out["long"])
    assert short[-1] == "[DONE]"  # finished inside the window
    assert long[-1] != "[DONE]" and json.loads(long[-1])["error"]["code"] == "service_unavailable"
    assert 2 < len(long) < 3000
    assert wait_until(lambda: u.stats()["aborted"] == 1)  # the cut stream's engine request was aborted
    assert limited.proc.wait(20) == 0
