"""Scheduling benchmark: seeded workload families replayed against every policy, in virtual time.

    python bench/scheduling.py [--families 13] [--requests 240] [--loads 1.0,1.3] [--seed 1] [--runs ...]

Each family is a seeded combination of an arrival process (Poisson, bursty on/off, a ramp), a prompt-length
mix (narrow, bimodal, long-tailed), prefix sharing (none, a few hot system prompts) and a cluster shape (two
to four prefill engines of different speeds, one to three decode engines). Family 0 is fixed: short prompts
and a slow, busy prefill pool beside fast decode engines (where the decode engine alone serves short prompts
sooner than a P/D pair).

What runs is the Coordinator's own scheduling code (scheduling/: Scheduler, the policies, the learned model,
the ledger, SLO admission and its queue) on shared state made in this process, driven as serving/dispatch.py
and serving/handoff.py drive it, against engines simulated the way engine_sim simulates vLLM (a FIFO waiting
queue, continuous batching, chunked prefill within `max_num_batched_tokens` per step, a step lasting
`step + per_seq x decoding sequences + prefill tokens / rate`, a prefix cache of block hashes). Their
`/metrics` gauges (running, waiting) are written into the health table every 0.5 s as the scrape does. All of
it runs on an asyncio loop whose clock is virtual (`VirtualLoop`): a sleep costs no wall time, so the whole
table takes minutes on a shared 2-core machine and every figure is the same on every run.

Capacity is the arrival rate the cluster sustains with perfect routing and no D-alone serving: the smaller of
the prefill capacity (sum of prefill engines' rates over the mean uncached prompt, hot prefixes cached) and the
decode capacity (sum over decode engines of B / step(B), B the largest batch whose step meets the TPOT budget,
over the mean output length). Loads are shares of it.

Per row: goodput (requests meeting both budgets per second of the arrival window), on-time among the admitted
(answered, not refused) requests, the share refused (429), TTFT p50 of answered requests. The last lines check
the issue's figures per family and print them machine-readably.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import math
import os
import random
import selectors
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.verdicts import AIM_VS_BEST_OTHER, AIM_VS_ROUND_ROBIN, Verdict, add_args, report  # noqa: E402
from config import Endpoint, Instance  # noqa: E402
from config.sections import SchedulerConfig  # noqa: E402
from scheduling import clock  # noqa: E402
from scheduling.admission import AdmissionQueue, OverBudget  # noqa: E402
from scheduling.affinity import PrefixIndex  # noqa: E402
from scheduling.health import Health  # noqa: E402
from scheduling.ledger import DECODE, PREFILL, Ledger  # noqa: E402
from scheduling.policies import JobInfo  # noqa: E402
from scheduling.predict import Predictor  # noqa: E402
from scheduling.registry import Registry  # noqa: E402
from scheduling.scheduler import (  # noqa: E402
    NoCapacity,
    Scheduler,
    make_policy,
)
from scheduling.tokens import BYTES_PER_TOKEN, chained_hashes  # noqa: E402
from state.shared import SharedState  # noqa: E402

MODEL = "bench"
BLOCK = 16
SCRAPE_S = 0.5
STALL_P, STALL_S = 0.002, 0.08  # each engine step is 0-10 % slower than nominal, and 1 in 500 stalls 80 ms
SLOWDOWN = 1.06  # so engines run about this much slower than nominal on average (capacity counts it)
DEFAULT_RUNS = (
    "round_robin:off,load_balance:off,kv_cache_affinity:off,slo_aware:off,slo_aware:reject,slo_aware:queue,"
    "slo_aware:queue:alone"
)


# -- virtual time ----------------------------------------------------------------------------------


class _Selector(selectors.DefaultSelector):
    """Waiting for I/O is moving the clock: there is no I/O, only timers."""

    loop: VirtualLoop

    def select(self, timeout=None):
        if timeout is None:
            raise RuntimeError("the simulation is stuck: nothing is scheduled")
        self.loop.now += timeout
        return []


class VirtualLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock jumps to the next timer: asyncio.sleep and wait_for cost no wall time."""

    def __init__(self):
        selector = _Selector()
        selector.loop = self
        self.now = 1000.0
        super().__init__(selector)

    def time(self) -> float:
        return self.now


# -- the simulated engines -------------------------------------------------------------------------


@dataclass
class Seq:
    uncached: int  # prompt tokens this engine computes (after its prefix cache)
    out: int  # tokens to emit (1 for a prefill engine)
    hashes: list[int]
    first: asyncio.Future
    done: asyncio.Future
    remaining: int = 0
    emitted: int = 0
    # Over the steps it decoded in: the sequences decoding (itself included), and the seconds those steps spent
    # on prompts (computed on this engine: D alone, whole requests).
    batch_sum: int = 0
    prefill_s: float = 0.0


class Engine:
    """One simulated vLLM engine (engine_sim's timing model, see engine_sim/engine.py)."""

    def __init__(self, rate: float, step_s: float, per_seq_s: float, max_seqs: int = 128, chunk: int = 4096):
        self.rate, self.step_s, self.per_seq_s = rate, step_s, per_seq_s
        self.max_seqs, self.chunk = max_seqs, chunk
        self.waiting: collections.deque[Seq] = collections.deque()
        self.running: list[Seq] = []
        self.cache: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.cache_blocks = 12_000
        self.wake = asyncio.Event()
        self.jitter = random.Random(int(rate) + int(step_s * 1e6))

    def cached_tokens(self, hashes: list[int], prompt: int) -> int:
        n = 0
        for h in hashes:
            if h not in self.cache:
                break
            n += 1
        return min(n * BLOCK, prompt - 1) if n else 0

    def submit(self, prompt: int, out: int, hashes: list[int], remote_kv: bool = False) -> Seq:
        loop = asyncio.get_running_loop()
        uncached = 0 if remote_kv else prompt - self.cached_tokens(hashes, prompt)
        s = Seq(uncached, out, hashes, loop.create_future(), loop.create_future(), remaining=uncached)
        self.waiting.append(s)
        self.wake.set()
        return s

    def _remember(self, hashes: list[int]) -> None:
        for h in hashes:
            self.cache[h] = None
            self.cache.move_to_end(h)
        while len(self.cache) > self.cache_blocks:
            self.cache.popitem(last=False)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while self.waiting and len(self.running) < self.max_seqs:
                self.running.append(self.waiting.popleft())
            if not self.running:
                self.wake.clear()
                await self.wake.wait()
                continue
            budget, prefill, finishing, decoders = self.chunk, 0, [], []
            for s in self.running:
                if s.remaining > 0:
                    if budget <= 0:
                        continue
                    take = min(s.remaining, budget)
                    budget -= take
                    prefill += take
                    s.remaining -= take
                    if not s.remaining:
                        finishing.append(s)
                elif s.emitted == 0 and not s.uncached:
                    finishing.append(s)  # KV came from P: its first token is this step's
                else:
                    decoders.append(s)
            step = (self.step_s + self.per_seq_s * len(decoders) + prefill / self.rate) * (
                1.0 + 0.1 * self.jitter.random()
            )
            if self.jitter.random() < STALL_P:  # a real engine stalls now and then (GC, a preemption, the host)
                step += STALL_S
            await asyncio.sleep(step)
            now = loop.time()
            for s in decoders:
                s.batch_sum += len(decoders)
                s.prefill_s += prefill / self.rate
            for s in finishing:
                self._remember(s.hashes)
            for s in finishing + decoders:
                s.emitted += 1
                if s.emitted == 1:
                    s.first.set_result(now)
                if s.emitted >= s.out:
                    s.done.set_result(now)
                    self.running.remove(s)


# -- families --------------------------------------------------------------------------------------

ARRIVALS = ("poisson", "bursty", "ramp")
MIXES = ("narrow", "bimodal", "longtail")
PREFIXES = ("none", "hot")
PREFILL_FACTORS = (1.0, 0.55, 0.3, 0.8)  # prefill engines' speeds relative to the family's fastest
DECODES = ((0.008, 0.0009, 1.0), (0.012, 0.0016, 0.6), (0.010, 0.0012, 0.8))  # step s, s/seq, prefill speed


@dataclass
class Family:
    name: str
    arrival: str
    mix: str
    prefix: str
    prefills: list[tuple[float, float]]  # (tokens/s, step s)
    decodes: list[tuple[float, float, float]]  # (step s, s per sequence, prefill tokens/s)
    ttft_s: float = 1.5
    tpot_s: float = 0.05
    out_range: tuple[int, int] = (32, 160)
    systems: list[int] = field(default_factory=list)  # hot system prompts' lengths

    def describe(self) -> str:
        ps = "/".join(f"{r / 1000:.1f}k" for r, _ in self.prefills)
        ds = "/".join(f"{a * 1000:.0f}+{b * 1000:.1f}" for a, b, _ in self.decodes)
        return f"{self.arrival}, {self.mix}, prefix {self.prefix}; P {ps} tok/s, D {ds} ms/step"


def make_family(i: int, seed: int) -> Family:
    if i == 0:  # short prompts, a slow prefill pool, fast decode engines
        return Family(
            "f00-short-busyP",
            "poisson",
            "short",
            "none",
            [(1500.0, 0.004), (900.0, 0.004)],
            [(0.008, 0.0009, 8000.0), (0.008, 0.0009, 8000.0)],
            ttft_s=1.0,
        )
    rng = random.Random(seed * 1000 + i)
    k = i - 1
    arrival, mix, prefix = ARRIVALS[k % 3], MIXES[(k // 3) % 3], PREFIXES[(k // 2) % 2]
    fast = rng.choice((5000.0, 7000.0, 9000.0))
    n_p, n_d = 2 + k % 3, 1 + (k // 3 + rng.randrange(2)) % 3
    factors = list(PREFILL_FACTORS[:n_p])
    rng.shuffle(factors)
    prefills = [(fast * f, 0.004) for f in factors]
    decodes = [(s, q, fast * f) for s, q, f in DECODES[:n_d]]
    fam = Family(f"f{i:02d}-{arrival}-{mix}-{prefix}", arrival, mix, prefix, prefills, decodes)
    if prefix == "hot":
        fam.systems = [rng.randint(1000, 2500) for _ in range(4)]
    return fam


@dataclass
class Req:
    at: float  # arrival, seconds from the start of the window
    system: int  # hot system prompt, -1 none
    user: int  # its own prompt tokens
    out: int

    def prompt(self, workload: Family) -> int:
        """Its prompt's tokens in `workload` (anything with the hot system prompts' lengths as `systems`)."""
        return (workload.systems[self.system] if self.system >= 0 else 0) + self.user


def _user_tokens(fam: Family, rng: random.Random) -> int:
    if fam.mix == "short":
        return rng.randint(40, 300)
    if fam.mix == "narrow":
        return rng.randint(600, 1000)
    if fam.mix == "bimodal":
        return rng.randint(100, 400) if rng.random() < 0.7 else rng.randint(2000, 6000)
    return min(16000, int(120 * rng.paretovariate(1.3)))  # long-tailed


def arrival_times(kind: str, n: int, rate: float, rng: random.Random, cycle_s: float) -> list[float]:
    """`n` arrival times (seconds) whose mean rate over the window is `rate`; `cycle_s`: a bursty one's cycle."""
    window = n / rate
    if kind == "poisson":
        t, out = 0.0, []
        for _ in range(n):
            t += rng.expovariate(rate)
            out.append(t)
        return out
    if kind == "bursty":  # three times the rate for a third of each cycle, nothing otherwise
        on, t, out = cycle_s / 3, 0.0, []
        while len(out) < n:
            t += rng.expovariate(3 * rate)
            if t % cycle_s >= on:
                t = (t // cycle_s + 1) * cycle_s
                continue
            out.append(t)
        return out
    if kind == "ramp":  # the rate grows linearly from half to one and a half times `rate` over the window
        return sorted(window * (-0.5 + math.sqrt(0.25 + 2.0 * rng.random())) for _ in range(n))
    # diurnal: a sine swell, 0.3x to 1.7x, one period over the window (thinning of a Poisson process at 1.7x)
    t, out = 0.0, []
    while len(out) < n:
        t += rng.expovariate(1.7 * rate)
        if rng.random() < (1.0 - 0.7 * math.cos(2 * math.pi * t / window)) / 1.7:
            out.append(t)
    return out


def draw_requests(
    times: list[float],
    rng: random.Random,
    systems: list[int],
    hot_share: float,
    user: Callable[[random.Random], int],
    out: Callable[[random.Random], int],
) -> list[Req]:
    """A request at each of `times`: a hot system prompt (of `systems`) for `hot_share` of them, its own prompt
    tokens `user(rng)`, its output tokens `out(rng)`."""
    reqs = []
    for t in times:
        system = rng.randrange(len(systems)) if systems and rng.random() < hot_share else -1
        reqs.append(Req(t, system, user(rng), out(rng)))
    return reqs


def make_requests(fam: Family, n: int, rate: float, seed: int) -> list[Req]:
    rng = random.Random(seed)
    times = arrival_times(fam.arrival, n, rate, rng, 12.0)
    return draw_requests(
        times, rng, fam.systems, 0.7, functools.partial(_user_tokens, fam), lambda r: r.randint(*fam.out_range)
    )


def capacity(fam: Family, seed: int) -> float:
    sample = make_requests(fam, 4000, 1.0, seed + 99)
    uncached = statistics.mean(r.user for r in sample)
    out = statistics.mean(r.out for r in sample)
    prefill = sum(rate / (uncached + rate * step) for rate, step in fam.prefills)
    tokens_per_s = 0.0
    for step, per_seq, _ in fam.decodes:
        batch = max(1, int((fam.tpot_s - step) / per_seq))
        tokens_per_s += batch / (step + per_seq * batch)
    return min(prefill, tokens_per_s / out) / SLOWDOWN


def hashes_of(fam: Family, req: Req, key: int) -> tuple[list[int], list[int]]:
    """A prompt's hashes twice: as the Coordinator computes them for its prefix index (scheduling/tokens.py's
    chained_hashes over the prompt's bytes, at sparse boundaries), and as the engine's own prefix cache keys its
    blocks (one per block). The system prompt's bytes, and so its blocks, are shared; the user part's are this
    request's."""
    sys_tokens = fam.systems[req.system] if req.system >= 0 else 0
    sys_blocks = sys_tokens // BLOCK
    own = (req.prompt(fam) // BLOCK) - sys_blocks
    data = _system_bytes(req.system, sys_tokens) + random.Random(key).randbytes(req.user * BYTES_PER_TOKEN)
    index = chained_hashes(data, BLOCK * BYTES_PER_TOKEN)
    return index, [hash((0, req.system, b)) for b in range(sys_blocks)] + [hash((1, key, b)) for b in range(own)]


def _system_bytes(system: int, tokens: int) -> bytes:
    return random.Random(-1 - system).randbytes(tokens * BYTES_PER_TOKEN) if system >= 0 else b""


# -- one run: a family, a policy, a load -----------------------------------------------------------


@dataclass
class Outcome:
    status: int  # 200, 429
    ttft: float = 0.0
    tpot: float = 0.0
    alone: bool = False
    # What the plan predicted, allowances included (0: it could not judge): TTFT from arrival, TPOT.
    ttft_pred: float = 0.0
    tpot_pred: float = 0.0
    # Where a TTFT went: the prefill's finish against the finish predicted when it was sent (no allowance), and
    # the wait from it to the first token (a pair's decode engine: KV, its queue, its first step).
    prefill_late_s: float = 0.0
    first_wait_s: float = 0.0
    # Where a TPOT went: the mean batch it decoded in, the share of its decode time spent on prompts computed
    # there, and the batch its plan's TPOT prediction stood for (-1: unknown).
    batch: float = 0.0
    prefill_share: float = 0.0
    batch_pred: float = -1.0


class Cluster:
    """The scheduler of one policy, as the gateway builds it, over simulated engines."""

    def __init__(self, fam: Family, policy: str, admission: str, alone: bool):
        self.shared = shared = SharedState.create()
        self.ledger = Ledger(shared, 0, 1)
        self.health = Health(shared)
        pol = make_policy(
            policy,
            shared,
            self.ledger,
            self.health,
            predictor=Predictor(shared, SchedulerConfig().slo_confidence),
            index=PrefixIndex(shared, BLOCK),
            block_tokens=BLOCK,
            decode_alone=alone,
        )
        registry = Registry(shared)
        instances, self.engines = [], {}
        for k, (rate, step) in enumerate(fam.prefills):
            instances.append(Instance(k + 1, "prefill", MODEL, (Endpoint(0, f"127.0.0.1:{9001 + k}"),)))
            self.engines[f"127.0.0.1:{9001 + k}"] = Engine(rate, step, 0.0)
        for k, (step, per_seq, rate) in enumerate(fam.decodes):
            instances.append(Instance(k + 101, "decode", MODEL, (Endpoint(0, f"127.0.0.1:{9101 + k}"),)))
            self.engines[f"127.0.0.1:{9101 + k}"] = Engine(rate, step, per_seq)
        registry.apply("set", instances)
        queue = AdmissionQueue(shared, 256) if admission == "queue" else None
        self.scheduler = Scheduler(registry, self.ledger, self.health, pol, admission=admission, queue=queue)
        self.by_slot = {t.slot: self.engines[t.address] for t in registry.view().targets}
        self.uses_prefix = pol.uses_prefix

    async def scrape(self) -> None:
        while True:
            for slot, e in self.by_slot.items():
                self.health.set_engine_load(slot, len(e.running), len(e.waiting), 0.0)
            await asyncio.sleep(SCRAPE_S)

    async def serve(self, fam: Family, req: Req, key: int) -> Outcome:
        index_hashes, hashes = hashes_of(fam, req, key)
        prompt = req.prompt(fam)
        job = JobInfo(
            MODEL,
            prompt,
            req.out,
            fam.ttft_s * 1000,
            fam.tpot_s * 1000,
            block_hashes=index_hashes if self.uses_prefix else [],
        )
        sent = clock.now()
        try:
            plan = self.scheduler.try_admit(job) or await self.scheduler.queued(job)
        except (OverBudget, NoCapacity):
            return Outcome(429)
        admitted = clock.now()
        d_leg = plan.leg(DECODE)
        d = self.by_slot[d_leg.target.slot]
        if plan.disaggregated and not plan.alone:
            hold = d_leg.hold()
            p_leg = plan.leg(PREFILL)
            lease = p_leg.lease()
            p = self.by_slot[p_leg.target.slot]
            s = p.submit(prompt, 1, hashes)
            await s.done
            prefill_done = clock.now()
            prefill_late = prefill_done - lease.predicted
            lease.succeed(s.uncached)
            lease.release()
            hold.release()
            s = None
            lease = d_leg.lease()
            seq = d.submit(prompt, req.out, hashes, remote_kv=True)
        else:  # D (or the one engine) computes the prompt itself
            lease = d_leg.lease()
            seq = d.submit(prompt, req.out, hashes)
            prefill_done, prefill_late = None, 0.0
        first = await seq.first
        if prefill_done is None:  # its prefill was done with its first token
            prefill_done, prefill_late = first, first - lease.predicted
        lease.first_token()
        done = await seq.done
        lease.events = req.out + 3  # the role, finish and usage/[DONE] events frame a stream
        lease.succeed(seq.uncached)
        lease.release()
        tpot = (done - first) / (req.out - 1) if req.out > 1 else 0.0
        judged = job.feasible is not None
        row = self.scheduler.predictor.rows[d_leg.target.slot]
        steps = max(1, req.out - 1)
        return Outcome(
            200,
            first - sent,
            tpot,
            plan.disaggregated and plan.alone,
            admitted - sent + job.ttft_s if judged else 0.0,
            job.tpot_s if judged else 0.0,
            prefill_late,
            first - prefill_done,
            seq.batch_sum / steps,
            seq.prefill_s / (done - first) if done > first else 0.0,
            (job.tpot_model_s - row.decode_step_s) / row.decode_per_seq_s if judged and row.decode_per_seq_s else -1.0,
        )


async def replay(cluster: Cluster, fam: Family, reqs: list[Req], key0: int) -> list[Outcome]:
    loop = asyncio.get_running_loop()
    start = loop.time()
    tasks = []
    for k, r in enumerate(reqs):
        delay = start + r.at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(loop.create_task(cluster.serve(fam, r, key0 + k)))
    return list(await asyncio.gather(*tasks))


@dataclass
class Row:
    family: str
    run: str
    load: float
    goodput: float
    ontime: float  # among admitted
    rejected: float
    ttft_p50: float
    alone: float
    late: list[Outcome] = field(default_factory=list)  # admitted and over a budget


def _p50(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def run_one(fam: Family, run: str, load: float, cap: float, n: int, warmup: int, seed: int) -> Row:
    policy, admission, *flags = run.split(":")
    loop = VirtualLoop()
    clock.use(loop.time)
    try:
        cluster = Cluster(fam, policy, admission, "alone" in flags)

        async def go():
            engines = [loop.create_task(e.run()) for e in cluster.engines.values()]
            engines.append(loop.create_task(cluster.scrape()))
            # Unmeasured warm-up at half load (the model learns the engines), then a pause to drain.
            await replay(cluster, fam, make_requests(fam, warmup, 0.5 * cap, seed + 7), 10**6)
            await asyncio.sleep(5.0)
            reqs = make_requests(fam, n, load * cap, seed)
            out = await replay(cluster, fam, reqs, 0)
            for t in engines:
                t.cancel()
            return out, reqs[-1].at

        outcomes, window = loop.run_until_complete(go())
    finally:
        loop.close()
        clock.use(time.monotonic)
    ok = [o for o in outcomes if o.status == 200]
    late = [o for o in ok if o.ttft > fam.ttft_s or o.tpot > fam.tpot_s]
    good = len(ok) - len(late)
    return Row(
        fam.name,
        run,
        load,
        good / window,
        good / len(ok) if ok else 1.0,
        1.0 - len(ok) / len(outcomes),
        _p50([o.ttft * 1000 for o in ok]),
        sum(o.alone for o in ok) / len(ok) if ok else 0.0,
        late,
    )


def lateness(late: list[Outcome], ttft_s: float, tpot_s: float) -> str:
    """Which budget the late requests missed and by how much their prediction (allowance included) was short:
    the median of observed / predicted for each budget missed."""

    def missed(budget: str, pairs: list[tuple[float, float]]) -> str:
        judged = [o / p for o, p in pairs if p > 0.0]
        text = f"{len(pairs)} over {budget}"
        if judged:
            text += f" (observed/predicted median {_p50(judged):.2f}x, worst {max(judged):.2f}x)"
        return text + (f", {len(pairs) - len(judged)} of them unjudged" if len(judged) < len(pairs) else "")

    ttft_late = [o for o in late if o.ttft > ttft_s]
    tpot_late = [o for o in late if o.tpot > tpot_s]
    by_ttft = [(o.ttft, o.ttft_pred) for o in ttft_late]
    by_tpot = [(o.tpot, o.tpot_pred) for o in tpot_late]
    text = "; ".join(missed(b, pairs) for b, pairs in (("TTFT", by_ttft), ("TPOT", by_tpot)) if pairs)
    if ttft_late:
        text += (
            f"; their prefills finished {_p50([o.prefill_late_s * 1000 for o in ttft_late]):+.0f} ms after the "
            f"expected finish (median), first token {_p50([o.first_wait_s * 1000 for o in ttft_late]):.0f} ms later"
        )
    if tpot_late:
        text += (
            f"; they decoded in batches of {_p50([o.batch for o in tpot_late]):.1f} (median; predicted "
            f"{_p50([o.batch_pred for o in tpot_late if o.batch_pred >= 0]):.1f}), "
            f"{_p50([o.prefill_share for o in tpot_late]):.0%} of their decode time spent on prompts computed there"
        )
    return text


HEADER = f"{'family':<28} {'policy:admission':<24} {'load':>5} {'goodput':>8} {'on-time':>8} {'refused':>8} {'TTFT p50':>9} {'D alone':>8}"


def _format(r: Row) -> str:
    return (
        f"{r.family:<28} {r.run:<24} {r.load:>5.0%} {r.goodput:>8.2f} {r.ontime:>8.1%} {r.rejected:>8.1%} "
        f"{r.ttft_p50:>9.0f} {r.alone:>8.0%}"
    )


def figures(rows: list[Row], families: list[Family], floor: float = 0.95, least_ratio: float = 0.95) -> list[Verdict]:
    """The issue's figures, each the worst over the families (named), against its target."""

    def get(fam: str, run: str, load: float) -> Row | None:
        return next((r for r in rows if r.family == fam and r.run == run and abs(r.load - load) < 1e-9), None)

    def worst(pairs: list[tuple[float, str]]) -> tuple[float, str]:
        return min(pairs, default=(math.nan, "-"))

    admitted = [r for r in rows if r.run.startswith("slo_aware:") and r.run.split(":")[1] != "off"]
    out = []
    ontime, where = worst([(r.ontime, f"{r.family} {r.run} at {r.load:.0%}") for r in admitted])
    out.append(
        Verdict(
            f"admitted on-time, worst of every family, load and admitting run: {ontime:.1%} ({where}; target "
            f"{floor:.0%})",
            not ontime < floor,
            True,
        )
    )
    vs_rr, vs_best, vs_lb = [], [], []
    for fam in families:
        rr, lb = get(fam.name, "round_robin:off", 1.0), get(fam.name, "load_balance:off", 1.0)
        others = [get(fam.name, r, 1.0) for r in ("round_robin:off", "load_balance:off", "kv_cache_affinity:off")]
        best_other = max((o.goodput for o in others if o), default=0.0)
        ad = [r for r in admitted if r.family == fam.name and abs(r.load - 1.0) < 1e-9]
        off = get(fam.name, "slo_aware:off", 1.0)
        if ad and rr and best_other:
            g = max(r.goodput for r in ad)
            vs_rr.append((g / rr.goodput if rr.goodput else math.inf, fam.name))
            vs_best.append((g / best_other, fam.name))
        if off and lb:
            vs_lb.append((off.goodput / lb.goodput if lb.goodput else math.inf, fam.name))
    # Checked (by default): admission loses no more than a tie's few requests (5 %) to round robin or the best other policy (in a
    # light family every policy serves nearly every request, and admission refuses a few that would have made it).
    # Reported: the aims (1.5x round robin, 1.15x the best other), which a family where round robin is
    # nearly perfect cannot reach, and slo_aware without admission against load_balance.
    for name, pairs, target, aim in (
        ("slo_aware with admission / round_robin", vs_rr, least_ratio, AIM_VS_ROUND_ROBIN),
        ("slo_aware with admission / best other", vs_best, least_ratio, AIM_VS_BEST_OTHER),
    ):
        if pairs:
            v, fam = worst(pairs)
            out.append(
                Verdict(
                    f"{name} at 100 %, worst family: {v:.2f}x ({fam}; target {target}x, aim {aim}x)", v >= target, True
                )
            )
    if vs_lb:
        v, fam = worst(vs_lb)
        out.append(
            Verdict(
                f"slo_aware without admission / load_balance at 100 %, worst family: {v:.2f}x ({fam}; aim 1.0x)",
                v >= 1.0,
                False,
            )
        )
    pd, alone = get(families[0].name, "slo_aware:queue", 1.0), get(families[0].name, "slo_aware:queue:alone", 1.0)
    if pd and alone:
        lower = 1 - alone.ttft_p50 / pd.ttft_p50
        out.append(
            Verdict(
                f"{families[0].name} at 100 %: TTFT p50 {alone.ttft_p50:.0f} ms with D alone vs {pd.ttft_p50:.0f} ms "
                f"always PD ({lower:.0%} lower; aim 20 %), goodput {alone.goodput:.2f} vs {pd.goodput:.2f}",
                lower >= 0.2,
                False,
            )
        )
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", type=int, default=13)
    parser.add_argument("--requests", type=int, default=240, help="measured requests per run")
    parser.add_argument("--warmup", type=int, default=60, help="unmeasured requests at half load first")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--loads", default="1.0,1.3")
    parser.add_argument("--runs", default=DEFAULT_RUNS, help="policy:admission[:alone] runs, comma-separated")
    parser.add_argument("--only", default="", help="family names containing this")
    add_args(parser)
    args = parser.parse_args(argv)
    loads = [float(x) for x in args.loads.split(",")]
    families = [make_family(i, args.seed) for i in range(args.families)]
    families = [f for f in families if args.only in f.name]
    started = time.monotonic()
    rows: list[Row] = []
    print(f"seed {args.seed}, {args.requests} requests per run", flush=True)
    print(HEADER, flush=True)
    for fam in families:
        cap = capacity(fam, args.seed)
        print(f"# {fam.name}: {fam.describe()}; capacity {cap:.2f} req/s", flush=True)
        for load in loads:
            for run in args.runs.split(","):
                rows.append(run_one(fam, run, load, cap, args.requests, args.warmup, args.seed))
                print(_format(rows[-1]), flush=True)
                if rows[-1].late and ":off" not in run:
                    print(f"#   late: {lateness(rows[-1].late, fam.ttft_s, fam.tpot_s)}", flush=True)
    print(f"\n({time.monotonic() - started:.0f} s)")
    verdicts = figures(rows, families, args.floor, args.least_ratio)
    return report(verdicts, args.check, f"bench/scheduling.py --check --seed {args.seed}")


if __name__ == "__main__":
    sys.exit(main())
