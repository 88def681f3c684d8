"""Per-tenant quotas held across all workers in shared memory (tenant_config's `rpm`, `tpm`,
`max_inflight`; serving/tenants.py decides with them).

A tenant's row (`TenantRow`) is found by its name's hash and claimed once, under the lock; each worker keeps the
rows it found. Its two buckets (requests and tokens, refilled continuously at a minute's worth a minute, holding
at most a minute's worth) change under the shared lock, so N workers admit what the configuration says, not N
times it. Each bucket is one number, the time it is full again (a generic cell rate algorithm): a unit of a rate
of N a minute is `PER_MINUTE_NS / N` ns of it (rounded up), what is taken moves that time later and what is given back
earlier, and a time already past is a full bucket; so a request reads and writes one field a bucket and no
refill is computed. Its requests in flight are counted per worker (`TenantCounts`, each worker
writes only its own row, the cap sums them under the lock), so the main process can zero a dead worker's and the
places come back, as the door's global count does.
"""

from __future__ import annotations

import time

from state.shared import MAX_TENANTS, SharedState, TenantRow, tenant_hash

# A minute in the monotonic clock's ns. One unit of a rate of N a minute refills in PER_MINUTE_NS / N ns, rounded up
# (never faster than configured; within 0.1 % up to a million a second, at least 1 ns a unit); a bucket holds N.
PER_MINUTE_NS = 60_000_000_000


def refill(level_milli: int, stamp_us: int, now_us: int, per: float, cap_milli: int) -> tuple[int, int]:
    """The door's rate-limit bucket's (level, stamp) at `now_us`: filled at `per` tokens a second (a float rate)
    up to `cap_milli`; level and stamp come back as whole floats for the caller to make ints. The stamp moves only by
    the time turned into whole milli-tokens, so callers coming more often than one milli-token's time lose no
    refill; a stamp ahead of this clock starts from now (no debt); a full bucket loses the time beyond it."""
    if not stamp_us:
        return cap_milli, now_us
    if now_us < stamp_us:
        stamp_us = now_us
    gained = (now_us - stamp_us) * per // 1000
    if level_milli + gained >= cap_milli:
        return cap_milli, now_us
    if gained:
        return level_milli + gained, stamp_us + gained * 1000 // per
    return level_milli, stamp_us


def wait_s(level_milli: int, need_milli: int, per_s: float) -> float:
    """Seconds until a bucket at `level_milli` holds `need_milli`."""
    return max(0.0, (need_milli - level_milli) / (1000 * per_s))


class Limits:
    """A quota's limits (tenant_config's rpm, tpm, max_inflight: 0 for none) with what `take` and `leave` work out
    from them: each rate's unit (`unit_ns`) and its full bucket's time. Made once per tenant and config
    (serving/tenants.py `Tenants.quota`), not per request (each division of these integers cost about 0.7 k
    instructions).

    `headers`: serving/tenants.py's last x-ratelimit-* block for these limits, with the buckets' times short of full
    it was made from: a bucket that refills between a tenant's requests leaves the same times request after request,
    and the block is a function of them and the limits."""

    __slots__ = ("headers", "max_inflight", "request_ns", "requests_ns", "rpm", "token_ns", "tokens_ns", "tpm")

    def __init__(self, rpm: int, tpm: int, max_inflight: int):
        self.rpm, self.tpm, self.max_inflight = rpm, tpm, max_inflight
        self.request_ns = unit_ns(rpm) if rpm else 0
        self.token_ns = unit_ns(tpm) if tpm else 0
        self.requests_ns, self.tokens_ns = self.request_ns * rpm, self.token_ns * tpm  # a full bucket's time
        self.headers: tuple = (-1, -1, None)

    def share(self, n: int) -> Limits:
        """One of `n` replicas' share: each limit divided by `n`, rounded down, at least 1 (0 stays none)."""
        return Limits(*(max(1, v // n) if v else 0 for v in (self.rpm, self.tpm, self.max_inflight)))

    def levels(self, requests_ahead_ns: int, tokens_ahead_ns: int) -> tuple[int, int]:
        """The buckets' levels in milli-units (0 without a rate) from how long each is short of full (`take`'s)."""
        return (
            self.rpm * 1000 - requests_ahead_ns * 1000 // self.request_ns if self.rpm else 0,
            self.tpm * 1000 - tokens_ahead_ns * 1000 // self.token_ns if self.tpm else 0,
        )


# An admission's verdict: (refused: "" when admitted, else "requests", "tokens" or "inflight"; seconds until it would
# not be; how long the requests' and tokens' buckets are short of full after it, in ns: `Limits.levels` makes them the
# client's headers' levels). A plain tuple: making a NamedTuple costs more than the rest of an admission's arithmetic.
Taken = tuple[str, float, int, int]


class TenantQuotas:
    """One worker's view of the tenants' table (see the module docstring)."""

    def __init__(self, shared: SharedState, worker: int, num_workers: int):
        self.rows: list[TenantRow] = list(shared.tenants.rows)
        # (The per-request sections call its acquire and release: `with` on it costs twice as much, its special
        # methods looked up and bound each time, and its __exit__ called with three arguments.)
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

    def take(self, at: int, now_ns: int, limits: Limits, reserve_tokens: int) -> Taken:
        """Admit one request of the tenant at row `at`, reserving `reserve_tokens` of its tpm, or say why not."""
        row, lock = self.rows[at], self.lock
        ahead = ahead_tokens = 0
        lock.acquire()
        try:
            cap = limits.max_inflight
            if cap:
                n = 0
                for column in self.inflight:  # (a loop: sum() over a generator costs twice as much)
                    n += column[at]
                if n >= cap:
                    full, full_tokens = row.requests_full_ns, row.tokens_full_ns
                    return (
                        "inflight",
                        1.0,
                        full - now_ns if full > now_ns else 0,
                        full_tokens - now_ns if full_tokens > now_ns else 0,
                    )
            rpm = limits.rpm
            if rpm:
                per = limits.request_ns
                full = row.requests_full_ns
                ahead = (full - now_ns if full > now_ns else 0) + per  # with this request's
                if ahead > limits.requests_ns:
                    full = row.tokens_full_ns
                    return (
                        "requests",
                        (ahead - limits.requests_ns) / 1e9,
                        ahead - per,
                        full - now_ns if full > now_ns else 0,
                    )
            if limits.tpm:
                per_token = limits.token_ns
                full = row.tokens_full_ns
                ahead_tokens = full - now_ns if full > now_ns else 0
                # a debt (or less than a token left): the next request waits until it is paid
                if ahead_tokens + per_token > limits.tokens_ns:
                    return (
                        "tokens",
                        (ahead_tokens + per_token - limits.tokens_ns) / 1e9,
                        ahead - limits.request_ns if rpm else 0,
                        ahead_tokens,
                    )
                ahead_tokens += reserve_tokens * per_token
                row.tokens_full_ns = now_ns + ahead_tokens
            if rpm:
                row.requests_full_ns = now_ns + ahead
            self.my_inflight[at] += 1
        finally:
            lock.release()
        return "", 0.0, ahead, ahead_tokens

    def leave(self, at: int, settle_tokens: int, token_ns: int) -> None:
        """A request of row `at` ended; `settle_tokens` (served less reserved) are taken from its tpm bucket (a
        refund when negative, never beyond a full bucket); `token_ns`: its tpm's unit (`Limits.token_ns`, 0 without
        a tpm)."""
        self.my_inflight[at] -= 1  # only this worker writes its row: no lock
        if token_ns and settle_tokens:
            now_ns = time.monotonic_ns()
            row, lock = self.rows[at], self.lock
            lock.acquire()
            try:
                full = row.tokens_full_ns  # (_take_tokens, inlined)
                row.tokens_full_ns = (full if full > now_ns else now_ns) + settle_tokens * token_ns
            finally:
                lock.release()

    def charge(self, batch: list[tuple[int, int, int]]) -> None:
        """Tokens served beyond those taken, per row: (row, tokens, its tpm's unit `Limits.token_ns`), all under one
        lock (a refund when negative, never beyond a full bucket)."""
        now_ns = time.monotonic_ns()
        with self.lock:
            for at, tokens, token_ns in batch:
                _take_tokens(self.rows[at], tokens, token_ns, now_ns)


def _take_tokens(row: TenantRow, tokens: int, token_ns: int, now_ns: int) -> None:
    """`tokens` taken from the row's tpm bucket (its unit `token_ns`) at `now_ns` (given back when negative: a time
    past is a full bucket, so never beyond it). Under the lock."""
    full = row.tokens_full_ns
    row.tokens_full_ns = (full if full > now_ns else now_ns) + tokens * token_ns


def unit_ns(per_minute: int) -> int:
    """The ns one unit of a rate of `per_minute` a minute takes to refill."""
    return -(-PER_MINUTE_NS // per_minute)
