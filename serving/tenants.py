"""Tenants on the request path: a request's quota (tenant_config's rpm, tpm, max_inflight) taken at the door and
settled when it ends, the x-ratelimit-* headers of its answer, and its tenant's metric label.

Who a request's tenant is, the key check says (handlers/auth.py, config.Settings.key_owners); this module only
reads `job.tenant`. The quotas are exact across workers (state/quotas.py: one lock) and, in cluster mode, across
replicas: the quota is asked in the door's one round trip to the cluster store (serving/cluster.py `admit`, `Ask`
here). While the store is away each replica holds its share of a tenant's limits (a limit divided by the live
replicas, rounded down, at least 1), in its own table.

`tpm` counts prompt plus output tokens. A request reserves its prompt's estimate (a quarter of its body's bytes:
the exact count, from the model's tokenizer when it has one, is made later, by the scheduler) and its tenant's
mean output (at most its max_tokens; all of max_tokens until one of the tenant's requests has ended here) when
admitted; at each of the worker's ticks (serving/observe.py `Tick`, 50 ms) what its requests were served beyond
what they took (the output as it streams, the prompt's count once made) is charged in one batch (one lock, or the
store's next call or tick), and the rest is settled when it ends. A bucket in debt refuses until the debt is paid.

Each tenant's prompts have their own scope in the engines' prefix cache (tenant_config's prefix_cache "isolated",
with keys on): vLLM's `cache_salt`, which enters a prompt's first block hash, is the tenant's digest on every body
bound for an engine (serving/legs.py `engine_body`), or the digest, ':' and the client's own salt, so no tenant
learns from `cached_tokens` (or its TTFT) what another asked.
"""

from __future__ import annotations

import hashlib
import math
import time
from contextlib import AbstractContextManager, nullcontext
from functools import lru_cache

from config import OTHER_TENANT, PRIORITIES, STANDARD, Live, Settings, TenantLimits
from errors import InvalidRequest, RateLimited, clip
from scheduling.fairness import FairShare
from serving.job import Job
from serving.observe import RequestRecord, Tick
from state.quotas import Limits, TenantQuotas
from state.shared import tenant_hash


def reset_text(short_milli: int, per_min: int) -> str:
    """When a bucket `short_milli` below full, filled at `per_min` a minute, is full again, as OpenAI's
    x-ratelimit-reset-* headers write it: `20ms`, `1.5s`, `6m0s`."""
    if short_milli <= 0:
        return "0ms"
    seconds = short_milli / (1000 * (per_min / 60))  # (wait_s's division, in its order: the same float)
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60)
    rest = math.ceil(rest * 1000) / 1000
    return f"{int(minutes)}m{rest:g}s" if minutes else f"{rest:g}s"


CLASSES = {name: i for i, name in enumerate(PRIORITIES)}  # x-priority's values: the class (vLLM's `priority`)
NO_TENANT = "-"  # an engine's metaserver call: part of a client request, which is its tenant's
EXPECTED_WEIGHT = 0.125  # a finished request's weight in its tenant's mean output
UNCOUNTED = nullcontext()  # the place of a request without a quota when there is no fair share to count it in


class Active:
    """An admitted request of a tenant without a quota: its output counted in its tenant's fair share (which its
    prompt was when the scheduler let it in), and the tenant no longer active for it, when the block ends. Without
    admission (`fair` None) there is no fair share to count in: a Place's base only."""

    __slots__ = ("fair", "job", "rec")

    def __init__(self, fair: FairShare | None, job: Job, rec: RequestRecord):
        self.fair, self.job, self.rec = fair, job, rec

    def __enter__(self) -> Active:
        return self

    def __exit__(self, *exc) -> None:
        self.fair.leave(self.job.tenant, self.rec.generated_tokens, self.job.weight)


LOCAL, STORE = 1, 2  # where a request's quota was taken: this Coordinator's table, or the cluster store
new_place = object.__new__


class Place(Active):
    """An admitted request's quota too: its tokens charged as it is served (`Tenants.charge`), given back and
    settled when the block ends. `side` 0 while the cluster store has not answered (or refused it): nothing held.

    Made by `Tenants.admit` only, which sets every field (`new_place`: calling the class, through an __init__, cost
    1 k instructions more): `tenants`, Active's three, `limits`, `prompt` (its estimate), `reserved` (taken from its
    tpm bucket when admitted: the prompt's estimate and its output's), `charged` (tokens taken from its tpm bucket so
    far), `key` (its tenant's row, LOCAL, or hash, STORE) and `side`."""

    __slots__ = ("charged", "key", "limits", "prompt", "reserved", "side", "tenants")

    def used(self) -> int:
        """Tokens served so far: its prompt (the scheduler's count once made, exact with the model's tokenizer;
        until then the estimate) and its output so far."""
        rec = self.rec
        return (rec.prompt_tokens or self.prompt) + rec.generated_tokens

    def __exit__(self, exc_type, exc, tb) -> None:
        """The request ended: its place given back, the tokens it was served beyond those charged taken (or those
        charged beyond them given back: a request no engine served is charged nothing). Its output counts in its
        tenant's mean when it ended without an error (an engine's error relayed, a stream cut or abandoned: its
        output says nothing of the tenant's usual one). (Tenants' settlement, here: a call fewer a request.)"""
        if not self.side:
            return
        if self.fair is not None:
            super().__exit__()
        tenants = self.tenants
        tenants.streaming.discard(self)
        rec = self.rec
        reached = rec.target is not None or rec.prefill is not None  # an engine served (some of) it
        out = rec.output_tokens  # (`generated_tokens`' first case, inlined: a JSON answer's usage)
        if out is None or not reached:
            out = rec.generated_tokens if reached else 0
        rest = (rec.prompt_tokens + out if reached else 0) - self.charged
        limits = self.limits
        tpm = limits.tpm
        if tpm and reached and exc_type is None:
            tenant = self.job.tenant
            mean = tenants.expected.get(tenant)
            if mean != out:  # (an output of the mean leaves it as it is)
                mean = tenants.expected[tenant] = out if mean is None else mean + (out - mean) * EXPECTED_WEIGHT
                tenants.reserving[tenant] = math.ceil(mean)
        if self.side == LOCAL:
            tenants.quotas.leave(self.key, rest, limits.token_ns)
        else:
            tenants.cluster.quotas.left(self.key, rest if tpm else 0, tpm)


class Ask:
    """A tenant's part of a request's one round trip to the cluster store (serving/cluster.py `admit`)."""

    __slots__ = ("headers", "key", "place", "rpm", "tpm")

    def __init__(self, place: Place, headers: dict[str, str]):
        self.place, self.headers = place, headers
        self.rpm, self.tpm = place.limits.rpm, place.limits.tpm
        self.key = str(tenant_hash(place.job.tenant))

    def args(self, epoch: str) -> tuple:
        lim = self.place.limits
        return (self.key, lim.rpm, lim.tpm, lim.max_inflight, self.place.reserved, epoch)

    def answer(self, refused: str, wait: float, state: list) -> None:
        """The store's verdict (`refused` "" when admitted) and the tenant's buckets after it: the headers, and
        RateLimited when refused."""
        place = self.place
        requests, tokens = (int(state[0]), int(state[2])) if len(state) > 2 else (0, 0)
        _headers(self.headers, requests, tokens, self.rpm, self.tpm)
        if refused:
            raise _refusal(refused, wait, place.tenants.limits(place.job.tenant))
        place.key, place.side = self.key, STORE
        place.tenants.held(place)

    def fallback(self) -> None:
        """The store is away: this replica's share of the quota, in its own table."""
        self.place.tenants.take_local(self.place, self.headers)


class Tenants:
    """One worker's side of the tenants (see the module docstring)."""

    def __init__(
        self,
        live: Live,
        quotas: TenantQuotas,
        fair: FairShare | None,
        tick: Tick,
    ):
        # `fair`: the scheduler's tenants' counters (None without admission: nothing reads them)
        self.live, self.quotas, self.fair = live, quotas, fair
        self.cluster = None  # cluster mode's serving/cluster.py Cluster: quotas held across the replicas
        self.streaming: set[Place] = set()  # admitted requests with a tpm: their tokens charged as they are served
        # tenant -> the output its requests were served, on average (this worker's, recent ones weigh more): what a
        # request of it reserves for its output, at most its max_tokens (unknown: all of max_tokens)
        self.expected: dict[str, float] = {}
        self.reserving: dict[str, int] = {}  # tenant -> its `expected` rounded up, as a request of it reserves it
        self._timer = tick.timer(self.charge)  # the tokens served by streams under way, charged
        # tenant -> (the Settings it was worked out from, and its quota from them: None without one), made once per
        # tenant and config (a reload's Settings is another object)
        self._quotas: dict[str, tuple[Settings, Limits | None]] = {}

    def limits(self, tenant: str) -> TenantLimits:
        s = self.live.s
        return s.tenant_limits.get(tenant) or s.default_limits

    def quota(self, tenant: str) -> Limits | None:
        """The tenant's rpm, tpm and max_inflight; None when it has none of them."""
        s = self.live.s
        known = self._quotas.get(tenant)
        if known is None or known[0] is not s:
            lim = self.limits(tenant)
            quota = Limits(lim.rpm, lim.tpm, lim.max_inflight) if lim.rpm or lim.tpm or lim.max_inflight else None
            known = self._quotas[tenant] = (s, quota)
        return known[1]

    def classify(self, job: Job, header: str | None) -> None:
        """The request's x-priority class (`header`; absent: standard), capped at its tenant's max_priority, its
        tenant's weight, and its prompt's prefix-cache scope (`job.cache_salt`). An unknown class is the client's
        error."""
        asked = STANDARD if header is None else CLASSES.get(header.strip().lower())
        if asked is None:
            raise InvalidRequest(f"header x-priority must be one of {', '.join(PRIORITIES)} (got {clip(header)!r})")
        lim = self.limits(job.tenant)
        job.priority, job.weight = max(asked, CLASSES[lim.max_priority]), lim.weight
        if self.live.s.isolated_prefixes and not job.family.counts_only:  # (a count computes no KV)
            job.cache_salt = effective_salt(job.tenant, job.body.get("cache_salt"))

    def admit(self, job: Job, rec: RequestRecord, headers: dict[str, str], door=None) -> AbstractContextManager:
        """`with tenants.admit(...)`: the request's quota held until the block ends, or RateLimited. The answer's
        x-ratelimit-* headers go into `headers` (a tenant with rpm or tpm only). In cluster mode, with the store
        reachable, the quota is asked in the door's round trip (`door`, its place: awaited in the block)."""
        tenant = job.tenant
        limits = self.quota(tenant)
        if limits is None:
            fair = self.fair
            if fair is None:
                return UNCOUNTED
            fair.arrive(tenant, job.priority)
            return Active(fair, job, rec)
        place = new_place(Place)  # (see Place)
        place.tenants, place.fair, place.job, place.rec, place.limits = self, self.fair, job, rec, limits
        place.key = place.side = 0
        tpm = limits.tpm
        if tpm:
            # its expected output, at most its max_tokens and a minute's tokens (a max_tokens of 10**30 would not fit
            # the bucket's clock, and reserves no more); comparisons: min() of three cost as much as the rest
            max_tokens = job.max_tokens
            output = self.reserving.get(tenant, max_tokens)
            if output > max_tokens:
                output = max_tokens
            if output > tpm:
                output = tpm
            place.prompt = prompt = len(job.raw) // 4
            place.reserved = place.charged = prompt + output
        else:
            place.prompt = place.reserved = place.charged = 0
        cluster = self.cluster
        if cluster is not None and cluster.connected and door is not None:
            door.tenant = Ask(place, headers)
            if door.pending is None:
                door.pending = cluster.admit(door, 0, 0.0, 0)
            return place
        self.take_local(place, headers)
        return place

    def take_local(self, place: Place, headers: dict[str, str]) -> None:
        """The quota from this Coordinator's table: exact across its workers; in cluster mode (the store away) this
        replica's share of each limit (divided by the live replicas, rounded down, at least 1)."""
        limits = place.limits
        cluster = self.cluster
        if cluster is not None and cluster.replicas > 1:
            limits = limits.share(cluster.replicas)
        tenant = place.job.tenant
        quotas = self.quotas
        at = quotas.slots.get(tenant)  # (`slot`, inlined once found)
        if at is None:
            at = quotas.slot(tenant)
        # (the door's monotonic clock, one for every process on the host, in integers: no float to make and round)
        refused, wait, ahead, ahead_tokens = quotas.take(at, time.monotonic_ns(), limits, place.reserved)
        if limits.rpm or limits.tpm:
            # (`_headers`, from the buckets' times: the block made for the same times last is taken as it is)
            known = limits.headers
            if known[0] != ahead or known[1] != ahead_tokens:
                requests, tokens = limits.levels(ahead, ahead_tokens)
                known = limits.headers = (ahead, ahead_tokens, _block(requests, tokens, limits.rpm, limits.tpm))
            name, block = known[2]
            headers[name] = block
        if refused:
            raise _refusal(refused, wait, self.limits(tenant))
        place.key, place.side, place.limits = at, LOCAL, limits
        self.held(place)

    def held(self, place: Place) -> None:
        """An admitted request's quota is held: its tenant is active, its tokens charged as they are served."""
        if self.fair is not None:
            self.fair.arrive(place.job.tenant, place.job.priority)
        if place.limits.tpm:
            self.streaming.add(place)
            timer = self._timer
            if not timer.armed:  # (armed already but for a request's first 50 ms: no call then)
                timer.arm()

    def charge(self) -> None:
        """At each tick: the tokens served since the last charge (the output as it streams, the prompt's count
        once the scheduler made it) taken from the tenants' tpm buckets, in one batch: this Coordinator's table
        under one lock, or the cluster store at this worker's next call or tick."""
        self._timer.disarm()
        batch = []
        for place in self.streaming:
            used = place.used()
            if used > place.charged:  # (what it reserved beyond what it used so far is settled when it ends)
                if place.side == LOCAL:
                    batch.append((place.key, used - place.charged, place.limits.token_ns))
                else:
                    self.cluster.quotas.charge(place.key, used - place.charged, place.limits.tpm)
                place.charged = used
        if batch:
            self.quotas.charge(batch)
        if self.streaming:
            self._timer.arm()

    def label(self, tenant: str) -> str:
        """The tenant as a metric label: the first MAX_TENANT_LABELS the config names (tenant_config's tenants and
        `default`, else the keys' own tenants), every other one `other`."""
        return tenant if tenant in self.live.s.tenant_labels else OTHER_TENANT

    def request_label(self, rec: RequestRecord) -> str | None:
        """A finished request's tenant as a metric label (None: not a tenant's, an engine's metaserver call)."""
        return None if rec.tenant == NO_TENANT else self.label(rec.tenant)


def _headers(headers: dict[str, str], requests_milli: int, tokens_milli: int, rpm: int, tpm: int) -> None:
    """OpenAI's x-ratelimit-* headers: each quota's limit, what is left of it (the buckets' levels after the
    admission, in milli-units), and when it is whole again.

    They go out as one pre-formatted block: the first header's value carries the others' lines. The answer's
    writer (handlers/sink.py `RelayResponse`) writes values as they are, and six headers cost six encodings and
    six formattings there. An error answer (the quota's refusal, or an admitted request's error) takes them apart
    again (`quota_headers`): Sanic's writer writes it."""
    if rpm or tpm:
        name, block = _block(requests_milli if rpm else 0, tokens_milli if tpm else 0, rpm, tpm)
        headers[name] = block


# The label a tenant's digest starts from: a constant, so that every worker and replica salts a tenant alike.
_SALT_LABEL = b"motor-coordinator/prefix-cache/"
SALT_DIGITS = 32  # hex digits of a tenant's digest: 128 bits
# vLLM takes a cache_salt of at most 128 characters: the client's own comes after the digest and ':'.
CLIENT_SALT_MAX = 128 - SALT_DIGITS - 1


@lru_cache(maxsize=4096)
def tenant_salt(tenant: str) -> str:
    """The tenant's prefix-cache scope: the first 32 hex digits of SHA-256 over a constant label and its name."""
    return hashlib.sha256(_SALT_LABEL + tenant.encode()).hexdigest()[:SALT_DIGITS]


def effective_salt(tenant: str, client: object) -> str:
    """The `cache_salt` a tenant's request carries to its engines: the tenant's digest, then ':' and the client's
    own salt when it sent one. The digest's fixed length makes it injective: no client salt gives another
    tenant's scope."""
    digest = tenant_salt(tenant)
    if client is None:
        return digest
    if not isinstance(client, str) or not 0 < len(client) <= CLIENT_SALT_MAX:
        raise InvalidRequest(
            f"cache_salt must be a non-empty string of at most {CLIENT_SALT_MAX} characters (the Coordinator puts "
            "its tenant's scope in front of it, and vLLM takes 128)",
            param="cache_salt",
        )
    return f"{digest}:{client}"


# Cached: a bucket that refills between a tenant's requests is left at the same level (full less one request and
# its reservation) request after request, and the block is a pure function of the levels and limits. (Formatting
# it was a fifth of what a quota costs a request.)
@lru_cache(maxsize=4096)
def _block(requests_milli: int, tokens_milli: int, rpm: int, tpm: int) -> tuple[str, str]:
    """`_headers`' block: the first header's name and its value, which carries the others' lines."""
    if rpm:
        left = requests_milli if requests_milli > 0 else 0
        requests = (
            f"{rpm}\r\nx-ratelimit-remaining-requests: {left // 1000}"
            f"\r\nx-ratelimit-reset-requests: {reset_text(rpm * 1000 - left, rpm)}"
        )
        if not tpm:
            return "x-ratelimit-limit-requests", requests
    left = tokens_milli  # (a debt's reset counts the debt too)
    tokens = (
        f"{tpm}\r\nx-ratelimit-remaining-tokens: {left // 1000 if left > 0 else 0}"
        f"\r\nx-ratelimit-reset-tokens: {reset_text(tpm * 1000 - left, tpm)}"
    )
    if rpm:
        return "x-ratelimit-limit-requests", f"{requests}\r\nx-ratelimit-limit-tokens: {tokens}"
    return "x-ratelimit-limit-tokens", tokens


def quota_headers(headers: dict[str, str]) -> dict[str, str]:
    """The x-ratelimit-* headers in an answer's `headers`, `_headers`' block taken apart into the headers it holds
    (for Sanic's own writer, which an error answer goes through); none when its request took no quota."""
    for name in ("x-ratelimit-limit-requests", "x-ratelimit-limit-tokens"):  # (the block's name: `_block`)
        block = headers.get(name)
        if block is not None:
            return dict(line.split(": ", 1) for line in f"{name}: {block}".split("\r\n"))
    return {}


def _refusal(refused: str, wait_s: float, lim: TenantLimits) -> RateLimited:
    """A quota's refusal. Its answer's x-ratelimit-* headers, which `_headers` wrote before it, the handler adds
    (handlers/lifetime.py `_fail`), as it does to every error answer of a request its tenant's quota counted."""
    kind = refused
    if kind == "inflight":
        message, kind = f"too many requests in flight for this tenant (limit {lim.max_inflight})", "requests"
    elif kind == "requests":
        message = f"rate limit reached for requests: limit {lim.rpm} per minute"
    else:
        message = f"rate limit reached for tokens: limit {lim.tpm} per minute (prompt plus output)"
    return RateLimited.by_quota(kind, message, wait_s, reason="tenant_" + refused)
