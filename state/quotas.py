"""Per-tenant quotas held across all workers in shared memory (tenant_config's `rpm`, `tpm`,
`max_inflight`; serving/tenants.py decides with them).

A tenant's row (`TenantRow`) is found by its name's hash and claimed once, under the lock; each worker keeps the
rows it found. Its two token buckets (requests and tokens, in milli-units, refilled continuously at a minute's
worth a minute, holding at most a minute's worth) change under the shared lock, so N workers admit what the
configuration says, not N times it. Its requests in flight are counted per worker (`TenantCounts`, each worker
writes only its own row, the cap sums them under the lock), so the main process can zero a dead worker's and the
places come back, as the door's global count does.
"""

from __future__ import annotations

from typing import NamedTuple

from state.shared import MAX_TENANTS, SharedState, TenantRow, tenant_hash

# `refill`'s period (µs) for a rate a minute: N a minute is N milli-tokens every 60,000 µs
PER_MINUTE = 60_000


def refill(
    level_milli: int, stamp_us: int, now_us: int, per: float, cap_milli: int, period_us: int = 1000
) -> tuple[int, int]:
    """A token bucket's (level, stamp) at `now_us`: filled at `per` milli-tokens every `period_us` up to `cap_milli`
    (`per` tokens a second by default, the door's float rate, whose level and stamp come back as whole floats for
    the caller to make ints; a tenant's rpm or tpm with `PER_MINUTE`, in integers alone). The stamp moves only by
    the time turned into whole milli-tokens, so callers coming more often than one milli-token's time lose no
    refill; a stamp ahead of this clock starts from now (no debt); a full bucket loses the time beyond it."""
    if not stamp_us:
        return cap_milli, now_us
    if now_us < stamp_us:
        stamp_us = now_us
    gained = (now_us - stamp_us) * per // period_us
    if level_milli + gained >= cap_milli:
        return cap_milli, now_us
    if gained:
        return level_milli + gained, stamp_us + gained * period_us // per
    return level_milli, stamp_us


def wait_s(level_milli: int, need_milli: int, per_s: float) -> float:
    """Seconds until a bucket at `level_milli` holds `need_milli`."""
    return max(0.0, (need_milli - level_milli) / (1000 * per_s))


class Limits(NamedTuple):
    rpm: int
    tpm: int
    max_inflight: int


# An admission's verdict: (refused: "" when admitted, else "requests", "tokens" or "inflight"; seconds until it would
# not be; the requests' and tokens' buckets' levels after it, in milli-units, for the client's headers). A plain
# tuple: making a NamedTuple costs more than the rest of an admission's arithmetic.
Taken = tuple[str, float, int, int]


class TenantQuotas:
    """One worker's view of the tenants' table (see the module docstring)."""

    def __init__(self, shared: SharedState, worker: int, num_workers: int):
        self.rows: list[TenantRow] = list(shared.tenants.rows)
        self.lock = shared.hot_lock
        # Views of the columns, kept: making one costs more than reading through it.
        self.inflight = [shared.tenant_counts[i].inflight for i in range(max(num_workers, worker + 1))]
        self.my_inflight = shared.tenant_counts[worker].inflight
        self.slots: dict[str, int] = {}  # tenant -> its row, as found

    def slot(self, tenant: str) -> int:
        """The tenant's row: found, else claimed (a full table's last row holds every tenant beyond it)."""
        found = self.slots.get(tenant)
        if found is not None:
            return found
        key, n = tenant_hash(tenant) | 1, MAX_TENANTS - 1
        at = n
        with self.lock:
            for i in range(n):
                j = (key + i) % n
                if self.rows[j].key in (0, key):
                    self.rows[j].key = key
                    at = j
                    break
        self.slots[tenant] = at
        return at

    def take(self, at: int, now_us: int, limits: Limits, reserve_tokens: int) -> Taken:
        """Admit one request of the tenant at row `at`, reserving `reserve_tokens` of its tpm, or say why not."""
        rpm, tpm, cap = limits
        row = self.rows[at]
        with self.lock:
            if cap:
                n = 0
                for column in self.inflight:  # (a loop: sum() over a generator costs twice as much)
                    n += column[at]
                if n >= cap:
                    return "inflight", 1.0, row.requests_milli, row.tokens_milli
            requests = tokens = 0
            # (each bucket's level written once: a field's write costs more than the arithmetic)
            if rpm:
                requests, row.requests_stamp_us = refill(
                    row.requests_milli, row.requests_stamp_us, now_us, rpm, rpm * 1000, PER_MINUTE
                )
                if requests < 1000:
                    row.requests_milli = requests
                    return "requests", wait_s(requests, 1000, rpm / 60), requests, row.tokens_milli
            if tpm:
                tokens, row.tokens_stamp_us = refill(
                    row.tokens_milli, row.tokens_stamp_us, now_us, tpm, tpm * 1000, PER_MINUTE
                )
                if tokens < 1000:  # a debt (or less than a token): the next request waits until it is paid
                    row.tokens_milli = tokens
                    if rpm:
                        row.requests_milli = requests
                    return "tokens", wait_s(tokens, 1000, tpm / 60), requests, tokens
                tokens -= reserve_tokens * 1000
                row.tokens_milli = tokens
            if rpm:
                requests -= 1000
                row.requests_milli = requests
            self.my_inflight[at] += 1
        return "", 0.0, requests, tokens

    def leave(self, at: int, settle_tokens: int, tpm: int) -> None:
        """A request of row `at` ended; `settle_tokens` (served less reserved) are taken from its tpm bucket (a
        refund when negative, never beyond a full bucket)."""
        self.my_inflight[at] -= 1  # only this worker writes its row: no lock
        if tpm and settle_tokens:
            row = self.rows[at]
            with self.lock:
                row.tokens_milli = min(tpm * 1000, row.tokens_milli - settle_tokens * 1000)

    def charge(self, batch: list[tuple[int, int, int]]) -> None:
        """Tokens served beyond those taken, per row: (row, tokens, its tpm), all under one lock (a refund when
        negative, never beyond a full bucket)."""
        with self.lock:
            for at, tokens, tpm in batch:
                row = self.rows[at]
                row.tokens_milli = min(tpm * 1000, row.tokens_milli - tokens * 1000)
