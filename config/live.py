"""Which settings a reloaded config file changes in a running Coordinator, and which wait for a restart.

`merge(running, reloaded)` gives the settings to run on: the running ones with every live key taken from the
reloaded file, and the config keys whose new value needs a restart (kept as they run). Live: API keys, the
limits (body size, in-flight cap, rate limit, the tenants' keys and quotas), the models (their SLOs, limits and tokenizers), retries and timeouts, the log
level, and the scheduler's health, scrape and breaker knobs. Everything else (ports, workers, TLS, instances:
those change through POST /instances/refresh; the policy, PD dispatch, admission, drain) needs a restart.

`check_nothing_left_out(running_raw, reloaded_raw)` refuses a file that leaves out a security or limit key
(of api_key_config, mgmt_api_key_config, rate_limit_config, tenant_config) or a whole such section the running file writes:
its default is the loosest value (no key asked for, no rate limit), so an omission, a truncated file or `{}`
would open what was closed. A new value takes effect only when written (`"enable_api_key": false` turns keys off).
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from typing import Any

from .sections import (
    ROOT_KEY,
    ApiConfig,
    ApiKeyConfig,
    ExceptionConfig,
    LogConfig,
    MgmtApiKeyConfig,
    RateLimitConfig,
    SchedulerConfig,
    ShutdownConfig,
    WorkersConfig,
)
from .settings import Settings, with_models_for_instances
from .tenancy import TenantConfig
from .validation import ConfigError, config_key, config_keys

_NOT_LIVE_EXCEPTIONS = {"kv_release_path"}  # the built-in simulator sets it at start


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


LIVE = (
    {"api_key", "mgmt_api_key", "tenants", "models", "log_level"}
    | _fields(RateLimitConfig)
    | (_fields(ExceptionConfig) - _NOT_LIVE_EXCEPTIONS)
    | {
        "health_check_interval_s",
        "health_check_timeout_failures",
        "metrics_scrape_interval_s",
        "breaker_failure_threshold",
        "breaker_open_s",
        "breaker_max_open_s",
        "enable_pd_separation_fallback_to_hybrid",
    }
)
# Settings' own attributes by section, to name a key that needs a restart as the file writes it.
_SECTION_OF = {
    name: (section, cls)
    for section, cls in (
        ("api_config", ApiConfig),
        ("inference_workers_config", WorkersConfig),
        ("scheduler_config", SchedulerConfig),
        ("exception_config", ExceptionConfig),
        ("rate_limit_config", RateLimitConfig),
        ("shutdown_config", ShutdownConfig),
        ("log_config", LogConfig),
    )
    for name in _fields(cls)
}
_HELD = {
    "infer_tls": "infer_tls_config",
    "mgmt_tls": "mgmt_tls_config",
    "instances": "instances",
    "tracer": "tracer_config",
    "cluster": "cluster_config",
    "tenants": "tenant_config",
    "kv_events": "kv_event_config",
}
_NOT_COMPARED = {"source_path", "models"}


def key_name(attr: str) -> str:
    """The config key path of a Settings attribute."""
    if attr in _SECTION_OF:
        section, cls = _SECTION_OF[attr]
        return f"{ROOT_KEY}.{section}.{config_key(cls, attr)}"
    return f"{ROOT_KEY}.{_HELD.get(attr, attr)}"


def overridden(from_file: Settings, running: Settings) -> frozenset[str]:
    """The attributes the start set otherwise than the file says (--workers, the built-in simulator's instances
    and release path): never taken from a reloaded file, nor said to need a restart."""
    return frozenset(
        f.name
        for f in dataclasses.fields(Settings)
        if f.name not in LIVE and getattr(from_file, f.name) != getattr(running, f.name)
    )


def merge(running: Settings, reloaded: Settings, kept: frozenset[str] = frozenset()) -> tuple[Settings, list[str]]:
    """(the settings to run on, the config keys whose change needs a restart, kept as they run). `kept`: the
    attributes `overridden` found."""
    changes = {a: getattr(reloaded, a) for a in LIVE - {"models"} if getattr(reloaded, a) != getattr(running, a)}
    # The models served: the file's, and those the running instances name (with default SLOs), as at start.
    served = with_models_for_instances(replace(reloaded, instances=running.instances)).models
    if served != running.models:
        changes["models"] = served
    restart = [
        key_name(f.name)
        for f in dataclasses.fields(Settings)
        if f.name not in LIVE
        and f.name not in _NOT_COMPARED
        and f.name not in kept
        and getattr(reloaded, f.name) != getattr(running, f.name)
    ]
    return (replace(running, **changes) if changes else running), restart


# The sections whose every key guards something: never loosened by leaving a key out.
GUARDED = (
    ("api_key_config", ApiKeyConfig),
    ("mgmt_api_key_config", MgmtApiKeyConfig),
    ("rate_limit_config", RateLimitConfig),
    ("tenant_config", TenantConfig),
)


def section_of(raw: Any, name: str) -> dict | None:
    """A section of a config file's JSON (a whole user_config.json or its motor_coordinator_config alone)."""
    root = raw.get(ROOT_KEY) if isinstance(raw, dict) and ROOT_KEY in raw else raw
    section = root.get(name) if isinstance(root, dict) else None
    return section if isinstance(section, dict) else None


def check_nothing_left_out(running_raw: Any, reloaded_raw: Any) -> None:
    """ConfigError naming the first guarded key, or whole section, that the running file writes and the
    reloaded file leaves out."""
    for name, cls in GUARDED:
        before, after = section_of(running_raw, name), section_of(reloaded_raw, name)
        known = {k for names in config_keys(cls).values() for k in names}
        gone = [f".{k}" for k in before or () if k in known and k not in (after or ())]
        if gone:
            where = f"{ROOT_KEY}.{name}" + ("" if after is None else gone[0])
            raise ConfigError(
                f"{where}: set in the running config and left out of this one; a security or limit setting is "
                "never dropped by omission (write the value wanted)"
            )
