"""MindIE-PyMotor's `user_config.json`, read with its meaning: its keys that name what the Coordinator's own
keys do, its sections that change nothing here, and what it derives from the engine sections.

`adopt` runs before the sections are validated: it takes out the keys that do nothing here (each said in one
WARNING line: `config: ... accepted, changes nothing here: why`), refuses the values the Coordinator cannot
honour (a ConfigError naming the key and why), and moves `motor_deploy_config.tls_config` over the TLS
sections as PyMotor does. `finish` runs after: it reads PyMotor's spellings of the Coordinator's keys
(circuit_config, prometheus_metrics_config, logging_config, rate_limit_config's bucket, transport_max_retry)
into Settings, refusing a pair of spellings that disagree, and adds the `aigw` model (its id and max seqlens
from the engine sections where `aigw` leaves them out). docs/pymotor.md says the
same key by key.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
from dataclasses import replace
from typing import Any

from .sections import LOG_LEVELS, ROOT_KEY, Aigw, CircuitConfig, ModelConfig, TracerConfig
from .settings import Settings
from .validation import ConfigError, validate

log = logging.getLogger("coordinator.config")

# Key paths under motor_coordinator_config that change nothing here, and why.
NOTED = {
    "timeout_config": "MindIE-PyMotor reads none of it either; the deadlines are exception_config's",
    "request_limit": "MindIE-PyMotor reads none of it either; the caps are rate_limit_config's",
    "scheduler_config.deploy_mode": "MindIE-PyMotor ignores it too; the instances' roles say how they are deployed",
    "scheduler_config.endpoint_instance_score_weight": "load_balance here weighs each engine's own scraped load",
    "scheduler_config.kv_affinity": "kv_cache_affinity here scores by the Coordinator's own prefix index "
    "(kv_affinity_block_size, affinity_overload_factor)",
    "scheduler_config.kv_conductor_config": "no external KV conductor: kv_cache_affinity keeps its own prefix index",
    "kv_conductor_config": "no external KV conductor: kv_cache_affinity keeps its own prefix index",
    "api_config.coordinator_api_dns": "an advertised name for MindIE-PyMotor's Controller; the Coordinator binds "
    "coordinator_api_host",
    "api_config.coordinator_api_infer_dns": "an advertised name for MindIE-PyMotor's Controller",
    "api_config.coordinator_api_obs_dns": "an advertised name for MindIE-PyMotor's Controller",
    "inference_workers_config.worker_metaserver_base_port": "/v1/metaserver is served on the inference port "
    "(its TLS, callers checked against the registered instances), not on a port per worker",
    "logging_config.log_max_line_length": "request lines quote client values at most 256 characters",
    "logging_config.log_format": "one format: time, level, logger[pid], message",
    "logging_config.log_rotation": "logs go to stdout, for the container runtime to keep",
    "etcd_config": "no etcd: replicas share their state through Redis (cluster_config.redis_url)",
    "etcd_tls_config": "no etcd client",
    "standby_config": "no master/standby pair: every replica serves, sharing its state through cluster_config",
    "precision_detection_config": "no logprob precision probes",
    "token_sampling_config": "no logprob precision probes",
    "health_check_config": "a key of the engine sections: the Coordinator checks /health itself "
    "(scheduler_config.health_check_interval)",
    "aigw.object": "entries are always of object `model`",
    "tracer_config.protocol": "the protocol comes from OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
}


def _refuse_true(why: str):
    return lambda v: why if v is True else None


# Key paths whose value stops the start when it asks for what is not here: (check -> why or None).
REFUSED = {
    "precision_detection_config.enable": _refuse_true("logprob precision probes are not supported"),
    "token_sampling_config.enable": _refuse_true("logprob precision probes are not supported"),
    "etcd_config.enable_etcd_persistence": _refuse_true(
        "no etcd persistence: in cluster mode the instance set persists in Redis (cluster_config.redis_url)"
    ),
    "context_budget_mode": lambda v: (
        None
        if v == "off"
        else "'on' is not supported: max_tokens is not cut to the context left (the engine refuses a request "
        "past its max_model_len)"
        if v == "on"
        else "must be off or on"
    ),
}
# motor_coordinator_config's own keys besides the sections config.load reads.
TOP_LEVEL = frozenset(
    {"aigw", "circuit_config", "tracer_config", "prometheus_metrics_config", "logging_config"}
    | {path.split(".")[0] for path in (*NOTED, *REFUSED)}
)


STANDBY = "standby_config.enable_master_standby"


def _standby(spelled: Spelled) -> None:
    """PyMotor's master/standby pair asks for replicas that act as one: here every replica serves, and they act as
    one through cluster_config; without it, N pods would be N unshared Coordinators (N times every limit)."""
    if not spelled.get("cluster_config.redis_url")[1]:
        raise ConfigError(
            f"{ROOT_KEY}.{STANDBY}: no master/standby election here; replicas are active-active and act as one"
            " through Redis: set cluster_config.redis_url (or standby off for a single pod)"
        )
    log.warning(
        "config: %s.%s: no master/standby election here; every replica serves (active-active), sharing its state"
        " through cluster_config.redis_url",
        ROOT_KEY,
        STANDBY,
    )


class Spelled:
    """The raw config object, to ask whether a key path was written in it (a default is no disagreement)."""

    def __init__(self, raw: dict):
        self.raw = raw

    def get(self, path: str) -> tuple[bool, Any]:
        node: Any = self.raw
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                return False, None
            node = node[part]
        return node is not None, node  # PyMotor writes null for "not set" (aigw, transport_max_retry)


def _pop(data: dict, path: str) -> tuple[bool, Any]:
    head, _, rest = path.partition(".")
    if head not in data:
        return False, None
    if not rest:
        return True, data.pop(head)
    inner = data[head]
    if not isinstance(inner, dict):
        return False, None
    inner = dict(inner)
    found, value = _pop(inner, rest)
    data[head] = inner
    return found, value


def adopt(raw: dict, whole: dict | None) -> dict:
    """The section object with what changes nothing here taken out (and said), PyMotor's impossible values
    refused, and `motor_deploy_config.tls_config` moved over the TLS sections."""
    spelled = Spelled(raw)
    for path, check in REFUSED.items():
        found, value = spelled.get(path)
        why = check(value) if found else None
        if why:
            raise ConfigError(f"{ROOT_KEY}.{path}: {why}")
    data = dict(raw)
    if spelled.get("standby_config.enable_master_standby")[1] is True:
        _standby(spelled)
        data.pop("standby_config")
    for path, why in NOTED.items():
        found, _ = _pop(data, path)
        if found:
            log.warning("config: %s.%s accepted, changes nothing here: %s", ROOT_KEY, path, why)
    data.pop("context_budget_mode", None)  # "off", checked above
    if "prefill_kv_event_config" in data:  # PyMotor's name of kv_event_config
        alias = data.pop("prefill_kv_event_config")
        if "kv_event_config" in data and data["kv_event_config"] != alias:
            raise ConfigError(
                f"{ROOT_KEY}.prefill_kv_event_config: differs from kv_event_config (the same section: write one)"
            )
        data["kv_event_config"] = alias
    limits = data.get("rate_limit_config")
    if isinstance(limits, dict):
        _check_rate_skip_paths(limits.get("skip_paths", []))
        size = limits.get("max_request_body_size")
        if isinstance(size, int) and not isinstance(size, bool) and 0 <= size < 1024:
            log.warning(
                "config: %s.rate_limit_config.max_request_body_size %d read as MindIE-PyMotor's megabytes: %s",
                ROOT_KEY,
                size,
                f"{size} MiB" if size else "0 (no limit there) keeps the default 16 MiB here, always enforced",
            )
    tls = ((whole or {}).get("motor_deploy_config") or {}).get("tls_config")
    if isinstance(tls, dict):
        for name in ("infer_tls_config", "mgmt_tls_config"):
            if name in tls:
                data[name] = tls[name]
                log.warning("config: %s taken from motor_deploy_config.tls_config.%s", name, name)
    return data


# Rate-limit skip paths (prefix match) that would exempt an inference route: a limit is never dropped silently.
# (/v1/metaserver is an engine's call, part of a client request already counted.)
_LIMITED_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")


def _check_rate_skip_paths(paths: Any) -> None:
    if not isinstance(paths, list):
        return  # refused as a list by its section's model
    for i, p in enumerate(paths):
        if isinstance(p, str) and p and any(r.startswith(p) for r in _LIMITED_ROUTES):
            raise ConfigError(
                f"{ROOT_KEY}.rate_limit_config.skip_paths[{i}]: {p!r} would exempt inference routes from the rate "
                "limit; only paths outside them may be listed (those are never limited here)"
            )


def _same(spelled: Spelled, ours: str, theirs: str, ours_value: Any, theirs_value: Any) -> None:
    """Both spellings written and disagreeing: refused, naming the later one."""
    if spelled.get(ours)[0] and spelled.get(theirs)[0] and ours_value != theirs_value:
        raise ConfigError(
            f"{ROOT_KEY}.{theirs}: {theirs_value!r} contradicts {ROOT_KEY}.{ours} ({ours_value!r}), which sets "
            "the same thing: set one"
        )


def finish(settings: Settings, raw: dict, whole: dict | None) -> Settings:
    """Settings with PyMotor's spellings of the Coordinator's keys applied, and the `aigw` model added."""
    spelled = Spelled(raw)
    changes: dict[str, Any] = {}
    # rate_limit_config: PyMotor's bucket, or today's requests_per_second; both on and unequal is refused.
    if (
        spelled.get("rate_limit_config.requests_per_second")[0]
        and spelled.get("rate_limit_config.enable_rate_limit")[0]
    ):
        rps, on = settings.requests_per_second, settings.enable_rate_limit
        bucket = settings.max_requests / settings.window_size_s
        if (on and not math.isclose(rps, bucket)) or (not on and rps > 0):
            raise ConfigError(
                f"{ROOT_KEY}.rate_limit_config.requests_per_second: {rps:g} contradicts enable_rate_limit "
                f"({str(on).lower()}" + (f", max_requests / window_size = {bucket:g}" if on else "") + "): set one"
            )
    # circuit_config: PyMotor's breaker keys (and its defaults) for scheduler_config's breaker_*.
    found, circuit_raw = spelled.get("circuit_config")
    if found:
        circuit = validate(CircuitConfig, circuit_raw, f"{ROOT_KEY}.circuit_config")
        for ours, theirs, value in (
            ("breaker_failure_threshold", "failure_threshold", circuit.failure_threshold),
            ("breaker_open_s", "base_timeout_s", circuit.base_timeout_s),
            ("breaker_max_open_s", "max_timeout_s", circuit.max_timeout_s),
        ):
            key = {"breaker_open_s": "breaker_open_time", "breaker_max_open_s": "breaker_max_open_time"}.get(ours, ours)
            _same(spelled, f"scheduler_config.{key}", f"circuit_config.{theirs}", getattr(settings, ours), value)
            changes[ours] = value
        if not circuit.enable:
            changes["breaker_failure_threshold"] = 0  # Health: a breaker that never opens
    found, metrics_raw = spelled.get("prometheus_metrics_config")
    if found:
        if not isinstance(metrics_raw, dict):
            raise ConfigError(f"{ROOT_KEY}.prometheus_metrics_config: must be an object")
        if "reuse_time" in metrics_raw:
            reuse = metrics_raw["reuse_time"]
            if isinstance(reuse, bool) or not isinstance(reuse, (int, float)) or not reuse > 0:
                raise ConfigError(f"{ROOT_KEY}.prometheus_metrics_config.reuse_time: must be a number > 0")
            _same(
                spelled,
                "scheduler_config.metrics_scrape_interval",
                "prometheus_metrics_config.reuse_time",
                settings.metrics_scrape_interval_s,
                reuse,
            )
            changes["metrics_scrape_interval_s"] = float(reuse)
        for k in sorted(set(metrics_raw) - {"reuse_time"}):
            log.warning("config: unknown key %s.prometheus_metrics_config.%s ignored", ROOT_KEY, k)
    found, level = spelled.get("logging_config.log_level")
    if found:
        if not isinstance(level, str) or level.upper() not in LOG_LEVELS:
            raise ConfigError(f"{ROOT_KEY}.logging_config.log_level: must be one of {', '.join(LOG_LEVELS)}")
        _same(spelled, "log_config.log_level", "logging_config.log_level", settings.log_level, level.upper())
        changes["log_level"] = level.upper()
    if settings.transport_max_retry is not None:
        changes["max_retry"] = settings.transport_max_retry
    found, tracer_raw = spelled.get("tracer_config")
    if found:
        tracer_raw = (
            {k: v for k, v in tracer_raw.items() if k != "protocol"} if isinstance(tracer_raw, dict) else tracer_raw
        )
        changes["tracer"] = validate(TracerConfig, tracer_raw, f"{ROOT_KEY}.tracer_config")
        if changes["tracer"].endpoint:
            _check_exporter()
    model = aigw_model(raw, whole, settings.models)
    if model is not None:
        changes["models"] = (*settings.models, model)
    return replace(settings, **changes) if changes else settings


def _check_exporter() -> None:
    """The OTLP exporter tracer_config.endpoint needs is there (serving/tracing.py makes it in each worker)."""
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    module = {
        "http/protobuf": "opentelemetry.exporter.otlp.proto.http",
        "grpc": "opentelemetry.exporter.otlp.proto.grpc",
    }
    if protocol not in module:
        raise ConfigError(
            f"{ROOT_KEY}.tracer_config.endpoint: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol!r} must be "
            "http/protobuf or grpc"
        )
    try:
        found = importlib.util.find_spec(module[protocol]) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        raise ConfigError(
            f"{ROOT_KEY}.tracer_config.endpoint: the {protocol} OTLP exporter ({module[protocol]}) is not installed"
        )


def _engine_value(engine: dict, *paths: str) -> tuple[str, Any]:
    for path in paths:
        found, value = Spelled(engine).get(path)
        if found:
            return path, value
    return "", None


def aigw_model(raw: dict, whole: dict | None, models: tuple[ModelConfig, ...]) -> ModelConfig | None:
    """The model `aigw` names, its missing keys filled from the engine sections as PyMotor fills them: the id
    from the engines' served model name, p_max_seqlen / d_max_seqlen from the prefill / decode engine's
    max_model_len. None when there is no aigw and no engine section, or `models` already lists that id."""
    found, aigw_raw = Spelled(raw).get("aigw")
    engines = {
        role: (whole or {}).get(f"motor_engine_{role}_config")
        for role in ("prefill", "decode")
        if isinstance((whole or {}).get(f"motor_engine_{role}_config"), dict)
    }
    if not found and not engines:
        return None
    aigw = validate(Aigw, aigw_raw if found else {}, f"{ROOT_KEY}.aigw")
    if found and aigw.owned_by != "motor":
        log.warning("config: %s.aigw.owned_by accepted, changes nothing here: entries are owned by motor", ROOT_KEY)
    names, lens = {}, {}
    for role, engine in engines.items():
        section = f"motor_engine_{role}_config"
        path, name = _engine_value(
            engine, "served_model_name", "model_config.served_model_name", "model_config.model_name"
        )
        if path:
            if not isinstance(name, str) or not name:
                raise ConfigError(f"{section}.{path}: must be a non-empty string")
            names[role] = name
        path, length = _engine_value(
            engine, "max_model_len", "engine_config.max_model_len", "engine_config.max-model-len"
        )
        if path:
            if isinstance(length, bool) or not isinstance(length, int) or length < 1:
                raise ConfigError(f"{section}.{path}: must be an integer >= 1")
            lens[role] = length
    model_id = aigw.id
    if not model_id:
        if len(set(names.values())) > 1:
            raise ConfigError(
                f"motor_engine_decode_config: serves {names['decode']!r}, the prefill engine {names['prefill']!r}: "
                f"set {ROOT_KEY}.aigw.id"
            )
        model_id = next(iter(names.values()), "")
    if not model_id:
        if found:
            raise ConfigError(f"{ROOT_KEY}.aigw.id: is required (no engine section names the model)")
        return None
    model = ModelConfig(
        id=model_id,
        slo_ttft_ms=aigw.slo_ttft_ms,
        slo_tpot_ms=aigw.slo_tpot_ms,
        p_max_seqlen=aigw.p_max_seqlen or lens.get("prefill") or lens.get("decode") or 8192,
        d_max_seqlen=aigw.d_max_seqlen or lens.get("decode") or lens.get("prefill") or 8192,
    )
    for i, m in enumerate(models):
        if m.id == model_id:
            if found and m != replace(model, engine_type=m.engine_type, tokenizer_path=m.tokenizer_path):
                raise ConfigError(f"{ROOT_KEY}.aigw: contradicts {ROOT_KEY}.models[{i}] (model {model_id!r}): set one")
            return None  # listed in models: that entry is the model's
    return model
