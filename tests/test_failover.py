"""The fault matrix's continuation column: streams whose engine fails after the first token go on elsewhere.

One Coordinator with `exception_config.reschedule_config.enable` serves a union model (two engines), a PD
model (one prefill, two decode engines) and a model on engines that, like vLLM 0.32's /v1/messages, return
no token ids there. Each engine that could serve the stream is told to fail after K tokens (die, reset,
in-band 5xx, stall): whichever one the request lands on breaks at token K, and the continuation (N - K
tokens, fewer than K) runs to its end on the other. The client's answer, read through the real SDKs, must
be the unbroken run's: same text, finish reason, usage and response id, no token ids it did not ask for;
the continuation is counted, and the ledger is back at zero.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

import httpx
import pytest

from harness.bodies import sse_events
from harness.clients import anthropic_client, openai_client
from harness.configs import coordinator_config, instance
from harness.coordinator import Coordinator
from harness.ledger import ledger, ledger_is_zero
from harness.loopback import wait_until
from serving.continuation import refusal
from serving.families import RESPONSES
from serving.job import job_from_body, parse_body

UNION, PD, PLAIN = "failover-union", "failover-pd", "failover-plain"
K, N = 10, 16  # the engine fails before token K+1 of N: a continuation generates N-K < K tokens
MAX_CONTINUATIONS = 2
SEED, TEMPERATURE = 7, 0.8
MESSAGES = [{"role": "user", "content": "Tell me about rivers, at length."}]


@pytest.fixture(scope="module")
def cluster(module_sims):
    sim = {"speedup": 5, "messages_token_ids": True}  # an engine whose Messages route returns ids too
    u = [module_sims("union", model=UNION, **sim) for _ in range(2)]
    p = [module_sims("prefill", model=PD, **sim)]
    d = [module_sims("decode", model=PD, **sim) for _ in range(2)]
    plain = [module_sims("union", model=PLAIN, speedup=5) for _ in range(2)]  # vLLM 0.32's Messages: no ids
    instances = [instance(i + 1, "union", UNION, s.address) for i, s in enumerate(u)]
    instances += [instance(11, "prefill", PD, p[0].address)]
    instances += [instance(i + 21, "decode", PD, s.address) for i, s in enumerate(d)]
    instances += [instance(i + 31, "union", PLAIN, s.address) for i, s in enumerate(plain)]
    sims = {"union": u, "prefill": p, "decode": d, "plain": plain}
    timeouts = {"first_token_timeout": 2.0, "stream_idle_timeout": 0.5, "stream_keepalive_interval": 0.15}
    with continuing(instances, sims, **timeouts) as coord:
        yield coord


def continuing(instances: list, sims: dict, **exception_config) -> Coordinator:
    """A Coordinator that continues broken streams, in front of `instances`; `sims`: their engines, by group."""
    cfg = coordinator_config(
        instances,
        exception_config={
            "reschedule_config": {"enable": True, "max_continuations": MAX_CONTINUATIONS},
            "max_retry": 2,
            "retry_delay": 0.01,
            "kv_release_path": "/sim/kv/release",
            **exception_config,
        },
        scheduler_config={"breaker_failure_threshold": 1000, "health_check_interval": 0.2},
    )
    coord = Coordinator(cfg)
    coord.sims = sims
    return coord


def all_healthy(c) -> bool:
    doc = httpx.get(c.mgmt + "/instances", timeout=5).json()
    return all(ep["healthy"] for inst in doc["instances"] for ep in inst["endpoints"])


def fresh(coord):
    """`coord` with its engines' faults cleared, their records emptied, and all of them healthy again."""
    every = [s for group in coord.sims.values() for s in group]
    for s in every:  # (clearing the faults brings a dead engine back to life)
        s.clear_faults()
        s.reset()
    assert wait_until(lambda: all_healthy(coord), 10)  # a dead engine of the last test is back
    return coord


@pytest.fixture
def c(cluster):
    return fresh(cluster)


# -- helpers ---------------------------------------------------------------------------------------


@dataclass
class Answer:
    text: str = ""
    finish: str | None = None
    usage: tuple = ()
    ids: set = field(default_factory=set)  # response ids seen on the chunks
    blocks: list = field(default_factory=list)  # Anthropic: (event, index) of block events
    leaked: bool = False  # token ids the client did not ask for reached it
    token_ids: list = field(default_factory=list)  # the ids the client asked for, as it got them


def ask(
    c, api: str, model: str, max_tokens: int = N, temperature: float = TEMPERATURE, rid: str | None = None, **extra
) -> Answer:
    """One streamed request through the real SDK, read to its end (`rid`: its X-Request-Id)."""
    a = Answer()
    headers = {"X-Request-Id": rid} if rid else {}
    if api == "messages":
        stream = anthropic_client(c).messages.create(
            extra_headers=headers,
            model=model,
            max_tokens=max_tokens,
            messages=MESSAGES,
            stream=True,
            extra_body={"temperature": temperature, "ignore_eos": True, **extra},
        )
        for ev in stream:
            a.leaked |= "token_ids" in json.dumps(ev.model_dump())
            if ev.type == "message_start":
                a.ids.add(ev.message.id)
                prompt = ev.message.usage.input_tokens
            elif ev.type in ("content_block_start", "content_block_stop"):
                a.blocks.append((ev.type, ev.index))
            elif ev.type == "content_block_delta":
                a.text += ev.delta.text
                a.blocks.append((ev.type, ev.index))
            elif ev.type == "message_delta":
                a.finish, a.usage = ev.delta.stop_reason, (prompt, ev.usage.output_tokens)
        return a
    oa = openai_client(c)
    common = {
        "model": model,
        "max_tokens": max_tokens,
        "seed": SEED,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "extra_body": {"ignore_eos": True, **extra},
        "extra_headers": headers,
    }
    if api == "chat":
        stream = oa.chat.completions.create(messages=MESSAGES, **common)
    else:
        stream = oa.completions.create(prompt="Tell me about rivers, at length.", **common)
    for chunk in stream:
        a.ids.add(chunk.id)
        for ch in chunk.choices:
            a.text += (ch.delta.content or "") if api == "chat" else ch.text
            a.finish = ch.finish_reason or a.finish
            got = (ch.model_extra or {}).get("token_ids")
            a.token_ids += got or []
            a.leaked |= got is not None and not extra.get("return_token_ids")
        prompt_ids = (chunk.model_extra or {}).get("prompt_token_ids")
        a.leaked |= prompt_ids is not None and not extra.get("return_token_ids")
        if chunk.usage:
            u = chunk.usage
            a.usage = (u.prompt_tokens, u.completion_tokens, u.total_tokens)
    return a


def engines_for(c, where: str) -> list:
    return c.sims["union"] if where == "union" else c.sims["decode"]


def model_for(where: str) -> str:
    return UNION if where == "union" else PD


def continuations_sent(sims) -> list[dict]:
    """The continuation requests the engines got: completions whose prompt is token ids."""
    return [
        r["body"]
        for s in sims
        for r in s.requests()
        if r["path"] == "/v1/completions" and isinstance((r["body"] or {}).get("prompt"), list)
    ]


def counter(c, name: str, **labels) -> float:
    text = httpx.get(c.obs + "/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def log_line(c, marker: str) -> str:
    """The request log line of the last request whose line holds `marker` (written in batches: waited for)."""

    def found() -> str:
        lines = [ln for ln in c.output().splitlines() if "coordinator.request" in ln and "status=" in ln]
        return next((ln for ln in reversed(lines) if marker in ln), "")

    assert wait_until(lambda: found(), 5), marker
    return found()


def settled(c) -> bool:
    return ledger_is_zero(c) and all(
        not (st := s.stats())["running"] and not st["waiting"] for g in c.sims.values() for s in g
    )


# -- the matrix ------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["union", "pd"])
@pytest.mark.parametrize("api", ["chat", "completions", "messages"])
@pytest.mark.parametrize("fault", ["die", "reset", "error", "stall"])
def test_a_stream_broken_after_k_tokens_goes_on_as_the_unbroken_run(c, fault, api, where):
    model, sims = model_for(where), engines_for(c, where)
    ref = ask(c, api, model)
    assert len(ref.text) > 0 and ref.usage[-1 if api == "messages" else 1] == N
    before = counter(c, "motor_stream_continuations_total")
    for s in sims:
        s.set_faults(mid_stream_fault=fault, mid_stream_fault_after_tokens=K)

    rid = uuid.uuid4().hex
    got = ask(c, api, model, rid=rid)

    assert got.text == ref.text
    assert (got.finish, got.usage) == (ref.finish, ref.usage)
    assert len(got.ids) == 1 and not got.leaked
    if api == "messages":  # one text block, its index kept across the break
        assert got.blocks[0] == ("content_block_start", 0) and got.blocks[-1] == ("content_block_stop", 0)
        assert {i for _, i in got.blocks} == {0}
    sent = continuations_sent(sims)
    assert len(sent) == 1, sent
    assert sent[0]["max_tokens"] == N - K and sent[0]["stream"] is True
    assert len(sent[0]["prompt"]) == ref.usage[0] + K  # the prompt's ids and the K generated ones
    if api != "messages":
        assert sent[0]["seed"] == SEED and sent[0]["temperature"] == TEMPERATURE
    assert "kv_transfer_params" not in sent[0]  # in PD the other decode engine computes the prompt itself
    assert wait_until(lambda: counter(c, "motor_stream_continuations_total") == before + 1, 5)
    assert wait_until(lambda: settled(c), 5), ledger(c)
    line = log_line(c, f"request_id={rid} ")
    assert " continuations=1 " in line and "status=200" in line, line
    if fault == "die":  # the failed engine is reported to health as any dead engine is
        assert wait_until(lambda: not all_healthy(c), 5)


def test_token_ids_the_client_asked_for_stay_and_match_the_unbroken_run(c):
    ref = ask(c, "chat", UNION, return_token_ids=True)
    assert len(ref.token_ids) == N
    for s in c.sims["union"]:
        s.set_faults(mid_stream_fault="reset", mid_stream_fault_after_tokens=K)
    got = ask(c, "chat", UNION, return_token_ids=True)
    assert (got.text, got.token_ids, got.usage) == (ref.text, ref.token_ids, ref.usage)


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_a_token_whose_text_the_client_has_not_seen_is_generated_again(c, api):
    """The K-th token's chunk came with its id and no text (vLLM waiting for the rest of a UTF-8 character),
    then the engine failed: the continuation goes on from token K-1, so that token's text is not lost."""
    ref = ask(c, api, UNION)
    for s in c.sims["union"]:
        s.set_faults(held_text_token=K, mid_stream_fault="reset", mid_stream_fault_after_tokens=K)
    rid = uuid.uuid4().hex
    got = ask(c, api, UNION, rid=rid)
    assert (got.text, got.finish, got.usage) == (ref.text, ref.finish, ref.usage)
    sent = continuations_sent(c.sims["union"])
    assert len(sent) == 1 and sent[0]["max_tokens"] == N - K + 1
    assert len(sent[0]["prompt"]) == ref.usage[0] + K - 1
    # The warning names the tokens kept: where the client's text and the continuation's meet.
    warned = [ln for ln in c.output().splitlines() if f"request_id={rid} stream continued on " in ln]
    assert len(warned) == 1 and f" kept_tokens={K - 1} " in warned[0], warned


def broken_chat(c, model: str) -> tuple[str, dict]:
    """A streamed chat request that ends with an error event: its text, and that last event."""
    body = {"model": model, "messages": MESSAGES, "max_tokens": N, "ignore_eos": True, "stream": True}
    r = httpx.post(c.url + "/v1/chat/completions", json=body, timeout=30)
    events = [json.loads(e) for e in sse_events(r.text) if e != "[DONE]"]
    return "".join(ch["delta"].get("content") or "" for e in events for ch in e.get("choices") or ()), events[-1]


def test_continuations_are_bounded_per_request_and_then_fail_as_before(c):
    """The PD model's three engines (two decode, one prefill: each serves a continuation) break after 3 tokens
    of every stream: the first engine and MAX_CONTINUATIONS continuations each add 3, then the client gets its
    one error event, and the refusal is counted as the limit."""
    for s in c.sims["decode"] + c.sims["prefill"]:
        s.set_faults(mid_stream_fault="reset", mid_stream_fault_after_tokens=3)
    before = counter(c, "motor_stream_continuation_refusals_total", reason="limit")
    text, last = broken_chat(c, PD)
    assert len(re.findall(r" \w+", text)) == 3 * (1 + MAX_CONTINUATIONS)
    assert "error" in last
    assert [len(continuations_sent([s])) for s in c.sims["decode"] + c.sims["prefill"]].count(1) == MAX_CONTINUATIONS
    assert wait_until(lambda: counter(c, "motor_stream_continuation_refusals_total", reason="limit") == before + 1, 5)
    assert wait_until(lambda: settled(c), 5), ledger(c)
    assert f" continuations={MAX_CONTINUATIONS} continuation_refused=limit " in log_line(c, "continuation_refused")


def test_a_continuation_never_goes_back_to_an_engine_that_failed_the_request(c):
    """Both union engines break after 3 tokens: the first one's stream goes on on the other, and when that
    breaks too there is no engine left that has not failed the request: the client gets its one error event
    after 6 tokens, and neither engine was asked twice."""
    for s in c.sims["union"]:
        s.set_faults(mid_stream_fault="reset", mid_stream_fault_after_tokens=3)
    before = counter(c, "motor_stream_continuation_refusals_total", reason="no_instance")
    text, last = broken_chat(c, UNION)
    assert len(re.findall(r" \w+", text)) == 3 * 2
    assert "error" in last
    assert [len(s.requests()) for s in c.sims["union"]] == [1, 1]  # the first try on one, the continuation on the other
    assert len(continuations_sent(c.sims["union"])) == 1
    assert wait_until(
        lambda: counter(c, "motor_stream_continuation_refusals_total", reason="no_instance") == before + 1, 5
    )
    assert wait_until(lambda: settled(c), 5), ledger(c)


# -- what is not continued, and fails as before -----------------------------------------------------

NOT_CONTINUED = [
    ("n", "/v1/chat/completions", {"n": 2}),
    ("structured_output", "/v1/chat/completions", {"response_format": {"type": "json_object"}}),
    ("tools", "/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}),
    ("logprobs", "/v1/chat/completions", {"logprobs": True, "top_logprobs": 2}),
    ("logprobs", "/v1/completions", {"logprobs": 1}),
    ("stop_strings", "/v1/chat/completions", {"stop": ["zzz"]}),
    ("penalties", "/v1/completions", {"presence_penalty": 0.5}),
    ("echo", "/v1/completions", {"echo": True}),
    ("thinking", "/v1/messages", {"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 2048}),
]


def _body(path: str, model: str, extra: dict) -> dict:
    first = {"prompt": "Tell me about rivers."} if path == "/v1/completions" else {"messages": MESSAGES}
    return {"model": model, **first, "max_tokens": N, "ignore_eos": True, "stream": True, **extra}


@pytest.mark.parametrize("reason,path,extra", NOT_CONTINUED, ids=[f"{r}-{p[4:]}" for r, p, _ in NOT_CONTINUED])
def test_what_cannot_be_continued_exactly_fails_as_before_and_is_counted(c, reason, path, extra):
    for s in c.sims["union"]:
        s.set_faults(mid_stream_fault="reset", mid_stream_fault_after_tokens=3)
    before = counter(c, "motor_stream_continuation_refusals_total", reason=reason)
    r = httpx.post(c.url + path, json=_body(path, UNION, extra), timeout=30)
    assert r.status_code == 200
    last = sse_events(r.text)[-1]
    assert "error" in json.loads(last), last  # one error event, as without continuation
    sent = [rec["body"] for s in c.sims["union"] for rec in s.requests()]
    assert all("return_token_ids" not in b for b in sent)  # refused up front: the engine got the client's body
    assert continuations_sent(c.sims["union"]) == []
    assert wait_until(lambda: counter(c, "motor_stream_continuation_refusals_total", reason=reason) == before + 1, 5)
    assert f"continuation_refused={reason} " in log_line(c, f"continuation_refused={reason} ")
    assert wait_until(lambda: settled(c), 5), ledger(c)


def test_a_responses_stream_is_not_continued():
    raw = b'{"model":"m","input":"Tell me about rivers.","stream":true}'
    job = job_from_body(RESPONSES, raw, parse_body(raw), "rid")
    assert refusal(job, "vllm") == "route"  # its events are not written from completions chunks


def test_messages_on_an_engine_that_returns_no_token_ids_fail_as_before(c):
    """vLLM 0.32's /v1/messages has no return_token_ids: nothing to continue from."""
    for s in c.sims["plain"]:
        s.set_faults(mid_stream_fault="reset", mid_stream_fault_after_tokens=3)
    before = counter(c, "motor_stream_continuation_refusals_total", reason="no_token_ids")
    r = httpx.post(c.url + "/v1/messages", json=_body("/v1/messages", PLAIN, {}), timeout=30)
    assert "event: error" in r.text.rsplit("\n\n", 2)[-2]
    assert continuations_sent(c.sims["plain"]) == []
    assert wait_until(
        lambda: counter(c, "motor_stream_continuation_refusals_total", reason="no_token_ids") == before + 1
    )
    assert wait_until(lambda: settled(c), 5), ledger(c)


def test_non_streamed_requests_keep_their_retries_and_are_not_continued(c):
    for s in c.sims["union"]:
        s.set_faults(fail_first_n=1)
    body = {"model": UNION, "messages": MESSAGES, "max_tokens": N, "ignore_eos": True}
    rid = uuid.uuid4().hex
    r = httpx.post(c.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": rid}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == N
    assert "return_token_ids" not in json.dumps([rec["body"] for s in c.sims["union"] for rec in s.requests()])
    line = log_line(c, f"request_id={rid} ")
    assert " retries=2 missed_handoff=False continuations=0 " in line, (
        line
    )  # each engine failed once, then one answered


def test_a_client_error_is_never_hidden_by_a_continuation(c):
    """An engine's 4xx before the first byte is the client's answer, continuation or not."""
    r = httpx.post(c.url + "/v1/chat/completions", json=_body("/v1/chat/completions", UNION, {"n": 0}), timeout=30)
    assert r.status_code == 400
    assert continuations_sent(c.sims["union"]) == []


def test_trigger_mode_streams_are_continued_on_another_decode_engine(sims):
    """MindIE's metaserver protocol (D first): the continuation still goes to another decode engine, without a
    ticket, and the client's usage keeps P's prompt counts."""
    p = sims("prefill", model=PD, speedup=5)
    d = [sims("decode", model=PD, speedup=5) for _ in range(2)]
    instances = [instance(11, "prefill", PD, p.address)] + [
        instance(21 + i, "decode", PD, s.address) for i, s in enumerate(d)
    ]
    cfg = coordinator_config(
        instances,
        exception_config={"reschedule_config": {"enable": True}, "retry_delay": 0.01},
        scheduler_config={"pd_dispatch": "trigger", "breaker_failure_threshold": 1000},
    )
    with Coordinator(cfg) as coord:
        ref = ask(coord, "chat", PD)
        for s in d:
            s.set_faults(mid_stream_fault="reset", mid_stream_fault_after_tokens=K)
        got = ask(coord, "chat", PD)
        assert (got.text, got.finish, got.usage) == (ref.text, ref.finish, ref.usage)
        sent = continuations_sent(d)
        assert len(sent) == 1 and "kv_transfer_params" not in sent[0]
        assert wait_until(lambda: ledger_is_zero(coord), 5), ledger(coord)


# -- where a continuation goes when there is no second decode instance ----------------------------------

HYBRID, SINGLE = "failover-hybrid", "failover-single"  # P + D + union; P + D alone
LONG, KILL_AT = 120, 8  # a 120-token greedy answer whose decode engine fails after its 8th token


@pytest.fixture(scope="module")
def one_decode(module_sims):
    """One Coordinator, two PD models with a single decode instance each: HYBRID has a union engine besides its
    pair, SINGLE has nothing besides it (MindIE-PyMotor's hybrid fallback: P serves a request without a ticket)."""
    sim = {"speedup": 5}
    sims = {
        "p": [module_sims("prefill", model=HYBRID, **sim)],
        "d": [module_sims("decode", model=HYBRID, **sim)],
        "u": [module_sims("union", model=HYBRID, **sim)],
        "p1": [module_sims("prefill", model=SINGLE, **sim)],
        "d1": [module_sims("decode", model=SINGLE, **sim)],
    }
    instances = [
        instance(1, "prefill", HYBRID, sims["p"][0].address),
        instance(2, "decode", HYBRID, sims["d"][0].address),
        instance(3, "union", HYBRID, sims["u"][0].address),
        instance(4, "prefill", SINGLE, sims["p1"][0].address),
        instance(5, "decode", SINGLE, sims["d1"][0].address),
    ]
    with continuing(instances, sims) as coord:
        yield coord


@pytest.fixture
def od(one_decode):
    return fresh(one_decode)


def greedy(c, model: str) -> Answer:
    return ask(c, "chat", model, max_tokens=LONG, temperature=0.0)


def test_the_single_decode_engine_killed_mid_stream_goes_on_on_the_union_engine(od):
    s = od.sims
    ref = greedy(od, HYBRID)
    assert ref.usage[1] == LONG and ref.finish == "length"
    s["d"][0].set_faults(mid_stream_fault="die", mid_stream_fault_after_tokens=KILL_AT)

    got = greedy(od, HYBRID)

    assert (got.text, got.finish, got.usage) == (ref.text, ref.finish, ref.usage)
    assert len(got.ids) == 1 and not got.leaked
    sent = continuations_sent(s["u"])  # what the union engine was asked
    assert len(sent) == 1 and sent[0]["max_tokens"] == LONG - KILL_AT and "kv_transfer_params" not in sent[0]
    assert len(sent[0]["prompt"]) == ref.usage[0] + KILL_AT
    assert continuations_sent(s["p"]) == []
    assert wait_until(lambda: settled(od), 5), ledger(od)
    assert f"model={HYBRID} " in log_line(od, " continuations=1 ")


def test_with_no_other_engine_the_stream_goes_on_on_the_prefill_engine(od):
    s = od.sims
    ref = greedy(od, SINGLE)
    s["d1"][0].set_faults(mid_stream_fault="die", mid_stream_fault_after_tokens=KILL_AT)

    got = greedy(od, SINGLE)

    assert (got.text, got.finish, got.usage) == (ref.text, ref.finish, ref.usage)
    assert len(got.ids) == 1 and got.finish == "length"
    sent = continuations_sent(s["p1"])  # P served it whole: no ticket, the prompt's and the generated ids
    assert len(sent) == 1 and "kv_transfer_params" not in sent[0] and sent[0]["max_tokens"] == LONG - KILL_AT
    assert wait_until(lambda: settled(od), 5), ledger(od)


def test_each_continuation_goes_to_an_engine_that_has_not_failed_the_request(od):
    """D breaks after 8 tokens, the union engine 8 tokens into the continuation: the second continuation goes
    to P, not back to D (alive, so it would have been asked), and the client still gets the unbroken text."""
    s = od.sims
    ref = greedy(od, HYBRID)
    for engine in s["d"] + s["u"]:
        engine.set_faults(mid_stream_fault="reset", mid_stream_fault_after_tokens=KILL_AT)

    got = greedy(od, HYBRID)

    assert (got.text, got.finish, got.usage) == (ref.text, ref.finish, ref.usage)
    assert len(got.ids) == 1
    assert continuations_sent(s["d"]) == []
    assert [len(continuations_sent(s[k])) for k in ("u", "p")] == [1, 1]
    assert continuations_sent(s["p"])[0]["max_tokens"] == LONG - 2 * KILL_AT
    assert wait_until(lambda: settled(od), 5), ledger(od)


def test_an_engine_that_failed_the_request_before_its_first_token_gets_no_continuation(od):
    """P fails the prefill once (the retry lands on it again, the only P, and succeeds), then D dies: P failed
    this request, so no engine is left for a continuation and the client gets its one error event."""
    s = od.sims
    s["p1"][0].set_faults(fail_first_n=1)
    s["d1"][0].set_faults(mid_stream_fault="die", mid_stream_fault_after_tokens=3)
    before = counter(od, "motor_stream_continuation_refusals_total", reason="no_instance")
    text, last = broken_chat(od, SINGLE)
    assert len(re.findall(r" \w+", text)) == 3 and "error" in last
    assert len(s["p1"][0].requests()) == 2  # the prefill twice, no continuation
    assert continuations_sent(s["p1"]) == []
    assert wait_until(
        lambda: counter(od, "motor_stream_continuation_refusals_total", reason="no_instance") == before + 1, 5
    )
    assert wait_until(lambda: settled(od), 5), ledger(od)


@pytest.mark.parametrize("where", ["union", "pd"])
def test_running_usage_on_every_chunk_counts_across_the_break_as_the_unbroken_run(c, where):
    """vLLM's `continuous_usage_stats`: each chunk carries the running counts. Across a continuation they go on
    from the tokens before the break (the continuation's own count is added to them), the prompt counted once."""
    model, sims = model_for(where), engines_for(c, where)

    def running() -> list[tuple[int, int, int]]:
        stream = openai_client(c).chat.completions.create(
            model=model,
            messages=MESSAGES,
            max_tokens=N,
            seed=SEED,
            temperature=TEMPERATURE,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True},
        )
        return [(u.prompt_tokens, u.completion_tokens, u.total_tokens) for ch in stream if (u := ch.usage)]

    ref = running()
    counts = [u[1] for u in ref]  # the role's chunk (0), each token's, then the usage chunk's
    assert counts == sorted(counts) and set(counts) == set(range(N + 1)), ref
    for s in sims:
        s.set_faults(mid_stream_fault="reset", mid_stream_fault_after_tokens=K)
    assert running() == ref
    assert len(continuations_sent(sims)) == 1
