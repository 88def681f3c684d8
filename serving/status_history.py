"""The status page's last five minutes: the Coordinator's own counters, sampled once a second.

Nothing is recorded per request for it: every second `MetricHistory.sample` reads the Prometheus counters and
histograms the workers already keep (prometheus-client's multiprocess files, summed over the workers as a scrape
sums them) and keeps the last `WINDOW_S` seconds of these snapshots. A window's numbers are the difference of two
snapshots: requests per second, TTFT and TPOT quantiles (interpolated in the histograms' buckets, as PromQL's
`histogram_quantile` does), SLO attainment (the share of observations within the target, interpolated the same way),
429s, continuations, missed handoffs, refusals by reason, and per tenant label the `motor_tenant_*` counters. It
runs in the main process (serving/status.py), so no worker's event loop pays for it.
"""

from __future__ import annotations

import glob
import math
import os
import time
from collections import defaultdict, deque
from collections.abc import Callable

from prometheus_client.multiprocess import MultiProcessCollector

WINDOW_S = 300  # what the page shows
STEP_S = 5  # one chart point per this many seconds
RATE_S = 10  # the request rate shown as a number: over this many seconds

Snapshot = dict[tuple, float]


def _by(kind: str, *labels: str) -> Callable[[dict, float, Snapshot], None]:
    def add(sample_labels: dict, value: float, into: Snapshot) -> None:
        into[(kind, *(sample_labels.get(name, "") for name in labels))] += value

    return add


def _bucket(kind: str) -> Callable[[dict, float, Snapshot], None]:
    def add(sample_labels: dict, value: float, into: Snapshot) -> None:
        into[(kind, sample_labels.get("model", ""), float(sample_labels["le"]))] += value

    return add


# The samples read, by name (serving/metrics.py defines them).
READ = {
    "motor_requests_total": _by("status", "model", "status"),
    "motor_ttft_seconds_bucket": _bucket("ttft"),
    "motor_tpot_seconds_bucket": _bucket("tpot"),
    "motor_stream_continuations_total": _by("continuations", "model"),
    "motor_stream_continuation_refusals_total": _by("continuation_refusals", "model"),
    "motor_missed_handoffs_total": _by("missed_handoffs", "model"),
    "motor_retries_total": _by("retries", "model"),
    "motor_prompt_tokens_total": _by("prompt_tokens", "model"),
    "motor_generation_tokens_total": _by("output_tokens", "model"),
    "motor_rejections_total": _by("rejections", "reason"),
    "motor_tenant_requests_total": _by("tenant_requests", "tenant", "status"),
    "motor_tenant_tokens_total": _by("tenant_tokens", "tenant", "kind"),
}


def read_counters(path: str) -> Snapshot:
    """The counters now, summed over every worker's file under `path`."""
    out: Snapshot = defaultdict(float)
    for metric in MultiProcessCollector.merge(glob.glob(os.path.join(path, "*.db")), accumulate=True):
        for s in metric.samples:
            add = READ.get(s.name)
            if add is not None:
                add(s.labels, s.value, out)
    return out


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """`histogram_quantile`: the q-quantile of cumulative (upper bound, count) buckets, +Inf last; None if empty."""
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower  # beyond the last finite bound: that bound, as Prometheus says
            return lower + (bound - lower) * (rank - below) / (count - below) if count > below else bound
        lower, below = bound, count
    return lower


def share_within(limit: float, buckets: list[tuple[float, float]]) -> float | None:
    """The share of observations at most `limit`, interpolated within its bucket; None if there are none."""
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if limit <= bound:
            if math.isinf(bound):
                return below / total
            return (below + (count - below) * (limit - lower) / (bound - lower)) / total
        lower, below = bound, count
    return 1.0


class Window:
    """What happened between two snapshots, its counters indexed by (kind, first label) once."""

    __slots__ = ("delta", "index", "seconds")

    def __init__(self, seconds: float, delta: Snapshot):
        self.seconds, self.delta = seconds, delta
        self.index: dict[tuple, list[tuple[tuple, float]]] = defaultdict(list)
        for k, v in delta.items():
            self.index[k[:2]].append((k, v))

    def _under(self, kind: str, labels: tuple[str, ...]) -> list[tuple[tuple, float]]:
        """A kind's (key, value) whose first labels are `labels`."""
        if not labels:
            return [(k, v) for k, v in self.delta.items() if k[0] == kind]
        n = len(labels)
        return [(k, v) for k, v in self.index.get((kind, labels[0]), ()) if k[1 : 1 + n] == labels]

    def total(self, kind: str, *labels: str) -> float:
        """The sum of a kind's counters whose first labels are `labels`."""
        return sum(v for _, v in self._under(kind, labels))

    def by(self, kind: str, *labels: str) -> dict[str, float]:
        """A kind's counters under `labels`, by the next label (non-zero only)."""
        n = len(labels)
        out: dict[str, float] = defaultdict(float)
        for k, v in self._under(kind, labels):
            if v:
                out[k[1 + n]] += v
        return dict(out)

    def buckets(self, kind: str, model: str) -> list[tuple[float, float]]:
        return sorted((k[2], v) for k, v in self.index.get((kind, model), ()))

    def rate(self, kind: str, *labels: str) -> float:
        return self.total(kind, *labels) / self.seconds if self.seconds > 0 else 0.0


Steps = list[tuple[float, Window]]  # one window per STEP_S, oldest first, each with its end time


class MetricHistory:
    """The last WINDOW_S seconds of counter snapshots, one a second (`sample`)."""

    def __init__(self, path: str, clock: Callable[[], float] = time.time):
        self.path, self.clock = path, clock
        self.snapshots: deque[tuple[float, Snapshot]] = deque(maxlen=WINDOW_S + 1)

    def sample(self) -> None:
        self.snapshots.append((self.clock(), read_counters(self.path)))

    def window(self, back_s: int, length_s: int | None = None) -> Window | None:
        """From `back_s + length_s` seconds ago (or the oldest snapshot) to `back_s` ago; None without two."""
        snaps, last = self.snapshots, len(self.snapshots) - 1
        end = last - back_s
        if end < 1:
            return None
        start = 0 if length_s is None else max(0, end - length_s)
        (t0, a), (t1, b) = snaps[start], snaps[end]
        return Window(t1 - t0, {k: max(0.0, v - a.get(k, 0.0)) for k, v in b.items()})

    def models(self) -> set[str]:
        """The model labels the counters name."""
        return {k[1] for k in self.snapshots[-1][1] if k[0] == "status"} if self.snapshots else set()

    def tenants(self) -> set[str]:
        return {k[1] for k in self.snapshots[-1][1] if k[0] == "tenant_requests"} if self.snapshots else set()

    def steps(self) -> Steps:
        """The last WINDOW_S seconds in windows of STEP_S, oldest first (the charts' points)."""
        out: Steps = []
        for back in range(0, WINDOW_S, STEP_S):
            w = self.window(back, STEP_S)
            if w is None:
                break
            out.append((self.snapshots[len(self.snapshots) - 1 - back][0], w))
        out.reverse()
        return out


def series(model: str, steps: Steps) -> dict[str, list]:
    """One chart point per step, oldest first: its end time, requests per second and the TTFT and TPOT p50 and p99
    (null where nothing was observed)."""
    cols: dict[str, list] = {k: [] for k in ("t", "rps", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")}
    for t, w in steps:
        ttft, tpot = w.buckets("ttft", model), w.buckets("tpot", model)
        point = {
            "t": round(t, 1),
            "rps": round(w.rate("status", model), 3),
            "ttft_p50": _round(quantile(0.5, ttft)),
            "ttft_p99": _round(quantile(0.99, ttft)),
            "tpot_p50": _round(quantile(0.5, tpot)),
            "tpot_p99": _round(quantile(0.99, tpot)),
        }
        for k, v in point.items():
            cols[k].append(v)
    return cols


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 5)
