"""The engines' KV events over real ZMQ: the subscriber (scheduling/kv_events.py) against engine_sim's publisher
and against a raw publisher the test drives (gaps and replay, AllBlocksCleared, restarts, refresh, garbage,
huge batches, floods), and the index it fills (scheduling/kv_index.py)."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import msgspec
import pytest
import zmq

from config import Endpoint, Instance, Settings
from config.sections import EndpointKvEvents, KvEventConfig
from engine_sim import launch
from engine_sim.tokens import text_token_ids
from harness.loopback import free_ports, wait_until
from scheduling.kv_events import BUDGET_PER_S, MAX_MESSAGE_BYTES, start_subscriber
from scheduling.kv_index import KV_LIVE, KV_LOST, KV_OFF, KvIndex, PromptKeys, prompt_seed
from scheduling.registry import Registry
from scheduling.tokens import ids_bytes
from state.shared import SharedState

BLOCK = 16


def instance(iid: int, address: str, pub: int, replay: int | None) -> Instance:
    kv = EndpointKvEvents(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}" if replay else "")
    return Instance(id=iid, role="union", model_name="m", endpoints=(Endpoint(id=0, address=address, kv_events=kv),))


class Subscribed:
    """A SharedState with an instance set, and the replica's subscriber (its process, as app.py starts it) on it."""

    def __init__(self, instances: list[Instance], budget_per_s: float = BUDGET_PER_S):
        self.shared = SharedState.create(kv_events=True)
        self.registry = Registry(self.shared)
        self.registry.apply("set", instances)
        for t in self.registry.view().targets:
            self.shared.endpoints[t.slot].healthy = 1.0
        settings = Settings(instances=tuple(instances), kv_events=KvEventConfig(enable=True))
        self.sub = start_subscriber(self.shared, settings, budget_per_s)
        self.index = KvIndex(self.shared)
        # Subscribed once the process has made every endpoint's sockets (`lost` until they connect).
        assert wait_until(lambda: all(self.row(i.id).state != KV_OFF for i in instances), 10)

    def slot(self, iid: int) -> int:
        return next(t.slot for t in self.registry.view().targets if t.instance_id == iid)

    def row(self, iid: int):
        return self.shared.kv_endpoints[self.slot(iid)]

    def cached(self, iid: int, ids: list[int], salt: str | None = None) -> int:
        return self.index.cached_tokens_at(self.slot(iid), PromptKeys(ids_bytes(ids), prompt_seed(salt)))

    def close(self) -> None:
        self.sub.stop()


def sim_with_events(pub: int, replay: int | None, **cfg):
    kv = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{pub}"}
    if replay:
        kv["replay_endpoint"] = f"tcp://127.0.0.1:{replay}"
    return launch(**{"role": "union", "model": "m", "zero_latency": True, "block_size": BLOCK, "kv_events": kv, **cfg})


def complete(sim, ids: list[int], salt: str | None = None) -> dict:
    body = {"model": "m", "prompt": ids, "max_tokens": 1, **({"cache_salt": salt} if salt else {})}
    r = httpx.post(sim.url + "/v1/completions", json=body, timeout=10)
    r.raise_for_status()
    return r.json()["usage"]


def ids_of(text: str) -> list[int]:
    return text_token_ids(text)


PROMPT_A = ids_of("the quick brown fox jumps over the lazy dog " * 12)  # 132 tokens: 8 full blocks
PROMPT_B = ids_of("rivers and stones tell a different story:  " * 12)


@pytest.fixture
def sim_pair():
    pub, replay = free_ports(2)
    sim = sim_with_events(pub, replay)
    world = Subscribed([instance(1, sim.address, pub, replay)])
    yield sim, world
    world.close()
    sim.stop()


def test_stored_blocks_predict_the_engines_cached_tokens(sim_pair):
    sim, world = sim_pair
    assert wait_until(lambda: world.row(1).state == KV_LIVE, 3)
    assert world.cached(1, PROMPT_A) == 0
    complete(sim, PROMPT_A)
    assert wait_until(lambda: world.cached(1, PROMPT_A) == 8 * BLOCK, 3)
    assert world.row(1).block_size == BLOCK
    # What the engine reports next time is what the index predicted.
    assert complete(sim, PROMPT_A)["prompt_tokens_details"]["cached_tokens"] == 8 * BLOCK
    # A prompt sharing the first blocks: its shared prefix only; another prompt: nothing.
    longer = PROMPT_A[: 5 * BLOCK] + PROMPT_B
    assert world.cached(1, longer) == 5 * BLOCK
    assert world.cached(1, PROMPT_B) == 0
    # A cache salt is another scope: the same ids under it are not held.
    assert world.cached(1, PROMPT_A, salt="tenant-x") == 0


def test_a_salted_prompts_blocks_are_stored_in_its_scope(sim_pair):
    """engine_sim as vLLM 0.32: a request's cache_salt is in its first block's hash and in that block's extra keys
    of BlockStored, so the index keys the blocks by the salt: the same ids under another salt, or none, are not
    held, at the engine as in the index."""
    sim, world = sim_pair
    assert wait_until(lambda: world.row(1).state == KV_LIVE, 3)
    complete(sim, PROMPT_A, salt="tenant-x")
    assert wait_until(lambda: world.cached(1, PROMPT_A, salt="tenant-x") == 8 * BLOCK, 3)
    assert world.cached(1, PROMPT_A) == 0 and world.cached(1, PROMPT_A, salt="tenant-y") == 0
    assert complete(sim, PROMPT_A)["prompt_tokens_details"]["cached_tokens"] == 0
    assert complete(sim, PROMPT_A, salt="tenant-x")["prompt_tokens_details"]["cached_tokens"] == 8 * BLOCK
    assert wait_until(lambda: world.cached(1, PROMPT_A) == 8 * BLOCK, 3)  # the unsalted copy, stored since
    assert world.row(1).blocks == 16


def test_all_blocks_cleared_forgets_the_engine(sim_pair):
    sim, world = sim_pair
    complete(sim, PROMPT_A)
    assert wait_until(lambda: world.row(1).blocks == 8, 3)
    httpx.post(sim.url + "/reset_prefix_cache").raise_for_status()
    assert wait_until(lambda: world.row(1).blocks == 0, 3)
    assert world.cached(1, PROMPT_A) == 0
    assert world.row(1).state == KV_LIVE
    complete(sim, PROMPT_B)  # and it goes on learning
    assert wait_until(lambda: world.cached(1, PROMPT_B) == 8 * BLOCK, 3)


def test_evictions_are_applied():
    pub, replay = free_ports(2)
    sim = sim_with_events(pub, replay, prefix_cache_blocks=10)
    world = Subscribed([instance(1, sim.address, pub, replay)])
    try:
        assert wait_until(lambda: world.row(1).state == KV_LIVE, 3)
        time.sleep(0.3)  # the SUB socket's subscription reaches the publisher
        complete(sim, PROMPT_A)
        assert wait_until(lambda: world.cached(1, PROMPT_A) == 8 * BLOCK, 3)
        complete(sim, PROMPT_B)  # 16 blocks in a cache of 10: A's tail goes first, then more
        assert wait_until(lambda: world.row(1).blocks == 10, 3)
        assert world.cached(1, PROMPT_B) == 8 * BLOCK
        predicted_a = world.cached(1, PROMPT_A)
        engine_a = complete(sim, PROMPT_A)["prompt_tokens_details"]["cached_tokens"]
        assert predicted_a == engine_a < 8 * BLOCK  # the engine lost some of A, and the index knows how much
    finally:
        world.close()
        sim.stop()


def test_a_sim_that_cannot_bind_its_replay_socket_releases_what_it_bound():
    """A sim whose replay port is taken fails to start, and gives back its HTTP and publisher ports: a context left
    holding a socket blocks the garbage collector's term() forever (CI's run stalled 300 s on one)."""
    http, pub = free_ports(2)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(zmq.ZMQError):
            sim_with_events(pub, taken.getsockname()[1], port=http)
    for port in (http, pub):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_late_subscriber_recovers_history_through_the_replay_socket():
    pub, replay = free_ports(2)
    sim = sim_with_events(pub, replay)
    complete(sim, PROMPT_A)  # published before anyone listens (seq 0)
    world = Subscribed([instance(1, sim.address, pub, replay)])
    try:
        time.sleep(0.3)
        complete(sim, PROMPT_B)  # seq 1: a gap from 0, asked of the replay socket
        assert wait_until(lambda: world.cached(1, PROMPT_B) == 8 * BLOCK, 3)
        assert wait_until(lambda: world.cached(1, PROMPT_A) == 8 * BLOCK, 3)
        assert world.row(1).state == KV_LIVE
    finally:
        world.close()
        sim.stop()


def test_what_an_engine_published_before_the_subscription_reached_it_is_asked_at_connect():
    """A PUB socket drops what it sends before a subscription reaches it, and an engine that publishes nothing more
    shows no gap: the connect itself asks the replay socket for everything from the start."""
    pub, replay = free_ports(2)
    publisher = RawPublisher(pub, replay)
    publisher.send(0, [stored(PROMPT_A, 100)])  # nobody listens yet: dropped, but kept for the replay
    world = Subscribed([instance(1, "127.0.0.1:1", pub, replay)])
    try:
        publisher.serve_replay()
        assert publisher.asked == [0]
        assert wait_until(lambda: world.cached(1, PROMPT_A) == 8 * BLOCK, 3)
        assert world.row(1).state == KV_LIVE and world.row(1).seq == 0
    finally:
        world.close()
        publisher.close()


def test_without_a_replay_socket_what_was_missed_stays_unknown():
    pub = free_ports(1)[0]
    sim = sim_with_events(pub, None)
    complete(sim, PROMPT_A)
    world = Subscribed([instance(1, sim.address, pub, None)])
    try:
        time.sleep(0.3)
        complete(sim, PROMPT_B)
        assert wait_until(lambda: world.cached(1, PROMPT_B) == 8 * BLOCK, 3)
        assert world.cached(1, PROMPT_A) == 0
    finally:
        world.close()
        sim.stop()


def test_an_engine_restart_forgets_what_it_held():
    pub, replay = free_ports(2)
    sim = sim_with_events(pub, replay)
    world = Subscribed([instance(1, sim.address, pub, replay)])
    try:
        time.sleep(0.3)
        complete(sim, PROMPT_A)
        complete(sim, PROMPT_B)
        assert wait_until(lambda: world.row(1).seq == 1, 3)
        assert world.row(1).clears == 0
        sim.stop()  # a new engine on the same addresses: its numbering starts at 0 again
        sim = sim_with_events(pub, replay, port=int(world.registry.view().targets[0].address.split(":")[1]))
        time.sleep(0.5)  # the SUB socket reconnects on its own
        complete(sim, PROMPT_B)
        assert wait_until(lambda: world.row(1).seq == 0 and world.cached(1, PROMPT_B) == 8 * BLOCK, 5)
        assert world.cached(1, PROMPT_A) == 0  # the restarted engine holds none of A
        assert world.row(1).clears == 1
    finally:
        world.close()
        sim.stop()


def test_refresh_subscribes_and_unsubscribes():
    (pub1, rep1, pub2, rep2) = free_ports(4)
    one, two = sim_with_events(pub1, rep1), sim_with_events(pub2, rep2)
    world = Subscribed([instance(1, one.address, pub1, rep1)])
    try:
        world.registry.apply("add", [instance(2, two.address, pub2, rep2)])
        for t in world.registry.view().targets:
            world.shared.endpoints[t.slot].healthy = 1.0
        assert wait_until(lambda: world.row(2).state == KV_LIVE, 3)
        time.sleep(0.3)
        complete(two, PROMPT_A)
        assert wait_until(lambda: world.cached(2, PROMPT_A) == 8 * BLOCK, 3)
        assert world.cached(1, PROMPT_A) == 0  # one engine's blocks are its own
        slot = world.slot(2)
        world.registry.apply("del", [2])
        assert wait_until(lambda: world.shared.kv_endpoints[slot].state == KV_OFF, 3)
        assert world.shared.kv_endpoints[slot].blocks == 0
    finally:
        world.close()
        one.stop()
        two.stop()


def test_an_engine_found_unhealthy_is_forgotten(sim_pair):
    sim, world = sim_pair
    time.sleep(0.3)
    complete(sim, PROMPT_A)
    assert wait_until(lambda: world.row(1).blocks == 8, 3)
    world.shared.endpoints[world.slot(1)].healthy = 0.0
    assert wait_until(lambda: world.row(1).blocks == 0, 3)
    assert world.row(1).state == KV_LOST


# -- a raw publisher the test drives --------------------------------------------------------------------


class RawPublisher:
    """vLLM's wire by hand: PUB frames with chosen sequence numbers, a ROUTER that replays chosen batches."""

    def __init__(self, pub: int | str, replay: int | str):
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 0)
        self.pub.bind(pub if isinstance(pub, str) else f"tcp://127.0.0.1:{pub}")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(replay if isinstance(replay, str) else f"tcp://127.0.0.1:{replay}")
        self.kept: dict[int, bytes] = {}
        self.asked: list[int] = []

    def send(self, seq: int, events: list[dict], publish: bool = True) -> None:
        payload = msgspec.msgpack.encode([time.time(), events])
        self.kept[seq] = payload
        if publish:
            self.pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))

    def frames(self, *frames: bytes) -> None:
        self.pub.send_multipart(frames)

    def serve_replay(self, timeout_s: float = 3.0, topic: bool = True) -> None:
        """Answer one replay request as vLLM 0.32 does, the topic before each sequence number (`topic=False`: as
        earlier vLLM and SGLang do, without it)."""
        if not self.router.poll(int(timeout_s * 1000)):
            raise AssertionError("no replay request came")
        client, _, start = self.router.recv_multipart()
        first = int.from_bytes(start, "big")
        self.asked.append(first)
        head = (client, b"", b"kv") if topic else (client, b"")
        for seq in sorted(self.kept):
            if seq >= first:
                self.router.send_multipart((*head, seq.to_bytes(8, "big"), self.kept[seq]))
        end = (client, b"", b"") if topic else (client, b"")
        self.router.send_multipart((*end, (-1).to_bytes(8, "big", signed=True), b""))

    def close(self) -> None:
        self.pub.close(0)
        self.router.close(0)
        self.ctx.term()


def stored(ids: list[int], first_hash: int, parent: int | None = None) -> dict:
    n = len(ids) // BLOCK
    return {
        "type": "BlockStored",
        "block_hashes": list(range(first_hash, first_hash + n)),
        "parent_block_hash": parent,
        "token_ids": ids[: n * BLOCK],
        "block_size": BLOCK,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


@pytest.fixture
def raw():
    pub, replay = free_ports(2)
    publisher = RawPublisher(pub, replay)
    world = Subscribed([instance(1, "127.0.0.1:1", pub, replay)])
    publisher.serve_replay()  # what it asks at connect: nothing was published before
    time.sleep(0.3)  # the SUB socket's subscription reaches the publisher
    yield publisher, world
    world.close()
    publisher.close()


@pytest.mark.parametrize("topic", [True, False], ids=["vllm-0.32", "earlier-vllm"])
def test_a_gap_is_filled_from_the_replay_socket(raw, topic):
    """vLLM 0.32's replay socket sends the topic before each sequence number; earlier vLLM and SGLang do not."""
    publisher, world = raw
    a, b = PROMPT_A[: 4 * BLOCK], PROMPT_A[4 * BLOCK : 8 * BLOCK]
    publisher.send(0, [stored(a, 100)])
    assert wait_until(lambda: world.cached(1, PROMPT_A) == 4 * BLOCK, 3)
    publisher.send(1, [stored(b, 200, parent=103)], publish=False)  # lost on the way
    publisher.send(2, [{"type": "BlockRemoved", "block_hashes": [999], "medium": "GPU"}])
    publisher.serve_replay(topic=topic)
    assert publisher.asked == [0, 1]  # at connect, then the gap
    assert wait_until(lambda: world.cached(1, PROMPT_A) == 8 * BLOCK, 3)
    assert wait_until(lambda: world.row(1).state == KV_LIVE, 3)  # the replay's end marker came
    assert world.row(1).seq == 2
    assert world.row(1).clears == 0  # the gap was filled: nothing forgotten


def test_an_engine_publishing_on_a_unix_socket_is_followed(tmp_path):
    """vLLM binds its PUB socket only for a wildcard or an ipc:// address (it connects to any other host): an
    engine on the Coordinator's host that must listen on no network publishes on ipc://, which the config takes."""
    from config import settings_from_dict
    from harness.configs import coordinator_config

    pub, replay = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    ep = {"id": 0, "address": "127.0.0.1:1", "kv_events": {"endpoint": pub, "replay_endpoint": replay}}
    cfg = coordinator_config([{"id": 1, "role": "union", "model_name": "m", "endpoints": [ep]}])
    (inst,) = settings_from_dict(cfg).instances
    publisher = RawPublisher(pub, replay)
    world = Subscribed([inst])
    try:
        publisher.serve_replay()
        time.sleep(0.3)
        publisher.send(0, [stored(PROMPT_A, 100)])
        assert wait_until(lambda: world.cached(1, PROMPT_A) == 8 * BLOCK, 3)
        assert world.row(1).state == KV_LIVE
    finally:
        world.close()
        publisher.close()


def _source_on_a_live_feed(publisher, world):
    """The policies' KvEventSource over `world`'s index once its feed is live and its block size known (PROMPT_B
    stored), its one target, and a JobInfo for token ids."""
    from scheduling.affinity import PrefixIndex
    from scheduling.kv_index import KvEventSource
    from scheduling.policies import JobInfo

    publisher.send(0, [stored(PROMPT_B, 100)])
    assert wait_until(lambda: world.cached(1, PROMPT_B) == 8 * BLOCK, 3)
    (target,) = world.registry.view().targets

    def job(ids: list[int]) -> JobInfo:
        return JobInfo("m", len(ids), 1, 1000, 50, prompt_keys=PromptKeys(ids_bytes(ids)))

    return KvEventSource(world.index, PrefixIndex(world.shared, BLOCK)), target, job


def test_a_prompt_in_flight_counts_as_held_until_its_events_come(raw):
    """A request's prompt sent to an engine is cached there for the requests after it (vLLM shares its blocks
    even within one step) before its events arrive: a second turn of it counts those blocks as held, until a
    moment after the first request is done."""
    from scheduling.kv_index import INFLIGHT_GRACE_S
    from scheduling.ledger import Ledger

    publisher, world = raw
    source, target, job = _source_on_a_live_feed(publisher, world)
    turn = PROMPT_A + ids_of(" and the next turn of it")
    assert source.cached_tokens(job(turn), target) == 0
    lease = Ledger(world.shared, 0, 1).lease(target.slot, len(PROMPT_A), 1)
    source.placed(lease, job(PROMPT_A))
    assert source.cached_tokens(job(turn), target) == 8 * BLOCK
    assert source.cached_tokens(job(PROMPT_B + PROMPT_A), target) == 8 * BLOCK  # B's own, from the events
    lease.release()
    assert source.cached_tokens(job(turn), target) == 8 * BLOCK  # its events may trail its answer
    time.sleep(INFLIGHT_GRACE_S + 0.1)
    assert source.cached_tokens(job(turn), target) == 0


def test_a_finished_prompt_whose_events_are_in_counts_only_what_is_left_of_it(raw):
    """Once the events show a finished prompt stored, the index says what is left of it: another prefill on the
    engine may evict its tail within the grace, and the next turn then finds only the head."""
    from scheduling.ledger import Ledger

    publisher, world = raw
    source, target, job = _source_on_a_live_feed(publisher, world)
    turn = PROMPT_A + ids_of(" and the next turn of it")
    lease = Ledger(world.shared, 0, 1).lease(target.slot, len(PROMPT_A), 1)
    source.placed(lease, job(PROMPT_A))
    publisher.send(1, [stored(PROMPT_A, 200)])
    assert wait_until(lambda: world.cached(1, PROMPT_A) == 8 * BLOCK, 3)
    lease.release()
    assert source.cached_tokens(job(turn), target) == 8 * BLOCK
    publisher.send(2, [{"type": "BlockRemoved", "block_hashes": [205, 206, 207], "medium": "GPU"}])
    assert wait_until(lambda: world.row(1).seq == 2, 3)
    assert source.cached_tokens(job(turn), target) == 5 * BLOCK  # within the grace: the eviction counts


def test_blocks_are_scoped_by_cache_salt_and_lora(raw):
    """vLLM puts a request's cache_salt in its first block's extra keys and a LoRA's name in every block's: such
    blocks answer only a prompt of the same scope."""
    publisher, world = raw
    salted = stored(PROMPT_A, 100)
    salted["extra_keys"] = [["tenant-x"]] + [None] * 7
    adapter = stored(PROMPT_B, 200)
    adapter["lora_name"], adapter["lora_id"] = "sql-lora", 1
    adapter["extra_keys"] = [["sql-lora"]] * 8
    publisher.send(0, [salted, adapter])
    assert wait_until(lambda: world.row(1).blocks == 16, 3)
    assert world.cached(1, PROMPT_A, salt="tenant-x") == 8 * BLOCK
    assert world.cached(1, PROMPT_A) == 0
    assert world.cached(1, PROMPT_A, salt="tenant-y") == 0
    assert world.cached(1, PROMPT_B) == 0  # the adapter's blocks are not the base model's


def test_removed_blocks_cut_the_prefix(raw):
    publisher, world = raw
    publisher.send(0, [stored(PROMPT_A, 100)])
    assert wait_until(lambda: world.cached(1, PROMPT_A) == 8 * BLOCK, 3)
    publisher.send(1, [{"type": "BlockRemoved", "block_hashes": [105, 106, 107], "medium": "GPU"}])
    assert wait_until(lambda: world.cached(1, PROMPT_A) == 5 * BLOCK, 3)
    assert world.row(1).blocks == 5
    publisher.send(2, [{"type": "BlockRemoved", "block_hashes": [104], "medium": "CPU"}])  # another tier's
    assert wait_until(lambda: world.row(1).seq == 2, 3)
    assert world.row(1).blocks == 5 and world.cached(1, PROMPT_A) == 5 * BLOCK  # the GPU's blocks stay
    publisher.send(3, [{"type": "AllBlocksCleared"}])
    assert wait_until(lambda: world.row(1).blocks == 0, 3)


def test_garbage_frames_are_dropped_and_the_feed_goes_on(raw):
    publisher, world = raw
    publisher.send(0, [stored(PROMPT_A, 100)])
    assert wait_until(lambda: world.row(1).blocks == 8, 3)
    publisher.frames(b"only one frame")
    publisher.frames(b"", b"short", b"x")
    publisher.frames(b"", (1).to_bytes(8, "big"), b"\xc1\xff not msgpack")  # seq 1 undecodable: forgotten
    assert wait_until(lambda: world.row(1).dropped >= 3, 3)
    assert wait_until(lambda: world.row(1).blocks == 0, 3)
    publisher.frames(b"", (2).to_bytes(8, "big"), msgspec.msgpack.encode([1.0, [{"type": "Nonsense"}]]))
    publisher.frames(b"", (3).to_bytes(8, "big"), msgspec.msgpack.encode({"not": "a batch"}))
    publisher.send(4, [stored(PROMPT_B, 300)])
    assert wait_until(lambda: world.cached(1, PROMPT_B) == 8 * BLOCK, 3)
    assert world.row(1).state == KV_LIVE
    # Blocks whose token ids do not fill them, and ids that are no tokens, are refused.
    bad = stored(PROMPT_A, 400)
    bad["token_ids"] = bad["token_ids"][:-1]
    negative = stored(PROMPT_A, 500)
    negative["token_ids"] = [-1] * len(negative["token_ids"])
    before = world.row(1).dropped
    publisher.send(5, [bad, negative])
    assert wait_until(lambda: world.row(1).dropped == before + 2, 3)
    assert world.row(1).blocks == 8


def test_a_huge_batch_is_refused_unread(raw):
    publisher, world = raw
    huge = stored(list(range(1, (MAX_MESSAGE_BYTES // 2) + 1)), 100)  # ids of up to 5 bytes each: over the cap
    publisher.send(0, [huge])
    publisher.send(1, [stored(PROMPT_B, 300)])  # sent after it on the same (by now closed) connection
    time.sleep(0.5)
    assert world.row(1).blocks == 0
    # ZMQ reconnects; what follows is read (seq 2 after a gap: the replay holds 0 and 1, the huge one refused again).
    deadline = time.monotonic() + 5
    seq = 2
    while world.cached(1, PROMPT_A) == 0 and time.monotonic() < deadline:
        publisher.send(seq, [stored(PROMPT_A, 1000 * seq)])
        seq += 1
        time.sleep(0.2)
        if publisher.router.poll(0):
            publisher.kept.pop(0)  # the engine's buffer rolled past it
            publisher.serve_replay()
    assert world.cached(1, PROMPT_A) == 8 * BLOCK


def flood(publisher: RawPublisher, seconds: float) -> float:
    """Send one batch after another for `seconds` from an asyncio loop; the loop's longest stall meanwhile."""
    payload = msgspec.msgpack.encode([time.time(), [stored(PROMPT_A, 100)]])

    async def watch() -> float:
        worst, last = 0.0, time.monotonic()
        end = last + seconds
        while last < end:
            await asyncio.sleep(0.001)
            now = time.monotonic()
            worst, last = max(worst, now - last), now
        return worst

    async def flood_and_watch() -> float:
        watcher = asyncio.ensure_future(watch())
        seq = 0
        while not watcher.done():
            for _ in range(50):
                publisher.frames(b"", seq.to_bytes(8, "big"), payload)
                seq += 1
            await asyncio.sleep(0)
        return await watcher

    return asyncio.run(flood_and_watch())


def test_a_flood_keeps_the_loop_responsive(raw):
    """The subscriber's process was started by this one, which runs an asyncio loop (as Sanic's single-process
    mode starts it): a flood of events never holds the loop for long (bench/kv_events.py measures how long)."""
    publisher, world = raw
    worst = flood(publisher, 2.0)
    assert world.row(1).batches > 1000
    assert worst < 0.5, f"the loop stalled {worst * 1000:.0f} ms"


def test_beyond_its_budget_an_engine_is_read_no_more_and_forgotten():
    pub, replay = free_ports(2)
    publisher = RawPublisher(pub, replay)
    budget = 3000.0  # units a second: a batch of 8 blocks costs about 20
    world = Subscribed([instance(1, "127.0.0.1:1", pub, replay)], budget_per_s=budget)
    try:
        publisher.serve_replay()
        time.sleep(0.3)
        started = time.monotonic()
        flood(publisher, 1.0)
        elapsed = time.monotonic() - started
        row = world.row(1)
        assert row.dropped > 0 and row.clears > 0
        cost = 1.0 + len(msgspec.msgpack.encode([time.time(), [stored(PROMPT_A, 100)]])) / 64.0
        assert row.batches * cost <= budget * (elapsed + 1.0)  # what it applied stayed within the budget
        time.sleep(1.0)  # within budget again: the next batch is applied
        publisher.send(10**6, [stored(PROMPT_B, 300)])
        publisher.serve_replay()
        assert wait_until(lambda: world.cached(1, PROMPT_B) == 8 * BLOCK, 3)
    finally:
        world.close()
        publisher.close()


# -- the Coordinator routes on them ---------------------------------------------------------------------------


def test_the_coordinator_routes_to_the_engine_holding_the_prefix():
    """Two union engines; one of them computed a prompt for a client that did not come through the Coordinator
    (as another replica's would). The Coordinator's estimate knows nothing of it; the engines' events do: the
    prompt's next turn goes there, the log line says what was predicted and what the engine reported, and
    /instances and /metrics show the subscription."""
    from harness.configs import coordinator_config
    from harness.coordinator import Coordinator

    sims, instances = engines_with_events(2, "union")
    cfg = coordinator_config(
        instances,
        scheduler_config={"scheduler_type": "kv_cache_affinity"},
        kv_event_config={"enable": True},
    )
    try:
        with Coordinator(cfg) as coord:
            assert wait_until(lambda: _kv_states(coord) == ["live", "live"], 10)
            assert httpx.get(coord.mgmt + "/instances").json()["prompt_tokens"] == {"m": "estimate"}
            for holder in (1, 0):  # each engine in turn holds a conversation, whatever the rotation says
                prompt = PROMPT_A if holder == 1 else PROMPT_B
                complete(sims[holder], prompt)  # straight to the engine
                assert wait_until(lambda h=holder: _kv_blocks(coord)[h] >= 8, 5)
                before = [len(s.requests()) for s in sims]
                turn = prompt + ids_of(" and the next turn of it, somewhat longer")
                for _ in range(3):
                    r = httpx.post(
                        coord.url + "/v1/completions", json={"model": "m", "prompt": turn, "max_tokens": 1}, timeout=10
                    )
                    assert r.status_code == 200, r.text
                    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 8 * BLOCK
                after = [len(s.requests()) for s in sims]
                assert after[holder] - before[holder] == 3 and after[1 - holder] == before[1 - holder]
            assert wait_until(lambda: "cached_tokens_predicted=128 cached_tokens=128" in coord.output(), 5)
            metrics = httpx.get(coord.obs + "/metrics").text
            assert 'motor_kv_prediction_total{model="m",outcome="exact"} 6.0' in metrics
            assert "motor_kv_events_blocks{" in metrics
    finally:
        for sim in sims:
            sim.stop()


def test_a_prompt_of_whole_blocks_is_predicted_to_reuse_all_but_its_last():
    """vLLM computes at least a prompt's last token, so a prompt of exactly 8 cached blocks reuses 7 (not all but
    one token): the engine reports it so, and the Coordinator predicts it so."""
    from harness.configs import coordinator_config
    from harness.coordinator import Coordinator

    sims, instances = engines_with_events(1, "union")
    whole = PROMPT_A[: 8 * BLOCK]
    cfg = coordinator_config(
        instances, scheduler_config={"scheduler_type": "kv_cache_affinity"}, kv_event_config={"enable": True}
    )
    try:
        with Coordinator(cfg) as coord:
            assert wait_until(lambda: _kv_states(coord) == ["live"], 10)
            complete(sims[0], whole)  # straight to the engine
            assert wait_until(lambda: _kv_blocks(coord)[0] >= 8, 5)
            r = httpx.post(coord.url + "/v1/completions", json={"model": "m", "prompt": whole, "max_tokens": 1})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 7 * BLOCK
            assert wait_until(lambda: "cached_tokens_predicted=112 cached_tokens=112" in coord.output(), 5)
    finally:
        sims[0].stop()


def test_new_conversations_on_a_prefix_both_engines_hold_are_spread():
    """Both engines hold a shared system prompt: new conversations on it go to the less loaded, in turn, not
    all to the first engine (whose cache they would crowd while the other's stays idle)."""
    from harness.configs import coordinator_config
    from harness.coordinator import Coordinator

    sims, instances = engines_with_events(2, "union")
    cfg = coordinator_config(
        instances, scheduler_config={"scheduler_type": "kv_cache_affinity"}, kv_event_config={"enable": True}
    )
    try:
        with Coordinator(cfg) as coord:
            assert wait_until(lambda: _kv_states(coord) == ["live", "live"], 10)
            for sim in sims:
                complete(sim, PROMPT_A)  # straight to each engine
            assert wait_until(lambda: min(_kv_blocks(coord)) >= 8, 5)
            before = [len(s.requests()) for s in sims]
            for k in range(4):
                prompt = PROMPT_A + ids_of(f" conversation {k}")
                r = httpx.post(coord.url + "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 1})
                assert r.status_code == 200, r.text
            assert [len(s.requests()) - b for s, b in zip(sims, before)] == [2, 2]
    finally:
        for sim in sims:
            sim.stop()


def _kv(coord) -> list[dict]:
    body = httpx.get(coord.mgmt + "/instances").json()
    return [ep["kv_events"] for inst in sorted(body["instances"], key=lambda i: i["id"]) for ep in inst["endpoints"]]


def _kv_states(coord) -> list[str]:
    return [k["state"] for k in _kv(coord)]


def _kv_blocks(coord) -> list[int]:
    return [k["blocks"] for k in _kv(coord)]


def engines_with_events(n: int, role: str, **cfg) -> tuple[list, list[dict]]:
    """`n` engines of `role` (engine_sim `cfg` beside) publishing KV events, and their instances (ids 1..n), each
    with its own addresses."""
    ports = free_ports(2 * n)
    sims = [sim_with_events(ports[2 * i], ports[2 * i + 1], role=role, **cfg) for i in range(n)]
    instances = [
        {
            "id": i + 1,
            "role": role,
            "model_name": "m",
            "endpoints": [
                {
                    "id": 0,
                    "address": sim.address,
                    "kv_events": {
                        "endpoint": f"tcp://127.0.0.1:{ports[2 * i]}",
                        "replay_endpoint": f"tcp://127.0.0.1:{ports[2 * i + 1]}",
                    },
                }
            ],
        }
        for i, sim in enumerate(sims)
    ]
    return sims, instances


def test_a_pd_request_prefills_where_the_prefix_is_and_says_what_p_reported():
    """PD: of two prefill engines, the one whose events say it holds the prompt's prefix gets the prefill leg (the
    other, never); the line compares the prediction with P's reported cached tokens."""
    from harness.configs import coordinator_config
    from harness.coordinator import Coordinator

    prefills, instances = engines_with_events(2, "prefill")
    decode = launch(role="decode", model="m", zero_latency=True, block_size=BLOCK)
    instances.append(
        {"id": 9, "role": "decode", "model_name": "m", "endpoints": [{"id": 0, "address": decode.address}]}
    )
    cfg = coordinator_config(
        instances, scheduler_config={"scheduler_type": "kv_cache_affinity"}, kv_event_config={"enable": True}
    )
    try:
        with Coordinator(cfg) as coord:
            # (the decode engine publishes nothing: its default address has no publisher, so it is not connected)
            assert wait_until(lambda: _kv_states(coord) == ["live", "live", "lost"], 10)
            complete(prefills[1], PROMPT_A)
            assert wait_until(lambda: _kv_blocks(coord)[1] >= 8, 5)
            turn = PROMPT_A + ids_of(" and the next turn of it, somewhat longer")
            for _ in range(2):
                r = httpx.post(coord.url + "/v1/completions", json={"model": "m", "prompt": turn, "max_tokens": 2})
                assert r.status_code == 200, r.text
                assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 8 * BLOCK
            assert len(prefills[0].requests()) == 0
            assert wait_until(lambda: coord.output().count("cached_tokens_predicted=128 cached_tokens=128") == 2, 5)
    finally:
        for sim in (*prefills, decode):
            sim.stop()


def test_each_replica_of_a_cluster_subscribes_for_itself():
    """Cluster mode: two replicas sharing a store; each has its own subscriber (a PUB serves any number of
    subscribers), so both send the conversation to the engine holding it."""
    from harness.configs import coordinator_config
    from harness.coordinator import Coordinator
    from harness.redis import RedisServer

    sims, instances = engines_with_events(2, "union")
    redis = RedisServer()
    cluster = {"redis_url": redis.url, "key_prefix": "motor:kv-test:"}
    configs = [
        coordinator_config(
            instances,
            scheduler_config={"scheduler_type": "kv_cache_affinity"},
            kv_event_config={"enable": True},
            cluster_config=cluster,
        )
        for _ in range(2)
    ]
    try:
        with Coordinator(configs[0]) as one, Coordinator(configs[1]) as two:
            for coord in (one, two):
                assert wait_until(lambda c=coord: _kv_states(c) == ["live", "live"], 10)
            complete(sims[1], PROMPT_A)
            for coord in (one, two):
                assert wait_until(lambda c=coord: _kv_blocks(c)[1] >= 8, 5)
            turn = PROMPT_A + ids_of(" and the next turn of it, somewhat longer")
            for coord in (one, two, one, two):
                r = httpx.post(coord.url + "/v1/completions", json={"model": "m", "prompt": turn, "max_tokens": 1})
                assert r.status_code == 200, r.text
                assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 8 * BLOCK
            assert len(sims[0].requests()) == 0
    finally:
        redis.stop()
        for sim in sims:
            sim.stop()


def test_a_prompt_of_ids_that_are_no_tokens_is_answered_as_the_engine_answers_it():
    """A token-id prompt holding a negative id cannot be keyed for the events' index: it is planned on its
    estimate, and its answer is the engine's own (not a failure of the Coordinator's)."""
    from harness.configs import coordinator_config
    from harness.coordinator import Coordinator

    sims, instances = engines_with_events(1, "union")
    cfg = coordinator_config(
        instances, scheduler_config={"scheduler_type": "kv_cache_affinity"}, kv_event_config={"enable": True}
    )
    body = {"model": "m", "prompt": [1, -5, 3], "max_tokens": 1}
    try:
        direct = httpx.post(sims[0].url + "/v1/completions", json=body, timeout=10)
        with Coordinator(cfg) as coord:
            assert wait_until(lambda: _kv_states(coord) == ["live"], 10)
            r = httpx.post(coord.url + "/v1/completions", json=body, timeout=10)
            assert r.status_code == direct.status_code != 500, r.text
    finally:
        for sim in sims:
            sim.stop()
