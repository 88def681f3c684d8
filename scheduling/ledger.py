"""The load ledger: in-flight requests and tokens per slot, summed across workers.

Each worker writes only its own row (no lock); readers sum a slot's column over the worker rows. A
`Lease` records exactly what one request added and takes it back once, whatever path the request ends
on (completion, error, cancellation), so the ledger returns to zero.
"""

from __future__ import annotations

from scheduling.shared import (
    L_DECODE_TOKENS,
    L_PREFILLING,
    L_PROMPT_TOKENS,
    L_REQUESTS,
    LEDGER_FIELDS,
    MAX_SLOTS,
    SharedState,
)

ROW = MAX_SLOTS * LEDGER_FIELDS


class Ledger:
    def __init__(self, shared: SharedState, worker: int, num_workers: int):
        self.arr = shared.ledger
        self.base = worker * ROW
        self.rows = range(0, max(num_workers, worker + 1) * ROW, ROW)

    def lease(self, slot: int, prompt_tokens: int, decode_tokens: int, prefilling: bool = True) -> "Lease":
        return Lease(self, slot, prompt_tokens, decode_tokens, prefilling)

    def _add(self, slot: int, field: int, delta: int) -> None:
        self.arr[self.base + slot * LEDGER_FIELDS + field] += delta

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

    def total_requests(self, slots) -> int:
        return sum(self.load(s)[0] for s in slots)

    def is_zero(self) -> bool:
        """True when no worker holds anything on any slot (used by tests and soak checks)."""
        return not any(self.arr[i] for row in self.rows for i in range(row, row + ROW))


class Lease:
    """What one request holds on one slot; `release()` is idempotent."""

    __slots__ = ("ledger", "slot", "prompt_tokens", "decode_tokens", "prefilling", "released")

    def __init__(self, ledger: Ledger, slot: int, prompt_tokens: int, decode_tokens: int, prefilling: bool):
        self.ledger, self.slot = ledger, slot
        self.prompt_tokens, self.decode_tokens, self.prefilling = prompt_tokens, decode_tokens, prefilling
        self.released = False
        ledger._add(slot, L_REQUESTS, 1)
        ledger._add(slot, L_DECODE_TOKENS, decode_tokens)
        if prefilling:
            ledger._add(slot, L_PROMPT_TOKENS, prompt_tokens)
            ledger._add(slot, L_PREFILLING, 1)

    def prefill_done(self) -> None:
        """The first token arrived: the prompt no longer waits for prefill."""
        if self.prefilling and not self.released:
            self.prefilling = False
            self.ledger._add(self.slot, L_PROMPT_TOKENS, -self.prompt_tokens)
            self.ledger._add(self.slot, L_PREFILLING, -1)

    def release(self) -> None:
        if self.released:
            return
        self.prefill_done()
        self.released = True
        self.ledger._add(self.slot, L_REQUESTS, -1)
        self.ledger._add(self.slot, L_DECODE_TOKENS, -self.decode_tokens)
