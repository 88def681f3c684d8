"""The exact-token path through the whole Coordinator, per request, beside vllm-router 0.1.17; both in front of
engine_sim.

    pip install -r bench/requirements.txt        # vllm-router==0.1.17, for this bench only
    python bench/tokenizer_gateways.py           # the e2e model's tokenizer when built, else a trained one
    python bench/tokenizer_gateways.py --tokenizer DIR --times 5

* **CPU per request** at 0/32/256/1024 KiB of chat prompt: `--times` chats, each new (its own first line, so no
  cache of pieces helps), sent one at a time through each gateway to one engine_sim (union, zero latency, a
  context long enough for a MiB prompt); the gateway's CPU (user + system of its process tree, /proc) over
  them and a second after (a prompt whose encoding outlasts the Coordinator's 0.25 s wait is encoded to the end
  meanwhile), less an idle second's CPU (each thread's CPU in ns, /proc/PID/task/TID/schedstat): what the
  gateway spent on the request, relay included. Gateways: the Coordinator (1
  worker, `kv_cache_affinity`) with the model's `tokenizer_path` (its chat rendered and encoded off the loop:
  scheduling/exact.py) and with the estimate; vllm-router 0.1.17 with `--policy cache_aware`. vllm-router
  does not tokenize in the router for HTTP workers (a message in its binary: "... is ignored: HTTP worker pools
  do not tokenize in the router"; it has no tokenizer flag): `cache_aware` keeps a tree of the prompts'
  characters (`--max-tree-size`, a character budget), and `kv_aware` takes the ids from the engine (its binary
  names `/v1/chat/completions/render`, which engine_sim does not serve). So its row is what its prompt-dependent
  routing costs, and the Coordinator's estimate row is the like for like.
* **Longest wait** (the Coordinator's loop stall): while 4 new chats of 1 MiB go through the Coordinator together,
  small chats of another model, served by a second engine_sim, go through it one at a time; the longest a small
  one took, less the median small one's time before the burst: what the long prompts' work cost another request
  on the worker. Not for vllm-router: its one pool would put the small chats behind the long ones at the engine
  (engine_sim's own handling of a MiB prompt), which measures the engine.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench import overhead  # noqa: E402
from bench.stall import tokenizer_dir  # noqa: E402
from harness.configs import coordinator_config, instance  # noqa: E402
from harness.coordinator import Coordinator  # noqa: E402
from harness.loopback import free_ports  # noqa: E402
from harness.processes import Proc  # noqa: E402

SIZES_KIB = (0, 32, 256, 1024)
MODEL, SMALL = "m", "small"
SETTLE_S = 1.0


def chat(kib: int, salt: str, model: str = MODEL) -> str:
    text = salt + "\n" + overhead.padding(kib)
    return json.dumps({"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 4})


def cpu_s(root: int) -> float:
    """The CPU of `root`'s process tree, each live thread's from its schedstat (ns; /proc/PID/stat counts ticks)."""
    total = 0
    for pid in overhead.tree(root):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                continue
    return total / 1e9


def post(port: int, data: str) -> float:
    t0 = time.perf_counter()
    status, _, raw = overhead.request(port, "POST", "/v1/chat/completions", data, timeout_s=120)
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {raw[:200]!r}")
    return time.perf_counter() - t0


def cpu_per_request(port: int, pid: int, label: str, times: int) -> list[float]:
    out = []
    for kib in SIZES_KIB:
        post(port, chat(kib, f"warm {label} {kib}"))
        t0 = cpu_s(pid)
        time.sleep(SETTLE_S)
        idle = cpu_s(pid) - t0  # health checks and scrapes meanwhile, taken off again below
        before = cpu_s(pid)
        for i in range(times):
            post(port, chat(kib, f"{label} {kib} {i} {time.time_ns()}"))
        time.sleep(SETTLE_S)  # an encoding past the Coordinator's bounded wait finishes off the request's path
        out.append((cpu_s(pid) - before - idle) / times * 1000)
    return out


def longest_wait(port: int, label: str) -> float:
    small = chat(0, "small", SMALL)
    base = statistics.median(post(port, small) for _ in range(20))
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        burst = [pool.submit(post, port, chat(1024, f"burst {label} {i} {time.time_ns()}")) for i in range(4)]
        worst = 0.0
        while not all(f.done() for f in burst):
            worst = max(worst, post(port, small))
        for f in burst:
            f.result()
    return (worst - base) * 1000


def router(engine_port: int, workdir: str) -> tuple[Proc, int]:
    exe = shutil.which("vllm-router") or os.path.join(os.path.dirname(sys.executable), "vllm-router")
    port, metrics = free_ports(2)
    args = [exe, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", f"http://127.0.0.1:{engine_port}"]
    args += ["--policy", "cache_aware", "--log-level", "warning"]
    args += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics)]
    proc = Proc(args, os.path.join(workdir, "vllm-router.log"))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            post(port, chat(0, "ready"))
            return proc, port
        except (OSError, RuntimeError):
            time.sleep(0.2)
    proc.stop()
    raise RuntimeError("vllm-router did not serve within 60 s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", default="", help="a tokenizer.json or its directory")
    ap.add_argument("--times", type=int, default=5, help="new chats timed per size and gateway (default 5)")
    opts = ap.parse_args(argv)
    workdir = tempfile.mkdtemp(prefix="motor-tokgw-")
    tok = tokenizer_dir(opts.tokenizer, workdir)
    engine_port, small_port = free_ports(2)
    sims = [
        Proc(
            [sys.executable, "-m", "engine_sim", "--port", str(port), "--model", model, "--zero-latency"]
            + ["--max-model-len", str(1 << 22), "--kv-capacity-tokens", str(1 << 23), "--log-level", "WARNING"],
            os.path.join(workdir, f"sim-{model}.log"),
            cwd=os.path.dirname(HERE),
        )
        for port, model in ((engine_port, MODEL), (small_port, SMALL))
    ]
    rows: list[tuple[str, list[float], float | None]] = []
    try:
        for port, sim in zip((engine_port, small_port), sims, strict=True):
            overhead.wait_http(port, "/health", 30, sim)
        for label, model in (("Coordinator, tokenizer_path", {"tokenizer_path": tok}), ("Coordinator, estimate", {})):
            cfg = coordinator_config(
                [
                    instance(1, "union", MODEL, f"127.0.0.1:{engine_port}"),
                    instance(2, "union", SMALL, f"127.0.0.1:{small_port}"),
                ],
                models=[{"id": MODEL, **model}, {"id": SMALL}],
                scheduler_config={"scheduler_type": "kv_cache_affinity"},
                log_config={"log_level": "WARNING"},
            )
            with Coordinator(cfg, workers=1) as coord:
                port = int(coord.url.rsplit(":", 1)[1])
                rows.append(
                    (label, cpu_per_request(port, coord.proc.pid, label, opts.times), longest_wait(port, label))
                )
            print(f"  {rows[-1]}", flush=True)
        if shutil.which("vllm-router") or os.path.exists(os.path.join(os.path.dirname(sys.executable), "vllm-router")):
            proc, port = router(engine_port, workdir)
            try:
                rows.append(
                    (
                        "vllm-router 0.1.17, cache_aware",
                        cpu_per_request(port, proc.pid, "router", opts.times),
                        None,
                    )
                )
            finally:
                proc.stop()
            print(f"  {rows[-1]}", flush=True)
        else:
            print("vllm-router not installed: pip install -r bench/requirements.txt", file=sys.stderr)
    finally:
        for sim in sims:
            sim.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    print("\n| gateway | " + " | ".join(f"CPU ms/request at {k} KiB" for k in SIZES_KIB) + " | longest wait ms |")
    print("|---" + "|---:" * (len(SIZES_KIB) + 1) + "|")
    for label, cpu, wait in rows:
        shown = "-" if wait is None else f"{wait:.1f}"
        print(f"| {label} | " + " | ".join(f"{c:.2f}" for c in cpu) + f" | {shown} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
