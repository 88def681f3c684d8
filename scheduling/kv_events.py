"""The subscriber to the engines' KV cache events (vLLM's `--kv-events-config` with the ZMQ publisher).

One per replica: a process of its own (`SubscriberProcess`, spawned by the main process, or by the worker in
Sanic's single-process mode) that owns one ZMQ SUB socket per engine endpoint and writes what the engines say into
the shared index (scheduling/kv_index.py), which every worker reads. A process, not a thread: decoding and
indexing a flood of events holds a GIL, and a thread's would be the GIL of the process it shares (the only
worker's, in single-process mode), stalling that event loop for tens of milliseconds (bench/kv_events.py).
Replicas of a cluster each subscribe for themselves: a PUB socket serves any number of subscribers, and nothing
goes through the store.

**The wire** (vLLM's ZmqEventPublisher): multipart messages (topic, 8-byte big-endian sequence number, msgpack
payload); the payload is a batch `[ts, events, data_parallel_rank?]`, each event a map tagged by `type`:
`BlockStored` (block_hashes, parent_block_hash, token_ids, block_size, lora_name, medium, extra_keys),
`BlockRemoved` (block_hashes), `AllBlocksCleared`. A missed sequence number is asked of the engine's replay
socket (ROUTER; this side a DEALER sends `["", start]` and gets `["", topic, seq, payload]` per batch, then seq -1,
as vLLM 0.32 sends them; earlier vLLM releases and SGLang leave the topic out). So is, whenever the SUB socket
connects, everything from the next wanted number (0 at first): what the engine published before the subscription
reached it, or while the connection was down.

**What makes an engine's blocks forgotten** (its epoch moves on): `AllBlocksCleared`; a sequence number lower
than expected (the engine restarted); a gap the replay cannot fill; the endpoint found unhealthy; a message that
cannot be decoded or exceeds the budget below; the endpoint leaving the instance set. A forgotten engine only
makes predictions low until its next events.

**States** (`GET /instances`, KvEndpointRow.state): `lost` until the SUB socket connects (ZMQ cannot tell an
engine that publishes nothing from one not there) and while it is disconnected or over its budget; `live`;
`replaying` while a gap (or, at each connect, what came before it) is asked of the replay socket; `off` when not
subscribed.

**Bounds** against a broken or hostile publisher: a message over MAX_MESSAGE_BYTES closes that connection (ZMQ's
MAXMSGSIZE); at most RCV_HWM messages wait per engine, so what waits is at most RCV_HWM x MAX_MESSAGE_BYTES;
each engine may spend BUDGET_PER_S units (an event or a block each) a second, beyond which its messages are
dropped unread (the engine is forgotten, state `lost`, until it is within budget again); each turn of the loop
handles at most SLICE messages per socket, so engines share the process.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
import zlib
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from config import Settings, split_address
from scheduling.kv_index import (
    KV_LIVE,
    KV_LOST,
    KV_OFF,
    KV_REPLAYING,
    TOKEN_BYTES,
    BlockTable,
    KvIndex,
    block_key,
    extra_bytes,
    mixed,
)
from scheduling.registry import Registry
from scheduling.tokens import ids_bytes
from state.shared import KV_ENTRIES, SharedState

log = logging.getLogger("coordinator.kv_events")

MAX_MESSAGE_BYTES = 1 << 20
RCV_HWM = 128
BUDGET_PER_S = 400_000.0  # events + blocks an engine may make this thread apply per second
SLICE = 64
PENDING_MAX = 1024  # live batches kept while a replay runs
REPLAY_TIMEOUT_S = 2.0
FOLLOW_INTERVAL_S = 0.5  # how often the instance set and health are looked at
POLL_MS = 100
REOPEN_DELAY_S = 0.2
STOP_WAIT_S = 2.0  # how long a stop waits for the process to close its sockets before it is killed
_END = -1
GPU_MEDIA = (None, "GPU")


# -- the wire, as vLLM's msgspec Structs encode it (events tagged by class name, the batch an array) --------


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[int | bytes]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_decode = msgspec.msgpack.Decoder(EventBatch).decode


def _replay_answer(frames: list[bytes]) -> tuple[int, bytes] | None:
    """(sequence number, payload) of one message from a replay socket, None if it is none. vLLM 0.32 sends
    `["", topic, seq, payload]` (the end: `["", "", -1, ""]`); earlier vLLM and SGLang `["", seq, payload]`."""
    if len(frames) not in (3, 4) or frames[0] or len(frames[-2]) != 8:
        return None
    return int.from_bytes(frames[-2], "big", signed=True), frames[-1]


def engine_hash(h: int | bytes) -> int:
    """An engine's block hash as 64 bits (vLLM's own int form keeps the low 64 bits of the digest)."""
    if isinstance(h, bytes):
        return int.from_bytes(h[-8:], "big")
    return h & ((1 << 64) - 1)


def endpoints_for(settings: Settings, address: str, own: Any) -> tuple[str, str]:
    """(PUB address, replay address or "") of one engine endpoint: its own `kv_events`, else kv_event_config's
    with `{host}` filled in."""
    if own is not None:
        return own.endpoint, own.replay_endpoint
    host, _ = split_address(address)
    host = f"[{host}]" if ":" in host else host
    cfg = settings.kv_events
    return cfg.endpoint.replace("{host}", host), cfg.replay_endpoint.replace("{host}", host)


class EngineFeed:
    """One engine endpoint's subscription: its sockets, its sequence, its replay and its budget.

    Each socket has a monitor: libzmq does not reconnect a connection it closed for a protocol error (a message
    over MAXMSGSIZE), so a disconnected socket is made again (`reopen`)."""

    def __init__(self, ctx: zmq.Context, slot: int, pub: str, replay: str, topic: str, budget_per_s: float):
        self.budget_per_s = budget_per_s
        self.ctx, self.slot, self.pub, self.replay_address, self.topic = ctx, slot, pub, replay, topic
        self.sub = self.sub_monitor = self.dealer = self.dealer_monitor = None
        self.open_sub()
        if replay:
            self.open_dealer()
        self.expected = -1  # the next sequence number wanted (-1: none seen since the engine was last forgotten)
        self.replaying_since = 0.0  # when the running replay was asked for (0: none runs)
        self.pending: list[tuple[int, bytes]] = []  # live batches that arrived during the replay
        self.budget, self.budget_at = budget_per_s, time.monotonic()
        self.healthy = True
        self.reopen_at: dict[str, float] = {}  # "sub" / "dealer" -> when to make it again

    def _socket(self, kind: int, address: str) -> tuple[zmq.Socket, zmq.Socket]:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.RCVHWM, RCV_HWM)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, 1)
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        if kind == zmq.SUB:
            sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sock.connect(address)
        return sock, monitor

    def open_sub(self) -> None:
        self.sub, self.sub_monitor = self._socket(zmq.SUB, self.pub)

    def open_dealer(self) -> None:
        self.dealer, self.dealer_monitor = self._socket(zmq.DEALER, self.replay_address)

    def sockets(self) -> list[tuple[zmq.Socket, str]]:
        pairs = [(self.sub, "sub"), (self.sub_monitor, "sub_monitor")]
        if self.dealer is not None:
            pairs += [(self.dealer, "dealer"), (self.dealer_monitor, "dealer_monitor")]
        return pairs

    def close(self, which: str | None = None) -> None:
        for name in ("sub", "dealer") if which is None else (which,):
            sock = getattr(self, name)
            if sock is not None:
                sock.disable_monitor()
                getattr(self, name + "_monitor").close(0)
                sock.close(0)

    def spend(self, units: float, now: float) -> bool:
        self.budget = min(self.budget_per_s, self.budget + (now - self.budget_at) * self.budget_per_s)
        self.budget_at = now
        if self.budget < units:
            return False
        self.budget -= units
        return True


class KvSubscriber:
    """The replica's subscriber: follows the instance set, keeps one EngineFeed per endpoint, applies events."""

    def __init__(self, shared: SharedState, settings: Settings, budget_per_s: float = BUDGET_PER_S):
        self.shared, self.settings, self.budget_per_s = shared, settings, budget_per_s
        self.index = KvIndex(shared)
        self.rows = self.index.rows
        self.registry = Registry(shared)
        # The engines' block hashes -> keys, per slot and epoch: what BlockRemoved and a parent hash are read by;
        # `parents` (by entry) the key of the block each one extends, whose count of children a removal lowers.
        size = len(shared.kv_blocks.key)
        self.hashes = BlockTable(
            memoryview(bytearray(8 * size)).cast("Q"),
            memoryview(bytearray(8 * size)).cast("Q"),
            memoryview(bytearray(8 * size)).cast("Q"),
            epochs=self.rows,
        )
        self.parents = memoryview(bytearray(8 * size)).cast("Q")
        self.ctx = zmq.Context()
        self.feeds: dict[int, EngineFeed] = {}
        self.by_socket: dict[zmq.Socket, tuple[EngineFeed, bool]] = {}
        self.poller = zmq.Poller()
        self.version = -1

    # -- life ----------------------------------------------------------------------------------------

    def run(self, stopping: Callable[[], bool]) -> None:
        """Follow the instance set and apply events until `stopping()` says so (looked at every POLL_MS)."""
        next_follow = 0.0
        while not stopping():
            try:
                now = time.monotonic()
                if now >= next_follow:
                    self.follow()
                    next_follow = now + FOLLOW_INTERVAL_S
                self.turn(POLL_MS)
            except Exception:  # the subscriber must outlive any one engine's surprise
                log.exception("kv events: a turn failed")
                time.sleep(0.1)

    def close(self) -> None:
        for slot in list(self.feeds):
            self._unsubscribe(slot)
        self.ctx.term()

    # -- the instance set and health ------------------------------------------------------------------

    def follow(self) -> None:
        """Subscribe to endpoints the set gained, unsubscribe from those it lost, forget engines gone unhealthy."""
        view = self.registry.view()
        if view.version != self.version:
            self.version = view.version
            settings = self.settings
            wanted: dict[int, tuple[str, str]] = {}
            for inst in view.instances.values():
                for ep, t in zip(inst.endpoints, (t for t in view.targets if t.instance_id == inst.id)):
                    wanted[t.slot] = endpoints_for(settings, ep.address, ep.kv_events)
            for slot in [s for s in self.feeds if wanted.get(s) != (self.feeds[s].pub, self.feeds[s].replay_address)]:
                self._unsubscribe(slot)
            for slot, (pub, replay) in wanted.items():
                if slot not in self.feeds:
                    self._subscribe(slot, pub, replay, settings.kv_events.topic)
        endpoints = self.shared.endpoints
        for slot, feed in self.feeds.items():
            healthy = endpoints[slot].healthy > 0.0
            if feed.healthy and not healthy:  # down, perhaps restarting: what it held may be gone
                self._forget(feed, KV_LOST)
            feed.healthy = healthy

    def _subscribe(self, slot: int, pub: str, replay: str, topic: str) -> None:
        try:
            feed = EngineFeed(self.ctx, slot, pub, replay, topic, self.budget_per_s)
        except zmq.ZMQError as e:
            log.warning("kv events: cannot subscribe to %s: %s", pub, e)
            return
        self.feeds[slot] = feed
        self.index.forget(slot)
        row = self.rows[slot]
        # `lost` until its SUB socket connects (an engine that publishes nothing and one not there look alike)
        row.state, row.seq, row.block_size, row.batches, row.dropped, row.clears = KV_LOST, -1, 0, 0, 0, 0
        self._register(feed)

    def _register(self, feed: EngineFeed) -> None:
        for sock, kind in feed.sockets():
            if sock not in self.by_socket:
                self.by_socket[sock] = (feed, kind)
                self.poller.register(sock, zmq.POLLIN)

    def _unregister(self, feed: EngineFeed, which: str | None = None) -> None:
        for sock, kind in feed.sockets():
            if which is None or kind.startswith(which):
                self.poller.unregister(sock)
                del self.by_socket[sock]

    def _unsubscribe(self, slot: int) -> None:
        feed = self.feeds.pop(slot)
        self._unregister(feed)
        feed.close()
        self.index.forget(slot)
        self.rows[slot].state = KV_OFF

    def _reopen(self, now: float) -> None:
        """Make again the sockets whose connection closed (after a moment: the engine may be restarting)."""
        for feed in self.feeds.values():
            for which, at in list(feed.reopen_at.items()):
                if now >= at:
                    del feed.reopen_at[which]
                    self._unregister(feed, which)
                    feed.close(which)
                    if which == "sub":
                        feed.open_sub()
                    else:
                        feed.open_dealer()
                    self._register(feed)

    # -- messages ------------------------------------------------------------------------------------

    def turn(self, timeout_ms: int) -> None:
        """Wait for messages up to `timeout_ms`, then handle at most SLICE from each socket that has some."""
        ready = self.poller.poll(timeout_ms)
        now = time.monotonic()
        for sock, _ in ready:
            feed, kind = self.by_socket.get(sock, (None, ""))
            if feed is None or feed.slot not in self.feeds:
                continue
            if kind.endswith("_monitor"):
                self._connection(feed, kind[: -len("_monitor")], sock, now)
                continue
            for _ in range(SLICE):
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=True)
                except zmq.Again:
                    break
                if kind == "dealer":
                    self._replayed(feed, frames)
                else:
                    self._live(feed, frames, now)
                if feed.slot not in self.feeds:
                    break
        self._reopen(now)
        for feed in list(self.feeds.values()):
            if feed.replaying_since and now - feed.replaying_since > REPLAY_TIMEOUT_S:
                self._replay_failed(feed)

    def _connection(self, feed: EngineFeed, which: str, monitor: zmq.Socket, now: float) -> None:
        """A socket's connection came or went: the SUB's decides between `live` and `lost` (nothing can come
        while it is down); a closed one is made again."""
        row = self.rows[feed.slot]
        while monitor.poll(0):
            event = parse_monitor_message(monitor.recv_multipart())["event"]
            if event == zmq.EVENT_DISCONNECTED:
                feed.reopen_at.setdefault(which, now + REOPEN_DELAY_S)
                if which == "sub" and row.state == KV_LIVE:
                    row.state = KV_LOST
            elif which == "sub" and row.state == KV_LOST and not feed.replaying_since:
                # A PUB socket drops what it publishes before a subscription reaches it, and while the connection
                # was down; no gap shows until the engine's next batch, which may be long in coming: ask now.
                if feed.dealer is not None:
                    self._ask_replay(feed, max(feed.expected, 0))
                else:
                    row.state = KV_LIVE

    def _live(self, feed: EngineFeed, frames: list[bytes], now: float) -> None:
        row = self.rows[feed.slot]
        if len(frames) != 3 or len(frames[1]) != 8:
            row.dropped += 1
            return
        if not feed.spend(1.0 + len(frames[2]) / 64.0, now):  # a block costs tens of bytes on the wire
            row.dropped += 1
            if row.state != KV_LOST:
                self._forget(feed, KV_LOST)
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        if feed.replaying_since:
            if len(feed.pending) < PENDING_MAX:
                feed.pending.append((seq, frames[2]))
            else:
                self._replay_failed(feed)
            return
        if feed.expected >= 0 and seq < feed.expected:  # numbering started again: the engine restarted
            self._forget(feed, KV_LIVE)
        if seq > max(feed.expected, 0) and feed.dealer is not None:  # a gap (or joined late): ask for it
            self._ask_replay(feed, max(feed.expected, 0))
            feed.pending.append((seq, frames[2]))
            return
        if feed.expected > 0 and seq > feed.expected:  # a gap nobody can fill: removals may be missing
            self._forget(feed, KV_LIVE)
        self._apply(feed, seq, frames[2])

    def _ask_replay(self, feed: EngineFeed, start: int) -> None:
        feed.dealer.send_multipart((b"", start.to_bytes(8, "big")), zmq.NOBLOCK)
        feed.replaying_since = time.monotonic()
        self.rows[feed.slot].state = KV_REPLAYING

    def _replayed(self, feed: EngineFeed, frames: list[bytes]) -> None:
        answer = _replay_answer(frames) if feed.replaying_since else None
        if answer is None:
            self.rows[feed.slot].dropped += 1
            return
        seq, payload = answer
        if seq == _END:
            self._replay_done(feed)
        elif seq >= feed.expected:
            if feed.expected > 0 and seq > feed.expected:  # the engine no longer has what was missed
                self._forget(feed, KV_REPLAYING)
            self._apply(feed, seq, payload)

    def _replay_done(self, feed: EngineFeed) -> None:
        feed.replaying_since = 0.0
        pending, feed.pending = feed.pending, []
        self.rows[feed.slot].state = KV_LIVE
        for seq, payload in sorted(pending):
            if seq < feed.expected:
                continue
            if feed.expected >= 0 and seq > feed.expected:
                self._forget(feed, KV_LIVE)
            self._apply(feed, seq, payload)

    def _replay_failed(self, feed: EngineFeed) -> None:
        """No answer in time (or too much arrived meanwhile): what was missed is lost; go on from what is here."""
        self._forget(feed, KV_LIVE)
        feed.expected = -1
        self._replay_done(feed)

    def _forget(self, feed: EngineFeed, state: int) -> None:
        self.index.forget(feed.slot)
        row = self.rows[feed.slot]
        row.state = state
        feed.expected = -1

    def _apply(self, feed: EngineFeed, seq: int, payload: bytes) -> None:
        row = self.rows[feed.slot]
        feed.expected = seq + 1
        row.seq = seq
        try:
            batch = _decode(payload)
        except (msgspec.DecodeError, ValueError):
            row.dropped += 1
            self._forget(feed, KV_LOST)  # what it said is unknown: removals may be in it
            feed.expected = seq + 1
            return
        row.batches += 1
        if row.state == KV_LOST:
            row.state = KV_LIVE
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(feed.slot, event)
            elif isinstance(event, BlockRemoved):
                self._removed(feed.slot, event)
            else:
                self.index.forget(feed.slot)

    def _stored(self, slot: int, ev: BlockStored) -> None:
        n, size = len(ev.block_hashes), ev.block_size
        row = self.rows[slot]
        if ev.medium not in GPU_MEDIA or size <= 0 or len(ev.token_ids) != n * size:
            row.dropped += 1
            return
        row.block_size = size
        epoch = row.epoch
        owner = (epoch << 16) | (slot + 1)
        if ev.parent_block_hash is None:
            crc, blocks = (zlib.crc32(extra_bytes(ev.lora_name)) if ev.lora_name else 0), 0
        else:
            i = self.hashes.find(mixed(engine_hash(ev.parent_block_hash), slot, epoch))
            if i < 0:  # its parent is not known (evicted, or before this subscription): it cannot be keyed
                return
            parent = self.hashes.values[i]
            crc, blocks = parent >> 32, parent & 0xFFFFFFFF
        try:
            data = memoryview(ids_bytes(ev.token_ids))
        except (OverflowError, TypeError):
            row.dropped += 1
            return
        extras = ev.extra_keys or ()
        step = size * TOKEN_BYTES
        parent, at = (block_key(crc, blocks) if blocks else 0), -1
        for j, h in enumerate(ev.block_hashes):
            extra = extras[j] if j < len(extras) else None
            if extra and ev.lora_name and extra[0] == ev.lora_name:
                extra = extra[1:]
            if extra:
                crc = zlib.crc32(extra_bytes(list(extra)), crc)
            crc = zlib.crc32(data[j * step : (j + 1) * step], crc)
            blocks += 1
            key = block_key(crc, blocks)
            e, _, _ = self.hashes.put(mixed(engine_hash(h), slot, epoch), owner, key)
            self.parents[e] = parent
            at = self.index.add(slot, key, parent, at)
            parent = key

    def _removed(self, slot: int, ev: BlockRemoved) -> None:
        if ev.medium not in GPU_MEDIA:
            return
        epoch = self.rows[slot].epoch
        for h in ev.block_hashes:
            i = self.hashes.find(mixed(engine_hash(h), slot, epoch))
            if i >= 0:
                key, parent = self.hashes.values[i], self.parents[i]
                self.hashes.drop(i)
                self.index.remove(slot, key, parent)


class SubscriberProcess:
    """The replica's subscriber, running in a spawned process until `stop` (or until the process that started it
    is gone). It shares only the shared memory: the instance set it follows, the endpoints' health, the index
    and the subscription rows it writes. kv_event_config needs a restart, so the settings it is given at start
    are the ones in force."""

    def __init__(self, shared: SharedState, settings: Settings, budget_per_s: float = BUDGET_PER_S):
        ctx = multiprocessing.get_context("spawn")
        self.stopping = ctx.Event()
        self.process = ctx.Process(
            target=_subscribe,
            args=(shared, settings, budget_per_s, self.stopping, os.getpid()),
            name="motor-kv-events",
            daemon=True,  # ended at this process's exit, should stop() never come
        )
        self.process.start()

    def stop(self) -> None:
        self.stopping.set()
        self.process.join(STOP_WAIT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def _subscribe(shared: SharedState, settings: Settings, budget_per_s: float, stopping, parent: int) -> None:
    """The subscriber process's life. A terminal's Ctrl-C reaches the whole process group: the parent stops it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
    sub = KvSubscriber(shared, settings, budget_per_s)
    try:
        sub.run(lambda: stopping.is_set() or os.getppid() != parent)
    finally:
        sub.close()


def start_subscriber(
    shared: SharedState, settings: Settings, budget_per_s: float = BUDGET_PER_S
) -> SubscriberProcess | None:
    """The replica's subscriber when kv_event_config.enable is set (and the shared table was made for it)."""
    if not settings.kv_events.enable or len(shared.kv_blocks.key) < KV_ENTRIES:
        return None
    return SubscriberProcess(shared, settings, budget_per_s)
