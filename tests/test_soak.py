"""Soak: a few thousand mixed requests (OpenAI and Anthropic, JSON and SSE, union and PD) with random client
disconnects, through a two-worker Coordinator.

At the end nothing may be left behind: the shared ledger is back to zero (management port), every engine
request ended (completed, aborted or failed; prefill KV freed), no upstream connection is left open beyond
the keep-alive pool, the log has no unclosed-response warning, and the Coordinator's memory stopped
growing after warm-up.
"""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest

from harness.configs import coordinator_config, instance
from harness.coordinator import Coordinator
from harness.ledger import ledger_is_zero
from harness.loopback import wait_until
from harness.processes import tree

UNION, PD = "soak-union", "soak-pd"
WARMUP, MEASURED = 400, 2000
CONCURRENCY = 24
DISCONNECT_SHARE = 0.25


@pytest.fixture(scope="module")
def cluster(module_sims):
    u = module_sims("union", model=UNION, speedup=50)
    p = module_sims("prefill", model=PD, speedup=50)
    d = module_sims("decode", model=PD, speedup=50)
    cfg = coordinator_config(
        [
            instance(1, "union", UNION, u.address),
            instance(2, "prefill", PD, p.address),
            instance(3, "decode", PD, d.address),
        ],
        inference_workers_config={"num_workers": 2},
        exception_config={"retry_delay": 0.01, "kv_release_path": "/sim/kv/release"},
    )
    with Coordinator(cfg) as coord:
        coord.sims = [u, p, d]
        yield coord


def request_for(rng: random.Random, i: int) -> tuple[str, dict]:
    model = rng.choice((UNION, PD))
    stream = rng.random() < 0.6
    max_tokens = rng.randint(1, 48)
    text = f"soak {i} " + "lorem ipsum " * rng.randint(1, 40)
    kind = rng.choice(("chat", "chat", "completions", "messages"))
    if kind == "messages":
        body = {
            "model": model,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": text}],
            "stream": stream,
        }
        return "/v1/messages", body
    if kind == "completions":
        return "/v1/completions", {"model": model, "prompt": text, "max_tokens": max_tokens, "stream": stream}
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "stream": stream}
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    return "/v1/chat/completions", body


async def one(session: aiohttp.ClientSession, url: str, rng: random.Random, i: int, tally: dict) -> None:
    path, body = request_for(rng, i)
    disconnect = rng.random() < DISCONNECT_SHARE
    try:
        if disconnect and rng.random() < 0.5:  # gone early: before or just after the answer starts
            resp = await asyncio.wait_for(session.post(url + path, json=body), rng.uniform(0.0, 0.03))
            resp.close()
            tally["disconnected"] += 1
            return
        async with session.post(url + path, json=body) as resp:
            if disconnect:  # gone in the middle of the answer
                await resp.content.readany()
                resp.close()
                tally["disconnected"] += 1
                return
            await resp.read()
            tally[resp.status] = tally.get(resp.status, 0) + 1
    except TimeoutError:
        tally["disconnected"] += 1


async def drive(url: str, n: int, seed: int) -> dict:
    rng = random.Random(seed)
    tally = {"disconnected": 0}
    queue = iter(range(n))
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:

        async def worker():
            for i in queue:
                await one(session, url, rng, i, tally)

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return tally


def tree_rss_kib(pid: int) -> int:
    """Resident memory of a process and all its descendants (Sanic's workers are children of the main process)."""
    total = 0
    for p in tree(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
    return total


def established_to(port: int) -> int:
    """TCP connections in state ESTABLISHED whose remote end is `port` (the Coordinator's side of its upstreams)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if fields[3] == "01" and int(fields[2].rsplit(":", 1)[1], 16) == port:
                        count += 1
        except FileNotFoundError:
            pass
    return count


def engines_settled(sims) -> bool:
    for s in sims:
        st = s.stats()
        if st["running"] or st["waiting"] or st["held_kv_tickets"]:
            return False
    return True


def summary(sims) -> list[str]:
    keys = ("received", "completed", "aborted", "failed", "dropped", "running", "waiting", "held_kv_tickets")
    return [" ".join(f"{k}={s.stats().get(k, 0)}" for k in keys) for s in sims]


def test_soak_leaves_nothing_behind(cluster):
    c = cluster
    warm = asyncio.run(drive(c.url, WARMUP, seed=1))
    assert warm.get(200, 0) > 0
    assert wait_until(lambda: engines_settled(c.sims), 10), summary(c.sims)
    rss_warm = tree_rss_kib(c.proc.pid)

    tally = asyncio.run(drive(c.url, MEASURED, seed=2))
    answered = sum(v for k, v in tally.items() if k != "disconnected")
    assert tally.get(200, 0) == answered, tally  # every request that was not abandoned succeeded
    assert tally["disconnected"] > MEASURED * DISCONNECT_SHARE / 2

    assert wait_until(lambda: ledger_is_zero(c), 10)
    assert wait_until(lambda: engines_settled(c.sims), 10), [s.stats() for s in c.sims]
    aborted = sum(s.stats()["aborted"] for s in c.sims)
    assert aborted > 0  # disconnects reached the engines
    # Upstream connections: only the idle keep-alive pool remains (at most one per concurrent request and
    # worker), not one per abandoned request.
    for s in c.sims:
        assert established_to(s.port) <= 2 * CONCURRENCY + 4, s
    assert "Unclosed" not in c.output() and "Traceback" not in c.output()
    rss_end = tree_rss_kib(c.proc.pid)
    assert rss_end < rss_warm * 1.10, (rss_warm, rss_end)
