"""The scheduler: from a model and a request, a plan naming the engine(s) that serve it.

A model with prefill and decode instances is served disaggregated (a P/D pair), or, with
`conditional_disaggregation`, on the pair's decode instance alone when the policy predicts that sooner
(`Plan.alone`). When it has no usable pair the request is served whole on a union, prefill or decode
instance (`enable_pd_separation_fallback_to_hybrid`, PyMotor's meaning; false: NoCapacity, a 503); with
only union instances whole requests go to one engine. Paused instances, unhealthy ones and those whose breaker is
open are never chosen; `exclude` keeps retries off the slots that already failed, and a job that names
an engine kind sees only engines of that kind.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from dataclasses import dataclass

from config import Live, Settings
from scheduling import clock
from scheduling.admission import OFF, QUEUE, REJECT, AdmissionQueue, OverBudget
from scheduling.affinity import PrefixIndex
from scheduling.exact import make_meter
from scheduling.fairness import BATCH, BATCH_SHARE, FairShare
from scheduling.health import Health
from scheduling.kv_index import TOKEN_BYTES, KvEventSource, KvIndex, PromptKeys, prompt_seed
from scheduling.ledger import DECODE, PREFILL, WHOLE, Hold, Lease, Ledger
from scheduling.policies import (
    MARGIN,
    TPOT_MARGIN,
    JobInfo,
    KvCacheAffinity,
    LoadBalance,
    Policy,
    PrefixSource,
    RoundRobin,
)
from scheduling.predict import UNKNOWN, Predictor
from scheduling.registry import Registry, Target
from scheduling.slo_aware import SloAware
from scheduling.tokens import PromptMeter, salted_hashes

log = logging.getLogger("coordinator.scheduler")

# The learned model's fits and allowances take at most one request per slot in this many seconds from
# each worker: they cost about 20 µs a request, a twentieth of a streamed request's whole cost in a loaded
# worker, and requests starting a millisecond apart on one engine tell the model little the others do not.
# Which requests are samples is decided when they start, so that it does not depend on how long they take.
# At the rates of real engines (a few requests a second per slot and worker) nearly every request is one;
# the prefill queue's corrections and the prefix index take every request.
LEARN_INTERVAL_S = 0.005


class NoCapacity(Exception):
    """No usable instance of the model."""


@dataclass
class Plan:
    """Where a request goes: one engine (`target`), or a P/D pair (`prefill` and `target`).

    `leg` gives each engine call of the plan as a `Leg`, which leases its engine and re-picks one for a retry.
    """

    prefill: Target | None  # set for a P/D pair
    target: Target  # the decode target of a pair, or the one engine of a whole request
    scheduler: Scheduler
    job: JobInfo
    alone: bool = False  # a pair whose decode engine computes the prompt itself (conditional disaggregation)

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not None

    def leg(self, kind: str, learn: bool = True) -> Leg:
        """The call `kind` names: WHOLE (the one engine), PREFILL (P of the pair) or DECODE (D of the pair).

        A whole request's retry is planned whole again, a prefill's as a pair again (P is chosen with its D in
        view), a decode's among the decode instances (its body carries P's ticket, which only they take).
        """
        if kind == PREFILL:
            return Leg(self.scheduler, self.job, PREFILL, self.prefill, REPLAN)
        if self.alone:  # D computes the prompt: a whole request on it, retried among the decode instances
            return Leg(self.scheduler, self.job, WHOLE, self.target, ("decode",), learn)
        return Leg(self.scheduler, self.job, kind, self.target, REPLAN if kind == WHOLE else ("decode",), learn)


# Where a leg's retry goes besides its roles (`Leg.retry_roles`): planned again, or the same engine.
REPLAN, PINNED = (), None
# Where a broken stream goes on (`Leg.continue_elsewhere`), in order of preference: any engine that serves the model
# whole, as MindIE-PyMotor's hybrid fallback does. A decode instance is sized for decoding; a prefill instance
# (a NixlConnector producer) serves a request without a ticket whole, at the cost of its new prompts' TTFT.
CONTINUATION_ROLES = ("decode", "union", "prefill")


class Leg:
    """One engine call of a request as the scheduler placed it: a whole request, the prefill or decode half
    of a P/D pair, or a single-engine call (count_tokens, a metaserver call).

    `target` is the engine it goes to now; `lease()` takes that engine's load in the ledger for one try
    (the caller releases the lease), `hold()` promises a decode engine's place while the prefill runs, and
    `move()` re-picks an engine for a retry, the way the leg was chosen (`retry_roles`): planned again
    (REPLAN), picked among those roles, or kept on the same engine (PINNED: a metaserver call names it);
    `continue_elsewhere()` picks the engine a broken stream goes on on.
    """

    __slots__ = ("job", "kind", "learn", "retry_roles", "scheduler", "target")

    def __init__(
        self,
        scheduler: Scheduler,
        job: JobInfo,
        kind: str,
        target: Target,
        retry_roles: tuple[str, ...] | None,
        learn: bool = True,
    ):
        self.scheduler, self.job, self.kind, self.target = scheduler, job, kind, target
        self.retry_roles = retry_roles
        self.learn = learn  # its leases' timings may teach the learned model (see Scheduler.lease)

    def lease(self) -> Lease:
        return self.scheduler.lease(self.target, self.job, self.kind, self.learn)

    def calibrate(self, prompt_tokens: int) -> None:
        """The engine counted the request's prompt (`engine_prompt`; -1: it did not say): the model's meter learns."""
        self.scheduler.calibrate(self.job.model, self.job.prompt_bytes, prompt_tokens)

    def hold(self) -> Hold:
        return self.scheduler.hold(self.target)

    def can_move(self, exclude: set[int]) -> bool:
        """Is there an engine to retry on besides the excluded slots?"""
        try:
            self._pick(frozenset(exclude))
        except NoCapacity:
            return False
        return True

    def move(self, exclude: set[int]) -> bool:
        """Re-pick `target` for a retry: another engine, else the same one again; False when none is usable
        (an open breaker), and `target` stays."""
        try:
            self.target = self._pick(frozenset(exclude))
        except NoCapacity:
            try:
                self.target = self._pick(frozenset())
            except NoCapacity:
                return False
        return True

    def continue_elsewhere(self) -> bool:
        """Re-pick `target` for a stream's continuation (serving/continuation.py): an engine of CONTINUATION_ROLES
        that has not failed the request (`JobInfo.failed`), never one that has; False when none is left.

        The leg becomes a whole request there: the engine computes the prompt and the generated tokens itself,
        so the ledger counts its prefill; its timings are no sample for the learned model's fits (its prompt is
        longer than the one the request was counted with)."""
        try:
            self.target = self.scheduler.pick_one(
                self.job.model, self.job, CONTINUATION_ROLES, frozenset(self.job.failed)
            )
        except NoCapacity:
            return False
        self.kind, self.learn = WHOLE, False
        return True

    def _pick(self, exclude: frozenset[int]) -> Target:
        roles, sched, job = self.retry_roles, self.scheduler, self.job
        if roles is PINNED:
            return self.target
        if roles:
            return sched.pick_one(job.model, job, roles, exclude)
        if self.kind == PREFILL:
            plan = sched.plan(job, exclude)
            if plan.prefill is None:
                raise NoCapacity("no prefill instance left")
            return plan.prefill
        return sched.plan(job, exclude, allow_pd=False).target


class Scheduler:
    """Plans requests with one policy, admits them by SLO, and keeps the learned model up to date.

    `predictor` and `index` are the shared learned model and the source of cached prefixes the policy also
    holds (None: nothing is learned). `live`: the settings it reads where it uses them
    (`enable_pd_separation_fallback_to_hybrid`; the models' `tokenizer_path`s, for exact token counts).
    """

    def __init__(
        self,
        registry: Registry,
        ledger: Ledger,
        health: Health,
        policy: Policy,
        *,
        admission: str = OFF,
        queue: AdmissionQueue | None = None,
        live: Live | None = None,
        learn_interval_s: float = LEARN_INTERVAL_S,
    ):
        self.registry, self.ledger, self.health, self.policy = registry, ledger, health, policy
        self.predictor: Predictor | None = policy.predictor
        self.index: PrefixSource | None = policy.index
        self.admission = admission
        self.queue = queue
        self.live = live or Live(Settings())
        # The tenants' counters (the Coordinator's, in shared memory): the queue's when there is one. Without
        # admission nothing reads them, nor the classes seen: None, and no request counts itself in them.
        self.fair: FairShare | None = queue.fair if queue is not None else None
        if self.fair is None and admission != OFF:
            self.fair = FairShare(registry.shared, ledger.worker, self.live.s.num_workers)
        self.meters: dict[str, PromptMeter] = {}  # by model id; the estimate's unless its tokenizer_path loads
        self.tokenizers: dict[str, str] = {}  # the tokenizer_path each model's meter was made with
        self.models: tuple = ()  # the live `models` the meters follow
        self._follow_models()  # at start-up: loading a tokenizer (and compiling its template) blocks
        self.learn_interval_s = learn_interval_s
        self._learn_after: dict[int, float] = {}  # slot -> when this worker next learns from one of its requests
        ledger.observer = self._observe
        ledger.on_prefilled = self._prefilled

    # -- before planning -------------------------------------------------------------------------

    def _follow_models(self) -> None:
        """The meters of the live `models`: a model whose tokenizer_path is new or changed gets a meter loaded now
        (after a reload, in this worker's first request that counts a prompt), the others keep theirs and what
        they learned."""
        self.models = models = self.live.s.models
        paths = {m.id: m.tokenizer_path for m in models if m.tokenizer_path}
        self.meters = {m: meter for m, meter in self.meters.items() if self.tokenizers.get(m) == paths.get(m)}
        for m, path in paths.items():
            if m not in self.meters:
                self.meters[m] = make_meter(path, self.policy.block_tokens)
        self.tokenizers = paths

    def meter(self, model: str) -> PromptMeter:
        if self.live.s.models is not self.models:  # a reload's: perhaps other tokenizer_paths
            self._follow_models()
        meter = self.meters.get(model)
        if meter is None:
            meter = self.meters[model] = make_meter(self.tokenizers.get(model, ""), self.policy.block_tokens)
        return meter

    def token_sources(self, models: list[str]) -> dict[str, str]:
        """How each model's prompts are counted: "exact" (its tokenizer_path: exact ids, which the engines' KV
        events can be asked about) or "estimate"."""
        return {m: "exact" if self.meter(m).exact else "estimate" for m in models}

    def prepare(self, job: JobInfo, kind: str, body: dict, salt: object = None) -> Awaitable[None] | None:
        """Count the prompt and hash its blocks (the policy uses them). The count is the estimate's, or exact for a
        token-id prompt; a model with a tokenizer has its prompt encoded off the loop (scheduling/exact.py), and
        the awaitable returned puts the exact count and ids in `job` once they are in, to await before planning
        (None: nothing to wait for). `salt`: the `cache_salt` its engines see, which scopes its blocks in their
        prefix caches, and so in both indexes (a prompt of another scope holds none of them)."""
        meter = self.meter(job.model)
        index = self.index if self.policy.uses_prefix else None
        hashes = index is not None and index.needs_hashes
        wants_ids = index is not None and index.needs_ids
        if not wants_ids:
            job.prompt_tokens, job.block_hashes, job.prompt_bytes = meter.count(kind, body, hashes)
        else:
            job.prompt_tokens, job.block_hashes, job.prompt_bytes, data = meter.count_ids(kind, body, hashes)
            if data:  # the engines' KV events can answer for this prompt (scheduling/kv_index.py)
                job.prompt_keys = PromptKeys(data, prompt_seed(salt))
            job.kv_predicted = bool(data) or meter.exact
        if salt and job.block_hashes:
            job.block_hashes = salted_hashes(job.block_hashes, salt)
        if not meter.exact or job.prompt_keys is not None:
            return None
        future = meter.submit(kind, body)
        if future is None:
            return None
        return self._exact(job, meter, future, prompt_seed(salt) if wants_ids else None)

    async def _exact(self, job: JobInfo, meter, future, seed: bytes | None) -> None:
        data = await meter.wait(future)
        if data is None:  # not in within EXACT_WAIT_S: planned on the estimate
            return
        job.prompt_tokens = len(data) // TOKEN_BYTES
        # The exact count teaches the estimate (prompts it cannot wait for).
        meter.calibrate(job.prompt_bytes, job.prompt_tokens)
        if seed is not None:
            job.prompt_keys = PromptKeys(data, seed)

    def calibrate(self, model: str, prompt_bytes: int, prompt_tokens: int) -> None:
        """An engine counted `prompt_tokens` for a prompt of `model` that `prepare` measured at `prompt_bytes`
        (JobInfo.prompt_bytes; 0: it cannot teach): the model's meter learns its tokens per byte from it.
        Per worker: each worker's (and each replica's) meters learn from the requests it serves."""
        if prompt_bytes and prompt_tokens > 0:
            meter = self.meters.get(model)
            if meter is not None:
                meter.calibrate(prompt_bytes, prompt_tokens)

    # -- admission -------------------------------------------------------------------------------

    def try_admit(self, job: JobInfo) -> Plan | None:
        """The first plan if SLO admission lets the request in now; None when it must wait (`queued`).

        Raises OverBudget when it is refused. Synchronous, so that the usual request (let in at once) costs no
        coroutine; only a wait in the queue awaits.
        """
        if self.admission == QUEUE and self.queue.ahead(job):  # it waits behind its betters (scheduling/admission.py)
            return None
        plan = self.judged(job)
        if self.admits(job, plan):
            if self.fair is not None:
                self.fair.admitted(job)
            return plan
        log.debug(
            "over budget: model=%s ttft=%.3f/%.3f s tpot=%.4f/%.4f s floor=%.3f",
            job.model,
            job.ttft_s,
            job.slo_ttft_ms / 1000,
            job.tpot_s,
            job.tpot_budget_ms / 1000,
            job.floor_s,
        )
        if self.admission == REJECT or self.queue is None:
            raise OverBudget(
                f"no instance of model {job.model!r} can meet the SLO budget now ({job.over} saturated: predicted TTFT "
                f"{job.ttft_s * 1000:.0f} ms of {job.slo_ttft_ms:.0f} ms, TPOT {job.tpot_s * 1000:.0f} ms of {job.tpot_budget_ms:.0f} ms)",
                job.retry_after_s,
            )
        return None

    def queued(self, job: JobInfo) -> Awaitable[Plan]:
        """Wait in the admission queue until a plan is admitted (or the queue gives up: OverBudget)."""
        return self.queue.wait(job, lambda: self._let_in(job))

    def _let_in(self, job: JobInfo) -> Plan | None:
        """The plan, if SLO admission lets it in now (None: not yet)."""
        plan = self.judged(job)
        return plan if self.admits(job, plan) else None

    def admits(self, job: JobInfo, plan: Plan) -> bool:
        """SLO admission's rule for a judged plan, the same on arrival and in the queue: its verdict, or engines
        with nothing of ours in flight (`_idle`)."""
        return job.feasible is not False or self.admission == OFF or (self._idle(plan) and not job.hopeless)

    def judged(self, job: JobInfo) -> Plan:
        """The plan, its verdict with the headroom a batch request leaves to the higher classes (fairness.py): its
        predicted TTFT and TPOT within BATCH_SHARE of what theirs may be, while such requests come."""
        plan = self.plan(job)
        if job.priority == BATCH and job.feasible and self.admission != OFF and self.fair.higher_class_seen(BATCH):
            left_s = job.slo_ttft_ms / 1000.0 - (clock.now() - job.arrived)
            if (
                job.ttft_s > BATCH_SHARE * MARGIN * left_s
                or job.tpot_s > BATCH_SHARE * TPOT_MARGIN * job.tpot_budget_ms / 1000
            ):
                job.feasible, job.over = False, "batch share"
        return plan

    def _idle(self, plan: Plan) -> bool:
        """Engines with nothing of ours in flight serve a request as well as they ever will: unless even the
        expected times miss the budget, refusing it would help no one, and serving it lets the model learn
        (allowances inflated by a bad moment would otherwise refuse everything, and never see it pass)."""
        return all(
            not self.ledger.requests(t.slot) and not self.ledger.held(t.slot) for t in (plan.prefill, plan.target) if t
        )

    # -- leases and learning ---------------------------------------------------------------------

    def lease(self, t: Target, job: JobInfo, kind: str, learn: bool = True) -> Lease:
        """Take `t`'s load for one leg (PREFILL, DECODE) or a whole request (WHOLE).

        `learn`: its timings can teach the model (a stream's, a prefill's; not a JSON answer's, which has no
        first-token time): it may be a sample, and only such leases use up this worker's turn on the slot.
        """
        if kind == DECODE:
            lease = self.ledger.lease(
                t.slot, 0, job.max_tokens, prefilling=False, kind=DECODE, tpot_budget_s=job.slo_tpot_ms / 1000.0
            )
            lease.predicted_tpot = job.tpot_model_s if job.feasible is not None else 0.0  # what the plan expected
            lease.predicted_batch = job.tpot_batch
            if job.feasible:
                self.ledger.record_verdict_batch(t.slot, job.tpot_batch, lease.started)
        else:
            uncached = self.policy.uncached(t, job)
            job.cached_predicted = job.prompt_tokens - uncached
            idle = not self.ledger.load(t.slot)[3]  # no prefill in flight there: its queue is empty
            tpot_budget_s = job.slo_tpot_ms / 1000.0 if kind == WHOLE else 0.0
            lease = self.ledger.lease(
                t.slot, uncached, 1 if kind == PREFILL else job.max_tokens, kind=kind, tpot_budget_s=tpot_budget_s
            )
            lease.hashes = job.block_hashes
            if self.index is not None:
                self.index.placed(lease, job)
            if kind == WHOLE and job.feasible is not None:
                lease.predicted_tpot, lease.predicted_batch = job.tpot_model_s, job.tpot_batch
                if job.feasible:
                    self.ledger.record_verdict_batch(t.slot, job.tpot_batch, lease.started)
            if self.predictor is not None:
                # A prefill admitted on its verdict may finish as much later as its plan left of its budget (a
                # promise that admission keeps; without admission nothing is promised).
                slack = UNKNOWN
                if job.feasible and self.admission != OFF:
                    left = job.slo_ttft_ms / 1000.0 - (lease.started - job.arrived)
                    slack = MARGIN * left - job.ttft_s
                lease.predicted, lease.shift = self.predictor.start_prefill(
                    t.slot, uncached, lease.started, idle, slack
                )
        lease.batch = self.ledger.requests(t.slot)
        if learn:
            lease.sample = self._sample(t.slot, lease.started)
        return lease

    def _sample(self, slot: int, now: float) -> bool:
        """Is a learnable lease starting now this worker's next sample on `slot` (LEARN_INTERVAL_S)?"""
        if now < self._learn_after.get(slot, 0.0):
            return False
        self._learn_after[slot] = now + self.learn_interval_s
        return True

    def hold(self, t: Target) -> Hold:
        """Promise `t`'s decode batch a place while the request's prefill runs."""
        return self.ledger.hold(t.slot)

    def _prefilled(self, lease: Lease) -> None:
        """A stream's first token arrived: its prompt's blocks are cached on its engine (recorded once)."""
        if self.index is not None:
            self.index.record(lease.hashes, lease.slot)
        lease.hashes = []

    def _observe(self, lease: Lease) -> None:
        """A lease marked successful is being released: learn from its timings."""
        try:
            pred, slot, fit = self.predictor, lease.slot, lease.sample
            if lease.kind == PREFILL or lease.kind == WHOLE:
                if pred is not None and lease.predicted:
                    if lease.kind == PREFILL or lease.first_at:
                        done = lease.ended if lease.kind == PREFILL else lease.first_at
                        tokens = lease.engine_uncached if lease.engine_uncached >= 0 else lease.prompt_tokens
                        pred.learn_prefill(slot, lease.started, done, tokens, lease.predicted, lease.shift, fit)
                    else:  # a JSON answer: its prefill was done by the time the answer was
                        pred.settle_prefill(slot, lease.ended, lease.predicted, lease.shift)
                if self.index is not None and lease.hashes:
                    self.index.record(lease.hashes, slot)
            if fit and pred is not None and lease.kind != PREFILL and lease.first_at:
                span = lease.ended - lease.first_at  # its decode, over which the slot's area grew by its mean batch
                if span > 0.0:
                    batch = (self.ledger.area(slot, lease.ended) - lease.area0) / span
                else:
                    batch = (lease.batch + self.ledger.requests(slot)) / 2.0
                started = lease.started if lease.kind == DECODE else lease.first_at
                let_grow = self.ledger.verdict_batch(slot, lease.started) if lease.predicted_tpot else 0.0
                pred.learn_decode(
                    slot,
                    started,
                    lease.first_at,
                    lease.ended,
                    lease.events,
                    batch,
                    lease.predicted_tpot,
                    lease.predicted_batch,
                    let_grow,
                    (lease.batch, self.ledger.requests(slot)),
                )
        except Exception:  # learning must never fail a request
            log.exception("learning from a finished request failed")
        if self.queue is not None:
            self.queue.poke()

    def _usable(self, pool: list[Target], exclude: frozenset[int], job: JobInfo) -> list[Target]:
        usable, kind = self.health.usable, job.engine_type
        return [
            t
            for t in pool
            if not t.paused and t.slot not in exclude and usable(t.slot) and (kind is None or t.engine_type == kind)
        ]

    def plan(self, job: JobInfo, exclude: frozenset[int] = frozenset(), allow_pd: bool = True) -> Plan:
        job.feasible, job.alone = None, False
        view = self.registry.view()
        model = job.model
        p_pool, d_pool, u_pool = view.pool(model, "prefill"), view.pool(model, "decode"), view.pool(model, "union")
        if allow_pd and p_pool and d_pool:
            ps, ds = self._usable(p_pool, exclude, job), self._usable(d_pool, exclude, job)
            if ps and ds:
                if len(ps) == len(ds) == 1 and self.admission == OFF and not self.policy.decode_alone:
                    return Plan(
                        ps[0], ds[0], self, job
                    )  # nothing to choose between and no verdict wanted: no predictions
                p, d = self.policy.choose_pair(ps, ds, job)
                return Plan(p, d, self, job, job.alone)
            if not self.live.s.enable_pd_separation_fallback_to_hybrid:
                raise NoCapacity(
                    f"no usable prefill/decode pair of model {model!r} "
                    "(enable_pd_separation_fallback_to_hybrid is false: no whole requests)"
                )
            whole = self._usable(u_pool, exclude, job) or ps or ds
        else:
            whole = (
                self._usable(u_pool, exclude, job)
                or self._usable(p_pool, exclude, job)
                or self._usable(d_pool, exclude, job)
            )
        if not whole:
            raise NoCapacity(f"no healthy instance of model {model!r} is available")
        if len(whole) == 1 and self.admission == OFF:
            return Plan(None, whole[0], self, job)
        return Plan(None, self.policy.choose_whole(whole, job), self, job)

    def pick(self, job: JobInfo, roles: tuple[str, ...], pinned: bool = False, learn: bool = True) -> Leg:
        """A single-engine call on one engine of `roles` (the first role that has a usable one; NoCapacity:
        none), retried among them (count_tokens), or on the same engine when `pinned` (a metaserver call)."""
        return Leg(self, job, WHOLE, self.pick_one(job.model, job, roles), PINNED if pinned else roles, learn)

    def pin(self, target: Target, job: JobInfo, learn: bool = True) -> Leg:
        """A whole-request call to `target` that its retries keep (a metaserver call names its engine)."""
        return Leg(self, job, WHOLE, target, PINNED, learn)

    def pick_one(
        self, model: str, job: JobInfo, roles: tuple[str, ...], exclude: frozenset[int] = frozenset()
    ) -> Target:
        """One engine of the model, preferring roles in order (count_tokens, metaserver)."""
        view = self.registry.view()
        for role in roles:
            cands = self._usable(view.pool(model, role), exclude, job)
            if cands:
                return self.policy.choose(cands, job)
        raise NoCapacity(f"no healthy instance of model {model!r} is available")


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (RoundRobin, LoadBalance, KvCacheAffinity, SloAware)}


def make_policy(name: str, shared, ledger: Ledger, health: Health, **model) -> Policy:
    """The policy named by scheduler_type; `model` passes predictor, index, block_tokens, overload_factor."""
    return POLICIES.get(name, LoadBalance)(shared, ledger, health, **model)


def prefix_source(settings, shared) -> PrefixSource:
    """Where cached prefixes come from: the engines' KV events (with the estimate for prompts whose ids are not
    known), or the estimate alone."""
    estimate = PrefixIndex(shared, settings.kv_affinity_block_size)
    if settings.kv_events.enable:
        return KvEventSource(KvIndex(shared), estimate)
    return estimate


def build_scheduler(live: Live, shared, registry: Registry, ledger: Ledger, health: Health) -> Scheduler:
    """The scheduler the live settings describe, on the shared learned model and prefix index."""
    settings = live.s  # its policy and admission need a restart (config.live); the rest it reads live
    policy = make_policy(
        settings.scheduler_type,
        shared,
        ledger,
        health,
        predictor=Predictor(shared, settings.slo_confidence),
        index=prefix_source(settings, shared),
        block_tokens=settings.kv_affinity_block_size,
        overload_factor=settings.affinity_overload_factor,
        decode_alone=settings.conditional_disaggregation,
    )
    queue = None
    if settings.admission == "queue":
        queue = AdmissionQueue(
            shared, settings.admission_queue_size, worker=ledger.worker, num_workers=settings.num_workers
        )
    return Scheduler(registry, ledger, health, policy, admission=settings.admission, queue=queue, live=live)
