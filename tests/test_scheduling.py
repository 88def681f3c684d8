"""Scheduling without a server: token counts and block hashes, the prefix index, the learned model, the
ledger, every policy, SLO admission and the engine-metrics scrape, on shared state made in this process."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from array import array

import pytest

from config import Endpoint, Instance, Live, ModelConfig, Settings
from engine_sim import tokens as sim_tokens
from harness.predictor import teach_decode, teach_prefill
from harness.tokenizer import tiny_tokenizer
from scheduling import clock
from scheduling.admission import AdmissionQueue, OverBudget
from scheduling.affinity import PrefixIndex
from scheduling.exact import make_meter
from scheduling.health import Health
from scheduling.ledger import DECODE, LOAD_FIELDS, PREFILL, WHOLE, Ledger
from scheduling.policies import JobInfo
from scheduling.predict import ALLOWANCE_HALF_LIFE_S, ALLOWANCE_QUIET_S, GROUP_S, UNKNOWN, Predictor
from scheduling.registry import Registry, Target
from scheduling.scheduler import LEARN_INTERVAL_S, Scheduler, make_policy
from scheduling.scrape import EngineScrapes, parse_engine_metrics
from scheduling.tokens import (
    CHAT,
    COMPLETION,
    LEARN_MIN_BYTES,
    MAX_TOKENS_PER_BYTE,
    MESSAGES,
    MIN_TOKENS_PER_BYTE,
    PromptMeter,
    blocks_covered,
    chained_hashes,
    engine_cached,
    engine_prompt,
    engine_uncached,
    hashes_covering,
    ids_bytes,
    render_chatml,
)
from state.shared import ERROR_RING, SharedState

MODEL = "m"


def load_left(shared: SharedState) -> list[tuple[int, int, str]]:
    """(row, slot, counter) of every load counter of the ledger that is not zero (the area of the mean batch is
    history, not load)."""
    return [
        (r, k, f)
        for r, row in enumerate(shared.ledger)
        for k, c in enumerate(row.slots)
        for f in LOAD_FIELDS
        if getattr(c, f)
    ]


BLOCK = 16


def target(slot: int, role: str) -> Target:
    return Target(
        slot + 1, 0, slot, role, MODEL, "vllm", f"http://127.0.0.1:{9000 + slot}", f"127.0.0.1:{9000 + slot}", False
    )


def job(
    prompt_tokens: int = 100, max_tokens: int = 50, ttft_ms: float = 2000, tpot_ms: float = 100, hashes=()
) -> JobInfo:
    return JobInfo(MODEL, prompt_tokens, max_tokens, ttft_ms, tpot_ms, block_hashes=list(hashes))


class World:
    """Shared state and one worker's view of it."""

    def __init__(self, policy: str = "load_balance", worker: int = 0, shared: SharedState | None = None):
        self.shared = shared or SharedState.create()
        self.ledger = Ledger(self.shared, worker, 2)
        self.health = Health(self.shared)
        self.predictor = Predictor(self.shared, Settings().slo_confidence)
        self.index = PrefixIndex(self.shared, BLOCK)
        self.policy = make_policy(
            policy,
            self.shared,
            self.ledger,
            self.health,
            predictor=self.predictor,
            index=self.index,
            block_tokens=BLOCK,
        )


async def admit(sched: Scheduler, job: JobInfo):
    """A request's first plan as the dispatcher takes it: at once, or after a wait in the admission queue."""
    return sched.try_admit(job) or await sched.queued(job)


def queue_work(w: World, slot: int, tokens: int):
    """A prefill of ours in flight on `slot`: a ledger lease and its place in the virtual queue."""
    lease = w.ledger.lease(slot, tokens, 1)
    lease.predicted, lease.shift = w.predictor.start_prefill(slot, tokens, lease.started)
    return lease


# -- tokens --------------------------------------------------------------------------------------


CHAT_BODY = {
    "model": MODEL,
    "messages": [
        {"role": "system", "content": "You are terse. " * 40},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Describe "}, {"type": "image_url", "image_url": {"url": "x"}}],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "content": "42", "tool_call_id": "1"},
    ],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
}


def test_estimate_renders_the_prompt_as_the_engine_counts_it():
    meter = PromptMeter(BLOCK)
    tokens, hashes, _ = meter.count(CHAT, CHAT_BODY)
    assert tokens == sim_tokens.chat_prompt_tokens(CHAT_BODY["messages"], tools=CHAT_BODY["tools"])
    blocks = len(sim_tokens.render_chat_prompt(CHAT_BODY["messages"], tools=CHAT_BODY["tools"]).encode()) // (BLOCK * 4)
    assert blocks_covered(len(hashes)) <= blocks < blocks_covered(len(hashes) + 1)  # as far into it as they reach
    anthropic = {
        "system": "Be brief.",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}],
    }
    tokens, _, _ = meter.count(MESSAGES, anthropic)
    assert tokens == sim_tokens.chat_prompt_tokens(anthropic["messages"], system="Be brief.")
    assert meter.count(COMPLETION, {"prompt": [1, 2, 3, 4, 5]}, hashes=False)[:2] == (5, [])
    assert meter.count(COMPLETION, {"prompt": "abcdefgh"})[:2] == (2, [])


def test_a_token_id_prompt_is_keyed_by_its_ids_bytes_unless_an_id_is_no_token():
    """count_ids gives a token-id prompt's `ids_bytes` (what its KV keys are made of), hashed as its blocks; a
    negative id is no token: no bytes (the prompt is planned on its hashes, over the ids modulo 2^32)."""
    meter = PromptMeter(BLOCK)
    ids = list(range(1, 4 * BLOCK + 1))
    tokens, hashes, learn, data = meter.count_ids(COMPLETION, {"prompt": ids})
    assert (tokens, learn, data) == (len(ids), 0, ids_bytes(ids))
    assert hashes == meter.count(COMPLETION, {"prompt": ids})[1] == chained_hashes(data, BLOCK * 4)
    assert len(hashes) == 4
    assert meter.count_ids(COMPLETION, {"prompt": ids}, hashes=False) == (len(ids), [], 0, data)
    assert meter.count_ids(CHAT, CHAT_BODY)[3] is None  # text: a TokenizerMeter's submit encodes it
    bad = [*ids[:-1], -5]
    with pytest.raises(OverflowError):
        ids_bytes(bad)
    tokens, hashes, _, data = meter.count_ids(COMPLETION, {"prompt": bad})
    assert (tokens, data) == (len(bad), None)
    assert hashes == chained_hashes(array("I", [i & 0xFFFFFFFF for i in bad]).tobytes(), BLOCK * 4)
    good = meter.count(COMPLETION, {"prompt": ids})[1]
    assert hashes[:3] == good[:3] and hashes[3] != good[3]  # the blocks before the negative id hash alike


def test_block_hashes_are_chained_over_the_whole_prompt():
    system = {"role": "system", "content": "shared system prompt " * 30}
    a = PromptMeter(BLOCK).count(CHAT, {"messages": [system, {"role": "user", "content": "first question " * 20}]})[1]
    b = PromptMeter(BLOCK).count(CHAT, {"messages": [system, {"role": "user", "content": "second question " * 20}]})[1]
    other = PromptMeter(BLOCK).count(
        CHAT,
        {
            "messages": [
                {"role": "system", "content": "another " * 75},
                {"role": "user", "content": "first question " * 20},
            ]
        },
    )[1]
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert shared >= len("shared system prompt " * 30) // (BLOCK * 4)
    assert a[shared:] != b[shared:] and a[0] != other[0]
    # Tools are part of the prefix: the same conversation with tools shares nothing at the start.
    with_tools = PromptMeter(BLOCK).count(
        CHAT, {"messages": [system], "tools": [{"type": "function", "function": {"name": "g"}}]}
    )[1]
    assert with_tools[0] != a[0]
    assert chained_hashes(b"x" * 130, 64) == chained_hashes(b"x" * 128, 64)
    assert len(set(chained_hashes(b"x" * 640, 64))) == 10  # same blocks, different prefixes: all distinct


def test_engine_uncached_reads_openai_usage():
    assert engine_uncached({"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 64}}) == 36
    assert engine_uncached({"prompt_tokens": 100}) == 100
    assert engine_uncached(None) == -1 and engine_uncached({"output_tokens": 3}) == -1


def test_engine_uncached_reads_vllms_anthropic_usage():
    """A Messages prefill's usage: what the cache held is left out of input_tokens; what was written to it
    was computed."""
    assert engine_uncached({"input_tokens": 36, "cache_read_input_tokens": 64}) == 36
    assert engine_uncached({"input_tokens": 20, "cache_read_input_tokens": 64, "cache_creation_input_tokens": 16}) == 36
    assert engine_uncached({"input_tokens": 100, "output_tokens": 1}) == 100


def test_engine_cached_reads_each_usages_cached_tokens():
    assert engine_cached({"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 64}}) == 64
    assert engine_cached({"input_tokens": 100, "input_tokens_details": {"cached_tokens": 32}}) == 32  # Responses
    assert engine_cached({"input_tokens": 20, "cache_read_input_tokens": 64, "cache_creation_input_tokens": 16}) == 64
    assert engine_cached({"prompt_tokens": 100, "prompt_tokens_details": None}) == -1
    assert engine_cached({"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": None}}) == -1
    assert engine_cached({"input_tokens": 36}) == -1 and engine_cached(None) == -1


def test_engine_prompt_reads_the_whole_prompt_from_each_usage():
    """What calibration is told: the prompt's tokens, cached ones included."""
    assert engine_prompt({"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 64}}) == 100
    assert engine_prompt({"input_tokens": 100, "input_tokens_details": {"cached_tokens": 64}}) == 100  # Responses
    assert engine_prompt({"input_tokens": 20, "cache_read_input_tokens": 64, "cache_creation_input_tokens": 16}) == 100
    assert engine_prompt({"input_tokens": 36, "output_tokens": 1}) == 36
    assert engine_prompt(None) == -1 and engine_prompt({"output_tokens": 3}) == -1


def test_exact_ids_off_the_loop_for_any_prompt_size(tmp_path):
    """The exact ids come from the pool (TokenizerMeter.submit), whatever the prompt's size: a 64 KiB chat is
    encoded as the tokenizer encodes the template's rendering; `count` gives the estimate at once."""
    pytest.importorskip("tokenizers")
    tok = tiny_tokenizer(str(tmp_path))

    meter = make_meter(str(tmp_path), BLOCK)
    assert meter.exact and meter.cut is not None
    for words in (30, 4000):  # 480 bytes and 64 KiB
        body = {
            "messages": [
                {"role": "system", "content": "the lazy dog"},
                {"role": "user", "content": "quick brown fox " * words},
            ]
        }
        rendered = (
            "<s><|im_start|>system\nthe lazy dog<|im_end|>\n<|im_start|>user\n"
            + "quick brown fox " * words
            + "<|im_end|>\n<|im_start|>assistant\n"
        )
        expected = tok.encode(rendered, add_special_tokens=False).ids
        data = meter.submit(CHAT, body).result(timeout=30)
        assert list(array("I", data)) == expected
        estimate, hashes, _ = meter.count(CHAT, body)
        assert estimate == PromptMeter(BLOCK).count(CHAT, body)[0] != len(expected)
        assert hashes == PromptMeter(BLOCK).count(CHAT, body)[1]  # over the ChatML text, as the estimate's
    data = meter.submit(COMPLETION, {"prompt": "the quick brown fox"}).result(timeout=30)
    assert list(array("I", data)) == tok.encode("the quick brown fox").ids
    assert meter.submit(COMPLETION, {"prompt": [1, 2, 3]}) is None  # token ids: count_ids has them
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}
    assert meter.submit(CHAT, {"messages": [image]}) is None  # the engine expands it: not known exactly


def test_a_conversation_is_not_encoded_from_scratch_each_turn(tmp_path):
    """Turn N+1 of a conversation encodes only the pieces (between special tokens) turn N did not have, and its
    ids are those of the whole rendering encoded at once."""
    pytest.importorskip("tokenizers")
    tok = tiny_tokenizer(str(tmp_path))
    meter = make_meter(str(tmp_path), BLOCK)
    messages = [{"role": "system", "content": "the lazy dog " * 50}]
    for turn in range(20):
        messages += [{"role": "user", "content": f"turn {turn} quick brown fox " * 40}]
        before = meter.cache.misses
        data = meter.submit(CHAT, {"messages": messages}).result(timeout=30)
        whole = tok.encode(meter.render(messages, None, None), add_special_tokens=False).ids
        assert list(array("I", data)) == whole
        if turn:  # the new user message and the assistant answer before it; the opened turn is cached
            assert meter.cache.misses - before <= 2, turn
        messages.append({"role": "assistant", "content": f"answer {turn} over the dog"})


def test_pieces_are_encoded_whole_where_they_do_not_encode_alone(tmp_path):
    """A special token that strips the space beside it joins what is around it: the meter encodes prompts whole."""
    pytest.importorskip("tokenizers")
    tiny_tokenizer(str(tmp_path))
    path = tmp_path / "tokenizer.json"
    spec = json.loads(path.read_text())
    for added in spec["added_tokens"]:
        added["lstrip"] = True
    path.write_text(json.dumps(spec))
    meter = make_meter(str(tmp_path), BLOCK)
    assert meter.exact and meter.cut is None
    body = {"messages": [{"role": "user", "content": "quick brown fox  "}]}
    data = meter.submit(CHAT, body).result(timeout=30)
    assert (
        list(array("I", data))
        == meter.tokenizer.encode(meter.render(body["messages"], None, None), add_special_tokens=False).ids
    )


def test_missing_tokenizer_falls_back_to_the_estimate(tmp_path):
    meter = make_meter(str(tmp_path / "nowhere"), BLOCK)
    assert not meter.exact
    assert meter.count(COMPLETION, {"prompt": "abcd" * 10})[0] == 10


def _prepared(sched: Scheduler, info: JobInfo, kind: str, body: dict) -> None:
    """prepare's estimate, without waiting for an exact count."""
    pending = sched.prepare(info, kind, body)
    if pending is not None:
        pending.close()


def _engine_count(body: dict, bytes_per_token: int) -> int:
    """An engine's count of a chat body: engine_sim's rendering at its `bytes_per_token`."""
    return sim_tokens.count_text_tokens(render_chatml(body["messages"]), bytes_per_token)


def _chat(content) -> dict:
    return {"messages": [{"role": "user", "content": content}]}


# Prompts of 300 bytes to 8 KiB, each different: what the engines' counts arrive for.
TEACHING = [_chat(f"turn {i}: " + "def f(x):\n    return x + 1\n" * (10 + 37 * i % 300)) for i in range(40)]


def test_the_estimate_calibrated_from_engine_counts_converges():
    """A tokenizer of 3 bytes a token, where the uncalibrated estimate says 4: 25 % low at first, within 5 %
    after 16 engine counts (each moves the ratio a tenth of the way: 0.9 ** 16 * 25 % = 4.6 %)."""
    meter = PromptMeter(BLOCK)
    long = _chat("x = compute(a, b)  # a line of code\n" * 30000)  # 1 MiB
    truth = _engine_count(long, 3)

    def error() -> float:
        return abs(meter.count(CHAT, long)[0] - truth) / truth

    assert error() == pytest.approx(0.25, abs=0.01)
    errors = []
    for body in TEACHING[:16]:
        tokens, _, learn = meter.count(CHAT, body, hashes=False)
        assert learn == len(render_chatml(body["messages"]).encode())
        meter.calibrate(learn, _engine_count(body, 3))
        errors.append(error())
    assert errors == sorted(errors, reverse=True) and errors[-2] > 0.05 >= errors[-1]
    for body in TEACHING[16:]:
        meter.calibrate(meter.count(CHAT, body, hashes=False)[2], _engine_count(body, 3))
    assert error() < 0.005
    # An engine that counts as the estimate does (ceil of bytes / 4) leaves an uncalibrated meter where it is.
    same = PromptMeter(BLOCK)
    for body in TEACHING:
        same.calibrate(same.count(CHAT, body, hashes=False)[2], _engine_count(body, 4))
    assert same.tokens_per_byte == 0.25


def test_calibration_is_clamped_and_learns_only_from_text_prompts():
    wild = PromptMeter(BLOCK)
    for _ in range(200):  # an engine claiming a million tokens for a kilobyte: at most one a byte
        wild.calibrate(1000, 10**6)
    assert wild.tokens_per_byte == pytest.approx(MAX_TOKENS_PER_BYTE)
    for _ in range(200):  # ... or one token: at least one per 16 bytes
        wild.calibrate(1000, 1)
    assert wild.tokens_per_byte == pytest.approx(MIN_TOKENS_PER_BYTE)
    meter = PromptMeter(BLOCK)
    text = "some words of text " * 50
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    unlearnable = [
        (COMPLETION, {"prompt": list(range(256, 1256))}),  # token ids
        (CHAT, _chat([{"type": "text", "text": text}, image])),
        (CHAT, _chat([{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, text])),
        (MESSAGES, _chat([{"type": "tool_result", "content": [{"type": "image", "source": {}}]}, text])),
        (CHAT, {**_chat(text), "chat_template": "{{ messages }}"}),  # the engine renders it the request's way
        (COMPLETION, {"prompt": text, "truncate_prompt_tokens": 10}),  # the engine cuts it
        (CHAT, _chat("short")),  # under LEARN_MIN_BYTES
    ]
    for kind, body in unlearnable:
        assert meter.count(kind, body, hashes=False)[2] == 0, body
    learnable = [
        (COMPLETION, {"prompt": text}),
        (MESSAGES, {"system": [{"type": "text", "text": "rules"}], **_chat([{"type": "text", "text": text}])}),
        (MESSAGES, _chat([{"type": "tool_result", "content": [{"type": "text", "text": text}]}])),
    ]
    for kind, body in learnable:
        assert meter.count(kind, body, hashes=False)[2] > LEARN_MIN_BYTES, body
    meter.calibrate(0, 5000)  # what an unlearnable prompt's count hands over: nothing learned
    assert meter.tokens_per_byte == 0.25


def test_the_scheduler_calibrates_the_models_meter_from_what_prepare_measured(tmp_path):
    """Scheduler.prepare keeps the learnable bytes on the JobInfo; the leg's calibrate hands them over with the
    engine's count. With a tokenizer (the engine's own) its exact counts and the engine's teach the long
    prompts' estimate together."""
    pytest.importorskip("tokenizers")
    tok = tiny_tokenizer(str(tmp_path))
    w = World("round_robin")
    registry = Registry(w.shared)
    registry.apply(
        "set",
        [
            Instance(1, "union", MODEL, (Endpoint(0, "127.0.0.1:9001"),)),
            Instance(2, "union", "exact", (Endpoint(0, "127.0.0.1:9002"),)),
        ],
    )
    sched = Scheduler(
        registry,
        w.ledger,
        w.health,
        w.policy,
        live=Live(Settings(models=(ModelConfig("exact", tokenizer_path=str(tmp_path)),))),
    )
    engines = {
        MODEL: lambda body: _engine_count(body, 3),
        "exact": lambda body: len(tok.encode("<s>" + render_chatml(body["messages"]), add_special_tokens=False).ids),
    }
    long = _chat("x = compute(a, b)  # a line of code\n" * 3000)
    for model, engine in engines.items():
        first = JobInfo(model, 0, 16, 0, 0)
        _prepared(sched, first, CHAT, long)
        assert first.prompt_bytes == len(render_chatml(long["messages"]).encode())
        for body in TEACHING[:30]:
            info = JobInfo(model, 0, 16, 0, 0)
            _prepared(sched, info, CHAT, body)
            sched.pick(info, ("union",)).calibrate(engine(body))
        after = JobInfo(model, 0, 16, 0, 0)
        _prepared(sched, after, CHAT, long)
        truth = engine(long)
        assert abs(after.prompt_tokens - truth) <= 0.05 * truth < abs(first.prompt_tokens - truth), model
    assert sched.meter("exact").exact and not sched.meter(MODEL).exact
    ids = JobInfo(MODEL, 0, 16, 0, 0)
    sched.prepare(ids, COMPLETION, {"prompt": list(range(256, 1256))})
    assert ids.prompt_tokens == 1000 and ids.prompt_bytes == 0
    before = sched.meter(MODEL).tokens_per_byte
    sched.pick(ids, ("union",)).calibrate(10)
    sched.calibrate("never-seen", 1000, 10)  # a model without a meter yet: nothing to teach
    assert sched.meter(MODEL).tokens_per_byte == before


# -- prefix index --------------------------------------------------------------------------------


def test_prefix_index_finds_each_slots_longest_cached_prefix():
    index = PrefixIndex(SharedState.create())
    meter = PromptMeter(BLOCK)
    system = {"role": "system", "content": "policy text " * 100}
    first = meter.count(CHAT, {"messages": [system, {"role": "user", "content": "a" * 800}]})[1]
    second = meter.count(CHAT, {"messages": [system, {"role": "user", "content": "b" * 800}]})[1]
    shared = blocks_covered(next(i for i, (x, y) in enumerate(zip(first, second)) if x != y))
    assert index.cached_blocks(second, 3) == 0
    index.record(first, 3)
    assert index.cached_blocks(first, 3) == blocks_covered(len(first))
    assert index.cached_blocks(second, 3) == shared
    assert index.cached_blocks(second, 4) == 0
    assert index.last_owner(second, shared) == 3
    index.record(second, 4)
    assert index.last_owner(first, shared) == 4  # slot 4 prefilled the shared prefix more recently
    assert index.cached_blocks(first, 3) == blocks_covered(len(first))


def test_the_estimate_keys_a_prompt_by_its_cache_salt():
    """The cache_salt its engines see (a tenant's) scopes a prompt's prefix hashes as it scopes the engines' blocks:
    the estimate predicts nothing of a prompt computed under one salt for the same prompt under another, or none."""
    w = World("kv_cache_affinity")
    sched = Scheduler(Registry(w.shared), w.ledger, w.health, w.policy)
    body = {"messages": [{"role": "user", "content": "hello " * 400}]}

    def prepared(salt: str | None) -> JobInfo:
        info = job()
        assert sched.prepare(info, CHAT, body, salt) is None
        return info

    t = target(3, "union")
    w.index.record(prepared("team-a").block_hashes, t.slot)
    assert w.index.cached_tokens(prepared("team-a"), t) > 0
    assert w.index.cached_tokens(prepared("team-b"), t) == 0
    assert w.index.cached_tokens(prepared(None), t) == 0


def test_prefix_index_keeps_a_prefix_while_other_prompts_pass():
    """A prompt's hashes carry its length in blocks in their low bits (the same at one boundary for every prompt):
    the table must not be addressed by it, or each new prompt overwrites the last ones' prefixes (it did: the
    hot system prompts of wall-clock seed 943840882 were forgotten a few prompts after being computed)."""
    index = PrefixIndex(SharedState.create())
    system = random.Random(1).randbytes(64 * 200)
    hot = chained_hashes(system + random.Random(2).randbytes(64 * 10), 64)
    index.record(hot, 3)
    for k in range(200):  # other prompts, each its own text, on other slots
        index.record(chained_hashes(random.Random(100 + k).randbytes(64 * 220), 64), 4 + k % 4)
    again = chained_hashes(system + random.Random(3).randbytes(64 * 10), 64)
    assert index.cached_blocks(again, 3) == 192  # the last boundary within the 200 shared blocks


def test_prefix_index_survives_more_keys_than_entries():
    index = PrefixIndex(SharedState.create())
    keys = [(k * 0x9E3779B97F4A7C15) & (2**64 - 1) for k in range(1, 300_000)]
    per_prompt = len(chained_hashes(b"x" * 64 * (1 << 14), 64))  # a 1 MiB prompt's hashes
    for start in range(0, len(keys), per_prompt):
        index.record(keys[start : start + per_prompt], 1)
    recent = keys[-per_prompt:]
    assert index.cached_blocks(recent, 2) == 0
    assert 0 <= index.cached_blocks(recent, 1) <= blocks_covered(per_prompt)


# -- learned model -------------------------------------------------------------------------------


def test_predictor_learns_prefill_speed_and_queues_work():
    pred = Predictor(SharedState.create(), 0.9)
    assert not pred.prefill_known(0) and pred.prefill_s(0, 1000) == UNKNOWN
    teach_prefill(pred, 0, tokens_per_s=2000.0, base_s=0.05)
    teach_prefill(pred, 1, tokens_per_s=1000.0, base_s=0.05)
    assert pred.prefill_known(0)
    assert pred.prefill_s(0, 2000) == pytest.approx(1.05, rel=0.05)
    assert pred.prefill_s(1, 2000) == pytest.approx(2.05, rel=0.05)

    now = time.monotonic()
    assert pred.queue_wait_s(0, now) == 0.0
    ends = [pred.start_prefill(0, 2000, now) for _ in range(3)]
    assert ends[0][0] - now == pytest.approx(1.05, abs=0.1)
    # Behind queued work a prompt ends with the engine step that takes the prompts sent while it waits too:
    # later than the continuous queue's end, by at most one mean step.
    step = pred.prefill_s(0, int(pred.mean_prefill_tokens(0)))
    for (end, _), queued in zip(ends[1:], (2.1, 3.15), strict=True):
        assert queued + 0.1 < end - now <= queued + step + 0.1
    assert pred.queue_wait_s(0, now) == pytest.approx(3.15, abs=0.1)
    # The first finishes 0.5 s late: the two behind it are late by as much, and when the second finishes
    # at its (corrected) end in the continuous queue, nothing more moves.
    (p1, s1), (p2, s2), _ = ends
    pred.learn_prefill(0, now, p1 + 0.5, 2000, p1, s1)
    assert pred.queue_wait_s(0, now) == pytest.approx(3.65, abs=0.1)
    second_end = now + pred.queue_wait_s(0, now) - pred.prefill_s(0, 2000)
    pred.learn_prefill(0, now, second_end, 2000, p2, s2)
    assert pred.queue_wait_s(0, now) == pytest.approx(3.65, abs=0.1)


def test_predictor_learns_decode_step_growth_with_batch():
    pred = Predictor(SharedState.create(), 0.9)
    assert not pred.decode_known(2)
    teach_decode(pred, 2, step_s=0.02, per_seq_s=0.005)
    assert pred.step_s(2, 1) == pytest.approx(0.025, rel=0.05)
    assert pred.step_s(2, 10) == pytest.approx(0.07, rel=0.05)
    assert pred.first_wait_s(2) == pytest.approx(0.02, abs=0.01)


def test_decode_slope_is_never_free_without_spread():
    pred = Predictor(SharedState.create(), 0.9)
    teach_decode(pred, 0, step_s=0.02, per_seq_s=0.005, batches=[2] * 6)
    assert pred.step_s(0, 2) == pytest.approx(0.03, rel=0.05)
    assert pred.step_s(0, 8) > pred.step_s(0, 2) * 1.3  # the prior keeps a bigger batch dearer


def test_allowances_are_the_confidence_quantile_of_recent_errors():
    pred = Predictor(SharedState.create(), 0.9)
    teach_prefill(pred, 0, 1000.0)
    teach_prefill(pred, 1, 1000.0)
    t = time.monotonic()  # the taught prefills were long ago: the queues are empty
    assert pred.allowance_s(0, 1.0, t) == pytest.approx(0.0, abs=0.01)  # an exact engine needs no room

    def prefill(late: float) -> None:  # predicted to take 1.01 s (1000 tokens, an idle engine)
        nonlocal t
        predicted, shift = pred.start_prefill(1, 1000, t)
        pred.learn_prefill(1, t, predicted + late, 1000, predicted, shift)
        t = predicted + late + 0.001

    prefill(2.0)  # a stall among few errors: a short record is covered whole
    assert pred.allowance_s(1, 1.01, t) == pytest.approx(2.0, rel=0.05)
    # Errors are shares of the predicted time: a prefill predicted ten times sooner gets a tenth of the room.
    assert pred.allowance_s(1, 0.101, t) == pytest.approx(0.2, rel=0.05)
    for _ in range(ERROR_RING):  # predictions that hold: the stall leaves the ring
        prefill(0.0)
    assert pred.allowance_s(1, 1.01, t) == pytest.approx(0.0, abs=0.001)
    for k in range(3 * ERROR_RING):  # one prefill in five 0.5 s late: more than the 10 % the quantile may miss
        prefill(0.5 if k % 5 == 0 else 0.0)
    assert 0.25 < pred.allowance_s(1, 1.01, t) < 0.55  # (the fit takes some of the misses into the prediction)
    for k in range(3 * ERROR_RING):  # one in twenty 0.5 s late: within the 10 % it may miss
        prefill(0.5 if k % 20 == 0 else 0.0)
    assert pred.allowance_s(1, 1.01, t) == pytest.approx(0.0, abs=0.001)
    strict = Predictor(pred_shared := SharedState.create(), 0.99)  # at 99 % confidence the same misses count
    teach_prefill(strict, 1, 1000.0)
    pred = strict
    for k in range(3 * ERROR_RING):
        prefill(0.5 if k % 20 == 0 else 0.0)
    assert 0.25 < pred.allowance_s(1, 1.01, t) < 0.55
    assert pred_shared.endpoints[1].late_count >= 3 * ERROR_RING  # the ring and its count are shared state
    for _ in range(40):  # decode streams a quarter slower than planned
        pred.learn_decode(2, t, t + 0.1, t + 0.1 + 0.025 * 40, 43, 2.0, predicted=0.020)
        t += 0.01
    assert pred.tpot_allowance_s(2, 0.020, t) == pytest.approx(0.005, rel=0.1)
    assert pred.tpot_allowance_s(2, 0.040, t) == pytest.approx(0.010, rel=0.1)


def test_the_tpot_allowance_leaves_out_the_growth_later_verdicts_predicted():
    """A stream whose batch grew after it was planned is judged against the step of the batch the verdicts of the
    requests that joined after it predicted (each judged against the budgets in the batch), as far as it grew:
    growth past their predictions is their error and stays in, and so does a stream slower than its batch's step,
    and all of the growth on an engine computing prompts (their prefill time in its steps is no batch's)."""
    t = time.monotonic()

    def streams(pred: Predictor, per_token: float, judged: float) -> None:
        nonlocal t
        for _ in range(40):  # planned for a batch of 2 (30 ms a token), decoded in a mean batch of 6
            pred.learn_decode(2, t, t + 0.1, t + 0.1 + per_token * 40, 43, 6.0, 0.030, planned=2.0, judged=judged)
            t += 0.01

    predicted, unknown, short, slow, computing = (Predictor(SharedState.create(), 0.95) for _ in range(5))
    for pred in (predicted, unknown, short, slow, computing):
        teach_decode(pred, 2, 0.02, 0.005)
    teach_prefill(computing, 2, 1000.0)
    computing.start_prefill(2, 1000, t)  # a second of prompt computed on the decode engine: half its time lately
    streams(predicted, 0.050, 6.0)  # the later verdicts predicted the batch of 6: no error
    streams(unknown, 0.050, 0.0)  # no verdict since: all of the growth is error (50 / 30 ms)
    streams(short, 0.050, 4.0)  # they predicted 4 (40 ms): the rest is error (50 / 40 ms)
    streams(slow, 0.0625, 6.0)  # a quarter slower than the step of its batch
    streams(computing, 0.050, 6.0)
    assert predicted.tpot_allowance_s(2, 0.030, t) == pytest.approx(0.0, abs=0.0005)
    assert unknown.tpot_allowance_s(2, 0.030, t) == pytest.approx(0.020, rel=0.1)
    assert short.tpot_allowance_s(2, 0.030, t) == pytest.approx(0.0075, rel=0.15)
    assert slow.tpot_allowance_s(2, 0.030, t) > 0.004
    assert computing.tpot_allowance_s(2, 0.030, t) == pytest.approx(0.020, rel=0.1)


def test_allowances_narrow_with_time_without_evidence():
    """A bad moment cannot shut admission for good: after ALLOWANCE_QUIET_S without new evidence an allowance
    halves every ALLOWANCE_HALF_LIFE_S, so the requests admitted again bring the evidence."""
    pred = Predictor(SharedState.create(), 0.9)
    teach_prefill(pred, 1, 1000.0)
    t = time.monotonic()
    predicted, shift = pred.start_prefill(1, 1000, t)
    pred.learn_prefill(1, t, predicted + 10.0, 1000, predicted, shift)  # 10 s late
    done = predicted + 10.0
    now_allowance = pred.allowance_s(1, 1.0, done)
    assert now_allowance > 4.0
    assert pred.allowance_s(1, 1.0, done + ALLOWANCE_QUIET_S) == now_allowance  # samples come and go: no decay
    quiet = done + ALLOWANCE_QUIET_S
    assert pred.allowance_s(1, 1.0, quiet + ALLOWANCE_HALF_LIFE_S) == pytest.approx(now_allowance / 2)
    assert pred.allowance_s(1, 1.0, quiet + 10 * ALLOWANCE_HALF_LIFE_S) < 0.01


def test_engine_itl_stands_in_for_an_unknown_decode_model_at_the_batch_asked_about():
    """Measured while the engine ran 16 sequences, its latency says little of a batch of 1: it is moved along the
    line's prior (a fixed part worth 4 sequences), so an engine that idles after a burst is not judged at the
    burst's batch."""
    world = World()
    world.health.put(5, "engine_itl_s", 0.04)
    world.health.put(5, "engine_itl_batch", 16.0)
    pred = world.predictor
    assert pred.decode_known(5) and not pred.decode_fitted(5)
    assert pred.step_s(5, 16) == pytest.approx(0.04)
    assert pred.step_s(5, 1) == pytest.approx(0.04 * 5 / 20)
    assert pred.step_s(5, 36) == pytest.approx(0.08)


# -- ledger --------------------------------------------------------------------------------------


def test_leases_and_holds_give_everything_back_once():
    shared = SharedState.create()
    a, b = Ledger(shared, 0, 2), Ledger(shared, 1, 2)
    seen = []
    a.observer = seen.append
    l1 = a.lease(3, 500, 1)
    l2 = b.lease(3, 300, 64, prefilling=False)
    hold = a.hold(3)
    assert a.load(3) == (2, 500, 65, 1) and b.held(3) == 1 and a.requests(3) == 2
    l1.prefill_done()
    assert a.load(3) == (2, 0, 65, 0)
    l1.succeed()
    for _ in range(2):
        l1.release()
        l2.release()
        hold.release()
    assert not load_left(shared)  # no worker holds anything on any slot
    assert seen == [l1]  # only a successful lease is learned from, once


def test_lease_timings():
    ledger = Ledger(SharedState.create(), 0, 1)
    lease = ledger.lease(0, 0, 10, prefilling=False)
    lease.first_token()
    first = lease.first_at
    lease.first_token()
    lease.release()
    assert lease.started <= first == lease.first_at <= lease.ended


# -- policies ------------------------------------------------------------------------------------


def test_round_robin_is_shared_across_workers_and_rotates_pairs():
    w0 = World("round_robin", 0)
    w1 = World("round_robin", 1, w0.shared)
    ps, ds = [target(0, "prefill"), target(1, "prefill")], [target(2, "decode"), target(3, "decode")]
    picks = [(w0 if k % 2 else w1).policy.choose_pair(ps, ds, job()) for k in range(8)]
    assert [p.slot for p, _ in picks] == [0, 1] * 4
    assert [d.slot for _, d in picks] == [2, 3] * 4
    assert [w0.policy.choose(ps, job()).slot for _ in range(4)] == [0, 1, 0, 1]


def test_load_balance_prefers_the_least_loaded_and_spreads_ties():
    w = World("load_balance")
    cands = [target(0, "union"), target(1, "union"), target(2, "union")]
    lease = w.ledger.lease(0, 4000, 256)
    w.health.set_engine_load(1, running=3, waiting=2, kv_usage=0.5)
    assert w.policy.choose(cands, job()).slot == 2
    lease.release()
    w.health.set_engine_load(1, 0, 0, 0)
    assert {w.policy.choose(cands, job()).slot for _ in range(6)} == {0, 1, 2}


def test_kv_cache_affinity_follows_the_prefix_until_overloaded():
    w = World("kv_cache_affinity")
    w.policy.overload_factor = 2.0
    ps, ds = [target(0, "prefill"), target(1, "prefill")], [target(2, "decode"), target(3, "decode")]
    hashes = chained_hashes(b"p" * 64 * 40, 64)
    w.index.record(hashes[:30], 1)
    for _ in range(3):
        assert w.policy.choose_pair(ps, ds, job(700, hashes=hashes))[0].slot == 1
    busy = [w.ledger.lease(1, 2000, 1) for _ in range(3)]
    assert w.policy.choose(ps, job(700, hashes=hashes)).slot == 0  # 3+ requests vs 0: over the bound
    for lease in busy:
        lease.release()
    assert w.policy.choose(ps, job(700, hashes=chained_hashes(b"q" * 64 * 40, 64))).slot in (0, 1)


def test_kv_cache_affinity_keeps_a_conversation_on_an_engine_serving_one_request_like_it():
    """Against an idle engine, a holder serving the conversation's previous turn (with the KV it uses) is not
    overloaded: moving would recompute the history where one more request in the batch costs about nothing."""
    w = World("kv_cache_affinity")
    ps = [target(0, "union"), target(1, "union")]
    hashes = chained_hashes(b"p" * 64 * 40, 64)
    w.index.record(hashes[:30], 1)
    previous = w.ledger.lease(1, 700, 256)
    w.health.set_engine_load(1, running=1, waiting=0, kv_usage=0.2)
    assert [w.policy.choose(ps, job(700, hashes=hashes)).slot for _ in range(4)] == [1] * 4
    previous.release()


def slo_world() -> tuple[World, list[Target], list[Target]]:
    """P0 fast (2000 tokens/s), P1 half as fast; D2 fast (20 ms + 5 ms/seq), D3 twice as slow."""
    w = World("slo_aware")
    teach_prefill(w.predictor, 0, 2000.0)
    teach_prefill(w.predictor, 1, 1000.0)
    teach_decode(w.predictor, 2, 0.02, 0.005)
    teach_decode(w.predictor, 3, 0.04, 0.010)
    return w, [target(0, "prefill"), target(1, "prefill")], [target(2, "decode"), target(3, "decode")]


def test_slo_aware_sends_work_where_it_finishes_first():
    w, ps, ds = slo_world()
    info = job(4000, ttft_ms=5000, tpot_ms=100)
    p, d = w.policy.choose_pair(ps, ds, info)
    assert (p.slot, d.slot) == (0, 2) and info.feasible is True
    assert info.ttft_s == pytest.approx(2.0 + 0.01 + 0.02 + 0.025, rel=0.1)
    # Fill the fast prefill engine's queue (6 s of work): a short prompt now finishes first on the slow one.
    queued = [queue_work(w, 0, 4000) for _ in range(3)]
    p, _ = w.policy.choose_pair(ps, ds, job(500, ttft_ms=5000))
    assert p.slot == 1
    # A long prompt cannot make a 5 s budget anywhere now: the plan says so.
    info = job(6000, ttft_ms=5000)
    w.policy.choose_pair(ps, ds, info)
    assert info.feasible is False and info.retry_after_s >= 1.0 and info.floor_s < info.ttft_s
    for lease in queued:
        lease.release()
    w.policy.choose_pair(ps, ds, info)  # no prefill in flight: nothing waits, whatever the virtual queue says
    assert info.ttft_s == pytest.approx(info.floor_s, rel=0.01)


def test_slo_aware_counts_a_cached_prefix_as_cheaper_prefill():
    w, ps, ds = slo_world()
    hashes = chained_hashes(b"s" * 64 * 200, 64)  # 3200 tokens
    w.index.record(hashes[: hashes_covering(192)], 1)  # the slow engine holds 3072 of them
    info = job(3200, hashes=hashes)
    p, _ = w.policy.choose_pair(ps, ds, info)
    assert p.slot == 1 and w.policy.uncached(p, info) == 128


class ReportedPrefixes:
    """A second PrefixSource: what the engines said they hold (slot -> cached prompt tokens), as a source fed by
    their KV cache events would know it; it reads no block hashes."""

    needs_hashes = False
    needs_ids = False
    tells_conversations = False

    def __init__(self, held: dict[int, int], last: int = -1):
        self.held, self.last, self.recorded, self.sent = held, last, [], []
        self.fills: dict[int, tuple[int, int]] = {}  # slot -> (blocks held, cache size in blocks)

    def cached_tokens(self, job: JobInfo, target: Target) -> int:
        return self.held.get(target.slot, 0)

    def last_holder(self, job: JobInfo, tokens: int) -> int:
        return self.last

    def cache_fill(self, target: Target) -> tuple[int, int]:
        return self.fills.get(target.slot, (0, 0))

    def starts(self, job: JobInfo, target: Target, tokens: int) -> bool | None:
        return None  # whether a prompt opens a conversation: not told

    def chains(self, target: Target) -> int:
        return -1

    def previous_turn(self, job: JobInfo, tokens: int) -> int:
        return -1  # where a conversation's turn before went: not told

    def kept(self, job: JobInfo, target: Target, tokens: int) -> None:
        pass

    def record(self, hashes: list[int], slot: int) -> None:
        self.recorded.append((hashes, slot))

    def placed(self, lease, job: JobInfo) -> None:
        self.sent.append(lease.slot)


def test_a_second_prefix_source_takes_the_estimates_place():
    """The policies and the scheduler know cached prefixes only through the PrefixSource calls."""
    reported = ReportedPrefixes({1: 480, 2: 480}, last=2)
    w = World()
    affinity = make_policy("kv_cache_affinity", w.shared, w.ledger, w.health, index=reported, block_tokens=BLOCK)
    ps = [target(0, "prefill"), target(1, "prefill"), target(2, "prefill")]
    assert affinity.choose(ps, job(700)).slot == 2  # two hold the most: the last to come to hold it
    reported.last = 1
    assert affinity.choose(ps, job(700)).slot == 1
    reported.held = {0: 96}
    assert affinity.choose(ps, job(700)).slot == 0

    s, fast_slow, ds = slo_world()
    slo = make_policy("slo_aware", s.shared, s.ledger, s.health, predictor=s.predictor, index=reported)
    reported.held = {1: 3072}  # the slow engine holds most of the prompt: it finishes first
    info = job(3200)
    assert slo.choose_pair(fast_slow, ds, info)[0].slot == 1 and slo.uncached(fast_slow[1], info) == 128
    reported.held = {0: 5000}  # more than the prompt: one token is still computed
    assert slo.uncached(fast_slow[0], job(3200)) == 1

    body = {"messages": [{"role": "user", "content": "hello " * 400}]}
    e = World("kv_cache_affinity")
    info = job()
    Scheduler(Registry(e.shared), e.ledger, e.health, e.policy).prepare(info, CHAT, body)
    assert info.block_hashes  # the estimate reads the prompt's block hashes
    sched = Scheduler(Registry(w.shared), w.ledger, w.health, affinity)
    info = job()
    sched.prepare(info, CHAT, body)
    assert info.prompt_tokens > 100 and info.block_hashes == []  # none made for a source that reads none
    info.block_hashes = [7, 8]
    lease = sched.lease(target(1, "union"), info, WHOLE)
    assert reported.sent == [1]  # the prompt is on its way there: the source is told
    lease.first_token()  # the prompt is cached there now: the source is told
    assert reported.recorded == [([7, 8], 1)]
    lease.release()


class ToldConversations(ReportedPrefixes):
    """A PrefixSource that tells a new conversation from a running one, as the engines' events do: `starting` is
    what it says of every prompt, `conversations` how many each engine holds; it records each lease's slot with
    whether its plan started a conversation."""

    tells_conversations = True

    def __init__(self, held: dict[int, int], starting: bool, conversations: dict[int, int]):
        super().__init__(held)
        self.starting, self.conversations = starting, conversations

    def starts(self, job: JobInfo, target: Target, tokens: int) -> bool | None:
        return self.starting

    def chains(self, target: Target) -> int:
        return self.conversations.get(target.slot, 0)

    def placed(self, lease, job: JobInfo) -> None:
        self.sent.append((lease.slot, job.opens))


def test_slo_aware_marks_a_plan_that_starts_a_conversation_for_the_engine_it_goes_to():
    """Until a new conversation's blocks are stored, its engine counts it among its conversations only if the
    plan said it starts one (scheduling/kv_index.py `chains`), or a burst of new ones all see the same counts.
    `slo_aware` says so whether it chose among plans on time or one is late everywhere, and not for a plan of
    the same request that continues a conversation."""
    s, ps, ds = slo_world()
    told = ToldConversations({}, True, {0: 3, 1: 0})
    told.fills = {0: (30, 64), 1: (0, 64)}
    slo = make_policy("slo_aware", s.shared, s.ledger, s.health, predictor=s.predictor, index=told)
    info = job(200, ttft_ms=5000)
    p, _ = slo.choose_pair(ps, ds, info)
    assert p.slot == 1 and info.opens  # where fewer conversations' futures fill the cache, both on time
    late = job(200, ttft_ms=1)
    slo.choose_pair(ps, ds, late)
    assert late.feasible is False and late.opens
    told.held, told.starting = {0: 128}, False  # a running conversation, its history on the first engine
    slo.choose_pair(ps, ds, info)
    assert not info.opens
    told.starting = True
    sched = Scheduler(Registry(s.shared), s.ledger, s.health, slo)
    p, _ = slo.choose_pair(ps, ds, info)
    sched.lease(p, info, PREFILL).release()
    assert told.sent == [(p.slot, True)]


def test_kv_cache_affinity_marks_a_new_conversation_it_cannot_weigh_the_futures_of():
    """One engine's conversations are not known (its events not live): the new conversation is placed on load,
    and still counts among the conversations of the engine it goes to, as `slo_aware`'s do."""
    w = World()
    told = ToldConversations({}, True, {0: -1, 1: 3})
    affinity = make_policy("kv_cache_affinity", w.shared, w.ledger, w.health, index=told, block_tokens=BLOCK)
    info = job(200)
    affinity.choose([target(0, "union"), target(1, "union")], info)
    assert info.opens
    told.held, told.starting = {1: 128}, False  # the next turn of a conversation held on the second engine
    affinity.choose([target(0, "union"), target(1, "union")], info)
    assert not info.opens


def test_kv_cache_affinity_leaves_a_full_cache_for_one_with_room():
    """A holder whose prefix cache is full evicts some conversation's history for what it stores; an engine with
    room evicts nothing. Its size comes from its /metrics, or from what it held when it first evicted."""
    reported = ReportedPrefixes({0: 128})
    w = World()
    affinity = make_policy("kv_cache_affinity", w.shared, w.ledger, w.health, index=reported, block_tokens=BLOCK)
    ps = [target(0, "union"), target(1, "union")]
    previous = w.ledger.lease(0, 200, 24)
    assert affinity.choose(ps, job(200)).slot == 0  # no size known: the holder, serving one request
    reported.fills = {0: (64, 64), 1: (10, 0)}  # the holder evicted at 64 blocks; the other's size is taken alike
    assert affinity.choose(ps, job(200)).slot == 1
    reported.fills = {0: (64, 0), 1: (10, 0)}
    w.health.put(0, "cache_blocks", 64.0)
    assert affinity.choose(ps, job(200)).slot == 1
    w.health.put(0, "cache_blocks", 1024.0)  # a large cache with room: the holder again
    assert affinity.choose(ps, job(200)).slot == 0
    previous.release()


def test_slo_aware_keeps_each_decode_engine_within_the_tpot_budget():
    w, ps, ds = slo_world()
    leases = []
    picks = []
    for _ in range(12):  # each decode joins now (delay 0: decode leases, not holds)
        info = job(100, tpot_ms=60)
        d = w.policy._pick_decode(ds, info, 0.0, 0, time.monotonic())[0]
        picks.append(d.slot)
        leases.append(w.ledger.lease(d.slot, 0, 1000, prefilling=False))
    # D2 fits 7 sequences under 57 ms (20 + 5 * 7 = 55), D3 2 (40 + 10 * 2 = 60 > 57: only 1 within the margin)
    assert picks.count(2) >= 7 and 1 <= picks.count(3) <= 5
    info = job(100, tpot_ms=60)
    w.policy.choose_pair(ps, ds, info)
    assert info.feasible is False and info.tpot_s > 0.057
    for lease in leases:
        lease.release()


def test_slo_aware_holds_count_for_the_decode_batch():
    w, ps, ds = slo_world()
    first = w.policy.predict_decode(ds[0], 1.0)[0]
    holds = [w.ledger.hold(2) for _ in range(4)]
    assert w.policy.predict_decode(ds[0], 1.0)[0] == pytest.approx(first + 4 * 0.005, rel=0.05)
    for h in holds:
        h.release()
    # Requests decoding now mostly finish before a decode that starts much later.
    leases = [w.ledger.lease(2, 0, 100, prefilling=False) for _ in range(4)]
    assert w.policy.predict_decode(ds[0], 0.0)[0] > w.policy.predict_decode(ds[0], 30.0)[0]
    for lease in leases:
        lease.release()


def test_decode_batch_forecast_discounts_what_will_have_finished():
    w, ps, ds = slo_world()
    leases = [w.ledger.lease(2, 0, 100, prefilling=False) for _ in range(4)]  # decodes of ~100 steps now
    length = 100 * w.predictor.step_s(2, 4)
    assert w.policy.decode_batch(ds[0], 0.0) == 5.0
    assert w.policy.decode_batch(ds[0], length / 2) == pytest.approx(3.0, rel=0.05)  # half of them left
    assert w.policy.decode_batch(ds[0], 2 * length) == 1.0
    holds = [w.ledger.hold(2) for _ in range(4)]  # promised: they start within the delay, then run a while
    longer = 100 * w.predictor.step_s(2, 8)  # 8 sequences make every step, and so every decode, longer
    assert length < longer < 2 * length
    assert w.policy.decode_batch(ds[0], 2 * length) == pytest.approx(1.0 + 4 * longer / (2 * length), rel=0.01)
    for x in leases + holds:
        x.release()


def test_an_idle_engine_has_no_queue_whatever_the_virtual_queue_says():
    w, ps, ds = slo_world()
    w.predictor.start_prefill(0, 100_000, time.monotonic())  # 50 s of phantom work (a lost response, say)
    assert w.predictor.queue_wait_s(0, time.monotonic()) > 40
    finish, service, _, _ = w.policy.predict_prefill(ps[0], job(1000), time.monotonic())
    assert finish == service
    lease = w.ledger.lease(0, 1000, 1)
    predicted, _ = w.predictor.start_prefill(0, 1000, lease.started, idle=True)
    assert predicted - lease.started < 1.0
    lease.release()


def test_slo_aware_tries_unknown_engines_while_idle_then_balances():
    w = World("slo_aware")
    ps, ds = [target(0, "prefill"), target(1, "prefill")], [target(2, "decode"), target(3, "decode")]
    info = job()
    p, d = w.policy.choose_pair(ps, ds, info)
    assert info.feasible is None and p.slot == 0 and d.slot == 2
    busy = [w.ledger.lease(0, 100, 1), w.ledger.lease(2, 0, 10, prefilling=False)]
    p, d = w.policy.choose_pair(ps, ds, job())
    assert (p.slot, d.slot) == (1, 3)
    for lease in busy:
        lease.release()


def test_slo_aware_whole_requests():
    w = World("slo_aware")
    teach_prefill(w.predictor, 0, 2000.0)
    teach_decode(w.predictor, 0, 0.02, 0.005)
    teach_prefill(w.predictor, 1, 500.0)
    teach_decode(w.predictor, 1, 0.02, 0.005)
    info = job(3000, ttft_ms=3000)
    assert w.policy.choose_whole([target(0, "union"), target(1, "union")], info).slot == 0
    assert info.feasible is True


# -- scheduler and admission ---------------------------------------------------------------------


def scheduler(policy: str, admission: str, queue_size: int = 4) -> tuple[Scheduler, World]:
    w = World(policy)
    registry = Registry(w.shared)
    registry.apply(
        "set",
        [
            Instance(1, "prefill", MODEL, (Endpoint(0, "127.0.0.1:9001"),)),
            Instance(2, "decode", MODEL, (Endpoint(0, "127.0.0.1:9002"),)),
        ],
    )
    queue = AdmissionQueue(w.shared, queue_size, tick_s=0.002) if admission == "queue" else None
    return Scheduler(registry, w.ledger, w.health, w.policy, admission=admission, queue=queue), w


def slots(sched: Scheduler) -> tuple[int, int]:
    view = sched.registry.view()
    return view.pool(MODEL, "prefill")[0].slot, view.pool(MODEL, "decode")[0].slot


def test_a_leg_retries_where_it_was_chosen_and_leases_its_engine():
    w = World("round_robin")
    registry = Registry(w.shared)
    registry.apply(
        "set",
        [
            Instance(1, "prefill", MODEL, (Endpoint(0, "127.0.0.1:9001"),)),
            Instance(2, "decode", MODEL, (Endpoint(0, "127.0.0.1:9002"),)),
            Instance(3, "decode", MODEL, (Endpoint(0, "127.0.0.1:9003"),)),
        ],
    )
    sched = Scheduler(registry, w.ledger, w.health, w.policy)
    info = job()
    plan = sched.try_admit(info)
    decode, prefill = plan.leg(DECODE), plan.leg(PREFILL)
    assert prefill.target is plan.prefill and decode.target is plan.target
    first = decode.target
    assert decode.can_move({first.slot}) and decode.move({first.slot})
    assert decode.target.role == "decode" and decode.target is not first  # the other decode instance
    alone = prefill.target
    assert not prefill.can_move({alone.slot}) and prefill.move({alone.slot})  # no other P: the same one again
    assert prefill.target is alone
    pinned = sched.pin(first, info)
    assert pinned.can_move({first.slot}) and pinned.move({first.slot}) and pinned.target is first
    lease = decode.lease()
    assert lease.kind == DECODE and w.ledger.requests(decode.target.slot) == 1
    hold = decode.hold()
    assert w.ledger.held(decode.target.slot) == 1
    lease.release()
    hold.release()
    assert not load_left(w.shared)


def test_scheduler_leases_feed_the_model_and_the_index():
    sched, w = scheduler("slo_aware", "off")
    p, d = slots(sched)
    info = job(640, hashes=chained_hashes(b"z" * 64 * 40, 64))
    lease = sched.lease(sched.registry.view().pool(MODEL, "prefill")[0], info, PREFILL)
    assert lease.prompt_tokens == 640 and w.ledger.load(p)[1] == 640
    lease.succeed(engine_uncached={"prompt_tokens": 640}["prompt_tokens"])
    lease.release()
    assert w.index.cached_blocks(info.block_hashes, p) == 40
    assert w.shared.endpoints  # the model saw one sample
    dl = sched.lease(sched.registry.view().pool(MODEL, "decode")[0], info, DECODE)
    dl.first_token()
    dl.events = 20
    dl.succeed()
    dl.release()
    assert not load_left(w.shared)
    again = job(640, hashes=info.block_hashes)
    assert sched.policy.uncached(sched.registry.view().pool(MODEL, "prefill")[0], again) == 1


def test_a_worker_fits_at_most_one_request_per_slot_per_learn_interval_but_every_completion_moves_the_queue():
    def prefills(interval_s: float, n: int) -> list[tuple[float, float, bool]]:
        """(fit samples, queue shift, last completion is this one's) after each of n prefills on one slot."""
        sched, w = scheduler("slo_aware", "off")
        assert sched.learn_interval_s == LEARN_INTERVAL_S
        sched.learn_interval_s = interval_s
        p = sched.registry.view().pool(MODEL, "prefill")[0]
        e = w.shared.endpoints[p.slot]
        seen = []
        for _ in range(n):
            lease = sched.lease(p, job(640), PREFILL)
            lease.succeed(640)
            # Later than predicted (nothing is learned yet): the queue is corrected. And in an engine step of its
            # own: completions within GROUP_S of each other are one sample.
            time.sleep(2 * GROUP_S)
            lease.release()
            seen.append((e.pf_n, e.queue_shift_s, e.last_done == lease.ended))
        return seen

    sampled = prefills(60.0, 3)
    # Only the first is a sample within the interval (each fitted when the next completion begins a new step).
    assert [n for n, _, _ in sampled] == [0.0, 1.0, 1.0]
    assert sampled[0][1] < sampled[1][1] < sampled[2][1]  # every completion moved the queue
    assert all(last for _, _, last in sampled)  # and set the last completion time
    every = prefills(0.0, 3)
    assert every[0][0] < every[1][0] < every[2][0]


def test_a_json_answer_records_its_prefix_and_settles_the_queue_only_when_early():
    """No first-token time: the answer's arrival bounds the prefill's finish, so only an early one moves the queue."""
    w = World("kv_cache_affinity")
    sched = Scheduler(Registry(w.shared), w.ledger, w.health, w.policy)
    u = target(0, "union")
    teach_prefill(w.predictor, 0, 1000.0)  # 640 tokens: 0.65 s predicted
    e = w.shared.endpoints[0]
    fitted, last_done = e.pf_n, e.last_done

    info = job(640, hashes=chained_hashes(b"q" * 64 * 40, 64))
    early = sched.lease(u, info, WHOLE, learn=False)
    behind = queue_work(w, 0, 640)  # queued behind it: its predicted finish moves up too
    queue_end = e.queue_until
    early.succeed()
    early.release()  # answered well before its predicted prefill finish
    moved = queue_end - e.queue_until
    assert moved == pytest.approx(early.predicted - early.ended, abs=1e-6) and moved > 0.5
    assert w.index.cached_blocks(info.block_hashes, 0) == 40
    assert (e.pf_n, e.last_done) == (fitted, last_done)  # no sample, no completion time

    late = sched.lease(u, job(640), WHOLE, learn=False)
    late.predicted = late.started - 1.0  # as if predicted to finish a second ago: the answer says nothing
    queue_end = e.queue_until
    late.succeed()
    late.release()
    assert e.queue_until == queue_end
    behind.release()


def test_a_streams_prefix_is_indexed_at_its_first_token_not_at_its_release():
    """A client sends the next turn as soon as it has read the last event, which may be before the lease is
    released: the prompt was cached on the engine from the first token on, and the index must say so by then."""
    w = World("kv_cache_affinity")
    sched = Scheduler(Registry(w.shared), w.ledger, w.health, w.policy)
    info = job(640, hashes=chained_hashes(b"s" * 64 * 40, 64))
    lease = sched.lease(target(1, "union"), info, WHOLE)
    assert w.index.cached_blocks(info.block_hashes, 1) == 0
    lease.first_token()
    assert w.index.cached_blocks(info.block_hashes, 1) == 40
    assert w.policy.choose([target(0, "union"), target(1, "union")], job(640, hashes=info.block_hashes)).slot == 1
    lease.succeed()
    lease.release()
    assert not load_left(w.shared)


def test_decode_samples_are_chosen_at_the_start_and_only_learnable_leases_use_the_turn():
    sched, w = scheduler("slo_aware", "off")
    sched.learn_interval_s = 60.0
    d = sched.registry.view().pool(MODEL, "decode")[0]
    e = w.shared.endpoints[d.slot]

    def decode(learn: bool):
        lease = sched.lease(d, job(640), DECODE, learn=learn)
        lease.first_token()
        lease.events = 20
        time.sleep(0.002)
        lease.succeed()
        return lease

    json_answer = decode(learn=False)  # a JSON answer: no sample, and the turn is still free
    first, second = decode(learn=True), decode(learn=True)  # second starts within the interval: no sample
    assert (json_answer.sample, first.sample, second.sample) == (False, True, False)
    second.release()  # finishing first does not make it the sample
    assert e.dc_n == 0.0
    first.release()
    assert e.dc_n == 1.0
    json_answer.release()
    assert e.dc_n == 1.0


def test_reject_admission_refuses_a_plan_over_budget():
    sched, w = scheduler("slo_aware", "reject")
    p, d = slots(sched)
    teach_prefill(w.predictor, p, 1000.0)
    teach_decode(w.predictor, d, 0.02, 0.005)
    assert asyncio.run(admit(sched, job(500, ttft_ms=2000))).prefill.slot == p
    with pytest.raises(OverBudget) as e:
        asyncio.run(admit(sched, job(5000, ttft_ms=2000)))
    assert e.value.retry_after_s >= 1.0 and "TTFT" in str(e.value)
    off, w2 = scheduler("slo_aware", "off")
    assert asyncio.run(admit(off, job(5000, ttft_ms=2000))).prefill is not None


def test_a_slots_tpot_floor_is_the_tightest_budget_of_the_streams_left():
    w = World()
    mine, theirs = w.ledger, Ledger(w.shared, 1, 2)
    loose = mine.lease(2, 0, 10, prefilling=False, tpot_budget_s=0.060)
    tight = [mine.lease(2, 0, 10, prefilling=False, tpot_budget_s=0.040) for _ in range(2)]
    other = theirs.lease(2, 0, 10, prefilling=False, tpot_budget_s=0.050)
    assert mine.tpot_floor_s(2) == pytest.approx(0.040) and mine.tpot_floor_s(3) == math.inf
    tight[0].release()
    assert mine.tpot_floor_s(2) == pytest.approx(0.040)
    tight[1].release()
    assert theirs.tpot_floor_s(2) == pytest.approx(0.050)  # another worker's stream is tighter than our 60 ms now
    other.release()
    assert mine.tpot_floor_s(2) == pytest.approx(0.060)
    loose.release()
    assert mine.tpot_floor_s(2) == math.inf and not load_left(w.shared)


def test_a_request_joining_a_decode_batch_is_judged_against_the_tightest_budget_there():
    """A loose TPOT budget cannot slow a tight stream past its own: a plan is judged against the tightest TPOT
    budget of the streams decoding on its decode engine, another worker's included, until that stream ends."""
    sched, w = scheduler("slo_aware", "reject")
    p, d = slots(sched)
    teach_prefill(w.predictor, p, 1000.0)
    teach_decode(w.predictor, d, 0.02, 0.005)
    decode = sched.registry.view().pool(MODEL, "decode")[0]
    loose = [sched.lease(decode, job(100, tpot_ms=200), DECODE) for _ in range(3)]
    assert asyncio.run(admit(sched, job(100, tpot_ms=200))).target.slot == d
    # Another worker's stream with a 40 ms budget: five in the batch take 45 ms a token, over its 85 %.
    tight = Ledger(w.shared, 1, 2).lease(d, 0, 50, prefilling=False, kind=DECODE, tpot_budget_s=0.040)
    with pytest.raises(OverBudget) as e:
        asyncio.run(admit(sched, job(100, tpot_ms=200)))
    assert "decode saturated" in str(e.value) and "of 40 ms" in str(e.value)
    tight.release()
    assert asyncio.run(admit(sched, job(100, tpot_ms=200))).target.slot == d
    for lease in loose:
        lease.release()
    assert not any(c.tpot_floor_us for c in w.ledger.columns[d])


def test_queue_admission_waits_for_capacity_then_admits():
    async def scenario():
        sched, w = scheduler("slo_aware", "queue")
        p, d = slots(sched)
        teach_prefill(w.predictor, p, 1000.0)
        teach_decode(w.predictor, d, 0.02, 0.005)
        busy = queue_work(w, p, 2000)  # 2 s of work on the only prefill engine
        info = job(400, ttft_ms=2000)
        waiting = asyncio.ensure_future(admit(sched, info))
        await asyncio.sleep(0.05)
        assert not waiting.done() and len(sched.queue) == 1
        busy.release()  # it ends (an error, say): nothing is queued any more
        sched.queue.poke()
        plan = await asyncio.wait_for(waiting, 2.0)
        assert plan.prefill.slot == p and info.feasible is True
        assert w.shared.workers[0].queued == 0  # this worker's shared queue count is back to zero

    asyncio.run(scenario())


def test_queue_admission_gives_up_when_no_wait_can_help_and_when_full():
    async def scenario():
        sched, w = scheduler("slo_aware", "queue", queue_size=1)
        p, d = slots(sched)
        teach_prefill(w.predictor, p, 1000.0)
        teach_decode(w.predictor, d, 0.02, 0.005)
        with pytest.raises(OverBudget, match="ran out"):
            await asyncio.wait_for(admit(sched, job(5000, ttft_ms=2000)), 2.0)  # 5 s of prefill, 2 s budget
        busy = queue_work(w, p, 3000)
        first = asyncio.ensure_future(admit(sched, job(500, ttft_ms=3000)))
        await asyncio.sleep(0.02)
        with pytest.raises(OverBudget, match="full"):
            await admit(sched, job(500, ttft_ms=3000))
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        assert len(sched.queue) == 0
        busy.release()

    asyncio.run(scenario())


def after_a_bad_moment(admission: str) -> tuple[Scheduler, World, int, int]:
    """An slo_aware scheduler whose model knows the engines, and whose prefill engine was, just now, five times
    slower than predicted: (scheduler, world, prefill slot, decode slot)."""
    sched, w = scheduler("slo_aware", admission)
    p, d = slots(sched)
    teach_prefill(w.predictor, p, 1000.0)
    teach_decode(w.predictor, d, 0.02, 0.005)
    w.health.put(p, "late_share", 5.0)  # an allowance of five times the prediction
    w.health.put(p, "late_at", time.monotonic())
    return sched, w, p, d


def test_idle_engines_are_never_refused_a_request_they_can_serve():
    sched, w, p, d = after_a_bad_moment("reject")
    assert w.predictor.allowance_s(p, 1.0, time.monotonic()) == pytest.approx(5.0, rel=0.05)
    plan = asyncio.run(admit(sched, job(500, ttft_ms=3000)))  # 0.5 s expected: served, and learned from
    assert plan.prefill.slot == p
    busy = w.ledger.lease(d, 0, 10, prefilling=False)
    with pytest.raises(OverBudget):  # engines at work: the allowance counts
        asyncio.run(admit(sched, job(500, ttft_ms=3000)))
    busy.release()
    with pytest.raises(OverBudget):  # idle, but even the expected time is over the budget
        asyncio.run(admit(sched, job(5000, ttft_ms=3000)))


def test_a_request_waiting_in_the_queue_is_let_in_when_its_engines_fall_idle():
    """The queue admits by the rule a request meets on arrival: engines with nothing of ours in flight serve it
    unless even its expected times miss the budget. Without it, a request queued while the engines were busy
    waited on an allowance (or a fit) inflated by a bad moment, every later one queued behind it, nothing was let
    in to teach the model otherwise, and the queue refused all of them until the allowance faded, or for good."""
    sched, w, p, d = after_a_bad_moment("queue")
    busy = w.ledger.lease(d, 0, 10, prefilling=False)

    async def scenario() -> None:
        waiting = asyncio.ensure_future(admit(sched, job(500, ttft_ms=3000)))
        await asyncio.sleep(0.05)
        assert not waiting.done() and len(sched.queue) == 1  # engines at work: the allowance counts
        busy.release()
        plan = await asyncio.wait_for(waiting, 1.0)  # idle now: let in (the budget lasts 2.4 s more)
        assert plan.prefill.slot == p

    asyncio.run(scenario())


def test_the_engines_own_latency_standing_in_for_a_decode_line_never_makes_a_request_hopeless():
    """Before the decode line is learned the engine's mean inter-token latency stands in for it: measured at the
    batch the engine ran in the last scrape interval with tokens, and kept while it idles. After bursts of 32 streams
    it said 39-41 ms against a 40 ms budget on an engine whose empty batch steps in 10 ms (tests/test_fairness.py's
    saturation): every request was hopeless, idle engines took none, and the line was never learned."""
    sched, w = scheduler("slo_aware", "reject")
    p, d = slots(sched)
    teach_prefill(w.predictor, p, 1000.0)
    w.health.put(d, "engine_itl_s", 0.05)
    plan = asyncio.run(admit(sched, job(500, ttft_ms=3000, tpot_ms=40)))  # idle engines: served, and learned from
    assert plan.target.slot == d
    teach_decode(w.predictor, d, 0.05, 0.002)  # its own line says an empty batch steps in 50 ms: hopeless
    with pytest.raises(OverBudget):
        asyncio.run(admit(sched, job(500, ttft_ms=3000, tpot_ms=40)))


def test_every_policy_judges_its_plan_when_the_model_knows_the_engines():
    for name in ("round_robin", "load_balance", "kv_cache_affinity"):
        sched, w = scheduler(name, "reject")
        p, d = slots(sched)
        teach_prefill(w.predictor, p, 1000.0)
        teach_decode(w.predictor, d, 0.02, 0.005)
        with pytest.raises(OverBudget):
            asyncio.run(admit(sched, job(5000, ttft_ms=2000)))


# -- engine metrics ------------------------------------------------------------------------------

METRICS = """# HELP vllm:num_requests_running x
vllm:num_requests_running{{model_name="m"}} {running}
vllm:num_requests_waiting{{model_name="m"}} 2.0
vllm:kv_cache_usage_perc{{model_name="m"}} 0.25
vllm:cache_config_info{{block_size="32",engine="0",num_gpu_blocks="64",prefix_caching_hash_algo="sha256"}} 1.0
vllm:time_to_first_token_seconds_sum{{model_name="m"}} {ttft_sum}
vllm:time_to_first_token_seconds_count{{model_name="m"}} {ttft_count}
vllm:inter_token_latency_seconds_bucket{{model_name="m",le="0.1"}} 3.0
vllm:inter_token_latency_seconds_sum{{model_name="m"}} {itl_sum}
vllm:inter_token_latency_seconds_count{{model_name="m"}} {itl_count}
"""


def test_scrape_keeps_gauges_and_interval_means():
    health = Health(SharedState.create())
    scrapes = EngineScrapes(health)
    scrapes.update(
        4, parse_engine_metrics(METRICS.format(running=3, ttft_sum=10.0, ttft_count=10, itl_sum=1.0, itl_count=100))
    )
    assert health.engine_load(4) == (3.0, 2.0, 0.25) and health.get(4, "engine_ttft_s") == 0.0
    assert health.get(4, "cache_blocks") == 64.0  # the info gauge's label
    scrapes.update(
        4, parse_engine_metrics(METRICS.format(running=5, ttft_sum=16.0, ttft_count=12, itl_sum=5.0, itl_count=200))
    )
    assert health.get(4, "engine_ttft_s") == pytest.approx(3.0)  # 6 s over 2 requests in the interval
    assert health.get(4, "engine_itl_s") == pytest.approx(0.04)
    assert health.get(4, "engine_itl_batch") == pytest.approx(4.0)  # the interval's two gauges, 3 and 5
    scrapes.update(
        4, parse_engine_metrics(METRICS.format(running=0, ttft_sum=0.0, ttft_count=0, itl_sum=0.0, itl_count=0))
    )
    assert health.get(4, "engine_itl_s") == pytest.approx(0.04)  # an engine restart is not a sample


def test_a_long_prompts_hashes_cover_prefixes_sparsely_and_find_a_shared_prefix_to_within_an_eighth():
    block = 64
    base = bytes(range(256)) * (64 * 1024)  # 16 MiB of distinct blocks
    long = chained_hashes(base[: 1 << 20], block)  # 1 MiB: 16384 blocks
    assert len(long) < 100 and blocks_covered(len(long)) == 16384
    assert chained_hashes(base[:1024], block) == long[:16]  # every block of the first KiB
    index = PrefixIndex(SharedState.create())
    index.record(long, 5)
    for shared_kib in (3, 100, 700, 1023):
        other = base[: shared_kib * 1024] + b"~" * ((1 << 20) - shared_kib * 1024)
        found = index.cached_blocks(chained_hashes(other, block), 5)
        assert shared_kib * 16 * 7 / 8 <= found <= shared_kib * 16  # never more than is shared
        assert index.last_owner(chained_hashes(other, block), found) == (5 if found else -1)


def test_a_stream_learns_against_the_batch_the_verdicts_admitted_after_it_predicted(monkeypatch):
    """The scheduler's side of the growth rule: a decode lease admitted on its verdict records the batch its plan
    predicted, and a stream's sample is given its own plan's batch and the largest recorded after it started."""
    t = [100.0]
    clock.use(lambda: t[0])
    try:
        sched, w = scheduler("slo_aware", "reject")
        p, d = slots(sched)
        teach_prefill(w.predictor, p, 1000.0)
        teach_decode(w.predictor, d, 0.02, 0.005)
        decode = sched.registry.view().pool(MODEL, "decode")[0]
        calls, learn_decode = [], w.predictor.learn_decode

        def spy(*args) -> None:
            calls.append(args[7:9])
            learn_decode(*args)

        monkeypatch.setattr(w.predictor, "learn_decode", spy)

        def admitted():
            info = job(100, max_tokens=10)
            asyncio.run(admit(sched, info))
            assert info.feasible and info.tpot_batch >= 1.0
            lease = sched.lease(decode, info, DECODE)
            lease.first_token()
            return info, lease

        first, a = admitted()
        t[0] += 0.5
        second, b = admitted()  # joins a's batch: its plan predicted a bigger one
        assert second.tpot_batch > first.tpot_batch
        assert w.ledger.verdict_batch(d, a.started) == pytest.approx(second.tpot_batch, abs=0.001)
        assert w.ledger.verdict_batch(d, b.started) == 0.0  # none after the last
        t[0] += 1.0
        for lease in (a, b):
            lease.events = 40
            lease.succeed()
            lease.release()
        assert calls == [
            (pytest.approx(first.tpot_batch), pytest.approx(second.tpot_batch, abs=0.001)),
            (pytest.approx(second.tpot_batch), 0.0),
        ]
        unjudged = sched.lease(decode, job(100, max_tokens=10), DECODE)  # no verdict: nothing recorded
        assert w.ledger.verdict_batch(d, b.started) == 0.0
        unjudged.release()
    finally:
        clock.use(time.monotonic)


def test_a_stream_whose_batch_ramped_teaches_its_error_not_the_steps_line():
    """A ramp's tokens come mostly in the small batch's short steps while the mean batch is over time: once the
    engine is known, a stream whose step at its end was over twice the one it joined (batch 1 to 8: 12 against 5
    sequences' worth, with the fixed part priced as 4) does not move the decode fit; its TPOT error counts."""
    t = [100.0]
    clock.use(lambda: t[0])
    try:
        sched, w = scheduler("slo_aware", "off")
        d = sched.registry.view().pool(MODEL, "decode")[0]
        teach_decode(w.predictor, d.slot, 0.02, 0.005)
        e = w.shared.endpoints[d.slot]

        def stream(others_at_end: int) -> tuple[float, int]:
            t[0] += 10.0
            a = sched.lease(d, job(100, max_tokens=10), DECODE)
            a.predicted_tpot = 0.02
            a.first_token()
            others = [w.ledger.lease(d.slot, 0, 10, prefilling=False) for _ in range(others_at_end)]
            t[0] += 1.0
            a.events = 40
            a.succeed()
            a.release()
            for o in others:
                o.release()
            return e.dc_n, e.tpot_count

        n, count = e.dc_n, e.tpot_count
        assert stream(2) == (pytest.approx(n * (1 - w.predictor.decay) + 1), count + 1)  # 1 to 3: steady
        n = e.dc_n
        assert stream(7) == (n, count + 2)  # 1 to 8: it ramped
        assert not load_left(w.shared)
    finally:
        clock.use(time.monotonic)


def test_a_streams_mean_batch_counts_the_streams_that_came_and_went(monkeypatch):
    """The decode fit's batch is the mean of the requests on the engine over a stream's decode (the ledger's area,
    over every worker's row), not its first and last batch: a stream that ran beside another for a while decoded
    in a bigger batch. For a decode leg and a whole request alike."""
    t = [100.0]
    clock.use(lambda: t[0])
    try:
        sched, w = scheduler("slo_aware", "off")
        d = sched.registry.view().pool(MODEL, "decode")[0]
        theirs = Ledger(w.shared, 1, 2)  # another worker's
        batches, learn_decode = [], w.predictor.learn_decode

        def spy(*args) -> None:
            batches.append(args[5])
            learn_decode(*args)

        monkeypatch.setattr(w.predictor, "learn_decode", spy)
        for kind in (DECODE, WHOLE):
            t[0] += 10.0
            a = sched.lease(d, job(100, max_tokens=10), kind)
            assert a.sample
            a.first_token()
            t[0] += 1.0
            b = theirs.lease(d.slot, 0, 10, prefilling=False)  # another worker's stream joins for 2 s
            t[0] += 2.0
            b.release()
            t[0] += 1.0
            a.events = 40
            a.succeed()
            a.release()
        # Alone for 2 s, beside another for 2 s: 1.5 (its first and last batch say 1).
        assert batches == [pytest.approx(1.5)] * 2
        assert not load_left(w.shared)
    finally:
        clock.use(time.monotonic)
