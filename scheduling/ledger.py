"""The load ledger: in-flight requests and tokens per slot, summed across workers.

Each worker writes only its own row (no lock); readers sum a slot's column over the worker rows. A
`Lease` records exactly what one request added and takes it back once, whatever path the request ends
on (completion, error, cancellation), so the ledger returns to zero. A lease also carries the timings
the learned model needs (start, first token, events seen); when a lease that was marked `succeed()`
is released, the ledger's `observer` (the scheduler) learns from it. A `Hold` promises a decode slot to
a request whose prefill is still running.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from scheduling import clock
from state.shared import MAX_SLOTS, REMOTE_ROW, LedgerCounts, SharedState

# The counters of load (LedgerCounts' fields besides the area of the mean batch).
LOAD_FIELDS = ("requests", "prompt_tokens", "decode_tokens", "prefilling", "held")
# What a lease is for (the learned model reads each kind differently).
PREFILL, DECODE, WHOLE = "prefill", "decode", "whole"


class Ledger:
    def __init__(self, shared: SharedState, worker: int, num_workers: int, remote: bool = False):
        """`remote`: the other replicas' load (cluster mode) counts too, as one more row."""
        self.worker = worker
        rows = range(max(num_workers, worker + 1))
        self.rows = (*rows, REMOTE_ROW) if remote else rows
        # Views of the shared rows, made once (making one costs more than reading a field of it): this worker's
        # counters of each slot, and each slot's counters in every row summed.
        ledger = shared.ledger
        self.mine: list[LedgerCounts] = [ledger[worker].slots[slot] for slot in range(MAX_SLOTS)]
        self.columns: list[tuple[LedgerCounts, ...]] = [
            tuple(ledger[row].slots[slot] for row in self.rows) for slot in range(MAX_SLOTS)
        ]
        # This worker's decodes in flight per slot, by TPOT budget (microseconds): each row's `tpot_floor_us`.
        self.budgets: list[dict[int, int]] = [{} for _ in range(MAX_SLOTS)]
        self.observer: Callable[[Lease], None] | None = None
        self.on_prefilled: Callable[[Lease], None] | None = None  # a lease's prompt is in its engine's cache now

    def lease(
        self,
        slot: int,
        prompt_tokens: int,
        decode_tokens: int,
        prefilling: bool = True,
        kind: str = "",
        tpot_budget_s: float = 0.0,
    ) -> Lease:
        """Take load on `slot`: one request, its uncached prompt tokens (while prefilling) and its output budget;
        `tpot_budget_s` (0: none) the TPOT budget of the stream it decodes there, protected while it runs."""
        lease = Lease(self, slot, prompt_tokens, decode_tokens, prefilling, kind or (PREFILL if prefilling else DECODE))
        if tpot_budget_s > 0.0:
            lease.tpot_budget_us = round(tpot_budget_s * 1e6)
            self.move_budget(slot, lease.tpot_budget_us, 1)
        return lease

    def move_budget(self, slot: int, us: int, change: int) -> None:
        """One decode with a TPOT budget of `us` more (+1) or fewer (-1) on `slot`: this worker's floor there."""
        budgets, row = self.budgets[slot], self.mine[slot]
        left = budgets.get(us, 0) + change
        if left > 0:
            budgets[us] = left
            floor = row.tpot_floor_us
            if not floor or us < floor:
                row.tpot_floor_us = us
        else:
            del budgets[us]
            if us == row.tpot_floor_us:  # the tightest left: the next one up, if any
                row.tpot_floor_us = min(budgets) if budgets else 0

    def record_verdict_batch(self, slot: int, batch: float, now: float) -> None:
        """A plan admitted on its verdict joins `slot`'s decode batch now, predicted to make it `batch`."""
        c = self.mine[slot]
        c.judged_batch_milli, c.judged_at_us = int(batch * 1000), int(now * 1e6)

    def verdict_batch(self, slot: int, since: float) -> float:
        """The largest decode batch `slot` was let grow to by the last verdict of each worker after `since` (0:
        none since)."""
        since_us, most = int(since * 1e6), 0
        for c in self.columns[slot]:
            if c.judged_at_us > since_us and c.judged_batch_milli > most:
                most = c.judged_batch_milli
        return most / 1000

    def tpot_floor_s(self, slot: int) -> float:
        """The tightest TPOT budget of the streams decoding on `slot` over all workers (inf: none)."""
        floor = tightest_us(c.tpot_floor_us for c in self.columns[slot])
        return floor / 1e6 if floor else math.inf

    def hold(self, slot: int) -> Hold:
        return Hold(self, slot)

    def load(self, slot: int) -> tuple[int, int, int, int]:
        """(requests, prompt tokens waiting for prefill, decode tokens, requests prefilling) over all workers."""
        r = p = d = f = 0
        for c in self.columns[slot]:
            r += c.requests
            p += c.prompt_tokens
            d += c.decode_tokens
            f += c.prefilling
        return r, p, d, f

    def requests(self, slot: int) -> int:
        return sum(c.requests for c in self.columns[slot])

    def held(self, slot: int) -> int:
        """Decode slots promised to requests still in prefill, over all workers."""
        return sum(c.held for c in self.columns[slot])

    def area(self, slot: int, now: float) -> float:
        """Request-seconds spent on `slot` so far, over all workers (each row's requests times the time they held):
        its growth between two moments over their distance is the mean batch between them."""
        now_us, total = int(now * 1e6), 0
        for c in self.columns[slot]:
            at = c.area_at_us
            total += c.area_us + c.requests * (now_us - at) if at else c.area_us
        return total / 1e6


def tightest_us(budgets) -> int:
    """The least of TPOT budgets in microseconds, 0 (none) left out; 0 when there is none."""
    return min((us for us in budgets if us > 0), default=0)


def _move_area(c: LedgerCounts, now: float) -> None:
    """Bring a row's area up to `now`, before its request count changes."""
    now_us = int(now * 1e6)
    if c.area_at_us:
        c.area_us += c.requests * (now_us - c.area_at_us)
    c.area_at_us = now_us


class Lease:
    """What one request holds on one slot; `release()` is idempotent."""

    __slots__ = (
        "area0",
        "batch",
        "counts",
        "decode_tokens",
        "ended",
        "engine_uncached",
        "events",
        "first_at",
        "hashes",
        "kind",
        "ledger",
        "ok",
        "predicted",
        "predicted_batch",
        "predicted_tpot",
        "prefilling",
        "prompt_tokens",
        "released",
        "sample",
        "shift",
        "slot",
        "started",
        "tpot_budget_us",
    )

    def __init__(self, ledger: Ledger, slot: int, prompt_tokens: int, decode_tokens: int, prefilling: bool, kind: str):
        self.ledger, self.slot, self.kind = ledger, slot, kind
        self.prompt_tokens, self.decode_tokens, self.prefilling = prompt_tokens, decode_tokens, prefilling
        self.released = self.ok = False
        self.started = clock.now()
        self.first_at = self.ended = self.predicted = self.predicted_tpot = self.shift = self.area0 = 0.0
        self.predicted_batch = 0.0  # the decode batch `predicted_tpot` is for
        self.events = 0
        self.engine_uncached = -1  # uncached prompt tokens as the engine reported them (-1: not reported)
        self.batch = 0  # requests on the slot when this one started, itself included
        self.tpot_budget_us = 0  # the TPOT budget it holds on the slot's floor (0: none)
        self.hashes: list[int] = []
        self.sample = False  # the learned model's fits take this request's timings (the scheduler decides as it leases)
        self.counts = c = ledger.mine[slot]
        _move_area(c, self.started)
        c.requests += 1
        c.decode_tokens += decode_tokens
        if prefilling:
            c.prompt_tokens += prompt_tokens
            c.prefilling += 1

    def prefill_done(self) -> None:
        """The first token arrived: the prompt no longer waits for prefill."""
        if not self.first_at:
            self.first_at = clock.now()
            if self.sample and self.kind != PREFILL:  # a decode the fit takes: where its mean batch starts
                self.area0 = self.ledger.area(self.slot, self.first_at)
        if self.prefilling and not self.released:
            self.prefilling = False
            c = self.counts
            c.prompt_tokens -= self.prompt_tokens
            c.prefilling -= 1

    def first_token(self) -> None:
        """A stream's first token arrived: its prompt is in the engine's prefix cache from now on (a client may
        send the next turn as soon as it has read the last event, before this lease is released)."""
        self.prefill_done()
        if self.hashes and self.ledger.on_prefilled is not None:
            self.ledger.on_prefilled(self)

    def succeed(self, engine_uncached: int = -1) -> None:
        """The engine answered in full: this lease's timings may be learned from when it is released."""
        self.ok = True
        self.engine_uncached = engine_uncached

    def release(self) -> None:
        if self.released:
            return
        self.ended = clock.now()
        observer = self.ledger.observer
        if self.ok and observer is not None:
            try:
                observer(self)
            finally:
                self._give_back()
        else:
            self._give_back()

    def _give_back(self) -> None:
        self.prefill_done()
        self.released = True
        c = self.counts
        _move_area(c, clock.now())
        c.requests -= 1
        c.decode_tokens -= self.decode_tokens
        if self.tpot_budget_us:
            self.ledger.move_budget(self.slot, self.tpot_budget_us, -1)


class Hold:
    """A decode slot promised while the request's prefill runs; `release()` is idempotent."""

    __slots__ = ("counts", "released")

    def __init__(self, ledger: Ledger, slot: int):
        self.counts, self.released = ledger.mine[slot], False
        self.counts.held += 1

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.counts.held -= 1
