"""The status page's document (`GET /status.json` on the observability port): made once a second for every worker.

`StatusPublisher`, a daemon thread of the main process, samples the counters (serving/status_history.py) and
builds the document from the shared tables the workers keep (instances, health and breakers, the ledger, the
engines' scraped load, the learned predictions, the cluster sync's findings), then publishes its JSON bytes in
shared memory. A worker answering `/status.json` copies the last published bytes (`StatusReader`): however many
browsers poll, the document is made once a second, and no request pays anything for it.

It shows nothing secret: no key, no Redis URL, no config path; instance addresses, model names, and tenant
names as the tenants' own metrics name them.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable

import ujson

from config import ModelConfig, Settings
from scheduling import clock
from scheduling.health import Health
from scheduling.ledger import Ledger
from scheduling.predict import UNKNOWN, Predictor
from scheduling.registry import Registry, Topology
from scheduling.status import instances_json
from serving.status_history import RATE_S, MetricHistory, Steps, Window, quantile, series, share_within
from state.shared import STATUS_BYTES, SharedState

log = logging.getLogger("coordinator.status")
INTERVAL_S = 1.0


class StatusDocument:
    """Builds the document from shared memory and the counters' history; read-only on both."""

    def __init__(self, shared: SharedState, settings: Callable[[], Settings], history: MetricHistory):
        self.shared, self.settings, self.history = shared, settings, history
        self.registry = Registry(shared)
        self.health = Health(shared)
        s = settings()
        self.predictor = Predictor(shared, s.slo_confidence)
        # One for the document's life: the workers and cluster mode change only with a restart (and views of the
        # shared rows cost more to make than to read).
        self.ledger = Ledger(shared, 0, s.num_workers, bool(s.cluster.redis_url))

    def build(self) -> dict:
        s = self.settings()
        clustered = bool(s.cluster.redis_url)
        view = self.registry.view()
        whole, steps = self.history.window(0), self.history.steps()  # made once a document
        g, rows = self.shared.globals, [self.shared.workers[i] for i in range(s.num_workers)]
        now = time.time()
        return {
            "generated_at": round(now, 3),
            "started_at": g.started_ms / 1000,
            "scheduler": s.scheduler_type,
            "pd_dispatch": s.pd_dispatch,
            "workers": s.num_workers,
            "draining": bool(g.draining),
            "inflight_requests": sum(r.inflight for r in rows),
            "queued_requests": sum(r.queued for r in rows),
            "instances_version": view.version,
            "instances": self._instances(view),
            "models": self._models(s, view, whole, steps),
            "rejections": whole.by("rejections") if whole is not None else {},
            "tenants": self._tenants(whole),
            "cluster": self._cluster(now) if clustered else None,
        }

    def _instances(self, view: Topology) -> list[dict]:
        out = instances_json(view, self.ledger, self.health, self.shared.kv_endpoints)
        targets = {(t.instance_id, t.endpoint_id): t for t in view.targets}
        now = clock.now()
        for inst in out:
            for ep in inst["endpoints"]:
                t = targets[(inst["id"], ep["id"])]
                ep["predicted"] = self._predicted(t.slot, t.role, ep["load"], now)
        return out

    def _predicted(self, slot: int, role: str, load: dict, now: float) -> dict:
        """What slo_aware's learned model predicts there now: the TTFT of a prompt of the mean size it learned
        from (queue included), and the TPOT at its present batch; null until it has learned enough."""
        p, ttft, tpot = self.predictor, None, None
        if role != "decode" and p.prefill_known(slot):
            ttft = p.queue_wait_s(slot, now) + p.prefill_s(slot, round(p.mean_prefill_tokens(slot)))
        if role != "prefill" and p.decode_known(slot):
            step = p.step_s(slot, load["inflight_requests"] + load["held_decode_slots"])
            tpot = step if step != UNKNOWN else None
        return {"ttft_s": _r(ttft), "tpot_s": _r(tpot)}

    def _models(self, s: Settings, view: Topology, whole: Window | None, steps: Steps) -> list[dict]:
        names = list(dict.fromkeys([*(m.id for m in s.models), *view.models(), *sorted(self.history.models())]))
        recent = self.history.window(0, RATE_S)
        out = []
        for name in names:
            cfg = s.model(name) or ModelConfig("")
            slo_ttft_ms, slo_tpot_ms = cfg.slo_ttft_ms, cfg.slo_tpot_ms
            entry = {
                "id": name,
                "slo_ttft_ms": slo_ttft_ms,
                "slo_tpot_ms": slo_tpot_ms,
                "instances": {role: len(view.pool(name, role)) for role in ("prefill", "decode", "union")},
                "series": series(name, steps),
            }
            if whole is not None:
                ttft, tpot = whole.buckets("ttft", name), whole.buckets("tpot", name)
                statuses = whole.by("status", name)
                entry.update(
                    seconds=round(whole.seconds),
                    requests=whole.total("status", name),
                    requests_per_s=round(recent.rate("status", name), 3) if recent else 0.0,
                    statuses=statuses,
                    throttled=statuses.get("429", 0.0),
                    ttft_p50_s=_r(quantile(0.5, ttft)),
                    ttft_p99_s=_r(quantile(0.99, ttft)),
                    tpot_p50_s=_r(quantile(0.5, tpot)),
                    tpot_p99_s=_r(quantile(0.99, tpot)),
                    slo_ttft_attained=_r(share_within(slo_ttft_ms / 1000, ttft)),
                    slo_tpot_attained=_r(share_within(slo_tpot_ms / 1000, tpot)),
                    continuations=whole.total("continuations", name),
                    continuation_refusals=whole.total("continuation_refusals", name),
                    missed_handoffs=whole.total("missed_handoffs", name),
                    retries=whole.total("retries", name),
                    prompt_tokens=whole.total("prompt_tokens", name),
                    output_tokens=whole.total("output_tokens", name),
                )
            out.append(entry)
        return out

    def _tenants(self, w: Window | None) -> list[dict]:
        """Per tenant label over the window, from the `motor_tenant_*` counters (with keys off, every request is
        `default`'s)."""
        if w is None:
            return []
        return [
            {
                "name": name,
                "requests": w.total("tenant_requests", name),
                "refused": w.by("tenant_requests", name).get("429", 0.0),
                "statuses": w.by("tenant_requests", name),
                "tokens": w.by("tenant_tokens", name),
            }
            for name in sorted(self.history.tenants())
        ]

    def _cluster(self, now: float) -> dict:
        g = self.shared.globals
        replicas = []
        for row in self.shared.replicas:
            if not row.replica:
                break
            replicas.append(
                {
                    "replica": row.replica.decode("utf-8", "replace"),
                    "age_s": _r(now - row.started_ms / 1000) if row.started_ms else None,
                    "report_age_s": _r(now - row.reported_ms / 1000) if row.reported_ms else None,
                }
            )
        return {
            "replica": os.environ.get("MOTOR_REPLICA_ID", ""),
            "store": "connected" if g.store_up == 1 else "disconnected",
            "replicas": replicas,
            "state_age_s": _r(now - g.synced_at_ms / 1000) if g.synced_at_ms else None,
            "instances_version": int(g.cluster_version),
        }


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


def publish(shared: SharedState, data: bytes) -> None:
    """The document's bytes into shared memory; `status_gen` is odd while they are written (readers retry)."""
    g = shared.globals
    g.status_gen += 1
    ctypes.memmove(shared.status, data, len(data))
    g.status_len = len(data)
    g.status_gen += 1


class StatusPublisher:
    """The main process's thread: every INTERVAL_S, a sample of the counters and the document published."""

    def __init__(self, shared: SharedState, settings: Callable[[], Settings]):
        self.shared = shared
        self.history = MetricHistory(os.environ["PROMETHEUS_MULTIPROC_DIR"])
        self.document = StatusDocument(shared, settings, self.history)
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, name="status-page", daemon=True)

    def start(self) -> None:
        self.once()  # a document from the first request on
        self.thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(timeout=2)

    def once(self) -> None:
        self.history.sample()
        doc = self.document.build()
        data = ujson.dumps(doc).encode()
        if len(data) > STATUS_BYTES:  # hundreds of models: their charts are left out
            for model in doc["models"]:
                model.pop("series")
            data = ujson.dumps(doc).encode()
        if len(data) > STATUS_BYTES:
            data = ujson.dumps({"generated_at": doc["generated_at"], "error": "too many instances to show"}).encode()
        publish(self.shared, data)

    def _run(self) -> None:
        while not self.stop_event.wait(INTERVAL_S):
            try:
                self.once()
            except Exception:  # the page must never stop the Coordinator, nor itself
                log.exception("status page: building the document failed")


class StatusReader:
    """A worker's side: the last published document, copied once per new generation."""

    def __init__(self, shared: SharedState):
        self.shared = shared
        self.gen, self.data = -1, b'{"starting": true}'

    def read(self) -> bytes:
        g = self.shared.globals
        gen = g.status_gen
        if gen != self.gen and not gen & 1:
            data = ctypes.string_at(ctypes.addressof(self.shared.status), g.status_len)
            if g.status_gen == gen:  # not rewritten meanwhile (else the next read takes it)
                self.gen, self.data = gen, data
        return self.data
