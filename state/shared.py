"""Cross-worker state in shared memory: the instance document, the load ledger, the per-endpoint table and the
smaller tables of single features (the prefix index, trigger mode's prefill usage, stored responses' homes).

Everything here is made once, in the main process (Sanic's `main_process_start`), and handed to every
worker through `app.shared_ctx`; in a single process the same raw arrays work on ordinary memory.
Every schedulable endpoint of every instance owns a *slot*: a column in the ledger and a row in the
endpoint table. Writers that need no lock: a worker writes only its own ledger row; endpoint rows are
written by the health checker, breaker updates, the metrics scraper and the predictor (single float stores,
torn reads impossible; the predictor's multi-field updates take `lock`).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
from dataclasses import dataclass
from typing import Any

MAX_WORKERS = 64
MAX_SLOTS = 256
DOC_BYTES = 1 << 20
CONFIG_BYTES = 1 << 20

# Ledger counters, one group per (worker, slot). L_HELD counts decode slots promised to requests whose
# prefill is still running (their decode leg will join that engine's batch soon).
L_REQUESTS, L_PROMPT_TOKENS, L_DECODE_TOKENS, L_PREFILLING, L_HELD = range(5)
LEDGER_FIELDS = 5
LEDGER_ROW = MAX_SLOTS * LEDGER_FIELDS  # one worker's ledger row: a group of counters per slot
# In cluster mode, the row after the workers' holds the other replicas' load (serving/cluster.py writes it).
REMOTE_ROW = MAX_WORKERS

# Endpoint table fields, one row per slot: health and breaker state, the engine's scraped load, and the
# predictor's learned model of that endpoint.
(
    EP_HEALTHY,  # 1.0 healthy, 0.0 unhealthy (active check or breaker decided)
    EP_BREAKER,  # 0 closed, 1 open, 2 half-open (one probe allowed)
    EP_OPEN_UNTIL,  # wall-clock time until which an open breaker rejects
    EP_FAILURES,  # consecutive failures
    EP_RUNNING,  # engine's vllm:num_requests_running
    EP_WAITING,  # engine's vllm:num_requests_waiting
    EP_KV_USAGE,  # engine's vllm:kv_cache_usage_perc (0..1)
    EP_SCRAPED_AT,  # when the metrics above were read
    # The learned model of this endpoint (scheduling/predict.py); 0 = not learned yet. Slot reuse clears it.
    EP_PREFILL_TPS,  # uncached prompt tokens prefilled per second
    EP_DECODE_STEP_S,  # seconds per decode step with an empty batch (intercept)
    EP_DECODE_PER_SEQ_S,  # extra seconds per decode step per running sequence (slope)
    EP_QUEUE_DELAY_S,  # decode leg: wait from its start to its first step (KV pull, engine admission)
    EP_PREFILL_BASE_S,  # fixed seconds per prefill (HTTP, one step), on top of tokens / EP_PREFILL_TPS
    EP_QUEUE_UNTIL,  # virtual time (time.monotonic) when the prefill work sent so far should be done
    EP_QUEUE_SHIFT_S,  # sum of corrections applied to EP_QUEUE_UNTIL from observed completions
    EP_LAST_DONE,  # time (monotonic) of the last observed prefill completion
    EP_PF_N,
    EP_PF_SX,
    EP_PF_SY,
    EP_PF_SXX,
    EP_PF_SXY,  # decayed sums: prefill seconds vs uncached tokens
    EP_DC_N,
    EP_DC_SX,
    EP_DC_SY,
    EP_DC_SXX,
    EP_DC_SXY,  # decayed sums: seconds per token vs batch size
    EP_ENGINE_TTFT_S,  # engine's mean TTFT over the last scrape interval (vllm:time_to_first_token_seconds)
    EP_ENGINE_ITL_S,  # engine's mean inter-token latency over the last scrape interval
    EP_LATE_SHARE,  # prefill allowance: a high quantile of recent errors, each a share of its predicted time
    EP_LATE_AT,  # when the prefill allowance last moved (it narrows with time since then)
    EP_TPOT_LATE_SHARE,  # TPOT allowance: a high quantile of recent TPOT errors, each a share of its prediction
    EP_TPOT_LATE_AT,  # when the TPOT allowance last moved
    EP_PREFILL_BUSY,  # prefill seconds sent per second there lately (decayed): the share of its time prefilling
    EP_PREFILL_BUSY_AT,  # when EP_PREFILL_BUSY was last updated
    EP_GROUP_TOKENS,  # uncached tokens of the prefills completed in the current group (one engine step, about)
    EP_GROUP_START,  # when the current group's work started
    EP_GROUP_FIT,  # 1.0: a member of the current group is a sample for the fit
    EP_AVOID_UNTIL,  # cluster mode: wall-clock time until which another replica finds it broken (0: none)
) = range(38)
ENDPOINT_FIELDS = 38

BREAKER_CLOSED, BREAKER_OPEN, BREAKER_HALF_OPEN = 0, 1, 2

# Global counters.
# G_DRAINING: the whole Coordinator is shutting down (set by the main process, app.py). Index 15 (once a
# global admission-queue count) is unused: that count is per worker now (W_QUEUED), so that a dead worker's
# share can be given back.
G_DOC_VERSION, G_DOC_LEN, G_RR, G_RATE_TOKENS_MILLI, G_RATE_STAMP_US, G_DRAINING = range(6)
# A reload the main process accepted (workers/reload.py): its count, and the length of its pickled Settings.
G_CONFIG_GEN, G_CONFIG_LEN = 7, 6
# Cluster mode (serving/cluster.py): the stored instance set's version this replica applied, whether the store
# answered the sync owner's last round trip (1) or not (0), the live replicas it saw, and when (wall-clock ms).
G_CLUSTER_VERSION, G_STORE_UP, G_REPLICAS, G_SYNCED_AT_MS = 8, 9, 10, 11
G_STORE_LOSSES = 12  # the times the sync owner found the store had lost its data: each worker re-publishes its count
GLOBAL_FIELDS = 16

# Per-worker rows, one per Sanic worker index: admission counters and the heartbeat. Each worker writes only
# its own row, the caps sum the rows, and the main process zeroes the row of a worker that died (nothing
# else writes it) and watches the heartbeats (workers/supervisor.py).
W_INFLIGHT = 0  # requests admitted and being served (serving/door.py)
W_QUEUED = 1  # requests waiting in this worker's SLO admission queue (scheduling/admission.py)
W_HEARTBEAT_MS = 2  # when the worker's event loop last ran its heartbeat (CLOCK_MONOTONIC ms; 0: not yet)
WORKER_FIELDS = 4

# The prefix index (scheduling/affinity.py): open-addressed entries of (chained block hash, bit mask of the
# slots that prefilled that prefix, the slot that did so last).
PREFIX_ENTRIES = 1 << 16
PREFIX_FIELDS = 3

# Prefill usage in trigger mode (serving/usage.py PrefillUsages): per worker, slots of (request id hash, prompt
# tokens, cached tokens + 1, when written) written by the worker that relayed P's answer to an engine's
# metaserver call, read by the worker whose client request's decode leg reports usage.
PREFILL_USAGE_SLOTS = 1024
PREFILL_USAGE_FIELDS = 4

# Where each stored Responses API response was served (state/response_homes.py): sets of ways, each way
# (response id hash, instance id, endpoint id, when written); a new id takes its set's oldest way.
RESPONSE_HOME_SETS = 8192
RESPONSE_HOME_WAYS = 8
RESPONSE_HOME_FIELDS = 4
RESPONSE_HOME_WORDS = RESPONSE_HOME_SETS * RESPONSE_HOME_WAYS * RESPONSE_HOME_FIELDS


@dataclass
class SharedState:
    """The raw shared arrays; picklable into spawned workers."""

    doc: Any  # RawArray of bytes: the JSON instance document
    ledger: Any  # RawArray int64 [(MAX_WORKERS + 1) * LEDGER_ROW]: the workers' rows, then REMOTE_ROW
    endpoints: Any  # RawArray double [MAX_SLOTS * ENDPOINT_FIELDS]: health, scraped load, learned model
    globals: Any  # RawArray int64 [GLOBAL_FIELDS]
    lock: Any  # a multiprocessing lock for the rare writes (instance refresh, rate limit bucket, learned model)
    prefix: Any = None  # RawArray uint64 [PREFIX_ENTRIES * PREFIX_FIELDS]
    workers: Any = None  # RawArray int64 [MAX_WORKERS * WORKER_FIELDS]: per-worker admission counters
    prefill_usage: Any = None  # RawArray int64 [MAX_WORKERS * PREFILL_USAGE_SLOTS * PREFILL_USAGE_FIELDS]
    response_homes: Any = None  # RawArray int64 [RESPONSE_HOME_WORDS]: where stored responses were served
    config: Any = None  # RawArray of bytes: the Settings a reload accepted, pickled (G_CONFIG_LEN of them)

    @classmethod
    def create(cls) -> SharedState:
        ctx = multiprocessing.get_context("spawn")
        return cls(
            doc=ctx.RawArray(ctypes.c_char, DOC_BYTES),
            ledger=ctx.RawArray(ctypes.c_int64, (MAX_WORKERS + 1) * LEDGER_ROW),
            endpoints=ctx.RawArray(ctypes.c_double, MAX_SLOTS * ENDPOINT_FIELDS),
            globals=ctx.RawArray(ctypes.c_int64, GLOBAL_FIELDS),
            lock=ctx.Lock(),
            prefix=ctx.RawArray(ctypes.c_uint64, PREFIX_ENTRIES * PREFIX_FIELDS),
            workers=ctx.RawArray(ctypes.c_int64, MAX_WORKERS * WORKER_FIELDS),
            prefill_usage=ctx.RawArray(ctypes.c_int64, MAX_WORKERS * PREFILL_USAGE_SLOTS * PREFILL_USAGE_FIELDS),
            response_homes=ctx.RawArray(ctypes.c_int64, RESPONSE_HOME_WORDS),
            config=ctx.RawArray(ctypes.c_char, CONFIG_BYTES),
        )

    @property
    def hot_lock(self) -> Any:
        """`lock`'s own semaphore, for the per-request critical sections: `with` on it skips the two Python
        frames of multiprocessing's wrapper (0.4 µs a use; a PD request takes it five times)."""
        return self.lock._semlock

    def release_if_stuck(self, wait_s: float) -> bool:
        """After a worker died: release `lock` if it stays taken for `wait_s`, and say so.

        A process killed inside a critical section (the OOM killer, `kill -9`) never releases the
        semaphore, and every other worker would block on it for good at its next request. The sections
        last microseconds, so a lock still taken after `wait_s` was taken by the dead worker. (A lock's
        semaphore may be released by another process.)
        """
        if self.lock.acquire(timeout=wait_s):
            self.lock.release()
            return False
        try:
            self.lock.release()
        except ValueError:  # its holder released it just now: it was not stuck after all
            return False
        return True

    def as_shared_ctx(self) -> dict:
        return {f"motor_{k}": getattr(self, k) for k in _FIELDS}

    @classmethod
    def from_shared_ctx(cls, ctx: Any) -> SharedState:
        return cls(*(getattr(ctx, f"motor_{k}") for k in _FIELDS))

    def clear_worker(self, worker: int) -> None:
        """Zero what worker `worker` holds: its ledger row and its admission counters. Safe only while that
        worker does not run (it alone writes them): at its start, or in the main process after it died."""
        ctypes.memset(ctypes.addressof(self.ledger) + worker * LEDGER_ROW * 8, 0, LEDGER_ROW * 8)
        if self.workers is not None:
            ctypes.memset(ctypes.addressof(self.workers) + worker * WORKER_FIELDS * 8, 0, WORKER_FIELDS * 8)


def worker_sum(arr: Any, rows: range, field: int) -> int:
    """`field` summed over the per-worker rows `rows` (offsets into `arr`)."""
    total = 0
    for row in rows:
        total += arr[row + field]
    return total


_FIELDS = (
    "doc",
    "ledger",
    "endpoints",
    "globals",
    "lock",
    "prefix",
    "workers",
    "prefill_usage",
    "response_homes",
    "config",
)


def worker_index(name: str | None = None) -> int:
    """A worker's row in the ledger (this process's by default): Sanic names workers Sanic-Server-<i>-<n>."""
    name = os.environ.get("SANIC_WORKER_NAME", "") if name is None else name
    parts = name.split("-")
    if len(parts) >= 3 and parts[2].isdigit():
        return int(parts[2]) % MAX_WORKERS
    return 0
