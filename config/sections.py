"""One model per `motor_coordinator_config` section: each key's name, type, bounds and default, written once.

Every section is a frozen dataclass whose attributes carry units (`first_token_timeout_s`) and whose config
keys keep MindIE-PyMotor's names (the pydantic alias, `first_token_timeout`). The dataclass is what the rest of
the Coordinator reads (plain attributes, nothing validated when one is built in code); pydantic validates a
config object against it (`config.load`), through the `...Section` schemas below where a section also has a
rule across its keys.

Values are read in pydantic's strict mode: a config file is JSON,
and a value of the wrong JSON type is refused, not converted. Lax mode would take "8000" or 8000.0 for an
integer, 1 or "yes" for a boolean, and True for a number. Numbers must be finite (Python's json reads NaN and
Infinity, which compare false with every bound).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import AfterValidator, AliasChoices, AllowInfNan, BeforeValidator, Field, Strict
from pydantic_core import PydanticCustomError

from .addresses import engine_url, split_address
from .keys import looks_hashed
from .validation import config_key

log = logging.getLogger("coordinator.config")
ROOT_KEY = "motor_coordinator_config"
ROLES = ("prefill", "decode", "union")
ENGINE_TYPES = ("vllm", "sglang", "mindie")
SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's --scheduling-policy: "priority" reads the body's `priority`
PD_ENGINE_TYPES = ("vllm",)  # the engines whose prefill/decode protocol (kv_transfer_params) is spoken here
SCHEDULER_TYPES = ("round_robin", "load_balance", "kv_cache_affinity", "slo_aware")
PD_DISPATCH = ("handoff", "trigger")
ADMISSION = ("off", "queue", "reject")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
MIN_WATCHDOG_S = 3.0  # workers write a heartbeat once a second; the supervisor looks twice a second
HTTP_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110 token: what a header name may be


def refused(why: str, key: str = "") -> PydanticCustomError:
    """A refusal in the Coordinator's words; `key` names the key it concerns when a rule of the whole object
    refuses it (config.load appends it to the key path)."""
    return PydanticCustomError("refused", "{why}", {"why": why, "key": key})


def _after(check: Any) -> AfterValidator:
    """An AfterValidator from a check that returns why a value is refused, or None."""

    def run(value: Any) -> Any:
        why = check(value)
        if why:
            raise refused(why)
        return value

    return AfterValidator(run)


def _between(lo: int, hi: int) -> AfterValidator:
    return _after(lambda v: None if lo <= v <= hi else f"must be {lo}..{hi}")


def one_of(choices: tuple[str, ...]) -> AfterValidator:
    return _after(lambda v: None if v in choices else f"must be one of {', '.join(choices)}")


# The value types. Field(ge=...) and Field(gt=...) are pydantic's bounds, said as "must be >= 1", "must be > 0".
Int = Annotated[int, Strict()]
Num = Annotated[float, Strict(), AllowInfNan(False)]
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]
NonEmptyStr = Annotated[Str, Field(min_length=1)]
Port = Annotated[Int, _between(1, 65535)]
Count = Annotated[Int, Field(ge=1)]
MAX_ID = 2**63 - 1  # instance and endpoint ids are kept in 64-bit signed slots of the shared tables
Id = Annotated[Int, _between(0, MAX_ID)]
Seconds = Annotated[Num, Field(gt=0)]
NonNegative = Annotated[Num, Field(ge=0.0)]
HeaderName = Annotated[
    NonEmptyStr,
    _after(  # no client could send another name: every request would get 401
        lambda v: (
            None
            if HTTP_TOKEN.fullmatch(v)
            else f"must be an HTTP header name: letters, digits and !#$%&'*+-.^_`|~ (got {v!r})"
        )
    ),
]
WatchdogSeconds = Annotated[
    NonNegative,
    _after(
        lambda v: (
            f"must be 0 (off) or at least {MIN_WATCHDOG_S:g} (workers beat once a second)"
            if 0 < v < MIN_WATCHDOG_S
            else None
        )
    ),
]
ReleasePath = Annotated[
    Str, _after(lambda v: "must be empty or a path starting with /" if v and not v.startswith("/") else None)
]
LogLevel = Annotated[Str, BeforeValidator(lambda v: v.upper() if isinstance(v, str) else v), one_of(LOG_LEVELS)]


def _key_list(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(k, str) and k for k in value):
        raise refused("must be a list of non-empty strings")
    return tuple(value)


def _valid_address(address: str) -> str:
    try:
        split_address(address)
    except ValueError as e:
        raise refused(f"{e} (got {address!r})") from None
    return address


MAX_BODY_DEFAULT = 16 * 1024 * 1024
MB = 1024 * 1024


def _body_size_bytes(value: Any) -> Any:
    """max_request_body_size in bytes; under 1024 it is MindIE-PyMotor's unit, megabytes, and its 0 ("no
    limit") keeps the default bound: a body limit is never dropped."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1024:
        return value * MB if value else MAX_BODY_DEFAULT
    return value


def key(name: str) -> Any:
    """The config key of an attribute, where MindIE-PyMotor's name differs from it."""
    return Field(alias=name)


# -- sections whose keys are the runtime Settings' own attributes (config.settings) -----------------------


@dataclass(frozen=True)
class ApiConfig:
    """api_config: where the Coordinator listens."""

    host: Annotated[NonEmptyStr, key("coordinator_api_host")] = "127.0.0.1"
    infer_port: Annotated[Port, key("coordinator_api_infer_port")] = 1025
    mgmt_port: Annotated[Port, key("coordinator_api_mgmt_port")] = 1026
    obs_port: Annotated[Port, key("coordinator_obs_port")] = 1027


@dataclass(frozen=True)
class WorkersConfig:
    """inference_workers_config: the Sanic worker processes."""

    num_workers: Annotated[Int, _between(1, 64)] = 1
    worker_watchdog_timeout_s: Annotated[WatchdogSeconds, key("worker_watchdog_timeout")] = 30.0
    # A client's whole time to send a request's head (from the segment with its first byte), then its body (from
    # the head's end): the silence between two bytes is no bound, a byte a second would hold a connection forever.
    request_head_timeout_s: Annotated[Seconds, key("request_head_timeout")] = 10.0
    request_body_timeout_s: Annotated[Seconds, key("request_body_timeout")] = 60.0
    # Open connections a worker keeps on each of its ports; one more is answered 503 and closed.
    max_connections_per_worker: Count = 4096


@dataclass(frozen=True)
class SchedulerConfig:
    """scheduler_config: engine choice, PD dispatch, admission, health and breaker."""

    scheduler_type: Annotated[Str, one_of(SCHEDULER_TYPES)] = "slo_aware"
    pd_dispatch: Annotated[Str, one_of(PD_DISPATCH)] = "handoff"
    admission: Annotated[Str, one_of(ADMISSION)] = "off"
    admission_queue_size: Count = 256
    # The share of predictions that should hold within their error bounds: each engine's allowance is this
    # quantile of its recent prediction errors (scheduling/predict.py), per stage (prefill, decode).
    slo_confidence: Annotated[Num, Field(ge=0.5, le=0.999)] = 0.95
    # slo_aware: per request, the decode instance alone computes the prompt (no prefill leg, no KV transfer)
    # when that is predicted to give the first token sooner within the budgets.
    conditional_disaggregation: Bool = False
    # With no usable P/D pair, serve requests whole (union, then prefill, then decode instances); false: 503.
    enable_pd_separation_fallback_to_hybrid: Bool = True
    metrics_scrape_interval_s: Annotated[Seconds, key("metrics_scrape_interval")] = 1.0
    health_check_interval_s: Annotated[Seconds, key("health_check_interval")] = 1.0
    health_check_timeout_failures: Count = 3
    breaker_failure_threshold: Count = 3
    breaker_open_s: Annotated[Seconds, key("breaker_open_time")] = 5.0
    # An open breaker that trips again stays open twice as long each time, up to this (0: never longer than
    # breaker_open_time). MindIE-PyMotor's circuit_config.max_timeout_s.
    breaker_max_open_s: Annotated[NonNegative, key("breaker_max_open_time")] = 0.0
    kv_affinity_block_size: Count = 16
    affinity_overload_factor: Annotated[Num, Field(ge=1.0)] = 2.0


@dataclass(frozen=True)
class RescheduleConfig:
    """exception_config.reschedule_config: a stream whose engine fails after visible output goes on elsewhere
    (serving/continuation.py). `max_continuations` bounds how often one request is continued (PyMotor has no
    such key; its `recompute_max_retry` is gone and ignored)."""

    enable: Bool = False
    max_continuations: Annotated[Int, _between(1, 10)] = 2


def _one_reschedule_switch(data: Any) -> Any:
    """`recompute_enabled`, PyMotor's deprecated spelling of reschedule_config.enable, read into it; both given
    and different is refused (PyMotor lets the new key win silently: an operator would not learn which one holds)."""
    if not isinstance(data, dict) or "recompute_enabled" not in data:
        return data
    alias = data["recompute_enabled"]
    if not isinstance(alias, bool):
        raise refused("must be a boolean", "recompute_enabled")
    log.warning(
        "config: exception_config.recompute_enabled is deprecated; use exception_config.reschedule_config.enable"
    )
    section = data.get("reschedule_config", {})
    if not isinstance(section, dict):
        return data  # refused as reschedule_config's own type
    if "enable" in section and section["enable"] is not alias:
        raise refused("contradicts reschedule_config.enable (its deprecated spelling)", "recompute_enabled")
    rest = {k: v for k, v in data.items() if k != "recompute_enabled"}
    return {**rest, "reschedule_config": {**section, "enable": alias}}


@dataclass(frozen=True)
class ExceptionConfig:
    """exception_config: retries and timeouts."""

    max_retry: Annotated[Int, _between(0, 100)] = 3
    retry_delay_s: Annotated[NonNegative, key("retry_delay")] = 0.2
    first_token_timeout_s: Annotated[Seconds, key("first_token_timeout")] = 600.0
    infer_timeout_s: Annotated[Seconds, key("infer_timeout")] = 3600.0
    connect_timeout_s: Annotated[Seconds, key("connect_timeout")] = 10.0
    stream_idle_timeout_s: Annotated[Seconds, key("stream_idle_timeout")] = 300.0
    stream_keepalive_interval_s: Annotated[Seconds, key("stream_keepalive_interval")] = 15.0
    kv_release_path: ReleasePath = ""
    # A client reading slower than the engine writes: what waits for it on its connection, and how long its
    # stream may last in all (0: no bound).
    max_stream_buffer_bytes: Annotated[Int, Field(ge=16384), key("max_stream_buffer_size")] = 1024 * 1024
    stream_total_timeout_s: Annotated[NonNegative, key("stream_total_timeout")] = 3600.0
    reschedule: Annotated[RescheduleConfig, key("reschedule_config")] = RescheduleConfig()
    # Read into reschedule_config.enable (ExceptionSection); a field only so that it is a known key.
    recompute_enabled: Annotated[Bool | None, key("recompute_enabled")] = None
    # MindIE-PyMotor's: retries of the forward to an engine; when set, the retries made (max_retry otherwise).
    transport_max_retry: Annotated[
        Int | None, _after(lambda v: None if v is None or 0 <= v <= 100 else "must be 0..100")
    ] = None
    # The most of an engine's error body kept and passed on to the client.
    upstream_error_body_max_bytes: Annotated[Int, Field(ge=256)] = 64 * 1024


@dataclass(frozen=True)
class RateLimitConfig:
    """rate_limit_config: request size, concurrency and rate."""

    max_request_body_bytes: Annotated[
        Int, BeforeValidator(_body_size_bytes), Field(ge=1024), key("max_request_body_size")
    ] = MAX_BODY_DEFAULT
    max_inflight_requests: Annotated[Int, Field(ge=0)] = 0
    requests_per_second: NonNegative = 0.0
    # MindIE-PyMotor's token bucket: `max_requests` at once, refilled over `window_size` seconds. Here one bucket
    # holds for all workers (PyMotor's is per worker process).
    enable_rate_limit: Bool = False
    max_requests: Count = 1000
    window_size_s: Annotated[Seconds, key("window_size")] = 60.0
    provider: Annotated[Str, one_of(("simple",))] = "simple"  # PyMotor's `olc` adapter is not here
    scope: Annotated[Str, one_of(("global",))] = "global"
    skip_paths: Annotated[tuple[str, ...], BeforeValidator(_key_list)] = ()
    error_message: NonEmptyStr = "too many requests, please try again later"
    error_status_code: Annotated[Int, _between(400, 599)] = 429


@dataclass(frozen=True)
class ShutdownConfig:
    """shutdown_config: the drain on SIGTERM."""

    drain_timeout_s: Annotated[NonNegative, key("drain_timeout")] = 30.0


@dataclass(frozen=True)
class LogConfig:
    """log_config."""

    log_level: LogLevel = "INFO"
    access_log: Bool = False


# -- sections the Settings hold as one object each --------------------------------------------------------


# Plain keys, or MindIE-PyMotor's hashed `salt:iterations:hexhash` (config.keys; `python -m config.keys hash`).
KeyList = Annotated[
    tuple[str, ...],
    BeforeValidator(_key_list),
    _after(lambda keys: next(filter(None, map(looks_hashed, keys)), None)),
]


@dataclass(frozen=True)
class ApiKeyConfig:
    """api_key_config: the clients' keys on the inference port."""

    enable_api_key: Bool = False
    valid_keys: KeyList = ()
    header_name: HeaderName = "Authorization"
    key_prefix: Str = "Bearer "
    # Paths (exact) where no key is asked for, as MindIE-PyMotor's api_key_config.skip_paths.
    skip_paths: Annotated[tuple[str, ...], BeforeValidator(_key_list)] = ()
    encryption_algorithm: Annotated[Str, one_of(("PBKDF2_SHA256",))] = "PBKDF2_SHA256"  # of hashed valid_keys
    # A file holding one more key (MindIE-PyMotor's mgmt_api_key_config.api_key_file), read at start and reload.
    api_key_file: Str = ""


@dataclass(frozen=True)
class MgmtApiKeyConfig(ApiKeyConfig):
    """mgmt_api_key_config: the operators' keys on the management and observability ports."""

    header_name: HeaderName = "X-Motor-Management-Key"
    key_prefix: Str = ""


def _keys_when_enabled(cfg: ApiKeyConfig) -> ApiKeyConfig:
    if cfg.enable_api_key and not (cfg.valid_keys or cfg.api_key_file):
        raise refused("must list at least one key when enable_api_key is true", "valid_keys")
    return cfg


@dataclass(frozen=True)
class TlsConfig:
    """infer_tls_config, mgmt_tls_config. MindIE spells the switch tls_enable: either spelling turns TLS on."""

    enable_tls: Annotated[Bool, Field(validation_alias=AliasChoices("enable_tls", "tls_enable"))] = False
    cert_file: Str = ""
    key_file: Str = ""
    ca_file: Str = ""
    passwd_file: Str = ""  # a file holding key_file's password (an encrypted key)
    crl_file: Str = ""  # revoked client certificates (with ca_file)


def _one_tls_switch(data: Any) -> Any:
    """Both spellings of the switch only if they agree (a tls_enable that is no boolean is refused as one)."""
    if isinstance(data, dict) and "enable_tls" in data and "tls_enable" in data:
        enable, alias = data["enable_tls"], data["tls_enable"]
        if isinstance(enable, bool) and alias is not enable:
            if isinstance(alias, bool):
                raise refused("contradicts enable_tls (MindIE's spelling of the same switch)", "tls_enable")
            data = {k: v for k, v in data.items() if k != "enable_tls"}  # pydantic then reads tls_enable alone
    return data


def _cert_and_key_when_enabled(tls: TlsConfig) -> TlsConfig:
    if tls.enable_tls and not (tls.cert_file and tls.key_file):
        raise refused("cert_file and key_file are required when enable_tls is true", "cert_file")
    return tls


def _ports_differ(api: ApiConfig) -> ApiConfig:
    taken: dict[int, str] = {}  # port: the key that has it
    for attr in ("infer_port", "mgmt_port", "obs_port"):
        port, name = getattr(api, attr), config_key(ApiConfig, attr)
        if port in taken:  # the later key clashes, as the deployer says it
            raise refused(
                f"clashes with {ROOT_KEY}.api_config.{taken[port]} ({port}); the three ports must differ", name
            )
        taken[port] = name
    return api


# -- MindIE-PyMotor's sections, read into the Coordinator's own keys (config.pymotor) -----------------------


@dataclass(frozen=True)
class CircuitConfig:
    """circuit_config: MindIE-PyMotor's breaker, scheduler_config's breaker_* keys under its names (and its
    defaults, when the section is given)."""

    enable: Bool = True
    failure_threshold: Count = 3
    base_timeout_s: Seconds = 30.0
    max_timeout_s: NonNegative = 300.0


Ratio = Annotated[Num, Field(ge=0.0), _after(lambda v: None if v <= 1.0 else "must be 0..1")]


@dataclass(frozen=True)
class TracerConfig:
    """tracer_config: OpenTelemetry export of one span tree per request (empty endpoint: off)."""

    endpoint: Str = ""
    root_sampling_rate: Ratio = 1.0
    remote_parent_sampled: Ratio = 1.0
    remote_parent_not_sampled: Ratio = 1.0
    local_parent_sampled: Ratio = 1.0
    local_parent_not_sampled: Ratio = 1.0


def _redis_url(url: str) -> str | None:
    if url and not url.startswith(("redis://", "rediss://")):
        return "must be a redis:// or rediss:// URL (or empty: one pod alone)"
    return None


@dataclass(frozen=True)
class ClusterConfig:
    """cluster_config: replicas that act as one Coordinator, sharing their state through Redis (state/cluster.py).

    Empty `redis_url`: one pod alone, its workers sharing memory, no Redis needed.
    """

    redis_url: Annotated[Str, _after(_redis_url)] = ""  # redis:// or rediss:// (TLS); a password may be in it
    redis_password_file: Str = ""  # a file holding the password (a mounted Secret), read at start
    key_prefix: NonEmptyStr = "motor:"  # every key starts with it: Coordinators sharing one Redis keep apart
    sync_interval_ms: Annotated[Int, _between(10, 1000)] = 50  # load, breakers and the instance set, both ways
    replica_ttl_s: Annotated[Seconds, Field(ge=0.5)] = 3.0  # a replica silent this long counts no more
    redis_timeout_ms: Annotated[Int, _between(10, 10000)] = 250  # a round trip longer than this: the store is down
    # Trigger mode: where decode engines call back (the Coordinator Service: any replica answers); empty: this pod.
    metaserver_url: Str = ""


def _zmq_endpoint(url: str) -> str | None:
    # ipc://: vLLM binds its PUB socket only for a wildcard or ipc address (it connects to any other), so
    # engines on the Coordinator's own host that must not listen beyond it publish on a Unix socket.
    if url.startswith("ipc://") and len(url) > len("ipc://"):
        return None
    if not url.startswith("tcp://") or url.rfind(":") <= len("tcp://"):
        return "must be tcp://HOST:PORT ({host} stands for each engine endpoint's host) or ipc://PATH"
    return None


ZmqEndpoint = Annotated[Str, _after(_zmq_endpoint)]


@dataclass(frozen=True)
class KvEventConfig:
    """kv_event_config (MindIE-PyMotor: prefill_kv_event_config): subscribe to every engine's KV cache events
    (vLLM's --kv-events-config with the ZMQ publisher) and route on what each engine holds (scheduling/kv_events.py).
    An endpoint's own `kv_events` object overrides the two addresses."""

    enable: Bool = False
    endpoint: ZmqEndpoint = "tcp://{host}:5557"
    replay_endpoint: Annotated[Str, _after(lambda v: _zmq_endpoint(v) if v else None)] = "tcp://{host}:5558"
    topic: Str = ""


@dataclass(frozen=True)
class EndpointKvEvents:
    """An endpoint's `kv_events`: where its engine publishes (engines sharing a host publish on ports of their own)."""

    endpoint: ZmqEndpoint
    replay_endpoint: Annotated[Str, _after(lambda v: _zmq_endpoint(v) if v else None)] = ""


@dataclass(frozen=True)
class Aigw:
    """aigw: MindIE-PyMotor's one `/v1/models` entry; what it leaves out comes from the engine sections."""

    id: Str = ""
    object: Annotated[Str, one_of(("model",))] = "model"
    owned_by: Str = "motor"
    p_max_seqlen: Annotated[Int | None, _after(lambda v: None if v is None or v >= 1 else "must be >= 1")] = None
    d_max_seqlen: Annotated[Int | None, _after(lambda v: None if v is None or v >= 1 else "must be >= 1")] = None
    slo_ttft_ms: Annotated[Count, key("slo_ttft")] = 1000
    slo_tpot_ms: Annotated[Count, key("slo_tpot")] = 50


# -- models and instances ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    """One entry of `models`: a served model's SLOs and limits."""

    id: NonEmptyStr
    slo_ttft_ms: Annotated[Count, key("slo_ttft")] = 1000
    slo_tpot_ms: Annotated[Count, key("slo_tpot")] = 50
    p_max_seqlen: Count = 8192
    d_max_seqlen: Count = 8192
    engine_type: Annotated[Str, one_of(ENGINE_TYPES)] = "vllm"
    tokenizer_path: Str = ""


@dataclass(frozen=True)
class Endpoint:
    """One engine process of an instance."""

    id: Id
    address: Annotated[NonEmptyStr, AfterValidator(_valid_address)]  # "host:port"
    kv_events: EndpointKvEvents | None = None  # its own KV-event addresses (else kv_event_config's, {host} filled)

    @property
    def base_url(self) -> str:
        return engine_url(self.address)


def _numbered_endpoints(value: Any) -> Any:
    """A non-empty list; an endpoint without an id has its index, one without an address is refused as a string."""
    if not isinstance(value, list) or not value:
        raise refused("must be a non-empty list")
    return [{"id": j, "address": None, **ep} if isinstance(ep, dict) else ep for j, ep in enumerate(value)]


@dataclass(frozen=True)
class Instance:
    """One entry of `instances` (or of a POST /instances/refresh body): an engine instance and its endpoints."""

    id: Id
    role: Annotated[Str, one_of(ROLES)]
    model_name: NonEmptyStr
    endpoints: Annotated[tuple[Endpoint, ...], BeforeValidator(_numbered_endpoints)]
    engine_type: Annotated[Str, one_of(ENGINE_TYPES)] = "vllm"
    # vLLM's --scheduling-policy of its engines: with "priority" each request carries its x-priority class as
    # vLLM's `priority` field (an FCFS engine refuses a non-zero one)
    scheduling_policy: Annotated[Str, one_of(SCHEDULING_POLICIES)] = "fcfs"

    def to_json(self) -> dict:
        return {
            "id": self.id,
            "role": self.role,
            "model_name": self.model_name,
            "engine_type": self.engine_type,
            "scheduling_policy": self.scheduling_policy,
            "endpoints": [_endpoint_json(e) for e in self.endpoints],
        }


def _endpoint_json(e: Endpoint) -> dict:
    out: dict = {"id": e.id, "address": e.address}
    if e.kv_events is not None:
        out["kv_events"] = {"endpoint": e.kv_events.endpoint, "replay_endpoint": e.kv_events.replay_endpoint}
    return out


def _absent_as_null(data: Any) -> Any:
    """An absent key of an instance is refused as the type it lacks ("must be a string"), not as missing."""
    if isinstance(data, dict):
        return {"id": None, "role": None, "model_name": None, "endpoints": None, **data}
    return data


def _endpoint_ids_unique(inst: Instance) -> Instance:
    # Logs, GET /instances and the metrics' (instance, endpoint) labels name endpoints by id.
    seen: set[int] = set()
    for j, ep in enumerate(inst.endpoints):
        if ep.id in seen:
            raise refused(f"duplicate endpoint id {ep.id} in instance {inst.id}", f"endpoints[{j}].id")
        seen.add(ep.id)
    return inst


def _pd_protocol_spoken(inst: Instance) -> Instance:
    # A prefill or decode leg carries vLLM's kv_transfer_params; other engines' PD handshakes are not spoken here.
    if inst.role != "union" and inst.engine_type not in PD_ENGINE_TYPES:
        raise refused(
            f"a {inst.role} instance must be {' or '.join(PD_ENGINE_TYPES)}: the PD protocol of {inst.engine_type} "
            "is not implemented (a union instance of it serves whole requests)",
            "engine_type",
        )
    return inst


def _model_ids_unique(models: tuple[ModelConfig, ...]) -> tuple[ModelConfig, ...]:
    if len({m.id for m in models}) != len(models):
        raise refused("model ids must be unique")
    return models


def _alone_needs_predictions(sched: SchedulerConfig) -> SchedulerConfig:
    if sched.conditional_disaggregation and sched.scheduler_type != "slo_aware":
        raise refused("needs scheduler_type slo_aware (it decides on predicted times)", "conditional_disaggregation")
    return sched


# The schemas config.load validates against: the section's dataclass and its rules across keys.
SchedulerSection = Annotated[SchedulerConfig, AfterValidator(_alone_needs_predictions)]
ApiSection = Annotated[ApiConfig, AfterValidator(_ports_differ)]
ExceptionSection = Annotated[ExceptionConfig, BeforeValidator(_one_reschedule_switch)]
MgmtApiKeySection = Annotated[MgmtApiKeyConfig, AfterValidator(_keys_when_enabled)]
TlsSwitch = Annotated[TlsConfig, BeforeValidator(_one_tls_switch)]  # the types and the switch, not the files
TlsSection = Annotated[TlsSwitch, AfterValidator(_cert_and_key_when_enabled)]
InstanceEntry = Annotated[
    Instance,
    BeforeValidator(_absent_as_null),
    AfterValidator(_endpoint_ids_unique),
    AfterValidator(_pd_protocol_spoken),
]
ModelList = Annotated[tuple[ModelConfig, ...], AfterValidator(_model_ids_unique)]
