"""Reading a user_config.json into Settings: each section validated by its model, errors in one line.

`load_settings(path)` reads a whole `user_config.json` (using its `motor_coordinator_config` object) or that
object alone, warns about unknown keys, and raises `ConfigError` naming the key path of the first invalid
value: pydantic's error for it, said as the Coordinator has always said it ("must be an integer").
"""

from __future__ import annotations

import json
import logging
import os
import socket
import ssl
from dataclasses import replace
from typing import Annotated, Any, get_args, get_origin

from state.shared import MAX_SLOTS

from .addresses import address_key
from .pymotor import TOP_LEVEL, adopt, finish
from .sections import (
    ROOT_KEY,
    ApiConfig,
    ApiKeyConfig,
    ApiSection,
    ClusterConfig,
    ExceptionSection,
    Instance,
    InstanceEntry,
    KvEventConfig,
    LogConfig,
    MgmtApiKeySection,
    ModelConfig,
    ModelList,
    RateLimitConfig,
    SchedulerSection,
    ShutdownConfig,
    TlsConfig,
    TlsSection,
    WorkersConfig,
)
from .settings import Settings
from .tenancy import Tenant, TenantConfig, TenantLimits, TenantSection
from .validation import ConfigError, config_key, config_keys, validate

log = logging.getLogger("coordinator.config")

DEFAULT_CONFIG_PATH = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "deployer", "user_config.json"
)


def _dataclass_of(schema: Any) -> type:
    return get_args(schema)[0] if get_origin(schema) is Annotated else schema


def warn_unknown(path: str, data: dict, cls: type) -> None:
    known = {name for names in config_keys(cls).values() for name in names}
    for key in sorted(set(data) - known):
        log.warning("config: unknown key %s.%s%s ignored", ROOT_KEY, path, key)


def parse_instance(path: str, raw: Any) -> Instance:
    """Validate one instance object (config file or /instances/refresh body)."""
    return validate(InstanceEntry, raw, f"{ROOT_KEY}.{path}")


def parse_models(path: str, raw: Any) -> tuple[ModelConfig, ...]:
    """Validate the served models (a config file's `models`, or the deployer's input before it reorders them)."""
    models = validate(ModelList, raw, f"{ROOT_KEY}.{path}")
    for i, m in enumerate(raw):
        warn_unknown(f"{path}[{i}].", m, ModelConfig)
    return models


def check_instance_set(instances: list[Instance], path: str) -> None:
    """What the instance registry (scheduling/registry.py) would refuse at start-up: a duplicate instance id,
    an engine address named twice, more endpoints than the shared tables have slots."""
    seen: set[int] = set()
    owner: dict[str, int] = {}
    for i, inst in enumerate(instances):
        if inst.id in seen:
            raise ConfigError(f"{ROOT_KEY}.{path}[{i}].id: duplicate instance id {inst.id}")
        seen.add(inst.id)
        for j, ep in enumerate(inst.endpoints):
            addr = address_key(ep.address)
            if addr in owner:
                raise ConfigError(
                    f"{ROOT_KEY}.{path}[{i}].endpoints[{j}].address: {addr} is already the address of instance "
                    f"{owner[addr]}"
                )
            owner[addr] = inst.id
    total = sum(len(inst.endpoints) for inst in instances)
    if total > MAX_SLOTS:
        raise ConfigError(f"{ROOT_KEY}.{path}: {total} endpoints in all: at most {MAX_SLOTS}")


def _check_host(section: str, api: ApiConfig) -> None:
    """The Coordinator binds its ports to this host at start-up: it must resolve now (engines' hosts are not
    checked: an engine that is not up yet is only unhealthy until it is)."""
    try:
        socket.getaddrinfo(api.host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as e:
        raise ConfigError(
            f"{ROOT_KEY}.{section}.{config_key(ApiConfig, 'host')}: {api.host!r} does not resolve to an address to "
            f"listen on ({e})"
        ) from None


def _check_cluster(section: str, cluster: ClusterConfig) -> None:
    """The store's password file is read by every worker at its start: it must be readable now."""
    path = cluster.redis_password_file
    if path and cluster.redis_url:
        try:
            with open(path, encoding="utf-8"):
                pass
        except OSError as e:
            raise ConfigError(
                f"{ROOT_KEY}.{section}.redis_password_file: cannot read {path!r} ({e.strerror})"
            ) from None


def _with_key_file(section: str, cfg: ApiKeyConfig) -> ApiKeyConfig:
    """The key in api_key_file (its one line) added to valid_keys, as MindIE-PyMotor's management key is given."""
    path = f"{ROOT_KEY}.{section}.api_key_file"
    try:
        with open(cfg.api_key_file, encoding="utf-8") as f:
            key = f.read().strip()
    except (OSError, UnicodeError) as e:
        raise ConfigError(f"{path}: cannot read {cfg.api_key_file!r} ({getattr(e, 'strerror', None) or e})") from None
    if not key or "\n" in key:
        raise ConfigError(f"{path}: {cfg.api_key_file!r} must hold one key on one line")
    return replace(cfg, valid_keys=(*cfg.valid_keys, key))


def _warn_unknown_in_tenants(key: str, data: dict) -> None:
    for i, t in enumerate(data.get("tenants") or ()):
        warn_unknown(f"{key}.tenants[{i}].", t, Tenant)
    warn_unknown(f"{key}.default.", data.get("default") or {}, TenantLimits)


def _check_tenant_keys(s: Settings) -> None:
    """A tenant's keys are valid keys of the inference port: they need keys on, and name one tenant each."""
    owned = [(i, t) for i, t in enumerate(s.tenants.tenants) if t.keys] if s.tenants is not None else []
    if owned and not s.api_key.enable_api_key:
        raise ConfigError(
            f"{ROOT_KEY}.tenant_config.tenants[{owned[0][0]}].keys: a tenant's keys need "
            f"{ROOT_KEY}.api_key_config.enable_api_key true (with keys off every request is the default tenant)"
        )
    if s.api_key.enable_api_key and not (s.api_key.valid_keys or owned):
        raise ConfigError(
            f"{ROOT_KEY}.api_key_config.valid_keys: must list at least one key when enable_api_key is true (or "
            "tenant_config's tenants their keys)"
        )
    for i, t in owned:
        if set(t.keys) & set(s.api_key.valid_keys):
            raise ConfigError(
                f"{ROOT_KEY}.tenant_config.tenants[{i}].keys: a key also in api_key_config.valid_keys (the default"
                " tenant's): one key, one tenant"
            )


def _check_tls_files(section: str, tls: TlsConfig) -> None:
    """With TLS on, the certificate and key must load now, not fail in every worker at start-up."""
    if not tls.enable_tls:
        return
    path = f"{ROOT_KEY}.{section}"
    for key in ("cert_file", "key_file", "ca_file", "passwd_file", "crl_file"):
        name = getattr(tls, key)
        if name and not (os.path.isfile(name) and os.access(name, os.R_OK)):
            raise ConfigError(f"{path}.{key}: {name!r} is not a readable file")
    if tls.crl_file and not tls.ca_file:
        raise ConfigError(f"{path}.crl_file: needs ca_file (it revokes certificates that ca_file signed)")
    try:
        server_tls_context(tls)
    except TlsFileError as e:
        raise ConfigError(f"{path}.{e.key}: {e}") from None


class TlsFileError(ValueError):
    """A TLS file that does not load; `key` names its key."""

    def __init__(self, key: str, why: str):
        super().__init__(why)
        self.key = key


def server_tls_context(tls: TlsConfig) -> ssl.SSLContext | None:
    """A port's server TLS: its certificate and key (the key's password in passwd_file); with `ca_file`, a client
    certificate, when one is presented, must be signed by it (and not be in crl_file). None is required:
    kubelet probes, Prometheus and engines calling /v1/metaserver present none."""
    if not tls.enable_tls:
        return None

    def password() -> bytes:
        if not tls.passwd_file:
            raise ValueError("the key is encrypted and no passwd_file is given")
        with open(tls.passwd_file, "rb") as f:
            return f.read().strip()

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(tls.cert_file, tls.key_file, password=password)
    except (ssl.SSLError, ValueError) as e:
        raise TlsFileError("cert_file", f"cannot load {tls.cert_file!r} with key_file {tls.key_file!r}: {e}") from None
    for key in ("ca_file", "crl_file") if tls.ca_file else ():
        name = getattr(tls, key)
        if name:
            try:
                context.load_verify_locations(name)
            except ssl.SSLError as e:
                raise TlsFileError(key, f"cannot load {name!r}: {e}") from None
    if tls.ca_file:
        if tls.crl_file:
            context.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
        context.verify_mode = ssl.CERT_OPTIONAL
    return context


# The sections of motor_coordinator_config in the order they are read: (key, schema, the Settings attribute
# that holds the section, or None where the section's fields are Settings' own).
SECTIONS = (
    ("api_config", ApiSection, None),
    ("inference_workers_config", WorkersConfig, None),
    ("api_key_config", ApiKeyConfig, "api_key"),  # its keys may be tenant_config's too: _check_tenant_keys
    ("mgmt_api_key_config", MgmtApiKeySection, "mgmt_api_key"),
    ("infer_tls_config", TlsSection, "infer_tls"),
    ("mgmt_tls_config", TlsSection, "mgmt_tls"),
    ("scheduler_config", SchedulerSection, None),
    ("exception_config", ExceptionSection, None),
    ("rate_limit_config", RateLimitConfig, None),
    ("shutdown_config", ShutdownConfig, None),
    ("log_config", LogConfig, None),
    ("cluster_config", ClusterConfig, "cluster"),
    ("tenant_config", TenantSection, "tenants"),
    ("kv_event_config", KvEventConfig, "kv_events"),
)
OPTIONAL = {"tenant_config"}  # absent, the Settings attribute is None: it means something of its own
# What only the machine that runs the Coordinator can answer, checked after the section is read.
_ON_THIS_HOST = {
    "api_config": _check_host,
    "infer_tls_config": _check_tls_files,
    "mgmt_tls_config": _check_tls_files,
    "cluster_config": _check_cluster,
}


def settings_from_dict(raw: dict, source_path: str = "", on_this_host: bool = True) -> Settings:
    """Build Settings from a whole user_config.json object or its motor_coordinator_config alone.

    `on_this_host` False: the file is checked for another machine (the deployer renders it for a pod), so
    what only that machine can answer is not checked: that the host resolves, that the TLS files load.
    """
    whole = raw if isinstance(raw, dict) and ROOT_KEY in raw else None
    if whole is not None:
        raw = raw[ROOT_KEY]
    if not isinstance(raw, dict):
        raise ConfigError(f"{ROOT_KEY}: must be a JSON object")
    given, raw = raw, adopt(raw, whole)
    own: dict[str, Any] = {}  # Settings' fields, from the sections whose fields they are
    held: dict[str, Any] = {}  # the sections Settings holds as one object
    for key, schema, attr in SECTIONS:
        if key in OPTIONAL and key not in raw:
            continue
        data = raw.get(key, {})
        section = validate(schema, data, f"{ROOT_KEY}.{key}")
        if on_this_host and key in _ON_THIS_HOST:
            _ON_THIS_HOST[key](key, section)
        if on_this_host and getattr(section, "api_key_file", ""):
            section = _with_key_file(key, section)
        warn_unknown(f"{key}.", data, _dataclass_of(schema))
        if isinstance(section, TenantConfig):
            _warn_unknown_in_tenants(key, data)
        if attr is None:
            own.update(vars(section))
        else:
            held[attr] = section
    models = parse_models("models", raw.get("models", []))
    instances = validate(tuple[InstanceEntry, ...], raw.get("instances", []), f"{ROOT_KEY}.instances")
    check_instance_set(list(instances), "instances")
    known = {key for key, _, _ in SECTIONS} | {"models", "instances"} | TOP_LEVEL
    for key in sorted(set(raw) - known):
        log.warning("config: unknown key %s.%s ignored", ROOT_KEY, key)
    settings = Settings(**own, **held, models=models, instances=instances, source_path=source_path)
    _check_tenant_keys(settings)
    return finish(settings, given, whole)


def resolve_config_path(cli_path: str | None) -> str:
    return cli_path or os.environ.get("USER_CONFIG_PATH") or DEFAULT_CONFIG_PATH


def read_config(path: str) -> bytes:
    """The config file's bytes, or ConfigError saying in one line why they cannot be read."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:  # missing, a directory, no permission: said in one line like any other config error
        raise ConfigError(f"{path}: {e.strerror or e}") from None


def parse_config(data: bytes, path: str) -> Any:
    """A config file's JSON, or ConfigError naming the file."""
    try:
        return json.loads(data)
    except ValueError as e:  # json's decode errors, UnicodeDecodeError, an integer over Python's digit limit
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:  # json's decoder recurses once per level of [ or {
        raise ConfigError(f"{path}: not valid JSON (nested too deeply)") from None


def load_settings(path: str) -> Settings:
    return settings_from_dict(parse_config(read_config(path), path), source_path=os.path.abspath(path))
