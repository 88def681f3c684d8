"""Prometheus metrics, correct across Sanic workers.

Counters and histograms use prometheus-client's multiprocess mode (one mmap file per worker under
$PROMETHEUS_MULTIPROC_DIR, summed at scrape time). Gauges of shared state (per-instance load, breaker,
the engines' own scraped gauges) are read straight from shared memory when /metrics is served.
"""

from __future__ import annotations

import os
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector

from serving.observe import Observer, RequestRecord

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0)

REQUESTS = Counter("motor_requests_total", "Requests answered, by route, model and HTTP status", ["route", "model", "status"])
TTFT = Histogram("motor_ttft_seconds", "Time to first token measured at the Coordinator", ["route", "model"], buckets=LATENCY_BUCKETS)
TPOT = Histogram("motor_tpot_seconds", "Time per output token after the first (streamed requests)", ["route", "model"], buckets=TPOT_BUCKETS)
E2E = Histogram("motor_e2e_seconds", "End-to-end request duration", ["route", "model"], buckets=LATENCY_BUCKETS)
LEG = Histogram("motor_leg_seconds", "Duration of each PD leg", ["leg", "model"], buckets=LATENCY_BUCKETS)
MISSED = Counter("motor_missed_handoffs_total", "Prefill legs that returned no kv_transfer_params", ["model"])
RETRIES = Counter("motor_retries_total", "Engine attempts retried before the first byte", ["model", "reason"])
REJECTIONS = Counter("motor_rejections_total", "Requests refused before reaching an engine", ["reason"])
DISCONNECTS = Counter("motor_client_disconnects_total", "Clients that went away, by phase", ["phase"])
INFLIGHT = Gauge("motor_inflight_requests", "Requests being served", multiprocess_mode="livesum")


class SharedStateCollector:
    """Per-instance load, breaker state and engine gauges, read from shared memory at scrape time."""

    def __init__(self, registry, ledger, health):
        self.registry, self.ledger, self.health = registry, ledger, health

    def collect(self):
        labels = ["instance", "endpoint", "role", "model"]
        fams = {
            "inflight": GaugeMetricFamily("motor_instance_inflight_requests", "Requests in flight per instance endpoint", labels=labels),
            "prompt": GaugeMetricFamily("motor_instance_inflight_prompt_tokens", "Prompt tokens awaiting prefill", labels=labels),
            "decode": GaugeMetricFamily("motor_instance_inflight_decode_tokens", "Output tokens budgeted for running requests", labels=labels),
            "healthy": GaugeMetricFamily("motor_instance_healthy", "1 when the endpoint passes its health check", labels=labels),
            "breaker": GaugeMetricFamily("motor_instance_breaker_state", "Circuit breaker: 0 closed, 1 open, 2 half-open", labels=labels),
            "running": GaugeMetricFamily("motor_engine_num_requests_running", "Engine's vllm:num_requests_running", labels=labels),
            "waiting": GaugeMetricFamily("motor_engine_num_requests_waiting", "Engine's vllm:num_requests_waiting", labels=labels),
            "kv": GaugeMetricFamily("motor_engine_kv_cache_usage_perc", "Engine's vllm:kv_cache_usage_perc", labels=labels),
        }
        breaker_codes = {"closed": 0, "open": 1, "half_open": 2}
        for t in self.registry.view().targets:
            lv = [str(t.instance_id), str(t.endpoint_id), t.role, t.model]
            requests, prompt_tokens, decode_tokens, _ = self.ledger.load(t.slot)
            running, waiting, kv = self.health.engine_load(t.slot)
            fams["inflight"].add_metric(lv, requests)
            fams["prompt"].add_metric(lv, prompt_tokens)
            fams["decode"].add_metric(lv, decode_tokens)
            fams["healthy"].add_metric(lv, 1.0 if self.health.is_healthy(t.slot) else 0.0)
            fams["breaker"].add_metric(lv, breaker_codes[self.health.breaker(t.slot)])
            fams["running"].add_metric(lv, running)
            fams["waiting"].add_metric(lv, waiting)
            fams["kv"].add_metric(lv, kv)
        yield from fams.values()


class PrometheusObserver(Observer):
    def __init__(self, registry, ledger, health):
        self.exposition_registry = CollectorRegistry()
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            MultiProcessCollector(self.exposition_registry)
        else:  # a single process without the multiprocess directory: the default registry is complete
            from prometheus_client import REGISTRY

            self.exposition_registry = REGISTRY
        self.exposition_registry.register(SharedStateCollector(registry, ledger, health))

    def request_started(self) -> None:
        INFLIGHT.inc()

    def request_done(self, rec: RequestRecord) -> None:
        super().request_done(rec)
        INFLIGHT.dec()
        model = rec.model or "-"
        REQUESTS.labels(rec.route, model, str(rec.status)).inc()
        if rec.status == 499:
            DISCONNECTS.labels(rec.disconnect_phase or "unknown").inc()
        elif rec.status in (429, 503) and rec.error:
            REJECTIONS.labels(rec.reject_reason or str(rec.status)).inc()
        if rec.status >= 400:
            return
        duration = time.monotonic() - rec.started
        E2E.labels(rec.route, model).observe(duration)
        if rec.ttft_s is not None:
            TTFT.labels(rec.route, model).observe(rec.ttft_s)
            if rec.stream and rec.events > 3:
                # Streams carry one event per token plus the role/usage/[DONE] framing.
                TPOT.labels(rec.route, model).observe((duration - rec.ttft_s) / (rec.events - 3))
        if rec.prefill_s is not None:
            LEG.labels("prefill", model).observe(rec.prefill_s)
        if rec.decode_s is not None:
            LEG.labels("decode", model).observe(rec.decode_s)

    def retry(self, job, target, err) -> None:
        super().retry(job, target, err)
        RETRIES.labels(job.model, type(err).__name__).inc()

    def missed_handoff(self, job, rec) -> None:
        super().missed_handoff(job, rec)
        MISSED.labels(job.model).inc()

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.exposition_registry), CONTENT_TYPE_LATEST
