"""`slo_aware` (`scheduler_config.scheduler_type`), the default policy: the pair predicted to meet the SLO budgets.

Predicts each candidate's TTFT (queue wait + uncached prefill + the decode engine's first
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
candidate it is tried once while idle (on KV events, by a request served whole only if it streams: a JSON
answer teaches no first token), else the prefill goes where `kv_cache_affinity` would place it on KV events,
or to the least loaded. A request late on every prefill engine goes to the one that finishes last (behind work
that is late already). With `decode_alone`
(`conditional_disaggregation`) each decode engine is also judged serving the request alone, computing
the prompt itself (`_pick_alone`), and is chosen when that is clearly sooner within both budgets.

The plan's verdict (`JobInfo.feasible`) is the judged pair's (scheduling/policies.py `Policy._verdict`).
"""

from __future__ import annotations

from scheduling import clock
from scheduling.job import JobInfo
from scheduling.policies import MARGIN, TPOT_MARGIN, KvCacheAffinity, LoadBalance
from scheduling.predict import BUSY_WINDOW_S, UNKNOWN
from scheduling.registry import Target

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


def _clearly_less(a: float, b: float, absolute: float) -> bool:
    return a < b - TIE * b - absolute


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
        best, holders = self.holders(cands, job)
        starts = self.conversation(cands, job, best, holders)
        if len(fits) < 2:
            return None
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
        """(target, TPOT, first-token wait, TPOT allowance, the batch it joins, the part of that wait spent waiting
        for a place in its batch) of the decode target with the lowest predicted TPOT (allowance included),
        preferring those within the budget, then those with a place free, among those the model knows (None:
        none)."""
        best = None
        n = len(ds)
        for k in range(n):
            d = ds[(start + k) % n]
            tpot, first, batch, full = self.predict_decode(d, delay)
            if tpot == UNKNOWN:
                continue
            allowance = self.predictor.tpot_allowance_s(d.slot, tpot, now)
            rank = (tpot + allowance > TPOT_MARGIN * self.tpot_budget_s(job, d.slot), full)
            if best is None or rank < best[0] or (rank == best[0] and _clearly_less(tpot + allowance, best[1], 0.0005)):
                best = (rank, tpot + allowance, d, tpot, first, allowance, batch, full)
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
        job.feasible, job.opens = None, False
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
        _, tpot, first, tpot_allowance, batch, full = d_pick
        ttft = finish + allowance + first
        if self.decode_alone:
            alone = self._pick_alone(ds, job, now, start, ttft)
            if alone is not None:
                d, ttft_alone, tpot, floor, tpot_allowance, batch = alone
                job.alone = True
                if ttft_alone == UNKNOWN:  # learning what D's prefill costs: no verdict on it yet
                    return p, d
                self._verdict(job, d.slot, ttft_alone, tpot, floor, tpot_allowance, batch=batch)
                return p, d
        self._verdict(job, d.slot, ttft, tpot, floor + first, tpot_allowance, breaks, batch, full)
        return p, d

    def _pick_alone(self, ds: list[Target], job: JobInfo, now: float, start: int, ttft_pd: float) -> tuple | None:
        """The decode engine that would serve the request alone (computing the prompt itself) when that is
        predicted to give a clearly sooner first token than the pair (`ttft_pd`) within both budgets: (it,
        its TTFT with allowance, its TPOT, the TTFT floor, the TPOT allowance, the batch it joins); None: the
        pair serves.

        Its prefill runs in the decode engine's steps, which costs the streams decoding there twice: once at
        once (every one of them waits for it, and for the prefills before it there: at most what their TPOT
        leaves of ALONE_STALL_TOKENS tokens' budget), and over time (the share of the engine's time spent
        prefilling lengthens every step it does not spend decoding). So only short or mostly cached prompts
        go to a busy decode engine. One whose prefill speed is not known yet is tried with a short prompt
        while it prefills nothing and its streams have room (an UNKNOWN TTFT), so that the model learns it.
        """
        pred, best = self.predictor, None
        ttft_budget = MARGIN * (job.slo_ttft_ms / 1000.0 - (now - job.arrived))
        n = len(ds)
        for k in range(n):
            d = ds[(start + k) % n]
            batch = self.decode_batch(d, 0.0)
            step, wait = self.joined_step(d, batch)
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
            slack = TPOT_MARGIN * self.tpot_budget_s(job, d.slot) - tpot - tpot_allowance
            prefilling = self.ledger.load(d.slot)[3]
            if slack <= 0.0 or (prefilling + 1) * stall > ALONE_STALL_TOKENS * slack:
                continue
            if finish == UNKNOWN:
                if not prefilling and job.prompt_tokens <= EXPLORE_ALONE_TOKENS and best is None:
                    best = (d, UNKNOWN, tpot, 0.0, tpot_allowance, batch)
                continue
            ttft = finish + allowance + wait + tpot
            if ttft <= ttft_budget and (best is None or best[1] == UNKNOWN or ttft < best[1]):
                best = (d, ttft, tpot, service + wait + tpot, tpot_allowance, batch)
        return best

    def choose_whole(self, cands: list[Target], job: JobInfo) -> Target:
        return self.choose(cands, job)

    def _whole_known(self, slot: int) -> bool:
        return self.predictor.prefill_known(slot) and self.predictor.decode_known(slot)

    def choose(self, cands: list[Target], job: JobInfo) -> Target:
        """One engine for the whole request: the soonest first token among those within the TPOT budget."""
        job.feasible, job.opens = None, False
        now = clock.now()
        best = None
        n, start = len(cands), self._rotation()
        plans = {}
        for k in range(n):
            t = cands[(start + k) % n]
            finish, service, allowance, breaks = self.predict_prefill(t, job, now)
            batch = self.decode_batch(t, 0.0) if finish != UNKNOWN else 0.0
            tpot, wait = self.joined_step(t, batch) if finish != UNKNOWN else (UNKNOWN, 0.0)
            if tpot == UNKNOWN:
                # On KV events only a request that can teach the model explores: a JSON answer teaches it
                # nothing, and the caches place it better than a turn of the rotation.
                explore = job.teaches or not self.sees_conversations
                return (explore and self._explore(cands, self._whole_known, start)) or self._unjudged(cands, job)
            over, ttft = (
                tpot > TPOT_MARGIN * self.tpot_budget_s(job, t.slot) or breaks,
                finish + allowance + wait + tpot,
            )
            plans[t.slot] = (over, ttft, t, tpot, service + wait + tpot, breaks, batch, wait)
            if best is None or over < best[0] or (over == best[0] and _clearly_less(ttft, best[1], 0.002)):
                best = plans[t.slot]
        cached = None
        if self.sees_conversations:
            ttft_budget = MARGIN * (job.slo_ttft_ms / 1000.0 - (now - job.arrived))
            cached = self._by_cache(
                cands, job, [p[2] for p in plans.values() if p[0] <= best[0] and p[1] <= ttft_budget]
            )
        _, ttft, t, tpot, floor, breaks, batch, full = plans[cached.slot] if cached is not None else best
        self._verdict(job, t.slot, ttft, tpot, floor, breaks=breaks, batch=batch, full=full)
        return t
