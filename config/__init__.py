"""The Coordinator's configuration: one model per user_config.json section, and the Settings built from them.

- config.sections: one frozen dataclass per `motor_coordinator_config` section (api_config, scheduler_config,
  api_key_config, infer_tls_config, models, instances, ...), the single source of each key's name, type,
  bounds and default; pydantic validates config objects against them (strict: JSON's own types only).
- config.settings: `Settings`, what the rest of the Coordinator reads. It inherits the fields of the sections
  whose keys are its own attributes (`settings.first_token_timeout_s` is ExceptionConfig's, default included)
  and holds the others as one object each (`settings.infer_tls`, `settings.models`). It stays a plain frozen
  dataclass, so the request path reads attributes and never touches pydantic. `Live` holds the Settings a
  worker runs on now: what every reader reads them through, so that a reload reaches it.
- config.validation: a value validated against a section's schema, pydantic's first error said in one line
  naming its key path (`motor_coordinator_config.exception_config.infer_timeout: must be a number`).
- config.load: `load_settings`, `settings_from_dict`: each section validated in turn, unknown keys warned
  about and ignored.
- config.addresses: engine addresses, read as the engine client reads them.
- config.pymotor: MindIE-PyMotor's keys read with their meaning (noted, refused, or moved onto the Coordinator's).
- config.keys: API keys in PyMotor's hashed form (`python -m config.keys hash`).
- config.live: which settings a reloaded file changes in a running Coordinator.
"""

from __future__ import annotations

from .addresses import ADDRESS_FORMS, address_key, engine_url, split_address
from .load import (
    DEFAULT_CONFIG_PATH,
    check_instance_set,
    load_settings,
    parse_config,
    parse_instance,
    parse_models,
    read_config,
    resolve_config_path,
    server_tls_context,
    settings_from_dict,
)
from .sections import (
    ADMISSION,
    ENGINE_TYPES,
    HTTP_TOKEN,
    LOG_LEVELS,
    MAX_ID,
    MIN_WATCHDOG_S,
    PD_DISPATCH,
    ROLES,
    ROOT_KEY,
    SCHEDULER_TYPES,
    ApiKeyConfig,
    ClusterConfig,
    Endpoint,
    Instance,
    ModelConfig,
    TlsConfig,
    TracerConfig,
)
from .settings import MAX_BACKOFF_S, Live, Settings, with_models_for_instances
from .tenancy import DEFAULT_TENANT, OTHER_TENANT, PRIORITIES, STANDARD, TenantLimits
from .validation import ConfigError, adapter, refusal, validate

__all__ = [
    "ADDRESS_FORMS",
    "ADMISSION",
    "DEFAULT_CONFIG_PATH",
    "DEFAULT_TENANT",
    "ENGINE_TYPES",
    "HTTP_TOKEN",
    "LOG_LEVELS",
    "MAX_BACKOFF_S",
    "MAX_ID",
    "MIN_WATCHDOG_S",
    "OTHER_TENANT",
    "PD_DISPATCH",
    "PRIORITIES",
    "ROLES",
    "ROOT_KEY",
    "SCHEDULER_TYPES",
    "STANDARD",
    "ApiKeyConfig",
    "ClusterConfig",
    "ConfigError",
    "Endpoint",
    "Instance",
    "Live",
    "ModelConfig",
    "Settings",
    "TenantLimits",
    "TlsConfig",
    "TracerConfig",
    "adapter",
    "address_key",
    "check_instance_set",
    "engine_url",
    "load_settings",
    "parse_config",
    "parse_instance",
    "parse_models",
    "read_config",
    "refusal",
    "resolve_config_path",
    "server_tls_context",
    "settings_from_dict",
    "split_address",
    "validate",
    "with_models_for_instances",
]
