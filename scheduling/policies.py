"""Instance selection policies (`scheduler_config.scheduler_type`); the registry of them is scheduling/scheduler.py's.

A policy gets the usable candidates of one role and the request's `JobInfo` and returns one target;
`choose_pair` picks a prefill and a decode target together. Every policy reads only shared counters
(the ledger, the health table with the engines' scraped gauges, the learned model, the cached prefixes of a
`PrefixSource`), so its choice costs microseconds and every worker chooses from the same picture.

* `round_robin`: one rotating counter shared by all workers (a pair takes one step of it).
* `load_balance`: least load: our in-flight requests and tokens plus the engine's own queue and KV use.
* `kv_cache_affinity`: the prefill goes to the instance that most recently came to hold the prompt's longest
  cached prefix (as its `PrefixSource` says: the Coordinator's estimate, by chained block hashes over the whole
  rendered prompt, or the engines' own KV events, scheduling/kv_index.py), unless that instance's load exceeds
  `affinity_overload_factor` times what the least loaded one's would be with this request; decode by load. On
  the engines' events it tells a conversation's next turn (its cached prefix its own history) from a new one
  (a prefix other conversations share, or none): the first stays with its history unless load alone says
  otherwise, the second goes where fewer conversations' futures will fill the cache.
* `slo_aware` (scheduling/slo_aware.py): the pair predicted to meet the TTFT and TPOT budgets, from the learned
  model; on the engines' KV events it places conversations as `kv_cache_affinity` does among the plans on time.

Every plan carries a verdict (`JobInfo.feasible`): True or False when the model can judge the chosen
pair against the budgets, None when it cannot yet; SLO admission (scheduling/admission.py) acts on it.
"""

from __future__ import annotations

from scheduling import clock
from scheduling.health import Health
from scheduling.job import JobInfo, PrefixSource
from scheduling.ledger import Ledger
from scheduling.predict import UNKNOWN, Predictor
from scheduling.registry import Target
from state.shared import SharedState

# A plan meets its budget when its predicted TTFT and TPOT, allowances included, are within these shares
# of it: room for what the allowances miss (the Coordinator's own delays, sudden load).
MARGIN = 0.85
TPOT_MARGIN = 0.85
# A load score's units: one request, or this many prompt tokens to prefill, or this many output tokens to
# decode (the engine's own queue counts in requests, its KV use up to 4.0).
PROMPT_TOKENS_PER_LOAD = 2048.0
OUTPUT_TOKENS_PER_LOAD = 8192.0
# `kv_cache_affinity` counts a full prefix cache as this much load: the weight `load_balance` gives the
# engine's KV use (the same memory).
CACHE_FILL_WEIGHT = 4.0


class Policy:
    name = "base"
    uses_prefix = False  # reads the prompt's cached prefixes

    def __init__(
        self,
        shared: SharedState,
        ledger: Ledger,
        health: Health,
        predictor: Predictor | None = None,
        index: PrefixSource | None = None,
        block_tokens: int = 16,
        overload_factor: float = 2.0,
        decode_alone: bool = False,
    ):
        self.shared, self.ledger, self.health = shared, ledger, health
        self.predictor = predictor
        self.index = index  # where cached prefixes come from (None: none is ever cached)
        self.block_tokens = block_tokens
        self.overload_factor = overload_factor
        self.decode_alone = decode_alone  # conditional disaggregation (slo_aware; `conditional_disaggregation`)

    def choose(self, cands: list[Target], job: JobInfo) -> Target:
        raise NotImplementedError

    def choose_pair(self, ps: list[Target], ds: list[Target], job: JobInfo) -> tuple[Target, Target]:
        p, d = self.choose(ps, job), self.choose(ds, job)
        self.judge(p, d, job)
        return p, d

    def choose_whole(self, cands: list[Target], job: JobInfo) -> Target:
        """One engine serves the request whole."""
        t = self.choose(cands, job)
        self.judge(None, t, job)
        return t

    def uncached(self, t: Target, job: JobInfo) -> int:
        """The prompt tokens `t` must compute: those of its longest cached prefix are free."""
        memo = job.cached.get(t.slot)
        if memo is None:
            cached = self.index.cached_tokens(job, t) if self.index is not None else 0
            memo = job.cached[t.slot] = min(cached, job.prompt_tokens - 1) if cached else 0
        return job.prompt_tokens - memo

    # -- predictions ---------------------------------------------------------------------------

    def decode_batch(self, t: Target, delay: float) -> float:
        """Sequences `t` will be decoding when a request joins in `delay` seconds, itself included.

        A decode lasts about L = (mean output budget) x (current step time). Of the requests decoding now,
        1 - delay / L are still running after `delay` (their progress spread evenly). Requests promised to
        `t` (prefilling now) start decoding at times spread over the next `delay` seconds, so min(1, L /
        delay) of them are still running when this one joins.
        """
        ours = self.ledger.requests(t.slot)
        held = self.ledger.held(t.slot)
        running, waiting, _ = self.health.engine_load(t.slot)
        # The engine may serve more than we sent it (other clients, a scrape older than our last completions).
        requests = int(running + waiting) if running + waiting > ours else ours
        if delay <= 0.0 or not (requests or held):
            return requests + held + 1.0
        length = self.stream_s(t, self.joined_step(t, requests + held)[0])
        running = requests * (1.0 - delay / length) if delay < length else 0.0
        promised = held * (length / delay) if delay > length else float(held)
        return running + promised + 1.0

    def stream_s(self, t: Target, step: float) -> float:
        """How long a stream on `t` lasts at `step` seconds a token: the mean output of our own requests there
        (those the engine runs beyond ours: like ours); without any, a typical one, never none (that would end the
        promised requests' decodes before they start)."""
        ours, _, decode_tokens, _ = self.ledger.load(t.slot)
        return (decode_tokens / ours if ours else 256.0) * step

    def joined_step(self, t: Target, batch: float) -> tuple[float, float]:
        """(seconds per decode step, seconds waiting for a place in the batch) of a sequence joining `t`'s batch of
        `batch` (itself included). An engine runs at most so many sequences at once (`seq_cap`, seen in its
        gauges: vLLM's max_num_seqs, or what its KV cache holds); those past it wait, and one of the running
        leaves every stream's life / cap, while the step stays the cap's."""
        cap = self.health.get(t.slot, "seq_cap")
        if not cap or batch <= cap:
            return self.predictor.step_s(t.slot, batch), 0.0
        step = self.predictor.step_s(t.slot, cap)
        if step == UNKNOWN:
            return UNKNOWN, 0.0
        return step, (batch - cap) * self.stream_s(t, step) / cap

    def predict_decode(self, d: Target, delay: float = 0.0) -> tuple[float, float, float, float]:
        """(seconds per token, seconds from the decode leg's start to its first token, the batch it joins, the part
        of those seconds it waits for a place in the batch) for a request whose decode leg starts in `delay`
        seconds."""
        pred = self.predictor
        batch = self.decode_batch(d, delay)
        tpot, wait = self.joined_step(d, batch)
        if tpot == UNKNOWN:
            return UNKNOWN, UNKNOWN, batch, 0.0
        busy = pred.prefill_busy(d.slot, clock.now())
        if busy > 0.0:  # prompts computed there (requests served whole or alone) take steps from its streams
            tpot /= 1.0 - busy if busy < 0.9 else 0.1
        return tpot, pred.first_wait_s(d.slot) + wait + tpot, batch, wait

    def predict_prefill(self, p: Target, job: JobInfo, now: float) -> tuple[float, float, float, bool]:
        """(seconds until `p` would finish this prompt's prefill, the same without queueing, the engine's
        allowance for prediction errors, whether it would make a prefill admitted there late): the first two
        are expected values, the allowance is what a judgement against a budget adds to them."""
        pred, slot = self.predictor, p.slot
        service = pred.prefill_s(slot, self.uncached(p, job))
        if service == UNKNOWN:
            return UNKNOWN, UNKNOWN, 0.0, False
        _, tokens, _, prefilling = self.ledger.load(slot)
        wait = 0.0  # no prefill of ours in flight there: whatever the virtual queue says, nothing of ours waits
        if prefilling:
            # The virtual queue, but never more than the work of ours still in flight there (the ledger's
            # uncached tokens of the prefills not done yet): the queue's end drifts, the ledger does not.
            wait = min(pred.queue_wait_s(slot, now), pred.prefill_s(slot, tokens))
        foreign = self.health.engine_load(slot)[1] - prefilling  # waiting there beyond ours (as last scraped)
        if foreign >= 1.0:
            wait += foreign * pred.mean_step_s(slot)
        # Its own step counted even behind others (an engine step may just have begun), and stretched by the
        # prompts that join it while it waits.
        finish = wait + pred.batch_wait_s(slot, wait, now) + service
        breaks = prefilling > 0 and pred.breaks_promise(slot, now + wait, now + finish, now)
        return finish, service, pred.allowance_s(slot, finish, now), breaks

    def judge(self, p: Target | None, d: Target, job: JobInfo) -> None:
        """Set the job's verdict for this plan (p None: one engine serves the request whole)."""
        job.feasible = None
        if self.predictor is None:
            return
        now = clock.now()
        finish, service, allowance, breaks = self.predict_prefill(p or d, job, now)
        if finish == UNKNOWN:
            return
        tpot, first, batch, full = self.predict_decode(d, finish if p is not None else 0.0)
        if tpot == UNKNOWN:
            return
        extra = tpot + full if p is None else first
        tpot_allowance = self.predictor.tpot_allowance_s(d.slot, tpot, now)
        self._verdict(
            job, d.slot, finish + allowance + extra, tpot, service + extra, tpot_allowance, breaks, batch, full
        )

    def tpot_budget_s(self, job: JobInfo, slot: int) -> float:
        """The TPOT budget a plan decoding on `slot` is judged against: the request's own, or the tightest of the
        streams decoding there (joining their batch slows them as much as it)."""
        own = job.slo_tpot_ms / 1000.0
        floor = self.ledger.tpot_floor_s(slot)
        return floor if floor < own - 1e-6 else own  # (the floor is kept in whole microseconds)

    def _verdict(
        self,
        job: JobInfo,
        slot: int,
        ttft: float,
        tpot: float,
        floor: float,
        tpot_allowance: float = 0.0,
        breaks: bool = False,
        batch: float = 0.0,
        full: float = 0.0,
    ) -> None:
        """`slot`: the decode engine's. `breaks`: the prefill would make one admitted before it late (a plan over
        its TTFT budget, as far as admission goes: it waits or is refused until that prefill's last step has
        begun). `batch`: the decode batch its TPOT was predicted for (0: not told). `full`: the seconds of `ttft`
        it waits for a place in the decode engine's batch (a plan late for them alone saturates the decode
        stage, not the prefill's)."""
        ttft_budget = job.slo_ttft_ms / 1000.0 - (clock.now() - job.arrived)
        tpot_budget = self.tpot_budget_s(job, slot)
        job.tpot_budget_ms = tpot_budget * 1000.0
        job.tpot_model_s, job.tpot_batch = tpot, batch
        tpot += tpot_allowance
        job.ttft_s, job.tpot_s, job.floor_s = ttft, tpot, floor
        late, slow = breaks or ttft > MARGIN * ttft_budget, tpot > TPOT_MARGIN * tpot_budget
        job.feasible = not late and not slow
        if late and not breaks and ttft - full <= MARGIN * ttft_budget:  # late only for a place in D's batch
            late, slow = False, True
        job.over = "prefill and decode" if late and slow else "prefill" if late else "decode" if slow else ""
        # (The engine's latency standing in for an unknown decode line was measured at some other batch: it cannot
        # say that even an idle engine misses the TPOT budget.)
        job.hopeless = floor > ttft_budget or (
            job.tpot_model_s > job.slo_tpot_ms / 1000.0 and self.predictor.decode_fitted(slot)
        )
        if not job.feasible:
            job.retry_after_s = max(1.0, ttft - MARGIN * ttft_budget)


class RoundRobin(Policy):
    """Rotate through the candidates with one counter shared by every worker."""

    name = "round_robin"

    def _next(self) -> int:
        g = self.shared.globals
        n = g.rr
        g.rr = n + 1
        return n

    def choose(self, cands: list[Target], job: JobInfo) -> Target:
        return cands[self._next() % len(cands)]

    def choose_pair(self, ps: list[Target], ds: list[Target], job: JobInfo) -> tuple[Target, Target]:
        n = self._next()  # one step per request, so P and D each rotate through their own pool
        p, d = ps[n % len(ps)], ds[n % len(ds)]
        self.judge(p, d, job)
        return p, d


class LoadBalance(Policy):
    """Least load: the ledger's in-flight requests and tokens, plus the engine's own queue from /metrics."""

    name = "load_balance"

    def score(self, t: Target) -> float:
        requests, prompt_tokens, decode_tokens, _ = self.ledger.load(t.slot)
        running, waiting, kv_usage = self.health.engine_load(t.slot)
        # Our own in-flight count is exact and fresh; the engine's waiting queue covers traffic that
        # does not come through this Coordinator. Prompt tokens weigh the prefill work ahead.
        return (
            requests
            + waiting
            + prompt_tokens / PROMPT_TOKENS_PER_LOAD
            + decode_tokens / OUTPUT_TOKENS_PER_LOAD
            + 4.0 * kv_usage
        )

    @staticmethod
    def weight(job: JobInfo) -> float:
        """What `job` itself would add to a score."""
        return 1.0 + job.prompt_tokens / PROMPT_TOKENS_PER_LOAD + job.max_tokens / OUTPUT_TOKENS_PER_LOAD

    def choose(self, cands: list[Target], job: JobInfo) -> Target:
        return self.least(cands, self.score)

    def least(self, cands: list[Target], score) -> Target:
        """The candidate with the lowest `score(target)`; ties go to the first from a rotating offset."""
        if len(cands) == 1:
            return cands[0]
        g = self.shared.globals
        start = g.rr
        g.rr = start + 1
        n = len(cands)
        best, best_score = None, float("inf")
        for k in range(n):  # start at a rotating offset so ties spread evenly
            t = cands[(start + k) % n]
            s = score(t)
            if s < best_score:
                best, best_score = t, s
        return best


class KvCacheAffinity(LoadBalance):
    """Prefill where the prompt's longest prefix was prefilled last, unless that instance is overloaded; on the
    engines' KV events, a new conversation where its future turns fit."""

    name = "kv_cache_affinity"
    uses_prefix = True

    def choose(self, cands: list[Target], job: JobInfo) -> Target:
        if len(cands) == 1 or self.index is None:
            return super().choose(cands, job)
        # A full prefix cache evicts some conversation's history for each block it stores, one with room
        # nothing: each engine's cache fill weighs like its KV use does.
        fills = self.cache_fills(cands)
        load = {}
        for t in cands:
            held, size = fills[t.slot]
            load[t.slot] = self.score(t) + (CACHE_FILL_WEIGHT * min(held / size, 1.0) if size else 0.0)

        def score(t: Target) -> float:
            return load[t.slot]

        best, holders = self.holders(cands, job)
        starts = self.conversation(cands, job, best, holders)
        target = holders[0] if holders else None
        if len(holders) > 1:
            # Equal holders (a shared system prompt on each): the estimate's most recent one, else the least
            # loaded, so new conversations spread instead of piling onto the first engine's cache.
            last = self.index.last_holder(job, best)
            target = next((t for t in holders if t.slot == last), None) or self.least(holders, score)
        # On the engines' events, a conversation's next turn stays with its history, and a new one (nothing held
        # but a prefix several chains share) goes where its future turns fit, then the overload rule, on load.
        if starts:
            future = self.opening(cands, job, fills)
            if future is not None:
                target = self.least(cands, future)
                return self.least(cands, self.score) if self._overloaded(target, cands, job, self.score) else target
        if target is None or self._overloaded(target, cands, job, score):
            return self.least(cands, score)
        if starts is False:
            self.index.kept(job, target, best)  # a running conversation stays with its history
        return target

    def _overloaded(self, target: Target, cands: list[Target], job: JobInfo, load) -> bool:
        """Leaving the holder recomputes the prefix elsewhere, and an engine batching continuously serves a few
        requests about as soon as one: the holder is overloaded only when its `load` exceeds the factor times what
        the least loaded engine would carry with this request on it (at idle, that many requests like it)."""
        return load(target) > self.overload_factor * (min(map(load, cands)) + self.weight(job))

    def choose_pair(self, ps: list[Target], ds: list[Target], job: JobInfo) -> tuple[Target, Target]:
        p, d = self.choose(ps, job), LoadBalance.choose(self, ds, job)
        self.judge(p, d, job)
        return p, d

    def cache_fills(self, cands: list[Target]) -> dict[int, tuple[int, int]]:
        """Each candidate's prefix cache: (blocks it holds, its size in blocks). The size is what the engine's
        /metrics says, else what it held when it first evicted, else the largest known (engines of a role alike)."""
        fills = {}
        for t in cands:
            held, size = self.index.cache_fill(t)
            fills[t.slot] = held, int(self.health.get(t.slot, "cache_blocks")) or size
        largest = max(size for _, size in fills.values())
        return {slot: (held, size or largest) for slot, (held, size) in fills.items()}

    def holders(self, cands: list[Target], job: JobInfo) -> tuple[int, list[Target]]:
        """The prompt's longest cached prefix in tokens and the candidates holding it (none when nothing is)."""
        best, holders = 0, []
        for t in cands:
            tokens = self.index.cached_tokens(job, t)
            if tokens > best:
                best, holders = tokens, [t]
            elif tokens == best and tokens:
                holders.append(t)
        return best, holders

    def conversation(self, cands: list[Target], job: JobInfo, best: int, holders: list[Target]) -> bool | None:
        """Whether `job` starts a conversation (True) or continues the history its holder has (False), as the
        engines' events judge it (None: they cannot; a history is on one engine at most). Marks `job.opens` when it
        starts one, wherever it goes: until its blocks are stored, the engine it is sent to counts it among its
        conversations."""
        verdicts = [self.index.starts(job, t, best) for t in holders or cands[:1]]
        starts = None if None in verdicts else any(verdicts)
        if starts and holders:
            # Held no further than a shared prefix, it may yet be the next turn of a short first one (no full block
            # past that prefix shows where it went): if this worker sent that turn to a holder, it continues there
            # (`holders` becomes that one).
            back = self.index.previous_turn(job, best)
            holders[:] = [t for t in holders if t.slot == back] or holders
            starts = holders[0].slot != back
        job.opens = starts is True
        return starts

    def opening(self, cands: list[Target], job: JobInfo, fills: dict[int, tuple[int, int]]):
        """How full each candidate's cache will be with this new conversation's future turns on it, as a score
        (None: the conversations an engine holds are not known): (the conversations it holds + 1) x the blocks they
        hold each, over its size, weighed like a full cache, plus the prefill of the prompt (what it holds is
        free)."""
        chains = {t.slot: self.index.chains(t) for t in cands}
        if min(chains.values()) < 0:
            return None
        total_chains = sum(chains.values())
        total_held = sum(held for held, _ in fills.values())
        per_chain = total_held / total_chains if total_chains else 0.0

        def future(t: Target) -> float:
            held, size = fills[t.slot]
            n = chains[t.slot]
            mean = held / n if n else per_chain
            return self.uncached(t, job) / PROMPT_TOKENS_PER_LOAD + CACHE_FILL_WEIGHT * (n + 1) * mean / (
                size or total_held or 1
            )

        return future
