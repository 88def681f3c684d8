"""Wall-clock scheduling benchmark: the real Coordinator (`python app.py`) over HTTP against engine_sim processes.

    python bench/wallclock.py [--seed N] [--requests 100] [--warmup 24] [--fill N] [--runs ...] [--load 1.0] [--check]

Each seed draws one workload (`draw`): 2-5 prefill engines and 1-4 decode engines up to 4x apart in speed,
an arrival process (Poisson, bursty on/off, a ramp, a diurnal swell), a prompt mix (narrow, bimodal,
long-tailed up to 32k tokens) with or without hot shared system prompts, an output mix, SLOs from tight to
loose, a load of 50-150 % of the computed capacity, and one or two Coordinator workers. Every run (a policy
and an admission mode) starts its own Coordinator on the same engines (prefix caches reset between runs),
sends unmeasured warm-up requests at half load (the model learns the engines), then unmeasured fill requests
at the run's load, Poisson, for as long as a stream lasts at capacity, and straight after them the measured
ones, streaming /v1/completions with the budgets in `x-slo-ttft-ms` / `x-slo-tpot-ms`. The fill is what makes
the load the measured requests meet the load named: a decode batch grows to its steady size over one stream's
life, and a window shorter than that (100 requests at 45 a second against streams of 5 s) meets batches a
fraction of that size, where every policy is on time.

Time is scaled: every engine runs `speedup` times as fast as its nominal speeds (engine_sim's `--speedup`,
0.25-2), the budgets are divided and the arrival rate multiplied by the same factor, so the workload is the
nominal one seen through another clock. What does not scale is the Coordinator's own CPU, HTTP, the scrape interval
and asyncio's timer slack on a loaded machine: the factor is chosen so that about `--rate` requests a second
arrive in wall time (what two shared cores relay without the client or the Coordinator saturating) and never
above 2, so a nominal 8 ms decode step stays 4 ms of wall time, several times the timer slack. Figures are
reported in nominal seconds.

Per run: goodput (requests meeting both budgets per nominal second of the arrival window), on-time among the
admitted (answered) requests, refused (429). Under each admitting run with late requests: why they were late
(`attribute`): each late request's TTFT is cut into PARTS, P's from engine_sim's own schedule replayed from the
arrivals P recorded, and given a cause.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import functools
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

import aiohttp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.overhead import engine_sims  # noqa: E402
from bench.scheduling import Req, arrival_times, draw_requests  # noqa: E402
from bench.verdicts import AIM_VS_BEST_OTHER, AIM_VS_ROUND_ROBIN, Verdict, add_args, report  # noqa: E402
from harness.configs import coordinator_config, instance  # noqa: E402
from harness.coordinator import Coordinator  # noqa: E402
from scheduling.tokens import BYTES_PER_TOKEN  # noqa: E402

MODEL = "wall"
BLOCK = 16
CHUNK = 8192  # engine_sim's max_num_batched_tokens (vLLM's default for chunked prefill)
MAX_SEQS = 64
MAX_LEN = 40_000
FILL_MAX = 240  # fill requests at most (at --rate 4, a minute of wall time a run)
DEFAULT_RUNS = "round_robin:off,load_balance:off,kv_cache_affinity:off,slo_aware:off,slo_aware:reject,slo_aware:queue"
ARRIVALS = ("poisson", "bursty", "ramp", "diurnal")
MIXES = ("narrow", "bimodal", "longtail")
OUTPUTS = ("short", "bimodal", "longtail")


# -- the workload generator ------------------------------------------------------------------------


@dataclass
class Workload:
    seed: int
    workers: int
    prefills: list[float]  # tokens/s
    decodes: list[tuple[float, float]]  # (step ms, ms per sequence)
    arrival: str
    mix: str
    output: str
    hot_share: float  # requests opening with a hot system prompt
    systems: list[int]  # their lengths in tokens
    ttft_s: float
    tpot_s: float
    load: float

    def describe(self) -> str:
        ps = "/".join(f"{r / 1000:.1f}k" for r in self.prefills)
        ds = "/".join(f"{a:.0f}+{b:.2f}" for a, b in self.decodes)
        return (
            f"{self.workers} worker(s); P {ps} tok/s; D {ds} ms/step; {self.arrival}, prompts {self.mix}, outputs "
            f"{self.output}, hot prefixes {self.hot_share:.0%} of {len(self.systems)}; SLO TTFT {self.ttft_s:.2f} s "
            f"TPOT {self.tpot_s * 1000:.0f} ms; load {self.load:.0%}"
        )


def draw(seed: int) -> Workload:
    """One workload, every parameter drawn from `seed`."""
    rng = random.Random(seed)
    fast = rng.uniform(4000.0, 12000.0)
    prefills = [fast] + [fast * rng.uniform(0.25, 1.0) for _ in range(rng.randint(1, 4))]
    base_step, base_seq = rng.uniform(6.0, 12.0), rng.uniform(0.3, 1.0)
    decodes = [(base_step, base_seq)]
    for _ in range(rng.randint(0, 3)):
        slow = rng.uniform(1.0, 4.0)
        decodes.append((base_step * slow, base_seq * slow))
    hot = rng.choice((0.0, 0.4, 0.8))
    systems = [rng.randint(500, 4000) for _ in range(rng.randint(1, 6))] if hot else []
    tpot = rng.uniform(1.5, 5.0) * max(a + 4 * b for a, b in decodes) / 1000.0
    return Workload(
        seed,
        rng.choice((1, 2)),
        prefills,
        decodes,
        rng.choice(ARRIVALS),
        rng.choice(MIXES),
        rng.choice(OUTPUTS),
        hot,
        systems,
        rng.uniform(0.8, 4.0),
        tpot,
        rng.uniform(0.5, 1.5),
    )


def _user_tokens(w: Workload, rng: random.Random) -> int:
    if w.mix == "narrow":
        return rng.randint(300, 1200)
    if w.mix == "bimodal":
        return rng.randint(100, 500) if rng.random() < 0.75 else rng.randint(3000, 10000)
    return min(32000, int(150 * rng.paretovariate(1.2)))


def _out_tokens(w: Workload, rng: random.Random) -> int:
    if w.output == "short":
        return rng.randint(16, 64)
    if w.output == "bimodal":
        return rng.randint(16, 48) if rng.random() < 0.7 else rng.randint(150, 300)
    return min(600, int(16 * rng.paretovariate(1.3)))


def requests(w: Workload, n: int, rate: float, seed: int, arrival: str = "") -> list[Req]:
    """`n` requests (arrivals in nominal seconds) at a mean `rate`, arriving as `arrival` says (default: the
    workload's process); a bursty cycle is 12 s or a third of the window."""
    rng = random.Random(seed)
    times = arrival_times(arrival or w.arrival, n, rate, rng, min(12.0, n / rate / 3))
    return draw_requests(
        times, rng, w.systems, w.hot_share, functools.partial(_user_tokens, w), functools.partial(_out_tokens, w)
    )


def _sample(w: Workload) -> list[Req]:
    """Requests enough to take the workload's means from."""
    return requests(w, 4000, 1.0, w.seed + 99)


def _steady_batches(w: Workload) -> list[tuple[int, float]]:
    """Per decode engine, the largest batch whose step meets the TPOT budget, and that step in nominal seconds."""
    out = []
    for step, per_seq in w.decodes:
        batch = min(MAX_SEQS, max(1, int((w.tpot_s * 1000 - step) / per_seq)))
        out.append((batch, (step + per_seq * batch) / 1000))
    return out


def capacity(w: Workload) -> float:
    """Requests per nominal second the cluster sustains with perfect routing: the smaller of the prefill
    capacity (the engines' rates over the mean uncached prompt, hot prefixes cached) and the decode capacity
    (per engine, the largest batch whose step meets the TPOT budget, over the mean output)."""
    sample = _sample(w)
    uncached = statistics.mean(r.user for r in sample)
    out = statistics.mean(r.out for r in sample)
    prefill = sum(rate / uncached for rate in w.prefills)
    return min(prefill, sum(batch / step for batch, step in _steady_batches(w)) / out)


def fill_requests(w: Workload, cap: float) -> int:
    """The fill's requests: arrivals at the run's load for as long as a stream lasts at capacity (the mean
    output at the slowest engine's steady step), at most FILL_MAX."""
    life = statistics.mean(r.out for r in _sample(w)) * max(step for _, step in _steady_batches(w))
    return min(FILL_MAX, math.ceil(w.load * cap * life))


# -- prompts ---------------------------------------------------------------------------------------

LETTERS = bytes.maketrans(bytes(range(256)), bytes(b"abcdefghijklmnopqrstuvwxyz"[i % 26] for i in range(256)))


def _text(rng: random.Random, tokens: int) -> str:
    """`tokens` tokens of ASCII (engine_sim counts BYTES_PER_TOKEN bytes a token, as the Coordinator's estimate does)."""
    return rng.randbytes(BYTES_PER_TOKEN * tokens).translate(LETTERS).decode()


def prompt_text(w: Workload, req: Req, key: int) -> str:
    system = _text(random.Random(-1 - req.system), w.systems[req.system]) if req.system >= 0 else ""
    return system + _text(random.Random(key), req.user)


def prompt_texts(w: Workload, reqs: list[Req], key0: int) -> list[str]:
    """The prompts of `reqs`, request k's own part drawn from key `key0 + k`: the same in every process."""
    return [prompt_text(w, r, key0 + k) for k, r in enumerate(reqs)]


# -- engines ---------------------------------------------------------------------------------------


class Engines:
    """The workload's engine_sim processes, `speedup` times faster than nominal."""

    def __init__(self, w: Workload, speedup: float, workdir: str):
        specs = [("prefill", rate, 0.0, 0.0) for rate in w.prefills]
        # A decode engine computes no prompt in P/D (its KV is pulled); its prefill rate is the fastest's.
        specs += [("decode", w.prefills[0], step, per_seq) for step, per_seq in w.decodes]
        args = []
        for role, rate, step, per_seq in specs:
            a = ["--role", role, "--model", MODEL, "--prefill-tokens-per-s", f"{rate:.1f}"]
            a += ["--decode-step-ms", f"{step:.3f}", "--decode-per-seq-ms", f"{per_seq:.4f}"]
            a += ["--speedup", f"{speedup:.4f}", "--max-model-len", str(MAX_LEN)]
            a += ["--max-num-batched-tokens", str(CHUNK), "--max-num-seqs", str(MAX_SEQS)]
            args.append(a + ["--kv-capacity-tokens", "4000000"])
        started = engine_sims(args, workdir)
        self.procs = [proc for proc, _ in started]
        self.addresses = [address for _, address in started]
        self.roles = [role for role, *_ in specs]
        # Each prefill engine's address and its nominal rate (tokens/s).
        self.prefill_rates = {a: rate for a, (role, rate, *_) in zip(self.addresses, specs) if role == "prefill"}

    def instances(self) -> list[dict]:
        return [instance(k + 1, role, MODEL, a) for k, (role, a) in enumerate(zip(self.roles, self.addresses))]

    async def reset(self, session: aiohttp.ClientSession) -> None:
        """Empty prefix caches and recorded requests: each run starts from the same engines."""
        for a in self.addresses:
            async with session.post(f"http://{a}/reset_prefix_cache") as r:
                await r.read()
            async with session.post(f"http://{a}/sim/reset") as r:
                await r.read()

    async def records(self, session: aiohttp.ClientSession) -> dict[str, list[dict]]:
        out = {}
        for a in self.addresses:
            async with session.get(f"http://{a}/sim/requests") as r:
                out[a] = await r.json()
        return out

    def stop(self) -> None:
        for p in self.procs:
            p.stop(5.0)


# -- one run ---------------------------------------------------------------------------------------


@dataclass
class Outcome:
    rid: str
    req: Req
    sent: float  # wall time.time()
    status: int = 0
    first: float = 0.0
    done: float = 0.0
    tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.first - self.sent

    @property
    def tpot(self) -> float:
        return (self.done - self.first) / (self.tokens - 1) if self.tokens > 1 else 0.0


async def send(
    session: aiohttp.ClientSession, url: str, w: Workload, req: Req, key: int, text: str, speedup: float, tag: str
) -> Outcome:
    body = {
        "model": MODEL,
        "prompt": text,
        "max_tokens": req.out,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {
        "x-request-id": f"{tag}-{key}",
        "x-slo-ttft-ms": f"{w.ttft_s * 1000 / speedup:.3f}",
        "x-slo-tpot-ms": f"{w.tpot_s * 1000 / speedup:.3f}",
    }
    o = Outcome(f"{tag}-{key}", req, time.time())
    try:
        async with session.post(url, json=body, headers=headers) as r:
            o.status = r.status
            if r.status != 200:
                await r.read()
                return o
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                if b'"text":' not in line or b'"text":""' in line:
                    continue
                now = time.time()
                if not o.first:
                    o.first = now
                o.tokens += 1
                o.done = now
    except aiohttp.ClientError:
        o.status = 599
    except asyncio.CancelledError:  # cut off by `replay`: what it had so far
        pass
    return o


async def replay(
    session, url: str, w: Workload, parts: list[tuple[list[Req], str, int]], speedup: float
) -> list[list[Outcome]]:
    """Each part's requests (with its tag, its prompts `prompt_texts`' from its key) sent at their times on one
    clock; each part's outcomes. It ends when the last part's requests are done: the others' still streaming
    then are cut off (a fill's long answers would otherwise hold every run for minutes after its measured end)."""
    sends = []
    for part, (reqs, tag, key0) in enumerate(parts):
        texts = prompt_texts(w, reqs, key0)  # made before the clock starts
        sends += [(r.at, part, k, r, texts[k], tag) for k, r in enumerate(reqs)]
    sends.sort(key=lambda x: x[:3])
    start = time.monotonic()
    tasks: list[list[asyncio.Task]] = [[] for _ in parts]
    for at, part, k, r, text, tag in sends:
        delay = start + at / speedup - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks[part].append(asyncio.create_task(send(session, url, w, r, k, text, speedup, tag)))
    last = await asyncio.gather(*tasks[-1])
    for t in (t for part in tasks[:-1] for t in part):
        t.cancel()
    return [list(await asyncio.gather(*part)) for part in tasks[:-1]] + [list(last)]


@dataclass
class Row:
    run: str
    goodput: float  # per nominal second
    ontime: float  # among admitted
    ttft_p50_ms: float  # nominal
    sent: int
    answered: int
    refused_n: int
    late: list[dict] = field(default_factory=list)  # attributed late admitted requests
    causes: collections.Counter = field(default_factory=collections.Counter)

    @property
    def refused(self) -> float:
        return self.refused_n / self.sent


def coordinator_cfg(w: Workload, engines: Engines, run: str) -> dict:
    policy, admission = run.split(":")[:2]
    return coordinator_config(
        engines.instances(),
        models=[{"id": MODEL}],
        inference_workers_config={"num_workers": w.workers},
        scheduler_config={
            "scheduler_type": policy,
            "admission": admission,
            "health_check_interval": 1.0,
            "metrics_scrape_interval": 0.5,
        },
        log_config={"log_level": "WARNING"},
    )


def start_coordinator(w: Workload, engines: Engines, run: str, tries: int = 3) -> Coordinator:
    """`python app.py` for `run`; on fresh ports again when another process took one of those chosen."""
    for left in reversed(range(tries)):
        try:
            return Coordinator(coordinator_cfg(w, engines, run))
        except RuntimeError as e:
            if not left or "Address already in use" not in str(e):
                raise


def run_one(w: Workload, cap: float, engines: Engines, run: str, n: int, warmup: int, fill: int, speedup: float) -> Row:
    """One run at `w.load` of the workload's capacity `cap`: `warmup` requests at half load, then `fill` at the
    run's load and the `n` measured ones after them."""
    with start_coordinator(w, engines, run) as coord:
        url = coord.url + "/v1/completions"

        async def go():
            conn = aiohttp.TCPConnector(limit=0)
            timeout = aiohttp.ClientTimeout(total=600)
            async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
                await engines.reset(session)
                warmup_reqs = requests(w, warmup, 0.5 * cap, w.seed + 7)
                (warm,) = await replay(session, url, w, [(warmup_reqs, "warm", 10**6)], speedup)
                await asyncio.sleep(1.0)
                filling = requests(w, fill, w.load * cap, w.seed + 13, "poisson") if fill else []
                reqs = requests(w, n, w.load * cap, w.seed)
                after = filling[-1].at if filling else 0.0
                measured = [dataclasses.replace(r, at=r.at + after) for r in reqs]
                filled, out = await replay(session, url, w, [(filling, "fill", 2 * 10**6), (measured, "m", 0)], speedup)
                return warm + filled, out, reqs[-1].at, await engines.records(session)

        warm, outcomes, window, records = asyncio.run(go())
    ok = [o for o in outcomes if o.status == 200 and o.tokens]
    late = [o for o in ok if o.ttft * speedup > w.ttft_s or o.tpot * speedup > w.tpot_s]
    good = len(ok) - len(late)
    row = Row(
        run,
        good / window,
        good / len(ok) if ok else 1.0,
        statistics.median(o.ttft * speedup * 1000 for o in ok) if ok else math.nan,
        len(outcomes),
        len(ok),
        sum(1 for o in outcomes if o.status == 429),
    )
    if late and ":off" not in run:
        row.late, row.causes = attribute(w, engines, records, warm, ok, late, speedup)
    return row


# -- why admitted requests miss --------------------------------------------------------------------


@dataclass
class _Prefill:
    """A prompt in p_schedule's replayed engine."""

    rid: str
    left: int  # tokens still to compute
    at: float  # its arrival
    residual: float  # the rest of the step running when it arrived
    system: int  # its hot system prompt's index, -1 none
    continuous_end: float  # its finish in a continuous FIFO queue at the true rate
    first_step: float | None = None  # when its first chunk's step began


def p_schedule(rate: float, arrivals: list[tuple]) -> dict[str, tuple[float, float, float, float]]:
    """engine_sim's loop on a prefill engine, replayed in nominal seconds from its arrivals (time, prompt tokens,
    hot system prompt's tokens or 0, its index, id). Per id: (the rest of the step running when it arrived, the
    wait for the steps after that before its first chunk, its own steps up to its last chunk, its finish minus
    the finish a continuous FIFO queue at the true rate gives: the Coordinator's model of an engine with the
    rate known exactly). As engine_sim: FIFO, a step takes up to CHUNK prompt tokens and lasts their time at
    `rate`, arrivals join at the next step, a prompt's blocks are cached when its prefill is done."""
    out: dict[str, tuple[float, float, float, float]] = {}
    cached: set[int] = set()
    pending = collections.deque(sorted(arrivals))
    running: list[_Prefill] = []
    now = queue_end = 0.0
    residual_of: dict[str, float] = {}
    while pending or running:
        while pending and pending[0][0] <= now and len(running) < MAX_SEQS:
            at, tokens, hot, system, rid = pending.popleft()
            uncached = max(1, tokens - ((hot // BLOCK) * BLOCK if hot and system in cached else 0))
            queue_end = max(queue_end, at) + uncached / rate
            running.append(_Prefill(rid, uncached, at, residual_of.get(rid, 0.0), system if hot else -1, queue_end))
        if not running:
            now = pending[0][0]
            continue
        budget, took, finished = CHUNK, 0, []
        for s in running:
            if budget <= 0:
                break
            take = min(s.left, budget)
            s.first_step = now if s.first_step is None else s.first_step
            budget, took, s.left = budget - take, took + take, s.left - take
            if not s.left:
                finished.append(s)
        end = now + took / rate
        for at, *_, rid in pending:  # arrivals during this step wait for its end
            if at >= end:
                break
            residual_of.setdefault(rid, end - max(at, now))
        now = end
        for s in finished:
            running.remove(s)
            if s.system >= 0:
                cached.add(s.system)
            out[s.rid] = (s.residual, s.first_step - s.at - s.residual, now - s.first_step, now - s.continuous_end)
    return out


# A late request's TTFT in parts (nominal seconds): the Coordinator's (its arrival to the prefill leg's at P,
# admission queue included); P's as a continuous queue at the true rate predicts it; what engine_sim's chunked
# steps add to that (queueing behind the engine's own batch: the rest of a running step, sharing a step with
# prompts sent after it); P's wall-clock lag behind its replayed schedule (timer slack, the machine's load, P's
# answer and the handoff over HTTP); the decode engine's (its arrival to the client's first token).
PARTS = ("coordinator", "P, continuous queue", "P, own batch", "P, wall-clock lag", "D to first token")
# Causes named for the parts a perfect model would still miss (all but the continuous queue).
CAUSES = (
    "Coordinator (admission queue included)",
    "",
    "queueing behind P's own batch",
    "simulator's wall-clock lag",
    "decode first token",
)


def _arrival(records: list[dict]) -> dict[str, tuple[float, dict]]:
    out = {}
    for rec in records:
        rid = {k.lower(): v for k, v in rec.get("headers", {}).items()}.get("x-request-id", "")
        out.setdefault(rid, (rec["time"], rec.get("body") or {}))
    return out


def attribute(
    w: Workload,
    engines: Engines,
    records: dict,
    warm: list[Outcome],
    ok: list[Outcome],
    late: list[Outcome],
    speedup: float,
):
    """Each answered request's TTFT cut into PARTS; each late one's cause: of the parts a perfect model would
    miss, the one furthest above its median among the on-time requests, when that is at least a tenth of the
    TTFT budget; otherwise `prefill rate / load error` (the learned rate, the virtual queue: not measured
    apart). A TPOT miss is `decode (TPOT)`. P's schedule is replayed from the warm-up's arrivals on (they fill
    its prefix cache)."""
    at_p: dict[str, tuple[str, float]] = {}
    at_d: dict[str, float] = {}
    for address, role in zip(engines.addresses, engines.roles, strict=True):
        for rid, (t, _) in _arrival(records.get(address, [])).items():
            if role == "prefill":
                at_p[rid] = (address, t)
            else:
                at_d[rid] = t
    t0 = min((o.sent for o in warm + ok), default=0.0)
    schedules = {}
    for address, rate in engines.prefill_rates.items():
        arrivals = []
        for o in warm + ok:
            where = at_p.get(o.rid)
            if where and where[0] == address:
                hot = w.systems[o.req.system] if o.req.system >= 0 else 0
                arrivals.append(((where[1] - t0) * speedup, o.req.prompt(w), hot, o.req.system, o.rid))
        schedules.update(p_schedule(rate, arrivals))
    parts: dict[str, tuple[float, ...]] = {}
    for o in ok:
        if o.rid not in at_p or o.rid not in at_d or o.rid not in schedules:
            continue  # D alone, or a leg not recorded
        p_at, d_at = at_p[o.rid][1], at_d[o.rid]
        step, queue, own, batch = schedules[o.rid]
        lag = (d_at - p_at) * speedup - step - queue - own
        modelled = step + queue + own - batch
        parts[o.rid] = ((p_at - o.sent) * speedup, modelled, batch, lag, (o.first - d_at) * speedup)
    late_ids = {o.rid for o in late}
    on_time = [p for rid, p in parts.items() if rid not in late_ids]
    typical = [statistics.median(p[i] for p in on_time) if on_time else 0.0 for i in range(len(PARTS))]
    rows, causes = [], collections.Counter()
    for o in late:
        if o.ttft * speedup <= w.ttft_s:
            causes["decode (TPOT)"] += 1
            rows.append({"rid": o.rid, "budget": "TPOT", "tpot_ms": o.tpot * speedup * 1000})
            continue
        p = parts.get(o.rid)
        if p is None:
            causes["unattributed (no P leg)"] += 1
            continue
        excess = {i: p[i] - typical[i] for i in range(len(PARTS)) if CAUSES[i]}
        worst = max(excess, key=excess.__getitem__)
        cause = CAUSES[worst] if excess[worst] >= 0.1 * w.ttft_s else "prefill rate / load error"
        causes[cause] += 1
        rows.append({"rid": o.rid, "budget": "TTFT", "ttft_s": o.ttft * speedup, "parts": p, "cause": cause})
    return rows, causes


# -- report ----------------------------------------------------------------------------------------

HEADER = f"{'policy:admission':<24} {'goodput':>8} {'on-time':>8} {'refused':>8} {'TTFT p50':>9}"


def _format(r: Row) -> str:
    return f"{r.run:<24} {r.goodput:>8.2f} {r.ontime:>8.1%} {r.refused:>8.1%} {r.ttft_p50_ms:>9.0f}"


def why_late(r: Row) -> str:
    """The late requests' causes and, for those late on TTFT, the median of each part of their TTFT."""
    text = ", ".join(f"{n} {cause}" for cause, n in r.causes.most_common())
    ttft = [x["parts"] for x in r.late if x["budget"] == "TTFT"]
    if ttft:
        medians = ", ".join(
            f"{name} {statistics.median(p[i] for p in ttft) * 1000:.0f}" for i, name in enumerate(PARTS)
        )
        text += f"; their TTFT's parts (median ms, nominal): {medians}"
    return text


def figures(rows: list[Row], floor: float = 0.95, least_ratio: float = 0.95) -> list[Verdict]:
    """bench/scheduling.py's figures for one workload: admitted on time in the admitting runs (checked), admission's
    goodput against round robin and the best other policy (checked at `least_ratio`, aims reported), slo_aware
    without admission against load_balance (reported)."""
    by = {r.run: r for r in rows}
    admitting = [r for r in rows if r.run.startswith("slo_aware:") and not r.run.endswith(":off")]
    out = []
    if admitting:
        worst = min(admitting, key=lambda r: r.ontime)
        out.append(
            Verdict(
                f"admitted on-time, worst admitting run: {worst.ontime:.1%} ({worst.run}; target {floor:.0%})",
                worst.ontime >= floor,
                True,
            )
        )
        best = max(r.goodput for r in admitting)
        others = [by[r] for r in ("round_robin:off", "load_balance:off", "kv_cache_affinity:off") if r in by]
        for name, base, aim in (
            ("round_robin", [by["round_robin:off"]] if "round_robin:off" in by else [], AIM_VS_ROUND_ROBIN),
            ("best other", others, AIM_VS_BEST_OTHER),
        ):
            if base:
                g = max(b.goodput for b in base)
                v = best / g if g else math.inf
                out.append(
                    Verdict(
                        f"slo_aware with admission / {name}: {v:.2f}x (target {least_ratio}x, aim {aim}x)",
                        v >= least_ratio,
                        True,
                    )
                )
    if "slo_aware:off" in by and "load_balance:off" in by:
        lb = by["load_balance:off"].goodput
        v = by["slo_aware:off"].goodput / lb if lb else math.inf
        out.append(Verdict(f"slo_aware without admission / load_balance: {v:.2f}x (aim 1.0x)", v >= 1.0, False))
    return out


def speedup_for(w: Workload, cap: float, rate: float) -> float:
    """The time scale: about `rate` arrivals a wall second at `w.load` of the capacity `cap`, at most 2x faster
    than nominal (see the docstring)."""
    return min(2.0, max(0.25, rate / (w.load * cap)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--requests", type=int, default=100, help="measured requests per run")
    parser.add_argument("--warmup", type=int, default=24, help="unmeasured requests at half load first")
    parser.add_argument(
        "--fill",
        type=int,
        default=-1,
        help="unmeasured requests at the run's load just before the measured ones (default: a stream's life, "
        f"at most {FILL_MAX})",
    )
    parser.add_argument("--rate", type=float, default=4.0, help="wall-clock arrivals a second to aim at")
    parser.add_argument("--runs", default=DEFAULT_RUNS, help="policy:admission runs, comma-separated")
    parser.add_argument("--workers", type=int, default=0, help="Coordinator workers (default: the seed's draw)")
    parser.add_argument(
        "--load",
        type=float,
        default=0.0,
        help="arrivals as a share of the capacity, 1.0 = 100 %% (default: the seed's draw)",
    )
    add_args(parser)
    parser.add_argument("--json", default="", help="write the rows and late requests' parts here")
    args = parser.parse_args(argv)
    w = draw(args.seed)
    if args.workers:
        w.workers = args.workers
    if args.load:
        w.load = args.load
    cap = capacity(w)
    speedup = speedup_for(w, cap, args.rate)
    fill = fill_requests(w, cap) if args.fill < 0 else args.fill
    print(f"seed {args.seed}: {w.describe()}", flush=True)
    print(
        f"# capacity {cap:.2f} req/s nominal, arrivals {w.load * cap:.2f} req/s; {speedup:.2f}x wall clock; "
        f"{fill} fill requests",
        flush=True,
    )
    print(HEADER, flush=True)
    started = time.monotonic()
    rows = []
    workdir = tempfile.mkdtemp(prefix="motor-wallclock-")
    engines = Engines(w, speedup, workdir)
    try:
        for run in args.runs.split(","):
            rows.append(run_one(w, cap, engines, run, args.requests, args.warmup, fill, speedup))
            print(_format(rows[-1]), flush=True)
            if rows[-1].causes:
                print(f"#   late: {why_late(rows[-1])}", flush=True)
    finally:
        engines.stop()
    print(f"\n({time.monotonic() - started:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "seed": args.seed,
                    "workload": w.describe(),
                    "speedup": speedup,
                    "fill": fill,
                    "rows": [
                        {
                            "run": r.run,
                            "goodput": r.goodput,
                            "ontime": r.ontime,
                            "refused": r.refused,
                            "answered": r.answered,
                            "refused_n": r.refused_n,
                            "late": r.late,
                        }
                        for r in rows
                    ],
                },
                f,
            )
    verdicts = figures(rows, args.floor, args.least_ratio)
    return report(verdicts, args.check, f"bench/wallclock.py --check --seed {args.seed}")


if __name__ == "__main__":
    sys.exit(main())
