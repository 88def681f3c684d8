"""What the values of the deployer-owned sections must satisfy, beyond their types: each key's bounds, the
mounts and Secrets that must not clash, the `vllm serve` flags and environment the templates set themselves,
the Redis several Coordinator pods need. Each check appends one ``key.path: message`` line per problem.
"""

from __future__ import annotations

import ipaddress
import posixpath
import re
import socket
from typing import Any

from config import ROOT_KEY as COORDINATOR_ROOT, split_address

from .kubernetes import (
    DNS_LABEL,
    DNS_SUBDOMAIN_RULE,
    LABEL_VALUE_RULE,
    NODE_PORT_MAX,
    NODE_PORT_MIN,
    PULL_POLICIES,
    check_node_selector,
    check_resources,
    check_tolerations,
    is_dns_subdomain,
    is_extended_resource_name,
    parse_quantity,
)
from .sections import (
    CONFIG_SECRET_NAME,
    COORDINATOR_CODE_DIR,
    COORDINATOR_MOUNTS,
    CPU_KV_BUFFER,
    ENGINE_MOUNTS,
    MAX_INSTANCES,
    REDIS_AUTH_DIR,
    DeployConfig,
    EngineConfig,
)

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

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # an environment variable or a Python class name


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


def _port(value: Any, path: str, errors: list[str]) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and not 1 <= value <= 65535:
        errors.append(f"{path}: must be 1..65535 (got {value})")


def _in_range(value: Any, lo: float, hi: float, path: str, errors: list[str], what: str = "") -> None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not lo <= value <= hi:
        errors.append(f"{path}: must be {lo}..{hi}{what} (got {value})")


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
    if not DNS_LABEL.fullmatch(d.job_id) or len(d.job_id) > 40:
        errors.append(
            f"{p}.job_id: must be a DNS-1123 label of at most 40 characters "
            f"(lowercase letters, digits, '-'; got {d.job_id!r})"
        )
    if not is_dns_subdomain(d.cluster_domain):
        errors.append(f"{p}.cluster_domain: must be {DNS_SUBDOMAIN_RULE} (got {d.cluster_domain!r})")
    for key in ("image_name", "engine_image_name", "redis_image"):
        val = getattr(d, key)
        if not val or any(c.isspace() for c in val):
            errors.append(f"{p}.{key}: must be a non-empty image reference (got {val!r})")
    if d.image_pull_policy not in PULL_POLICIES:
        errors.append(f"{p}.image_pull_policy: must be one of {', '.join(PULL_POLICIES)} (got {d.image_pull_policy!r})")
    for i, name in enumerate(d.image_pull_secrets):
        if isinstance(name, str) and not is_dns_subdomain(name):
            errors.append(f"{p}.image_pull_secrets[{i}]: not a Secret name, {DNS_SUBDOMAIN_RULE} (got {name!r})")
    _in_range(d.coordinator_replicas, 1, 16, f"{p}.coordinator_replicas", errors)
    _in_range(d.p_instances_num, 1, MAX_INSTANCES, f"{p}.p_instances_num", errors)
    _in_range(d.d_instances_num, 1, MAX_INSTANCES, f"{p}.d_instances_num", errors)
    _in_range(d.coordinator_node_port, NODE_PORT_MIN, NODE_PORT_MAX, f"{p}.coordinator_node_port", errors)
    check_resources(d.coordinator_resources, f"{p}.coordinator_resources", errors)
    check_node_selector(d.coordinator_node_selector, f"{p}.coordinator_node_selector", errors)
    check_tolerations(d.coordinator_tolerations, f"{p}.coordinator_tolerations", errors)
    if d.service_account_name and not is_dns_subdomain(d.service_account_name):
        errors.append(
            f"{p}.service_account_name: not a service account name, {DNS_SUBDOMAIN_RULE} "
            f"(got {d.service_account_name!r})"
        )
    _in_range(d.run_as_user, 1, 2**31 - 1, f"{p}.run_as_user", errors, " (non-root)")
    _in_range(d.prestop_sleep_seconds, 0, 300, f"{p}.prestop_sleep_seconds", errors)
    if d.termination_grace_period_seconds < 0:
        errors.append(f"{p}.termination_grace_period_seconds: must be >= 0")
    if not is_dns_subdomain(d.tls_secret_name):
        errors.append(f"{p}.tls_secret_name: not a Secret name, {DNS_SUBDOMAIN_RULE} (got {d.tls_secret_name!r})")
    elif d.tls_secret_name == CONFIG_SECRET_NAME:
        errors.append(
            f"{p}.tls_secret_name: {d.tls_secret_name!r} is the Secret the deployer renders for the "
            f"Coordinator's user_config.json"
        )
    check_resources(d.redis_resources, f"{p}.redis_resources", errors)
    if d.redis_storage_size and parse_quantity(d.redis_storage_size) is None:
        errors.append(f"{p}.redis_storage_size: empty or a Kubernetes quantity (got {d.redis_storage_size!r})")
    if d.redis_storage_class and not is_dns_subdomain(d.redis_storage_class):
        errors.append(
            f"{p}.redis_storage_class: not a StorageClass name, {DNS_SUBDOMAIN_RULE} (got {d.redis_storage_class!r})"
        )
    if d.redis_password_secret and not is_dns_subdomain(d.redis_password_secret):
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
    if not is_extended_resource_name(e.accelerator_resource_name):
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
    check_resources(e.resources, f"{p}.resources", errors)
    check_node_selector(e.node_selector, f"{p}.node_selector", errors)
    check_tolerations(e.tolerations, f"{p}.tolerations", errors)
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
