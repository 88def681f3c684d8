"""Mid-stream continuation against real vLLM: the decode engine is SIGKILLed a few tokens into a long greedy
answer, and the client's stream still ends normally: one stream, the tokens it had seen, then the rest from another
engine, nothing repeated and nothing lost.

Two shapes of the run's three engines (vllm_up.sh starts no fourth one):
- a PD model with two decode instances: the real NixlConnector decode engine, and the union engine registered
  as a second decode instance (the continuation's target computes the prompt itself, with no ticket: what any
  vLLM engine does with a completions prompt of token ids). The union instance is paused while the request is
  placed, so that the first decode leg goes to the NixlConnector engine, and resumed before that engine is killed.
- P + D + a union engine, no second decode instance: the continuation must go to the union engine, never back
  to the dead decode engine.
The reference is built as a right splice would be: an unbroken greedy stream of the same body on the union engine
directly (greedy logprobs through the pair equal the union engine's: test_vllm_pd.py) gives the tokens the client
had seen (as many as the Coordinator's warning says it kept), and the union engine's greedy answer to the prompt's
ids followed by those gives the rest. Not the unbroken text itself: vLLM's greedy answer from the prompt and k of its
own greedy tokens, computed in one pass, parts from the unbroken answer's rest for some k (on this model, for 4 of
13 cuts tried on the union engine and 9 of 13 on the decode engine, 3 to 213 tokens on): a CI run that killed D
later than usual saw that. The union engine's prefix cache is emptied before each stream and each reference, so
both compute their prompts whole. The decode engine is restarted after each kill for the tests and suites after it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from functools import partial

import httpx
import openai
import pytest

from harness.configs import REAL_ENGINE_CHECKS, coordinator_config, instance
from harness.coordinator import Coordinator
from harness.loopback import wait_until

pytestmark = pytest.mark.vllm

PROMPT = [{"role": "user", "content": "Tell me a long story about the weather in Paris in spring."}]
ANSWER_TOKENS = 440  # a long answer (the context is 512): about 2 s of decoding, the kill lands well inside it
KILL_AFTER = 5  # content chunks read before the decode engine is killed
P, D, U = 1, 2, 3  # instance ids: prefill, the NixlConnector decode, the union engine


def coordinator(engines, model: str, union_role: str) -> Coordinator:
    """A Coordinator with continuation on, in front of the three engines; the union engine's role is `union_role`."""
    cfg = coordinator_config(
        [
            instance(P, "prefill", model, engines["prefill"].address),
            instance(D, "decode", model, engines["decode"].address),
            instance(U, union_role, model, engines["union"].address),
        ],
        models=[{"id": model, "p_max_seqlen": 512, "d_max_seqlen": 512}],
        exception_config={"reschedule_config": {"enable": True}, "stream_idle_timeout": 60},
        scheduler_config=REAL_ENGINE_CHECKS,
    )
    return Coordinator(cfg, ready_timeout_s=180.0)


@pytest.fixture(scope="module")
def failover(engines, model):
    with coordinator(engines, model, "decode") as coord:  # the union engine as a second decode instance
        yield coord


def body(model: str, attempt: int = 0) -> dict:
    """The streamed greedy request; a later `attempt` asks in other words (a prompt no engine has seen yet)."""
    prompt = PROMPT if attempt == 0 else [{**PROMPT[0], "content": f"{PROMPT[0]['content']} Take {attempt + 1}."}]
    return {
        "model": model,
        "messages": prompt,
        "max_tokens": ANSWER_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def cold(engine) -> None:
    """The engine's prefix cache emptied (POST /reset_prefix_cache: the union engine runs in vLLM's dev mode)."""
    assert httpx.post(engine.url + "/reset_prefix_cache", timeout=30).status_code == 200


def events(r: httpx.Response) -> list[dict]:
    return [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: ") and ln != "data: [DONE]"]


def spliced(coord, engine, model: str, got: Streamed) -> tuple[str, tuple]:
    """What the client of `got` should have read, and the usage (prompt, completion) it should have been told: the
    first `kept` tokens (the Coordinator's warning) of `engine`'s unbroken greedy answer, then `engine`'s greedy
    answer to the prompt's ids and those tokens, as the continuation asks for it."""
    warned = [ln for ln in coord.output().splitlines() if f"request_id={got.rid} stream continued on " in ln]
    assert len(warned) == 1, warned
    kept = int(warned[0].split(" kept_tokens=")[1].split()[0])
    cold(engine)
    req = {**body(model, got.attempt), "return_token_ids": True}
    unbroken = events(httpx.post(engine.url + "/v1/chat/completions", json=req, timeout=300))
    prompt_ids = unbroken[0]["prompt_token_ids"]
    ids, seen = [], ""  # (the chunks up to the kept tokens': `kept` ends at a chunk that carried text)
    for ch in (c for e in unbroken for c in e["choices"]):
        if len(ids) < kept:
            ids += ch.get("token_ids") or []
            seen += ch["delta"].get("content") or ""
    if len(ids) > kept:  # vLLM merged the chunks of a reader it ran ahead of: the kept tokens' text, decoded whole
        ids = ids[:kept]
        r = httpx.post(engine.url + "/detokenize", json={"model": model, "tokens": ids}, timeout=60)
        seen = r.json()["prompt"]
    assert len(ids) == kept, (len(ids), kept)
    usage = unbroken[-1]["usage"]
    cold(engine)
    rest = {"model": model, "prompt": prompt_ids + ids, "max_tokens": ANSWER_TOKENS - kept, "temperature": 0}
    rest |= {"ignore_eos": True, "stream": True}
    tail = "".join(
        c["text"]
        for e in events(httpx.post(engine.url + "/v1/completions", json=rest, timeout=300))
        for c in e["choices"]
    )
    return seen + tail, (usage["prompt_tokens"], usage["completion_tokens"])


@dataclass
class Streamed:
    text: str = ""
    usage: object = None
    ids: set = field(default_factory=set)
    finish: str | None = None
    killed: bool = False
    attempt: int = 0  # which prompt (`body`)
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)  # its X-Request-Id: its own log line, not another's


def stream_killing_decode(coord, engines, model: str, before_kill=None, attempt: int = 0) -> Streamed:
    """The body streamed through `coord` with the SDK; the decode engine is SIGKILLed once KILL_AFTER content
    chunks are in (`before_kill`, which must return True, runs just before)."""
    client = openai.OpenAI(base_url=coord.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    req = body(model, attempt)
    extra = {"ignore_eos": req.pop("ignore_eos")}
    got, seen = Streamed(attempt=attempt), 0
    for chunk in client.chat.completions.create(**req, extra_body=extra, extra_headers={"X-Request-Id": got.rid}):
        got.ids.add(chunk.id)
        for ch in chunk.choices:
            got.text += ch.delta.content or ""
            got.finish = ch.finish_reason or got.finish
            assert (ch.model_extra or {}).get("token_ids") is None  # ids the client did not ask for
            seen += bool(ch.delta.content)
        got.usage = chunk.usage or got.usage
        if seen >= KILL_AFTER and not got.killed:
            if before_kill is not None:
                assert before_kill()
            engines["decode"].kill()  # SIGKILL of its process group, mid-answer
            got.killed = True
    return got


def killed_mid_answer(coord, engines, model: str, before=None, before_kill=None, attempts: int = 3) -> Streamed:
    """`stream_killing_decode` until the kill lands while D still decodes: at most `attempts` streams, each with
    a prompt of its own (the unbroken reference is the one of `got.attempt`), `before` run before each.

    On two cores D's API server can fall behind its engine and send the rest of an answer in one burst: a kill
    after that interrupts nothing, and the stream ends whole with no continuation. Such a try proves nothing;
    D is restarted and another is made."""
    for attempt in range(attempts):
        if before is not None:
            assert before()
        cold(engines["union"])  # (the continuation then computes its prompt whole, as `spliced` does)
        got = stream_killing_decode(coord, engines, model, before_kill, attempt)
        assert got.killed
        assert wait_until(partial(_request_line, coord, got.rid), timeout_s=10)
        whole = got.finish == "length" and got.usage is not None and got.usage.completion_tokens == ANSWER_TOKENS
        if not (whole and " continuations=0 " in _request_line(coord, got.rid)):
            return got
        back_up(coord, engines)
    raise AssertionError(f"the decode engine had sent all {attempts} answers before {KILL_AFTER} chunks were read")


def back_up(coord, engines) -> None:
    """The killed decode engine restarted, and seen healthy by `coord`."""
    engines["decode"].restart()
    assert wait_until(engines["decode"].healthy, timeout_s=60)
    assert wait_until(lambda: _decode_healthy(coord), timeout_s=30)


def test_decode_engine_killed_mid_answer_the_stream_goes_on_with_the_unbroken_text(failover, engines, model):
    got = Streamed()
    try:
        got = killed_mid_answer(
            failover,
            engines,
            model,
            before=lambda: failover.refresh("pause", [U]).status_code == 200,
            before_kill=lambda: failover.refresh("resume", [U]).status_code == 200,
        )
        assert got.killed
        reference, ref_usage = spliced(failover, engines["union"], model, got)
        assert ref_usage[1] == ANSWER_TOKENS
        assert got.text == reference, diverged(got, reference)  # token for token: nothing repeated or lost
        assert got.finish == "length" and len(got.ids) == 1
        assert (got.usage.prompt_tokens, got.usage.completion_tokens) == ref_usage
        assert wait_until(lambda: _request_line(failover, got.rid), timeout_s=10)
        line = _request_line(failover, got.rid)
        assert " continuations=1 " in line and "status=200" in line, line
    finally:
        failover.refresh("resume", [U])
        if got.killed:
            back_up(failover, engines)


def test_the_only_decode_engine_killed_mid_answer_the_stream_goes_on_on_the_union_engine(engines, model):
    """P + D + union, no second decode instance: the continuation goes to the union engine (its own count of
    finished requests says so), never back to the dead decode engine, and the client gets the unbroken text."""
    union = engines["union"]
    with coordinator(engines, model, "union") as coord:
        finished0 = union.metric("vllm:request_success_total", finished_reason="length")
        got = Streamed()
        try:
            got = killed_mid_answer(coord, engines, model)
            assert got.killed
            assert wait_until(
                lambda: union.metric("vllm:request_success_total", finished_reason="length") == finished0 + 1,
                timeout_s=10,
            )
            reference, ref_usage = spliced(coord, union, model, got)
            assert got.text == reference, diverged(got, reference)
            assert got.finish == "length" and len(got.ids) == 1
            assert (got.usage.prompt_tokens, got.usage.completion_tokens) == ref_usage
            assert wait_until(lambda: _request_line(coord, got.rid), timeout_s=10)
            line = _request_line(coord, got.rid)
            assert " continuations=1 " in line and f" decode={U}/" in line and "status=200" in line, line
        finally:
            if got.killed:
                back_up(coord, engines)


def diverged(got: Streamed, reference: str) -> str:
    at = next((i for i, (a, b) in enumerate(zip(got.text, reference)) if a != b), min(len(got.text), len(reference)))
    return f"the texts ({len(got.text)} and {len(reference)} characters) differ from character {at}"


def _request_line(coord, rid: str) -> str:
    """The request log line of request `rid` ("" until its batch is written)."""
    lines = [ln for ln in coord.output().splitlines() if f"request_id={rid} " in ln and "status=" in ln]
    return lines[-1] if lines else ""


def _decode_healthy(coord) -> bool:
    doc = httpx.get(coord.mgmt + "/instances", timeout=5).json()
    return all(ep["healthy"] for inst in doc["instances"] if inst["id"] == D for ep in inst["endpoints"])
