"""Tenants (tenant_config): who a key is, in the log line and never the key; the config's refusals; stored
responses that exist only for the tenant that made them, alone and in cluster mode (a real redis-server).
Quotas and their headers are tests/test_quotas.py."""

from __future__ import annotations

import asyncio
import hashlib
import re
import time

import httpx
import openai
import pytest

from config import ConfigError, settings_from_dict
from config.keys import hash_key
from config.live import check_nothing_left_out
from harness.clients import openai_client
from harness.configs import api_keys, coordinator_config, instance
from harness.coordinator import Coordinator
from harness.loopback import wait_until
from tests.conftest import MODEL
from tests.test_cluster import cluster  # noqa: F401 (a fixture)

PD = "qwen3-pd"
KEY_A, KEY_B, KEY_D = "sk-team-a-1", "sk-team-b-1", "sk-default-1"
TENANTS = {
    "tenants": [
        {"name": "team-a", "keys": [KEY_A]},
        {"name": "team-b", "keys": [hash_key(KEY_B, iterations=1000)]},
    ]
}


def tenant_of(coord: Coordinator, rid: str) -> str:
    line: list[str] = []
    assert wait_until(
        lambda: line.extend(ln for ln in coord.output().splitlines() if f"request_id={rid} " in ln) or line
    )
    return re.search(r" tenant=(\S+)", line[0])[1]


def ask(coord: Coordinator, key: str | None, rid: str) -> int:
    sdk = openai_client(coord, key or "none")
    try:
        sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_headers={"X-Request-Id": rid}
        )
    except openai.APIStatusError as e:
        return e.status_code
    return 200


def test_the_key_names_the_tenant_in_the_log_line_and_the_key_is_never_written(sims):
    u = sims("union")
    cfg = coordinator_config([instance(1, "union", MODEL, u.address)], api_key_config=api_keys(KEY_D))
    with Coordinator({**cfg, "tenant_config": TENANTS}) as coord:
        for key, tenant in ((KEY_A, "team-a"), (KEY_B, "team-b"), (KEY_D, "default")):
            for n in range(2):  # the hashed key's second time: remembered, the same tenant
                assert ask(coord, key, f"t-{tenant}-{n}") == 200
                assert tenant_of(coord, f"t-{tenant}-{n}") == tenant
        assert ask(coord, "sk-nobody", "t-nobody") == 401
        assert all(k not in coord.output() for k in (KEY_A, KEY_B, KEY_D))


def test_without_tenant_config_each_key_is_its_own_tenant_and_without_keys_there_is_one(sims):
    u = sims("union")
    cfg = coordinator_config([instance(1, "union", MODEL, u.address)], api_key_config=api_keys(KEY_A, KEY_B))
    with Coordinator(cfg) as coord:
        assert ask(coord, KEY_A, "k-a") == 200 and ask(coord, KEY_B, "k-b") == 200
        a, b = tenant_of(coord, "k-a"), tenant_of(coord, "k-b")
        assert a == "key-" + hashlib.sha256(KEY_A.encode()).hexdigest()[:12] and b.startswith("key-") and a != b
    with Coordinator(coordinator_config([instance(1, "union", MODEL, u.address)])) as coord:
        assert ask(coord, None, "k-none") == 200 and tenant_of(coord, "k-none") == "default"


def _tenants(section: dict, keys: dict | None = None) -> dict:
    return {"api_key_config": keys or api_keys(KEY_D), "tenant_config": section}


@pytest.mark.parametrize(
    "cfg, said",
    [
        (_tenants({"tenants": [{"name": "a"}, {"name": "a"}]}), "tenant_config.tenants[1].name: must be unique"),
        (_tenants({"tenants": [{"keys": ["k"]}]}), "tenant_config.tenants[0].name: must be unique"),
        (_tenants({"tenants": [{"name": "other"}]}), "tenant_config.tenants[0].name"),
        (_tenants({"tenants": [{"name": "a b"}]}), "tenant_config.tenants[0].name"),
        (
            _tenants({"tenants": [{"name": "a", "keys": ["k"]}, {"name": "b", "keys": ["k"]}]}),
            "tenant_config.tenants[1].keys: a key listed under another tenant too",
        ),
        (_tenants({"tenants": [{"name": "a", "keys": [KEY_D]}]}), "tenant_config.tenants[0].keys: a key also in"),
        (
            _tenants({"tenants": [{"name": "a", "keys": ["k"]}]}, {"enable_api_key": False}),
            "tenant_config.tenants[0].keys: a tenant's keys need",
        ),
        (_tenants({"default": {"max_priority": "urgent"}}), "tenant_config.default.max_priority: must be one of"),
        (_tenants({"default": {"rpm": -1}}), "tenant_config.default.rpm: must be >= 0"),
        (_tenants({"default": {"weight": 0}}), "tenant_config.default.weight: must be > 0"),
        (_tenants({"tenants": [{"name": "a", "tpm": "9"}]}), "tenant_config.tenants[0].tpm: must be an integer"),
        (_tenants({"tenants": {}}), "tenant_config.tenants: must be a list"),
    ],
)
def test_a_tenant_config_that_cannot_be_honoured_is_refused_naming_the_key(cfg, said):
    with pytest.raises(ConfigError, match=re.escape("motor_coordinator_config." + said)):
        settings_from_dict(cfg)


def test_a_tenants_keys_alone_are_the_valid_keys_and_reload_never_drops_tenant_config():
    s = settings_from_dict(
        {"api_key_config": {"enable_api_key": True}, "tenant_config": {"tenants": [{"name": "a", "keys": ["k"]}]}}
    )
    assert s.key_owners == (("k", "a"),)
    running = _tenants({"default": {"rpm": 5}})
    with pytest.raises(ConfigError, match=r"motor_coordinator_config\.tenant_config: set in the running config"):
        check_nothing_left_out(running, {"api_key_config": api_keys(KEY_D)})
    with pytest.raises(ConfigError, match=r"tenant_config\.default: set in the running config"):
        check_nothing_left_out(running, _tenants({"tenants": []}))


# -- stored responses belong to their tenant ----------------------------------------------------------------


def not_theirs(mine: openai.OpenAI, theirs: openai.OpenAI, model: str) -> None:
    """A response `mine` stored does not exist for `theirs` (GET, DELETE, cancel, previous_response_id), and is
    still there, whole, for `mine` afterwards."""
    r = mine.responses.create(model=model, input="secret", max_output_tokens=3)
    for call in (
        lambda: theirs.responses.retrieve(r.id),
        lambda: theirs.responses.delete(r.id),
        lambda: theirs.responses.cancel(r.id),
        lambda: theirs.responses.create(model=model, input="more", previous_response_id=r.id, max_output_tokens=2),
    ):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["code"] == "not_found" and r.id in e.value.body["message"]
    assert mine.responses.retrieve(r.id).id == r.id
    follow = mine.responses.create(model=model, input="more", previous_response_id=r.id, max_output_tokens=2)
    assert follow.id != r.id


@pytest.mark.parametrize("with_config", [True, False], ids=["tenant_config", "key_each"])
def test_a_stored_response_exists_only_for_its_tenant(sims, with_config):
    u, p, d = sims("union"), sims("prefill", model=PD), sims("decode", model=PD)
    cfg = coordinator_config(
        [
            instance(1, "union", MODEL, u.address),
            instance(2, "prefill", PD, p.address),
            instance(3, "decode", PD, d.address),
        ],
        inference_workers_config={"num_workers": 2},
        api_key_config=api_keys(KEY_A, KEY_D) if not with_config else api_keys(KEY_D),
    )
    if with_config:
        cfg["tenant_config"] = {"tenants": [{"name": "team-a", "keys": [KEY_A]}]}
    with Coordinator(cfg, workers=2) as coord:
        a, other = openai_client(coord, KEY_A), openai_client(coord, KEY_D)
        for model in (MODEL, PD):
            not_theirs(a, other, model)
            not_theirs(other, a, model)


def test_a_stored_response_is_its_tenants_through_every_replica(cluster, sims):  # noqa: F811 (the fixture)
    engines = [sims("union") for _ in range(2)]
    instances = [instance(i + 1, "union", MODEL, e.address) for i, e in enumerate(engines)]
    replicas = cluster(instances, 2, api_key_config=api_keys(KEY_D), tenant_config=TENANTS)
    a0, a1 = (openai_client(r, KEY_A) for r in replicas)
    b1 = openai_client(replicas[1], KEY_B)
    first = a0.responses.create(model=MODEL, input="Remember this.", max_output_tokens=4)
    assert wait_until(lambda: _found(a1, first.id))  # the home and its owner travel on the events channel
    for call in (lambda: b1.responses.retrieve(first.id), lambda: b1.responses.delete(first.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    time.sleep(0.2)  # a forget B's DELETE had published would have reached replica 0 by now
    assert a0.responses.retrieve(first.id).id == first.id


def _found(sdk: openai.OpenAI, rid: str) -> bool:
    try:
        return sdk.responses.retrieve(rid).id == rid
    except openai.NotFoundError:
        return False


def test_in_cluster_mode_the_replicas_together_hold_a_tenants_quota(cluster, sims):  # noqa: F811 (the fixture)
    """Three replicas of two workers, 200 requests at once spread over them: each replica holds its share of the
    tenant's rpm (and of its max_inflight), so together they admit the quota exactly, not three times it."""
    rpm, cap = 30, 6
    engines = [sims("union", speedup=1.0) for _ in range(2)]  # 10 ms a token: 1,000 tokens hold a place 10 s
    tenants = {
        "tenants": [
            {"name": "team-r", "keys": [KEY_A], "rpm": rpm},
            {"name": "team-c", "keys": [KEY_B], "max_inflight": cap},
        ]
    }
    replicas = cluster(
        [instance(i + 1, "union", MODEL, e.address) for i, e in enumerate(engines)],
        api_key_config=api_keys(KEY_D),
        tenant_config=tenants,
    )
    assert wait_until(lambda: all(_replicas_seen(r) == 3 for r in replicas), timeout_s=5)

    def burst(key: str, max_tokens: int) -> list[tuple[int, float, float]]:
        """Each request's (status, sent, answered)."""

        async def load() -> list[tuple[int, float, float]]:
            async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=300)) as client:
                body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": max_tokens}
                body["ignore_eos"] = True  # (else the simulated model ends after 8-64 tokens, its place with it)
                headers = {"Authorization": f"Bearer {key}"}

                async def one(i: int) -> tuple[int, float, float]:
                    url = replicas[i % len(replicas)].url + "/v1/chat/completions"
                    sent = time.monotonic()
                    status = (await client.post(url, json=body, headers=headers)).status_code
                    return status, sent, time.monotonic()

                return await asyncio.gather(*(one(i) for i in range(200)))

        return asyncio.run(load())

    started = time.monotonic()
    statuses = [r[0] for r in burst(KEY_A, 2)]
    refilled = int((time.monotonic() - started) * rpm / 60)  # what the bucket refilled while the burst ran
    assert set(statuses) <= {200, 429} and rpm <= statuses.count(200) <= rpm + refilled, statuses.count(200)
    results = burst(KEY_B, 1000)
    admitted = [r for r in results if r[0] == 200]
    assert {r[0] for r in results} <= {200, 429} and len(admitted) == cap, len(admitted)
    assert max(r[1] for r in results) < min(r[2] for r in admitted)  # all were there at once


def _replicas_seen(coord: Coordinator) -> int:
    return httpx.get(coord.mgmt + "/instances", timeout=5).json()["cluster"]["replicas"]
