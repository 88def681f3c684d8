"""Prometheus metrics, correct across Sanic workers.

Counters and histograms use prometheus-client's multiprocess mode (one mmap file per worker under
$PROMETHEUS_MULTIPROC_DIR, summed at scrape time). Gauges are read from shared memory when /metrics is
served: in-flight and queued requests (summed over the workers' rows), and per endpoint its health,
breaker, this Coordinator's load on it and the engine's own gauges from its last scrape. So a request pays
for a few counter increments and histogram observations, nothing more. What a worker that died held is
zeroed in shared memory by the main process's supervisor (app.py) within about a second, before the
worker is restarted; until then the gauges still count it.

The `model` label takes the names of registered models only (anything else is `other`), so a client
sending made-up model names cannot grow the label set.
"""

from __future__ import annotations

import glob
import os
import time
from bisect import bisect_left

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector

from scheduling.health import Health
from scheduling.kv_index import STATE_NAMES
from scheduling.ledger import Ledger
from scheduling.registry import Registry
from scheduling.status import endpoint_status
from serving.observe import PLACEMENTS, Observer, RequestRecord, Tick, kv_outcome

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0)
OTHER_MODEL = "other"

REQUESTS = Counter(
    "motor_requests_total",
    "Requests answered, by route, model and HTTP status (499: client went away)",
    ["route", "model", "status"],
)
TTFT = Histogram(
    "motor_ttft_seconds",
    "Time to first token of streamed requests, measured at the Coordinator",
    ["route", "model"],
    buckets=LATENCY_BUCKETS,
)
TPOT = Histogram(
    "motor_tpot_seconds",
    "Time per output token after the first, streamed requests",
    ["route", "model"],
    buckets=TPOT_BUCKETS,
)
E2E = Histogram(
    "motor_e2e_seconds", "End-to-end duration of successful requests", ["route", "model"], buckets=LATENCY_BUCKETS
)
LEG = Histogram(
    "motor_leg_seconds",
    "Duration of each PD leg (prefill: until P answered; decode: until D's answer ended)",
    ["leg", "model"],
    buckets=LATENCY_BUCKETS,
)
PROMPT_TOKENS = Counter(
    "motor_prompt_tokens_total",
    "Prompt tokens of successful requests (engine usage, else the Coordinator's count)",
    ["route", "model"],
)
OUTPUT_TOKENS = Counter(
    "motor_generation_tokens_total", "Output tokens of successful requests (usage, or SSE events)", ["route", "model"]
)
MISSED = Counter(
    "motor_missed_handoffs_total",
    "PD requests whose decode recomputed the prompt (P returned no kv_transfer_params, or D failed with them)",
    ["model"],
)
PLACEMENT = Counter(
    "motor_placements_total",
    "Inference requests by placement: pd (a prefill and a decode instance), decode_alone (the pair's decode "
    "instance computed the prompt), whole (one instance: union or fallback)",
    ["model", "placement"],
)
RETRIES = Counter(
    "motor_retries_total",
    "Engine attempts retried before the first byte, by the error that caused them",
    ["model", "reason"],
)
CONTINUATIONS = Counter(
    "motor_stream_continuations_total",
    "Streams continued on another engine after a failure past the first byte, by the error that broke them",
    ["model", "reason"],
)
CONTINUATION_REFUSALS = Counter(
    "motor_stream_continuation_refusals_total",
    "Streams broken past the first byte and not continued, by why not",
    ["model", "reason"],
)
TENANT_REQUESTS = Counter(
    "motor_tenant_requests_total",
    "Requests answered, by tenant (the first 64 the config names; others: other) and HTTP status",
    ["tenant", "status"],
)
TENANT_TOKENS = Counter(
    "motor_tenant_tokens_total",
    "Tokens of successful requests by tenant and kind (prompt, output, cached: the prompt tokens the engine had cached)",
    ["tenant", "kind"],
)
KV_PREDICTION = Counter(
    "motor_kv_prediction_total",
    "Requests whose cached prompt tokens the engines' KV events predicted, by how the engine's count compared: "
    "exact, over (predicted more than it held), under, unpredicted (its exact ids not had in time: the estimate's)",
    ["model", "outcome"],
)
REJECTIONS = Counter("motor_rejections_total", "Requests refused before reaching an engine, by reason", ["reason"])
DISCONNECTS = Counter("motor_client_disconnects_total", "Clients that went away, by phase", ["phase"])
STORE_CALLS = Counter("motor_cluster_store_round_trips_total", "Round trips to the cluster store (cluster mode)")
STORE_ERRORS = Counter("motor_cluster_store_errors_total", "Cluster store round trips that failed or timed out")


def store_calls(store) -> None:
    """A cluster store's round trips and errors since the last call, onto the counters."""
    STORE_CALLS.inc(store.round_trips)
    STORE_ERRORS.inc(store.errors)
    store.round_trips = store.errors = 0


BREAKER_CODES = {"closed": 0, "open": 1, "half_open": 2}
KV_STATE_CODES = {name: code for code, name in STATE_NAMES.items()}


def clear_stale_files() -> None:
    """Start-up, main process: counters left by a previous run in a reused directory must not be summed in."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if path:
        for f in glob.glob(os.path.join(path, "*.db")):
            os.remove(f)


class SharedStateCollector:
    """Gauges read from shared memory at scrape time, the same from whichever worker answers."""

    def __init__(self, registry: Registry, ledger: Ledger, health: Health):
        self.registry, self.ledger, self.health = registry, ledger, health

    def collect(self):
        g, w = self.registry.shared.globals, self.registry.shared.workers
        rows = [w[i] for i in range(len(self.ledger.rows))]
        yield GaugeMetricFamily(
            "motor_inflight_requests",
            "Requests admitted and being served, all workers",
            value=sum(row.inflight for row in rows),
        )
        yield GaugeMetricFamily(
            "motor_queued_requests",
            "Requests waiting in SLO admission queues, all workers",
            value=sum(row.queued for row in rows),
        )
        yield GaugeMetricFamily(
            "motor_draining", "1 while the Coordinator is shutting down", value=1 if g.draining else 0
        )
        if g.synced_at_ms or g.store_up:  # cluster mode
            yield GaugeMetricFamily(
                "motor_cluster_store_connected", "1 while the cluster store answers this replica", value=g.store_up
            )
            yield GaugeMetricFamily(
                "motor_cluster_replicas", "Live Coordinator replicas, this one included", value=max(1, g.replicas)
            )
            yield GaugeMetricFamily(
                "motor_cluster_state_age_seconds",
                "Seconds since this replica last heard the others' load and breakers (staleness)",
                value=max(0.0, time.time() - g.synced_at_ms / 1000) if g.synced_at_ms else 0.0,
            )

        view = self.registry.view()
        labels = ["instance", "endpoint", "role", "model"]

        def family(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=labels)

        fams = [
            (family("motor_instance_healthy", "1 when the endpoint passes its health check"), lambda s: s.healthy),
            (
                family("motor_instance_paused", "1 when the instance is paused (no new requests)"),
                lambda s: s.target.paused,
            ),
            (
                family("motor_instance_breaker_state", "Circuit breaker: 0 closed, 1 open, 2 half-open"),
                lambda s: BREAKER_CODES[s.breaker],
            ),
            (
                family("motor_instance_inflight_requests", "Legs this Coordinator has in flight on the endpoint"),
                lambda s: s.inflight_requests,
            ),
            (
                family("motor_instance_inflight_prompt_tokens", "Prompt tokens of those legs still prefilling"),
                lambda s: s.inflight_prompt_tokens,
            ),
            (
                family("motor_instance_inflight_decode_tokens", "Output tokens budgeted for those legs"),
                lambda s: s.inflight_decode_tokens,
            ),
            (
                family("motor_instance_held_decode_slots", "Decode legs promised to requests still in prefill"),
                lambda s: s.held_decode_slots,
            ),
            (
                family("motor_engine_num_requests_running", "The engine's vllm:num_requests_running"),
                lambda s: s.engine_running,
            ),
            (
                family("motor_engine_num_requests_waiting", "The engine's vllm:num_requests_waiting"),
                lambda s: s.engine_waiting,
            ),
            (
                family("motor_engine_kv_cache_usage_perc", "The engine's vllm:kv_cache_usage_perc (0..1)"),
                lambda s: s.engine_kv_cache_usage,
            ),
            (
                family(
                    "motor_engine_seq_cap",
                    "The most sequences the decode engine was seen running while requests waited for a place "
                    "(0 until seen)",
                ),
                lambda s: s.engine_seq_cap,
            ),
        ]
        kv_blocks = family("motor_kv_events_blocks", "Blocks of the engine's KV cache the KV-event index holds")
        kv_state = family(
            "motor_kv_events_state", "The endpoint's KV-event subscription: 0 off, 1 live, 2 replaying, 3 lost"
        )
        for s in endpoint_status(view, self.ledger, self.health, self.registry.shared.kv_endpoints):
            t = s.target
            values = [str(t.instance_id), str(t.endpoint_id), t.role, t.model]
            for fam, read in fams:
                fam.add_metric(values, float(read(s)))
            kv_blocks.add_metric(values, float(s.kv_blocks))
            kv_state.add_metric(values, float(KV_STATE_CODES[s.kv_events]))
        for fam, _ in fams:
            yield fam
        yield kv_blocks
        yield kv_state


class _PendingCount:
    """A counter child and what this worker added to it since the last flush."""

    __slots__ = ("amount", "child")

    def __init__(self, child):
        self.child, self.amount = child, 0.0

    def flush(self) -> None:
        if self.amount:
            self.child.inc(self.amount)
            self.amount = 0.0


class _PendingHistogram:
    """A histogram child and the observations made since the last flush, already counted into its buckets.

    Flushing writes each touched bucket once, however many observations it got. It writes the child's
    bucket and sum values (`_buckets`, `_sum`, `_upper_bounds`) the way `Histogram.observe` does; they
    are prometheus-client internals, so the version is pinned and tests/test_metrics.py reads the counts back.
    """

    __slots__ = ("bounds", "child", "counts", "seen", "total")

    def __init__(self, child):
        self.child, self.bounds = child, child._upper_bounds
        self.counts = [0] * len(self.bounds)
        self.total, self.seen = 0.0, False

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # the first bucket whose bound is >= value (+Inf last)
        self.total += value
        self.seen = True

    def flush(self) -> None:
        if not self.seen:
            return
        self.child._sum.inc(self.total)
        for i, n in enumerate(self.counts):
            if n:
                self.child._buckets[i].inc(n)
                self.counts[i] = 0
        self.total, self.seen = 0.0, False


class _Series:
    """What requests of one (route, model, status) add to the metrics, made on first use."""

    __slots__ = (
        "decode_leg",
        "dirty",
        "e2e",
        "kv_outcomes",
        "model",
        "output_tokens",
        "parts",
        "placements",
        "prefill_leg",
        "prompt_tokens",
        "requests",
        "tpot",
        "ttft",
    )

    def __init__(self, route: str, model: str, status: int):
        self.requests = _PendingCount(REQUESTS.labels(route, model, str(status)))
        self.placements = {p: _PendingCount(PLACEMENT.labels(model, p)) for p in PLACEMENTS}
        self.parts: list[_PendingCount | _PendingHistogram] = [self.requests, *self.placements.values()]
        self.model, self.dirty = model, False
        if status >= 400:  # failed requests count, nothing more
            return
        self.e2e = _PendingHistogram(E2E.labels(route, model))
        self.prompt_tokens = _PendingCount(PROMPT_TOKENS.labels(route, model))
        self.output_tokens = _PendingCount(OUTPUT_TOKENS.labels(route, model))
        self.ttft = _PendingHistogram(TTFT.labels(route, model))
        self.tpot = _PendingHistogram(TPOT.labels(route, model))
        self.prefill_leg = _PendingHistogram(LEG.labels("prefill", model))
        self.decode_leg = _PendingHistogram(LEG.labels("decode", model))
        self.kv_outcomes: dict[str, _PendingCount] = {}  # made on first use: no series for outcomes never seen
        self.parts += [
            self.e2e,
            self.prompt_tokens,
            self.output_tokens,
            self.ttft,
            self.tpot,
            self.prefill_leg,
            self.decode_leg,
        ]

    def kv_outcome(self, outcome: str) -> None:
        """One request whose cached prompt tokens the KV events predicted, by how the engine's count compared."""
        count = self.kv_outcomes.get(outcome)
        if count is None:
            count = self.kv_outcomes[outcome] = _PendingCount(KV_PREDICTION.labels(self.model, outcome))
            self.parts.append(count)
        count.amount += 1

    def flush(self) -> None:
        self.dirty = False
        for part in self.parts:
            part.flush()


class _TenantSeries:
    """What requests of one (tenant label, status) add to the tenant metrics, made on first use."""

    __slots__ = ("cached_tokens", "dirty", "output_tokens", "parts", "prompt_tokens", "requests")

    def __init__(self, tenant: str, status: int):
        self.requests = _PendingCount(TENANT_REQUESTS.labels(tenant, str(status)))
        self.prompt_tokens = _PendingCount(TENANT_TOKENS.labels(tenant, "prompt"))
        self.output_tokens = _PendingCount(TENANT_TOKENS.labels(tenant, "output"))
        self.cached_tokens = _PendingCount(TENANT_TOKENS.labels(tenant, "cached"))  # written only when not 0
        self.parts = (self.requests, self.prompt_tokens, self.output_tokens, self.cached_tokens)
        self.dirty = False

    def flush(self) -> None:
        self.dirty = False
        for part in self.parts:
            part.flush()


class PrometheusObserver(Observer):
    """Per-request metrics, written to prometheus-client's files at the worker's next `Tick` after the request.

    Each value written in multiprocess mode takes a lock and a write into the worker's mmap file (a
    streamed request made about ten: 38 µs of CPU in a loaded worker). A request adds to plain numbers
    instead, and the tick writes what all requests since the last one added (flushing once per loop pass
    still cost a loaded worker a flush every three or four requests). A scrape this worker answers flushes
    first; another worker's last `TICK_S` of requests may be missing from it.
    """

    def __init__(self, registry: Registry, ledger: Ledger, health: Health, tick: Tick, tenants=None):
        super().__init__(tick)
        self.registry, self.tenants = registry, tenants  # tenants: serving/tenants.py's Tenants (None: not counted)
        self._children: dict[tuple[str, str, int], _Series] = {}
        self._tenant_children: dict[tuple[str, int], _TenantSeries] = {}
        self._dirty: list[_Series | _TenantSeries] = []
        self._timer = tick.timer(self.flush)
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            self.exposition_registry = CollectorRegistry()
            MultiProcessCollector(self.exposition_registry)
        else:  # a single process without the multiprocess directory: the default registry is complete
            self.exposition_registry = REGISTRY
        self.exposition_registry.register(SharedStateCollector(registry, ledger, health))

    def _model(self, model: str) -> str:
        return model if model in self.registry.view().model_names else OTHER_MODEL

    def _series(self, route: str, model: str, status: int) -> _Series:
        # `labels()` takes a lock and builds its key on every call: a request reuses its series' children.
        key = (route, model, status)
        series = self._children.get(key)
        if series is None:
            series = self._children[key] = _Series(route, model, status)
        return series

    def flush(self) -> None:
        self._timer.disarm()
        dirty, self._dirty = self._dirty, []
        for series in dirty:
            series.flush()

    def request_done(self, rec: RequestRecord) -> None:
        super().request_done(rec)
        series = self._series(rec.route, self._model(rec.model), rec.status)
        self._add(series, rec)
        self._mark(series)
        label = self.tenants.request_label(rec) if self.tenants is not None else None
        if label is not None:
            key = (label, rec.status)
            tenant = self._tenant_children.get(key) or self._tenant_children.setdefault(key, _TenantSeries(*key))
            tenant.requests.amount += 1
            if rec.status < 400 and not (rec.family is not None and rec.family.counts_only):
                tenant.prompt_tokens.amount += rec.prompt_tokens
                tenant.output_tokens.amount += rec.generated_tokens
                if rec.cached_tokens > 0:
                    tenant.cached_tokens.amount += rec.cached_tokens
            self._mark(tenant)

    def _mark(self, series: _Series | _TenantSeries) -> None:
        if not series.dirty:
            series.dirty = True
            self._dirty.append(series)
            self._timer.arm()

    def _add(self, series: _Series, rec: RequestRecord) -> None:
        series.requests.amount += 1
        if rec.placement:
            series.placements[rec.placement].amount += 1
        if rec.disconnect_phase:
            DISCONNECTS.labels(rec.disconnect_phase).inc()
        if rec.reject_reason:
            REJECTIONS.labels(rec.reject_reason).inc()
        if rec.status >= 400:
            return
        series.e2e.observe(rec.duration_s)
        outcome = kv_outcome(rec)
        if outcome is not None:
            series.kv_outcome(outcome)
        if (
            rec.family is not None and rec.family.counts_only
        ):  # a count or a tokenization, not an inference: no tokens were served
            return
        series.prompt_tokens.amount += rec.prompt_tokens
        tokens = rec.generated_tokens
        series.output_tokens.amount += tokens
        if rec.stream and rec.ttft_s is not None:
            series.ttft.observe(rec.ttft_s)
            if tokens > 1:
                series.tpot.observe((rec.duration_s - rec.ttft_s) / (tokens - 1))
        if rec.prefill_s is not None:
            series.prefill_leg.observe(rec.prefill_s)
        if rec.decode_s is not None:
            series.decode_leg.observe(rec.decode_s)

    def retry(self, job, target, err) -> None:
        super().retry(job, target, err)
        RETRIES.labels(self._model(job.model), type(err).__name__).inc()

    def continuation(self, job, target, err, kept: int) -> None:
        super().continuation(job, target, err, kept)
        CONTINUATIONS.labels(self._model(job.model), type(err).__name__).inc()

    def continuation_refused(self, job, target, reason: str, err) -> None:
        super().continuation_refused(job, target, reason, err)
        CONTINUATION_REFUSALS.labels(self._model(job.model), reason).inc()

    def missed_handoff(self, job, rec, why: str) -> None:
        super().missed_handoff(job, rec, why)
        MISSED.labels(self._model(job.model)).inc()

    def close(self) -> None:
        self.flush()
        super().close()

    def exposition(self) -> tuple[bytes, str]:
        self.flush()
        return generate_latest(self.exposition_registry), CONTENT_TYPE_LATEST
