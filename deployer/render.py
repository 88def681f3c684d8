"""Render the Kubernetes bundle and the cluster user_config.json from validated settings.

All YAML comes from the Jinja templates in ``templates/``; Python only computes values
(names, labels, argument lists, the instance list) and hands them to the templates, which
emit every scalar through the ``j`` filter (JSON encoding, always a valid YAML scalar).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import errno
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import jinja2

from .monitoring import dashboard
from .sections import (
    CONFIG_PATH_IN_CONTAINER,
    CONFIG_SECRET_NAME,
    REDIS_AUTH_DIR,
    REDIS_PASSWORD_KEY,
    EngineConfig,
    Settings,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
TEMPLATE_DIR = REPO_ROOT / "templates"
DEFAULT_CONFIG = Path(__file__).resolve().parent / "user_config.json"
DEFAULT_OUT = Path(__file__).resolve().parent / "deployment"

COORDINATOR_NAME = "motor-coordinator"
INFER_SERVICE = "motor-coordinator-infer"
MGMT_SERVICE = "motor-coordinator-mgmt"
METRICS_SERVICE = "motor-coordinator-metrics"
# The rendered Redis (motor_deploy_config.redis_enabled): its StatefulSet, Service and PodDisruptionBudget.
REDIS_NAME = "motor-coordinator-redis"
REDIS_PORT = 6379
REDIS_UID = 999  # the redis user of the official images
ENGINE_NAME = {"prefill": "motor-engine-prefill", "decode": "motor-engine-decode"}
KV_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer"}
OUTPUT_FILES = (
    "coordinator_init.yaml",
    "engine_prefill.yaml",
    "engine_decode.yaml",
    "monitoring.yaml",
    "user_config.json",
)


# A JSON surrogate pair (an escaped character above U+FFFF) after an even run of backslashes, so
# an escaped backslash followed by "ud83d" is left alone.
_SURROGATE_PAIR = re.compile(r"(?<!\\)((?:\\\\)*)\\u(d[89ab][0-9a-f]{2})\\u(d[c-f][0-9a-f]{2})")


def _yaml_escape(m: re.Match[str]) -> str:
    hi, lo = int(m.group(2), 16), int(m.group(3), 16)
    return f"{m.group(1)}\\U{0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00):08X}"


def _json_scalar(value: Any) -> str:
    """Encode a value as JSON, which YAML reads back as the same scalar, list or mapping.

    ASCII-only, so U+0085 or U+2028 cannot become YAML line breaks; but Kubernetes' Go YAML
    parser rejects JSON's surrogate-pair escapes, so those become YAML's 8-digit \\U escapes.
    """
    return _SURROGATE_PAIR.sub(_yaml_escape, json.dumps(value, ensure_ascii=True))


def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["j"] = _json_scalar
    return env


def labels(settings: Settings, component: str) -> dict[str, str]:
    """Selector labels of one component (also put on its pods)."""
    return {
        "app.kubernetes.io/name": "motor",
        "app.kubernetes.io/instance": settings.namespace,
        "app.kubernetes.io/component": component,
    }


def engine_address(settings: Settings, role: str, index: int) -> str:
    name = ENGINE_NAME[role]
    eng = settings.prefill if role == "prefill" else settings.decode
    return f"{name}-{index}.{name}.{settings.namespace}.svc.{settings.deploy.cluster_domain}:{eng.port}"


def instances(settings: Settings) -> list[dict[str, Any]]:
    """Every prefill and decode pod by its stable DNS name, then any static instances of the input."""
    out: list[dict[str, Any]] = []
    model = settings.prefill.served_model_name
    for role, count in (("prefill", settings.deploy.p_instances_num), ("decode", settings.deploy.d_instances_num)):
        for i in range(count):
            out.append(
                {
                    "id": len(out) + 1,
                    "role": role,
                    "model_name": model,
                    "endpoints": [{"id": 0, "address": engine_address(settings, role, i)}],
                }
            )
    for extra in settings.raw.get("motor_coordinator_config", {}).get("instances", []):
        item = copy.deepcopy(extra)
        item["id"] = len(out) + 1
        out.append(item)
    return out


def models(settings: Settings) -> list[dict[str, Any]]:
    """The served model first (SLOs from the input entry of the same id), then every other input model,
    in the input's order: static instances may serve them, and instances added later through
    POST /instances/refresh find their SLOs there."""
    given = settings.raw.get("motor_coordinator_config", {}).get("models", [])
    name = settings.prefill.served_model_name
    entry = copy.deepcopy(next((m for m in given if m["id"] == name), {}))
    entry.update(
        {"id": name, "p_max_seqlen": settings.prefill.max_model_len, "d_max_seqlen": settings.decode.max_model_len}
    )
    entry.setdefault("slo_ttft", 1000)
    entry.setdefault("slo_tpot", 50)
    return [entry] + [copy.deepcopy(m) for m in given if m["id"] != name]


def cluster_user_config(settings: Settings) -> dict[str, Any]:
    """The user_config.json the Coordinator pods read: the input with every default filled in,
    the Coordinator bound to 0.0.0.0, the engine pods listed as instances and, with a Redis (the rendered
    one or the input's redis_url), cluster_config's URL, password file and a key prefix of the job's own."""
    cfg = copy.deepcopy(settings.raw)
    cfg["motor_deploy_config"] = dataclasses.asdict(settings.deploy)
    cfg["motor_engine_prefill_config"] = dataclasses.asdict(settings.prefill)
    cfg["motor_engine_decode_config"] = dataclasses.asdict(settings.decode)
    coord = cfg["motor_coordinator_config"]
    coord.setdefault("api_config", {})["coordinator_api_host"] = "0.0.0.0"
    coord["models"] = models(settings)
    coord["instances"] = instances(settings)
    cluster = coord.get("cluster_config", {})
    d = settings.deploy
    if d.redis_enabled:
        cluster["redis_url"] = f"redis://{REDIS_NAME}.{settings.namespace}.svc.{d.cluster_domain}:{REDIS_PORT}/0"
    if cluster.get("redis_url"):
        # Two jobs may share one Redis: each keeps its own keys.
        cluster.setdefault("key_prefix", f"motor:{settings.namespace}:")
        if d.redis_password_secret:
            cluster["redis_password_file"] = f"{REDIS_AUTH_DIR}/{REDIS_PASSWORD_KEY}"
        coord["cluster_config"] = cluster
    return cfg


def engine_args(settings: Settings, role: str) -> list[str]:
    eng: EngineConfig = settings.prefill if role == "prefill" else settings.decode
    kv = {"kv_connector": eng.kv_connector, "kv_role": KV_ROLE[role], "kv_buffer_device": eng.kv_buffer_device}
    if eng.kv_connector_extra_config:
        kv["kv_connector_extra_config"] = eng.kv_connector_extra_config
    args = [
        eng.model_path,
        "--host",
        "0.0.0.0",
        "--port",
        str(eng.port),
        "--served-model-name",
        eng.served_model_name,
        "--max-model-len",
        str(eng.max_model_len),
        "--tensor-parallel-size",
        str(eng.tensor_parallel_size),
        "--pipeline-parallel-size",
        str(eng.pipeline_parallel_size),
        "--gpu-memory-utilization",
        str(eng.gpu_memory_utilization),
        "--kv-transfer-config",
        json.dumps(kv, separators=(",", ":")),
    ]
    return args + list(eng.extra_args)


def _engine_context(settings: Settings, role: str) -> dict[str, Any]:
    eng: EngineConfig = settings.prefill if role == "prefill" else settings.decode
    name = ENGINE_NAME[role]
    res = copy.deepcopy(dataclasses.asdict(eng.resources))
    if eng.accelerator_num:
        for part in ("requests", "limits"):
            # settings refuses native resource names (cpu, memory...), so the accelerators never replace a value.
            assert eng.accelerator_resource_name not in res[part], eng.accelerator_resource_name
            res[part][eng.accelerator_resource_name] = str(eng.accelerator_num)
    probe_period = 10
    return {
        "role": role,
        "name": name,
        "service_name": name,
        "replicas": settings.deploy.p_instances_num if role == "prefill" else settings.deploy.d_instances_num,
        "labels": labels(settings, f"engine-{role}"),
        "engine": eng,
        "args": engine_args(settings, role),
        "resources": {k: v for k, v in res.items() if v},
        "extra_env": [{"name": k, "value": v} for k, v in sorted(eng.env.items())],
        "probe_period": probe_period,
        "startup_failure_threshold": -(-eng.startup_timeout_seconds // probe_period),
    }


def render(settings: Settings) -> dict[str, str]:
    """Return {file name: text} for the whole bundle."""
    env = environment()
    cfg = cluster_user_config(settings)
    config_text = json.dumps(cfg, indent=2, ensure_ascii=True) + "\n"
    d = settings.deploy
    c = settings.coordinator
    ctx = {
        "s": settings,
        "deploy": d,
        "coord": c,
        "namespace": settings.namespace,
        "coordinator_name": COORDINATOR_NAME,
        "config_secret_name": CONFIG_SECRET_NAME,
        "infer_service": INFER_SERVICE,
        "mgmt_service": MGMT_SERVICE,
        "metrics_service": METRICS_SERVICE,
        "coordinator_labels": labels(settings, "coordinator"),
        "config_path": CONFIG_PATH_IN_CONTAINER,
        "config_dir": str(Path(CONFIG_PATH_IN_CONTAINER).parent),
        "config_file": Path(CONFIG_PATH_IN_CONTAINER).name,
        "config_text": config_text,
        "config_hash": hashlib.sha256(config_text.encode()).hexdigest()[:16],
        "tls_enabled": c.infer_tls or c.mgmt_tls,
        "mgmt_scheme": "HTTPS" if c.mgmt_tls else "HTTP",
        "termination_grace": settings.termination_grace_seconds,
        "coordinator_resources": {k: v for k, v in dataclasses.asdict(d.coordinator_resources).items() if v},
        "redis_name": REDIS_NAME,
        "redis_port": REDIS_PORT,
        "redis_uid": REDIS_UID,
        "redis_labels": labels(settings, "redis"),
        "redis_resources": {k: v for k, v in dataclasses.asdict(d.redis_resources).items() if v},
        "redis_auth_dir": REDIS_AUTH_DIR,
        "redis_password_key": REDIS_PASSWORD_KEY,
    }
    out = {
        "coordinator_init.yaml": env.get_template("coordinator_init.yaml.j2").render(ctx),
        "monitoring.yaml": env.get_template("monitoring.yaml.j2").render(
            ctx, dashboard_json=json.dumps(dashboard(), indent=2, ensure_ascii=True)
        ),
        "user_config.json": config_text,
    }
    for role in ("prefill", "decode"):
        ectx = dict(ctx, **_engine_context(settings, role))
        out[f"engine_{role}.yaml"] = env.get_template("engine.yaml.j2").render(ectx)
    return {name: out[name] for name in OUTPUT_FILES}


def write(settings: Settings, out_dir: Path) -> list[Path]:
    """Write the bundle into out_dir, every file or none: each is staged beside its target and renamed into
    place only once all are written, so a target that is a directory or a full disk leaves out_dir as it was
    (and removes the directories made for it)."""
    files = render(settings)
    made = [d for d in (out_dir, *out_dir.parents) if not d.exists()]  # deepest first
    staged: dict[Path, Path] = {}
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            target = out_dir / name
            if target.is_dir():  # the rename would fail, after the others had replaced their files
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(target))
            partial = out_dir / f".{name}.partial"
            staged[partial] = target
            partial.write_text(text, encoding="utf-8")
    except OSError:
        for partial in staged:
            partial.unlink(missing_ok=True)
        for made_dir in made:
            with contextlib.suppress(OSError):  # not empty: something else wrote there meanwhile
                made_dir.rmdir()
        raise
    for partial, target in staged.items():
        os.replace(partial, target)
    return list(staged.values())
