"""The exact-token path's cost (scheduling/exact.py): CPU per request by prompt size, the longest stall of an
event loop while megabyte prompts are encoded, and what the cache of rendered pieces saves on a conversation.

    python bench/exact_tokens.py                 # the e2e model's tokenizer when built, else a trained one
    python bench/exact_tokens.py --tokenizer DIR

* **CPU per request** at 0/32/256/1024 KiB of chat prompt: process CPU (the pool's thread and tokenizers' own
  threads) of `submit(...).result()` for a prompt not seen before, median of a few, and per KiB.
* **Loop stall**: an asyncio loop ticking every millisecond while 4 prompts of 1 MiB are encoded in the pool
  (the request's await included): the longest gap between ticks less the tick.
* **A 20-turn conversation** (each turn's user message 2 KiB, the answer 1 KiB, a 4 KiB system prompt): CPU
  of the 20 turns' encodings with the cache, and with it off (every turn from scratch).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench import overhead  # noqa: E402
from bench.stall import tokenizer_dir  # noqa: E402
from scheduling import exact  # noqa: E402
from scheduling.tokens import CHAT  # noqa: E402


def chat(kib: int, salt: str) -> dict:
    return {"messages": [{"role": "user", "content": salt + overhead.padding(kib)[len(salt) :]}]}


def cpu_of(fn) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def per_request(meter, sizes: list[int], times: int) -> list[tuple[int, float]]:
    out = []
    for kib in sizes:
        took = [cpu_of(lambda k=kib, i=i: meter.submit(CHAT, chat(k, f"{k}-{i} ")).result()) for i in range(times)]
        out.append((kib, statistics.median(took) * 1000))
    return out


async def _stall(meter, kib: int, n: int) -> float:
    longest, stop = 0.0, False

    async def tick():
        nonlocal longest
        last = time.perf_counter()
        while not stop:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            longest, last = max(longest, now - last - 0.001), now

    ticker = asyncio.ensure_future(tick())
    await asyncio.sleep(0.05)
    exact.EXACT_WAIT_S = 60.0  # this measures the encoding, not the bound
    await asyncio.gather(*(meter.wait(meter.submit(CHAT, chat(kib, f"stall-{i} "))) for i in range(n)))
    stop = True
    await ticker
    return longest * 1000


def conversation(meter, turns: int, cached: bool) -> tuple[float, int]:
    """CPU of encoding each turn of one conversation, and the pieces encoded."""
    meter.cache = exact.IdsCache(exact.CACHE_BYTES if cached else 0)
    messages = [{"role": "system", "content": overhead.padding(4)}]
    total = 0.0
    for t in range(turns):
        messages.append({"role": "user", "content": f"turn {t} " + overhead.padding(2)})
        total += cpu_of(lambda: meter.submit(CHAT, {"messages": list(messages)}).result())
        messages.append({"role": "assistant", "content": f"answer {t} " + overhead.padding(1)})
    return total * 1000, meter.cache.misses


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", default="", help="a tokenizer.json or its directory")
    ap.add_argument("--times", type=int, default=3)
    opts = ap.parse_args(argv)
    meter = exact.make_meter(tokenizer_dir(opts.tokenizer, tempfile.mkdtemp(prefix="motor-exact-")))
    assert meter.exact, "the tokenizer did not load"
    print(f"tokenizer: cut at special tokens = {meter.cut is not None}\n")
    print("| chat prompt KiB | CPU ms per request | CPU ms per KiB |")
    print("|---:|---:|---:|")
    for kib, ms in per_request(meter, [0, 32, 256, 1024], opts.times):
        print(f"| {kib} | {ms:.2f} | {ms / kib if kib else 0:.3f} |")
    print(f"\nlongest loop stall while 4 prompts of 1 MiB are encoded: {asyncio.run(_stall(meter, 1024, 4)):.1f} ms")
    with_ms, with_pieces = conversation(meter, 20, True)
    without_ms, without_pieces = conversation(meter, 20, False)
    print(
        f"\n20-turn conversation: {with_ms:.1f} ms CPU with the cache ({with_pieces} pieces encoded), "
        f"{without_ms:.1f} ms from scratch each turn ({without_pieces} pieces): {without_ms / with_ms:.1f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
