"""Scheduler pick benchmark: how long choosing the engine(s) for one request takes, per policy and cluster size.

    python bench/pick.py                   # full run, about 15 seconds
    python bench/pick.py --quick           # about 3 seconds
    python bench/pick.py --json out.json   # also write the figures to out.json

No server and no network: the scheduling package (which imports no Sanic) is built in this process the way
a Coordinator worker builds it (app.py: SharedState.create, Registry "set", Ledger, Health,
build_scheduler), over instances with loopback addresses that nothing ever contacts. For every policy
(round_robin, load_balance, kv_cache_affinity, slo_aware) and cluster (1P+1D, 4P+4D, 16P+16D, and
union-only 1U and 8U), each on fresh shared state, and two chat bodies (short: one user message of 20
words; long: 10 messages of 200 words, about 2,400 estimated prompt tokens), it times

    pick    a fresh JobInfo, `prepare` (rendering and counting the prompt, and hashing its blocks for the
            policies that read them) and `plan`: what Dispatcher.job_info and the first plan cost a request
    full    the pick, then the chosen engines' load taken and given back as the dispatcher's handoff does:
            a decode hold, the prefill lease, the decode lease (a union engine: one whole lease)

Before timing, the cluster is made to look like one in service. The learned model knows every engine
(prefill and decode timings fed to it long ago by harness/predictor.py; engines of
four speeds), so slo_aware predicts instead of exploring. The prefix index holds both prompts on the last
prefill (or union) engine, so the affinity policies find a cached prefix. The first half of every pool
has 1-3 requests in flight (open leases, decode holds, scraped engine gauges), so the load-aware policies
compare unequal engines. The benchmark's own leases are released without `succeed()`, as after an error,
so the learned speeds and the prefix index stay as warmed (learning from leases that last microseconds
would teach the model that engines are that fast); the learning a successful request does when it ends
(once, under the shared lock) is therefore not counted. What does move is the virtual prefill queue of an
engine with a prefill in flight: each prefill sent there lengthens it and nothing reports it done, so
slo_aware turns away from such engines, and plans meet the budget less often as a cell runs. That changes
the verdicts, not the work a pick does.

Every figure is the median over 5 batches (3 with --quick) of the mean µs per request within one batch,
timed with time.perf_counter_ns. A batch is sized to last about 30 ms (5 ms with --quick) by one untimed
batch that also warms the cell up (at least 20 requests), so a cheap cell runs thousands of requests a
batch and a dear one dozens, and a run takes about as long on any machine. Before the first cell,
requests run untimed for a moment: a process's first cell is slower otherwise, whichever it is. Garbage
collection stays on (a worker pays for it too); a collection runs before each cell, so that no cell pays
for its predecessor's garbage. On a machine others load, figures move by tens of percent between runs:
compare cells of one run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from config import SCHEDULER_TYPES, Endpoint, Instance, Live, ModelConfig, Settings  # noqa: E402
from harness.bodies import WORDS  # noqa: E402
from harness.predictor import teach_decode, teach_prefill  # noqa: E402
from scheduling.health import Health  # noqa: E402
from scheduling.ledger import DECODE, PREFILL, WHOLE, Ledger  # noqa: E402
from scheduling.policies import JobInfo  # noqa: E402
from scheduling.registry import Registry, Target  # noqa: E402
from scheduling.scheduler import Plan, Scheduler, build_scheduler  # noqa: E402
from scheduling.tokens import CHAT  # noqa: E402
from state.shared import SharedState  # noqa: E402

MODEL = ModelConfig("bench", slo_ttft_ms=2000, slo_tpot_ms=50)
BASE_PORT = 20000  # instance k listens (never) at 127.0.0.1:BASE_PORT+k
MAX_TOKENS = 256


@dataclass(frozen=True)
class Cluster:
    name: str
    prefill: int = 0
    decode: int = 0
    union: int = 0

    def roles(self) -> list[str]:
        return ["prefill"] * self.prefill + ["decode"] * self.decode + ["union"] * self.union


CLUSTERS = (
    Cluster("1P+1D", prefill=1, decode=1),
    Cluster("4P+4D", prefill=4, decode=4),
    Cluster("16P+16D", prefill=16, decode=16),
    Cluster("1U", union=1),
    Cluster("8U", union=8),
)


def words(n: int, offset: int) -> str:
    return " ".join(WORDS[(offset + k) % len(WORDS)] for k in range(n))


def chat(messages: list[dict]) -> dict:
    return {"model": MODEL.id, "messages": messages, "max_tokens": MAX_TOKENS}


PROMPTS = {
    "short": chat([{"role": "user", "content": words(20, 0)}]),
    # Offsets differ per message so the turns are not one repeated text.
    "long": chat([{"role": ("user", "assistant")[k % 2], "content": words(200, 37 * k)} for k in range(10)]),
}

# The engines' speeds, in four tiers so the model has something to choose between (roughly a data-centre
# GPU serving an 8B model): prefill tokens/s, seconds per decode step empty and per running sequence.
PREFILL_TPS = (12000.0, 9000.0, 6000.0, 15000.0)
DECODE_STEP_S = (0.012, 0.015, 0.020, 0.010)
DECODE_PER_SEQ_S = 0.0004


# -- the cluster ---------------------------------------------------------------------------------


def build(policy: str, cluster: Cluster) -> Scheduler:
    """A worker's scheduler over fresh shared state holding `cluster`, as app.py builds one."""
    instances = tuple(
        Instance(k + 1, role, MODEL.id, (Endpoint(0, f"127.0.0.1:{BASE_PORT + k}"),))
        for k, role in enumerate(cluster.roles())
    )
    settings = Settings(scheduler_type=policy, models=(MODEL,), instances=instances)
    shared = SharedState.create()
    registry = Registry(shared)
    registry.apply("set", list(settings.instances))
    ledger = Ledger(shared, 0, settings.num_workers)
    live = Live(settings)
    return build_scheduler(live, shared, registry, ledger, Health(shared, live))


def warm(sched: Scheduler) -> None:
    """Make the cluster look like one in service (see the module docstring)."""
    view = sched.registry.view()
    for k, t in enumerate(view.targets):
        if t.role != "decode":
            teach_prefill(sched.predictor, t.slot, PREFILL_TPS[k % 4], base_s=0.02)
        if t.role != "prefill":
            teach_decode(sched.predictor, t.slot, DECODE_STEP_S[k % 4], DECODE_PER_SEQ_S)
    holder = (view.pool(MODEL.id, "prefill") or view.pool(MODEL.id, "union"))[-1]
    for body in PROMPTS.values():
        sched.index.record(sched.meter(MODEL.id).count(CHAT, body)[1], holder.slot)
    for role in ("prefill", "decode", "union"):
        pool = view.pool(MODEL.id, role)
        for k, t in enumerate(pool[: (len(pool) + 1) // 2]):
            busy(sched, t, 1 + k % 3)


def busy(sched: Scheduler, t: Target, requests: int) -> None:
    """`requests` of ours in flight on `t` (a decode engine also has one promised), and the engine's gauges
    saying so. Never released: the ledger keeps their load for as long as this cluster is measured."""
    kind = {"prefill": PREFILL, "decode": DECODE, "union": WHOLE}[t.role]
    for _ in range(requests):
        sched.lease(t, JobInfo(MODEL.id, 1500, MAX_TOKENS, MODEL.slo_ttft_ms, MODEL.slo_tpot_ms), kind)
    if t.role == "decode":
        sched.hold(t)
    sched.health.set_engine_load(t.slot, running=requests, waiting=requests // 2, kv_usage=0.1 * requests)


# -- one request -----------------------------------------------------------------------------------


class Request:
    """One chat request's scheduling, as serving/dispatch.py and its flows do it, short of any engine call."""

    def __init__(self, sched: Scheduler, body: dict):
        self.sched, self.body = sched, body

    def pick(self) -> tuple[JobInfo, Plan]:
        info = JobInfo(MODEL.id, 0, MAX_TOKENS, MODEL.slo_ttft_ms, MODEL.slo_tpot_ms)  # prepare() counts the prompt
        self.sched.prepare(info, CHAT, self.body)
        return info, self.sched.plan(info)

    def full(self) -> None:
        sched = self.sched
        info, plan = self.pick()
        if plan.disaggregated:  # Dispatcher._handoff: D's hold while P prefills, then the decode leg
            hold = sched.hold(plan.target)
            sched.lease(plan.prefill, info, PREFILL).release()
            hold.release()
            sched.lease(plan.target, info, DECODE).release()
        else:
            sched.lease(plan.target, info, WHOLE).release()


# -- timing --------------------------------------------------------------------------------------


def timed(step: Callable[[], object], n: int) -> float:
    """Mean µs per call over `n` calls."""
    t0 = time.perf_counter_ns()
    for _ in range(n):
        step()
    return (time.perf_counter_ns() - t0) / n / 1000.0


def measure(step: Callable[[], object], batch_s: float, batches: int) -> tuple[list[float], int]:
    """(µs per call in each of `batches` batches, calls per batch), a batch lasting about `batch_s`."""
    gc.collect()
    n = max(20, round(batch_s * 1e6 / timed(step, 20)))  # the first calls also build the model's prompt meter
    # One untimed batch: the interpreter specialises the hot code and the caches fill; it also sizes the batches.
    n = max(20, round(batch_s * 1e6 / timed(step, n)))
    return [timed(step, n) for _ in range(batches)], n


def warm_up(seconds: float) -> None:
    """Run requests untimed for a while: without it the first cell of a process measured slower than the
    same cell later, whichever cell came first (cold interpreter and memory caches, a CPU clock ramping up)."""
    sched = build(SCHEDULER_TYPES[-1], CLUSTERS[1])
    warm(sched)
    steps = [step for req in (Request(sched, body) for body in PROMPTS.values()) for step in (req.pick, req.full)]
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for step in steps:
            timed(step, 20)


def run(batch_s: float, batches: int, report: Callable[[dict], None]) -> list[dict]:
    warm_up(10 * batch_s)
    rows = []
    for policy in SCHEDULER_TYPES:
        for cluster in CLUSTERS:
            sched = build(policy, cluster)
            warm(sched)
            for prompt, body in PROMPTS.items():
                req = Request(sched, body)
                row = {
                    "policy": policy,
                    "cluster": cluster.name,
                    "prompt": prompt,
                    "prompt_tokens": req.pick()[0].prompt_tokens,
                }
                for name, step in (("pick", req.pick), ("full", req.full)):
                    per_batch, n = measure(step, batch_s, batches)
                    row[f"{name}_us"] = round(statistics.median(per_batch), 2)
                    # Every batch's figure too: on a shared machine their spread says how far to trust the median.
                    row[f"{name}_batches_us"] = [round(us, 2) for us in per_batch]
                    row[f"{name}_calls_per_batch"] = n
                report(row)
                rows.append(row)
    return rows


def print_row(row: dict) -> None:
    print(
        f"| {row['policy']} | {row['cluster']} | {row['prompt']} | {row['pick_us']:.1f} | {row['full_us']:.1f} |",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--quick", action="store_true", help="shorter batches, fewer of them (about 3 s in all)")
    ap.add_argument("--json", metavar="PATH", help="also write the results to PATH")
    args = ap.parse_args()
    batch_s, batches = (0.005, 3) if args.quick else (0.03, 5)

    cpus = os.cpu_count()
    print(f"Python {platform.python_version()} ({platform.python_implementation()}), {cpus} CPUs, {platform.machine()}")
    print(f"median of {batches} batches of ~{batch_s * 1000:.0f} ms each; µs per request\n")
    print("| policy | cluster | prompt | pick µs (prepare+plan) | full µs (with leases) |")
    print("|---|---|---|--:|--:|", flush=True)
    started = time.monotonic()
    rows = run(batch_s, batches, print_row)
    print(f"\n{len(rows)} cells in {time.monotonic() - started:.1f} s")
    if args.json:
        result = {
            "python": platform.python_version(),
            "implementation": platform.python_implementation(),
            "cpus": cpus,
            "quick": args.quick,
            "batches": batches,
            "batch_s": batch_s,
            "rows": rows,
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
