"""The runtime settings: what app.py, handlers/, serving/, scheduling/ and engines/ read.

`Settings` is assembled from the section models (config.sections): it inherits the fields of the sections
whose keys are its own attributes (api_config, inference_workers_config, scheduler_config, ...), defaults
included, and holds the other sections as one object each (`api_key`, `infer_tls`, `models`, ...). It is a
plain frozen dataclass: reading it costs an attribute lookup, nothing validates it when code builds one
(`Settings(retry_delay_s=0.2)`, `dataclasses.replace`), and only config.load builds one from a file.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from functools import cached_property

from .sections import (
    ApiConfig,
    ApiKeyConfig,
    ClusterConfig,
    ExceptionConfig,
    Instance,
    KvEventConfig,
    LogConfig,
    MgmtApiKeyConfig,
    ModelConfig,
    RateLimitConfig,
    SchedulerConfig,
    ShutdownConfig,
    TlsConfig,
    TracerConfig,
    WorkersConfig,
)
from .tenancy import DEFAULT_TENANT, TenantConfig, TenantLimits

MAX_BACKOFF_S = 10.0  # the longest wait before one retry, however many retries and however long retry_delay
NO_LIMITS = TenantLimits()
MAX_TENANT_LABELS = 64  # tenants named in metric labels (serving/tenants.py); the others are `other`


@dataclass(frozen=True)
class Settings(LogConfig, ShutdownConfig, RateLimitConfig, ExceptionConfig, SchedulerConfig, WorkersConfig, ApiConfig):
    # The bases in reverse order of user_config.json: a dataclass takes its fields from the last base first.
    api_key: ApiKeyConfig = field(default_factory=ApiKeyConfig)
    mgmt_api_key: ApiKeyConfig = field(default_factory=MgmtApiKeyConfig)
    infer_tls: TlsConfig = field(default_factory=TlsConfig)
    mgmt_tls: TlsConfig = field(default_factory=TlsConfig)
    models: tuple[ModelConfig, ...] = ()
    instances: tuple[Instance, ...] = ()
    tracer: TracerConfig = field(default_factory=TracerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    tenants: TenantConfig | None = None  # tenant_config (None: absent, each distinct key is its own tenant)
    kv_events: KvEventConfig = field(default_factory=KvEventConfig)
    source_path: str = ""

    def rate_limit(self) -> tuple[float, float]:
        """(requests a second, the bucket's size): MindIE-PyMotor's bucket when enable_rate_limit, else
        requests_per_second with a bucket of one second's worth (at least one); (0, 0): no rate limit."""
        if self.enable_rate_limit:
            return self.max_requests / self.window_size_s, float(self.max_requests)
        return self.requests_per_second, max(1.0, self.requests_per_second)

    @cached_property
    def bucket(self) -> tuple[float, int]:
        """`rate_limit()` as the door reads it on every request: (requests a second, the bucket's size in
        milli-tokens), worked out once per Settings (a plain attribute read after the first)."""
        rate, burst = self.rate_limit()
        return rate, int(burst * 1000)

    @cached_property
    def key_owners(self) -> tuple[tuple[str, str], ...]:
        """Every entry of the inference port's keys with the tenant it names: tenant_config's tenants' own, then
        api_key_config's (the `default` tenant's; without tenant_config each its own tenant, `key-` and 12 hex
        digits of its entry's SHA-256: stable when keys are added or reordered, and no key in a log line)."""
        if self.tenants is None:
            return tuple((k, "key-" + hashlib.sha256(k.encode()).hexdigest()[:12]) for k in self.api_key.valid_keys)
        owned = tuple((k, t.name) for t in self.tenants.tenants for k in t.keys)
        return owned + tuple((k, DEFAULT_TENANT) for k in self.api_key.valid_keys)

    @cached_property
    def mgmt_key_owners(self) -> tuple[tuple[str, str], ...]:
        """The management and observability ports' keys (mgmt_api_key_config's), each the `default` tenant's."""
        return tuple((k, DEFAULT_TENANT) for k in self.mgmt_api_key.valid_keys)

    @cached_property
    def tenant_limits(self) -> dict[str, TenantLimits]:
        """The named tenants' limits; any other tenant has `default_limits`."""
        return {t.name: t for t in self.tenants.tenants} if self.tenants is not None else {}

    @cached_property
    def tenant_labels(self) -> frozenset[str]:
        """The tenants named in metric labels (serving/tenants.py): the first MAX_TENANT_LABELS the config names."""
        named = [t.name for t in self.tenants.tenants] if self.tenants is not None else []
        return frozenset(
            list(dict.fromkeys([*named, DEFAULT_TENANT, *(t for _, t in self.key_owners)]))[:MAX_TENANT_LABELS]
        )

    @cached_property
    def isolated_prefixes(self) -> bool:
        """Each tenant's prompts get their own prefix-cache scope (serving/tenants.py `effective_salt`): keys are on
        (more than one tenant is possible) and tenant_config's prefix_cache is "isolated" (its default, and
        without tenant_config)."""
        return self.api_key.enable_api_key and (self.tenants is None or self.tenants.prefix_cache == "isolated")

    @cached_property  # (read for every request of a tenant tenant_config does not name)
    def default_limits(self) -> TenantLimits:
        return self.tenants.default if self.tenants is not None else NO_LIMITS

    def backoff_s(self, attempt: int) -> float:
        """The wait after failed attempt `attempt` (0 = the first): retry_delay doubled each time, capped."""
        return min(self.retry_delay_s * 2**attempt, MAX_BACKOFF_S)

    def model(self, model_id: str) -> ModelConfig | None:
        for m in self.models:
            if m.id == model_id:
                return m
        return None


class Live:
    """The settings a worker runs on now, one per worker: every long-lived object holds it and reads
    `live.s.<key>` where the value is used, never a copy, so a reload (app.py's `apply_settings`, which swaps
    `s`) reaches every reader. Values worked out from settings are kept beside the Settings they came from
    (`Settings.bucket`) or rebuilt when `s` changes (the scheduler's token meters)."""

    __slots__ = ("s",)

    def __init__(self, s: Settings):
        self.s = s


def with_models_for_instances(settings: Settings) -> Settings:
    """Every model named by an instance is served, with default SLOs when the config does not list it."""
    known = {m.id for m in settings.models}
    extra = tuple(
        ModelConfig(id=name) for name in dict.fromkeys(i.model_name for i in settings.instances) if name not in known
    )
    return replace(settings, models=settings.models + extra) if extra else settings
