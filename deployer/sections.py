"""Every deployment key, its default and its validation, in one place.

Sections:
- ``motor_deploy_config``: cluster-side settings (namespace, images, counts, ports, TLS secret, the Redis that
  several Coordinator pods share state through).
- ``motor_engine_prefill_config`` / ``motor_engine_decode_config``: the vLLM engines.
- ``motor_coordinator_config``: owned by the Coordinator, whose section models (config.sections) read it;
  `CoordinatorView` holds the sections the deployer renders from (ports, TLS, drain timeout).

deployer.settings loads a whole user_config.json with these; deployer.render renders from the result.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import ipaddress
import posixpath
import re
import socket
from dataclasses import dataclass, field
from typing import Annotated, Any, get_type_hints

from pydantic import ConfigDict, Strict, ValidationError, WrapValidator, with_config
from pydantic_core import ErrorDetails

from config import ROOT_KEY as COORDINATOR_ROOT, ConfigError as CoordinatorConfigError, adapter, refusal, split_address
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
# Directories of the images' operating system. A volume on one of them, or on a directory above one, hides
# it and the container cannot start; inside SYSTEM_TREES (programs, libraries, the interpreter, the kernel's
# interfaces) it hides part of them. Inside the others a directory of one's own is fine: /etc/motor-tls,
# /var/lib/models, /root/.cache/huggingface.
SYSTEM_DIRS = (
    "/bin",
    "/boot",
    "/dev",
    "/etc",
    "/home",
    "/lib",
    "/lib64",
    "/opt",
    "/proc",
    "/root",
    "/run",
    "/sbin",
    "/srv",
    "/sys",
    "/usr",
    "/var",
)
SYSTEM_TREES = ("/bin", "/lib", "/lib64", "/proc", "/sbin", "/sys", "/usr")
NODE_PORT_MIN, NODE_PORT_MAX = 30000, 32767
MAX_INSTANCES = 64
MAX_DRAIN_SECONDS = 86400
PULL_POLICIES = ("Always", "IfNotPresent", "Never")


# A Kubernetes Toleration: its fields and their types, and the values the API server accepts.
@dataclass
class Toleration:
    key: Str = ""
    operator: Str = ""
    value: Str = ""
    effect: Str = ""
    tolerationSeconds: Int = 0


TOLERATION_FIELDS = tuple(f.name for f in dataclasses.fields(Toleration))
TOLERATION_OPERATORS = ("Equal", "Exists")
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
# The kv_buffer_device of CPU engines (accelerator_num 0): vLLM's CPU build keeps the NIXL buffer in host memory.
CPU_KV_BUFFER = "cpu"
# Environment variables the engine template sets itself; `env` may not override them.
MANAGED_ENGINE_ENV = ("VLLM_NIXL_SIDE_CHANNEL_PORT", "VLLM_NIXL_SIDE_CHANNEL_HOST", "POD_IP", "POD_NAME")

# `vllm serve` flags the engine template sets, with the key that sets each. vLLM's argparse keeps the
# last occurrence, so the same flag in extra_args would silently override the key.
MANAGED_ENGINE_FLAGS = {
    "--host": "always 0.0.0.0",
    "--port": "from port",
    "--model": "from model_path",
    "--served-model-name": "from served_model_name",
    "--max-model-len": "from max_model_len",
    "--tensor-parallel-size": "from tensor_parallel_size",
    "-tp": "from tensor_parallel_size",
    "--pipeline-parallel-size": "from pipeline_parallel_size",
    "-pp": "from pipeline_parallel_size",
    "--gpu-memory-utilization": "from gpu_memory_utilization",
    "--kv-transfer-config": "from kv_connector, kv_buffer_device and kv_connector_extra_config",
}


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


# --------------------------------------------------------------------------- semantic checks

# Every pattern is applied with fullmatch: `$` would also match before a final newline.
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
DNS_SUBDOMAIN_MAX = 253  # Kubernetes' limit on object names (Secrets, service accounts) and on DNS names
DNS_SUBDOMAIN_RULE = f"a DNS subdomain: lowercase letters, digits, '-' and '.', at most {DNS_SUBDOMAIN_MAX} characters"
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # an environment variable or a Python class name
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")  # fullmatch, at most 63 characters
QUOTA_PREFIX = "requests."  # ResourceQuota's name for a resource's requests
LABEL_VALUE_RULE = "at most 63 letters, digits, '-', '_' or '.', beginning and ending with a letter or digit"
_QUANTITY = re.compile(r"(?P<num>[0-9]+(\.[0-9]*)?|\.[0-9]+)(?P<suf>Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)?")
_SUFFIX = {
    None: 1,
    "m": 1e-3,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "P": 1e15,
    "E": 1e18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}


def is_loopback(address: str) -> bool:
    """Whether an engine address, which the Coordinator's parse_instance accepted, names the pod itself.
    The host is read as the resolver reads it: a final dot is the root ('localhost.'), IPv4 has inet_aton's
    spellings ('127.1', '2130706433', '0x7f.1'), and an IPv4-mapped IPv6 address is its IPv4 address."""
    host = split_address(address)[0].rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        ip: ipaddress.IPv4Address | ipaddress.IPv6Address = ipaddress.IPv4Address(socket.inet_aton(host))
    except OSError:
        try:
            ip = ipaddress.IPv6Address(host)
        except ValueError:
            return False
        ip = ip.ipv4_mapped or ip
    return ip.is_loopback or ip.is_unspecified


def _is_dns_subdomain(name: str) -> bool:
    return len(name) <= DNS_SUBDOMAIN_MAX and _DNS_SUBDOMAIN.fullmatch(name) is not None


def _is_label_value(value: str) -> bool:
    return value == "" or (len(value) <= 63 and _LABEL_NAME.fullmatch(value) is not None)


def _is_label_key(key: str) -> bool:
    """A Kubernetes label key (qualified name): an optional DNS subdomain prefix and '/', then a name."""
    prefix, slash, name = key.rpartition("/")
    if slash and not _is_dns_subdomain(prefix):
        return False
    return name != "" and _is_label_value(name)


def _is_extended_resource_name(name: str) -> bool:
    """What the API server takes as an extended resource (its IsExtendedResourceName): a label key with a
    prefix, outside the kubernetes.io namespace, that is still one with "requests." in front (the quota name).
    A name without a prefix is a native resource: cpu, memory, ephemeral-storage, hugepages-*."""
    return (
        "/" in name
        and "kubernetes.io/" not in name
        and not name.startswith(QUOTA_PREFIX)
        and _is_label_key(QUOTA_PREFIX + name)
    )


def _check_node_selector(selector: dict[str, str], path: str, errors: list[str]) -> None:
    """What the API server refuses in a nodeSelector: keys and values are label keys and values."""
    for key, value in selector.items():
        if not _is_label_key(key):
            errors.append(
                f"{path}.{key}: not a label key (an optional DNS subdomain prefix and '/', then {LABEL_VALUE_RULE})"
            )
        elif not _is_label_value(value):
            errors.append(f"{path}.{key}: not a label value: empty or {LABEL_VALUE_RULE} (got {value!r})")


def _check_tolerations(tolerations: list[dict[str, Any]], path: str, errors: list[str]) -> None:
    """What the API server refuses in a pod's tolerations (its validateTolerations)."""
    for i, tol in enumerate(tolerations):
        at = f"{path}[{i}]"
        bad = [
            f"{at}.{name}: unknown key (known: {', '.join(TOLERATION_FIELDS)})"
            for name in tol
            if name not in TOLERATION_FIELDS
        ]
        try:
            adapter(Toleration).validate_python(tol)
        except ValidationError as e:
            bad += [quoted(refusal(error, at)) for error in e.errors(include_url=False)]
        if bad:
            errors.extend(bad)
            continue
        key, value, effect = tol.get("key", ""), tol.get("value", ""), tol.get("effect", "")
        operator = tol.get("operator") or "Equal"  # Kubernetes' default
        if key and not _is_label_key(key):
            errors.append(f"{at}.key: not a label key (got {key!r})")
        if operator not in TOLERATION_OPERATORS:
            errors.append(f"{at}.operator: must be one of {', '.join(TOLERATION_OPERATORS)} (got {operator!r})")
        elif not key and operator != "Exists":
            errors.append(f"{at}.operator: must be Exists when key is empty (it then tolerates every taint)")
        elif operator == "Exists" and value:
            errors.append(f"{at}.value: must be empty when operator is Exists (got {value!r})")
        elif not _is_label_value(value):
            errors.append(f"{at}.value: not a label value: empty or {LABEL_VALUE_RULE} (got {value!r})")
        if effect and effect not in TAINT_EFFECTS:
            errors.append(
                f"{at}.effect: must be empty (every effect) or one of {', '.join(TAINT_EFFECTS)} (got {effect!r})"
            )
        elif "tolerationSeconds" in tol and effect != "NoExecute":
            errors.append(f"{at}.tolerationSeconds: only with effect NoExecute")


def parse_quantity(text: str) -> float | None:
    m = _QUANTITY.fullmatch(text) if isinstance(text, str) else None
    if not m:
        return None
    return float(m.group("num")) * _SUFFIX[m.group("suf")]


def _port(value: Any, path: str, errors: list[str]) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and not 1 <= value <= 65535:
        errors.append(f"{path}: must be 1..65535 (got {value})")


def _in_range(value: Any, lo: float, hi: float, path: str, errors: list[str], what: str = "") -> None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not lo <= value <= hi:
        errors.append(f"{path}: must be {lo}..{hi}{what} (got {value})")


def _check_resources(res: ResourceSpec, path: str, errors: list[str]) -> None:
    for part in ("requests", "limits"):
        for name, qty in getattr(res, part).items():
            if name not in ("cpu", "memory", "ephemeral-storage"):
                errors.append(f"{path}.{part}.{name}: only cpu, memory, ephemeral-storage here")
            elif parse_quantity(qty) is None:
                errors.append(f"{path}.{part}.{name}: not a Kubernetes quantity (got {qty!r})")
    for name, req in res.requests.items():
        lim = res.limits.get(name)
        rq, lq = parse_quantity(req), parse_quantity(lim) if lim is not None else None
        if rq is not None and lq is not None and rq > lq:
            errors.append(f"{path}.requests.{name}: {req} exceeds limits.{name} {lim}")


def _no_overlap(path: str, mounts: tuple, key: str, pod: str, errors: list[str]) -> None:
    """Refuse a mount path equal to, inside or containing another mount of the same pod."""
    own = path.rstrip("/") + "/"
    for other in mounts:
        if own.startswith(other + "/") or (other + "/").startswith(own):
            errors.append(f"{key}: {path!r} overlaps {other}, also mounted in {pod}")


def _check_mount_path(path: str, key: str, mounts: tuple, pod: str, trees: tuple, errors: list[str]) -> None:
    """A volume's mount path: absolute and normalized (Kubernetes refuses '..'; '//usr' and '/usr/.' are /usr),
    clear of the pod's other mounts, not at or above a system directory, not in `trees` (nor at or above them)."""
    if not path.startswith("/") or path.startswith("//") or posixpath.normpath(path) != (path.rstrip("/") or "/"):
        errors.append(f"{key}: must be a normalized absolute directory (got {path!r})")
        return
    _no_overlap(path, mounts, key, pod, errors)
    own = path.rstrip("/") + "/"
    hidden = next((d for d in SYSTEM_DIRS + trees if (d + "/").startswith(own)), None)
    inside = next((d for d in trees if own.startswith(d + "/")), None)
    if hidden:
        errors.append(f"{key}: {path!r} would hide {hidden}, which the container needs; use a directory of its own")
    elif inside:
        errors.append(
            f"{key}: {path!r} lies inside {inside}, whose files the container runs; a volume there "
            f"would hide some of them"
        )


def check_deploy(d: DeployConfig, errors: list[str]) -> None:
    p = "motor_deploy_config"
    if not _DNS_LABEL.fullmatch(d.job_id) or len(d.job_id) > 40:
        errors.append(
            f"{p}.job_id: must be a DNS-1123 label of at most 40 characters "
            f"(lowercase letters, digits, '-'; got {d.job_id!r})"
        )
    if not _is_dns_subdomain(d.cluster_domain):
        errors.append(f"{p}.cluster_domain: must be {DNS_SUBDOMAIN_RULE} (got {d.cluster_domain!r})")
    for key in ("image_name", "engine_image_name", "redis_image"):
        val = getattr(d, key)
        if not val or any(c.isspace() for c in val):
            errors.append(f"{p}.{key}: must be a non-empty image reference (got {val!r})")
    if d.image_pull_policy not in PULL_POLICIES:
        errors.append(f"{p}.image_pull_policy: must be one of {', '.join(PULL_POLICIES)} (got {d.image_pull_policy!r})")
    for i, name in enumerate(d.image_pull_secrets):
        if isinstance(name, str) and not _is_dns_subdomain(name):
            errors.append(f"{p}.image_pull_secrets[{i}]: not a Secret name, {DNS_SUBDOMAIN_RULE} (got {name!r})")
    _in_range(d.coordinator_replicas, 1, 16, f"{p}.coordinator_replicas", errors)
    _in_range(d.p_instances_num, 1, MAX_INSTANCES, f"{p}.p_instances_num", errors)
    _in_range(d.d_instances_num, 1, MAX_INSTANCES, f"{p}.d_instances_num", errors)
    _in_range(d.coordinator_node_port, NODE_PORT_MIN, NODE_PORT_MAX, f"{p}.coordinator_node_port", errors)
    _check_resources(d.coordinator_resources, f"{p}.coordinator_resources", errors)
    _check_node_selector(d.coordinator_node_selector, f"{p}.coordinator_node_selector", errors)
    _check_tolerations(d.coordinator_tolerations, f"{p}.coordinator_tolerations", errors)
    if d.service_account_name and not _is_dns_subdomain(d.service_account_name):
        errors.append(
            f"{p}.service_account_name: not a service account name, {DNS_SUBDOMAIN_RULE} "
            f"(got {d.service_account_name!r})"
        )
    _in_range(d.run_as_user, 1, 2**31 - 1, f"{p}.run_as_user", errors, " (non-root)")
    _in_range(d.prestop_sleep_seconds, 0, 300, f"{p}.prestop_sleep_seconds", errors)
    if d.termination_grace_period_seconds < 0:
        errors.append(f"{p}.termination_grace_period_seconds: must be >= 0")
    if not _is_dns_subdomain(d.tls_secret_name):
        errors.append(f"{p}.tls_secret_name: not a Secret name, {DNS_SUBDOMAIN_RULE} (got {d.tls_secret_name!r})")
    elif d.tls_secret_name == CONFIG_SECRET_NAME:
        errors.append(
            f"{p}.tls_secret_name: {d.tls_secret_name!r} is the Secret the deployer renders for the "
            f"Coordinator's user_config.json"
        )
    _check_resources(d.redis_resources, f"{p}.redis_resources", errors)
    if d.redis_storage_size and parse_quantity(d.redis_storage_size) is None:
        errors.append(f"{p}.redis_storage_size: empty or a Kubernetes quantity (got {d.redis_storage_size!r})")
    if d.redis_storage_class and not _is_dns_subdomain(d.redis_storage_class):
        errors.append(
            f"{p}.redis_storage_class: not a StorageClass name, {DNS_SUBDOMAIN_RULE} (got {d.redis_storage_class!r})"
        )
    if d.redis_password_secret and not _is_dns_subdomain(d.redis_password_secret):
        errors.append(
            f"{p}.redis_password_secret: not a Secret name, {DNS_SUBDOMAIN_RULE} (got {d.redis_password_secret!r})"
        )
    elif d.redis_password_secret == CONFIG_SECRET_NAME:
        errors.append(
            f"{p}.redis_password_secret: {CONFIG_SECRET_NAME!r} is the Secret the deployer renders for the "
            f"Coordinator's user_config.json"
        )
    _check_mount_path(
        d.tls_mount_path,
        f"{p}.tls_mount_path",
        COORDINATOR_MOUNTS + ((REDIS_AUTH_DIR,) if d.redis_password_secret else ()),
        "the Coordinator pod",
        SYSTEM_TREES + (COORDINATOR_CODE_DIR,),
        errors,
    )
    if d.weight_mount_path:
        _check_mount_path(
            d.weight_mount_path, f"{p}.weight_mount_path", ENGINE_MOUNTS, "the engine pods", SYSTEM_TREES, errors
        )
    if parse_quantity(d.dshm_size) is None:
        errors.append(f"{p}.dshm_size: not a Kubernetes quantity (got {d.dshm_size!r})")


def check_cluster(d: DeployConfig, coordinator: Any, errors: list[str]) -> None:
    """Several Coordinator pods act as one only through Redis: the input's cluster_config.redis_url, or the
    Redis the deployer renders (redis_enabled), not both. The URL is never quoted: it may hold a password."""
    p = "motor_deploy_config"
    at = f"{COORDINATOR_ROOT}.cluster_config"
    cluster = coordinator.get("cluster_config", {}) if isinstance(coordinator, dict) else {}
    if not isinstance(cluster, dict):
        errors.append(f"{at}: must be an object")
        return
    url = cluster.get("redis_url", "")
    if not isinstance(url, str):
        errors.append(f"{at}.redis_url: must be a string")
        return
    if d.redis_enabled and url:
        errors.append(
            f"{p}.redis_enabled: the deployer renders the Redis and points {at}.redis_url at it; "
            f"leave redis_url empty or redis_enabled false"
        )
    elif d.coordinator_replicas > 1 and not d.redis_enabled and not url:
        errors.append(
            f"{p}.coordinator_replicas: {d.coordinator_replicas} Coordinator pods share their state only through "
            f"Redis: set {at}.redis_url or {p}.redis_enabled"
        )
    if d.redis_password_secret and cluster.get("redis_password_file"):
        errors.append(
            f"{at}.redis_password_file: the deployer sets it to the mounted {p}.redis_password_secret; leave it empty"
        )


def _managed_flag(arg: str) -> str | None:
    """The deployer-set flag that a `vllm serve` argument would set, if any. vLLM reads
    --max_model_len as --max-model-len, --kv-transfer-config.kv_role=... as part of
    --kv-transfer-config, and argparse takes a unique prefix (--max-model) for the whole flag."""
    name = arg.split("=", 1)[0]
    if name in MANAGED_ENGINE_FLAGS:
        return name
    if not name.startswith("--") or len(name) < 3:
        return None
    name = "--" + name[2:].replace("_", "-").split(".", 1)[0]
    return next((flag for flag in MANAGED_ENGINE_FLAGS if flag.startswith(name)), None)


def check_engine(e: EngineConfig, p: str, deploy: DeployConfig, errors: list[str]) -> None:
    if e.engine_type != "vllm":
        errors.append(f"{p}.engine_type: only 'vllm' is supported (got {e.engine_type!r})")
    if not e.model_path:
        errors.append(f"{p}.model_path: must not be empty")
    elif (
        e.model_path.startswith("/")
        and deploy.weight_mount_path
        and not (e.model_path.rstrip("/") + "/").startswith(deploy.weight_mount_path.rstrip("/") + "/")
    ):
        errors.append(
            f"{p}.model_path: {e.model_path!r} is not under "
            f"motor_deploy_config.weight_mount_path {deploy.weight_mount_path!r}"
        )
    if not e.served_model_name or any(c.isspace() for c in e.served_model_name):
        errors.append(f"{p}.served_model_name: must be a non-empty name without spaces")
    _in_range(e.max_model_len, 16, 10_000_000, f"{p}.max_model_len", errors)
    _in_range(e.tensor_parallel_size, 1, 64, f"{p}.tensor_parallel_size", errors)
    _in_range(e.pipeline_parallel_size, 1, 64, f"{p}.pipeline_parallel_size", errors)
    if isinstance(e.gpu_memory_utilization, (int, float)) and not 0 < e.gpu_memory_utilization <= 1:
        errors.append(f"{p}.gpu_memory_utilization: must be in (0, 1] (got {e.gpu_memory_utilization})")
    _port(e.port, f"{p}.port", errors)
    _port(e.side_channel_port, f"{p}.side_channel_port", errors)
    if e.port == e.side_channel_port:
        errors.append(f"{p}.side_channel_port: clashes with {p}.port ({e.port})")
    if not _IDENTIFIER.fullmatch(e.kv_connector):
        errors.append(f"{p}.kv_connector: must be a connector class name (got {e.kv_connector!r})")
    if not e.kv_buffer_device:
        errors.append(f"{p}.kv_buffer_device: must not be empty")
    elif e.accelerator_num == 0 and e.kv_buffer_device != CPU_KV_BUFFER:
        errors.append(
            f"{p}.kv_buffer_device: must be {CPU_KV_BUFFER!r} when accelerator_num is 0: the pod has "
            f"no accelerator to hold the KV buffer (got {e.kv_buffer_device!r})"
        )
    if not _is_extended_resource_name(e.accelerator_resource_name):
        errors.append(
            f"{p}.accelerator_resource_name: not an extended resource name: a DNS-subdomain prefix "
            f"outside kubernetes.io, '/', then {LABEL_VALUE_RULE}, e.g. nvidia.com/gpu; not cpu, memory, "
            f"ephemeral-storage or hugepages-* (got {e.accelerator_resource_name!r})"
        )
    if (
        isinstance(e.accelerator_num, int)
        and isinstance(e.tensor_parallel_size, int)
        and isinstance(e.pipeline_parallel_size, int)
    ):
        need = e.tensor_parallel_size * e.pipeline_parallel_size
        if e.accelerator_num < 0:
            errors.append(f"{p}.accelerator_num: must be >= 0")
        elif 0 < e.accelerator_num < need:
            errors.append(
                f"{p}.accelerator_num: {e.accelerator_num} is fewer than "
                f"tensor_parallel_size * pipeline_parallel_size = {need}"
            )
    _check_resources(e.resources, f"{p}.resources", errors)
    _check_node_selector(e.node_selector, f"{p}.node_selector", errors)
    _check_tolerations(e.tolerations, f"{p}.tolerations", errors)
    _in_range(e.startup_timeout_seconds, 30, 86400, f"{p}.startup_timeout_seconds", errors)
    for i, arg in enumerate(e.extra_args):
        flag = _managed_flag(arg)
        if flag:
            errors.append(
                f"{p}.extra_args[{i}]: {arg!r} would override {flag}, which the deployer sets "
                f"({MANAGED_ENGINE_FLAGS[flag]})"
            )
    for name in e.env:
        if not _IDENTIFIER.fullmatch(name):
            errors.append(f"{p}.env.{name}: not a valid environment variable name")
        elif name in MANAGED_ENGINE_ENV:
            errors.append(f"{p}.env.{name}: set by the deployer; use side_channel_port instead")


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
