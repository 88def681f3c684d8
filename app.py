"""The Coordinator: `python app.py [--config PATH] [--workers N]`.

One Sanic app serves three ports (inference, management, observability) from `num_workers` worker
processes. Cross-worker state (instances, load, health) is made in `main_process_start` and handed to
the workers through `shared_ctx`; each worker keeps its own engine connection pool on `app.ctx`. With no
instances configured, the built-in engine simulator starts (one prefill and one decode instance on free
loopback ports) so that every endpoint answers out of the box.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import shutil
import signal
import ssl
import sys
import tempfile
import time
from dataclasses import replace
from functools import partial
from multiprocessing import resource_tracker

# prometheus-client picks its multiprocess mode at import time: set the directory before any import.
if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="motor-prom-")
    os.environ["MOTOR_OWNS_PROM_DIR"] = "1"

from sanic import Request, Sanic
from sanic.exceptions import SanicException
from sanic.server.socket import bind_socket
from sanic.worker.loader import AppLoader, CertLoader

from config import (
    ConfigError,
    Endpoint,
    Instance,
    Live,
    Settings,
    load_settings,
    resolve_config_path,
    server_tls_context,
    with_models_for_instances,
)
from engines import EngineClient
from errors import CoordinatorError, HeaderFieldsTooLarge, NotFound, PayloadTooLarge
from handlers import register
from handlers.connection import EdgeProtocol
from handlers.ids import request_id
from handlers.planes import INFER, MGMT, OBS
from handlers.sink import api_of, error_response
from scheduling.health import Health
from scheduling.kv_events import start_subscriber
from scheduling.kv_index import KvEventSource
from scheduling.ledger import Ledger
from scheduling.registry import Registry
from scheduling.scheduler import build_scheduler
from serving.background import Background
from serving.cluster import Cluster, ClusterResponseHomes, replica_id, shared_events
from serving.dispatch import Dispatcher
from serving.door import Door
from serving.metrics import PrometheusObserver, clear_stale_files
from serving.observe import Tick
from serving.status import StatusPublisher, StatusReader
from serving.tenants import Tenants
from serving.usage import PrefillUsages
from state.quotas import TenantQuotas
from state.response_homes import SharedResponseHomes
from state.shared import SharedState, worker_index
from workers.reload import ConfigWatch, Reloader
from workers.supervisor import SANIC_SHUTDOWN_S, STOP_GRACE_S, Supervisor, start_heartbeat

log = logging.getLogger("coordinator")
APP_NAME = "motor_coordinator"


def create_app(settings: Settings) -> Sanic:
    """The app of every process: the main process's listeners (shared memory, the supervisor) and each worker's
    (its serving objects, the drain), the routes and the error handler."""
    app = Sanic(APP_NAME, certloader_class=InferenceTls)
    configure_sanic(app, settings)
    app.ctx.live = Live(settings)  # what every reader in this worker reads the settings through (apply_settings)
    app.ctx.plane_by_port = {settings.infer_port: INFER, settings.mgmt_port: MGMT, settings.obs_port: OBS}
    register(app)
    add_main_process_listeners(app, settings)
    add_worker_listeners(app, settings)
    app.exception(Exception)(render_error)
    return app


def configure_sanic(app: Sanic, settings: Settings) -> None:
    """Sanic's own settings: its limits, timeouts, access log and error format."""
    sanic_limits(app, settings)
    # Sanic's bound on the silence within a head; the head's and body's whole deadlines are EdgeProtocol's, which
    # Sanic's timer checks every half of its shortest timeout.
    app.config.REQUEST_TIMEOUT = settings.request_head_timeout_s
    app.config.KEEP_ALIVE_TIMEOUT = 75
    # The drain window is ours (before_server_stop); Sanic's own wait only lets the last error events out.
    app.config.GRACEFUL_SHUTDOWN_TIMEOUT = SANIC_SHUTDOWN_S
    app.config.ACCESS_LOG = settings.access_log
    app.config.FALLBACK_ERROR_FORMAT = "json"
    app.config.MOTD = False


def add_main_process_listeners(app: Sanic, settings: Settings) -> None:
    """The main process's: the shared memory and the instance set at start, the workers' supervisor, cleanup."""

    @app.main_process_start
    async def make_shared_state(app: Sanic):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # Sanic's state manager has started (main())
        clear_stale_files()
        if settings.cluster.redis_url:  # one name for this replica, in every worker (spawned: they inherit it)
            os.environ["MOTOR_REPLICA_ID"] = replica_id()
        shared = start_shared_state(app, settings)
        for key, value in shared.as_shared_ctx().items():
            setattr(app.shared_ctx, key, value)
        app.ctx.main_shared = shared

    @app.main_process_ready
    async def supervise_workers(app: Sanic):
        # A worker that dies is restarted, after what it held in shared memory is zeroed; a stop signal to
        # the main process marks the whole Coordinator draining (workers/supervisor.py).
        Supervisor(
            app.manager,
            app.ctx.main_shared,
            settings.worker_watchdog_timeout_s,
            stop_deadline_s=settings.drain_timeout_s + STOP_GRACE_S,
        ).install()

    @app.main_process_stop
    async def remove_metrics_dir(app: Sanic):
        stop_shared_state(app)
        if os.environ.get("MOTOR_OWNS_PROM_DIR"):
            shutil.rmtree(os.environ["PROMETHEUS_MULTIPROC_DIR"], ignore_errors=True)


def add_worker_listeners(app: Sanic, settings: Settings) -> None:
    """Each worker's: TLS per port, its serving objects at start, the drain on a stop signal, its stop."""

    @app.before_server_start
    async def tls_per_port(app: Sanic):
        # Sanic gives every server it runs the one TLS context InferenceTls loaded; the management and
        # metrics servers start after this listener (Sanic's `_start_servers`) and take theirs from here.
        mgmt = server_tls_context(settings.mgmt_tls)
        for info in app.state.server_info:
            sock = info.settings.get("sock")  # workers serve sockets the main process bound
            port = sock.getsockname()[1] if sock is not None else info.settings.get("port")
            if port in (settings.mgmt_port, settings.obs_port):
                info.settings["ssl"] = mgmt

    @app.before_server_start
    async def start_worker(app: Sanic):
        build_worker(app, settings)

    @app.before_server_stop
    async def drain(app: Sanic):
        # Readiness turns false and new requests get 503 at once; in-flight ones get the drain window.
        await app.ctx.door.drain(settings.drain_timeout_s)
        # The management and metrics ports stop in Sanic tasks of their own ("RunServer"), which run these
        # listeners too; Sanic's cleanup then waits for them without running the loop and spins forever
        # (sanic/app.py shutdown_tasks). So the primary server lets them finish here, while the loop runs.
        me = asyncio.current_task()
        others = [t for t in asyncio.all_tasks() if t is not me and t.get_name() == "RunServer"]
        if others and me.get_name() != "RunServer":
            await asyncio.wait(others, timeout=5)

    @app.after_server_start
    async def drain_before_stopping(app: Sanic):
        # Sanic's own stop-signal handler (the manager sends workers SIGINT) closes the management and
        # metrics listeners at once, so probes would find nothing to answer them. This one drains first,
        # with every port still serving: readiness 503 `ready: false`, liveness 200, new requests 503.
        # When the whole Coordinator stops, the main process has set the global draining flag before
        # signalling the workers (workers/supervisor.py), so every worker refuses at once. A signal sent to
        # this worker alone makes only this worker drain and exit; the supervisor then restarts it.
        loop = asyncio.get_running_loop()
        stopping: list[asyncio.Task] = []

        async def drain_then_stop() -> None:
            await app.ctx.door.drain(settings.drain_timeout_s)
            app.stop(terminate=False)

        def on_signal() -> None:
            if not stopping:
                stopping.append(loop.create_task(drain_then_stop()))

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)

    @app.after_server_stop
    async def stop_worker(app: Sanic):
        stop_shared_state(app)  # Sanic's single_process mode: this process's own threads
        if app.ctx.reloader is not None:
            await app.ctx.reloader.stop()
        await app.ctx.background.stop()
        if app.ctx.cluster is not None:
            await app.ctx.cluster.stop()
        await app.ctx.client.close()
        if app.ctx.tracing is not None:
            app.ctx.tracing.shutdown()  # the spans still batched are sent
        app.ctx.observer.close()


def build_worker(app: Sanic, settings: Settings) -> None:
    """This worker's serving objects on `app.ctx`, over the shared memory the main process made (or its own in
    Sanic's single_process mode), and its background tasks started."""
    configure_logging(settings.log_level)  # workers are spawned: main()'s logging setup is not theirs
    if hasattr(app.shared_ctx, "motor_doc"):
        shared = SharedState.from_shared_ctx(app.shared_ctx)
    else:  # Sanic's single_process mode runs no main_process_* listener: this process's memory will do
        shared = start_shared_state(app, settings)
    worker = worker_index()
    shared.clear_worker(worker)  # a restarted worker starts from zero (the supervisor zeroed it too)
    ctx = app.ctx
    ctx.started_at = int(time.time())
    ctx.shared = shared
    ctx.registry = Registry(shared)
    clustered = bool(settings.cluster.redis_url)
    ctx.ledger = Ledger(shared, worker, settings.num_workers, remote=clustered)
    live = ctx.live
    ctx.health = Health(shared, live)
    ctx.scheduler = build_scheduler(live, shared, ctx.registry, ctx.ledger, ctx.health)
    ctx.client = EngineClient(live)
    tick = Tick()  # one timer for the worker's batching writers
    ctx.tenants = Tenants(live, TenantQuotas(shared, worker, settings.num_workers), ctx.scheduler.fair, tick)
    ctx.observer = PrometheusObserver(ctx.registry, ctx.ledger, ctx.health, tick, ctx.tenants)
    ctx.door = Door(live, shared, worker)
    ctx.status_reader = StatusReader(shared)
    usages, homes = PrefillUsages(shared, worker, settings.num_workers), SharedResponseHomes(shared)
    ctx.cluster = None
    if clustered:  # replicas act as one (serving/cluster.py)
        replica = os.environ.setdefault("MOTOR_REPLICA_ID", replica_id())
        ctx.cluster = ctx.door.cluster = Cluster(live, shared, worker, replica, ctx.registry)
        ctx.tenants.cluster = ctx.cluster  # tenants' quotas across the replicas, through the store
        homes = ClusterResponseHomes(homes, ctx.cluster)
        # Replicas share the estimate (the KV events' source wraps it: each replica subscribes to the engines itself).
        prefixes = ctx.scheduler.index
        shared_events(
            ctx.cluster, usages, homes, prefixes.estimate if isinstance(prefixes, KvEventSource) else prefixes
        )
        ctx.cluster.start()
    ctx.dispatcher = Dispatcher(live, ctx.scheduler, ctx.health, ctx.client, ctx.observer, usages, homes)
    ctx.background = Background(live, ctx.registry, ctx.health, ctx.client)
    if worker == 0:  # one worker checks health and scrapes engines for all of them (a restarted one too)
        ctx.background.start()
    ctx.tracing = None
    if settings.tracer.endpoint:  # OpenTelemetry (serving/tracing.py); off, its SDK is not even imported
        from serving.tracing import Tracing

        ctx.tracing = Tracing(settings.tracer)
        ctx.dispatcher.trace(ctx.tracing)
        ctx.client.traced = True
    ctx.reloader = None
    if settings.source_path:  # the config file is watched, and what may change live applies (workers/reload.py)
        ctx.reloader = Reloader(shared, partial(apply_settings, app), worker)
        ctx.reloader.start()
    # The supervisor's watchdog kills a worker whose loop stops beating; a worker of a main process (not
    # Sanic's single_process mode, whose parent is whatever started it) stops itself if that one dies.
    start_heartbeat(shared, worker, watch_parent=hasattr(app.shared_ctx, "motor_doc"))
    # Start-up objects live for the worker's life: keep them out of the cyclic collector's scans.
    gc.freeze()


async def render_error(request: Request, exc: Exception):
    """Any error no handler answered (Sanic's own among them), in the request's API envelope."""
    api = api_of(request)
    rid = request_id(request)
    if isinstance(exc, CoordinatorError):
        return error_response(exc, api, rid)
    if not isinstance(exc, SanicException):
        log.exception("unhandled error on %s", request.path, exc_info=exc)
        return error_response(CoordinatorError("internal error"), api, rid)
    status = exc.status_code
    if status == 413 and "header" in str(exc).lower():  # Sanic's limit on the request head
        return error_response(HeaderFieldsTooLarge("request header fields too large"), api, rid)
    if status == 413:
        return error_response(PayloadTooLarge("request body exceeds the configured size limit"), api, rid)
    if status == 404:
        return error_response(NotFound(f"no route {request.method} {request.path}", code="not_found"), api, rid)
    if status >= 500:
        log.error("%s on %s: %s", type(exc).__name__, request.path, exc)
    # Sanic's own errors keep their status and headers (a 405's Allow, a 503's Retry-After).
    err = CoordinatorError(str(exc) or "bad request", headers={k: str(v) for k, v in (exc.headers or {}).items()})
    err.status = status
    err.openai_type = "server_error" if status >= 500 else "invalid_request_error"
    return error_response(err, api, rid)


def start_shared_state(app: Sanic, settings: Settings) -> SharedState:
    """The shared memory with the configured instances, and the threads one process runs for the whole Coordinator
    on `app.ctx` (the main process's, or the only process's in Sanic's single_process mode): the config file's
    watch, the one subscriber to the engines' KV events (a process of its own: scheduling/kv_events.py) and the
    status page's publisher."""
    shared = SharedState.create(kv_events=settings.kv_events.enable)
    Registry(shared).apply("set", list(settings.instances))
    app.ctx.config_watch = watch_config(settings, shared)
    app.ctx.kv_events = start_subscriber(shared, settings)
    app.ctx.status = status_page(settings, shared, app.ctx.config_watch)
    return shared


def stop_shared_state(app: Sanic) -> None:
    """Stop what `start_shared_state` started (nothing when it did not run in this process)."""
    for own in ("config_watch", "kv_events", "status"):
        if getattr(app.ctx, own, None) is not None:
            getattr(app.ctx, own).stop()


def watch_config(settings: Settings, shared: SharedState) -> ConfigWatch | None:
    """The config file's watcher (workers/reload.py), one for the whole Coordinator."""
    if not settings.source_path:
        return None
    watch = ConfigWatch(settings, shared)
    watch.start()
    return watch


def status_page(settings: Settings, shared: SharedState, watch: ConfigWatch | None) -> StatusPublisher:
    """The status page's document, made once a second for all workers (serving/status.py), on the settings the
    config watch last accepted."""
    publisher = StatusPublisher(shared, lambda: watch.running if watch is not None else settings)
    publisher.start()
    return publisher


def apply_settings(app: Sanic, settings: Settings) -> None:
    """A reloaded config's live settings (config.live), in this worker from its next request on: every reader
    reads them through `app.ctx.live`; Sanic and logging keep their own copies."""
    app.ctx.live.s = settings
    sanic_limits(app, settings)
    logging.getLogger().setLevel(settings.log_level)


def sanic_limits(app: Sanic, settings: Settings) -> None:
    """Sanic's own bounds on a body and on a response's silences, from the settings (never below the Coordinator's)."""
    app.config.REQUEST_MAX_SIZE = max(settings.max_request_body_bytes, 10 * 1024 * 1024 + 1024)
    app.config.RESPONSE_TIMEOUT = response_timeout_s(settings)


def start_simulator(settings: Settings) -> Settings:
    """No instances configured: start one prefill and one decode simulator and register them."""
    from engine_sim import SimConfig, launch

    model = settings.models[0].id if settings.models else "qwen3"
    handles = [launch(SimConfig(role=role, model=model)) for role in ("prefill", "decode")]
    instances = tuple(
        Instance(i, h.config.role, model, (Endpoint(0, h.address),)) for i, h in enumerate(handles, start=1)
    )
    for inst in instances:
        log.info(
            "built-in engine simulator: %s instance of %s on http://%s", inst.role, model, inst.endpoints[0].address
        )
    # The simulator can free a prefill's held KV when its decode leg never starts.
    return replace(settings, instances=instances, kv_release_path=settings.kv_release_path or "/sim/kv/release")


def response_timeout_s(s: Settings) -> float:
    """Sanic's RESPONSE_TIMEOUT, which bounds every silent gap of a response, the wait for its first byte included.

    It must never fire before the Coordinator's own deadlines: the longest wait before a first byte is
    every attempt of both legs plus the backoffs (a non-streaming answer is all one gap). Once a stream
    has started, keep-alive comments bound the gaps.
    """
    attempts = s.max_retry + 1
    backoff = sum(s.backoff_s(i) for i in range(s.max_retry))
    return attempts * (s.first_token_timeout_s + s.infer_timeout_s) + 2 * backoff + 60


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="MindIE Motor Coordinator (PD-disaggregated LLM gateway)")
    parser.add_argument(
        "--config", help="user_config.json (default: $USER_CONFIG_PATH, else deployer/user_config.json)"
    )
    parser.add_argument("--workers", type=int, help="override inference_workers_config.num_workers")
    return parser.parse_args(argv)


def configure_logging(level: str) -> None:
    # Per-record work the format does not use costs tens of µs a request: no caller frame lookup, no
    # thread or process-name lookups. The process id (cheap) tells the workers' lines apart.
    logging._srcfile = None
    logging.logThreads = False
    logging.logMultiprocessing = False
    # Lines quote what clients sent (a model name, an engine's error): a lone surrogate there has no UTF-8
    # form, and would fail the write of a whole batch of request lines.
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s", stream=sys.stdout
    )
    for name in ("sanic.root", "sanic.error", "sanic.server", "sanic.access"):
        logger = logging.getLogger(name)
        logger.setLevel(max(logging.getLevelName(level), logging.INFO))
        logger.propagate = False  # Sanic's own handlers print these; the root handler would print them again
    logging.getLogger("sanic.error").addFilter(unread_body_is_no_error)


def unread_body_is_no_error(record: logging.LogRecord) -> bool:
    """Sanic logs an ERROR when a 2xx answer leaves a request body unread: a GET with a body, which GET routes
    ignore (Sanic then reads it away, under the body deadline). What any client can make happen is no error of the
    Coordinator's, and must not fill its error log: the line is dropped."""
    return not str(record.msg).endswith(" body not consumed.")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    path = resolve_config_path(args.config)
    try:
        settings = load_settings(path)
        if args.workers is not None:
            if not 1 <= args.workers <= 64:
                raise ConfigError("--workers: must be 1..64")
            settings = replace(settings, num_workers=args.workers)
        check_ports_free(settings)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    log.info("config loaded from %s", path)
    if not settings.instances:
        settings = start_simulator(settings)
    settings = with_models_for_instances(settings)

    loader = AppLoader(factory=partial(create_app, settings))
    app = loader.load()
    common = dict(
        host=settings.host,
        workers=settings.num_workers,
        access_log=settings.access_log,
        motd=False,
        protocol=EdgeProtocol,
    )
    for port in (settings.infer_port, settings.mgmt_port, settings.obs_port):  # TLS: InferenceTls and tls_per_port
        app.prepare(port=port, **common)
    scheme = "https" if settings.infer_tls.enable_tls else "http"
    obs_scheme = "https" if settings.mgmt_tls.enable_tls else "http"
    log.info(
        "Coordinator on %s://%s:%d (inference), %s:%d (management), %s:%d (metrics), %d worker(s); status page:"
        " %s://%s:%d/",
        scheme,
        settings.host,
        settings.infer_port,
        settings.host,
        settings.mgmt_port,
        settings.host,
        settings.obs_port,
        settings.num_workers,
        obs_scheme,
        f"[{settings.host}]" if ":" in settings.host else settings.host,
        settings.obs_port,
    )
    # The first process Sanic starts is its state manager, which the main process needs until its workers have
    # stopped. It keeps the signal mask it starts with: with SIGTERM blocked, a stop signal to the whole process
    # group (`kill -TERM -- -PGID`: docker stop, most supervisors) cannot end it under the main process (a
    # BrokenPipeError traceback, exit 1). Sanic ends it at exit. The main process unblocks SIGTERM in
    # `make_shared_state`, right after; one that came meanwhile is delivered then. CPython's resource tracker is
    # started first: its launch unblocks SIGTERM in the process that launches it.
    resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    Sanic.serve(primary=app, app_loader=loader)
    return 0


def check_ports_free(settings: Settings) -> None:
    """Each port binds as Sanic will bind it, or ConfigError says which key's port cannot (one line and exit 2,
    rather than Sanic's traceback after the simulator started)."""
    for key, port in (
        ("coordinator_api_infer_port", settings.infer_port),
        ("coordinator_api_mgmt_port", settings.mgmt_port),
        ("coordinator_obs_port", settings.obs_port),
    ):
        try:
            bind_socket(settings.host, port).close()
        except OSError as e:
            raise ConfigError(
                f"motor_coordinator_config.api_config.{key}: cannot listen on {settings.host}:{port} ({e.strerror or e})"
            ) from None


class InferenceTls(CertLoader):
    """The TLS context Sanic loads in each worker (contexts do not cross processes) and gives every server:
    the inference port's. The management and metrics ports get theirs in `tls_per_port`."""

    def load(self, app: Sanic) -> ssl.SSLContext | None:
        return server_tls_context(app.ctx.live.s.infer_tls)


if __name__ == "__main__":
    sys.exit(main())
