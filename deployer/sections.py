"""Every deployment key and its default, and how a deployer-owned section is read.

Sections:
- ``motor_deploy_config``: cluster-side settings (namespace, images, counts, ports, TLS secret, the Redis that
  several Coordinator pods share state through).
- ``motor_engine_prefill_config`` / ``motor_engine_decode_config``: the vLLM engines.
- ``motor_coordinator_config``: owned by the Coordinator, whose section models (config.sections) read it;
  `CoordinatorView` holds the sections the deployer renders from (ports, TLS, drain timeout).

deployer.checks holds what each section's values must satisfy (deployer.kubernetes: what the API server
accepts); deployer.settings loads a whole user_config.json with these; deployer.render renders from the result.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import posixpath
from dataclasses import dataclass, field
from typing import Annotated, Any, get_type_hints

from pydantic import ConfigDict, Strict, ValidationError, WrapValidator, with_config
from pydantic_core import ErrorDetails

from config import ConfigError as CoordinatorConfigError, adapter, refusal
from config.sections import ApiConfig, Bool, Int, SchedulerConfig, ShutdownConfig, Str, TlsConfig

# A number as given (NaN and Infinity too: the bounds refuse them, quoting them); an integer stays one, as the
# render writes it (--gpu-memory-utilization 1).
Float = Annotated[float, Strict(), WrapValidator(lambda v, number: v if type(v) is int else number(v))]

CONFIG_PATH_IN_CONTAINER = "/etc/motor/user_config.json"
# The Secret (not a ConfigMap: it may carry API keys, the valid_keys of api_key_config and
# mgmt_api_key_config) holding the rendered user_config.json.
CONFIG_SECRET_NAME = "motor-coordinator-config"
# Directories the templates mount besides the TLS Secret and the weights: two volumes on one path,
# or one inside the other, are refused by Kubernetes or hide the other's files.
COORDINATOR_MOUNTS = (posixpath.dirname(CONFIG_PATH_IN_CONTAINER), "/tmp")
# Where the Coordinator pods mount redis_password_secret, when set, and the key of it they read.
REDIS_AUTH_DIR = "/etc/motor-redis"
REDIS_PASSWORD_KEY = "password"
ENGINE_MOUNTS = ("/dev/shm",)
# The Coordinator image's working directory, holding app.py and the packages it imports (the Dockerfile's WORKDIR).
COORDINATOR_CODE_DIR = "/opt/motor"
MAX_INSTANCES = 64
MAX_DRAIN_SECONDS = 86400
# The kv_buffer_device of CPU engines (accelerator_num 0): vLLM's CPU build keeps the NIXL buffer in host memory.
CPU_KV_BUFFER = "cpu"


class ConfigError(ValueError):
    """Bad input. ``errors`` holds one ``key.path: message`` line per problem."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        super().__init__("\n".join(self.errors))


def _doc(text: str) -> dict[str, str]:
    return {"doc": text}


@with_config(ConfigDict(extra="forbid"))  # an unknown key is a typo
@dataclass
class ResourceSpec:
    """Kubernetes-style ``{"requests": {...}, "limits": {...}}`` for cpu and memory."""

    requests: dict[str, Str] = field(default_factory=dict, metadata=_doc("cpu/memory requests"))
    limits: dict[str, Str] = field(default_factory=dict, metadata=_doc("cpu/memory limits"))


@with_config(ConfigDict(extra="forbid"))  # an unknown key is a typo
@dataclass
class DeployConfig:
    job_id: Str = field(
        default="mindie-motor",
        metadata=_doc("deployment name; also the Kubernetes namespace everything is created in (DNS-1123 label)"),
    )
    create_namespace: Bool = field(
        default=True, metadata=_doc("render a Namespace object for job_id at the top of coordinator_init.yaml")
    )
    cluster_domain: Str = field(
        default="cluster.local", metadata=_doc("cluster DNS domain used in the engines' stable names")
    )
    image_name: Str = field(
        default="motor-coordinator:latest", metadata=_doc("Coordinator image (its working directory holds app.py)")
    )
    engine_image_name: Str = field(
        default="vllm/vllm-openai:latest",
        metadata=_doc("vLLM engine image (must provide `vllm serve` and NIXL); pin a version in production"),
    )
    image_pull_policy: Str = field(
        default="IfNotPresent", metadata=_doc("Always, IfNotPresent or Never, for every container")
    )
    image_pull_secrets: list[Str] = field(
        default_factory=list, metadata=_doc("names of docker-registry Secrets for every pod")
    )
    coordinator_replicas: Int = field(default=1, metadata=_doc("Coordinator pods, 1..16"))
    p_instances_num: Int = field(default=1, metadata=_doc(f"prefill instances (one pod each), 1..{MAX_INSTANCES}"))
    d_instances_num: Int = field(default=1, metadata=_doc(f"decode instances (one pod each), 1..{MAX_INSTANCES}"))
    coordinator_node_port: Int = field(default=31015, metadata=_doc("nodePort of the inference Service, 30000..32767"))
    coordinator_resources: ResourceSpec = field(
        default_factory=lambda: ResourceSpec(
            requests={"cpu": "1", "memory": "1Gi"}, limits={"cpu": "2", "memory": "2Gi"}
        ),
        metadata=_doc("Coordinator container requests/limits"),
    )
    coordinator_node_selector: dict[str, Str] = field(
        default_factory=dict, metadata=_doc("nodeSelector of the Coordinator pods")
    )
    coordinator_tolerations: list[dict[str, Any]] = field(
        default_factory=list, metadata=_doc("tolerations of the Coordinator pods (Kubernetes Toleration objects)")
    )
    service_account_name: Str = field(
        default="",
        metadata=_doc(
            "service account of the Coordinator pods; empty: the namespace default. No API token is mounted either way"
        ),
    )
    run_as_user: Int = field(default=1000, metadata=_doc("non-root UID (and GID) the Coordinator runs as"))
    prestop_sleep_seconds: Int = field(
        default=5,
        metadata=_doc("preStop sleep before SIGTERM, so Service endpoints stop routing to a terminating pod, 0..300"),
    )
    termination_grace_period_seconds: Int = field(
        default=0,
        metadata=_doc(
            "0: prestop_sleep_seconds + shutdown_config.drain_timeout + 10; otherwise must exceed prestop + drain"
        ),
    )
    tls_secret_name: Str = field(
        default="motor-coordinator-tls",
        metadata=_doc("Secret mounted when infer_tls_config or mgmt_tls_config enables TLS"),
    )
    tls_mount_path: Str = field(
        default="/etc/motor-tls",
        metadata=_doc("where that Secret is mounted; cert_file/key_file/ca_file must lie under it"),
    )
    weight_mount_path: Str = field(
        default="/mnt/weight/",
        metadata=_doc(
            "host directory with model weights, mounted read-only at the same path in engine pods; "
            "empty: no mount (model_path is then a Hugging Face id or baked into the image)"
        ),
    )
    dshm_size: Str = field(default="8Gi", metadata=_doc("size of the memory-backed /dev/shm of engine pods"))
    redis_enabled: Bool = field(
        default=False,
        metadata=_doc(
            "render a Redis (StatefulSet, Service, PodDisruptionBudget) the Coordinator pods share state "
            "through: cluster_config.redis_url is set to it; required for coordinator_replicas > 1 unless "
            "cluster_config.redis_url names one"
        ),
    )
    redis_image: Str = field(
        default="redis:7.2.5-alpine",
        metadata=_doc("image of the rendered Redis (must provide redis-server, redis-cli and sh)"),
    )
    redis_resources: ResourceSpec = field(
        default_factory=lambda: ResourceSpec(
            requests={"cpu": "100m", "memory": "256Mi"}, limits={"cpu": "1", "memory": "1Gi"}
        ),
        metadata=_doc("Redis container requests/limits"),
    )
    redis_storage_size: Str = field(
        default="1Gi",
        metadata=_doc("size of the Redis volume claim (append-only file); empty: an emptyDir, lost when the pod moves"),
    )
    redis_storage_class: Str = field(
        default="", metadata=_doc("storageClassName of that claim; empty: the cluster's default class")
    )
    redis_password_secret: Str = field(
        default="",
        metadata=_doc(
            f"Secret whose `{REDIS_PASSWORD_KEY}` key is the Redis password, mounted in the Coordinator pods "
            f"(cluster_config.redis_password_file) and required by the rendered Redis; empty: no password"
        ),
    )


@with_config(ConfigDict(extra="forbid"))  # an unknown key is a typo
@dataclass
class EngineConfig:
    engine_type: Str = field(default="vllm", metadata=_doc("only `vllm` is supported"))
    model_path: Str = field(
        default="/mnt/weight/qwen3",
        metadata=_doc("model directory inside the container (or a Hugging Face id), the `vllm serve` positional"),
    )
    served_model_name: Str = field(
        default="qwen3",
        metadata=_doc("--served-model-name; the model id clients send. Must be equal for prefill and decode"),
    )
    max_model_len: Int = field(
        default=8192, metadata=_doc("--max-model-len; also the Coordinator's p_max_seqlen / d_max_seqlen")
    )
    tensor_parallel_size: Int = field(default=1, metadata=_doc("--tensor-parallel-size"))
    pipeline_parallel_size: Int = field(default=1, metadata=_doc("--pipeline-parallel-size"))
    gpu_memory_utilization: Float = field(default=0.9, metadata=_doc("--gpu-memory-utilization, (0, 1]"))
    port: Int = field(default=8000, metadata=_doc("engine HTTP port (--port), probes on /health"))
    side_channel_port: Int = field(
        default=5600, metadata=_doc("VLLM_NIXL_SIDE_CHANNEL_PORT (NIXL handshake); the host is the pod IP")
    )
    kv_connector: Str = field(
        default="NixlConnector",
        metadata=_doc("kv_connector of --kv-transfer-config; kv_role is kv_producer (prefill) / kv_consumer (decode)"),
    )
    kv_buffer_device: Str = field(
        default="cuda",
        metadata=_doc(
            "kv_buffer_device of --kv-transfer-config: `cuda` for GPU engines; `cpu`, the default and the only "
            "value, when accelerator_num is 0 (CPU engines)"
        ),
    )
    kv_connector_extra_config: dict[str, Any] = field(
        default_factory=dict, metadata=_doc("kv_connector_extra_config of --kv-transfer-config, omitted when empty")
    )
    accelerator_resource_name: Str = field(
        default="nvidia.com/gpu",
        metadata=_doc(
            "extended resource requested for the accelerators (a DNS-subdomain prefix outside kubernetes.io, '/', "
            "a name), e.g. nvidia.com/gpu, amd.com/gpu"
        ),
    )
    accelerator_num: Int = field(
        default=1,
        metadata=_doc("accelerators per pod; 0 for CPU engines, otherwise >= tensor * pipeline parallel size"),
    )
    resources: ResourceSpec = field(
        default_factory=lambda: ResourceSpec(
            requests={"cpu": "4", "memory": "32Gi"}, limits={"cpu": "16", "memory": "64Gi"}
        ),
        metadata=_doc("engine container cpu/memory requests/limits"),
    )
    startup_timeout_seconds: Int = field(
        default=1800, metadata=_doc("how long the startup probe waits for /health (model load), >= 30")
    )
    extra_args: list[Str] = field(
        default_factory=list,
        metadata=_doc("further `vllm serve` arguments, appended as given (not the flags the deployer sets)"),
    )
    env: dict[str, Str] = field(
        default_factory=dict, metadata=_doc("further environment variables (not the deployer-managed NIXL ones)")
    )
    node_selector: dict[str, Str] = field(default_factory=dict, metadata=_doc("nodeSelector of the engine pods"))
    tolerations: list[dict[str, Any]] = field(default_factory=list, metadata=_doc("tolerations of the engine pods"))


@dataclass
class CoordinatorView:
    """The Coordinator's sections the deployer renders from, as the Coordinator's models read them."""

    api: ApiConfig = field(default_factory=ApiConfig)
    infer_tls_config: TlsConfig = field(default_factory=TlsConfig)
    mgmt_tls_config: TlsConfig = field(default_factory=TlsConfig)
    shutdown: ShutdownConfig = field(default_factory=ShutdownConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    tls_files: list[str] = field(default_factory=list)  # the TLS files the pods read from the mounted Secret

    @property
    def infer_port(self) -> int:
        return self.api.infer_port

    @property
    def mgmt_port(self) -> int:
        return self.api.mgmt_port

    @property
    def obs_port(self) -> int:
        return self.api.obs_port

    @property
    def infer_tls(self) -> bool:
        return self.infer_tls_config.enable_tls

    @property
    def mgmt_tls(self) -> bool:
        return self.mgmt_tls_config.enable_tls

    @property
    def drain_timeout(self) -> float:
        return self.shutdown.drain_timeout_s


@dataclass
class Settings:
    deploy: DeployConfig
    prefill: EngineConfig
    decode: EngineConfig
    coordinator: CoordinatorView
    raw: dict[str, Any]  # the whole input, untouched

    @property
    def namespace(self) -> str:
        return self.deploy.job_id

    @property
    def termination_grace_seconds(self) -> int:
        if self.deploy.termination_grace_period_seconds:
            return self.deploy.termination_grace_period_seconds
        return int(self.deploy.prestop_sleep_seconds + self.coordinator.drain_timeout + 10)


SECTIONS = {
    "motor_deploy_config": DeployConfig,
    "motor_engine_prefill_config": EngineConfig,
    "motor_engine_decode_config": EngineConfig,
}
# A top-level key naming one of these is meant for a section the deployer reads, however it is spelled.
_SECTION_WORDS = (
    ("deploy", "motor_deploy_config"),
    ("prefil", "motor_engine_prefill_config"),
    ("decod", "motor_engine_decode_config"),
    ("coordinat", "motor_coordinator_config"),
)
# Every top-level key of user_config.json; `version` is MindIE's format version, passed through unread.
TOP_LEVEL_KEYS = ("version", *SECTIONS, "motor_coordinator_config")


def near_miss(key: str) -> str | None:
    """The known top-level key `key` is probably a misspelling of, if any (MindIE's sections for its other
    components, motor_controller_config and the like, are none)."""
    lower = key.lower()
    close = difflib.get_close_matches(lower, TOP_LEVEL_KEYS, n=1, cutoff=0.85)
    if close:
        return close[0]
    return next((known for word, known in _SECTION_WORDS if word in lower), None)


# --------------------------------------------------------------------------- typed loading


def quoted(exc: CoordinatorConfigError) -> str:
    """A refusal of the Coordinator's config layer, with the value refused, as the deployer quotes it."""
    text = str(exc)
    return f"{text} (got {exc.value[0]!r})" if exc.value and "(got " not in text else text


_UNKNOWN_KEY = ("extra_forbidden", "unexpected_keyword_argument")  # pydantic's error types for an unknown key


def _refusal(error: ErrorDetails, cls: type, path: str) -> str:
    if error["type"] not in _UNKNOWN_KEY:
        return quoted(refusal(error, path))
    owner = cls  # the dataclass the unknown key is in: the section's own, or one of its fields'
    for part in error["loc"][:-1]:
        owner = get_type_hints(owner)[part]
    names = ", ".join(sorted(f.name for f in dataclasses.fields(owner)))
    return f"{refusal(error, path).args[0].partition(': ')[0]}: unknown key (known: {names})"


def load_section(cls: type, data: dict[str, Any], path: str, errors: list[str]) -> Any:
    """A deployer-owned section read by pydantic into its dataclass (strict: JSON's own types), every refused
    value listed in `errors`; the keys refused keep their defaults."""
    try:
        return adapter(cls).validate_python(copy.deepcopy(data))
    except ValidationError as e:
        refused = e.errors(include_url=False)
    # The section's unknown keys first, as they were listed before pydantic read these sections.
    refused.sort(key=lambda e: not (e["type"] in _UNKNOWN_KEY and len(e["loc"]) == 1))
    errors.extend(_refusal(error, cls, path) for error in refused)
    bad = {error["loc"][0] for error in refused}
    return adapter(cls).validate_python(copy.deepcopy({k: v for k, v in data.items() if k not in bad}))


def defaults_as_dict(cls: type) -> dict[str, Any]:
    """The defaults of one section, as they appear in user_config.json."""
    return dataclasses.asdict(cls())


def key_docs(cls: type, prefix: str) -> list[tuple]:
    """(key path, default, doc) for every key of a section, nested objects flattened."""
    rows = []
    inst = cls()
    for f in dataclasses.fields(cls):
        val = getattr(inst, f.name)
        doc = f.metadata.get("doc", "")
        if dataclasses.is_dataclass(val):
            val = dataclasses.asdict(val)
        rows.append((f"{prefix}.{f.name}", val, doc))
    return rows
