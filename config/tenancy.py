"""tenant_config: who an API key is, and the limits of each tenant (serving/tenants.py applies them)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated

from pydantic import AfterValidator, Field

from .sections import Int, KeyList, Num, Str, one_of, refused

PRIORITIES = ("interactive", "standard", "batch")  # x-priority's classes, first served first (vLLM's 0, 1, 2)
STANDARD = 1  # a request's class without x-priority
DEFAULT_TENANT, OTHER_TENANT = "default", "other"  # the tenant of api_key_config's keys; the metrics' fold
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # safe in a log line and a metric label as it is
# Whether tenants share the engines' prefix cache: "isolated" salts each tenant's prompts (serving/tenants.py).
PREFIX_CACHE = ("isolated", "shared")


@dataclass(frozen=True)
class TenantLimits:
    """tenant_config.default, and each tenant's own limits (0: unlimited)."""

    weight: Annotated[Num, Field(gt=0)] = 1.0  # its share of the tokens served when the queue is full
    rpm: Annotated[Int, Field(ge=0)] = 0  # requests a minute
    tpm: Annotated[Int, Field(ge=0)] = 0  # prompt plus output tokens a minute
    max_inflight: Annotated[Int, Field(ge=0)] = 0
    max_priority: Annotated[Str, one_of(PRIORITIES)] = "interactive"


@dataclass(frozen=True)
class Tenant(TenantLimits):
    """One entry of tenant_config.tenants: a name, the keys that are it, its limits."""

    name: Str = ""
    keys: KeyList = ()


@dataclass(frozen=True)
class TenantConfig:
    """tenant_config: who a key is (serving/tenants.py). Absent, each distinct key is its own tenant."""

    tenants: tuple[Tenant, ...] = ()
    default: TenantLimits = TenantLimits()
    prefix_cache: Annotated[Str, one_of(PREFIX_CACHE)] = "isolated"


def tenants_apart(cfg: TenantConfig) -> TenantConfig:
    names: set[str] = set()
    keys: set[str] = set()
    for i, t in enumerate(cfg.tenants):
        if not TENANT_NAME.fullmatch(t.name) or t.name in (DEFAULT_TENANT, OTHER_TENANT) or t.name in names:
            why = "must be unique, 1..64 letters, digits, '.', '_' or '-', not 'default' or 'other'"
            raise refused(f"{why} (got {t.name!r})", f"tenants[{i}].name")
        if keys & set(t.keys):  # one key, one identity
            raise refused("a key listed under another tenant too", f"tenants[{i}].keys")
        names.add(t.name)
        keys.update(t.keys)
    return cfg


TenantSection = Annotated[TenantConfig, AfterValidator(tenants_apart)]
