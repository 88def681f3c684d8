"""Long prompts and the event loop: what a worker's other streams see while megabyte prompts arrive.

    python bench/stall.py                       # 4 prompts of 1 MiB, with and without a tokenizer
    python bench/stall.py --kib 256 --prompts 8 --tokenizer DIR

One Coordinator worker serves two models: `steady`, a simulated engine streaming one token every
`--pace-ms` (engine_sim), and `long`, the fast fake engine (bench/fastfake.c) answering at once. A client
streams from `steady`; once its stream has settled, `--prompts` chat requests of `--kib` KiB arrive at
`long` together. The steady stream's longest gap between chunks while they are served, less its pace, is
what one request's synchronous work cost every other stream on the worker. Then the same prompt alone,
one at a time at concurrency 1: its median time through the Coordinator less its time to the engine
directly. Both with the estimate (no tokenizer) and with `tokenizer_path` set (a tokenizer.json: `--tokenizer`,
else the e2e model's in ~/.cache/motor-e2e when built, else a byte-level BPE trained here).
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import statistics
import sys
import tempfile
import time

import aiohttp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench import overhead  # noqa: E402
from harness.configs import coordinator_config, instance  # noqa: E402
from harness.coordinator import Coordinator  # noqa: E402
from harness.loopback import free_ports  # noqa: E402
from harness.processes import Proc  # noqa: E402


def tokenizer_dir(given: str, workdir: str) -> str:
    if given:
        return given
    cached = sorted(glob.glob(os.path.expanduser("~/.cache/motor-e2e/model-*/tokenizer.json")))
    if cached:
        return os.path.dirname(cached[-1])
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=2000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([overhead.padding(64)], trainer)
    tok.save(os.path.join(workdir, "tokenizer.json"))
    return workdir


def prompt_body(kib: int) -> bytes:
    return json.dumps(
        {"model": "long", "messages": [{"role": "user", "content": overhead.padding(kib)}], "max_tokens": 16}
    ).encode()


async def steady_gaps(url: str, started: asyncio.Event, tokens: int) -> list[tuple[float, float]]:
    """(arrival time, gap since the chunk before) for each chunk of one paced stream."""
    body = {"model": "steady", "messages": [{"role": "user", "content": "count"}], "max_tokens": tokens}
    out, last = [], None
    async with aiohttp.ClientSession() as s, s.post(url, json={**body, "stream": True}) as r:
        async for line in r.content:
            if not line.startswith(b"data:"):
                continue
            now = time.monotonic()
            if last is not None:
                out.append((now, now - last))
            last = now
            if len(out) == 20:
                started.set()
    return out


async def burst(url: str, data: bytes, n: int) -> tuple[float, float]:
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:

        async def one():
            async with s.post(url, data=data, headers=headers) as r:
                await r.read()
                assert r.status == 200, r.status

        t0 = time.monotonic()
        await asyncio.gather(*(one() for _ in range(n)))
        return t0, time.monotonic()


async def stall(coord_url: str, data: bytes, n: int, pace_ms: float) -> dict:
    started = asyncio.Event()
    stream = asyncio.ensure_future(steady_gaps(coord_url, started, 400))
    await started.wait()
    t0, t1 = await burst(coord_url, data, n)
    gaps = await stream
    pace = statistics.median(g for _, g in gaps)
    during = [g for at, g in gaps if t0 <= at <= t1 + 2 * pace_ms / 1000]
    return {"pace_ms": pace * 1000, "longest_ms": max(during) * 1000, "above_pace_ms": (max(during) - pace) * 1000}


async def lone(url: str, data: bytes, times: int) -> float:
    headers = {"Content-Type": "application/json"}
    took = []
    async with aiohttp.ClientSession() as s:
        for _ in range(times):
            t0 = time.monotonic()
            async with s.post(url, data=data, headers=headers) as r:
                await r.read()
            took.append(time.monotonic() - t0)
    return statistics.median(took[1:]) * 1000


def run(opts, workdir: str, tokenizer: str) -> dict:
    fake_port, sim_port = free_ports(2)
    fake = Proc([overhead.build_fake(workdir), str(fake_port), "long"], os.path.join(workdir, "fake.log"))
    sim = Proc(
        [sys.executable, "-m", "engine_sim", "--port", str(sim_port), "--model", "steady"]
        + ["--decode-step-ms", str(opts.pace_ms), "--decode-per-seq-ms", "0", "--log-level", "WARNING"],
        os.path.join(workdir, "sim.log"),
        cwd=os.path.dirname(HERE),
    )
    try:
        overhead.wait_http(fake_port, "/health", 30, fake)
        overhead.wait_http(sim_port, "/health", 30, sim)
        model = {"id": "long", **({"tokenizer_path": tokenizer} if tokenizer else {})}
        cfg = coordinator_config(
            [
                instance(1, "union", "long", f"127.0.0.1:{fake_port}"),
                instance(2, "union", "steady", f"127.0.0.1:{sim_port}"),
            ],
            models=[model, {"id": "steady"}],
            scheduler_config={"health_check_interval": 1.0, "metrics_scrape_interval": 1.0},
        )
        data = prompt_body(opts.kib)
        with Coordinator(cfg, workers=1) as coord:
            url = coord.url + "/v1/chat/completions"
            asyncio.run(lone(url, data, 3))  # warm: connections, the tokenizer's first calls
            out = asyncio.run(stall(url, data, opts.prompts, opts.pace_ms))
            out["lone_ms"] = asyncio.run(lone(url, data, opts.times))
        out["direct_ms"] = asyncio.run(lone(f"http://127.0.0.1:{fake_port}/v1/chat/completions", data, opts.times))
        out["added_ms"] = out["lone_ms"] - out["direct_ms"]
        return out
    finally:
        sim.stop()
        fake.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kib", type=int, default=1024, help="each long prompt's size (default 1024)")
    ap.add_argument("--prompts", type=int, default=4, help="long prompts arriving together (default 4)")
    ap.add_argument("--pace-ms", type=float, default=20.0, help="the steady stream's time per token (default 20)")
    ap.add_argument("--times", type=int, default=9, help="lone requests timed (default 9)")
    ap.add_argument("--tokenizer", default="", help="a tokenizer.json or its directory (default: see above)")
    opts = ap.parse_args(argv)
    workdir = tempfile.mkdtemp(prefix="motor-stall-")
    rows = []
    for label, tok in (("estimate", ""), ("tokenizer_path", tokenizer_dir(opts.tokenizer, workdir))):
        r = run(opts, workdir, tok)
        rows.append((label, r))
        print(f"  {label}: {r}", flush=True)
    print(
        f"\n{opts.prompts} prompts of {opts.kib} KiB arriving together; steady stream at {opts.pace_ms:g} ms a token\n"
    )
    print("| counting | stream's pace ms | longest gap ms | above pace ms | lone prompt ms | direct ms | added ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, r in rows:
        print(
            f"| {label} | {r['pace_ms']:.1f} | {r['longest_ms']:.1f} | {r['above_pace_ms']:.1f} | {r['lone_ms']:.1f} "
            f"| {r['direct_ms']:.1f} | {r['added_ms']:.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
