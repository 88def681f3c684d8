"""A seeded multi-turn chat trace and the prefix-cache hit rate it gets from real vLLM engines.

Used by the KV-event e2e test (tests/e2e/test_vllm_kv_events.py) and bench/kv_hitrate.py, which send the same
trace once per routing policy. The trace: `conversations` chats of `turns` turns each, interleaved in a seeded
random order (so a rotation does not keep a chat on one engine by accident), each opening with one of a few
shared system prompts and each turn carrying the answer the engine gave to the previous one. Before a run,
`prime` has one engine answer the first turn of some chats straight, as a client of another gateway would: what
it cached is known only to the engines (and their KV events). The hit rate is the engines' own
`vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total` over the run, summed over the engines.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import openai

from harness.bodies import WORDS
from harness.configs import REAL_ENGINE_CHECKS, coordinator_config
from harness.loopback import wait_until
from harness.metrics import by_label

ANSWER_TOKENS = 24
CONCURRENCY = 2  # chats in flight at once, as several users' would be
# Greedy answers of a fixed length: every policy's run sees the same conversations.
SAMPLING = {"temperature": 0, "max_tokens": ANSWER_TOKENS, "extra_body": {"ignore_eos": True}}
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


@dataclass
class Chat:
    system: str
    questions: list[str]
    primed: bool = False  # its first turn is answered straight by the primed engine before the run
    messages: list[dict] = field(default_factory=list)


@dataclass
class Trace:
    chats: list[Chat]
    order: list[int]  # chat indices: the k-th occurrence of i is chat i's turn k


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_trace(seed: int = 33, conversations: int = 16, turns: int = 5, systems: int = 3, primed: int = 6) -> Trace:
    """`conversations` chats of `turns` turns over `systems` shared system prompts (~100 tokens each; questions
    ~25); the first `primed` chats are the ones `prime` starts."""
    rng = random.Random(seed)
    prompts = [f"You are assistant number {s}. " + _words(rng, 60) for s in range(systems)]
    chats = [
        Chat(prompts[i % systems], [_words(rng, 14) + "?" for _ in range(turns)], primed=i < primed)
        for i in range(conversations)
    ]
    order = [i for i in range(conversations) for _ in range(turns)]
    rng.shuffle(order)
    return Trace(chats, order)


def fresh(trace: Trace) -> Trace:
    """The same trace with every conversation not yet begun."""
    return Trace([Chat(c.system, c.questions, c.primed) for c in trace.chats], trace.order)


async def _turn(client: openai.AsyncOpenAI, model: str, chat: Chat, question: str, stream: bool = False) -> dict:
    if not chat.messages:
        chat.messages.append({"role": "system", "content": chat.system})
    chat.messages.append({"role": "user", "content": question})
    if not stream:
        resp = await client.chat.completions.create(model=model, messages=chat.messages, **SAMPLING)
        chat.messages.append({"role": "assistant", "content": resp.choices[0].message.content})
        return resp.usage.model_dump()
    text, usage = [], None
    events = await client.chat.completions.create(
        model=model, messages=chat.messages, stream=True, stream_options={"include_usage": True}, **SAMPLING
    )
    async for event in events:
        text.extend(choice.delta.content or "" for choice in event.choices)
        usage = event.usage or usage
    chat.messages.append({"role": "assistant", "content": "".join(text)})
    return usage.model_dump()


async def prime(url: str, model: str, trace: Trace) -> None:
    """The first turn of each primed chat, answered by the engine at `url` directly (no Coordinator)."""
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        for chat in trace.chats:
            if chat.primed:
                await _turn(client, model, chat, "Before we start: " + chat.questions[0])


async def run(
    trace: Trace, model: str, url_of: Callable[[int], str], concurrency: int = 1, stream: bool = False
) -> list[dict]:
    """Send the trace, chat i's turns to `url_of(i)`, in its order with up to `concurrency` requests in flight
    (a turn waits for its chat's previous answer), streamed or as JSON answers: each request's usage."""
    clients: dict[str, openai.AsyncOpenAI] = {}
    asked = [0] * len(trace.chats)
    previous: list[asyncio.Task | None] = [None] * len(trace.chats)
    slots = asyncio.Semaphore(concurrency)

    async def turn(i: int, question: str, before: asyncio.Task | None) -> dict:
        try:
            if before is not None:
                await before
            url = url_of(i)
            if url not in clients:
                clients[url] = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
            return await _turn(clients[url], model, trace.chats[i], question, stream)
        finally:
            slots.release()

    tasks = []
    try:
        for i in trace.order:
            await slots.acquire()
            previous[i] = asyncio.create_task(turn(i, trace.chats[i].questions[asked[i]], previous[i]))
            tasks.append(previous[i])
            asked[i] += 1
        return list(await asyncio.gather(*tasks))
    finally:
        for client in clients.values():
            await client.close()


def metric(text: str, name: str) -> float:
    """The sum of every sample of `name` on a Prometheus page."""
    return sum(float(m.group(3)) for m in map(_SAMPLE.match, text.splitlines()) if m and m.group(1) == name)


def prefix_counts(urls: list[str]) -> tuple[float, float]:
    """(cached prompt tokens found, prompt tokens looked up) over the engines, from their own counters."""
    pages = [httpx.get(u + "/metrics", timeout=10).text for u in urls]
    return (
        sum(metric(p, "vllm:prefix_cache_hits_total") for p in pages),
        sum(metric(p, "vllm:prefix_cache_queries_total") for p in pages),
    )


def reset(urls: list[str], model: str) -> None:
    """Empty every engine's prefix cache (vLLM's POST /reset_prefix_cache, served with VLLM_SERVER_DEV_MODE=1), and
    have each compute a prompt shorter than a block: vLLM publishes the reset's `AllBlocksCleared` with its next
    step's events, and until then a subscriber sees the cache as it was."""
    for u in urls:
        r = httpx.post(u + "/reset_prefix_cache", timeout=30)
        r.raise_for_status()
        r = httpx.post(u + "/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 1}, timeout=120)
        r.raise_for_status()


@dataclass
class RunResult:
    hit_rate: float
    usages: list[dict]


def measure(
    trace: Trace,
    model: str,
    engines: list[str],
    url_of: Callable[[int], str],
    concurrency: int = CONCURRENCY,
    stream: bool = False,
) -> RunResult:
    """One run of the trace from empty caches: engines[0] primed first, then the trace through `url_of` (streamed,
    or as JSON answers)."""
    trace = fresh(trace)
    reset(engines, model)
    asyncio.run(prime(engines[0], model, trace))
    hits0, queries0 = prefix_counts(engines)
    usages = asyncio.run(run(trace, model, url_of, concurrency, stream))
    hits, queries = prefix_counts(engines)
    return RunResult((hits - hits0) / max(queries - queries0, 1.0), usages)


def kv_addresses(run_dir: str, name: str) -> dict:
    """Where vllm_up.sh's union engine `name` publishes its KV events: an endpoint's `kv_events` object."""
    with open(os.path.join(run_dir, f"{name}.kv")) as f:
        pub, replay = f.read().split()
    return {"endpoint": pub, "replay_endpoint": replay}


def coordinator_cfg(unions: list[tuple[str, dict]], model: str, model_dir: str, policy: str, kv_events: bool) -> dict:
    """A Coordinator in front of union engines, given as (address, kv_events object): `policy`, the model's
    tokenizer from `model_dir` (exact prompt tokens), KV events on or off."""
    instances = [
        {"id": k + 1, "role": "union", "model_name": model, "endpoints": [{"id": 0, "address": a, "kv_events": kv}]}
        for k, (a, kv) in enumerate(unions)
    ]
    return coordinator_config(
        instances,
        models=[{"id": model, "tokenizer_path": model_dir}],
        scheduler_config={"scheduler_type": policy, **REAL_ENGINE_CHECKS},
        kv_event_config={"enable": kv_events},
    )


def kv_states(coord) -> list[str]:
    return [kv["state"] for kv in _kv_rows(coord)]


def _kv_rows(coord) -> list[dict]:
    body = coord.instances()
    return [ep["kv_events"] for inst in body["instances"] for ep in inst["endpoints"]]


def caught_up(coord, model: str, engines: list[str], timeout_s: float = 60.0) -> bool:
    """Each engine computes a prompt of a few blocks straight, and the Coordinator's subscriptions take its events
    in. A subscriber that joins an engine which served before replays the engine's history when it connects
    (`replaying`: predictions fall back to the estimate meanwhile); that start-up is not what a trace measures."""

    def settled() -> bool:
        return all(kv["state"] == "live" and kv["blocks"] > 0 for kv in _kv_rows(coord))

    deadline = time.monotonic() + timeout_s
    attempt = 0
    while True:
        # Another prompt each time (a prompt the engine holds publishes no event): a batch published after the
        # connect's replay and before the subscription reached the engine is seen only at the engine's next one.
        prompt = f"Warm up {attempt}. " + " ".join(WORDS[k % len(WORDS)] for k in range(120))
        for url in engines:
            httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1}, timeout=120)
        if wait_until(settled, min(5.0, max(deadline - time.monotonic(), 0.1))):
            return True
        if time.monotonic() >= deadline:
            return False
        attempt += 1


def predictions(coord) -> dict[str, float]:
    """The Coordinator's own comparison of predicted and reported cached tokens: {exact|over|under|unpredicted: requests}."""
    return by_label(coord, "motor_kv_prediction_total", "outcome")
