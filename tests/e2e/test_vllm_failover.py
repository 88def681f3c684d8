"""Mid-stream continuation against real vLLM: the decode engine is SIGKILLed a few tokens into a long greedy
answer, and the client's stream still ends normally with exactly the text an unbroken run produces.

The run's engines serve as a PD model with two decode instances: the real NixlConnector decode engine, and
the union engine registered as a second decode instance (the continuation's target computes the prompt
itself, with no ticket: what any vLLM engine does with a completions prompt of token ids; vllm_up.sh starts
no fourth engine for it). The union instance is paused while the request is placed, so that the first decode
leg goes to the NixlConnector engine, and resumed before that engine is killed. The reference is an unbroken
greedy stream of the same body on the union engine directly (greedy logprobs through the pair equal the
union engine's: test_vllm_pd.py). The decode engine is restarted at the end for the suites after this one.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from harness.configs import coordinator_config, instance
from harness.coordinator import Coordinator
from harness.loopback import wait_until

pytestmark = pytest.mark.vllm

PROMPT = [{"role": "user", "content": "Tell me a long story about the weather in Paris in spring."}]
ANSWER_TOKENS = 440  # a long answer (the context is 512): about 2 s of decoding, the kill lands well inside it
KILL_AFTER = 5  # content chunks read before the decode engine is killed
P, D, U = 1, 2, 3  # instance ids: prefill, the NixlConnector decode, the union engine as a second decode


@pytest.fixture(scope="module")
def failover(engines, model):
    cfg = coordinator_config(
        [
            instance(P, "prefill", model, engines["prefill"].address),
            instance(D, "decode", model, engines["decode"].address),
            instance(U, "decode", model, engines["union"].address),
        ],
        models=[{"id": model, "p_max_seqlen": 512, "d_max_seqlen": 512}],
        exception_config={"reschedule_config": {"enable": True}, "stream_idle_timeout": 60},
        scheduler_config={"health_check_interval": 0.5, "metrics_scrape_interval": 1.0},
    )
    with Coordinator(cfg, ready_timeout_s=180.0) as coord:
        yield coord


def body(model: str) -> dict:
    return {
        "model": model,
        "messages": PROMPT,
        "max_tokens": ANSWER_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def unbroken(engine, model: str) -> tuple[str, tuple]:
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    req = body(model)
    extra = {"ignore_eos": req.pop("ignore_eos")}
    text, usage = "", None
    for chunk in client.chat.completions.create(**req, extra_body=extra):
        for ch in chunk.choices:
            text += ch.delta.content or ""
        usage = chunk.usage or usage
    return text, (usage.prompt_tokens, usage.completion_tokens)


def test_decode_engine_killed_mid_answer_the_stream_goes_on_with_the_unbroken_text(failover, engines, model):
    reference, ref_usage = unbroken(engines["union"], model)
    assert ref_usage[1] == ANSWER_TOKENS

    assert failover.refresh("pause", [U]).status_code == 200
    client = openai.OpenAI(base_url=failover.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    req = body(model)
    extra = {"ignore_eos": req.pop("ignore_eos")}
    text, usage, ids, finish, seen = "", None, set(), None, 0
    killed = False
    try:
        for chunk in client.chat.completions.create(**req, extra_body=extra):
            ids.add(chunk.id)
            for ch in chunk.choices:
                text += ch.delta.content or ""
                finish = ch.finish_reason or finish
                assert (ch.model_extra or {}).get("token_ids") is None  # ids the client did not ask for
                seen += bool(ch.delta.content)
            usage = chunk.usage or usage
            if seen >= KILL_AFTER and not killed:
                assert failover.refresh("resume", [U]).status_code == 200
                engines["decode"].kill()  # SIGKILL of its process group, mid-answer
                killed = True
        assert killed
        assert text == reference  # token for token: nothing repeated, nothing missing
        assert finish == "length" and len(ids) == 1
        assert (usage.prompt_tokens, usage.completion_tokens) == ref_usage
        assert wait_until(lambda: _request_line(failover), timeout_s=10)
        line = _request_line(failover)
        assert " continuations=1 " in line and "status=200" in line, line
    finally:
        failover.refresh("resume", [U])
        if killed:
            engines["decode"].restart()
            assert wait_until(engines["decode"].healthy, timeout_s=60)
            assert wait_until(lambda: _decode_healthy(failover), timeout_s=30)


def _request_line(coord) -> str:
    lines = [ln for ln in coord.output().splitlines() if "route=/v1/chat/completions" in ln and "status=" in ln]
    return lines[-1] if lines else ""


def _decode_healthy(coord) -> bool:
    doc = httpx.get(coord.mgmt + "/instances", timeout=5).json()
    return all(ep["healthy"] for inst in doc["instances"] if inst["id"] == D for ep in inst["endpoints"])
