"""The engines' KV events: what the index costs (scheduling/kv_index.py, scheduling/kv_events.py).

    python bench/kv_events.py
    python bench/kv_events.py --nice -10     # the flood's rounds in a session with its share of a shared machine

One run, four numbers (docs/performance.md keeps them):
* memory per cached block: the shared table and the subscriber's map of engine hashes are allocated once
  (KV_ENTRIES entries); filled with 4 engines' blocks until the table holds no more, bytes / blocks held;
* ingestion on one core: vLLM batches (msgpack, as a ZMQ message carries them) decoded and applied by the
  subscriber's own code, in events a second for events of 1 block (a decode step's) and of 16 (a prefill's);
* lookup: a prompt's cached prefix on 4 engines from its ids' bytes as the tokenizer's pool hands them over,
  at 32 KiB and 1 MiB of prompt (4 bytes of text a token), tokenizing aside; and beside it what a token-id
  prompt pays first to turn its ids into those bytes on the loop;
* the longest stall of an asyncio loop in the process that started the subscriber (as Sanic's single-process
  mode's worker starts it; with workers the main process starts it: either way the subscriber is a process of
  its own, sharing no loop's GIL) while another process floods it over ZMQ for 3 s, beside the same flood with
  nobody subscribed (what the flood's own CPU costs the loop on this machine), in alternating rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import msgspec  # noqa: E402

from bench import overhead  # noqa: E402
from config import Endpoint, Instance, Settings  # noqa: E402
from config.sections import EndpointKvEvents, KvEventConfig  # noqa: E402
from harness.loopback import free_ports  # noqa: E402
from scheduling.kv_events import EngineFeed, KvSubscriber, start_subscriber  # noqa: E402
from scheduling.kv_index import KV_LIVE, KvIndex, PromptKeys  # noqa: E402
from scheduling.registry import Registry  # noqa: E402
from scheduling.tokens import ids_bytes  # noqa: E402
from state.shared import KV_ENTRIES, SharedState  # noqa: E402

BLOCK = 16
ENGINES = 4
FLOOD = """
import sys, time, zmq, msgspec
ctx = zmq.Context(); pub = ctx.socket(zmq.PUB); pub.bind(sys.argv[1]); time.sleep(0.5)
ids = list(range(1000, 1000 + 16 * 16)); seq = 0; end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    ev = {"type": "BlockStored", "block_hashes": list(range(seq * 16, seq * 16 + 16)), "parent_block_hash": None,
          "token_ids": ids, "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None}
    pub.send_multipart((b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode([time.time(), [ev]]))); seq += 1
print(seq)
"""


def world(addresses: list[tuple[int, int]]) -> tuple[SharedState, KvSubscriber]:
    shared = SharedState.create(kv_events=True)
    instances = [
        Instance(
            id=i + 1,
            role="union",
            model_name="m",
            endpoints=(
                Endpoint(
                    id=0,
                    address=f"127.0.0.1:{1 + i}",
                    kv_events=EndpointKvEvents(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}"),
                ),
            ),
        )
        for i, (pub, rep) in enumerate(addresses)
    ]
    Registry(shared).apply("set", instances)
    settings = Settings(instances=tuple(instances), kv_events=KvEventConfig(enable=True))
    return shared, KvSubscriber(shared, settings)


def batch(first_hash: int, ids: list[int], parent: int | None) -> bytes:
    n = len(ids) // BLOCK
    ev = {
        "type": "BlockStored",
        "block_hashes": list(range(first_hash, first_hash + n)),
        "parent_block_hash": parent,
        "token_ids": ids,
        "block_size": BLOCK,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    return msgspec.msgpack.encode([time.time(), [ev]])


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def feeds(sub: KvSubscriber, n: int) -> list[EngineFeed]:
    sub.follow()
    return [sub.feeds[s] for s in sorted(sub.feeds)][:n]


def memory_and_ingest() -> None:
    before = rss_bytes()
    shared, sub = world([(p, p + 1) for p in range(40000, 40000 + 2 * ENGINES, 2)])
    fs = feeds(sub, ENGINES)
    made = rss_bytes() - before
    # Ingestion: chains of 1-block events (decode steps), then 16-block events (prefill chunks).
    for blocks_per_event in (1, 16):
        payloads = []
        for chain in range(400):
            parent = None
            for step in range(16 // blocks_per_event if blocks_per_event < 16 else 1):
                first = (blocks_per_event * 1000) * 10**6 + chain * 1000 + step * blocks_per_event
                ids = [chain * 7919 + step * 31 + k for k in range(blocks_per_event * BLOCK)]
                payloads.append(batch(first, ids, parent))
                parent = first + blocks_per_event - 1
        feed = fs[0]
        started = time.process_time()
        for seq, payload in enumerate(payloads):
            sub._apply(feed, seq, payload)
        cpu = time.process_time() - started
        print(
            f"ingest: {len(payloads) / cpu:,.0f} events/s of {blocks_per_event} block(s) "
            f"({len(payloads) * blocks_per_event / cpu:,.0f} blocks/s) on one core"
        )
    # Fill every engine until the table takes no more.
    rows = sub.index.rows
    seq = 10**6
    for round_ in range(4 * KV_ENTRIES // (ENGINES * 64)):
        for e, feed in enumerate(fs):
            first = (e + 1) * 10**12 + round_ * 64
            ids = [(e * 10**9 + round_ * 64 * BLOCK + k) for k in range(64 * BLOCK)]
            sub._apply(feed, seq, batch(first, ids, None))
            seq += 1
    held = sum(rows[f.slot].blocks for f in fs)
    mine = (sub.hashes.keys, sub.hashes.owners, sub.hashes.values, sub.parents)
    table = ctypes.sizeof(shared.kv_blocks) + sum(column.nbytes for column in mine)
    grown = rss_bytes() - before
    print(
        f"memory: {held:,} blocks held by {ENGINES} engines in {table / 2**20:.0f} MiB of tables: "
        f"{table / held:.0f} bytes per block (process RSS grew {grown / 2**20:.0f} MiB, {grown / held:.0f} bytes "
        f"per block; {made / 2**20:.0f} MiB of it at start)"
    )
    sub.close()


def lookup() -> None:
    shared, sub = world([(p, p + 1) for p in range(41000, 41000 + 2 * ENGINES, 2)])
    fs = feeds(sub, ENGINES)
    for kib in (32, 1024):
        ids = [(k * 2654435761) % 150000 for k in range(kib * 1024 // 4)]
        held = len(ids) * 9 // 10 // BLOCK * BLOCK  # each engine holds the first 90 %, in chains of 256 blocks
        for e, feed in enumerate(fs):
            parent, seq = None, 0
            for start in range(0, held, 256 * BLOCK):
                chunk = ids[start : min(start + 256 * BLOCK, held)]
                first = (e + 1) * 10**9 + start
                sub._apply(feed, seq, batch(first, chunk, parent))
                parent, seq = first + len(chunk) // BLOCK - 1, seq + 1
        runs = 20 if kib > 100 else 200
        encoded = ids_bytes(ids)  # what the tokenizer's pool hands over (scheduling/exact.py)
        bytes_s = look_s = 0.0
        for _ in range(runs):
            t0 = time.perf_counter()
            data = ids_bytes(ids)  # a token-id prompt's, on the loop
            t1 = time.perf_counter()
            prompt = PromptKeys(encoded)
            found = [sub.index.cached_tokens_at(f.slot, prompt) for f in fs]
            t2 = time.perf_counter()
            bytes_s, look_s = bytes_s + t1 - t0, look_s + t2 - t1
            assert data == encoded
        assert found == [held] * ENGINES, (found, held)
        print(
            f"lookup at {kib} KiB ({len(ids):,} tokens), {ENGINES} engines: {look_s / runs * 1000:.3f} ms from the "
            f"tokenizer's bytes; a token-id prompt's ids to bytes {bytes_s / runs * 1000:.3f} ms more"
        )
    sub.close()


def flood_stall(subscribed: bool) -> tuple[float, int, int]:
    """The longest stall of this process's asyncio loop while another process floods one engine's feed for 3 s:
    with the subscriber started as app.py starts it (its own process; in Sanic's single-process mode the worker
    starts it, as here), or with nobody subscribed (what the flood's CPU alone costs the loop on this machine)."""
    pub, rep = free_ports(2)
    shared, here = world([(pub, rep)])
    here.ctx.term()  # the settings only: the subscriber measured is the process
    for t in Registry(shared).view().targets:
        shared.endpoints[t.slot].healthy = 1.0
    sub = start_subscriber(shared, here.settings) if subscribed else None
    rows = KvIndex(shared).rows
    if sub is not None:
        deadline = time.monotonic() + 10
        while not any(r.state == KV_LIVE for r in rows) and time.monotonic() < deadline:
            time.sleep(0.05)
    flood = subprocess.Popen([sys.executable, "-c", FLOOD, f"tcp://127.0.0.1:{pub}", "3"], stdout=subprocess.PIPE)

    async def watch() -> float:
        await asyncio.sleep(0.7)
        worst, last = 0.0, time.monotonic()
        end = last + 2.0
        while last < end:
            await asyncio.sleep(0.001)
            now = time.monotonic()
            worst, last = max(worst, now - last), now
        return worst

    worst = asyncio.run(watch())
    sent = int(flood.communicate()[0])
    if sub is not None:
        sub.stop()
    return worst, sent, sum(r.batches for r in rows)


def stall(rounds: int = 3) -> None:
    for round_ in range(rounds):
        for subscribed in (False, True):
            worst, sent, applied = flood_stall(subscribed)
            who = "subscriber process" if subscribed else "nobody subscribed"
            print(
                f"flood, {who}: {sent:,} batches of 16 blocks sent in 3 s, {applied:,} applied; the loop's longest "
                f"stall {worst * 1000:.1f} ms (1 ms sleeps; round {round_ + 1})",
                flush=True,
            )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nice", type=int, default=0, help="the niceness of this session's autogroup (negative: root)")
    ap.add_argument("--flood-only", action="store_true", help="only the flood's rounds")
    opts = ap.parse_args()
    if opts.nice:  # other sessions' load otherwise shows as stalls of the loop, subscriber or not
        overhead.NICE = opts.nice
        overhead.set_autogroup_nice("self")
    if not opts.flood_only:
        memory_and_ingest()
        lookup()
    stall()
