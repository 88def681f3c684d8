"""Tenants on the request path: a request's quota (tenant_config's rpm, tpm, max_inflight) taken at the door and
settled when it ends, the x-ratelimit-* headers of its answer, and its tenant's metric label.

Who a request's tenant is, the key check says (handlers/auth.py, config.Settings.key_owners); this module only
reads `job.tenant`. The quotas are exact across workers (state/quotas.py: one lock). In cluster mode each replica
holds its share of a tenant's limits (a limit divided by the live replicas, rounded down, at least 1): together
never more than the limit (when it is at least the number of replicas), though a tenant whose requests reach one
replica only gets that replica's share.

`tpm` counts prompt plus output tokens: a request reserves its prompt's estimate (a quarter of its body's bytes)
plus its output budget (`max_tokens`, or the route's default) when admitted, and the difference to what it was
served is settled when it ends (given back, or taken beyond). A tenant whose bucket is in debt waits until the
debt is paid, so the tokens served in any minute exceed `tpm` by at most one request's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from config import OTHER_TENANT, PRIORITIES, STANDARD, Live, TenantLimits
from errors import InvalidRequest, RateLimited, clip
from scheduling.fairness import FairShare
from serving.job import Job
from serving.observe import RequestRecord
from state.quotas import Limits, Taken, TenantQuotas, wait_s


def reset_text(seconds: float) -> str:
    """A duration as OpenAI's x-ratelimit-reset-* headers write it: `20ms`, `1.5s`, `6m0s`."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60)
    rest = math.ceil(rest * 1000) / 1000
    return f"{int(minutes)}m{rest:g}s" if minutes else f"{rest:g}s"


CLASSES = {name: i for i, name in enumerate(PRIORITIES)}  # x-priority's values: the class (vLLM's `priority`)
NO_TENANT = "-"  # an engine's metaserver call: part of a client request, which is its tenant's


class Active:
    """An admitted request of a tenant without a quota: its output counted in its tenant's fair share (which its
    prompt was when the scheduler let it in), and the tenant no longer active for it, when the block ends."""

    __slots__ = ("fair", "job", "rec")

    def __init__(self, fair: FairShare, job: Job, rec: RequestRecord):
        self.fair, self.job, self.rec = fair, job, rec

    def __enter__(self) -> Active:
        return self

    def __exit__(self, *exc) -> None:
        self.fair.leave(self.job.tenant, self.rec.generated_tokens, self.job.weight)


class Place(Active):
    """An admitted request's quota too: given back, and its tokens settled, when the block ends."""

    __slots__ = ("at", "quotas", "reserved", "tpm")

    def __init__(
        self, fair: FairShare, job: Job, rec: RequestRecord, quotas: TenantQuotas, at: int, reserved: int, tpm: int
    ):
        super().__init__(fair, job, rec)
        self.quotas, self.at, self.reserved, self.tpm = quotas, at, reserved, tpm

    def __exit__(self, *exc) -> None:
        super().__exit__()
        rec = self.rec
        reached = rec.target is not None or rec.prefill is not None  # an engine served (some of) it
        served = rec.prompt_tokens + rec.generated_tokens if reached else 0
        self.quotas.leave(self.at, served - self.reserved, self.tpm)


class Tenants:
    """One worker's side of the tenants (see the module docstring)."""

    def __init__(self, live: Live, quotas: TenantQuotas, fair: FairShare, clock: Callable[[], float] = time.monotonic):
        self.live, self.quotas, self.fair, self.clock = live, quotas, fair, clock
        self.replicas: Callable[[], int] = lambda: 1  # cluster mode: the live replicas (serving/cluster.py)

    def limits(self, tenant: str) -> TenantLimits:
        s = self.live.s
        return s.tenant_limits.get(tenant) or s.default_limits

    def classify(self, job: Job, header: str | None) -> None:
        """The request's x-priority class (`header`; absent: standard), capped at its tenant's max_priority, and its
        tenant's weight. An unknown class is the client's error."""
        asked = STANDARD if header is None else CLASSES.get(header.strip().lower())
        if asked is None:
            raise InvalidRequest(f"header x-priority must be one of {', '.join(PRIORITIES)} (got {clip(header)!r})")
        lim = self.limits(job.tenant)
        job.priority, job.weight = max(asked, CLASSES[lim.max_priority]), lim.weight

    def admit(self, job: Job, rec: RequestRecord, headers: dict[str, str]) -> Active:
        """`with tenants.admit(...)`: the request's quota held until the block ends, or RateLimited. The answer's
        x-ratelimit-* headers go into `headers` (a tenant with rpm or tpm only)."""
        lim = self.limits(job.tenant)
        if not (lim.rpm or lim.tpm or lim.max_inflight):
            self.fair.arrive(job.tenant, job.priority)
            return Active(self.fair, job, rec)
        n = self.replicas()
        rpm, tpm, cap = (max(1, v // n) if v else 0 for v in (lim.rpm, lim.tpm, lim.max_inflight))
        reserved = len(job.raw) // 4 + job.max_tokens if tpm else 0
        at = self.quotas.slot(job.tenant)
        taken = self.quotas.take(at, int(self.clock() * 1e6), Limits(rpm, tpm, cap), reserved)
        _headers(headers, taken, rpm, tpm)
        if taken.refused:
            raise _refusal(taken, lim, headers)
        self.fair.arrive(job.tenant, job.priority)
        return Place(self.fair, job, rec, self.quotas, at, reserved, tpm)

    def label(self, tenant: str) -> str:
        """The tenant as a metric label: the first MAX_TENANT_LABELS the config names (tenant_config's tenants and
        `default`, else the keys' own tenants), every other one `other`."""
        return tenant if tenant in self.live.s.tenant_labels else OTHER_TENANT

    def request_label(self, rec: RequestRecord) -> str | None:
        """A finished request's tenant as a metric label (None: not a tenant's, an engine's metaserver call)."""
        return None if rec.tenant == NO_TENANT else self.label(rec.tenant)


def _headers(headers: dict[str, str], taken: Taken, rpm: int, tpm: int) -> None:
    """OpenAI's x-ratelimit-* headers: each quota's limit, what is left of it, and when it is whole again."""
    if rpm:
        left = max(0, taken.requests_milli)
        headers["x-ratelimit-limit-requests"] = str(rpm)
        headers["x-ratelimit-remaining-requests"] = str(left // 1000)
        headers["x-ratelimit-reset-requests"] = reset_text(wait_s(left, rpm * 1000, rpm / 60))
    if tpm:
        left = taken.tokens_milli
        headers["x-ratelimit-limit-tokens"] = str(tpm)
        headers["x-ratelimit-remaining-tokens"] = str(max(0, left) // 1000)
        headers["x-ratelimit-reset-tokens"] = reset_text(wait_s(left, tpm * 1000, tpm / 60))


def _refusal(taken: Taken, lim: TenantLimits, headers: dict[str, str]) -> RateLimited:
    kind = taken.refused
    if kind == "inflight":
        message, kind = f"too many requests in flight for this tenant (limit {lim.max_inflight})", "requests"
    elif kind == "requests":
        message = f"rate limit reached for requests: limit {lim.rpm} per minute"
    else:
        message = f"rate limit reached for tokens: limit {lim.tpm} per minute (prompt plus output)"
    err = RateLimited.by_quota(kind, message, taken.wait_s, reason="tenant_" + taken.refused)
    err.headers.update(headers)
    return err
