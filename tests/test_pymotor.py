"""MindIE-PyMotor's user_config.json moves over unchanged: four real PyMotor-shaped configs started as `python
app.py --config FILE`, each key they set checked over HTTP against what ../shared/spec/pymotor-config.md says it
does (or the difference docs/pymotor.md states), and the keys that cannot be honoured refused at start in one line.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

import httpx
import openai
import pytest

from config import ROOT_KEY, Live, Settings, settings_from_dict
from config.keys import hash_key, hashed_entry
from harness import ROOT
from harness.bodies import chat_body
from harness.clients import openai_client
from harness.configs import api_config, instance
from harness.coordinator import Coordinator
from scheduling.health import Health
from state.shared import SharedState

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
NOTE = "accepted, changes nothing here"


def fresh_post(url: str, body: dict, **kw) -> httpx.Response:
    with httpx.Client(timeout=30) as c:  # a new connection: the kernel picks the worker
        return c.post(url + "/v1/chat/completions", json=body, **kw)


def defaults_dump() -> dict:
    with open(os.path.join(DATA, "pymotor_defaults.json")) as f:
        whole = json.load(f)
    whole[ROOT_KEY]["api_config"].update(api_config())
    whole[ROOT_KEY]["inference_workers_config"]["num_workers"] = 2  # PyMotor's 4, on a machine of 2 cores
    return whole


def hashed_by_cli(key: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "config.keys", "hash", "--iterations", "20000"],
        input=key + "\n",
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    )
    return out.stdout.strip()


# -- 1. PyMotor's defaults dump --------------------------------------------------------------------------------


def test_defaults_dump_starts_and_serves_as_pymotor_would():
    whole = defaults_dump()
    with Coordinator(whole, wrap=False) as coord:
        log = coord.proc.output()
        for noted in (
            "timeout_config",
            "request_limit",
            "scheduler_config.endpoint_instance_score_weight",
            "scheduler_config.kv_affinity",
            "api_config.coordinator_api_dns",
            "inference_workers_config.worker_metaserver_base_port",
            "standby_config",
            "etcd_config",
            "etcd_tls_config",
        ):
            lines = [ln for ln in log.splitlines() if f"{ROOT_KEY}.{noted} {NOTE}" in ln]
            assert len(lines) == 1, f"{noted}: {lines}"
        # enable_api_key false: no key asked; enable_rate_limit false: no limit however many come at once.
        client = openai_client(coord).with_options(max_retries=0)
        answer = client.chat.completions.create(
            model="qwen3", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert answer.choices[0].message.content
        statuses = [fresh_post(coord.url, chat_body("qwen3", max_tokens=1)).status_code for _ in range(30)]
        assert statuses == [200] * 30
        # max_request_body_size 0 is PyMotor's "no limit": the Coordinator keeps its 16 MiB bound (stated).
        big = fresh_post(coord.url, chat_body("qwen3", content="x" * (17 * 1024 * 1024)))
        assert big.status_code == 413
        assert [m["id"] for m in httpx.get(coord.url + "/v1/models").json()["data"]] == ["qwen3"]


# -- 2. aigw, limits and hashed keys -----------------------------------------------------------------------------


def test_aigw_limits_and_hashed_keys(sims, tmp_path):
    u = sims("union", model="glm-4.6")
    hashed = hashed_by_cli("sk-hashed-7")
    key_file = tmp_path / "mgmt.key"
    key_file.write_text(hash_key("op-key-1", iterations=1000) + "\n")
    assert hashed_entry(hashed).iterations == 20000
    cfg = {
        "api_config": api_config(),
        "inference_workers_config": {"num_workers": 2},
        "aigw": {"id": "glm-4.6", "p_max_seqlen": 131072, "d_max_seqlen": 131072, "slo_ttft": 800, "slo_tpot": 40},
        "scheduler_config": {"scheduler_type": "load_balance", "enable_pd_separation_fallback_to_hybrid": False},
        "exception_config": {
            "max_retry": 5,
            "transport_max_retry": 1,
            "retry_delay": 0.01,
            "upstream_error_body_max_bytes": 1024,
        },
        "api_key_config": {"enable_api_key": True, "valid_keys": [hashed, "sk-plain-3"], "skip_paths": ["/v1/models"]},
        "mgmt_api_key_config": {"enable_api_key": True, "api_key_file": str(key_file)},
        "rate_limit_config": {
            "enable_rate_limit": True,
            "max_requests": 6,
            "window_size": 3600,
            "error_message": "slow down please",
        },
        "instances": [instance(1, "union", "glm-4.6", u.address)],
    }
    with Coordinator(cfg) as coord:
        assert hashed not in coord.proc.output() and "sk-plain-3" not in coord.proc.output()
        # skip_paths: an exact match opens /v1/models, and only it.
        listed = httpx.get(coord.url + "/v1/models")
        assert listed.status_code == 200
        (entry,) = listed.json()["data"]
        assert entry["id"] == "glm-4.6"
        assert (entry["p_max_seqlen"], entry["d_max_seqlen"], entry["slo_ttft"], entry["slo_tpot"]) == (
            131072,
            131072,
            800,
            40,
        )
        assert httpx.get(coord.url + "/v1/models/glm-4.6").status_code == 401
        # mgmt_api_key_config.api_key_file: its one (hashed) key guards /instances; the probes stay open.
        assert httpx.get(coord.mgmt + "/instances").status_code == 401
        assert httpx.get(coord.mgmt + "/instances", headers={"X-Motor-Management-Key": "op-key-2"}).status_code == 401
        assert httpx.get(coord.mgmt + "/instances", headers={"X-Motor-Management-Key": "op-key-1"}).status_code == 200
        assert httpx.get(coord.mgmt + "/readiness").status_code == 200
        # Keys: the hashed entry and the plain one admit; a wrong key and none are 401 (docs/pymotor.md says so).
        msg = [{"role": "user", "content": "hi"}]
        for key in ("sk-hashed-7", "sk-hashed-7", "sk-plain-3"):
            client = openai_client(coord, key=key).with_options(max_retries=0)
            assert client.chat.completions.create(model="glm-4.6", messages=msg, max_tokens=2).choices
        with pytest.raises(openai.AuthenticationError):
            openai_client(coord, key="sk-hashed-8").with_options(max_retries=0).chat.completions.create(
                model="glm-4.6", messages=msg, max_tokens=2
            )
        assert fresh_post(coord.url, chat_body("glm-4.6")).status_code == 401
        auth = {"Authorization": "Bearer sk-plain-3"}
        # upstream_error_body_max_bytes: an engine's 4xx body reaches the client cut to 1024 bytes.
        u.set_faults(fail_status=400, fail_body="e" * 5000)
        refused = fresh_post(coord.url, chat_body("glm-4.6"), headers=auth)
        u.clear_faults()
        assert refused.status_code == 400
        assert refused.json()["error"]["message"] == "e" * 1024
        # 4 tokens taken of 6 (the refusals before the door take none): 2 more pass, across both workers.
        statuses = [fresh_post(coord.url, chat_body("glm-4.6", max_tokens=1), headers=auth) for _ in range(5)]
        assert [r.status_code for r in statuses] == [200, 200, 429, 429, 429]
        assert statuses[2].json()["error"]["message"] == "slow down please"
        assert float(statuses[2].headers["Retry-After"]) > 0


def test_transport_max_retry_is_the_retries_made(sims):
    u1, u2 = sims("union", model="m"), sims("union", model="m")
    cfg = {
        "api_config": api_config(),
        "exception_config": {"max_retry": 5, "transport_max_retry": 1, "retry_delay": 0.01},
        "instances": [instance(1, "union", "m", u1.address), instance(2, "union", "m", u2.address)],
    }
    with Coordinator(cfg) as coord:
        for u in (u1, u2):
            u.set_faults(fail_status=503)
        assert fresh_post(coord.url, chat_body("m")).status_code == 502  # the engines' 503s, retries spent
        assert u1.stats()["received"] + u2.stats()["received"] == 2  # one try and transport_max_retry retries


# -- 3. an empty motor_coordinator_config: the model from the engine sections ----------------------------------


def test_empty_section_takes_the_model_from_the_engine_sections():
    whole = {
        ROOT_KEY: {"api_config": api_config()},  # the ports only: the test runs beside others
        "motor_engine_prefill_config": {
            "model_config": {"model_name": "dsv3"},
            "engine_config": {"max_model_len": 32768},
        },
        "motor_engine_decode_config": {
            "model_config": {"model_name": "dsv3"},
            "engine_config": {"max_model_len": 16384},
        },
    }
    with Coordinator(whole, wrap=False) as coord:
        (entry,) = httpx.get(coord.url + "/v1/models").json()["data"]
        assert (entry["id"], entry["p_max_seqlen"], entry["d_max_seqlen"]) == ("dsv3", 32768, 16384)
        assert (entry["slo_ttft"], entry["slo_tpot"], entry["owned_by"]) == (1000, 50, "motor")
        answer = openai_client(coord).chat.completions.create(
            model="dsv3", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert answer.model == "dsv3"


# -- 4. keys PyMotor itself ignores --------------------------------------------------------------------------------


def test_keys_pymotor_ignores_are_accepted_with_a_note(sims):
    u = sims("union", model="m")
    cfg = {
        "api_config": api_config(),
        "timeout_config": {"request_timeout": 1, "read_timeout": 1},
        "request_limit": {"single_node_max_requests": 1, "max_requests": 1},
        "scheduler_config": {"deploy_mode": "pd_separate"},
        "instances": [instance(1, "union", "m", u.address)],
    }
    with Coordinator(cfg) as coord:
        log = coord.proc.output()
        for key in ("timeout_config", "request_limit", "scheduler_config.deploy_mode"):
            assert sum(f"{ROOT_KEY}.{key} {NOTE}" in ln for ln in log.splitlines()) == 1, key
        u.set_faults(slow_first_byte_s=1.5)  # past request_timeout and read_timeout: they bound nothing

        async def three_at_once():
            async with httpx.AsyncClient(timeout=30) as c:
                return await asyncio.gather(
                    *(c.post(coord.url + "/v1/chat/completions", json=chat_body("m", max_tokens=1)) for _ in range(3))
                )

        assert [r.status_code for r in asyncio.run(three_at_once())] == [200, 200, 200]  # request_limit 1: none


# -- refused at start: one line naming the key -----------------------------------------------------------------------

REFUSED = [
    ({"context_budget_mode": "on"}, "context_budget_mode: 'on' is not supported"),
    ({"standby_config": {"enable_master_standby": True}}, "standby_config.enable_master_standby:"),
    ({"rate_limit_config": {"provider": "olc"}}, "rate_limit_config.provider: must be one of simple"),
    (
        {
            "rate_limit_config": {
                "enable_rate_limit": True,
                "max_requests": 100,
                "window_size": 10,
                "requests_per_second": 5,
            }
        },
        "rate_limit_config.requests_per_second: 5 contradicts enable_rate_limit (true, max_requests / window_size = 10)",
    ),
    (
        {"rate_limit_config": {"enable_rate_limit": False, "requests_per_second": 5}},
        "rate_limit_config.requests_per_second: 5 contradicts enable_rate_limit (false)",
    ),
    ({"rate_limit_config": {"skip_paths": ["/v1/"]}}, "rate_limit_config.skip_paths[0]: '/v1/' would exempt"),
    (
        {"circuit_config": {"failure_threshold": 5}, "scheduler_config": {"breaker_failure_threshold": 3}},
        "circuit_config.failure_threshold: 5 contradicts motor_coordinator_config.scheduler_config.breaker_failure_threshold (3)",
    ),
    (
        {"logging_config": {"log_level": "DEBUG"}, "log_config": {"log_level": "INFO"}},
        "logging_config.log_level: 'DEBUG' contradicts",
    ),
    (
        {"prometheus_metrics_config": {"reuse_time": 3}, "scheduler_config": {"metrics_scrape_interval": 1}},
        "prometheus_metrics_config.reuse_time: 3 contradicts",
    ),
    ({"api_key_config": {"enable_api_key": True}}, "api_key_config.valid_keys: must list at least one key"),
    ({"api_key_config": {"valid_keys": ["ab:0:" + "0" * 64]}}, "api_key_config.valid_keys: a hashed key's iterations"),
    (
        {"api_key_config": {"encryption_algorithm": "SM3"}},
        "api_key_config.encryption_algorithm: must be one of PBKDF2_SHA256",
    ),
    (
        {"mgmt_api_key_config": {"enable_api_key": True, "api_key_file": "/nonexistent/k"}},
        "mgmt_api_key_config.api_key_file: cannot read",
    ),
    ({"aigw": {"p_max_seqlen": 4096}}, "aigw.id: is required"),
    (
        {"aigw": {"id": "m", "slo_ttft": 900}, "models": [{"id": "m", "slo_ttft": 1000}]},
        "aigw: contradicts motor_coordinator_config.models[0]",
    ),
    ({"tracer_config": {"root_sampling_rate": 2}}, "tracer_config.root_sampling_rate: must be 0..1"),
    (
        {"infer_tls_config": {"enable_tls": True, "cert_file": "/x", "key_file": "/y", "crl_file": "/z"}},
        "infer_tls_config.cert_file: '/x' is not a readable file",
    ),
]


@pytest.mark.parametrize(("section", "said"), REFUSED, ids=[s for _, s in REFUSED])
def test_refused_at_start_in_one_line(section, said):
    fd, path = tempfile.mkstemp(suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump({ROOT_KEY: {"api_config": api_config(), **section}}, f)
    try:
        out = subprocess.run(
            [sys.executable, "app.py", "--config", path], capture_output=True, text=True, cwd=ROOT, timeout=60
        )
    finally:
        os.unlink(path)
    assert out.returncode == 2, out.stderr
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("config error:")]
    assert errors == [errors[0]] and f"{ROOT_KEY}.{said}" in errors[0], out.stderr


# -- what is checked without a server ---------------------------------------------------------------------------------


def test_pymotor_hash_format_is_the_sheets():
    # PBKDF2-HMAC-SHA256 of the key's UTF-8, the salt text's UTF-8 as salt, 32 bytes in lowercase hex.
    import hashlib

    entry = hash_key("sk-é", iterations=1000, salt="00ff")
    assert entry == "00ff:1000:" + hashlib.pbkdf2_hmac("sha256", "sk-é".encode(), b"00ff", 1000).hex()
    assert hashed_entry(entry).matches("sk-é".encode()) and not hashed_entry(entry).matches(b"sk-e")
    assert hashed_entry("plain-key") is None


def test_spellings_that_agree_are_one_value():
    s = settings_from_dict(
        {
            "circuit_config": {"failure_threshold": 4, "base_timeout_s": 2, "max_timeout_s": 16},
            "scheduler_config": {"breaker_failure_threshold": 4, "metrics_scrape_interval": 3},
            "prometheus_metrics_config": {"reuse_time": 3},
            "logging_config": {"log_level": "debug"},
            "rate_limit_config": {
                "enable_rate_limit": True,
                "max_requests": 60,
                "window_size": 60,
                "requests_per_second": 1,
            },
        }
    )
    assert (s.breaker_failure_threshold, s.breaker_open_s, s.breaker_max_open_s) == (4, 2.0, 16.0)
    assert (s.metrics_scrape_interval_s, s.log_level, s.rate_limit()) == (3.0, "DEBUG", (1.0, 60.0))
    assert settings_from_dict({"circuit_config": {"enable": False}}).breaker_failure_threshold == 0
    assert settings_from_dict({"rate_limit_config": {"max_request_body_size": 10}}).max_request_body_bytes == 10 << 20


def test_circuit_open_time_doubles_per_trip_up_to_its_cap():
    health = Health(
        SharedState.create(), Live(Settings(breaker_failure_threshold=2, breaker_open_s=1.0, breaker_max_open_s=5.0))
    )
    opened = []
    for _ in range(6):
        health.record_failure(0)
        opened.append(round(health.get(0, "open_until") - time.time()) if health.breaker(0) == "open" else 0)
    assert opened == [0, 1, 2, 4, 5, 5]
    health.record_success(0)
    assert health.breaker(0) == "closed"
    off = Health(SharedState.create(), Live(Settings(breaker_failure_threshold=0)))
    for _ in range(10):
        off.record_failure(1)
    assert off.breaker(1) == "closed"


def test_tls_passwd_file_unlocks_an_encrypted_key_and_is_needed_for_one(tmp_path):
    from cryptography.hazmat.primitives import serialization

    from config import ConfigError
    from tests.certs import make_certs

    certs = make_certs(tmp_path)
    with open(certs.key, "rb") as f:
        key = serialization.load_pem_private_key(f.read(), password=None)
    locked = tmp_path / "locked.key"
    locked.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"s3cret"),
        )
    )
    (tmp_path / "pw").write_text("s3cret\n")
    (tmp_path / "bad").write_text("nope\n")
    tls = {"enable_tls": True, "cert_file": str(certs.cert), "key_file": str(locked)}
    ok = settings_from_dict({"infer_tls_config": {**tls, "passwd_file": str(tmp_path / "pw")}})
    assert ok.infer_tls.passwd_file.endswith("pw")
    for extra, said in (
        ({}, "infer_tls_config.cert_file: cannot load"),
        ({"passwd_file": str(tmp_path / "bad")}, "infer_tls_config.cert_file: cannot load"),
        ({"passwd_file": str(tmp_path / "pw"), "crl_file": str(certs.ca)}, "infer_tls_config.crl_file: needs ca_file"),
    ):
        with pytest.raises(ConfigError, match=said):
            settings_from_dict({"infer_tls_config": {**tls, **extra}})
