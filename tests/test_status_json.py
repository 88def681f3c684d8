"""GET /status.json on the observability port: the status page's document, from live Coordinators (simulator
engines; cluster mode against a real redis-server). Its numbers follow the requests served, it is made at most
once a second however often it is asked for, and it holds no secret."""

from __future__ import annotations

import math
import time
import uuid

import httpx
import openai
import pytest

from harness.clients import openai_client
from harness.configs import coordinator_config, instance
from harness.coordinator import Coordinator
from harness.redis import RedisServer
from serving.status_history import quantile, share_within

MODEL = "status-model"


def until(read, timeout_s: float):
    """`read()`'s first truthy answer within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (got := read()):
        assert time.monotonic() < deadline, f"not seen within {timeout_s} s"
        time.sleep(0.1)
    return got


def status(coord: Coordinator) -> dict:
    r = httpx.get(coord.obs + "/status.json", timeout=5)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    return r.json()


def model_of(doc: dict, name: str) -> dict:
    return next(m for m in doc["models"] if m["id"] == name)


def test_the_document_follows_the_requests_and_is_made_once_a_second(sims):
    u = sims("union", model=MODEL)
    models = [{"id": MODEL, "slo_ttft": 5000, "slo_tpot": 1000}]
    with Coordinator(coordinator_config([instance(7, "union", MODEL, u.address)], models=models)) as coord:
        client = openai_client(coord)
        for _ in range(12):
            for _ in client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "count me"}], max_tokens=8, stream=True
            ):
                pass
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "json"}], max_tokens=4)

        def counted() -> dict | None:
            m = model_of(status(coord), MODEL)
            return m if m.get("requests") == 13 else None

        m = until(counted, 10)
        assert m["statuses"] == {"200": 13.0}
        assert m["requests_per_s"] > 0 and max(m["series"]["rps"]) > 0
        assert 0 < m["ttft_p50_s"] <= m["ttft_p99_s"] < 5
        assert 0 < m["tpot_p50_s"] <= m["tpot_p99_s"] < 1
        assert m["slo_ttft_attained"] == m["slo_tpot_attained"] == 1.0  # generous targets: every request met them
        assert m["instances"] == {"prefill": 0, "decode": 0, "union": 1}
        assert m["output_tokens"] > 0 and m["continuations"] == m["missed_handoffs"] == 0
        assert len(m["series"]["t"]) == len(m["series"]["ttft_p99"]) >= 1
        doc = status(coord)
        [inst] = doc["instances"]
        assert inst["id"] == 7 and inst["role"] == "union" and inst["endpoints"][0]["address"] == u.address
        assert inst["endpoints"][0]["kv_events"] == {"state": "off", "blocks": 0}  # (kv_event_config off)
        assert inst["endpoints"][0]["predicted"]["tpot_s"] > 0  # slo_aware learned this engine's decode speed
        [tenant] = doc["tenants"]  # keys off: one tenant, `default`
        assert tenant["name"] == "default" and tenant["requests"] == 13 and tenant["refused"] == 0
        assert doc["cluster"] is None

        # However often it is asked for, the document is made once a second.
        seen, start = set(), time.monotonic()
        while time.monotonic() - start < 2.5:
            seen.add(status(coord)["generated_at"])
        assert 2 <= len(seen) <= 4

        # An unknown model's 404 is counted under `other`, and nothing is shown for it that a client chose.
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="made-up-name", messages=[{"role": "user", "content": "x"}])
        other = until(lambda: next((m for m in status(coord)["models"] if m["id"] == "other"), None), 10)
        assert other["statuses"] == {"404": 1.0}
        assert "made-up-name" not in httpx.get(coord.obs + "/status.json").text


def test_cluster_mode_shows_the_replicas_and_the_store_and_no_redis_url(sims):
    u = sims("union", model=MODEL)
    redis = RedisServer()
    prefix = f"motor:status-{uuid.uuid4().hex[:8]}:"
    cfg = coordinator_config(
        [instance(1, "union", MODEL, u.address)],
        cluster_config={"redis_url": redis.url, "key_prefix": prefix},
    )
    try:
        with Coordinator(cfg) as a, Coordinator({**cfg, "api_config": coordinator_config([])["api_config"]}) as b:

            def both() -> dict | None:
                c = status(a)["cluster"]
                return c if len(c["replicas"]) == 2 else None

            c = until(both, 15)
            assert c["store"] == "connected" and c["replica"] == c["replicas"][0]["replica"]
            assert all(r["age_s"] > 0 and r["report_age_s"] < 5 for r in c["replicas"])
            assert status(b)["cluster"]["replica"] in {r["replica"] for r in c["replicas"]}
            text = httpx.get(a.obs + "/status.json").text
            assert redis.url not in text and str(redis.port) not in text and prefix not in text
            redis.kill()
            until(lambda: status(a)["cluster"]["store"] == "disconnected", 15)
    finally:
        redis.stop()


def test_quantiles_and_attainment_read_the_buckets_as_prometheus_does():
    # 10 observations at most 0.1 s, 10 more at most 0.5 s, none above.
    buckets = [(0.1, 10.0), (0.5, 20.0), (math.inf, 20.0)]
    assert quantile(0.5, buckets) == pytest.approx(0.1)
    assert quantile(0.75, buckets) == pytest.approx(0.3)  # halfway into the second bucket
    assert quantile(0.99, [(0.1, 1.0), (math.inf, 2.0)]) == 0.1  # in +Inf: the last finite bound
    assert quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]) is None
    assert share_within(0.1, buckets) == pytest.approx(0.5)
    assert share_within(0.3, buckets) == pytest.approx(0.75)
    assert share_within(1.0, buckets) == pytest.approx(1.0)
    assert share_within(0.05, buckets) == pytest.approx(0.25)
