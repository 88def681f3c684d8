"""Cluster mode: three Coordinator replicas (two workers each) sharing their state through a real redis-server.

Each test gets its own key prefix in the module's Redis, so its replicas share only with each other. Clients
talk to every replica; the engines are simulators.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from redis import Redis as RedisClient

from harness.configs import coordinator_config, instance
from harness.coordinator import Coordinator
from harness.loopback import CLIENT, wait_until
from harness.redis import RedisServer
from tests.conftest import MODEL

REPLICAS = 3


class Replicas(list):
    """Coordinator replicas of one cluster (one key prefix), started together, stopped at teardown."""

    def __init__(self, redis: RedisServer, instances: list[dict], n: int = REPLICAS, **sections):
        super().__init__()
        self.redis, self.instances, self.sections = redis, instances, sections
        self.prefix = f"motor:test-{uuid.uuid4().hex[:8]}:"
        self.start(n)

    def config(self, **extra) -> dict:
        sections = {**self.sections, **extra}
        cluster = {"redis_url": self.redis.url, "key_prefix": self.prefix, **sections.pop("cluster_config", {})}
        return coordinator_config(
            self.instances,
            inference_workers_config={"num_workers": 2},
            cluster_config=cluster,
            **sections,
        )

    def start(self, n: int, **extra) -> list[Coordinator]:
        with ThreadPoolExecutor(n) as pool:
            started = list(pool.map(lambda _: Coordinator(self.config(**extra)), range(n)))
        self.extend(started)
        return started

    def stop_all(self) -> None:
        for coord in self:
            coord.stop()
        self.clear()


@pytest.fixture
def cluster(redis):
    made: list[Replicas] = []

    def make(instances: list[dict], n: int = REPLICAS, **sections) -> Replicas:
        replicas = Replicas(redis, instances, n, **sections)
        made.append(replicas)
        return replicas

    yield make
    for replicas in made:
        replicas.stop_all()


def listed(coord: Coordinator) -> dict:
    return coord.instances()


def ids(coord: Coordinator) -> list[int]:
    return sorted(i["id"] for i in listed(coord)["instances"])


def paused(coord: Coordinator) -> list[int]:
    return sorted(i["id"] for i in listed(coord)["instances"] if i.get("paused"))


def metric(coord: Coordinator, name: str) -> float:
    for line in CLIENT.get(coord.obs + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


def chat(coord: Coordinator, max_tokens: int = 4, content: str = "hello", **extra) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **extra}
    return CLIENT.post(coord.url + "/v1/chat/completions", json=body, timeout=30)


def test_a_refresh_on_one_replica_routes_every_replica_and_outlives_them_all(cluster, sims):
    a, b, c = (sims("union") for _ in range(3))
    replicas = cluster([instance(1, "union", MODEL, a.address)])
    assert all(listed(r)["cluster"]["store"] == "connected" for r in replicas)
    assert len({listed(r)["cluster"]["replica"] for r in replicas}) == REPLICAS
    new_set = [instance(2, "union", MODEL, b.address), instance(3, "union", MODEL, c.address)]
    assert replicas[0].refresh("set", new_set).status_code == 200
    # Every replica routes by the new set at its next sync (every 50 ms; bench/cluster_sync.py times it: the
    # deadlines here leave room for a loaded machine).
    assert wait_until(lambda: all(ids(r) == [2, 3] for r in replicas), timeout_s=5.0)
    assert replicas[1].refresh("pause", [3]).status_code == 200
    assert wait_until(lambda: all(paused(r) == [3] for r in replicas), timeout_s=5.0)
    for r in replicas:
        assert chat(r).status_code == 200
    assert b.stats()["completed"] == REPLICAS and c.stats()["completed"] == 0  # paused everywhere

    # Every replica stops; new ones (their static config still lists instance 1 only) serve the stored set.
    replicas.stop_all()
    replicas.start(2)
    assert all(ids(r) == [2, 3] and paused(r) == [3] for r in replicas)
    assert chat(replicas[0]).status_code == 200 and a.stats()["completed"] == 0


def test_a_replica_is_not_ready_before_its_first_sync_has_read_the_stored_set(sims):
    """Readiness waits for the first round trip to the store: a replica ready before it would route by its
    static instances, which the stored set replaces. The store here accepts and never answers, so that round
    trip lasts `redis_timeout_ms`; then the replica serves its static set, and is ready."""
    a = sims("union")
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel accepts; nothing answers
    cluster = {"redis_url": "redis://127.0.0.1:%d" % silent.getsockname()[1], "redis_timeout_ms": 4000}
    config = coordinator_config([instance(1, "union", MODEL, a.address)], cluster_config=cluster)
    mgmt = "http://%s:%d" % (
        config["api_config"]["coordinator_api_host"],
        config["api_config"]["coordinator_api_mgmt_port"],
    )
    started: list[Coordinator] = []
    starting = threading.Thread(target=lambda: started.append(Coordinator(config)))
    starting.start()
    answers = []
    try:
        while starting.is_alive():
            try:
                r = httpx.get(mgmt + "/readiness", timeout=1.0)
                answers.append((r.status_code, r.json()["ready"], r.json()["message"]))
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        starting.join()
        coord = started[0]
        # The harness returns once it has seen readiness answer 200, which can be after this loop's last poll.
        after = httpx.get(mgmt + "/readiness", timeout=1.0)
        assert answers and answers[0][:2] == (503, False) and "not read yet" in answers[0][2], answers[:3]
        assert (after.status_code, after.json()["ready"]) == (200, True), after.text
        assert "cluster store unreachable" in coord.output()
        assert chat(coord).status_code == 200 and a.stats()["completed"] == 1
    finally:
        for coord in started:
            coord.stop()
        silent.close()


def test_a_refresh_is_not_undone_by_the_sync_that_runs_while_it_is_stored(cluster, sims):
    """The replica that takes a refresh keeps it: its own sync, running while the refresh is being stored, must not
    adopt the set stored before it (the refresh's replica would keep the old set while every other had the new)."""
    a, b = sims("union"), sims("union")
    replicas = cluster(
        [instance(1, "union", MODEL, a.address), instance(2, "union", MODEL, b.address)],
        2,
        cluster_config={"sync_interval_ms": 10},  # many syncs in each refresh's round trips
    )
    for i in range(40):
        want = [2] if i % 2 == 0 else []
        assert replicas[i % 2].refresh("pause" if want else "resume", [2]).status_code == 200
        assert wait_until(lambda want=want: all(paused(r) == want for r in replicas), timeout_s=2.0), (
            i,
            [paused(r) for r in replicas],
        )


def test_an_instance_set_outside_the_bounds_reaches_no_replica(cluster, sims, redis):
    """Ids beyond 2^63-1 and a prefill that is not vLLM: refused by the refresh, and not adopted from the store
    (where a replica of another version could have written them)."""
    a = sims("union")
    replicas = cluster([instance(1, "union", MODEL, a.address)], n=2)
    for bad in (
        instance(2**64 + 50, "union", MODEL, a.address),
        instance(2, "prefill", MODEL, "127.0.0.1:9", engine_type="sglang"),
    ):
        r = replicas[0].refresh("set", [bad])
        assert r.status_code == 400 and r.json()["status"] == "failed", r.text
    stored = [{**instance(2**64 + 50, "union", MODEL, a.address, engine_type="vllm"), "paused": False}]
    redis.command(b"SET", replicas.prefix.encode() + b"instances", json.dumps(stored).encode())
    redis.command(b"INCR", replicas.prefix.encode() + b"instances:v")
    assert wait_until(lambda: all("cannot be applied here" in r.output() for r in replicas), timeout_s=5)
    time.sleep(1.0)  # twenty sync ticks: the refusal is said once per worker, not on each
    for r in replicas:
        assert ids(r) == [1] and chat(r).status_code == 200
        assert "instances[0].id: must be 0..9223372036854775807" in r.output()
        assert r.output().count("cannot be applied here") <= 2, r.output()


def test_a_cluster_wide_in_flight_cap_holds_under_200_concurrent_requests(cluster, sims):
    engines = [sims("union", speedup=0.2) for _ in range(2)]  # 10 ms a token: 60 tokens hold a request 0.6 s
    replicas = cluster(
        [instance(i + 1, "union", MODEL, e.address) for i, e in enumerate(engines)],
        rate_limit_config={"max_inflight_requests": 8},
    )
    peak = [0]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], sum(e.stats()["running"] + e.stats()["waiting"] for e in engines))
            time.sleep(0.005)

    async def load() -> list[int]:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=300)) as client:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "slow"}], "max_tokens": 60}

            async def one(i: int) -> int:
                r = await client.post(replicas[i % REPLICAS].url + "/v1/chat/completions", json=body)
                return r.status_code

            return await asyncio.gather(*(one(i) for i in range(200)))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        statuses = asyncio.run(load())
    finally:
        done.set()
        watcher.join()
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(200) >= 8 and statuses.count(429) > 0
    assert 1 <= peak[0] <= 8, peak[0]


def test_a_cluster_wide_rate_limit_holds_to_its_bucket(cluster, sims):
    u = sims("union")
    replicas = cluster([instance(1, "union", MODEL, u.address)], rate_limit_config={"requests_per_second": 1.0})
    # A bucket of one second's worth (1 request) refilled at 1/s: 12 requests spread over the replicas in about
    # 0.3 s get at most 1 + 0.3 + 1 (a token that refilled meanwhile, rounding) through; alone, each replica
    # would let its own bucket's request through (3).
    with ThreadPoolExecutor(12) as pool:
        statuses = list(pool.map(lambda i: chat(replicas[i % REPLICAS]).status_code, range(12)))
    assert set(statuses) <= {200, 429}
    assert 1 <= statuses.count(200) <= 2, statuses


def test_load_through_two_replicas_steers_the_third(cluster, sims):
    busy, idle = sims("union", speedup=0.2), sims("union", speedup=0.2)  # 10 ms a decode step
    replicas = cluster(
        [instance(1, "union", MODEL, busy.address), instance(2, "union", MODEL, idle.address)],
        scheduler_config={"scheduler_type": "load_balance"},
    )
    a, b, c = replicas
    assert a.refresh("pause", [2]).status_code == 200  # the long requests all go to engine 1
    assert wait_until(lambda: all(paused(r) == [2] for r in replicas), timeout_s=5.0)
    with ThreadPoolExecutor(6) as pool:
        long = [pool.submit(chat, r, 500) for r in (a, b, a, b, a, b)]  # 5 s each on engine 1
        assert wait_until(lambda: busy.stats()["running"] == 6, timeout_s=5)
        assert a.refresh("resume", [2]).status_code == 200
        assert wait_until(lambda: all(paused(r) == [] for r in replicas), timeout_s=2.0)  # (the long ones last 5 s)
        time.sleep(0.2)  # a few sync periods: C has heard A's and B's load
        before = idle.stats()["completed"]
        for _ in range(6):  # C alone holds nothing: only the other replicas' load tells engine 1 is busy
            assert chat(c).status_code == 200
        assert idle.stats()["completed"] - before == 6
        assert all(f.result().status_code == 200 for f in long)


def test_trigger_mode_bills_the_prompt_when_the_metaserver_call_reaches_another_replica(cluster, sims):
    """D counts the transferred KV as cached; P's own counts are billed (test_pd.py), also when D's metaserver call
    reaches another replica than the client's: that replica publishes them."""
    p, d = sims("prefill"), sims("decode")
    instances = [instance(1, "prefill", MODEL, p.address), instance(2, "decode", MODEL, d.address)]
    replicas = cluster(instances, 1, scheduler_config={"pd_dispatch": "trigger"})
    other = replicas[0]
    # Replica A tells D to call back replica B (as a Service in front of the replicas would send it anywhere).
    first = Coordinator(replicas.config(cluster_config={"metaserver_url": other.url + "/v1/metaserver"}))
    replicas.append(first)
    for i in range(3):
        content = f"bill me {i} " * 40
        r = chat(first, max_tokens=3, content=content)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # nothing cached on P yet
        again = chat(first, max_tokens=3, content=content).json()["usage"]
        assert 0 < again["prompt_tokens_details"]["cached_tokens"] < again["prompt_tokens"], again  # P's hits
    assert d.stats()["metaserver_calls"] == 6
    assert wait_until(lambda: other.output().count("route=/v1/metaserver") == 6), other.output()[-2000:]


def test_redis_down_fails_no_request_and_state_converges_when_it_returns(cluster, sims, redis):
    a, b = sims("union"), sims("union")
    replicas = cluster([instance(1, "union", MODEL, a.address)], rate_limit_config={"max_inflight_requests": 60})
    failures: list[str] = []
    stop = threading.Event()

    def clients(i: int) -> int:
        n = 0
        while not stop.is_set():
            r = chat(replicas[i % REPLICAS], stream=(n % 2 == 0))
            if r.status_code != 200:
                failures.append(f"{r.status_code} {r.text[:200]}")
            n += 1
        return n

    with ThreadPoolExecutor(6) as pool:
        work = [pool.submit(clients, i) for i in range(6)]
        time.sleep(0.5)
        redis.kill()
        assert wait_until(lambda: all(listed(r)["cluster"]["store"] == "disconnected" for r in replicas), 5)
        assert metric(replicas[0], "motor_cluster_store_connected") == 0
        time.sleep(1.0)
        redis.start()  # empty: every replica must put its state back
        assert wait_until(lambda: all(listed(r)["cluster"]["store"] == "connected" for r in replicas), 5)
        stop.set()
        served = sum(f.result() for f in work)
    assert not failures, failures[:5]
    assert served > 20
    assert metric(replicas[0], "motor_cluster_store_connected") == 1
    assert metric(replicas[0], "motor_cluster_store_errors_total") > 0
    assert metric(replicas[0], "motor_cluster_store_round_trips_total") > metric(
        replicas[0], "motor_cluster_store_errors_total"
    )
    # Each replica counts the others at its own next sync: "connected" can come first (a request's round trip).
    assert wait_until(lambda: metric(replicas[0], "motor_cluster_replicas") == REPLICAS, 5)
    assert replicas[0].refresh("add", [instance(2, "union", MODEL, b.address)]).status_code == 200
    assert wait_until(lambda: all(ids(r) == [1, 2] for r in replicas), timeout_s=5.0)
    for r in replicas:
        assert "cluster store unreachable" in r.output() and "reachable again" in r.output()


def in_flight(server: RedisServer, prefix: str) -> int:
    """The cluster's requests in flight as the store counts them (every worker's key)."""
    with RedisClient.from_url(server.url) as r:
        return sum(int(r.get(k) or 0) for k in r.smembers(prefix + "inflight"))


def test_a_store_that_lost_its_data_under_load_is_put_back_by_every_replica(cluster, sims, redis):
    """Redis comes back empty (restarted without persistence, then FLUSHALL) while streams are in flight: every
    replica re-publishes its counts and re-seeds or adopts the instance set, so the cap is exact again and a
    refresh reaches every replica, though the store's version restarts below the replicas' own (3)."""
    engines = [sims("union", speedup=0.2) for _ in range(4)]  # 10 ms a token
    replicas = cluster(
        [instance(i, "union", MODEL, engines[i - 1].address) for i in (1, 2)],
        n=2,
        rate_limit_config={"max_inflight_requests": 8},
    )
    a, b = replicas
    assert a.refresh("pause", [2]).status_code == 200 and a.refresh("resume", [2]).status_code == 200
    assert wait_until(lambda: listed(b)["cluster"]["instances_version"] == 3, timeout_s=5.0)

    def counted() -> int:
        return in_flight(redis, replicas.prefix)

    def restart() -> None:
        redis.kill()
        redis.start()

    def flush() -> None:
        assert redis.command(b"FLUSHALL") == b"+OK"

    async def burst() -> list[int]:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hold"}], "max_tokens": 300}  # 3 s
            replies = await asyncio.gather(
                *(client.post(replicas[i % 2].url + "/v1/chat/completions", json=body) for i in range(18))
            )
            return sorted(r.status_code for r in replies)

    for lose, pause, add in ((restart, 1, 3), (flush, 2, 4)):
        assert wait_until(lambda: counted() == 0, timeout_s=5)
        with ThreadPoolExecutor(8) as pool:
            streams = [pool.submit(chat, replicas[i % 2], 300, stream=True) for i in range(8)]  # 3 s each
            assert wait_until(lambda: sum(e.stats()["running"] for e in engines) == 8, timeout_s=5)
            lose()
            assert wait_until(lambda: counted() == 8, timeout_s=5), counted()  # every worker's count is back
            assert b.refresh("pause", [pause]).status_code == 200
            assert wait_until(lambda n=pause: n in paused(a), timeout_s=5), listed(a)
            assert a.refresh("add", [instance(add, "union", MODEL, engines[add - 1].address)]).status_code == 200
            assert wait_until(lambda n=add: n in ids(b), timeout_s=5), listed(b)
            assert all(s.result().status_code == 200 for s in streams)
        assert wait_until(lambda: counted() == 0, timeout_s=5), counted()
        statuses = asyncio.run(burst())
        assert statuses == [200] * 8 + [429] * 10, f"{lose.__name__}: {statuses.count(200)} of 18 admitted"


def test_a_killed_replicas_share_of_the_cap_comes_back_within_its_ttl(cluster, sims):
    u = sims("union", speedup=0.2)
    replicas = cluster(
        [instance(1, "union", MODEL, u.address)],
        n=2,
        rate_limit_config={"max_inflight_requests": 4},
        cluster_config={"replica_ttl_s": 1.0},
    )
    doomed, survivor = replicas
    pool = ThreadPoolExecutor(4)
    held = [pool.submit(chat, doomed, 1000) for _ in range(4)]  # 10 s each: the whole cap, on the doomed replica
    assert wait_until(lambda: u.stats()["running"] == 4, timeout_s=5)
    assert chat(survivor).status_code == 429
    os.killpg(doomed.proc.pid, signal.SIGKILL)
    # Its in-flight keys expire after replica_ttl_s (1 s here); the engine sees the dropped connections too.
    assert wait_until(lambda: chat(survivor).status_code == 200, timeout_s=5)
    pool.shutdown(wait=False, cancel_futures=True)
    for f in held:
        f.cancel()


def test_pymotor_standby_starts_active_active_with_one_line_saying_so(redis, sims):
    u = sims("union")
    cfg = coordinator_config(
        [instance(1, "union", MODEL, u.address)],
        standby_config={"enable_master_standby": True, "master_lock_ttl": 10},
        cluster_config={"redis_url": redis.url, "key_prefix": f"motor:test-{uuid.uuid4().hex[:8]}:"},
    )
    with Coordinator(cfg) as coord:
        lines = [ln for ln in coord.output().splitlines() if "standby_config" in ln]
        assert len(lines) == 1 and "every replica serves (active-active)" in lines[0], lines
        assert listed(coord)["cluster"]["store"] == "connected"
        assert chat(coord).status_code == 200
        assert redis.url not in coord.output() and "redis://" not in json.dumps(listed(coord))


def test_replicas_agree_where_a_prefix_is_cached(cluster, sims):
    engines = [sims("union") for _ in range(2)]
    replicas = cluster(
        [instance(i + 1, "union", MODEL, e.address) for i, e in enumerate(engines)],
        scheduler_config={"scheduler_type": "kv_cache_affinity"},
    )

    def served() -> list[int]:
        return [e.stats()["completed"] for e in engines]

    for n in range(4):
        prompt = f"{n} {uuid.uuid4().hex} " + "a long shared system prompt " * 200
        before = served()
        assert chat(replicas[0], content=prompt).status_code == 200
        first = [a - b for a, b in zip(served(), before)]
        time.sleep(0.3)  # a few sync periods: the other replicas have heard where it was prefilled
        for r in replicas[1:]:
            assert chat(r, content=prompt).status_code == 200
        # Both follow-ups went where the first was served (alone, each replica would pick by load: a coin toss).
        assert [a - b for a, b in zip(served(), before)] == [3 * f for f in first]


def test_a_stored_response_is_found_through_any_replica(cluster, sims):
    engines = [sims("union") for _ in range(2)]
    replicas = cluster([instance(i + 1, "union", MODEL, e.address) for i, e in enumerate(engines)], 2)
    a, b = (openai.OpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0) for r in replicas)
    first = a.responses.create(model=MODEL, input="Remember this.", max_output_tokens=4)
    holder = next(e for e in engines if any(q["path"] == "/v1/responses" for q in e.requests()))
    time.sleep(0.3)  # the home travels to the other replica on the events channel
    assert b.responses.retrieve(first.id).id == first.id
    follow = b.responses.create(model=MODEL, input="And now?", previous_response_id=first.id, max_output_tokens=4)
    assert follow.id != first.id and follow.status in ("completed", "incomplete")
    assert sum(q["path"] == "/v1/responses" for q in holder.requests()) == 2  # the follow-up went where it lives


def test_an_endpoint_one_replica_found_broken_is_avoided_by_all(cluster, sims):
    broken, good = sims("union"), sims("union")
    replicas = cluster(
        [instance(1, "union", MODEL, broken.address), instance(2, "union", MODEL, good.address)],
        2,
        scheduler_config={"scheduler_type": "round_robin", "breaker_open_time": 30},
    )
    a, b = replicas
    broken.set_faults(fail_status=500)
    for _ in range(8):  # A's retries go to the good engine; A's breaker opens after 3 failures in a row
        assert chat(a).status_code == 200
    assert [i["endpoints"][0]["breaker"] for i in listed(a)["instances"] if i["id"] == 1] == ["open"]
    # B's own breaker stays closed, and B schedules nothing there (as /instances and readiness count it)
    assert wait_until(lambda: [i["schedulable"] for i in listed(b)["instances"]] == [False, True], timeout_s=5.0)
    assert [i["endpoints"][0]["breaker"] for i in listed(b)["instances"] if i["id"] == 1] == ["closed"]
    tried = broken.stats()["received"]
    for _ in range(6):  # B never saw a failure: round robin alone would send every other request to engine 1
        assert chat(b).status_code == 200
    assert broken.stats()["received"] == tried
