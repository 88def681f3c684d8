"""Instance selection policies (`scheduler_config.scheduler_type`).

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
* `slo_aware`: predicts each candidate's TTFT (queue wait + uncached prefill + the decode engine's first
  step) and TPOT (the decode engine's step time with the batch it will have when this request joins)
  from the learned model (scheduling/predict.py), and takes the decode engine with the lowest predicted
  TPOT (preferring those within budget) and the prefill engine that finishes soonest, each with its
  learned allowance for prediction errors. A cached prefix lowers a candidate's uncached tokens, so
  affinity is a lower prefill cost, not a rule; a faster or less busy engine is a sooner finish, so the
  pair chosen is also the one that spends the least capacity on the request. A prefill engine where the
  prompt would make a prefill admitted before it late (scheduling/predict.py's promises) is chosen only when
  every one is, and then the plan is over budget. On the engines' KV events, of the plans on time and judged
  no worse than the soonest, a conversation's next turn stays with its history and a new conversation goes
  where its future turns fit, as `kv_cache_affinity` places them: leaving a history computes it again and holds
  it twice, evicting other conversations' histories, which no first-token prediction sees. Before the model knows a
  candidate it is tried once while idle (by a request served whole only if it streams: a JSON answer teaches no
  first token), else the prefill goes where `kv_cache_affinity` would place it on KV events, or to the least
  loaded. A request late on every prefill
  engine goes to the one that finishes last (behind work that is late already). With `decode_alone`
  (`conditional_disaggregation`) each decode engine is also judged serving the request alone, computing
  the prompt itself (`_pick_alone`), and is chosen when that is clearly sooner within both budgets.

Every plan carries a verdict (`JobInfo.feasible`): True or False when the model can judge the chosen
pair against the budgets, None when it cannot yet; SLO admission (scheduling/admission.py) acts on it.
"""

from __future__ import annotations

from scheduling import clock
from scheduling.health import Health
from scheduling.job import JobInfo, PrefixSource
from scheduling.ledger import Ledger
from scheduling.predict import BUSY_WINDOW_S, UNKNOWN, Predictor
from scheduling.registry import Target
from state.shared import SharedState

# A plan meets its budget when its predicted TTFT and TPOT, allowances included, are within these shares
# of it: room for what the allowances miss (the Coordinator's own delays, sudden load).
MARGIN = 0.85
TPOT_MARGIN = 0.85
# Predictions within 5 % (plus 2 ms for a TTFT, 0.5 ms for a TPOT) of the best are ties; ties go to the
# first candidate in an order that rotates with every request, so equal idle engines share the traffic.
TIE = 0.05
# Conditional disaggregation tries a decode engine whose prefill speed it does not know yet with prompts up
# to this size (a few requests, until it knows): a longer one would stall the streams decoding there.
EXPLORE_ALONE_TOKENS = 512
# A prefill served on a decode engine may delay the streams there by at most what their predicted TPOT
# leaves of this many tokens' budget (a stream's TPOT is its mean over its tokens).
ALONE_STALL_TOKENS = 2
# ... and it goes there only with a prompt at most this many times the mean of those computed there so far:
# a speed learned from short prompts says little about a long one's.
ALONE_EXTRAPOLATION = 4.0
# A load score's units: one request, or this many prompt tokens to prefill, or this many output tokens to
# decode (the engine's own queue counts in requests, its KV use up to 4.0).
PROMPT_TOKENS_PER_LOAD = 2048.0
OUTPUT_TOKENS_PER_LOAD = 8192.0
# `kv_cache_affinity` counts a full prefix cache as this much load: the weight `load_balance` gives the
# engine's KV use (the same memory).
CACHE_FILL_WEIGHT = 4.0


def _clearly_less(a: float, b: float, absolute: float) -> bool:
    return a < b - TIE * b - absolute


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
        ours, _, decode_tokens, _ = self.ledger.load(t.slot)
        held = self.ledger.held(t.slot)
        running, waiting, _ = self.health.engine_load(t.slot)
        # The engine may serve more than we sent it (other clients, a scrape older than our last completions).
        requests = int(running + waiting) if running + waiting > ours else ours
        if delay <= 0.0 or not (requests or held):
            return requests + held + 1.0
        step = self.predictor.step_s(t.slot, requests + held)
        # The mean output of our own requests there (those the engine runs beyond ours: like ours); without any,
        # a typical one, never none (that would end the promised requests' decodes before they start).
        length = (decode_tokens / ours if ours else 256.0) * step
        running = requests * (1.0 - delay / length) if delay < length else 0.0
        promised = held * (length / delay) if delay > length else float(held)
        return running + promised + 1.0

    def predict_decode(self, d: Target, delay: float = 0.0) -> tuple[float, float]:
        """(seconds per token, seconds from the decode leg's start to its first token) for a request whose
        decode leg starts in `delay` seconds."""
        pred = self.predictor
        tpot = pred.step_s(d.slot, self.decode_batch(d, delay))
        if tpot == UNKNOWN:
            return UNKNOWN, UNKNOWN
        busy = pred.prefill_busy(d.slot, clock.now())
        if busy > 0.0:  # prompts computed there (requests served whole or alone) take steps from its streams
            tpot /= 1.0 - busy if busy < 0.9 else 0.1
        return tpot, pred.first_wait_s(d.slot) + tpot

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
        tpot, first = self.predict_decode(d, finish if p is not None else 0.0)
        if tpot == UNKNOWN:
            return
        extra = tpot if p is None else first
        tpot_allowance = self.predictor.tpot_allowance_s(d.slot, tpot, now)
        self._verdict(job, finish + allowance + extra, tpot, service + extra, tpot_allowance, breaks)

    def _verdict(
        self, job: JobInfo, ttft: float, tpot: float, floor: float, tpot_allowance: float = 0.0, breaks: bool = False
    ) -> None:
        """`breaks`: the prefill would make one admitted before it late (a plan over its TTFT budget, as far as
        admission goes: it waits or is refused until that prefill's last step has begun)."""
        ttft_budget = job.slo_ttft_ms / 1000.0 - (clock.now() - job.arrived)
        tpot_budget = job.slo_tpot_ms / 1000.0
        job.tpot_model_s = tpot
        tpot += tpot_allowance
        job.ttft_s, job.tpot_s, job.floor_s = ttft, tpot, floor
        late, slow = breaks or ttft > MARGIN * ttft_budget, tpot > TPOT_MARGIN * tpot_budget
        job.feasible = not late and not slow
        job.over = "prefill and decode" if late and slow else "prefill" if late else "decode" if slow else ""
        job.hopeless = floor > ttft_budget or job.tpot_model_s > tpot_budget
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
        target = holders[0] if holders else None
        if len(holders) > 1:
            # Equal holders (a shared system prompt on each): the estimate's most recent one, else the least
            # loaded, so new conversations spread instead of piling onto the first engine's cache.
            last = self.index.last_holder(job, best)
            target = next((t for t in holders if t.slot == last), None) or self.least(holders, score)
        # On the engines' events, a conversation's next turn stays with its history, and a new one (nothing held
        # but a prefix several chains share) goes where its future turns fit, then the overload rule, on load.
        starts = self.conversation(cands, job, best, holders)
        job.opens = False
        if starts:
            future = self.opening(cands, job, fills)
            if future is not None:
                job.opens = True
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
        engines' events judge it (None: they cannot; a history is on one engine at most)."""
        verdicts = [self.index.starts(job, t, best) for t in holders or cands[:1]]
        return None if None in verdicts else any(verdicts)

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


class SloAware(KvCacheAffinity):
    """The pair predicted to meet the TTFT and TPOT budgets (see the module docstring)."""

    name = "slo_aware"
    uses_prefix = True

    def _explore(self, cands: list[Target], known, start: int) -> Target | None:
        """An idle candidate the model does not know yet (so it learns it), if any; rotating, so that engines
        it never learns (whole requests that do not stream teach nothing) still share the traffic."""
        n = len(cands)
        for k in range(n):
            t = cands[(start + k) % n]
            if not known(t.slot) and not self.ledger.requests(t.slot) and not self.ledger.held(t.slot):
                return t
        return None

    def _rotation(self) -> int:
        g = self.shared.globals
        start = g.rr
        g.rr = start + 1
        return start

    @property
    def sees_conversations(self) -> bool:
        """Whether the prefix source tells a conversation's next turn from a new one (the engines' KV events)."""
        return self.index is not None and self.index.tells_conversations

    def _unjudged(self, cands: list[Target], job: JobInfo) -> Target:
        """Where a request goes that the model cannot judge (an engine not known yet; union engines serving only
        JSON answers, which teach no first-token time): where `kv_cache_affinity` places it when the engines'
        events tell conversations apart, else the least loaded."""
        if self.sees_conversations:
            return KvCacheAffinity.choose(self, cands, job)
        return LoadBalance.choose(self, cands, job)

    def _by_cache(self, cands: list[Target], job: JobInfo, fits: list[Target]) -> Target | None:
        """Of `fits` (the candidates on time, and judged no worse than the soonest), the one the engines' caches
        prefer: a conversation's next turn stays with its history, a new conversation goes where its future turns
        fit (as `kv_cache_affinity` places it). None: no such choice (one candidate, or the events cannot tell).
        Leaving a history computes it again and holds it twice, which the first token's prediction does not
        see: it evicts other conversations' histories."""
        if len(fits) < 2:
            return None
        best, holders = self.holders(cands, job)
        starts = self.conversation(cands, job, best, holders)
        if starts is False:
            kept = next((t for t in fits if t.slot == holders[0].slot), None)
            if kept is not None:
                self.index.kept(job, kept, best)
            return kept
        if starts:
            future = self.opening(cands, job, self.cache_fills(cands))
            if future is not None:
                return self.least(fits, future)
        return None

    def _pick_decode(self, ds: list[Target], job: JobInfo, delay: float, start: int, now: float) -> tuple | None:
        """(target, TPOT, first-token wait, TPOT allowance) of the decode target with the lowest predicted TPOT
        (allowance included), preferring those within the budget, among those the model knows (None: none)."""
        budget = TPOT_MARGIN * job.slo_tpot_ms / 1000.0
        best = None
        n = len(ds)
        for k in range(n):
            d = ds[(start + k) % n]
            tpot, first = self.predict_decode(d, delay)
            if tpot == UNKNOWN:
                continue
            allowance = self.predictor.tpot_allowance_s(d.slot, tpot, now)
            over = tpot + allowance > budget
            if best is None or over < best[0] or (over == best[0] and _clearly_less(tpot + allowance, best[1], 0.0005)):
                best = (over, tpot + allowance, d, tpot, first, allowance)
        return best[2:] if best is not None else None

    def _pick_prefill(
        self, ps: list[Target], job: JobInfo, now: float, start: int
    ) -> tuple[Target, float, float, float, bool] | None:
        """The prefill target that finishes first, allowance included, preferring those where it makes no prefill
        admitted before it late: (it, its expected finish, its allowance, the least expected service time of
        any, whether it makes one late). When even the first would finish after the TTFT budget, the one that
        finishes last: there it delays only requests that are late already."""
        best = latest = None
        floor = UNKNOWN
        n = len(ps)
        plans = {}
        for k in range(n):
            p = ps[(start + k) % n]
            finish, service, allowance, breaks = self.predict_prefill(p, job, now)
            if finish == UNKNOWN:
                continue
            plans[p.slot] = (p, finish, allowance, breaks)
            if (
                best is None
                or breaks < best[3]
                or (breaks == best[3] and _clearly_less(finish + allowance, best[1] + best[2], 0.002))
            ):
                best = (p, finish, allowance, breaks)
            if latest is None or finish > latest[1]:
                latest = (p, finish, allowance, breaks)
            floor = min(floor, service)
        if best is None:
            return None
        left = job.slo_ttft_ms / 1000.0 - (now - job.arrived)
        cached = None
        if self.sees_conversations:
            fits = [
                p
                for p, finish, allowance, breaks in plans.values()
                if breaks <= best[3] and finish + allowance <= MARGIN * left
            ]
            cached = self._by_cache(ps, job, fits)
        if cached is not None:
            best = plans[cached.slot]
        elif best[1] > left:
            # Late wherever it goes: where it delays the fewest requests that can still be on time, behind
            # the work that is late already (without admission it is served all the same).
            best = latest
        return best[0], best[1], best[2], floor, best[3]

    def choose_pair(self, ps: list[Target], ds: list[Target], job: JobInfo) -> tuple[Target, Target]:
        pred = self.predictor
        job.feasible = None
        start, now = self._rotation(), clock.now()
        p_pick = self._pick_prefill(ps, job, now, start)
        d_pick = self._pick_decode(ds, job, p_pick[1], start, now) if p_pick is not None else None
        # An engine the model does not know yet takes the request while it is idle, so that it learns it (the
        # request is not judged); otherwise the known engines are judged, whatever the others.
        p_new, d_new = self._explore(ps, pred.prefill_known, start), self._explore(ds, pred.decode_known, start)
        judged = d_pick is not None and d_new is None
        d = d_pick[0] if judged else d_new or LoadBalance.choose(self, ds, job)
        if p_pick is None or p_new is not None:
            return p_new or self._unjudged(ps, job), d
        if not judged:
            return p_pick[0], d
        p, finish, allowance, floor, breaks = p_pick
        _, tpot, first, tpot_allowance = d_pick
        ttft = finish + allowance + first
        if self.decode_alone:
            alone = self._pick_alone(ds, job, now, start, ttft)
            if alone is not None:
                d, ttft_alone, tpot, floor, tpot_allowance = alone
                job.alone = True
                if ttft_alone == UNKNOWN:  # learning what D's prefill costs: no verdict on it yet
                    return p, d
                self._verdict(job, ttft_alone, tpot, floor, tpot_allowance)
                return p, d
        self._verdict(job, ttft, tpot, floor + first, tpot_allowance, breaks)
        return p, d

    def _pick_alone(self, ds: list[Target], job: JobInfo, now: float, start: int, ttft_pd: float) -> tuple | None:
        """The decode engine that would serve the request alone (computing the prompt itself) when that is
        predicted to give a clearly sooner first token than the pair (`ttft_pd`) within both budgets: (it,
        its TTFT with allowance, its TPOT, the TTFT floor, the TPOT allowance); None: the pair serves.

        Its prefill runs in the decode engine's steps, which costs the streams decoding there twice: once at
        once (every one of them waits for it, and for the prefills before it there: at most what their TPOT
        leaves of ALONE_STALL_TOKENS tokens' budget), and over time (the share of the engine's time spent
        prefilling lengthens every step it does not spend decoding). So only short or mostly cached prompts
        go to a busy decode engine. One whose prefill speed is not known yet is tried with a short prompt
        while it prefills nothing and its streams have room (an UNKNOWN TTFT), so that the model learns it.
        """
        pred, best = self.predictor, None
        tpot_budget = TPOT_MARGIN * job.slo_tpot_ms / 1000.0
        ttft_budget = MARGIN * (job.slo_ttft_ms / 1000.0 - (now - job.arrived))
        n = len(ds)
        for k in range(n):
            d = ds[(start + k) % n]
            step = pred.step_s(d.slot, self.decode_batch(d, 0.0))
            if step == UNKNOWN:
                continue
            busy = pred.prefill_busy(d.slot, now)
            if pred.prefill_known(d.slot) and self.uncached(d, job) > ALONE_EXTRAPOLATION * pred.mean_prefill_tokens(
                d.slot
            ):  # its prefill speed there is known for prompts of the sizes computed there so far
                continue
            finish, service, allowance, breaks = self.predict_prefill(d, job, now)
            if breaks:  # it would make a prompt admitted there before it late
                continue
            # What its streams lose: the prompt's tokens (the fixed part of a prefill there is mostly the step
            # it shares with them, which they take anyway).
            stall = service - pred.base_s(d.slot)
            if finish == UNKNOWN:
                stall = 0.0
            elif not _clearly_less(finish + allowance + step, ttft_pd, 0.002):
                continue
            busy += stall / BUSY_WINDOW_S
            if busy >= 0.9:
                continue
            tpot = step / (1.0 - busy)
            tpot_allowance = pred.tpot_allowance_s(d.slot, tpot, now)
            slack = tpot_budget - tpot - tpot_allowance
            prefilling = self.ledger.load(d.slot)[3]
            if slack <= 0.0 or (prefilling + 1) * stall > ALONE_STALL_TOKENS * slack:
                continue
            if finish == UNKNOWN:
                if not prefilling and job.prompt_tokens <= EXPLORE_ALONE_TOKENS and best is None:
                    best = (d, UNKNOWN, tpot, 0.0, tpot_allowance)
                continue
            ttft = finish + allowance + tpot
            if ttft <= ttft_budget and (best is None or best[1] == UNKNOWN or ttft < best[1]):
                best = (d, ttft, tpot, service + tpot, tpot_allowance)
        return best

    def choose_whole(self, cands: list[Target], job: JobInfo) -> Target:
        return self.choose(cands, job)

    def _whole_known(self, slot: int) -> bool:
        return self.predictor.prefill_known(slot) and self.predictor.decode_known(slot)

    def choose(self, cands: list[Target], job: JobInfo) -> Target:
        """One engine for the whole request: the soonest first token among those within the TPOT budget."""
        pred = self.predictor
        job.feasible = None
        now = clock.now()
        budget = TPOT_MARGIN * job.slo_tpot_ms / 1000.0
        best = None
        n, start = len(cands), self._rotation()
        plans = {}
        for k in range(n):
            t = cands[(start + k) % n]
            finish, service, allowance, breaks = self.predict_prefill(t, job, now)
            tpot = pred.step_s(t.slot, self.decode_batch(t, 0.0)) if finish != UNKNOWN else UNKNOWN
            if tpot == UNKNOWN:
                # Only a request that can teach the model explores (a JSON answer would only spread the traffic).
                explore = self._explore(cands, self._whole_known, start) if job.teaches else None
                return explore or self._unjudged(cands, job)
            over, ttft = tpot > budget or breaks, finish + allowance + tpot
            plans[t.slot] = (over, ttft, t, tpot, service + tpot, breaks)
            if best is None or over < best[0] or (over == best[0] and _clearly_less(ttft, best[1], 0.002)):
                best = plans[t.slot]
        cached = None
        if self.sees_conversations:
            ttft_budget = MARGIN * (job.slo_ttft_ms / 1000.0 - (now - job.arrived))
            cached = self._by_cache(
                cands, job, [p[2] for p in plans.values() if p[0] <= best[0] and p[1] <= ttft_budget]
            )
        _, ttft, t, tpot, floor, breaks = plans[cached.slot] if cached is not None else best
        self._verdict(job, ttft, tpot, floor, breaks=breaks)
        return t


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (RoundRobin, LoadBalance, KvCacheAffinity, SloAware)}


def make_policy(name: str, shared: SharedState, ledger: Ledger, health: Health, **model) -> Policy:
    """The policy named by scheduler_type; `model` passes predictor, index, block_tokens, overload_factor."""
    return POLICIES.get(name, LoadBalance)(shared, ledger, health, **model)
