"""Config values that would fail at start-up are refused when the config is read: one line naming the key
path, a non-zero exit, no traceback."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys

import pytest

import engines
from config import MAX_BACKOFF_S, ConfigError, Settings, settings_from_dict, split_address
from harness import ROOT
from harness.configs import coordinator_config, instance

MODEL = "qwen3"


def union(iid: int, *addresses: str) -> dict:
    return instance(iid, "union", MODEL, *addresses)


def refused(cfg: dict) -> str:
    with pytest.raises(ConfigError) as info:
        settings_from_dict({"motor_coordinator_config": cfg})
    return str(info.value)


def test_two_instances_at_one_address_are_refused_with_the_key_path():
    cfg = coordinator_config([union(1, "127.0.0.1:9"), union(2, "127.0.0.1:8", "http://127.0.0.1:9")])
    assert refused(cfg) == (
        "motor_coordinator_config.instances[1].endpoints[1].address: 127.0.0.1:9 is already the address of instance 1"
    )


@pytest.mark.parametrize("first, second", [("Engine-0.svc:8000", "http://engine-0.SVC:8000"), ("[::1]:9", "[0::1]:9")])
def test_one_engine_spelt_two_ways_is_refused_as_one_address(first, second):
    cfg = coordinator_config([union(1, first), union(2, second)])
    assert refused(cfg).startswith("motor_coordinator_config.instances[1].endpoints[0].address: ")
    assert "is already the address of instance 1" in refused(cfg)


@pytest.mark.parametrize(
    "address",
    ["10.0.0.5:8000", "engine-0.engines.svc:8000", "http://e:8000", "https://e:8443", "[::1]:8000", "HTTP://E:80"],
)
def test_engine_addresses_are_read_as_the_engine_client_reads_them(address):
    inst = settings_from_dict(coordinator_config([union(1, address)])).instances[0]
    (host, port, _tls), _target, _host_header = engines._split(inst.endpoints[0].base_url)
    assert split_address(address) == (host, port)


@pytest.mark.parametrize(
    "address, why",
    [
        ("::1:8000", "must be host:port"),  # unbracketed IPv6: made every request to it fail with a 500
        ("[10.0.0.5]:8000", "must be host:port"),
        ("ftp://e:80", "the scheme must be http or https"),
        ("e :80", "must be host:port"),
        ("e\t:80", "must be host:port"),
        (":80", "must be host:port"),
        ("e", "must be host:port"),
        ("e:80/v1", "must be host:port"),
        ("e:80/", "must be host:port"),
        ("user@e:80", "must be host:port"),
        ("e:0", "the port must be 1..65535"),
        ("e:65536", "the port must be 1..65535"),
    ],
)
def test_engine_addresses_that_are_not_host_port_are_refused(address, why):
    message = refused(coordinator_config([union(1, address)]))
    assert message.startswith(f"motor_coordinator_config.instances[0].endpoints[0].address: {why}"), message
    assert message.endswith(f"(got {address!r})") and "\n" not in message


def test_more_endpoints_than_slots_are_refused():
    cfg = coordinator_config([union(i, f"127.0.0.1:{10000 + i}") for i in range(257)])
    assert refused(cfg) == "motor_coordinator_config.instances: 257 endpoints in all: at most 256"
    cfg = coordinator_config([union(i, f"127.0.0.1:{10000 + i}") for i in range(256)])
    assert len(settings_from_dict(cfg).instances) == 256


def test_duplicate_endpoint_ids_in_one_instance_are_refused():
    inst = union(1, "127.0.0.1:9", "127.0.0.1:8")
    inst["endpoints"][1]["id"] = 0
    assert refused(coordinator_config([inst])) == (
        "motor_coordinator_config.instances[0].endpoints[1].id: duplicate endpoint id 0 in instance 1"
    )
    # The same id in two instances names two endpoints: fine.
    assert settings_from_dict(coordinator_config([union(1, "127.0.0.1:9"), union(2, "127.0.0.1:8")]))


@pytest.mark.parametrize("iid", [2**64 + 50, 2**63, -1])
@pytest.mark.parametrize("where", ["instance", "endpoint"])
def test_instance_and_endpoint_ids_outside_0_to_2_63_minus_1_are_refused(where, iid):
    """Ids are kept in 64-bit slots: 2^64 + 50 was cut down to 50 and a stored response went to instance 50."""
    inst = union(1, "127.0.0.1:9")
    key = "id" if where == "instance" else "endpoints[0].id"
    (inst if where == "instance" else inst["endpoints"][0])["id"] = iid
    assert refused(coordinator_config([inst])) == f"motor_coordinator_config.instances[0].{key}: must be 0..{2**63 - 1}"


def test_the_largest_ids_are_accepted():
    inst = union(2**63 - 1, "127.0.0.1:9")
    inst["endpoints"][0]["id"] = 2**63 - 1
    (read,) = settings_from_dict(coordinator_config([inst])).instances
    assert read.id == read.endpoints[0].id == 2**63 - 1


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("engine_type", ["sglang", "mindie"])
def test_a_prefill_or_decode_instance_must_speak_vllms_pd_protocol(role, engine_type):
    cfg = coordinator_config(
        [instance(1, "union", MODEL, "127.0.0.1:9"), instance(2, role, MODEL, "127.0.0.1:8", engine_type=engine_type)]
    )
    assert refused(cfg).startswith(
        f"motor_coordinator_config.instances[1].engine_type: a {role} instance must be vllm: the PD protocol of "
        f"{engine_type} is not implemented"
    )
    # A union instance of that type serves whole requests: no PD protocol is spoken to it.
    cfg["instances"][1]["role"] = "union"
    assert settings_from_dict(cfg).instances[1].engine_type == engine_type


@pytest.mark.parametrize(
    "ports, key, other, port",
    [
        ((1025, 1025, 1027), "coordinator_api_mgmt_port", "coordinator_api_infer_port", 1025),
        ((1025, 1026, 1025), "coordinator_obs_port", "coordinator_api_infer_port", 1025),
        ((1025, 1026, 1026), "coordinator_obs_port", "coordinator_api_mgmt_port", 1026),
    ],
)
def test_a_port_clash_names_the_key_that_clashes(ports, key, other, port):
    api = dict(zip(("coordinator_api_infer_port", "coordinator_api_mgmt_port", "coordinator_obs_port"), ports))
    assert refused({"api_config": api}) == (
        f"motor_coordinator_config.api_config.{key}: clashes with motor_coordinator_config.api_config.{other} ({port}); "
        "the three ports must differ"
    )


def test_a_listen_host_that_does_not_resolve_is_refused_but_engine_hosts_are_not_looked_up():
    cfg = coordinator_config([union(1, "not-an-engine.invalid:8000")])
    assert settings_from_dict(cfg).instances[0].endpoints[0].address == "not-an-engine.invalid:8000"
    cfg["api_config"]["coordinator_api_host"] = "not-a-host.invalid"
    assert refused(cfg).startswith(
        "motor_coordinator_config.api_config.coordinator_api_host: 'not-a-host.invalid' does not resolve"
    )


@pytest.fixture(scope="module")
def cert(tmp_path_factory) -> tuple[str, str]:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("no openssl command")
    folder = tmp_path_factory.mktemp("tls")
    done = subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-subj", "/CN=127.0.0.1",
         "-days", "1", "-keyout", "key.pem", "-out", "cert.pem"],
        cwd=folder, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return str(folder / "cert.pem"), str(folder / "key.pem")


@pytest.mark.parametrize("section", ["infer_tls_config", "mgmt_tls_config"])
def test_tls_files_must_exist_and_load(cert, tmp_path, section):
    cert_file, key_file = cert
    cfg = coordinator_config([union(1, "127.0.0.1:9")])
    cfg[section] = {"enable_tls": True, "cert_file": cert_file, "key_file": key_file}
    assert getattr(settings_from_dict(cfg), section.split("_")[0] + "_tls").cert_file == cert_file

    cfg[section] = {"enable_tls": True, "cert_file": str(tmp_path / "missing.pem"), "key_file": key_file}
    assert (
        refused(cfg)
        == f"motor_coordinator_config.{section}.cert_file: '{tmp_path / 'missing.pem'}' is not a readable file"
    )
    cfg[section] = {"enable_tls": True, "cert_file": cert_file, "key_file": str(tmp_path / "missing.key")}
    assert refused(cfg).startswith(f"motor_coordinator_config.{section}.key_file: ")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    cfg[section] = {"enable_tls": True, "cert_file": str(garbage), "key_file": key_file}
    assert refused(cfg).startswith(f"motor_coordinator_config.{section}.cert_file: cannot load")
    cfg[section] = {"enable_tls": True, "cert_file": cert_file, "key_file": key_file, "ca_file": str(garbage)}
    assert refused(cfg).startswith(f"motor_coordinator_config.{section}.ca_file: cannot load")
    # Files are looked at only with TLS on.
    cfg[section] = {"enable_tls": False, "cert_file": str(tmp_path / "missing.pem"), "key_file": ""}
    assert settings_from_dict(cfg)


def test_the_coordinator_exits_with_one_line_not_a_traceback(tmp_path):
    """Each of these started the app before, and failed in it with a traceback."""
    base = coordinator_config([union(1, "127.0.0.1:9")])
    taken = socket.create_server(("127.0.0.1", 0))  # another program's port
    cases = {
        "same-address": {**base, "instances": [union(1, "127.0.0.1:9"), union(2, "127.0.0.1:9")]},
        "too-many": {**base, "instances": [union(i, f"127.0.0.1:{10000 + i}") for i in range(300)]},
        "missing-cert": {
            **base,
            "infer_tls_config": {"enable_tls": True, "cert_file": "/nonexistent.pem", "key_file": "/nonexistent.key"},
        },
        "bad-host": {**base, "api_config": {**base["api_config"], "coordinator_api_host": "not-a-host.invalid"}},
        "id-over-2^63": {**base, "instances": [union(2**64 + 50, "127.0.0.1:9")]},
        "sglang-prefill": {**base, "instances": [instance(1, "prefill", MODEL, "127.0.0.1:9", engine_type="sglang")]},
        "port-in-use": {
            **base,
            "api_config": {**base["api_config"], "coordinator_api_mgmt_port": taken.getsockname()[1]},
        },
    }
    named = {  # the key each line names
        "id-over-2^63": "instances[0].id: must be 0..",
        "sglang-prefill": "instances[0].engine_type: a prefill instance must be vllm",
    }
    for name, cfg in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"motor_coordinator_config": cfg}))
        proc = subprocess.run(
            [sys.executable, "app.py", "--config", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 2, (name, proc.stdout[-2000:], proc.stderr[-2000:])
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("config error: motor_coordinator_config."), (
            name,
            proc.stderr[-2000:],
        )
        assert "Traceback" not in proc.stdout + proc.stderr
        assert lines[0].startswith(f"config error: motor_coordinator_config.{named.get(name, '')}"), lines[0]
    assert (
        "api_config.coordinator_api_mgmt_port: cannot listen on 127.0.0.1:%d (Address already in use)"
        % taken.getsockname()[1]
        in lines[0]
    )
    taken.close()


def test_a_config_path_that_cannot_be_read_is_one_line_not_a_traceback(tmp_path):
    """A directory gave a traceback (only a missing file was caught)."""
    for path, why in ((tmp_path, "Is a directory"), (tmp_path / "missing.json", "No such file or directory")):
        proc = subprocess.run(
            [sys.executable, "app.py", "--config", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 2, (path, proc.stderr[-2000:])
        assert proc.stderr.strip().splitlines() == [f"config error: {path}: {why}"], proc.stderr[-2000:]


def test_a_config_nested_too_deeply_is_one_line_not_a_traceback(tmp_path):
    """json's decoder recursed into a RecursionError, which was not caught."""
    path = tmp_path / "deep.json"
    path.write_text('{"motor_coordinator_config": {"x": ' + "[" * 100000 + "]" * 100000 + "}}")
    proc = subprocess.run(
        [sys.executable, "app.py", "--config", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [f"config error: {path}: not valid JSON (nested too deeply)"], (
        proc.stderr[-2000:]
    )


@pytest.mark.parametrize("section", ["api_key_config", "mgmt_api_key_config"])
@pytest.mark.parametrize(
    "name, ok",
    [
        ("X-Api-Key", True),
        ("x_key.v2!#$%&'*+^`|~", True),
        ("Bad Header:", False),
        ("Authorization:", False),
        ("X-Key\n", False),
        ("Ключ", False),
        ("", False),
    ],
)
def test_the_api_key_header_name_must_be_an_http_token(section, name, ok):
    cfg = {section: {"header_name": name}}
    if ok:
        assert getattr(settings_from_dict(cfg), section.replace("_config", "")).header_name == name
    else:
        message = refused(cfg)
        assert message.startswith(f"motor_coordinator_config.{section}.header_name: must ") and "\n" not in message, (
            message
        )


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), 10**400])
def test_numbers_must_be_finite(value):
    """Python's json reads NaN and Infinity: a timeout or rate of NaN compares false with every bound (and
    an integer too large for a float overflowed with a traceback)."""
    raw = json.loads(json.dumps({"exception_config": {"infer_timeout": value}}))
    with pytest.raises(ConfigError, match=r"exception_config\.infer_timeout: must be a number"):
        settings_from_dict(raw)


@pytest.mark.parametrize("value,ok", [(0, True), (3, True), (30, True), (1, False), (2.9, False), (-1, False)])
def test_the_worker_watchdog_timeout_is_off_or_at_least_3_s(value, ok):
    raw = {"motor_coordinator_config": {"inference_workers_config": {"worker_watchdog_timeout": value}}}
    if ok:
        assert settings_from_dict(raw).worker_watchdog_timeout_s == value
    else:
        with pytest.raises(ConfigError, match=r"inference_workers_config\.worker_watchdog_timeout"):
            settings_from_dict(raw)


def test_retry_backoff_doubles_from_retry_delay_and_is_capped():
    s = Settings(retry_delay_s=0.2)
    assert [s.backoff_s(i) for i in range(4)] == [0.2, 0.4, 0.8, 1.6]
    assert s.backoff_s(20) == MAX_BACKOFF_S  # uncapped: 58 hours before the 21st retry
    assert Settings(retry_delay_s=100).backoff_s(0) == MAX_BACKOFF_S


@pytest.mark.parametrize(
    "key,attr,default",
    [
        ("request_head_timeout", "request_head_timeout_s", 10.0),
        ("request_body_timeout", "request_body_timeout_s", 60.0),
        ("max_connections_per_worker", "max_connections_per_worker", 4096),
    ],
)
def test_the_connection_bounds_have_defaults_and_must_be_positive(key, attr, default):
    assert getattr(settings_from_dict({}), attr) == default
    raw = {"motor_coordinator_config": {"inference_workers_config": {key: 3}}}
    assert getattr(settings_from_dict(raw), attr) == 3
    for bad in (0, -1, "10"):
        message = refused({"inference_workers_config": {key: bad}})
        assert message.startswith(f"motor_coordinator_config.inference_workers_config.{key}: must "), message


def test_a_config_with_a_huge_integer_is_one_line_not_a_traceback(tmp_path):
    """Python refuses to read an integer of more than 4300 digits (a ValueError, which was not caught)."""
    path = tmp_path / "huge.json"
    path.write_text('{"motor_coordinator_config": {"x": 1' + "0" * 5000 + "}}")
    proc = subprocess.run(
        [sys.executable, "app.py", "--config", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(f"config error: {path}: not valid JSON ("), line


@pytest.mark.parametrize(
    "section, enable",
    [
        ({}, False),
        ({"reschedule_config": {"enable": True}}, True),
        ({"recompute_enabled": True}, True),  # PyMotor's deprecated spelling
        ({"recompute_enabled": False, "reschedule_config": {"enable": False}}, False),
        ({"recompute_enabled": True, "recompute_max_retry": 9}, True),  # PyMotor's removed key: ignored
    ],
)
def test_reschedule_config_and_its_deprecated_alias(section, enable):
    s = settings_from_dict({"exception_config": section})
    assert s.reschedule.enable is enable
    assert s.reschedule.max_continuations == 2


@pytest.mark.parametrize(
    "section, key",
    [
        ({"recompute_enabled": True, "reschedule_config": {"enable": False}}, "exception_config.recompute_enabled"),
        ({"recompute_enabled": "yes"}, "exception_config.recompute_enabled"),
        ({"reschedule_config": {"enable": 1}}, "exception_config.reschedule_config.enable"),
        ({"reschedule_config": {"max_continuations": 0}}, "exception_config.reschedule_config.max_continuations"),
    ],
)
def test_a_reschedule_config_the_coordinator_cannot_honour_names_its_key(section, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        settings_from_dict({"exception_config": section})


@pytest.mark.parametrize(
    ("cluster", "why"),
    [
        ({"redis_url": "http://127.0.0.1:6379"}, "redis_url: must be a redis:// or rediss:// URL"),
        (
            {"redis_url": "redis://127.0.0.1:6379", "redis_password_file": "/nonexistent/pw"},
            "redis_password_file: cannot read",
        ),
        ({"sync_interval_ms": 5}, "sync_interval_ms: must be 10..1000"),
        ({"replica_ttl_s": 0.1}, "replica_ttl_s: must be >= 0.5"),
        ({"key_prefix": ""}, "key_prefix:"),
    ],
)
def test_a_cluster_config_that_cannot_work_is_refused_naming_its_key(cluster, why):
    assert refused(coordinator_config([union(1, "127.0.0.1:8000")], cluster_config=cluster)).startswith(
        f"motor_coordinator_config.cluster_config.{why}"
    )


def test_cluster_mode_is_off_by_default_and_its_defaults_have_units():
    s = settings_from_dict(coordinator_config([union(1, "127.0.0.1:8000")]))
    c = s.cluster
    assert (c.redis_url, c.key_prefix, c.sync_interval_ms, c.replica_ttl_s, c.redis_timeout_ms) == (
        "",
        "motor:",
        50,
        3.0,
        250,
    )


def test_pymotor_standby_without_a_shared_store_is_refused_with_what_to_set():
    cfg = coordinator_config([union(1, "127.0.0.1:8000")], standby_config={"enable_master_standby": True})
    why = refused(cfg)
    assert why.startswith("motor_coordinator_config.standby_config.enable_master_standby: ")
    assert "set cluster_config.redis_url" in why
