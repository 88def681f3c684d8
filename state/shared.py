"""Cross-worker state in shared memory: the instance document, the load ledger, the per-endpoint table and the
smaller tables of single features (the prefix index, trigger mode's prefill usage, stored responses' homes,
the tenants' quotas and counts, the tenants' fair share, the engines' KV blocks and their subscriptions, the replicas a cluster-mode sync
saw, the status page's document).

Everything here is made once, in the main process (Sanic's `main_process_start`), and handed to every
worker through `app.shared_ctx`; in a single process the same raw arrays work on ordinary memory.
Each table's row is a ctypes Structure (`Table`) that names its fields once, in layout order; code reads
and writes the shared memory through views of it (`row.field`: no offsets, as fast as an indexed read).
Every schedulable endpoint of every instance owns a *slot*: counters in each ledger row and a row in the
endpoint table. Writers that need no lock: a worker writes only its own ledger row; endpoint rows are
written by the health checker, breaker updates, the metrics scraper and the predictor (single float stores,
torn reads impossible; the predictor's multi-field updates take `lock`).
"""

from __future__ import annotations

import ctypes
import hashlib
import multiprocessing
import os
import time
from dataclasses import dataclass
from typing import Any

MAX_WORKERS = 64
MAX_SLOTS = 256
DOC_BYTES = 1 << 20
CONFIG_BYTES = 1 << 20
STATUS_BYTES = 1 << 21


class Table(ctypes.Structure):
    """A table's row: its fields, named once in `_fields_`, whose order is the memory layout."""

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(name for name, _type in cls._fields_)


class LedgerCounts(Table):
    """One worker's counters of one slot. `held` counts decode slots promised to requests whose prefill is
    still running (their decode leg will join that engine's batch soon)."""

    _fields_ = [
        ("requests", ctypes.c_int64),
        ("prompt_tokens", ctypes.c_int64),
        ("decode_tokens", ctypes.c_int64),
        ("prefilling", ctypes.c_int64),
        ("held", ctypes.c_int64),
        # Request-microseconds on the slot up to `area_at_us` (clock microseconds; 0: never moved): a stream's
        # mean batch is the growth of the sum of every row's area over its decode, over its duration.
        ("area_us", ctypes.c_int64),
        ("area_at_us", ctypes.c_int64),
        # The tightest TPOT budget (microseconds) of this worker's decodes in flight on the slot (0: none): a
        # request joining the batch is judged against it too, so a loose budget cannot slow a tight stream.
        ("tpot_floor_us", ctypes.c_int64),
        # The decode batch (thousandths, itself included) the last plan this worker admitted on a verdict
        # predicted for the slot, and when it joined (clock microseconds): what admission let the batch grow to.
        ("judged_batch_milli", ctypes.c_int64),
        ("judged_at_us", ctypes.c_int64),
    ]


class LedgerRow(Table):
    _fields_ = [("slots", LedgerCounts * MAX_SLOTS)]


# The ledger has a LedgerRow per worker; in cluster mode the row after the workers'
# holds the other replicas' load (serving/cluster.py writes it).
REMOTE_ROW = MAX_WORKERS


# Prediction errors kept per endpoint and stage, of which the allowances are a quantile.
ERROR_RING = 32


def _doubles(*names: str) -> list[tuple[str, type]]:
    return [(name, ctypes.c_double) for name in names]


class EndpointRow(Table):
    """One slot's row of the endpoint table: health and breaker state, the engine's scraped load, and the
    predictor's learned model of that endpoint (scheduling/predict.py; 0 = not learned yet; slot reuse
    clears it)."""

    _fields_ = _doubles(
        "healthy",  # 1.0 healthy, 0.0 unhealthy (active check or breaker decided)
        "breaker",  # 0 closed, 1 open, 2 half-open (one probe allowed)
        "open_until",  # wall-clock time until which an open breaker rejects
        "failures",  # consecutive failures
        "running",  # engine's vllm:num_requests_running
        "waiting",  # engine's vllm:num_requests_waiting
        "kv_usage",  # engine's vllm:kv_cache_usage_perc (0..1)
        "cache_blocks",  # its KV cache's size in blocks (vllm:cache_config_info's num_gpu_blocks; 0: not said)
        "seq_cap",  # a decode engine's: the most sequences it ran while others waited for a place, two scrapes in a
        # row (its max_num_seqs, or what its KV cache held then; 0: never seen full)
        "scraped_at",  # when the metrics above were read
        "prefill_tps",  # uncached prompt tokens prefilled per second
        "decode_step_s",  # seconds per decode step with an empty batch (intercept)
        "decode_per_seq_s",  # extra seconds per decode step per running sequence (slope)
        "queue_delay_s",  # decode leg: wait from its start to its first step (KV pull, engine admission)
        "prefill_base_s",  # fixed seconds per prefill (HTTP, one step), on top of tokens / prefill_tps
        "queue_until",  # virtual time (time.monotonic) when the prefill work sent so far should be done
        "step_open_at",  # virtual time the last engine step the virtual queue opened (one with a fixed part) begins
        "queue_shift_s",  # sum of corrections applied to queue_until from observed completions
        "last_done",  # time (monotonic) of the last observed prefill completion
        # decayed sums: prefill seconds vs uncached tokens
        *("pf_n", "pf_sx", "pf_sy", "pf_sxx", "pf_sxy"),
        # decayed sums: seconds per token vs batch size
        *("dc_n", "dc_sx", "dc_sy", "dc_sxx", "dc_sxy"),
        "engine_ttft_s",  # engine's mean TTFT over the last scrape interval (vllm:time_to_first_token_seconds)
        "engine_itl_s",  # engine's mean inter-token latency over the last scrape interval
        "engine_itl_batch",  # the sequences it ran then (its two scrapes' running gauge, their mean; at least 1)
        "late_share",  # prefill allowance: the confidence quantile of `late_errors` (a share of the predicted time)
        "late_at",  # when the prefill allowance last moved (it narrows with time since then)
        "late_count",  # prefill errors recorded so far (the next goes to late_errors[late_count % ERROR_RING])
        "tpot_late_share",  # TPOT allowance: the confidence quantile of `tpot_errors` (a share of the prediction)
        "tpot_late_at",  # when the TPOT allowance last moved
        "tpot_count",  # TPOT errors recorded so far
        "prefill_busy",  # prefill seconds sent per second there lately (decayed): the share of its time prefilling
        "prefill_busy_at",  # when prefill_busy was last updated
        "group_tokens",  # uncached tokens of the prefills completed in the current group (one engine step, about)
        "group_start",  # when the current group's work started
        "group_fit",  # 1.0: a member of the current group is a sample for the fit
        "group_steps",  # groups of completions (engine steps) merged into the current group's sample
        "avoid_until",  # cluster mode: wall-clock time until which another replica finds it broken (0: none)
        # The tightest promise among the prefills in flight whose last engine step a prompt sent now may join:
        # by when it must finish (0: none), its predicted start and finish, and queue_shift_s when predicted.
        "promise_due",
        "promise_start",
        "promise_end",
        "promise_shift_s",
    ) + [
        # The last ERROR_RING errors of the predictions made for this endpoint, each observed / predicted - 1
        # (scheduling/predict.py): prefill finish times, and decode streams' seconds per token.
        ("late_errors", ctypes.c_double * ERROR_RING),
        ("tpot_errors", ctypes.c_double * ERROR_RING),
    ]


BREAKER_CLOSED, BREAKER_OPEN, BREAKER_HALF_OPEN = 0, 1, 2


class Globals(Table):
    """The Coordinator's single counters."""

    _fields_ = [
        ("doc_version", ctypes.c_int64),  # the instance document's version and length (scheduling/registry.py)
        ("doc_len", ctypes.c_int64),
        ("rr", ctypes.c_int64),  # the round-robin policies' turn
        ("rate_tokens_milli", ctypes.c_int64),  # the rate limit's bucket (serving/door.py)
        ("rate_stamp_us", ctypes.c_int64),
        ("draining", ctypes.c_int64),  # the whole Coordinator is shutting down (set by the main process, app.py)
        # A reload the main process accepted (workers/reload.py): its count, and the length of its pickled Settings.
        ("config_gen", ctypes.c_int64),
        ("config_len", ctypes.c_int64),
        # Cluster mode (serving/cluster.py): the stored instance set's version this replica applied, whether the
        # store answered the sync owner's last round trip (1) or not (0), the live replicas it saw, and when
        # (wall-clock ms), and their workers (0: unknown, a replica did not say).
        ("cluster_version", ctypes.c_int64),
        ("store_up", ctypes.c_int64),
        ("replicas", ctypes.c_int64),
        ("synced_at_ms", ctypes.c_int64),
        ("cluster_workers", ctypes.c_int64),
        # The sync owner's first round trip at start has ended (1): it adopted the stored instance set, seeded it,
        # or found the store down. Not ready before it: this replica would route by its static config.
        ("first_synced", ctypes.c_int64),
        # The times the sync owner found the store had lost its data: each worker re-publishes its count. And the
        # workers of the live replicas as it saw them before the latest loss (the store lost their reports too): the
        # writers the store waits for (0 once that wait is over).
        ("store_losses", ctypes.c_int64),
        ("workers_at_loss", ctypes.c_int64),
        # The status page's JSON document (serving/status.py): odd while it is being written, and its length.
        ("status_gen", ctypes.c_int64),
        ("status_len", ctypes.c_int64),
        ("started_ms", ctypes.c_int64),  # when this Coordinator started (wall-clock ms)
    ]


class WorkerRow(Table):
    """One Sanic worker's admission counters and heartbeat. Each worker writes only its own row, the caps sum
    the rows, and the main process zeroes the row of a worker that died (nothing else writes it) and watches
    the heartbeats (workers/supervisor.py)."""

    _fields_ = [
        ("inflight", ctypes.c_int64),  # requests admitted and being served (serving/door.py)
        ("queued", ctypes.c_int64),  # requests waiting in this worker's SLO admission queue (scheduling/admission.py)
        # when the worker's event loop last ran its heartbeat (CLOCK_MONOTONIC ms; 0: not yet)
        ("heartbeat_ms", ctypes.c_int64),
    ]


# The prefix index (scheduling/affinity.py): open-addressed entries of (chained block hash, bit mask of the
# slots that prefilled that prefix, the slot that did so last), a column per field.
PREFIX_ENTRIES = 1 << 16


class PrefixTable(Table):
    _fields_ = [
        ("key", ctypes.c_uint64 * PREFIX_ENTRIES),
        ("slots", ctypes.c_uint64 * PREFIX_ENTRIES),
        ("last", ctypes.c_uint64 * PREFIX_ENTRIES),
    ]


# The engines' KV facts (scheduling/kv_index.py, written by the one subscriber of a replica, scheduling/kv_events.py):
# open-addressed entries of (a block's key mixed with its slot and that slot's epoch, the slot + 1 and epoch
# that own it, how many of the slot's blocks extend it), a column per field. KV_ENTRIES entries (10 MiB) only when
# kv_event_config.enable is set.
KV_ENTRIES = 1 << 19


class KvBlockTable(Table):
    _fields_ = [
        ("key", ctypes.c_uint64 * KV_ENTRIES),
        ("owner", ctypes.c_uint64 * KV_ENTRIES),  # (epoch << 16) | (slot + 1); 0: never used
        ("children", ctypes.c_uint32 * KV_ENTRIES),  # the slot's stored blocks that extend this one (0: a leaf)
    ]


class KvBlockTableOff(Table):
    """The table's stand-in while KV events are off: one entry, never written."""

    _fields_ = [("key", ctypes.c_uint64 * 1), ("owner", ctypes.c_uint64 * 1), ("children", ctypes.c_uint32 * 1)]


class KvEndpointRow(Table):
    """One slot's KV-event subscription, written by the subscriber alone."""

    _fields_ = [
        ("state", ctypes.c_int64),  # KV_OFF, KV_LIVE, KV_REPLAYING, KV_LOST (scheduling/kv_index.py)
        ("epoch", ctypes.c_int64),  # bumped when the slot's blocks are all forgotten: older entries are dead
        ("blocks", ctypes.c_int64),  # blocks the index holds for the slot now
        ("block_size", ctypes.c_int64),  # the engine's tokens per block, from its events (0: none seen yet)
        ("seq", ctypes.c_int64),  # the last sequence number applied (-1: none)
        ("batches", ctypes.c_int64),  # batches applied
        ("dropped", ctypes.c_int64),  # messages refused: malformed, oversized, over the rate budget
        ("clears", ctypes.c_int64),  # times its blocks were all forgotten (AllBlocksCleared, restart, loss)
        ("peak", ctypes.c_int64),  # the most blocks held since they were last forgotten
        ("evicted", ctypes.c_int64),  # blocks the engine evicted since then: once it has, `peak` is its cache's size
        ("leaves", ctypes.c_int64),  # blocks it holds that none of its blocks extend: the ends of its chains
    ]


# Prefill usage in trigger mode (serving/usage.py PrefillUsages): per worker, slots written by the worker that
# relayed P's answer to an engine's metaserver call, read by the worker whose client request's decode leg
# reports usage.
PREFILL_USAGE_SLOTS = 1024


class PrefillUsage(Table):
    _fields_ = [
        ("key", ctypes.c_int64),  # the request id's hash (0: empty)
        ("prompt_tokens", ctypes.c_int64),
        ("cached_plus_one", ctypes.c_int64),  # cached tokens + 1 (0: P's answer had no cached count)
        ("written_ns", ctypes.c_int64),  # when written (CLOCK_MONOTONIC)
    ]


class PrefillUsageRow(Table):
    _fields_ = [("slots", PrefillUsage * PREFILL_USAGE_SLOTS)]


# Where each stored Responses API response was served (state/response_homes.py): sets of ways; a new id takes
# its set's oldest way.
RESPONSE_HOME_SETS = 8192
RESPONSE_HOME_WAYS = 8


class ResponseHome(Table):
    _fields_ = [
        ("key", ctypes.c_int64),  # the response id's hash (0: a free way)
        ("instance_id", ctypes.c_int64),
        ("endpoint_id", ctypes.c_int64),
        ("written_ns", ctypes.c_int64),  # when written (CLOCK_MONOTONIC)
        ("owner", ctypes.c_int64),  # its tenant's name's hash: to every other tenant the id does not exist
    ]


class ResponseHomeSet(Table):
    _fields_ = [("ways", ResponseHome * RESPONSE_HOME_WAYS)]


# Tenants (state/quotas.py): a tenant's row is found by its name's hash (open addressing); a table full of tenants
# puts the rest in its last row, together.
MAX_TENANTS = 1024


class TenantRow(Table):
    """One tenant's buckets, changed under the lock by whichever worker admits its request."""

    _fields_ = [
        ("key", ctypes.c_int64),  # the name's hash (0: a free row)
        # When each bucket is full again, on the monotonic clock (ns; past: full): rpm's, and tpm's (more than a
        # minute ahead: a debt the tokens served beyond it left). state/quotas.py
        ("requests_full_ns", ctypes.c_int64),
        ("tokens_full_ns", ctypes.c_int64),
    ]


class TenantTable(Table):
    _fields_ = [("rows", TenantRow * MAX_TENANTS)]


def tenant_hash(tenant: str) -> int:
    """A tenant's name as a number below 2**63, the same in every process and replica: its row's key here (with
    the low bit set: never a free row's 0) and the owner of its stored responses (state/response_homes.py)."""
    return int.from_bytes(hashlib.blake2b(tenant.encode(), digest_size=8).digest(), "little") >> 1


class TenantCounts(Table):
    """One worker's requests in flight per tenant row: only that worker writes them, the cap sums the workers'."""

    _fields_ = [("inflight", ctypes.c_int64 * MAX_TENANTS)]


# The tenants' fair share (scheduling/fairness.py): a row per tenant, claimed in order under the lock (a table full of
# tenants puts the rest in its last row, together). A tenant's virtual counter is its row's `lift` plus every
# worker's `served` of it; it is active while any worker's `active` of it is not 0.
MAX_FAIR_TENANTS = 256


class FairTable(Table):
    """The Coordinator's side of the tenants' fair share."""

    _fields_ = [
        ("key", ctypes.c_int64 * MAX_FAIR_TENANTS),  # each row's tenant: tenant_hash(name) | 1 (0: a free row)
        ("lift", ctypes.c_double * MAX_FAIR_TENANTS),  # weighted tokens its idle lifts added (written under the lock)
        ("used", ctypes.c_int64),  # rows claimed (written under the lock)
        ("seen", ctypes.c_double * 3),  # when a request of each x-priority class last came (scheduling.clock; 0: never)
    ]


class FairCounts(Table):
    """One worker's part of the tenants' fair share: only that worker writes it, readers sum the workers'. The main
    process zeroes a dead worker's `active` (its requests are gone), never its `served` (tokens it did serve)."""

    _fields_ = [
        ("served", ctypes.c_double * MAX_FAIR_TENANTS),  # weighted tokens (tokens / weight) it served each row
        ("active", ctypes.c_int64 * MAX_FAIR_TENANTS),  # each row's requests waiting or being served by it
    ]


# The replicas the cluster-mode sync owner saw at its last sync (serving/cluster.py), for the status page: this one
# first; `Globals.replicas` of them are valid.
MAX_REPLICAS = 64
REPLICA_ID_BYTES = 120


class ReplicaRow(Table):
    _fields_ = [
        ("replica", ctypes.c_char * REPLICA_ID_BYTES),  # its id (serving/cluster.py replica_id), UTF-8
        ("started_ms", ctypes.c_int64),  # when it started, by its own clock (wall-clock ms; 0: not said)
        ("reported_ms", ctypes.c_int64),  # when it wrote the report the sync read, by its own clock
    ]


@dataclass
class SharedState:
    """The raw shared arrays of the tables above; picklable into spawned workers."""

    doc: Any  # RawArray of bytes: the JSON instance document
    ledger: Any  # RawArray of LedgerRow [MAX_WORKERS + 1]: the workers' rows, then REMOTE_ROW
    endpoints: Any  # RawArray of EndpointRow [MAX_SLOTS]: health, scraped load, learned model
    globals: Any  # RawValue of Globals
    lock: Any  # a multiprocessing lock for the rare writes (instance refresh, rate limit bucket, learned model)
    prefix: Any = None  # RawValue of PrefixTable
    workers: Any = None  # RawArray of WorkerRow [MAX_WORKERS]: per-worker admission counters
    prefill_usage: Any = None  # RawArray of PrefillUsageRow [MAX_WORKERS]
    response_homes: Any = None  # RawArray of ResponseHomeSet [RESPONSE_HOME_SETS]: where stored responses were served
    config: Any = None  # RawArray of bytes: the Settings a reload accepted, pickled (`globals.config_len` of them)
    tenants: Any = None  # RawValue of TenantTable
    tenant_counts: Any = None  # RawArray of TenantCounts [MAX_WORKERS]
    kv_endpoints: Any = None  # RawArray of KvEndpointRow [MAX_SLOTS]: each engine's KV-event subscription
    kv_blocks: Any = None  # RawValue of KvBlockTable: the engines' KV blocks (KvBlockTableOff when off)
    replicas: Any = None  # RawArray of ReplicaRow [MAX_REPLICAS]: the replicas the last cluster sync saw
    status: Any = None  # RawArray of bytes: the status page's JSON (`globals.status_len` of them)
    fair: Any = None  # RawValue of FairTable: the tenants' fair share
    fair_counts: Any = None  # RawArray of FairCounts [MAX_WORKERS]: each worker's part of it

    @classmethod
    def create(cls, kv_events: bool = False) -> SharedState:
        ctx = multiprocessing.get_context("spawn")
        shared = cls(
            doc=ctx.RawArray(ctypes.c_char, DOC_BYTES),
            ledger=ctx.RawArray(LedgerRow, MAX_WORKERS + 1),
            endpoints=ctx.RawArray(EndpointRow, MAX_SLOTS),
            globals=ctx.RawValue(Globals),
            lock=ctx.Lock(),
            prefix=ctx.RawValue(PrefixTable),
            workers=ctx.RawArray(WorkerRow, MAX_WORKERS),
            prefill_usage=ctx.RawArray(PrefillUsageRow, MAX_WORKERS),
            response_homes=ctx.RawArray(ResponseHomeSet, RESPONSE_HOME_SETS),
            config=ctx.RawArray(ctypes.c_char, CONFIG_BYTES),
            tenants=ctx.RawValue(TenantTable),
            tenant_counts=ctx.RawArray(TenantCounts, MAX_WORKERS),
            kv_endpoints=ctx.RawArray(KvEndpointRow, MAX_SLOTS),
            kv_blocks=ctx.RawValue(KvBlockTable if kv_events else KvBlockTableOff),
            replicas=ctx.RawArray(ReplicaRow, MAX_REPLICAS),
            status=ctx.RawArray(ctypes.c_char, STATUS_BYTES),
            fair=ctx.RawValue(FairTable),
            fair_counts=ctx.RawArray(FairCounts, MAX_WORKERS),
        )
        shared.globals.started_ms = int(time.time() * 1000)
        return shared

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
        _clear(self.ledger[worker])
        if self.workers is not None:
            _clear(self.workers[worker])
        if self.tenant_counts is not None:  # its places in flight come back
            _clear(self.tenant_counts[worker].inflight)
        if self.fair_counts is not None:  # its requests are no longer active (what it served stays counted)
            _clear(self.fair_counts[worker].active)


def _clear(row: ctypes.Structure) -> None:
    ctypes.memset(ctypes.addressof(row), 0, ctypes.sizeof(row))


def endpoint_rows(shared: SharedState) -> list[EndpointRow]:
    """Views of every slot's row of the endpoint table, to keep (making a view costs more than reading it)."""
    return [shared.endpoints[slot] for slot in range(MAX_SLOTS)]


def write_replicas(shared: SharedState, replicas: list[tuple[str, int, int]]) -> None:
    """The replicas a cluster sync saw (its own first), with their start and report times, for the status page;
    an empty id ends the list."""
    rows = shared.replicas
    for row, (replica, started_ms, reported_ms) in zip(rows, replicas[:MAX_REPLICAS]):
        row.replica = replica.encode()[:REPLICA_ID_BYTES]
        row.started_ms, row.reported_ms = started_ms, reported_ms
    if len(replicas) < MAX_REPLICAS:
        rows[len(replicas)].replica = b""


def worker_rows(shared: SharedState, worker: int, num_workers: int) -> tuple[WorkerRow, ...]:
    """The per-worker rows the caps sum, as seen by worker `worker`: every configured worker's, and its own."""
    return tuple(shared.workers[i] for i in range(max(num_workers, worker + 1)))


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
    "tenants",
    "tenant_counts",
    "kv_endpoints",
    "kv_blocks",
    "replicas",
    "status",
    "fair",
    "fair_counts",
)


def worker_index(name: str | None = None) -> int:
    """A worker's row in the ledger (this process's by default): Sanic names workers Sanic-Server-<i>-<n>."""
    name = os.environ.get("SANIC_WORKER_NAME", "") if name is None else name
    parts = name.split("-")
    if len(parts) >= 3 and parts[2].isdigit():
        return int(parts[2]) % MAX_WORKERS
    return 0
