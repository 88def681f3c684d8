"""The load ledger: in-flight requests and tokens per slot, summed across workers.

Each worker writes only its own row (no lock); readers sum a slot's column over the worker rows. A
`Lease` records exactly what one request added and takes it back once, whatever path the request ends
on (completion, error, cancellation), so the ledger returns to zero. A lease also carries the timings
the learned model needs (start, first token, events seen); when a lease that was marked `succeed()`
is released, the ledger's `observer` (the scheduler) learns from it. A `Hold` promises a decode slot to
a request whose prefill is still running.
"""

from __future__ import annotations

from collections.abc import Callable

from scheduling import clock
from state.shared import (
    L_DECODE_TOKENS,
    L_HELD,
    L_PREFILLING,
    L_PROMPT_TOKENS,
    L_REQUESTS,
    LEDGER_FIELDS,
    LEDGER_ROW as ROW,
    REMOTE_ROW,
    SharedState,
)

# What a lease is for (the learned model reads each kind differently).
PREFILL, DECODE, WHOLE = "prefill", "decode", "whole"


class Ledger:
    def __init__(self, shared: SharedState, worker: int, num_workers: int, remote: bool = False):
        """`remote`: the other replicas' load (cluster mode) counts too, as one more row."""
        self.arr = shared.ledger
        self.worker = worker
        self.base = worker * ROW
        rows = range(0, max(num_workers, worker + 1) * ROW, ROW)
        self.rows = (*rows, REMOTE_ROW * ROW) if remote else rows
        self.observer: Callable[[Lease], None] | None = None
        self.on_prefilled: Callable[[Lease], None] | None = None  # a lease's prompt is in its engine's cache now

    def lease(
        self, slot: int, prompt_tokens: int, decode_tokens: int, prefilling: bool = True, kind: str = ""
    ) -> Lease:
        """Take load on `slot`: one request, its uncached prompt tokens (while prefilling) and its output budget."""
        return Lease(self, slot, prompt_tokens, decode_tokens, prefilling, kind or (PREFILL if prefilling else DECODE))

    def hold(self, slot: int) -> Hold:
        return Hold(self, slot)

    def at(self, slot: int) -> int:
        """Where this worker's counters of `slot` start in `arr` (leases and holds add to `arr[at + field]`:
        a method call per counter cost a PD request 1.4 µs)."""
        return self.base + slot * LEDGER_FIELDS

    def load(self, slot: int) -> tuple[int, int, int, int]:
        """(requests, prompt tokens waiting for prefill, decode tokens, requests prefilling) over all workers."""
        arr, off = self.arr, slot * LEDGER_FIELDS
        r = p = d = f = 0
        for row in self.rows:
            i = row + off
            r += arr[i + L_REQUESTS]
            p += arr[i + L_PROMPT_TOKENS]
            d += arr[i + L_DECODE_TOKENS]
            f += arr[i + L_PREFILLING]
        return r, p, d, f

    def requests(self, slot: int) -> int:
        arr, i = self.arr, slot * LEDGER_FIELDS + L_REQUESTS
        return sum(arr[row + i] for row in self.rows)

    def held(self, slot: int) -> int:
        """Decode slots promised to requests still in prefill, over all workers."""
        arr, i = self.arr, slot * LEDGER_FIELDS + L_HELD
        return sum(arr[row + i] for row in self.rows)


class Lease:
    """What one request holds on one slot; `release()` is idempotent."""

    __slots__ = (
        "arr",
        "at",
        "batch",
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
        "predicted_tpot",
        "prefilling",
        "prompt_tokens",
        "released",
        "sample",
        "shift",
        "slot",
        "started",
    )

    def __init__(self, ledger: Ledger, slot: int, prompt_tokens: int, decode_tokens: int, prefilling: bool, kind: str):
        self.ledger, self.slot, self.kind = ledger, slot, kind
        self.prompt_tokens, self.decode_tokens, self.prefilling = prompt_tokens, decode_tokens, prefilling
        self.released = self.ok = False
        self.started = clock.now()
        self.first_at = self.ended = self.predicted = self.predicted_tpot = self.shift = 0.0
        self.events = 0
        self.engine_uncached = -1  # uncached prompt tokens as the engine reported them (-1: not reported)
        self.batch = 0  # requests on the slot when this one started, itself included
        self.hashes: list[int] = []
        self.sample = False  # the learned model's fits take this request's timings (the scheduler decides)
        self.arr, self.at = arr, at = ledger.arr, ledger.at(slot)
        arr[at + L_REQUESTS] += 1
        arr[at + L_DECODE_TOKENS] += decode_tokens
        if prefilling:
            arr[at + L_PROMPT_TOKENS] += prompt_tokens
            arr[at + L_PREFILLING] += 1

    def prefill_done(self) -> None:
        """The first token arrived: the prompt no longer waits for prefill."""
        if not self.first_at:
            self.first_at = clock.now()
        if self.prefilling and not self.released:
            self.prefilling = False
            arr, at = self.arr, self.at
            arr[at + L_PROMPT_TOKENS] -= self.prompt_tokens
            arr[at + L_PREFILLING] -= 1

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
        arr, at = self.arr, self.at
        arr[at + L_REQUESTS] -= 1
        arr[at + L_DECODE_TOKENS] -= self.decode_tokens


class Hold:
    """A decode slot promised while the request's prefill runs; `release()` is idempotent."""

    __slots__ = ("arr", "i", "released")

    def __init__(self, ledger: Ledger, slot: int):
        self.arr, self.i, self.released = ledger.arr, ledger.at(slot) + L_HELD, False
        self.arr[self.i] += 1

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.arr[self.i] -= 1
