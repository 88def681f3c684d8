"""Scheduling benchmark: one seeded workload replayed against every policy on a simulated P/D cluster.

    python bench/scheduling.py [--speedup 5] [--requests 120] [--seed 7] [--runs policy:admission,...]

Each policy gets its own copy of the cluster: four engine_sim processes (two prefill, two decode; one
of each twice as slow) behind the real Coordinator (`python app.py`, harness/coordinator.py). All copies
start first; the client then sends the same requests to each in turn, load level by load level (an
unmeasured warm-up at 50 %, then Poisson arrivals at 70 %, 100 % and 130 % of capacity), so slow
moments of a shared machine fall on every policy alike. Requests are streamed chat completions; the
client measures TTFT and TPOT itself. The simulators run `--speedup` times faster than the "cluster
time" every figure is quoted in: the client converts its wall-clock measurements back by that factor,
and the SLOs the Coordinator gets (`models[].slo_ttft/slo_tpot`, wall-clock ms) are the cluster SLOs
divided by it.

Before any measured traffic, every shared system prompt is prefilled once on every prefill engine,
straight to the engine: each engine's prefix cache (the simulator's default, 200,000 tokens) then holds
all of them, as in a steady state.

Capacity is the arrival rate the cluster could sustain with perfect routing, from engine speeds
*measured* on this machine before the run (a loaded machine runs the simulators slower than their
nominal figures): the smaller of
  prefill: the sum over prefill engines of 1 / (base + u / rate), u the mean prompt tokens minus the
           shared system prompt (every system prompt a prefix-cache hit: each prefill engine's cache
           holds all of them), and
  decode:  the sum over decode engines of B / step(B), B the largest batch whose measured step time
           meets the TPOT SLO, divided by the mean output tokens.

The table: goodput (requests per cluster second meeting both SLOs, over the arrival window), SLO
attainment (share of all requests meeting both) and among admitted ones, p50/p99 TTFT and TPOT of the
answered requests (cluster ms), and the share refused with 429. The last line is machine-readable.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from harness.bodies import WORDS  # noqa: E402
from harness.configs import coordinator_config, instance  # noqa: E402
from harness.coordinator import Coordinator  # noqa: E402

MODEL = "bench"
SLO_TTFT_MS = 8000.0  # cluster time
SLO_TPOT_MS = 100.0
# The simulated cluster, in cluster time: (role, uncached prefill tokens/s, decode step ms, ms per sequence).
ENGINES = (
    ("prefill", 800.0, 5.0, 0.5),
    ("prefill", 400.0, 10.0, 1.0),  # twice as slow
    ("decode", 8000.0, 10.0, 15.0),
    ("decode", 4000.0, 20.0, 30.0),  # twice as slow
)
BLOCK = 16


# -- workload ----------------------------------------------------------------------------------


def _text(rng: random.Random, tokens: int) -> str:
    """ASCII text the engines count as `tokens` tokens (4 bytes each)."""
    out, size = [], 0
    while size < tokens * 4:
        w = rng.choice(WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[: tokens * 4]


@dataclass
class Req:
    system: int  # index of the shared system prompt, -1 for none
    user_tokens: int
    max_tokens: int
    body: bytes = b""

    def prompt_tokens(self, systems: list[str]) -> int:
        return (len(systems[self.system]) // 4 if self.system >= 0 else 0) + self.user_tokens


def make_systems(seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"[system prompt {i}] " + _text(rng, rng.randint(1000, 3000) - 5) for i in range(20)]


def make_requests(seed: int, n: int, systems: list[str], bodies: bool = True) -> list[Req]:
    """A quarter short prompts (100-1,000 tokens, no system prompt); the rest one of the 20 system prompts
    plus a user part of 50-5,000 tokens (log-uniform): prompts span 100-8,000 tokens."""
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        if rng.random() < 0.25:
            r = Req(-1, int(math.exp(rng.uniform(math.log(100), math.log(1000)))), rng.randint(16, 96))
        else:
            r = Req(
                rng.randrange(len(systems)),
                int(math.exp(rng.uniform(math.log(50), math.log(5000)))),
                rng.randint(16, 96),
            )
        if bodies:
            messages = [{"role": "system", "content": systems[r.system]}] if r.system >= 0 else []
            messages.append({"role": "user", "content": f"request {seed}-{i}: " + _text(rng, r.user_tokens)})
            r.body = json.dumps(
                {"model": MODEL, "messages": messages, "max_tokens": r.max_tokens, "ignore_eos": True, "stream": True}
            ).encode()
        reqs.append(r)
    return reqs


@dataclass
class Speeds:
    """Engine speeds measured on this machine, in cluster time."""

    prefill: list[tuple[float, float]]  # per prefill engine: (base s, tokens/s)
    decode: list[tuple[float, float]]  # per decode engine: (step s, s per sequence)

    def capacity(self, systems: list[str], seed: int) -> tuple[float, float, float]:
        """(capacity, prefill capacity, decode capacity) in requests per cluster second (see the docstring)."""
        sample = make_requests(seed, 20000, systems, bodies=False)
        uncached = sum(r.user_tokens for r in sample) / len(sample) + 20  # the chat template's tokens
        out = sum(r.max_tokens for r in sample) / len(sample)
        prefill = sum(1.0 / (base + uncached / rate) for base, rate in self.prefill)
        tokens_per_s = 0.0
        for step, per_seq in self.decode:
            batch = int((SLO_TPOT_MS / 1000.0 - step) // per_seq) if per_seq > 0 else 64
            if batch >= 1:
                tokens_per_s += batch / (step + per_seq * batch)
        decode = tokens_per_s / out
        return min(prefill, decode), prefill, decode


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares intercept and slope."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return max(0.0, my - slope * mx), max(slope, 1e-9)


async def measure_speeds(cluster: Cluster, speedup: float) -> Speeds:
    """Time the engines directly, one at a time: prefills of two sizes, decode streams at two batch sizes."""
    import aiohttp

    rng = random.Random(1)
    async with aiohttp.ClientSession() as session:

        async def prefill(url: str, tokens: int) -> float:
            body = {"model": MODEL, "prompt": _text(rng, tokens), "max_tokens": 1}
            started = time.perf_counter()
            async with session.post(url + "/v1/completions", json=body) as resp:
                await resp.read()
            return (time.perf_counter() - started) * speedup

        async def stream(url: str, tokens: int) -> float:
            body = {"model": MODEL, "prompt": _text(rng, 8), "max_tokens": tokens, "ignore_eos": True, "stream": True}
            first = last = 0.0
            n = 0
            async with session.post(url + "/v1/completions", json=body) as resp:
                async for line in resp.content:
                    if line.startswith(b"data: {") and b'"text":"' in line and b'"text":""' not in line:
                        last = time.perf_counter()
                        first = first or last
                        n += 1
            return (last - first) / (n - 1) * speedup

        speeds = Speeds([], [])
        for role, url in cluster.engines:  # the median of 3 tries at each point: a busy machine has hiccups
            if role == "prefill":
                await prefill(url, 16)  # the first request of a process is slower
                points = [(t, statistics.median([await prefill(url, t) for _ in range(3)])) for t in (400, 3200)]
                base, per_token = _line(points)
                speeds.prefill.append((base, 1.0 / per_token))
            else:
                points = []
                for batch in (1, 4):
                    tries = []
                    for _ in range(3):
                        times = await asyncio.gather(*(stream(url, 40) for _ in range(batch)))
                        tries.append(sum(times) / batch)
                    points.append((batch, statistics.median(tries)))
                speeds.decode.append(_line(points))
    return speeds


def serve_sim(config_json: str) -> None:
    """Child process: one engine_sim server; prints its port."""
    from engine_sim import SimConfig, serve

    async def main():
        srv = await serve(SimConfig(**json.loads(config_json)))
        print(f"port {srv.port}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


class Cluster:
    def __init__(self, policy: str, admission: str, speedup: float):
        self.policy, self.admission = policy, admission
        self.sims, self.engines, instances = [], [], []
        for i, (role, rate, step_ms, per_seq_ms) in enumerate(ENGINES, start=1):
            cfg = {
                "role": role,
                "model": MODEL,
                "speedup": speedup,
                "prefill_tokens_per_s": rate,
                "decode_step_ms": step_ms,
                "decode_per_seq_ms": per_seq_ms,
                "block_size": BLOCK,
                "kv_hold_timeout_s": 60.0,
            }
            proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--serve-sim", json.dumps(cfg)],
                stdout=subprocess.PIPE,
                cwd=ROOT,
                start_new_session=True,
            )
            self.sims.append(proc)
            port = int(proc.stdout.readline().split()[1])
            self.engines.append((role, f"http://127.0.0.1:{port}"))
            instances.append(instance(i, role, MODEL, f"127.0.0.1:{port}"))
        models = [{"id": MODEL, "slo_ttft": round(SLO_TTFT_MS / speedup), "slo_tpot": round(SLO_TPOT_MS / speedup)}]
        cfg = coordinator_config(
            instances,
            models,
            scheduler_config={"scheduler_type": policy, "admission": admission, "metrics_scrape_interval": 0.5},
            exception_config={"retry_delay": 0.01, "max_retry": 1},
        )
        self.coordinator = Coordinator(cfg, ready_timeout_s=180.0)  # a busy machine starts workers slowly
        self.url = self.coordinator.url + "/v1/chat/completions"

    def stop(self) -> None:
        self.coordinator.stop()
        for proc in self.sims:
            proc.terminate()
        for proc in self.sims:
            proc.wait(10)


# -- client ------------------------------------------------------------------------------------


@dataclass
class Result:
    status: int
    ttft_s: float = 0.0  # wall clock
    tpot_s: float = 0.0
    tokens: int = 0


async def one(session, url: str, req: Req) -> Result:
    import aiohttp

    sent = time.perf_counter()
    first = last = 0.0
    n = 0
    try:
        async with session.post(url, data=req.body, headers={"Content-Type": "application/json"}) as resp:
            if resp.status != 200:
                await resp.read()
                return Result(resp.status)
            async for line in resp.content:
                if line.startswith(b"data: {") and b'"content":"' in line and b'"content":""' not in line:
                    last = time.perf_counter()
                    if not n:
                        first = last
                    n += 1
    except (TimeoutError, aiohttp.ClientError):
        return Result(599)
    if not n:
        return Result(598)
    return Result(200, first - sent, (last - first) / (n - 1) if n > 1 else 0.0, n)


async def phase(session, url: str, reqs: list[Req], rate_wall: float, rng: random.Random) -> tuple[list[Result], float]:
    """Send `reqs` with Poisson arrivals at `rate_wall` per second; (results, arrival window in wall seconds)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    at, tasks = 0.0, []
    for req in reqs:
        at += rng.expovariate(rate_wall)
        delay = start + at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(loop.create_task(one(session, url, req)))
    return list(await asyncio.gather(*tasks)), at


@dataclass
class Row:
    policy: str
    admission: str
    load: float
    offered: float
    goodput: float
    attainment: float
    admitted_attainment: float
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float
    rejected: float
    errors: int


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarize(
    policy: str, admission: str, load: float, offered: float, results: list[Result], window_s: float, speedup: float
) -> Row:
    ok = [r for r in results if r.status == 200]
    ttft = [r.ttft_s * speedup * 1000 for r in ok]
    tpot = [r.tpot_s * speedup * 1000 for r in ok]
    good = sum(1 for a, b in zip(ttft, tpot) if a <= SLO_TTFT_MS and b <= SLO_TPOT_MS)
    rejected = sum(1 for r in results if r.status == 429)
    errors = sum(1 for r in results if r.status not in (200, 429))
    admitted = len(results) - rejected
    return Row(
        policy,
        admission,
        load,
        offered,
        good / (window_s * speedup),
        good / len(results),
        good / admitted if admitted else 0.0,
        _pct(ttft, 0.5),
        _pct(ttft, 0.99),
        _pct(tpot, 0.5),
        _pct(tpot, 0.99),
        rejected / len(results),
        errors,
    )


async def prefill_directly(session, url: str, messages: list[dict]) -> None:
    body = {"model": MODEL, "messages": messages, "max_tokens": 1}
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        await resp.read()


async def prewarm(session, url: str, systems: list[str]) -> None:
    """Prefill every shared system prompt once on a prefill engine, straight to it: its prefix cache then
    holds all of them, as it does in a steady state (the capacity figure assumes it)."""
    for text in systems:
        await prefill_directly(session, url, [{"role": "system", "content": text}, {"role": "user", "content": "-"}])


async def run(args, systems: list[str], clusters: list[Cluster], loads: list[float]) -> list[Row]:
    import aiohttp

    speeds = await measure_speeds(clusters[0], args.speedup)
    cap, prefill_cap, decode_cap = speeds.capacity(systems, args.seed)
    print(
        "measured (cluster time): prefill "
        + ", ".join(f"{rate:.0f} tokens/s + {base * 1000:.0f} ms" for base, rate in speeds.prefill)
        + "; decode step "
        + ", ".join(f"{a * 1000:.0f} + {b * 1000:.1f}/seq ms" for a, b in speeds.decode)
        + f"\ncapacity {cap:.2f} req/s (prefill {prefill_cap:.2f}, decode {decode_cap:.2f})"
    )
    rows = []
    timeout = aiohttp.ClientTimeout(total=None, sock_read=300)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        await asyncio.gather(
            *(prewarm(session, url, systems) for c in clusters for role, url in c.engines if role == "prefill")
        )
        print(HEADER, flush=True)
        for cluster in clusters:
            warm = make_requests(args.seed + 1000, args.warmup, systems)
            await phase(session, cluster.url, warm, 0.5 * cap * args.speedup, random.Random(args.seed + 1000))
        for k, load in enumerate(loads):
            reqs = make_requests(args.seed + k, args.requests, systems)
            for cluster in clusters:
                rng = random.Random(args.seed + k)
                results, window = await phase(session, cluster.url, reqs, load * cap * args.speedup, rng)
                rows.append(
                    summarize(cluster.policy, cluster.admission, load, load * cap, results, window, args.speedup)
                )
                print(_format(rows[-1]), flush=True)
                await asyncio.sleep(1.0)
    return rows


HEADER = (
    f"{'policy':<18} {'admission':<9} {'load':>5} {'offered':>8} {'goodput':>8} {'attain':>7} {'adm.att':>7} "
    f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'rejected':>8}"
)


def _format(r: Row) -> str:
    return (
        f"{r.policy:<18} {r.admission:<9} {r.load:>5.0%} {r.offered:>8.2f} {r.goodput:>8.2f} {r.attainment:>7.1%} "
        f"{r.admitted_attainment:>7.1%} {r.ttft_p50:>9.0f} {r.ttft_p99:>9.0f} {r.tpot_p50:>9.1f} {r.tpot_p99:>9.1f} "
        f"{r.rejected:>8.1%}" + (f"  ({r.errors} errors)" if r.errors else "")
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--speedup", type=float, default=5.0, help="simulated cluster time per wall-clock second")
    parser.add_argument("--requests", type=int, default=120, help="requests per load level")
    parser.add_argument("--warmup", type=int, default=30, help="unmeasured requests at 50 %% load first")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--loads", default="0.7,1.0,1.3")
    parser.add_argument(
        "--runs",
        default="round_robin:off,load_balance:off,kv_cache_affinity:off,slo_aware:reject",
        help="policy:admission pairs, comma-separated",
    )
    parser.add_argument("--serve-sim", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_sim:
        serve_sim(args.serve_sim)
        return 0
    systems = make_systems(args.seed)
    loads = [float(x) for x in args.loads.split(",")]
    print(
        f"cluster (nominal, cluster time): prefill {ENGINES[0][1]:.0f} and {ENGINES[1][1]:.0f} tokens/s; decode step "
        f"{ENGINES[2][2]:.0f} + {ENGINES[2][3]:.0f}/seq ms and {ENGINES[3][2]:.0f} + {ENGINES[3][3]:.0f}/seq ms; "
        f"SLO TTFT {SLO_TTFT_MS:.0f} ms, TPOT {SLO_TPOT_MS:.0f} ms; speedup {args.speedup:g}; "
        f"{args.requests} requests per load, seed {args.seed}",
        flush=True,
    )
    started = time.monotonic()
    clusters: list[Cluster] = []
    try:
        for spec in args.runs.split(","):
            policy, _, admission = spec.partition(":")
            clusters.append(Cluster(policy, admission or "off", args.speedup))
        rows = asyncio.run(run(args, systems, clusters, loads))
    finally:
        for cluster in clusters:
            cluster.stop()
    print(f"({time.monotonic() - started:.0f} s)\n")
    print(HEADER)
    for r in rows:
        print(_format(r))
    print(verdict_line(rows))
    return 0


def verdict_line(rows: list[Row]) -> str:
    def goodput(policy: str, load: float) -> float:
        found = [r.goodput for r in rows if r.policy == policy and abs(r.load - load) < 1e-9 and r.admission != "queue"]
        return found[0] if found else float("nan")

    slo = goodput("slo_aware", 1.0)
    others = [goodput(p, 1.0) for p in ("round_robin", "load_balance", "kv_cache_affinity")]
    best = max((g for g in others if not math.isnan(g)), default=float("nan"))
    rr = others[0]
    at130 = [
        r.admitted_attainment
        for r in rows
        if r.policy == "slo_aware" and r.admission == "reject" and abs(r.load - 1.3) < 1e-9
    ]
    return (
        f"slo_aware_vs_round_robin={slo / rr if rr else float('inf'):.2f} "
        f"slo_aware_vs_best_other={slo / best if best else float('inf'):.2f} "
        f"admitted_attainment_130={at130[0] if at130 else float('nan'):.2f}"
    )


if __name__ == "__main__":
    sys.exit(main())
