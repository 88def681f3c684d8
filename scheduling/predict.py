"""Learned speeds of every engine endpoint, shared by all workers: predicted TTFT and TPOT per candidate.

Nothing here knows how fast an engine is: every figure comes from timings the dispatcher observes.

Prefill (P and union endpoints). Each endpoint is modelled as one FIFO server (vLLM schedules prefill
first come, first served, chunking long prompts). Its *virtual queue* `queue_until` is when the
prefill work sent so far should be done: a new prefill of `u` uncached tokens starts at
max(now, queue end) and takes `u / rate`, plus the fixed part `base` when it opens an engine step: sent to an
idle engine, or after the last step the queue opened has begun (`step_open_at`); sent before, it joins that
step (the engine takes every waiting prompt into its next step). Behind queued work its predicted finish is
later by what joins its engine step while it waits (`batch_wait_s`). When a prefill completes, the gap between its
observed finish and its end in the continuous queue moves the queue end (requests behind it are late or
early by the same amount), counting each correction once: a lease remembers the sum of corrections when it
started. So after a completion the queue end is that completion plus the work sent after it; when later
prompts joined its engine step, they are partly done by then and the end is later than the engine's by
their part (at most one step, until the next completion corrects it), never earlier.
The fit's samples are groups of completions: those within `GROUP_S` of each other finished in one engine
step (a chunked batch), so their tokens add up; the group's service time runs from max(its first
member's start, the previous group's last completion) to its last completion. A completion whose prompt was
sent before the group's last completion may have had chunks computed in the group's steps, so it joins the
group's sample (at most `MERGE_STEPS` groups a sample). `rate` and `base` are a
least-squares line through (uncached tokens, service time) pairs, each group fitted when the next begins.
When none of our prefills is in flight on the endpoint (the ledger says so), its queue is empty, whatever
the virtual queue held (a lost or aborted request leaves phantom work there otherwise). A JSON answer
has no first-token time, only an upper bound on it: it moves the queue end only when it arrives before
its predicted prefill finish (`settle_prefill`), and is not fitted.

Error bounds. Every sampled prefill's error (observed minus predicted finish, as predicted when it was
sent, as a share of the time from then to the predicted finish: a short prompt is not judged by a long
one's misses) goes into the endpoint's ring of its last ERROR_RING errors (state/shared.py), and the
endpoint's allowance (`allowance_s`), the share added to a prediction judged against a budget, is the
`confidence` quantile of that ring (`scheduler_config.slo_confidence`): with the default 0.95, 19 in 20 of
its recent prefills finished within prediction plus allowance. A quantile, not a mean: an engine whose
predictions are usually right but now and then far off gets the room its misses need; one that is
always right gets none. Decode streams do the same with their observed seconds per token against the TPOT
predicted when the request was planned (`tpot_allowance_s`), which also covers errors in the predicted
batch. After `ALLOWANCE_QUIET_S` without any evidence an allowance halves every `ALLOWANCE_HALF_LIFE_S`,
and so do the errors in its ring when the next one comes (so a bad moment cannot shut admission for good:
the requests it lets in again are the evidence, and the old misses weigh less beside them).

Promises. With admission, a prefill admitted on its verdict may finish later than predicted by what its plan
left of its budget (`start_prefill`'s `slack_s`). A prompt sent behind it joins its last engine step while
that step has not begun, making it longer, so a later plan must not break that promise (`breaks_promise`):
each endpoint keeps the tightest promise among the prefills in flight that a prompt sent now can still
reach, and a prompt that would take that step past it is judged over budget there (it waits, is refused,
or goes where it breaks none).

Decode (D and union endpoints). Seconds per output token grows with the batch: `step + per_seq * B`,
a least-squares line through (mean batch during a request, its observed seconds per token) pairs. The
wait from a decode leg's start to its first step (KV pull, engine admission) is a running mean. Prompts
computed on the endpoint take steps from its streams: `prefill_busy` is the share of its time the
prefills sent there lately take (decayed over `BUSY_WINDOW_S`), and policies divide a TPOT by 1 - that.

The fits use exponentially decayed sums (the last ~`1/decay` samples dominate), updated under the
shared lock from finished requests that are samples: at most one per slot every `LEARN_INTERVAL_S` from
each worker (scheduling/scheduler.py), while the virtual queue takes every completion. With too little
spread in x, a slope is shrunk toward a prior (through the origin for prefill, a fixed part worth 4
sequences for decode), and a line the samples put at a slope of zero or below, or a fixed part below zero,
is the prior, so no model claims that more tokens or a bigger batch are free, or a step costs nothing of its
own. An endpoint is
"known" after `min_samples` observations; before that the policies fall back to load balancing (and
the engine's own mean inter-token latency, from /metrics, moved to the batch asked about along the prior,
stands in for an unknown decode model).
"""

from __future__ import annotations

import math

from state.shared import ERROR_RING, SharedState, endpoint_rows

UNKNOWN = float("inf")
# The decode fit's prior: a step's fixed part costs about as much as this many sequences.
DECODE_FIXED_SEQS = 4.0
# A decode stream whose step at one end of it was over this many times the other's (batch ramped or drained)
# does not teach the step's line (`learn_decode`).
STEADY_STEP_RATIO = 2.0
# A decode engine that spent at least this share of its time lately computing prompts (requests served whole or
# on D alone) is computing them: a stream's TPOT error there counts its batch's growth too (`learn_decode`).
COMPUTING_BUSY = 0.01
# Prefill errors are shares of the predicted time from planning to finish, at least this long: a prefill
# predicted to take a millisecond is not judged by how many milliseconds it missed by in relative terms.
MIN_SPAN_S = 0.05
# After ALLOWANCE_QUIET_S without evidence an allowance (and the errors it is a quantile of) halves every
# ALLOWANCE_HALF_LIFE_S.
ALLOWANCE_QUIET_S, ALLOWANCE_HALF_LIFE_S = 5.0, 2.0
# Prefill completions this close to the previous one finished in the same engine step (a chunked batch):
# their tokens and the time since the step's work started make one sample of the fit.
GROUP_S = 0.003
# A completion whose prompt was sent before the last group's completions joins that group's sample (its first
# chunks may have shared the group's steps), up to this many groups in one sample: a queue that never empties
# would otherwise merge them all, and the fit would learn nothing while it lasts.
MERGE_STEPS = 2
# The window over which an endpoint's share of time spent prefilling is measured (an exponential decay).
BUSY_WINDOW_S = 2.0


class Predictor:
    """`confidence`: the share of predictions that should hold within their allowance
    (`scheduler_config.slo_confidence`)."""

    def __init__(self, shared: SharedState, confidence: float, decay: float = 1 / 32, min_samples: int = 3):
        self.rows, self.lock = endpoint_rows(shared), shared.hot_lock
        self.keep = 1.0 - decay
        self.decay = decay
        self.min_samples = min_samples
        self.confidence = confidence

    # -- reading (hot path: a few float loads) -------------------------------------------------

    def prefill_known(self, slot: int) -> bool:
        return self.rows[slot].prefill_tps > 0.0

    def queue_wait_s(self, slot: int, now: float) -> float:
        wait = self.rows[slot].queue_until - now
        return wait if wait > 0.0 else 0.0

    def prefill_s(self, slot: int, tokens: int) -> float:
        """Service time of a prefill of `tokens` uncached tokens, without queueing (inf when unknown)."""
        e = self.rows[slot]
        rate = e.prefill_tps
        return e.prefill_base_s + tokens / rate if rate > 0.0 else UNKNOWN

    def base_s(self, slot: int) -> float:
        """The fixed part of a prefill's service time."""
        return self.rows[slot].prefill_base_s

    def allowance_s(self, slot: int, span_s: float, now: float) -> float:
        """What to add to a prefill finish predicted `span_s` from `now` so that a `confidence` share finish by then."""
        e = self.rows[slot]
        share = self._allowance(e.late_share, e.late_at, now)
        return share * (span_s if span_s > MIN_SPAN_S else MIN_SPAN_S)

    def mean_prefill_tokens(self, slot: int) -> float:
        """The (decayed) mean uncached tokens of the prefills learned from on `slot` (0: none yet)."""
        e = self.rows[slot]
        n = e.pf_n
        return e.pf_sx / n if n > 0.0 else 0.0

    def decode_known(self, slot: int) -> bool:
        return self.decode_fitted(slot) or self.rows[slot].engine_itl_s > 0.0

    def decode_fitted(self, slot: int) -> bool:
        """Known by its own line, not by the engine's mean inter-token latency standing in for one: that is the
        latency at whatever batch the engine ran in the last scrape interval with tokens, and stays when it idles."""
        return self.rows[slot].dc_n >= self.min_samples

    def step_s(self, slot: int, batch: float) -> float:
        """Seconds per output token with `batch` sequences running (inf when unknown). Before the line is learned,
        the engine's own mean inter-token latency, moved from the batch it was measured at to `batch` along the
        line's prior (a fixed part worth `DECODE_FIXED_SEQS` sequences)."""
        e = self.rows[slot]
        if e.dc_n >= self.min_samples:
            return e.decode_step_s + e.decode_per_seq_s * batch
        itl = e.engine_itl_s
        if itl <= 0.0:
            return UNKNOWN
        return itl * (DECODE_FIXED_SEQS + batch) / (DECODE_FIXED_SEQS + e.engine_itl_batch)

    def tpot_allowance_s(self, slot: int, tpot_s: float, now: float) -> float:
        """What to add to a predicted TPOT of `tpot_s` so that a `confidence` share of streams stay within it."""
        e = self.rows[slot]
        return self._allowance(e.tpot_late_share, e.tpot_late_at, now) * tpot_s

    @staticmethod
    def _allowance(share: float, moved_at: float, now: float) -> float:
        """An allowance `share` that last moved at `moved_at`, narrowed by the time since."""
        if share <= 0.0:
            return 0.0
        quiet = now - moved_at - ALLOWANCE_QUIET_S
        return share * 0.5 ** (quiet / ALLOWANCE_HALF_LIFE_S) if quiet > 0.0 else share

    def first_wait_s(self, slot: int) -> float:
        return self.rows[slot].queue_delay_s

    # -- writing (once per request, under the shared lock) -------------------------------------

    def start_prefill(
        self, slot: int, tokens: int, now: float, idle: bool = False, slack_s: float = UNKNOWN
    ) -> tuple[float, float]:
        """Queue a prefill of `tokens` uncached tokens: (its predicted finish, its correction baseline).

        `idle`: nothing else is prefilling there (the ledger says so), whatever the virtual queue holds.
        `slack_s`: how much later than predicted it may finish within its budget (UNKNOWN: it was not judged):
        the promise later prompts must keep (`breaks_promise`).
        The baseline is the correction sum now plus its batch wait, so that its completion corrects the
        queue against the continuous queue's end (see `learn_prefill`), while its error is measured against
        the predicted finish.
        """
        e = self.rows[slot]
        with self.lock:
            end = e.queue_until
            rate = e.prefill_tps
            batch = 0.0
            if rate > 0.0:
                queued = not (end < now or idle)
                start = end if queued else now
                if queued and now < e.step_open_at:
                    # Behind queued work, while the engine step that will take it has not begun: it joins that
                    # step (a chunked batch), its tokens and no step of its own.
                    service = tokens / rate
                else:  # it opens a step: now on an idle engine, else after the work of the step that has begun
                    e.step_open_at = start
                    service = e.prefill_base_s + tokens / rate
                batch = self.batch_wait_s(slot, start - now, now)
                end = start + service
                e.prefill_busy = self.prefill_busy(slot, now) + service / BUSY_WINDOW_S
                e.prefill_busy_at = now
                finish = end + batch
                if slack_s != UNKNOWN and (
                    idle
                    or finish + slack_s < e.promise_due
                    or not self._in_reach(e, now, end, self._promise_end(e), self.mean_step_s(slot))
                ):
                    e.promise_due, e.promise_start, e.promise_end = finish + slack_s, start, finish
                    e.promise_shift_s = e.queue_shift_s
            else:
                end = now
            e.queue_until = end
            return end + batch, e.queue_shift_s + batch

    def breaks_promise(self, slot: int, start: float, finish: float, now: float) -> bool:
        """Would a prompt sent now, starting at `start` and finishing at `finish`, make an admitted prefill there
        late? Its tokens join the last engine step of the prompts just ahead whose last step has not begun (a
        chunked batch), and make that step longer: the promise's prefill then ends when this one does, at most
        one mean step after its predicted end (what joins a step, as `batch_wait_s` counts it)."""
        e = self.rows[slot]
        due = e.promise_due
        if due <= 0.0 or finish <= due:
            return False
        end, step = self._promise_end(e), self.mean_step_s(slot)
        return self._in_reach(e, now, start, end, step) and end + min(finish - end, step) > due

    def mean_step_s(self, slot: int) -> float:
        """The mean engine step of prefill there (the fit's samples are steps)."""
        return self.prefill_s(slot, int(self.mean_prefill_tokens(slot)))

    @staticmethod
    def _promise_end(e) -> float:
        """The promise's predicted prefill end, moved by the queue's corrections since it was predicted."""
        return e.promise_end + e.queue_shift_s - e.promise_shift_s

    @staticmethod
    def _in_reach(e, now: float, start: float, end: float, step: float) -> bool:
        """Can a prompt sent now that starts at `start` still join the last step of the promise's prefill (ending
        at `end`)? That step has not begun, and at most one mean `step` of work lies between `end` and `start`.
        A prefill of at most a mean step is one step, begun at its start (a prompt sent within GROUP_S of it
        joins it all the same); a longer one takes several, and the engine's token budget a step, which says
        when its last begins, is not known here: until its end."""
        begins = e.promise_start + end - e.promise_end
        last_step = begins + GROUP_S if end - begins <= step else end
        return now <= last_step and start - end <= step

    def batch_wait_s(self, slot: int, wait_s: float, now: float) -> float:
        """What a prompt that waits `wait_s` behind work already on the endpoint loses to the engine's batching.

        Its first token comes at the end of the engine step that computes its last chunk, and that step also
        takes the prompts that arrive while it waits (up to the engine's token budget a step): at the rate
        prompts have been sent there lately (`prefill_busy`, seconds of work a second), `busy x wait_s` seconds
        of them, at most one mean step (the fit's samples are steps). Nothing when it does not wait: an idle
        engine starts a step with it alone."""
        if wait_s <= 0.0:
            return 0.0
        busy = self.prefill_busy(slot, now)
        if busy <= 0.0:
            return 0.0
        step = self.mean_step_s(slot)
        extra = busy * wait_s
        return extra if extra < step else step

    def prefill_busy(self, slot: int, now: float) -> float:
        """The share of the endpoint's time spent on the prefills sent there lately (over ~BUSY_WINDOW_S)."""
        e = self.rows[slot]
        busy = e.prefill_busy
        if busy <= 0.0:
            return 0.0
        return busy * math.exp((e.prefill_busy_at - now) / BUSY_WINDOW_S)

    def learn_prefill(
        self, slot: int, started: float, done: float, tokens: int, predicted: float, shift0: float, fit: bool = True
    ) -> None:
        """A prefill queued at `started` (see start_prefill) completed at `done` after `tokens` uncached tokens.

        `fit`: also a sample for the fit and the allowance; without it only the virtual queue and the last
        completion time move (every completion must move them, or later predictions drift).

        The queue moves by how late it finished against its end in the continuous queue, not against its
        predicted finish (which adds the batch wait, what later prompts add to its last step). Corrected by
        the prediction, a step that took fewer later prompts than the batch wait counted (bursts end: the
        recent rate of prompts sent overstates what comes next) moved the queue's end earlier than the
        engine's, and the next prompt was predicted to wait less than it did; with admission, let in and
        late. This way a step that took more leaves the end late by their part instead: a wait predicted
        long, at most one step, corrected by the next completion.
        """
        e = self.rows[slot]
        with self.lock:
            shift = e.queue_shift_s
            late = done - (predicted + shift - shift0)
            span = predicted - started  # 0: sent before the model knew the engine, so no prediction was made
            if fit and span > 0.0 and e.pf_n >= self.min_samples:  # the error of a learned model's prediction
                error = (done - predicted) / (span if span > MIN_SPAN_S else MIN_SPAN_S)
                e.late_share = self._record(e.late_errors, e.late_count, e.late_at, error, done)
                e.late_count, e.late_at = e.late_count + 1, done
            e.queue_until += late
            e.step_open_at += late
            e.queue_shift_s = shift + late
            last = e.last_done
            if last and done - last <= GROUP_S:  # the same engine step as the last completion: one sample
                e.group_tokens += tokens
                if fit:
                    e.group_fit = 1.0
                if done > last:
                    e.last_done = done
                return
            group_tokens, group_start = e.group_tokens, e.group_start
            if started < last and e.group_steps < MERGE_STEPS and e.pf_n >= self.min_samples:
                # Sent before the group ended, it may have shared the group's steps: a short prompt that completed
                # in the step which also computed a long one's first chunk took that chunk's time, and the long
                # one's own sample then looks as fast as its last chunk. Their tokens over their time is the rate.
                e.group_tokens += tokens
                e.group_steps += 1.0
                if fit:
                    e.group_fit = 1.0
                e.last_done = done
                return
            if e.group_fit and group_tokens and last > group_start:
                sums, line = self._add_and_fit(
                    (e.pf_n, e.pf_sx, e.pf_sy, e.pf_sxx, e.pf_sxy), group_tokens, last - group_start, ratio_prior=True
                )
                e.pf_n, e.pf_sx, e.pf_sy, e.pf_sxx, e.pf_sxy = sums
                if line is not None:
                    e.prefill_base_s = line[0]
                    e.prefill_tps = 1.0 / line[1] if line[1] > 0.0 else 1e12
            e.group_tokens, e.group_fit, e.group_steps = float(tokens), 1.0 if fit else 0.0, 1.0
            e.group_start = started if started > last else last
            e.last_done = done

    def settle_prefill(self, slot: int, done_by: float, predicted: float, shift0: float) -> None:
        """A prefill whose answer came whole (a JSON answer: no first-token time) was done by `done_by`.

        A prediction later than that was late at least by the difference, and so is the work queued behind
        it: the queue end moves up by as much. An answer after the predicted finish says nothing (the
        decode took that time), so nothing is fitted and the last completion time stays.
        """
        e = self.rows[slot]
        if predicted + e.queue_shift_s - shift0 <= done_by:  # the usual case, told without the lock
            return
        with self.lock:
            shift = e.queue_shift_s
            early = predicted + shift - shift0 - done_by
            if early > 0.0:
                e.queue_until -= early
                e.step_open_at -= early
                e.queue_shift_s = shift - early

    def learn_decode(
        self,
        slot: int,
        started: float,
        first: float,
        done: float,
        events: int,
        batch: float,
        predicted: float = 0.0,
        planned: float = 0.0,
        judged: float = 0.0,
        ends: tuple[int, int] = (0, 0),
    ) -> None:
        """A decode (or whole) stream: leg started, first and last event times, events seen, mean batch, the
        seconds per token predicted when it was planned (0: none) for a batch of `planned`, and the largest batch
        the verdicts of the requests that joined after it predicted (0: not known).

        Its error against the prediction leaves out the growth of its batch that those verdicts predicted (a mean
        batch above the planned one, up to theirs, at the step the current fit gives each): each of them was
        judged against the tightest TPOT budget in the batch (`Policy.tpot_budget_s`), so that growth is bounded
        by admission. Counted in, it would widen the allowance of every plan (streams admitted into a small batch
        see it double under load) and refuse requests that fit. Growth past what they predicted stays in: it is
        their batch predictions' error (short under bursts), and the allowance is what bounds it. So does all of
        it on an engine computing prompts (`COMPUTING_BUSY`): their steps' prefill time, which slows the streams
        there, is not in the batch the verdicts predicted.

        `ends`: the requests on the slot when it joined and when it ended (0: not known). A stream whose batch
        ramped (or drained) that far, its step at one end over STEADY_STEP_RATIO times the other's (as the prior
        prices a step), teaches its error but not the step's line once the engine is known: most of its tokens
        came in the short steps of the small batch while its mean batch is over time, so it would flatten the
        line, and a line too flat admits batches past the budget that no allowance learned from growth catches."""
        e = self.rows[slot]
        with self.lock:
            if events >= 5 and done > first:
                per_token = (done - first) / (events - 3)  # framing: the role, finish and usage/[DONE] events
                if predicted > 0.0:
                    grown = min(batch, judged)
                    # (On an engine computing prompts, its steps' prefill time is no batch's: all of it counts.)
                    if grown > planned > 0.0 and self.prefill_busy(slot, done) < COMPUTING_BUSY:
                        at_plan, at_grown = self.step_s(slot, planned), self.step_s(slot, grown)
                        if at_grown != UNKNOWN:
                            predicted *= at_grown / at_plan
                    error = per_token / predicted - 1.0
                    e.tpot_late_share = self._record(e.tpot_errors, e.tpot_count, e.tpot_late_at, error, done)
                    e.tpot_count, e.tpot_late_at = e.tpot_count + 1, done
                low, high = sorted(ends)
                steady = not low or high + DECODE_FIXED_SEQS <= STEADY_STEP_RATIO * (low + DECODE_FIXED_SEQS)
                if steady or e.dc_n < self.min_samples:
                    sums, line = self._add_and_fit(
                        (e.dc_n, e.dc_sx, e.dc_sy, e.dc_sxx, e.dc_sxy), batch, per_token, ratio_prior=False
                    )
                    e.dc_n, e.dc_sx, e.dc_sy, e.dc_sxx, e.dc_sxy = sums
                    if line is not None:
                        e.decode_step_s, e.decode_per_seq_s = line
            step = self.step_s(slot, batch)
            if step == UNKNOWN or started >= first:  # (a whole stream, timed from its first token: no decode leg wait)
                return
            wait = first - started - step
            wait = wait if wait > 0.0 else 0.0
            old = e.queue_delay_s
            e.queue_delay_s = wait if old == 0.0 else self.keep * old + self.decay * wait

    def _record(self, ring, count: float, moved_at: float, error: float, now: float) -> float:
        """One prediction's error (observed / predicted - 1) into `ring` (`count` recorded before it, the last at
        `moved_at`): the new allowance, the `confidence` quantile of the ring (0 when the quantile held early).
        Errors older than a quiet spell are halved as the allowance was."""
        n = int(count)
        quiet = now - moved_at - ALLOWANCE_QUIET_S
        if quiet > 0.0 and n:
            fade = 0.5 ** (quiet / ALLOWANCE_HALF_LIFE_S)
            for i in range(min(n, ERROR_RING)):
                ring[i] *= fade
        ring[n % ERROR_RING] = error
        n += 1
        held = sorted(ring[: min(n, ERROR_RING)])
        # The smallest error that at least a `confidence` share of the ring is within (all of a short ring's).
        q = held[min(len(held) - 1, math.ceil(self.confidence * len(held)) - 1)]
        return q if q > 0.0 else 0.0

    def _add_and_fit(
        self, sums: tuple[float, float, float, float, float], x: float, y: float, ratio_prior: bool
    ) -> tuple[tuple[float, float, float, float, float], tuple[float, float] | None]:
        """The sums (n, Sx, Sy, Sxx, Sxy) decayed, with one (x, y) sample added; and the intercept and slope of y
        on x, the slope shrunk toward a prior (None until `min_samples` samples).

        The caller reads the sums once and writes them once: each access to shared memory costs more than the
        arithmetic.
        """
        k = self.keep
        n, sx, sy, sxx, sxy = sums
        n, sx, sy, sxx, sxy = k * n + 1.0, k * sx + x, k * sy + y, k * sxx + x * x, k * sxy + x * y
        sums = n, sx, sy, sxx, sxy
        if n < self.min_samples:
            return sums, None
        mx, my = sx / n, sy / n
        vx = max(0.0, sxx / n - mx * mx)
        cxy = sxy / n - mx * my
        if ratio_prior:  # prefill: time proportional to tokens unless the data say otherwise
            prior = my / mx if mx > 0 else 0.0
            weight = (0.1 * mx) ** 2
        else:  # decode: the fixed part of a step costs about as much as DECODE_FIXED_SEQS sequences
            prior = my / (mx + DECODE_FIXED_SEQS)
            weight = 0.5
        b = (cxy + weight * prior) / (vx + weight) if vx + weight > 0 else prior
        # The prior holds where the line claims that more is free (noise: steps shared with other work) or that
        # the fixed part costs less than nothing (a decode stream timed while its batch drained runs faster than
        # its mean batch says, so samples from bursts alone tilt the line, and a lone stream would be predicted
        # nearly free).
        if b <= 0.0 or my - b * mx < 0.0:
            b = prior
        return sums, (my - b * mx, b)
