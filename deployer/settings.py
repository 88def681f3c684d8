"""Load a whole user_config.json into the deployer's `Settings`, or raise `ConfigError`
listing each bad value as ``<key path>: <what is wrong>``.

The deployer-owned sections are read by deployer.sections and checked by deployer.checks;
``motor_coordinator_config`` by the Coordinator's own section models (config.sections), for the keys the
deployer renders from (ports, TLS, drain timeout, pd_dispatch) and for the models and static instances, on
the input's index. The rest is passed through untouched, and `load` ends by reading the rendered
user_config.json with the Coordinator's own loader: what it refuses, the Coordinator pods would crash-loop on.

Unknown keys in the deployer-owned sections are errors (they are almost always typos), and so is a
top-level key that is a near miss of a known one (a misspelled section would leave its defaults in force);
other top-level keys (MindIE's sections for components this project does not have) are passed over with a
warning. Unknown keys in ``motor_coordinator_config`` are left for the Coordinator to judge.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from config import (
    ROOT_KEY as COORDINATOR_KEY,
    ConfigError as CoordinatorConfigError,
    address_key,
    check_instance_set,
    parse_instance,
    parse_models,
    settings_from_dict,
    validate,
)
from config.sections import ApiSection, SchedulerConfig, ShutdownConfig, TlsSwitch

from .checks import check_cluster, check_deploy, check_engine, is_loopback
from .render import cluster_user_config, instances
from .sections import (
    COORDINATOR_CODE_DIR,
    COORDINATOR_MOUNTS,
    CPU_KV_BUFFER,
    ENGINE_MOUNTS,
    MAX_DRAIN_SECONDS,
    SECTIONS,
    TOP_LEVEL_KEYS,
    ConfigError,
    CoordinatorView,
    DeployConfig,
    EngineConfig,
    Settings,
    defaults_as_dict,
    key_docs,
    load_section,
    near_miss,
    quoted,
)

# What deployer.settings has always offered its importers, besides `load`.
__all__ = [
    "COORDINATOR_CODE_DIR",
    "COORDINATOR_MOUNTS",
    "ENGINE_MOUNTS",
    "ConfigError",
    "DeployConfig",
    "EngineConfig",
    "Settings",
    "defaults_as_dict",
    "key_docs",
    "load",
]
log = logging.getLogger("deployer")


def _coordinator_view(raw: Any, deploy: DeployConfig, errors: list[str]) -> CoordinatorView:
    p = COORDINATOR_KEY
    view = CoordinatorView()
    if raw is None:
        errors.append(f"{p}: missing (the Coordinator's own section is required)")
        return view
    if not isinstance(raw, dict):
        errors.append(f"{p}: must be an object")
        return view

    def read(key: str, schema: Any, default: Any, data: Any = None) -> Any:
        """The section as the Coordinator's model reads it; its default (and the error listed) if refused."""
        try:
            return validate(schema, raw.get(key, {}) if data is None else data, f"{p}.{key}")
        except CoordinatorConfigError as exc:
            errors.append(quoted(exc))
            return default

    api = raw.get("api_config", {})
    # The render binds the pods to 0.0.0.0 (cluster_user_config), whatever host the input names.
    view.api = read(
        "api_config", ApiSection, view.api, dict(api, coordinator_api_host="0.0.0.0") if isinstance(api, dict) else api
    )
    mount = deploy.tls_mount_path.rstrip("/") + "/"
    for key in ("infer_tls_config", "mgmt_tls_config"):
        tls = read(key, TlsSwitch, getattr(view, key))
        setattr(view, key, tls)
        if not tls.enable_tls:
            continue
        for fkey in ("cert_file", "key_file", "ca_file"):
            val = getattr(tls, fkey)
            fpath = f"{p}.{key}.{fkey}"
            if not val:
                if fkey != "ca_file":
                    errors.append(f"{fpath}: required when enable_tls is true")
            elif not val.startswith(mount) or len(val) == len(mount):
                errors.append(
                    f"{fpath}: must be a file under motor_deploy_config.tls_mount_path "
                    f"{deploy.tls_mount_path!r}, where Secret {deploy.tls_secret_name!r} "
                    f"is mounted (got {val!r})"
                )
            else:
                view.tls_files.append(val)

    shutdown = raw.get("shutdown_config", {})
    if not isinstance(shutdown, dict):
        read("shutdown_config", ShutdownConfig, view.shutdown)  # lists the Coordinator's "must be an object"
    else:
        try:
            drain_s = validate(ShutdownConfig, shutdown, f"{p}.shutdown_config").drain_timeout_s
        except CoordinatorConfigError:  # its only key: said below, with the deployer's bound
            drain_s = None
        # Bounded: it sizes terminationGracePeriodSeconds, an integer.
        if drain_s is None or drain_s > MAX_DRAIN_SECONDS:
            errors.append(
                f"{p}.shutdown_config.drain_timeout: must be a number 0..{MAX_DRAIN_SECONDS} "
                f"(got {shutdown.get('drain_timeout')!r})"
            )
        else:
            view.shutdown = ShutdownConfig(drain_s)
    view.scheduler = read("scheduler_config", SchedulerConfig, view.scheduler)

    try:
        # The Coordinator's own check, on the input's index: the rendered list puts the served model first.
        parse_models("models", raw.get("models", []))
    except CoordinatorConfigError as exc:
        errors.append(str(exc))

    given = raw.get("instances", [])
    if not isinstance(given, list):
        errors.append(f"{p}.instances: must be a list")
        given = []
    for i, inst in enumerate(given):
        try:
            # The Coordinator's own check, on the input's index; ids are the deployer's (it renumbers).
            parsed = parse_instance(f"instances[{i}]", dict(inst, id=0) if isinstance(inst, dict) else inst)
        except CoordinatorConfigError as exc:
            errors.append(str(exc))
            continue
        for j, ep in enumerate(parsed.endpoints):
            if is_loopback(ep.address):
                errors.append(
                    f"{p}.instances[{i}].endpoints[{j}].address: {ep.address!r} is a loopback address, "
                    f"unreachable from the Coordinator pod"
                )
    return view


def load(raw: Any) -> Settings:
    """Validate the whole user_config.json object and return the effective settings."""
    if not isinstance(raw, dict):
        raise ConfigError(["user_config.json: the top level must be a JSON object"])
    errors: list[str] = []
    for key in raw:
        if key in TOP_LEVEL_KEYS:
            continue
        near = near_miss(str(key))
        if near:  # a misspelled section would otherwise leave its defaults in force
            errors.append(f"{key}: unknown top-level key; did you mean {near}?")
        else:
            log.warning("%s: unknown top-level key, not read (known: %s)", key, ", ".join(TOP_LEVEL_KEYS))
    parsed = {}
    for section, cls in SECTIONS.items():
        data = raw.get(section, {})
        if not isinstance(data, dict):
            errors.append(f"{section}: must be an object")
            data = {}
        parsed[section] = load_section(cls, data, section, errors)
    deploy = parsed["motor_deploy_config"]
    prefill = parsed["motor_engine_prefill_config"]
    decode = parsed["motor_engine_decode_config"]
    if not errors:  # semantic checks only make sense on well-typed values
        for section, engine in (("motor_engine_prefill_config", prefill), ("motor_engine_decode_config", decode)):
            if engine.accelerator_num == 0 and "kv_buffer_device" not in raw.get(section, {}):
                engine.kv_buffer_device = CPU_KV_BUFFER
        check_deploy(deploy, errors)
        check_cluster(deploy, raw.get("motor_coordinator_config"), errors)
        check_engine(prefill, "motor_engine_prefill_config", deploy, errors)
        check_engine(decode, "motor_engine_decode_config", deploy, errors)
        if prefill.served_model_name != decode.served_model_name:
            errors.append(
                f"motor_engine_decode_config.served_model_name: {decode.served_model_name!r} "
                f"differs from motor_engine_prefill_config.served_model_name "
                f"{prefill.served_model_name!r}; a P/D pair serves one model"
            )
        if prefill.kv_connector != decode.kv_connector:
            errors.append(
                f"motor_engine_decode_config.kv_connector: {decode.kv_connector!r} differs "
                f"from motor_engine_prefill_config.kv_connector {prefill.kv_connector!r}"
            )
    view = _coordinator_view(raw.get("motor_coordinator_config"), deploy, errors)
    if (
        not errors
        and deploy.termination_grace_period_seconds
        and deploy.termination_grace_period_seconds <= deploy.prestop_sleep_seconds + view.drain_timeout
    ):
        errors.append(
            f"motor_deploy_config.termination_grace_period_seconds: "
            f"{deploy.termination_grace_period_seconds} must exceed prestop_sleep_seconds + "
            f"motor_coordinator_config.shutdown_config.drain_timeout "
            f"({deploy.prestop_sleep_seconds} + {view.drain_timeout:g})"
        )
    if errors:
        raise ConfigError(errors)
    settings = Settings(deploy=deploy, prefill=prefill, decode=decode, coordinator=view, raw=copy.deepcopy(raw))
    _coordinator_accepts(settings)
    return settings


def _coordinator_accepts(settings: Settings) -> None:
    """Refuse what the Coordinator would refuse in the rendered user_config.json: its pods would
    crash-loop on it. The deployer checks only the keys it reads; the Coordinator judges the rest.

    The input's static instances are checked first, as a set (two at one address) and against the
    engine pods, with the ids the render gives them, so the message names the input's index: the
    rendered list puts the engine pods first."""
    rendered = instances(settings)
    generated = settings.deploy.p_instances_num + settings.deploy.d_instances_num
    static = [parse_instance(f"instances[{i}]", inst) for i, inst in enumerate(rendered[generated:])]
    try:
        check_instance_set(static, "instances")
    except CoordinatorConfigError as exc:
        raise ConfigError([str(exc)]) from None
    pods = {address_key(pod["endpoints"][0]["address"]): pod["id"] for pod in rendered[:generated]}
    clashes = [
        f"{COORDINATOR_KEY}.instances[{i}].endpoints[{j}].address: {address_key(ep.address)} is already "
        f"the address of instance {pods[address_key(ep.address)]}, an engine pod the deployer renders"
        for i, inst in enumerate(static)
        for j, ep in enumerate(inst.endpoints)
        if address_key(ep.address) in pods
    ]
    if clashes:
        raise ConfigError(clashes)
    coordinator_log = logging.getLogger("coordinator.config")
    coordinator_log.addFilter(_models_warned_on_the_input)
    try:
        settings_from_dict(cluster_user_config(settings), on_this_host=False)  # the pod's files and DNS are not here
    except CoordinatorConfigError as exc:
        raise ConfigError([f"{exc} (the Coordinator refuses the rendered user_config.json)"]) from None
    finally:
        coordinator_log.removeFilter(_models_warned_on_the_input)


def _models_warned_on_the_input(record: logging.LogRecord) -> bool:
    """Drops the rendered file's warnings about unknown keys of `models`: the check of the input's
    `models` gave them already, naming the input's index, not the reordered one."""
    return f"{COORDINATOR_KEY}.models[" not in record.getMessage()
