"""Where `kv_cache_affinity` on the engines' KV events places a conversation: the index's chains (each engine's
blocks that no block extends, scheduling/kv_index.py) kept from real events over ZMQ, a new conversation (its
cached prefix one that other prompts extend, a shared system prompt) placed where fewer chains live, and a running
one (its cached prefix a chain's end, its own history) kept where it is, over engine_sim's events."""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from harness.configs import coordinator_config
from harness.coordinator import Coordinator
from harness.loopback import CLIENT, wait_until
from scheduling.affinity import PrefixIndex
from scheduling.job import JobInfo
from scheduling.kv_index import KvEventSource, PromptKeys
from scheduling.tokens import ids_bytes
from tests.test_kv_events import BLOCK, _kv_blocks, _kv_states, complete, engines_with_events, ids_of, raw, stored

__all__ = ["raw"]  # the fixture, used by name

SYSTEM = ids_of("you are a careful assistant who answers briefly and well. " * 8)[: 3 * BLOCK]  # 3 blocks


def _removed(*hashes: int) -> dict:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": "GPU"}


def test_chains_are_counted_under_stored_removed_and_cleared_events(raw):
    """A block's children are the stored blocks extending it; an engine's chains are its blocks with none. Two
    conversations on one system prompt are two chains, and two chains go on from the system prompt's end (what
    makes a prompt whose cached prefix ends there a new conversation); removals walk it back, AllBlocksCleared
    empties it."""
    publisher, world = raw
    index, slot = world.index, world.slot(1)
    x = ids_of(" the first conversation asks about rivers and their stones" * 4)[: 2 * BLOCK]
    y = ids_of(" the second conversation asks about mountains and snow" * 4)[: 2 * BLOCK]
    opening = PromptKeys(ids_bytes(SYSTEM + ids_of(" a third opens")))

    publisher.send(0, [stored(SYSTEM, 100)])
    assert wait_until(lambda: world.row(1).blocks == 3, 3)
    assert world.row(1).leaves == 1  # the system prompt alone: one chain, ending at its last block
    assert index.children_at(slot, opening, 3) == 0
    publisher.send(1, [stored(x, 200, parent=102)])
    assert wait_until(lambda: world.row(1).blocks == 5, 3)
    assert world.row(1).leaves == 1 and index.children_at(slot, opening, 3) == 1  # x goes on from its end
    publisher.send(2, [stored(y, 300, parent=102)])
    assert wait_until(lambda: world.row(1).blocks == 7, 3)
    assert world.row(1).leaves == 2 and index.children_at(slot, opening, 3) == 2  # two chains share it
    assert index.children_at(slot, PromptKeys(ids_bytes(SYSTEM + x + [7])), 5) == 0  # x's history ends a chain

    publisher.send(3, [_removed(301)])  # a tail evicted: its chain ends a block earlier
    assert wait_until(lambda: world.row(1).blocks == 6, 3)
    assert world.row(1).leaves == 2
    publisher.send(4, [_removed(300)])  # y gone: the system prompt still extended by x
    assert wait_until(lambda: world.row(1).blocks == 5, 3)
    assert world.row(1).leaves == 1 and index.children_at(slot, opening, 3) == 1
    publisher.send(5, [_removed(201, 200)])  # x gone: the system prompt's end is a chain's end again
    assert wait_until(lambda: world.row(1).blocks == 3, 3)
    assert world.row(1).leaves == 1 and index.children_at(slot, opening, 3) == 0
    publisher.send(6, [stored(x, 200, parent=102), stored(y, 300, parent=102), _removed(100, 101, 102)])
    assert wait_until(lambda: world.row(1).blocks == 4, 3)
    assert world.row(1).leaves == 2  # its head evicted under them: x and y still two chains
    publisher.send(7, [stored(x, 400, parent=201), {"type": "AllBlocksCleared"}])
    assert wait_until(lambda: world.row(1).clears == 1, 3)
    assert world.row(1).blocks == 0 and world.row(1).leaves == 0


def test_the_answer_as_generated_is_no_conversation_of_its_own(raw):
    """The engine caches a turn's answer as it generated it; the next prompt may render it otherwise and go on
    from the block before it: two chain ends, one conversation. Its next turn is judged a running conversation
    (one branch goes on from its history), and once it is kept there the branch is not counted as a conversation."""
    publisher, world = raw
    source = KvEventSource(world.index, PrefixIndex(world.shared, BLOCK))
    (target,) = world.registry.view().targets
    history = SYSTEM + ids_of(" the first conversation asks about rivers and their stones" * 4)[: 2 * BLOCK]
    generated = ids_of(" an answer as the engine generated it, token by token" * 4)[:BLOCK]
    rendered = ids_of(" an answer as the next prompt renders it, from its text" * 4)[:BLOCK]
    publisher.send(0, [stored(history, 100), stored(generated, 200, parent=104)])
    assert wait_until(lambda: world.row(1).blocks == 6, 3)
    turn = history + rendered + ids_of(" and the next question")
    job = JobInfo("m", len(turn), 1, 1000, 50, prompt_keys=PromptKeys(ids_bytes(turn)))
    assert source.cached_tokens(job, target) == 5 * BLOCK and source.chains(target) == 1
    assert source.starts(job, target, 5 * BLOCK) is False
    source.kept(job, target, 5 * BLOCK)
    publisher.send(1, [stored(rendered, 300, parent=104)])  # the turn's blocks, beside the generated one
    assert wait_until(lambda: world.row(1).blocks == 7, 3)
    assert world.row(1).leaves == 2 and source.chains(target) == 1
    opening = JobInfo("m", 60, 1, 1000, 50, prompt_keys=PromptKeys(ids_bytes(SYSTEM + ids_of(" a new one"))))
    publisher.send(2, [stored(SYSTEM + rendered, 400)])  # another conversation on the system prompt
    assert wait_until(lambda: world.row(1).blocks == 8, 3)
    assert source.starts(opening, target, 3 * BLOCK) is True and source.chains(target) == 2


def _send(coord, sims, ids: list[int], stream: bool = False, max_tokens: int = 2) -> int:
    """Completes `ids` through the Coordinator (streamed, or one JSON answer); the index of the engine that served
    it."""
    before = [len(s.requests()) for s in sims]
    body = {"model": "m", "prompt": ids, "max_tokens": max_tokens, "stream": stream}
    r = CLIENT.post(coord.url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert ("data: [DONE]" in r.text) == stream, r.text
    served = [i for i, s in enumerate(sims) if len(s.requests()) > before[i]]
    assert len(served) == 1
    return served[0]


def _known(coord) -> list[bool]:
    """Per engine, whether slo_aware's model knows it (its status page predicts a TTFT and a TPOT there)."""
    body = CLIENT.get(coord.obs + "/status.json").json()
    predicted = [ep["predicted"] for inst in body["instances"] for ep in inst["endpoints"]]
    return [p["ttft_s"] is not None and p["tpot_s"] is not None for p in predicted]


@contextmanager
def _primed(cache_blocks: int, policy: str = "kv_cache_affinity", **sim):
    """Two engine_sim engines of `cache_blocks` blocks of prefix cache, a Coordinator routing on their events with
    `policy` (engine_sim `sim` settings beside), and six conversations on one system prompt (5 blocks each, 3 of them the system prompt's) of which
    the first engine served the first three straight (as another gateway's clients would)."""
    sims, instances = engines_with_events(2, "union", prefix_cache_blocks=cache_blocks, **sim)
    cfg = coordinator_config(instances, scheduler_config={"scheduler_type": policy}, kv_event_config={"enable": True})
    chats = [SYSTEM + ids_of(f" conversation {k} asks a question of about two blocks in length " * 3) for k in range(6)]
    try:
        with Coordinator(cfg) as coord:
            assert wait_until(lambda: _kv_states(coord) == ["live", "live"], 10)
            for chat in chats[:3]:
                complete(sims[0], chat)
            assert wait_until(lambda: _kv_blocks(coord)[0] == 9, 5)
            yield sims, coord, chats
    finally:
        for sim in sims:
            sim.stop()


@pytest.mark.parametrize(
    "policy, stream", [("kv_cache_affinity", False), ("slo_aware", False), ("slo_aware", True)], ids=str
)
def test_a_new_conversation_goes_where_fewer_chains_live_and_a_running_one_stays(policy, stream):
    """The first engine holds three conversations on a system prompt and has room for many more; the second holds
    nothing. New conversations on that system prompt go to the second engine (where their future turns will not
    crowd the first's), each until it holds as many: the cached system prompt alone does not hold them. Each
    running conversation's next turn stays where its history is.

    `slo_aware` places them so while both engines are on time: on JSON answers, which teach its model no first
    token (it cannot judge them), as `kv_cache_affinity` does; on streams, once its model knows both engines (a
    few prompts shorter than a block, which no cache keeps), among the plans within budget."""
    with _primed(64, policy, zero_latency=not stream) as (sims, coord, chats):  # streams' timings teach the model
        if stream:
            for k in range(12):
                _send(coord, sims, ids_of(" warm up" * (1 + k % 4))[: BLOCK - 1], stream=True, max_tokens=8)
            assert wait_until(lambda: all(_known(coord)), 5), _known(coord)
        assert [_send(coord, sims, chat, stream) for chat in chats[3:]] == [1, 1, 1]
        turns = [chat + ids_of(" and a next turn of it") for chat in chats]
        assert [_send(coord, sims, turn, stream) for turn in turns] == [0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize("policy", ["kv_cache_affinity", "slo_aware"])
def test_the_next_turn_of_a_short_first_turn_goes_back_where_that_turn_went(policy):
    """A first turn shorter than a block past its system prompt leaves no block of its own: the engines hold the
    system prompt alone of its next turn, as of any new conversation's. The Coordinator sent that turn, so the
    next, which extends it token for token, goes back there, where a new conversation would not go."""
    with _primed(64, policy) as (sims, coord, chats):
        opening = SYSTEM + ids_of(" a short one")
        assert len(opening) < 4 * BLOCK
        assert _send(coord, sims, opening) == 1  # a new conversation: where fewer chains live
        for k in range(5):  # another gateway's clients fill the second engine with conversations
            complete(sims[1], SYSTEM + ids_of(f" elsewhere {k} asks a question of about two blocks in length " * 3))
        assert wait_until(lambda: _kv_blocks(coord)[1] == 13, 5), _kv_blocks(coord)
        assert _send(coord, sims, SYSTEM + ids_of(" another short one")) == 0  # a new one goes to the first now
        assert _send(coord, sims, opening + ids_of(" an answer, and the next question")) == 1
