"""The Coordinator's typed settings: the single source of defaults, loaded and validated in one place.

`load_settings(path)` reads a whole `user_config.json` (using its `motor_coordinator_config` object)
or that object alone, warns about unknown keys, and raises `ConfigError` naming the key path of the
first invalid value. Config keys keep MindIE-PyMotor's names; the typed attributes carry units.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import os
import re
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any
from urllib.parse import urlsplit

from state.shared import MAX_SLOTS

log = logging.getLogger("coordinator.config")

DEFAULT_CONFIG_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "deployer", "user_config.json")
ROOT_KEY = "motor_coordinator_config"

ROLES = ("prefill", "decode", "union")
ENGINE_TYPES = ("vllm", "sglang", "mindie")
SCHEDULER_TYPES = ("round_robin", "load_balance", "kv_cache_affinity", "slo_aware")
PD_DISPATCH = ("handoff", "trigger")
ADMISSION = ("off", "queue", "reject")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
MIN_WATCHDOG_S = 3.0  # workers write a heartbeat once a second; the supervisor looks twice a second
MAX_BACKOFF_S = 10.0  # the longest wait before one retry, however many retries and however long retry_delay
ENGINE_SCHEMES = ("http", "https")
# The network location of an engine address: a name or IPv4 address, or an IPv6 address in brackets (unbracketed,
# its colons cannot be told from the port's), then the port.
_ENGINE_NETLOC = re.compile(r"(?:\[(?P<ipv6>[0-9A-Fa-f:.]+)\]|[A-Za-z0-9_.-]+):(?P<port>[0-9]{1,5})")
HTTP_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110 token: what a header name may be
ADDRESS_FORMS = "host:port, http://host:port or https://host:port (an IPv6 host in brackets: [::1]:8000)"


class ConfigError(ValueError):
    """An invalid configuration value; the message starts with the key path."""


@dataclass(frozen=True)
class Endpoint:
    id: int
    address: str  # "host:port"

    @property
    def base_url(self) -> str:
        return engine_url(self.address)


def engine_url(address: str) -> str:
    """The URL engines.py sends to for an engine address: a bare "host:port" is http."""
    return address if "://" in address else f"http://{address}"


@lru_cache(maxsize=4096)
def split_address(address: str) -> tuple[str, int]:
    """(host, port) of an engine address, read as engines.py reads it (urlsplit of `engine_url`), or ValueError
    saying why it cannot be one. The host comes lowercased and without brackets."""
    if not address.isprintable() or " " in address:  # urlsplit drops tabs and newlines, engines.py would too
        raise ValueError(f"must be {ADDRESS_FORMS}, without spaces")
    url = engine_url(address)
    try:
        parts = urlsplit(url)
    except ValueError:  # a bracketed host that is not an IPv6 address
        parts = None
    if parts is not None and parts.scheme not in ENGINE_SCHEMES:
        raise ValueError("the scheme must be http or https")
    netloc = _ENGINE_NETLOC.fullmatch(parts.netloc) if parts is not None else None
    if netloc is None or url.partition("://")[2] != parts.netloc:  # a path, query or fragment, even an empty one
        raise ValueError(f"must be {ADDRESS_FORMS}")
    if netloc["ipv6"] is not None:
        try:
            ipaddress.IPv6Address(netloc["ipv6"])
        except ValueError:
            raise ValueError(f"must be {ADDRESS_FORMS}") from None
    port = int(netloc["port"])
    if not 1 <= port <= 65535:
        raise ValueError("the port must be 1..65535")
    return parts.hostname or "", port


def address_key(address: str) -> str:
    """The engine a valid address names, as "host:port": `HOST:80`, `http://host:80` and `https://host:80` are one
    engine (one socket), and so are two spellings of one IPv6 address (`[::1]` and `[0::1]`)."""
    host, port = split_address(address)
    if ":" in host:
        host = f"[{ipaddress.IPv6Address(host).compressed}]"
    return f"{host}:{port}"


@dataclass(frozen=True)
class Instance:
    id: int
    role: str
    model_name: str
    endpoints: tuple[Endpoint, ...]
    engine_type: str = "vllm"

    def to_json(self) -> dict:
        return {
            "id": self.id,
            "role": self.role,
            "model_name": self.model_name,
            "engine_type": self.engine_type,
            "endpoints": [{"id": e.id, "address": e.address} for e in self.endpoints],
        }


@dataclass(frozen=True)
class ModelConfig:
    id: str
    slo_ttft_ms: int = 1000
    slo_tpot_ms: int = 50
    p_max_seqlen: int = 8192
    d_max_seqlen: int = 8192
    engine_type: str = "vllm"
    tokenizer_path: str = ""


@dataclass(frozen=True)
class TlsConfig:
    enable_tls: bool = False
    cert_file: str = ""
    key_file: str = ""
    ca_file: str = ""


@dataclass(frozen=True)
class ApiKeyConfig:
    enable_api_key: bool = False
    valid_keys: tuple[str, ...] = ()
    header_name: str = "Authorization"
    key_prefix: str = "Bearer "


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    infer_port: int = 1025
    mgmt_port: int = 1026
    obs_port: int = 1027
    num_workers: int = 1
    worker_watchdog_timeout_s: float = 30.0
    api_key: ApiKeyConfig = ApiKeyConfig()
    mgmt_api_key: ApiKeyConfig = ApiKeyConfig(header_name="X-Motor-Management-Key", key_prefix="")
    infer_tls: TlsConfig = TlsConfig()
    mgmt_tls: TlsConfig = TlsConfig()
    scheduler_type: str = "slo_aware"
    pd_dispatch: str = "handoff"
    admission: str = "off"
    admission_queue_size: int = 256
    metrics_scrape_interval_s: float = 1.0
    health_check_interval_s: float = 1.0
    health_check_timeout_failures: int = 3
    breaker_failure_threshold: int = 3
    breaker_open_s: float = 5.0
    kv_affinity_block_size: int = 16
    affinity_overload_factor: float = 2.0
    max_retry: int = 3
    retry_delay_s: float = 0.2
    first_token_timeout_s: float = 600.0
    infer_timeout_s: float = 3600.0
    connect_timeout_s: float = 10.0
    stream_idle_timeout_s: float = 300.0
    stream_keepalive_interval_s: float = 15.0
    kv_release_path: str = ""
    max_request_body_bytes: int = 16 * 1024 * 1024
    max_inflight_requests: int = 0
    requests_per_second: float = 0.0
    drain_timeout_s: float = 30.0
    log_level: str = "INFO"
    access_log: bool = False
    models: tuple[ModelConfig, ...] = ()
    instances: tuple[Instance, ...] = ()
    source_path: str = ""

    def backoff_s(self, attempt: int) -> float:
        """The wait after failed attempt `attempt` (0 = the first): retry_delay doubled each time, capped."""
        return min(self.retry_delay_s * 2**attempt, MAX_BACKOFF_S)

    def model(self, model_id: str) -> ModelConfig | None:
        for m in self.models:
            if m.id == model_id:
                return m
        return None


# -- validation helpers ------------------------------------------------------------------------


def _fail(path: str, why: str) -> None:
    raise ConfigError(f"{ROOT_KEY}.{path}: {why}")


def _int(path: str, v: Any, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        _fail(path, "must be an integer")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        _fail(path, f"must be {lo}..{hi}" if hi is not None else f"must be >= {lo}")
    return v


def _num(path: str, v: Any, lo: float = 0.0, positive: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        _fail(path, "must be a number")
    try:
        number = float(v)
    except OverflowError:  # an integer of hundreds of digits
        number = math.inf
    if not math.isfinite(number):
        _fail(path, "must be a number")  # NaN and Infinity too (Python's json reads them)
    if number < lo or (positive and number <= 0):
        _fail(path, "must be > 0" if positive else f"must be >= {lo}")
    return number


def _watchdog_timeout(path: str, v: Any) -> float:
    seconds = _num(path, v)
    if 0 < seconds < MIN_WATCHDOG_S:
        _fail(path, f"must be 0 (off) or at least {MIN_WATCHDOG_S:g} (workers beat once a second)")
    return seconds


def _bool(path: str, v: Any) -> bool:
    if not isinstance(v, bool):
        _fail(path, "must be true or false")
    return v


def _str(path: str, v: Any, choices: tuple[str, ...] | None = None, nonempty: bool = False) -> str:
    if not isinstance(v, str):
        _fail(path, "must be a string")
    if choices is not None and v not in choices:
        _fail(path, f"must be one of {', '.join(choices)}")
    if nonempty and not v:
        _fail(path, "must not be empty")
    return v


def _obj(path: str, v: Any) -> dict:
    if not isinstance(v, dict):
        _fail(path, "must be an object")
    return v


def _release_path(path: str, v: Any) -> str:
    v = _str(path, v)
    if v and not v.startswith("/"):
        _fail(path, "must be empty or a path starting with /")
    return v


def _header_name(path: str, v: Any) -> str:
    v = _str(path, v, nonempty=True)
    if not HTTP_TOKEN.fullmatch(v):  # no client could send it: every request would get 401
        _fail(path, f"must be an HTTP header name: letters, digits and !#$%&'*+-.^_`|~ (got {v!r})")
    return v


def _port(path: str, v: Any) -> int:
    return _int(path, v, 1, 65535)


class _Section:
    """Reads one config object, remembering which keys were consumed so the rest can be warned about."""

    def __init__(self, data: dict, path: str):
        self.data, self.path, self.used = data, path, set()

    def get(self, key: str, default: Any, check: Callable[[str, Any], Any]) -> Any:
        self.used.add(key)
        if key not in self.data:
            return default
        return check(f"{self.path}{key}", self.data[key])

    def section(self, key: str) -> _Section:
        self.used.add(key)
        return _Section(_obj(f"{self.path}{key}", self.data.get(key, {})), f"{self.path}{key}.")

    def warn_unknown(self) -> None:
        for key in sorted(set(self.data) - self.used):
            log.warning("config: unknown key %s.%s%s ignored", ROOT_KEY, self.path, key)


def parse_instance(path: str, raw: Any, known_models: set[str] | None = None) -> Instance:
    """Validate one instance object (config file or /instances/refresh body)."""
    obj = _obj(path, raw)
    iid = _int(f"{path}.id", obj.get("id"), 0)
    role = _str(f"{path}.role", obj.get("role"), ROLES)
    model_name = _str(f"{path}.model_name", obj.get("model_name"), nonempty=True)
    engine_type = _str(f"{path}.engine_type", obj.get("engine_type", "vllm"), ENGINE_TYPES)
    eps = obj.get("endpoints")
    if not isinstance(eps, list) or not eps:
        _fail(f"{path}.endpoints", "must be a non-empty list")
    endpoints = []
    seen: set[int] = set()
    for j, ep in enumerate(eps):
        ep = _obj(f"{path}.endpoints[{j}]", ep)
        address = _str(f"{path}.endpoints[{j}].address", ep.get("address"), nonempty=True)
        try:
            split_address(address)
        except ValueError as e:
            _fail(f"{path}.endpoints[{j}].address", f"{e} (got {address!r})")
        eid = _int(f"{path}.endpoints[{j}].id", ep.get("id", j), 0)
        if eid in seen:  # logs, GET /instances and the metrics' (instance, endpoint) labels name endpoints by id
            _fail(f"{path}.endpoints[{j}].id", f"duplicate endpoint id {eid} in instance {iid}")
        seen.add(eid)
        endpoints.append(Endpoint(eid, address))
    return Instance(iid, role, model_name, tuple(endpoints), engine_type)


def parse_models(path: str, raw: Any) -> tuple[ModelConfig, ...]:
    """Validate the served models (a config file's `models`, or the deployer's input before it reorders them)."""
    if not isinstance(raw, list):
        _fail(path, "must be a list")
    models = []
    for i, m in enumerate(raw):
        ms = _Section(_obj(f"{path}[{i}]", m), f"{path}[{i}].")
        models.append(
            ModelConfig(
                id=ms.get("id", None, lambda p, v: _str(p, v, nonempty=True))
                or _fail(f"{path}[{i}].id", "is required"),
                slo_ttft_ms=ms.get("slo_ttft", 1000, lambda p, v: _int(p, v, 1)),
                slo_tpot_ms=ms.get("slo_tpot", 50, lambda p, v: _int(p, v, 1)),
                p_max_seqlen=ms.get("p_max_seqlen", 8192, lambda p, v: _int(p, v, 1)),
                d_max_seqlen=ms.get("d_max_seqlen", 8192, lambda p, v: _int(p, v, 1)),
                engine_type=ms.get("engine_type", "vllm", lambda p, v: _str(p, v, ENGINE_TYPES)),
                tokenizer_path=ms.get("tokenizer_path", "", _str),
            )
        )
        ms.warn_unknown()
    if len({m.id for m in models}) != len(models):
        _fail(path, "model ids must be unique")
    return tuple(models)


def _tls(sec: _Section) -> TlsConfig:
    # MindIE spells the switch tls_enable; either spelling turns TLS on, both only if they agree.
    enable, alias = sec.get("enable_tls", None, _bool), sec.get("tls_enable", None, _bool)
    if enable is not None and alias is not None and enable != alias:
        _fail(f"{sec.path}tls_enable", "contradicts enable_tls (MindIE's spelling of the same switch)")
    tls = TlsConfig(
        enable_tls=bool(alias) if enable is None else enable,
        cert_file=sec.get("cert_file", "", _str),
        key_file=sec.get("key_file", "", _str),
        ca_file=sec.get("ca_file", "", _str),
    )
    if tls.enable_tls and not (tls.cert_file and tls.key_file):
        _fail(f"{sec.path}cert_file", "cert_file and key_file are required when enable_tls is true")
    sec.warn_unknown()
    return tls


def _api_key(sec: _Section, default: ApiKeyConfig) -> ApiKeyConfig:
    def keys(path: str, v: Any) -> tuple[str, ...]:
        if not isinstance(v, list) or not all(isinstance(k, str) and k for k in v):
            _fail(path, "must be a list of non-empty strings")
        return tuple(v)

    cfg = ApiKeyConfig(
        enable_api_key=sec.get("enable_api_key", default.enable_api_key, _bool),
        valid_keys=sec.get("valid_keys", default.valid_keys, keys),
        header_name=sec.get("header_name", default.header_name, _header_name),
        key_prefix=sec.get("key_prefix", default.key_prefix, _str),
    )
    if cfg.enable_api_key and not cfg.valid_keys:
        _fail(f"{sec.path}valid_keys", "must list at least one key when enable_api_key is true")
    sec.warn_unknown()
    return cfg


def settings_from_dict(raw: dict, source_path: str = "", on_this_host: bool = True) -> Settings:
    """Build Settings from a whole user_config.json object or its motor_coordinator_config alone.

    `on_this_host` False: the file is checked for another machine (the deployer renders it for a pod), so
    what only that machine can answer is not checked: that the host resolves, that the TLS files load.
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"{ROOT_KEY}: must be a JSON object")
    if ROOT_KEY in raw:
        raw = raw[ROOT_KEY]
        if not isinstance(raw, dict):
            raise ConfigError(f"{ROOT_KEY}: must be a JSON object")
    d = Settings()
    top = _Section(raw, "")

    api = top.section("api_config")
    host = api.get("coordinator_api_host", d.host, lambda p, v: _str(p, v, nonempty=True))
    infer_port = api.get("coordinator_api_infer_port", d.infer_port, _port)
    mgmt_port = api.get("coordinator_api_mgmt_port", d.mgmt_port, _port)
    obs_port = api.get("coordinator_obs_port", d.obs_port, _port)
    taken: dict[int, str] = {}  # port: the key that has it
    for key, port in (
        ("coordinator_api_infer_port", infer_port),
        ("coordinator_api_mgmt_port", mgmt_port),
        ("coordinator_obs_port", obs_port),
    ):
        if port in taken:  # the later key clashes, as the deployer says it
            _fail(
                f"api_config.{key}",
                f"clashes with {ROOT_KEY}.api_config.{taken[port]} ({port}); the three ports must differ",
            )
        taken[port] = key
    if on_this_host:
        _check_host("api_config.coordinator_api_host", host)
    api.warn_unknown()

    workers = top.section("inference_workers_config")
    num_workers = workers.get("num_workers", d.num_workers, lambda p, v: _int(p, v, 1, 64))
    worker_watchdog_timeout_s = workers.get("worker_watchdog_timeout", d.worker_watchdog_timeout_s, _watchdog_timeout)
    workers.warn_unknown()

    api_key = _api_key(top.section("api_key_config"), d.api_key)
    mgmt_api_key = _api_key(top.section("mgmt_api_key_config"), d.mgmt_api_key)
    infer_tls = _tls(top.section("infer_tls_config"))
    mgmt_tls = _tls(top.section("mgmt_tls_config"))
    if on_this_host:
        _check_tls_files("infer_tls_config", infer_tls)
        _check_tls_files("mgmt_tls_config", mgmt_tls)

    sched = top.section("scheduler_config")
    scheduler = dict(
        scheduler_type=sched.get("scheduler_type", d.scheduler_type, lambda p, v: _str(p, v, SCHEDULER_TYPES)),
        pd_dispatch=sched.get("pd_dispatch", d.pd_dispatch, lambda p, v: _str(p, v, PD_DISPATCH)),
        admission=sched.get("admission", d.admission, lambda p, v: _str(p, v, ADMISSION)),
        admission_queue_size=sched.get("admission_queue_size", d.admission_queue_size, lambda p, v: _int(p, v, 1)),
        metrics_scrape_interval_s=sched.get(
            "metrics_scrape_interval", d.metrics_scrape_interval_s, lambda p, v: _num(p, v, positive=True)
        ),
        health_check_interval_s=sched.get(
            "health_check_interval", d.health_check_interval_s, lambda p, v: _num(p, v, positive=True)
        ),
        health_check_timeout_failures=sched.get(
            "health_check_timeout_failures", d.health_check_timeout_failures, lambda p, v: _int(p, v, 1)
        ),
        breaker_failure_threshold=sched.get(
            "breaker_failure_threshold", d.breaker_failure_threshold, lambda p, v: _int(p, v, 1)
        ),
        breaker_open_s=sched.get("breaker_open_time", d.breaker_open_s, lambda p, v: _num(p, v, positive=True)),
        kv_affinity_block_size=sched.get(
            "kv_affinity_block_size", d.kv_affinity_block_size, lambda p, v: _int(p, v, 1)
        ),
        affinity_overload_factor=sched.get(
            "affinity_overload_factor", d.affinity_overload_factor, lambda p, v: _num(p, v, lo=1.0)
        ),
    )
    sched.warn_unknown()

    exc = top.section("exception_config")
    exception = dict(
        max_retry=exc.get("max_retry", d.max_retry, lambda p, v: _int(p, v, 0, 100)),
        retry_delay_s=exc.get("retry_delay", d.retry_delay_s, _num),
        first_token_timeout_s=exc.get(
            "first_token_timeout", d.first_token_timeout_s, lambda p, v: _num(p, v, positive=True)
        ),
        infer_timeout_s=exc.get("infer_timeout", d.infer_timeout_s, lambda p, v: _num(p, v, positive=True)),
        connect_timeout_s=exc.get("connect_timeout", d.connect_timeout_s, lambda p, v: _num(p, v, positive=True)),
        stream_idle_timeout_s=exc.get(
            "stream_idle_timeout", d.stream_idle_timeout_s, lambda p, v: _num(p, v, positive=True)
        ),
        stream_keepalive_interval_s=exc.get(
            "stream_keepalive_interval", d.stream_keepalive_interval_s, lambda p, v: _num(p, v, positive=True)
        ),
        kv_release_path=exc.get("kv_release_path", d.kv_release_path, _release_path),
    )
    exc.warn_unknown()

    rl = top.section("rate_limit_config")
    limits = dict(
        max_request_body_bytes=rl.get("max_request_body_size", d.max_request_body_bytes, lambda p, v: _int(p, v, 1024)),
        max_inflight_requests=rl.get("max_inflight_requests", d.max_inflight_requests, lambda p, v: _int(p, v, 0)),
        requests_per_second=rl.get("requests_per_second", d.requests_per_second, _num),
    )
    rl.warn_unknown()

    shutdown = top.section("shutdown_config")
    drain_timeout_s = shutdown.get("drain_timeout", d.drain_timeout_s, _num)
    shutdown.warn_unknown()

    logc = top.section("log_config")
    log_level = logc.get(
        "log_level", d.log_level, lambda p, v: _str(p, str(v).upper() if isinstance(v, str) else v, LOG_LEVELS)
    )
    access_log = logc.get("access_log", d.access_log, _bool)
    logc.warn_unknown()

    models = top.get("models", (), parse_models)

    raw_instances = top.get("instances", [], lambda p, v: v if isinstance(v, list) else _fail(p, "must be a list"))
    instances = [parse_instance(f"instances[{i}]", inst) for i, inst in enumerate(raw_instances)]
    check_instance_set(instances, "instances")
    top.warn_unknown()

    return Settings(
        host=host,
        infer_port=infer_port,
        mgmt_port=mgmt_port,
        obs_port=obs_port,
        num_workers=num_workers,
        worker_watchdog_timeout_s=worker_watchdog_timeout_s,
        api_key=api_key,
        mgmt_api_key=mgmt_api_key,
        infer_tls=infer_tls,
        mgmt_tls=mgmt_tls,
        drain_timeout_s=drain_timeout_s,
        log_level=log_level,
        access_log=access_log,
        models=models,
        instances=tuple(instances),
        source_path=source_path,
        **scheduler,
        **exception,
        **limits,
    )


def check_instance_set(instances: list[Instance], path: str) -> None:
    """What the instance registry (scheduling/registry.py) would refuse at start-up: a duplicate instance id,
    an engine address named twice, more endpoints than the shared tables have slots."""
    seen: set[int] = set()
    owner: dict[str, int] = {}
    for i, inst in enumerate(instances):
        if inst.id in seen:
            _fail(f"{path}[{i}].id", f"duplicate instance id {inst.id}")
        seen.add(inst.id)
        for j, ep in enumerate(inst.endpoints):
            addr = address_key(ep.address)
            if addr in owner:
                _fail(f"{path}[{i}].endpoints[{j}].address", f"{addr} is already the address of instance {owner[addr]}")
            owner[addr] = inst.id
    total = sum(len(inst.endpoints) for inst in instances)
    if total > MAX_SLOTS:
        _fail(path, f"{total} endpoints in all: at most {MAX_SLOTS}")


def _check_host(path: str, host: str) -> None:
    """The Coordinator binds its ports to this host at start-up: it must resolve now (engines' hosts are not
    checked: an engine that is not up yet is only unhealthy until it is)."""
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as e:
        _fail(path, f"{host!r} does not resolve to an address to listen on ({e})")


def _check_tls_files(section: str, tls: TlsConfig) -> None:
    """With TLS on, the certificate and key must load now, not fail in every worker at start-up."""
    if not tls.enable_tls:
        return
    for key in ("cert_file", "key_file", "ca_file"):
        name = getattr(tls, key)
        if name and not (os.path.isfile(name) and os.access(name, os.R_OK)):
            _fail(f"{section}.{key}", f"{name!r} is not a readable file")

    def no_password() -> bytes:
        raise ValueError("the key is encrypted")

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(tls.cert_file, tls.key_file, password=no_password)
    except (ssl.SSLError, ValueError) as e:
        _fail(f"{section}.cert_file", f"cannot load {tls.cert_file!r} with key_file {tls.key_file!r}: {e}")
    if tls.ca_file:
        try:
            context.load_verify_locations(tls.ca_file)
        except ssl.SSLError as e:
            _fail(f"{section}.ca_file", f"cannot load {tls.ca_file!r}: {e}")


def resolve_config_path(cli_path: str | None) -> str:
    return cli_path or os.environ.get("USER_CONFIG_PATH") or DEFAULT_CONFIG_PATH


def load_settings(path: str) -> Settings:
    try:
        with open(path, "rb") as f:
            raw = json.load(f)
    except OSError as e:  # missing, a directory, no permission: said in one line like any other config error
        raise ConfigError(f"{path}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:  # json's decoder recurses once per level of [ or {
        raise ConfigError(f"{path}: not valid JSON (nested too deeply)") from None
    return settings_from_dict(raw, source_path=os.path.abspath(path))


def with_models_for_instances(settings: Settings) -> Settings:
    """Every model named by an instance is served, with default SLOs when the config does not list it."""
    known = {m.id for m in settings.models}
    extra = tuple(
        ModelConfig(id=name) for name in dict.fromkeys(i.model_name for i in settings.instances) if name not in known
    )
    return replace(settings, models=settings.models + extra) if extra else settings


__all__ = [
    "DEFAULT_CONFIG_PATH",
    "ApiKeyConfig",
    "ConfigError",
    "Endpoint",
    "Instance",
    "ModelConfig",
    "Settings",
    "TlsConfig",
    "address_key",
    "check_instance_set",
    "load_settings",
    "parse_instance",
    "parse_models",
    "resolve_config_path",
    "settings_from_dict",
    "split_address",
    "with_models_for_instances",
]
