"""Recorded engine timings for the learned model's accuracy tests (tests/test_scheduling_predict.py).

    python -m harness.traces tests/data/engine_sim_trace.json

records one trace from a real engine_sim server on loopback, in real time: bursts of prefills of mixed
sizes (short prompts between long ones, as a bursty chat workload sends them) against one engine, then
streams decoding in batches of different sizes. Each prefill is (sent, uncached prompt tokens as the
engine reported them, answered); each stream is (started, first token, done, events, batch). The tests
replay it through scheduling/predict.py as the scheduler would and measure its errors.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time

import aiohttp

from engine_sim import SimConfig, serve
from harness.bodies import WORDS

SPEEDUP = 4.0  # the engine runs this much faster than its nominal speeds; times are recorded as seen


def _text(rng: random.Random, tokens: int) -> str:
    out, size = [], 0
    while size < tokens * 4:
        w = rng.choice(WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[: tokens * 4]


async def _prefills(session, url: str, rng: random.Random, t0: float) -> list[list[float]]:
    async def one(tokens: int) -> list[float]:
        body = {"model": "m", "prompt": _text(rng, tokens), "max_tokens": 1}
        sent = time.monotonic()
        async with session.post(url, json=body) as resp:
            usage = (await resp.json())["usage"]
        done = time.monotonic()
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return [sent - t0, usage["prompt_tokens"] - cached, done - t0]

    tasks = []
    for _burst in range(12):  # a burst of 6-14 prefills, 70 % short, then a pause
        for _ in range(rng.randint(6, 14)):
            tokens = rng.randint(60, 400) if rng.random() < 0.7 else rng.randint(2000, 6000)
            tasks.append(asyncio.create_task(one(tokens)))
            await asyncio.sleep(rng.expovariate(40.0))
        await asyncio.sleep(rng.uniform(0.3, 1.2))
    return sorted(await asyncio.gather(*tasks))


async def _streams(session, url: str, rng: random.Random, t0: float) -> list[list[float]]:
    async def one(tokens: int, batch: int) -> list[float]:
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": _text(rng, 20)}],
            "max_tokens": tokens,
            "ignore_eos": True,
            "stream": True,
        }
        started, first, events = time.monotonic(), 0.0, 0
        async with session.post(url, json=body) as resp:
            async for line in resp.content:
                if line.startswith(b"data:"):
                    events += 1
                    if events == 2:  # the first token's event (after the role's)
                        first = time.monotonic()
        return [started - t0, first - t0, time.monotonic() - t0, events, batch]

    out = []
    for batch in (1, 2, 4, 8, 12, 16, 24, 4, 1, 16):
        out += await asyncio.gather(*(one(rng.randint(30, 60), batch) for _ in range(batch)))
    return out


async def record() -> dict:
    rng = random.Random(25)
    sim = SimConfig(model="m", speedup=SPEEDUP, prefill_tokens_per_s=6000.0, decode_step_ms=10.0, decode_per_seq_ms=1.2)
    srv = await serve(sim)
    url = f"http://127.0.0.1:{srv.port}/v1/completions"
    try:
        async with aiohttp.ClientSession() as session:
            t0 = time.monotonic()
            prefills = await _prefills(session, url, rng, t0)
            await asyncio.sleep(0.5)
            streams = await _streams(session, url.replace("/completions", "/chat/completions"), rng, t0)
    finally:
        await srv.stop()
    return {
        "engine": "engine_sim 6000 tokens/s, decode step 10 + 1.2 ms per sequence, speedup 4",
        "prefills": prefills,
        "streams": streams,
    }


if __name__ == "__main__":
    trace = asyncio.run(record())
    with open(sys.argv[1], "w") as f:
        json.dump(trace, f, indent=0)
    print(f"{len(trace['prefills'])} prefills, {len(trace['streams'])} streams")
