"""Cross-worker state in shared memory: the instance document, the load ledger and per-slot health.

Everything here is made once, in the main process (Sanic's `main_process_start`), and handed to every
worker through `app.shared_ctx`; in a single process the same raw arrays work on ordinary memory.
Every schedulable endpoint of every instance owns a *slot*: a column in the ledger and a row in the
health table. Writers that need no lock: a worker writes only its own ledger row; health rows are
written by the health checker and by breaker updates (single float stores, torn reads impossible).
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

# Ledger counters, one group per (worker, slot).
L_REQUESTS, L_PROMPT_TOKENS, L_DECODE_TOKENS, L_PREFILLING = range(4)
LEDGER_FIELDS = 4

# Health table fields, one row per slot.
(
    H_HEALTHY,  # 1.0 healthy, 0.0 unhealthy (active check or breaker decided)
    H_BREAKER,  # 0 closed, 1 open, 2 half-open (one probe allowed)
    H_OPEN_UNTIL,  # wall-clock time until which an open breaker rejects
    H_FAILURES,  # consecutive failures
    H_RUNNING,  # engine's vllm:num_requests_running
    H_WAITING,  # engine's vllm:num_requests_waiting
    H_KV_USAGE,  # engine's vllm:kv_cache_usage_perc (0..1)
    H_SCRAPED_AT,  # when the metrics above were read
    H_PREFILL_TPS,  # learned uncached prefill tokens per second (EWMA; 0 = unknown)
    H_DECODE_STEP_S,  # learned seconds per output token (EWMA; 0 = unknown)
    H_DECODE_PER_SEQ_S,  # learned extra seconds per token per running sequence
    H_QUEUE_DELAY_S,  # learned queueing delay before prefill starts
) = range(12)
HEALTH_FIELDS = 12

BREAKER_CLOSED, BREAKER_OPEN, BREAKER_HALF_OPEN = 0, 1, 2

# Global counters.
G_DOC_VERSION, G_DOC_LEN, G_RR, G_RATE_TOKENS_MILLI, G_RATE_STAMP_US, G_DRAINING, G_INFLIGHT = range(7)
GLOBAL_FIELDS = 8


@dataclass
class SharedState:
    """The raw shared arrays; picklable into spawned workers."""

    doc: Any  # RawArray of bytes: the JSON instance document
    ledger: Any  # RawArray int64 [MAX_WORKERS * MAX_SLOTS * LEDGER_FIELDS]
    health: Any  # RawArray double [MAX_SLOTS * HEALTH_FIELDS]
    globals: Any  # RawArray int64 [GLOBAL_FIELDS]
    lock: Any  # a multiprocessing lock for the rare writes (instance refresh, rate limit bucket)

    @classmethod
    def create(cls) -> "SharedState":
        ctx = multiprocessing.get_context("spawn")
        return cls(
            doc=ctx.RawArray(ctypes.c_char, DOC_BYTES),
            ledger=ctx.RawArray(ctypes.c_int64, MAX_WORKERS * MAX_SLOTS * LEDGER_FIELDS),
            health=ctx.RawArray(ctypes.c_double, MAX_SLOTS * HEALTH_FIELDS),
            globals=ctx.RawArray(ctypes.c_int64, GLOBAL_FIELDS),
            lock=ctx.Lock(),
        )

    def as_shared_ctx(self) -> dict:
        return {f"motor_{k}": getattr(self, k) for k in ("doc", "ledger", "health", "globals", "lock")}

    @classmethod
    def from_shared_ctx(cls, ctx: Any) -> "SharedState":
        return cls(*(getattr(ctx, f"motor_{k}") for k in ("doc", "ledger", "health", "globals", "lock")))


def worker_index() -> int:
    """This process's row in the ledger: Sanic names workers Sanic-Server-<i>-<n>."""
    name = os.environ.get("SANIC_WORKER_NAME", "")
    parts = name.split("-")
    if len(parts) >= 3 and parts[2].isdigit():
        return int(parts[2]) % MAX_WORKERS
    return 0
