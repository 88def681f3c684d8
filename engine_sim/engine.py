"""The simulated continuous-batching engine (one scheduler loop per server).

Timing model
------------
* Requests enter a FIFO waiting queue (with ``scheduling_policy`` "priority": ordered by their ``priority``,
  lower first, then arrival, as vLLM's priority policy orders it). A request is admitted while fewer than ``max_num_seqs``
  run and its KV fits: block-rounded (prompt + max(generated so far, 1)) tokens of all running
  requests, plus KV held for remote decode (prefill role), must stay within
  ``kv_capacity_tokens``. The head of the queue blocks the rest (FCFS, like vLLM). A prompt that
  can never fit is admitted alone when nothing else runs.
* Each engine step prefills up to ``max_num_batched_tokens`` uncached prompt tokens (prefix-cache
  hits and remotely transferred KV cost nothing) and decodes one token for every running
  sequence that finished its prefill (each of its ``n`` choices). A sequence whose prefill
  completes in a step samples its first token at the end of that step (as vLLM does).
* step duration = decode_step_ms + decode_per_seq_ms * decoding_choices
  + prefill_tokens / prefill_tokens_per_s, all divided by ``speedup``.
  So TTFT grows with queued prompt tokens and ITL grows with the batch.
* ``zero_latency`` servers bypass this module's loop entirely.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import itertools
import logging
import time

from . import kv_events
from .config import SimConfig

log = logging.getLogger("engine_sim")

# vLLM's histogram buckets, as vLLM lists them.
# fmt: off
LAT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
XFER_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
# fmt: on


class Histogram:
    __slots__ = ("buckets", "count", "counts", "sum")

    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float):
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1

    def render(self, name: str, labels: str) -> list[str]:
        out, acc = [], 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            out.append(f'{name}_bucket{{{labels},le="{float(b)}"}} {acc}')
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.count}')
        out.append(f"{name}_count{{{labels}}} {self.count}")
        out.append(f"{name}_sum{{{labels}}} {self.sum}")
        return out


class Seq:
    """One request inside the engine (all its ``n`` choices decode together)."""

    __slots__ = (
        "aborted",
        "arrival",
        "block_hashes",
        "cache_salt",
        "cached_tokens",
        "done",
        "emitted",
        "event",
        "finish_time",
        "first_token_time",
        "hold_for_remote",
        "kv_tokens",
        "last_token_time",
        "out_lens",
        "priority",
        "prompt_tokens",
        "remaining_prefill",
        "rid",
        "token_ids",
    )

    def __init__(
        self, rid: str, prompt_tokens: int, cached_tokens: int, out_lens: list[int], block_hashes=None, token_ids=None
    ):
        self.rid = rid
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = min(cached_tokens, max(prompt_tokens - 1, 0))
        self.remaining_prefill = prompt_tokens - self.cached_tokens
        self.out_lens = out_lens
        self.emitted = 0  # tokens emitted per choice (all choices advance together)
        self.event = asyncio.Event()
        self.done = False
        self.aborted = False
        self.arrival = 0.0
        self.first_token_time = None
        self.last_token_time = None
        self.finish_time = None
        self.hold_for_remote = False
        self.block_hashes = block_hashes or []
        self.token_ids = token_ids  # the prompt's ids, kept only when KV events are published
        self.kv_tokens = 0
        self.priority = 0  # vLLM's `priority`: read under --scheduling-policy priority
        self.cache_salt: str | None = None  # vLLM's `cache_salt`: in its first block's KV event

    @property
    def max_len(self) -> int:
        return max(self.out_lens) if self.out_lens else 0

    def decoding_choices(self) -> int:
        return sum(1 for n in self.out_lens if n > self.emitted)

    async def wait_emitted(self, k: int) -> None:
        """Until the engine emitted k tokens per choice, or aborted the request."""
        while self.emitted < k and not self.aborted:
            self.event.clear()
            if self.emitted >= k:
                break
            await self.event.wait()


class Ticket:
    __slots__ = ("block_ids", "expiry", "kv_tokens", "rid", "tokens")

    def __init__(self, rid, tokens, block_ids, expiry, kv_tokens):
        self.rid, self.tokens, self.block_ids, self.expiry, self.kv_tokens = rid, tokens, block_ids, expiry, kv_tokens


class Engine:
    def __init__(self, cfg: SimConfig):
        self.cfg = cfg
        self.waiting: collections.deque = collections.deque()
        self.running: list[Seq] = []
        self.tickets: dict[str, Ticket] = {}
        self.prefix: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self.prefix_cap = cfg.prefix_cache_blocks or max(1, cfg.kv_capacity_tokens // cfg.block_size)
        self.kv_events: kv_events.KvEventPublisher | None = None  # set by the server when cfg.kv_events is on
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._block_ids = itertools.count(1)
        self.reset_stats()

    # ------------------------------------------------------------------ stats / metrics
    def reset_stats(self):
        self.stats = dict(
            received=0,
            completed=0,
            aborted=0,
            failed=0,
            held_kv_tickets=0,
            kv_pulled=0,
            kv_released=0,
            kv_expired=0,
            recomputes=0,
            remote_kv_hits=0,
            remote_kv_unreachable=0,
            prefix_cache_hit_tokens=0,
            prompt_tokens=0,
            generation_tokens=0,
            tickets_issued=0,
            prefill_without_ticket=0,
            metaserver_calls=0,
        )
        self.aborted_ids: list[str] = []
        self.ttft = Histogram(LAT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.xfer = Histogram(XFER_BUCKETS)
        self.by_source = {"local_compute": 0, "local_cache_hit": 0, "external_kv_transfer": 0}
        self.success = collections.Counter()
        self.prefix_queries = 0
        self.prefix_hits = 0

    def snapshot(self) -> dict:
        self.expire_tickets()
        s = dict(self.stats)
        s["running"] = len(self.running)
        s["waiting"] = len(self.waiting)
        s["held_kv_tickets"] = len(self.tickets)
        s["held_kv_tokens"] = sum(t.tokens for t in self.tickets.values())
        s["kv_used_tokens"] = self.kv_used()
        s["kv_cache_usage_perc"] = self.kv_usage()
        s["aborted_request_ids"] = list(self.aborted_ids)
        s["held_ticket_ids"] = list(self.tickets)
        return s

    # ------------------------------------------------------------------ KV accounting
    def _blocks(self, tokens: int) -> int:
        b = self.cfg.block_size
        return ((tokens + b - 1) // b) * b

    def kv_used(self) -> int:
        return sum(s.kv_tokens for s in self.running) + sum(t.kv_tokens for t in self.tickets.values())

    def kv_usage(self) -> float:
        cap = self.cfg.kv_capacity_tokens
        return min(1.0, self.kv_used() / cap) if cap > 0 else 0.0

    def _seq_kv(self, s: Seq) -> int:
        return self._blocks(s.prompt_tokens + max(s.emitted, 1) * max(len(s.out_lens), 1))

    # ------------------------------------------------------------------ prefix cache
    def prefix_match(self, hashes) -> int:
        """Number of leading blocks of ``hashes`` present in the prefix cache."""
        n = 0
        for h in hashes:
            if h not in self.prefix:
                break
            n += 1
        for h in reversed(hashes[:n]):  # a prefix's head is the most recently used: tails are evicted first, as in vLLM
            self.prefix.move_to_end(h)
        return n

    def prefix_insert(self, hashes, token_ids=None, salt=None):
        """The prompt's blocks are cached (the least recently used ones beyond the cap are evicted); with a KV
        event publisher, the blocks new to the cache are published as stored (the first one's extra keys carry
        the prompt's cache `salt`) and the evicted ones as removed."""
        new = [i for i, h in enumerate(hashes) if h not in self.prefix]
        for h in reversed(hashes):
            self.prefix[h] = None
            self.prefix.move_to_end(h)
        evicted = []
        while len(self.prefix) > self.prefix_cap:
            evicted.append(self.prefix.popitem(last=False)[0])
        if self.kv_events is not None and token_ids is not None:
            events, start = [], None
            for j, i in enumerate(new):  # one BlockStored per run of consecutive new blocks
                if start is None:
                    start = i
                if j + 1 == len(new) or new[j + 1] != i + 1:
                    events.append(kv_events.stored(hashes, token_ids, start, i + 1, self.cfg.block_size, salt))
                    start = None
            if evicted:
                events.append(kv_events.removed(evicted))
            self.kv_events.publish(events)

    def prefix_reset(self) -> None:
        """vLLM's /reset_prefix_cache: every cached block is dropped (AllBlocksCleared)."""
        self.prefix.clear()
        if self.kv_events is not None:
            self.kv_events.publish([kv_events.CLEARED])

    # ------------------------------------------------------------------ tickets (P side)
    def issue_ticket(self, rid: str, tokens: int, now: float) -> Ticket:
        nblocks = max(1, (tokens + self.cfg.block_size - 1) // self.cfg.block_size)
        ids = [next(self._block_ids) for _ in range(nblocks)]
        exp = now + self.cfg.kv_hold_timeout_s / self.cfg.speedup
        t = Ticket(rid, tokens, ids, exp, self._blocks(tokens))
        self.tickets[rid] = t
        self.stats["tickets_issued"] += 1
        self._kick()
        return t

    def expire_tickets(self):
        if not self.tickets:
            return
        now = time.monotonic()
        for rid in [r for r, t in self.tickets.items() if t.expiry <= now]:
            del self.tickets[rid]
            self.stats["kv_expired"] += 1
            self._kick()

    def pull_ticket(self, rid: str) -> Ticket | None:
        self.expire_tickets()
        t = self.tickets.pop(rid, None)
        if t is not None:
            self.stats["kv_pulled"] += 1
            self._kick()
        return t

    def release_ticket(self, rid: str) -> bool:
        self.expire_tickets()
        t = self.tickets.pop(rid, None)
        if t is not None:
            self.stats["kv_released"] += 1
            self._kick()
        return t is not None

    # ------------------------------------------------------------------ request lifecycle
    def account_prompt(self, prompt_tokens: int, prefix_hit: int, remote_hit: int):
        self.stats["prompt_tokens"] += prompt_tokens
        self.stats["prefix_cache_hit_tokens"] += prefix_hit
        self.by_source["local_cache_hit"] += prefix_hit
        self.by_source["external_kv_transfer"] += remote_hit
        self.by_source["local_compute"] += max(0, prompt_tokens - prefix_hit - remote_hit)
        self.prefix_queries += prompt_tokens
        self.prefix_hits += prefix_hit

    def submit(self, s: Seq):
        s.arrival = time.monotonic()
        if self.cfg.scheduling_policy == "priority":  # lower priority first, then arrival (vLLM's priority policy)
            bisect.insort_right(self.waiting, s, key=lambda q: q.priority)
        else:
            self.waiting.append(s)
        self._kick()

    def abort(self, s: Seq, request_id: str):
        if s.done:
            return
        s.done = s.aborted = True
        try:
            self.waiting.remove(s)
        except ValueError:
            pass
        if s in self.running:
            self.running.remove(s)
        self.stats["aborted"] += 1
        self.aborted_ids.append(request_id)
        self._kick()

    def drop(self, s: Seq):
        """Remove a request without counting it as a client abort (simulated faults)."""
        if s.done:
            return
        s.done = s.aborted = True
        try:
            self.waiting.remove(s)
        except ValueError:
            pass
        if s in self.running:
            self.running.remove(s)
        self.stats["dropped"] = self.stats.get("dropped", 0) + 1
        self._kick()

    def _kick(self):
        if self._wake is not None:
            self._wake.set()

    # ------------------------------------------------------------------ scheduler loop
    def start(self):
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self):
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass

    def _admit(self):
        cfg = self.cfg
        used = self.kv_used()
        while self.waiting and len(self.running) < cfg.max_num_seqs:
            s = self.waiting[0]
            need = self._blocks(s.prompt_tokens + max(len(s.out_lens), 1))
            if used + need > cfg.kv_capacity_tokens and self.running:
                break
            if used + need > cfg.kv_capacity_tokens and self.tickets and not self.running:
                break  # wait for held KV to be pulled / expire
            self.waiting.popleft()
            s.kv_tokens = need
            used += need
            self.running.append(s)

    async def _loop(self):
        cfg = self.cfg
        while True:
            self.expire_tickets()
            self._admit()
            if not self.running:
                self._wake.clear()
                timeout = None
                if self.tickets:
                    timeout = max(0.0, min(t.expiry for t in self.tickets.values()) - time.monotonic()) + 0.001
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout)
                except TimeoutError:
                    pass
                continue
            budget = cfg.max_num_batched_tokens
            prefill_tokens = 0
            finishing_prefill = []
            decoders = []
            for s in self.running:
                if s.remaining_prefill > 0:
                    if budget <= 0:
                        continue
                    take = min(s.remaining_prefill, budget)
                    budget -= take
                    prefill_tokens += take
                    s.remaining_prefill -= take
                    if s.remaining_prefill == 0:
                        finishing_prefill.append(s)
                else:
                    decoders.append(s)
            batch = sum(s.decoding_choices() for s in decoders)
            dur = (cfg.decode_step_ms + cfg.decode_per_seq_ms * batch) / 1000.0
            if cfg.prefill_tokens_per_s > 0:
                dur += prefill_tokens / cfg.prefill_tokens_per_s
            await asyncio.sleep(dur / cfg.speedup)
            now = time.monotonic()
            for s in finishing_prefill:
                if s.block_hashes:
                    self.prefix_insert(s.block_hashes, s.token_ids, s.cache_salt)
            for s in finishing_prefill + decoders:
                if s.done:
                    continue
                s.emitted += 1
                self.stats["generation_tokens"] += sum(1 for n in s.out_lens if n >= s.emitted)
                if s.first_token_time is None:
                    s.first_token_time = now
                    self.ttft.observe(now - s.arrival)
                else:
                    self.itl.observe(now - s.last_token_time)
                s.last_token_time = now
                s.kv_tokens = max(s.kv_tokens, self._seq_kv(s))
                if s.emitted >= s.max_len:
                    s.done = True
                    s.finish_time = now
                    self.e2e.observe(now - s.arrival)
                    self.running.remove(s)
                s.event.set()
