"""Prefix-cache hit rate of real vLLM engines on seeded multi-turn traces, per way of routing them.

    bash tests/e2e/vllm_up.sh python bench/kv_hitrate.py      # starts the e2e engines, runs, stops them
    ... bench/kv_hitrate.py --seeds 33,7,8                      # one trace per seed (33, the default: the test's)
    ... bench/kv_hitrate.py --stream                            # every answer streamed (the default: JSON)

The trace is harness/kv_trace.py's (the KV-event e2e test's): 16 chats of 5 turns over 3 shared system
prompts, interleaved, greedy answers carried into the next turn, 2 requests in flight (`--concurrency`), sent to vllm_up.sh's
two union engines (prefix caching, KV events, 32-token blocks, 64 blocks of cache each) from empty caches after
the first engine answered 6 chats' first turns straight. The hit rate is the engines' own
`vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total` over the run. Two runs of one trace can differ
by a few hundredths (which requests share the engines' batches moves evictions), more than the gaps between the
best ways of routing, so compare them over several seeds. Ways of routing:

* the Coordinator's `round_robin`; `kv_cache_affinity` on its estimate (events off) and on the engines' KV
  events; `slo_aware` on KV events (with them: the share of requests whose predicted cached tokens equal
  the engine's, the Coordinator's `motor_kv_prediction_total`);
* sticky: chat i always straight to engine i mod 2;
* vllm-router 0.1.17 (`pip install -r bench/requirements.txt` into the e2e venv, never the
  Coordinator's: a Rust wheel with its own dependencies) with `--policy cache_aware`, and `kv_aware` fed the
  same engines' KV events (`--kv-event-source URL=ENDPOINT`, `--kv-event-replay-source`, block size 32;
  it takes tcp:// addresses only, so the engines' Unix sockets are relayed to 127.0.0.1 ports here).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import httpx  # noqa: E402
import zmq  # noqa: E402

from harness.coordinator import Coordinator  # noqa: E402
from harness.kv_trace import (  # noqa: E402
    CONCURRENCY,
    caught_up,
    coordinator_cfg,
    kv_addresses,
    kv_states,
    make_trace,
    measure,
    predictions,
)
from harness.loopback import free_ports, wait_until  # noqa: E402

UNIONS = ("union", "union2")
EVENTS = "Coordinator kv_cache_affinity, KV events"
ROUTER = os.path.join(
    os.environ.get("MOTOR_E2E_CACHE", os.path.expanduser("~/.cache/motor-e2e")), "vllm-venv/bin/vllm-router"
)


def through_coordinator(env: dict, policy: str, kv_events: bool) -> tuple[float, float | None]:
    unions = [(env[name], kv_addresses(env["run"], name)) for name in UNIONS]
    cfg = coordinator_cfg(unions, env["model"], env["model_dir"], policy, kv_events)
    with Coordinator(cfg, ready_timeout_s=180.0) as coord:
        if kv_events and not caught_up(coord, env["model"], env["urls"]):
            raise SystemExit(f"KV events not live: {kv_states(coord)}")
        result = measure(
            env["trace"], env["model"], env["urls"], lambda i: coord.url, env["concurrency"], env["stream"]
        )
        if not kv_events:
            return result.hit_rate, None
        n = len(result.usages)
        wait_until(lambda: sum(predictions(coord).values()) == n, 10)
        return result.hit_rate, predictions(coord).get("exact", 0.0) / n


def through_router(env: dict, policy: str) -> float:
    port, prom = free_ports(2)
    cmd = [ROUTER, "--host", "127.0.0.1", "--port", str(port), "--policy", policy, "--worker-urls", *env["urls"]]
    cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom)]
    if policy == "kv_aware":
        for name in UNIONS:
            pub, replay = relay(kv_addresses(env["run"], name))
            cmd += ["--kv-event-source", f"http://{env[name]}={pub}"]
            cmd += ["--kv-event-replay-source", f"http://{env[name]}={replay}"]
        cmd += ["--kv-event-block-size", "32", "--kv-event-model", env["model"]]
    log_path = os.path.join(env["run"], f"vllm-router-{policy}.log")
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT) as proc:
        try:
            if not wait_until(lambda: _up(url), 120, 0.5):
                raise SystemExit(f"vllm-router {policy} did not start: see {log_path}")
            return measure(
                env["trace"], env["model"], env["urls"], lambda i: url, env["concurrency"], env["stream"]
            ).hit_rate
        finally:
            proc.terminate()


def relay(kv: dict) -> tuple[str, str]:
    """tcp://127.0.0.1 addresses relaying an engine's ipc:// KV events (vllm-router takes tcp:// only, and vLLM
    binds its publisher only on ipc:// or every interface): a PUB relay and a replay relay, in daemon threads."""
    ctx = zmq.Context.instance()
    pub_port, replay_port = free_ports(2)
    xsub, xpub = ctx.socket(zmq.XSUB), ctx.socket(zmq.XPUB)
    xsub.connect(kv["endpoint"])
    xpub.bind(f"tcp://127.0.0.1:{pub_port}")
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.bind(f"tcp://127.0.0.1:{replay_port}")
    dealer.connect(kv["replay_endpoint"])
    for front, back in ((xpub, xsub), (router, dealer)):
        threading.Thread(target=zmq.proxy, args=(front, back), daemon=True).start()
    return f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}"


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-router", action="store_true", help="skip vllm-router (not installed)")
    ap.add_argument("--concurrency", type=int, default=CONCURRENCY, help="requests in flight")
    ap.add_argument("--only", default="", help="only the rows whose name contains one of these, comma-separated")
    ap.add_argument("--seeds", default="33", help="the traces' seeds, comma-separated (33: the e2e test's trace)")
    ap.add_argument("--stream", action="store_true", help="stream every answer (slo_aware learns only from streams)")
    args = ap.parse_args()
    try:
        env = {name: os.environ[f"MOTOR_E2E_{name.upper()}"] for name in UNIONS}
        env.update(run=os.environ["MOTOR_E2E_RUN"], model=os.environ["MOTOR_E2E_MODEL"])
        env["model_dir"] = os.environ["MOTOR_E2E_MODEL_DIR"]
    except KeyError as e:
        raise SystemExit(f"{e} unset: run it as `bash tests/e2e/vllm_up.sh python bench/kv_hitrate.py`") from None
    env["urls"] = [f"http://{env[name]}" for name in UNIONS]
    env["concurrency"], env["stream"] = args.concurrency, args.stream
    seeds = [int(seed) for seed in args.seeds.split(",")]
    only = [word for word in args.only.split(",") if word]
    rates: dict[str, list[float]] = {}
    exacts: dict[str, list[float]] = {}

    def row(name: str, run) -> None:
        if only and not any(word in name for word in only):
            return
        started = time.monotonic()
        got = run()
        rate, exact = got if isinstance(got, tuple) else (got, None)
        rates.setdefault(name, []).append(rate)
        if exact is not None:
            exacts.setdefault(name, []).append(exact)
        print(
            f"seed {env['seed']}, {name}: hit rate {rate:.3f}"
            + (f", exact predictions {exact:.3f}" if exact is not None else "")
            + f" ({time.monotonic() - started:.0f} s)",
            flush=True,
        )

    for seed in seeds:
        env["seed"], env["trace"] = seed, make_trace(seed)
        row("Coordinator round_robin", lambda: through_coordinator(env, "round_robin", False))
        row("Coordinator kv_cache_affinity, estimate", lambda: through_coordinator(env, "kv_cache_affinity", False))
        row(EVENTS, lambda: through_coordinator(env, "kv_cache_affinity", True))
        row("Coordinator slo_aware, KV events", lambda: through_coordinator(env, "slo_aware", True))
        row(
            "sticky (chat i on engine i mod 2, direct)",
            lambda: measure(
                env["trace"], env["model"], env["urls"], lambda i: env["urls"][i % 2], env["concurrency"], env["stream"]
            ).hit_rate,
        )
        if not args.no_router:
            row("vllm-router 0.1.17 cache_aware", lambda: through_router(env, "cache_aware"))
            row("vllm-router 0.1.17 kv_aware", lambda: through_router(env, "kv_aware"))
    print(table(seeds, rates, exacts))


def table(seeds: list[int], rates: dict[str, list[float]], exacts: dict[str, list[float]]) -> str:
    """Markdown: each routing's hit rate per trace seed and their mean, its exact predictions' mean, and (beside
    KV events' row) the seeds on which KV events' rate was above it."""
    events = rates.get(EVENTS)
    head = "| routing | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | exact predictions | KV events above |"
    lines = ["", head, "|---|" + "---:|" * (len(seeds) + 3)]
    for name, got in rates.items():
        exact = exacts.get(name)
        above = "" if events is None or name == EVENTS else f"{sum(e > r for e, r in zip(events, got))} of {len(got)}"
        lines.append(
            f"| {name} | "
            + " | ".join(f"{r:.3f}" for r in got)
            + f" | {sum(got) / len(got):.3f} | {'' if not exact else f'{sum(exact) / len(exact):.3f}'} | {above} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
