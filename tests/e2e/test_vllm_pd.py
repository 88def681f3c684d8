"""The Coordinator in front of a real vLLM prefill + decode pair (NixlConnector over loopback), through the SDKs.

Every request through the pair also checks that the KV really moved: D's NIXL transfer count rises by one per
request and D's prompt tokens come from `external_kv_transfer`, not from local compute. Greedy logprobs
through the pair must equal the union engine's for the same body: D decoded from P's KV, not from a
recomputed or different prompt. The tiny model's text is gibberish, so no assertion reads it.
"""

from __future__ import annotations

from contextlib import contextmanager

import anthropic
import httpx
import openai
import pytest

from harness.loopback import wait_until
from tests.e2e.engines import metric_value

pytestmark = pytest.mark.vllm

PROMPT = [{"role": "user", "content": "Tell me about the weather in Paris in spring, in some detail."}]
GREEDY = {"temperature": 0, "ignore_eos": True}


def oai(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.coord.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def ant(cluster) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=cluster.coord.url, api_key="unused", max_retries=0, timeout=120)


@contextmanager
def kv_moved(cluster, requests: int = 1):
    """Asserts that the block's requests each moved their prompt's KV from P to D (and D computed none of it).

    Yields a list to append each request's prompt token count to; D's external-KV counter must rise by their sum.
    """
    d = cluster.engines["decode"]

    def read():
        text = d.metrics()
        return (
            metric_value(text, "vllm:nixl_xfer_time_seconds_count"),
            metric_value(text, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"),
            metric_value(text, "vllm:prompt_tokens_by_source_total", source="local_compute"),
        )

    xfers0, external0, local0 = read()
    prompts: list[int] = []
    yield prompts
    # The counters are updated by D's engine loop right after the request; give it a moment.
    expected = (xfers0 + requests, external0 + sum(prompts), local0)
    assert wait_until(lambda: read() == expected, timeout_s=10), (
        f"D metrics {read()} != expected {expected}; the Coordinator's warnings (a missed handoff, P found "
        f"unhealthy):\n{warnings(cluster)}"
    )


def warnings(cluster) -> str:
    lines = cluster.coord.output().splitlines()
    return "\n".join(line for line in lines if "WARNING" in line or "ERROR" in line)[-4000:]


def direct(engine, path: str, body: dict) -> dict:
    r = httpx.post(engine.url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_json_and_stream_through_the_pair(pd):
    c = oai(pd)
    args = dict(model=pd.model, messages=PROMPT, max_tokens=6, extra_body=GREEDY)
    with kv_moved(pd, requests=2) as prompts:
        resp = c.chat.completions.create(**args)
        chunks = list(c.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
        prompts += [resp.usage.prompt_tokens, chunks[-1].usage.prompt_tokens]
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 6
    assert "kv_transfer_params" not in resp.model_dump()
    assert chunks[0].choices[0].delta.role == "assistant"
    choice_chunks = [ch for ch in chunks if ch.choices]
    assert choice_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    streamed = "".join(ch.choices[0].delta.content or "" for ch in choice_chunks)
    assert streamed == resp.choices[0].message.content


def test_completions_json_and_stream_through_the_pair(pd):
    c = oai(pd)
    args = dict(model=pd.model, prompt="def fibonacci(n):", max_tokens=5, extra_body=GREEDY)
    with kv_moved(pd, requests=2) as prompts:
        resp = c.completions.create(**args)
        chunks = list(c.completions.create(**args, stream=True, stream_options={"include_usage": True}))
        prompts += [resp.usage.prompt_tokens, chunks[-1].usage.prompt_tokens]
    assert resp.object == "text_completion"
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 5
    streamed = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert streamed == resp.choices[0].text
    assert chunks[-1].usage.completion_tokens == 5


def test_messages_json_and_stream_through_the_pair(pd):
    """vLLM's /v1/messages accepts the prefill leg and returns a ticket, so Anthropic traffic is disaggregated too."""
    c = ant(pd)
    args = dict(model=pd.model, messages=PROMPT, max_tokens=5, extra_body={"temperature": 0})
    with kv_moved(pd, requests=2) as prompts:
        msg = c.messages.create(**args)
        with c.messages.stream(**args) as stream:
            events = list(stream)
            final = stream.get_final_message()
        prompts += [msg.usage.input_tokens, final.usage.input_tokens]
    assert msg.type == "message" and msg.role == "assistant"
    assert msg.content[0].type == "text"
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 5
    assert "kv_transfer_params" not in msg.model_dump()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "message_delta" in kinds
    assert final.content[0].text == msg.content[0].text
    assert final.usage.output_tokens == 5


def test_count_tokens_is_the_engines_answer(pd):
    body = {"model": pd.model, "messages": PROMPT}
    counted = ant(pd).messages.count_tokens(model=pd.model, messages=PROMPT)
    engine = direct(pd.engines["decode"], "/v1/messages/count_tokens", body)
    assert counted.input_tokens == engine["input_tokens"] > 0


def test_tokenize_and_detokenize_are_the_engines_answers(pd):
    """vLLM's /tokenize (a prompt and a conversation) and /detokenize through the Coordinator: the engine's bodies."""
    client = oai(pd)
    for body in (
        {"model": pd.model, "prompt": "Hello, how are you?", "return_token_strs": True},
        {"model": pd.model, "messages": PROMPT, "add_generation_prompt": True},
    ):
        got = client.post(pd.coord.url + "/tokenize", body=body, cast_to=object)
        assert got == direct(pd.engines["decode"], "/tokenize", body) and got["count"] > 0
        ids = {"model": pd.model, "tokens": got["tokens"]}
        assert client.post(pd.coord.url + "/detokenize", body=ids, cast_to=object) == direct(
            pd.engines["prefill"], "/detokenize", ids
        )


def test_models_lists_the_pair(pd):
    models = oai(pd).models.list().data
    assert [m.id for m in models] == [pd.model]
    entry = models[0].model_dump()
    assert entry["p_instances_num"] == 1 and entry["d_instances_num"] == 1
    assert entry["p_max_seqlen"] == 512 and entry["d_max_seqlen"] == 512


def test_greedy_logprobs_through_the_pair_equal_the_union_engine(pd):
    body = {"model": pd.model, "messages": PROMPT, "max_tokens": 8, "logprobs": True, **GREEDY}
    union = direct(pd.engines["union"], "/v1/chat/completions", body)
    with kv_moved(pd) as prompts:
        resp = oai(pd).chat.completions.create(
            model=pd.model, messages=PROMPT, max_tokens=8, logprobs=True, extra_body=GREEDY
        )
        prompts.append(union["usage"]["prompt_tokens"])
    via_pair = [(t.token, t.logprob) for t in resp.choices[0].logprobs.content]
    alone = [(t["token"], t["logprob"]) for t in union["choices"][0]["logprobs"]["content"]]
    assert via_pair == alone


def test_prompt_scoring_is_computed_on_decode_alone(pd):
    """`echo` with `max_tokens` 0 and `logprobs` (lm-eval's loglikelihood requests): D computes the prompt and
    its logprobs itself, no KV moves, and the answer is the prompt alone, scored like the union engine's."""
    prompt = "The weather in Paris in spring is"
    body = {"model": pd.model, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
    union = direct(pd.engines["union"], "/v1/completions", body)["choices"][0]
    d = pd.engines["decode"]
    xfers0 = d.metric("vllm:nixl_xfer_time_seconds_count")
    local0 = d.metric("vllm:prompt_tokens_by_source_total", source="local_compute")
    resp = oai(pd).completions.create(model=pd.model, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    choice = resp.choices[0]
    assert choice.text == prompt == union["text"] and choice.finish_reason == "length"
    assert choice.logprobs.tokens == union["logprobs"]["tokens"]
    assert choice.logprobs.token_logprobs == pytest.approx(union["logprobs"]["token_logprobs"], abs=1e-3)
    assert wait_until(
        lambda: d.metric("vllm:prompt_tokens_by_source_total", source="local_compute")
        == local0 + resp.usage.prompt_tokens
    )
    assert d.metric("vllm:nixl_xfer_time_seconds_count") == xfers0


def test_usage_matches_the_engines_numbers(pd):
    """The client's usage is the engines' own count (prompt from P, completion from D), in JSON and in SSE."""
    body = {"model": pd.model, "messages": PROMPT, "max_tokens": 4, **GREEDY}
    union = direct(pd.engines["union"], "/v1/chat/completions", body)["usage"]
    c = oai(pd)
    resp = c.chat.completions.create(model=pd.model, messages=PROMPT, max_tokens=4, extra_body=GREEDY)
    chunks = list(
        c.chat.completions.create(
            model=pd.model,
            messages=PROMPT,
            max_tokens=4,
            extra_body=GREEDY,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    for usage in (resp.usage, chunks[-1].usage):
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
            union["prompt_tokens"],
            union["completion_tokens"],
            union["total_tokens"],
        )
    msgs = {"model": pd.model, "messages": PROMPT, "max_tokens": 3}
    engine = direct(pd.engines["union"], "/v1/messages", {**msgs, "temperature": 0})["usage"]
    msg = ant(pd).messages.create(**msgs, extra_body={"temperature": 0})
    assert (msg.usage.input_tokens, msg.usage.output_tokens) == (engine["input_tokens"], engine["output_tokens"])


def test_client_disconnect_during_decode_aborts_the_engine_request(pd):
    """vLLM does not count a client abort in request_success_total; the proof is that D stops: its running gauge
    falls back to 0 and the request never finishes (no new `length` finish, fewer tokens than max_tokens, and at
    least the tokens the client saw: the first chunk is the role's, without one). The stream is closed at once
    after its third chunk; a fast engine finishes 480 tokens in about a second, and on an idle machine one run saw
    D finish before the close reached it, so the stream is tried up to three times and one must show D stopped
    (a close that never reaches D fails all three)."""
    d = pd.engines["decode"]
    outcomes = []
    for _ in range(3):
        tokens0 = d.metric("vllm:generation_tokens_total")
        finished0 = d.metric("vllm:request_success_total", finished_reason="length")
        stream = oai(pd).chat.completions.create(
            model=pd.model, messages=PROMPT, max_tokens=480, extra_body=GREEDY, stream=True
        )
        tokens_seen = 0
        for seen, chunk in enumerate(stream, 1):
            tokens_seen += bool(chunk.choices and chunk.choices[0].delta.content)
            if seen == 3:
                break
        stream.close()
        assert wait_until(lambda: d.metric("vllm:num_requests_running") == 0, timeout_s=30)
        finished = d.metric("vllm:request_success_total", finished_reason="length") - finished0
        generated = d.metric("vllm:generation_tokens_total") - tokens0
        assert tokens_seen >= 1 and generated >= tokens_seen
        outcomes.append((finished, generated))
        if finished == 0 and generated < 480:
            return
    raise AssertionError(f"D finished every stream the client closed: (finished, tokens generated) {outcomes}")


def p_instances(cluster) -> int:
    return oai(cluster).models.list().data[0].model_dump()["p_instances_num"]


def test_prefill_engine_killed_then_back(pd):
    """P dies while D lives, then comes back. Runs last.

    The first request after the crash gets either a clean error in the API's own shape (the prefill leg found P
    dead and the retries ran out) or an answer, depending on whether the health check has already seen P down.
    Once it has (`p_instances_num` 0), requests are served whole on D (the scheduler's fallback): D computes
    the prompt itself and no KV moves. When P is back, requests go through the pair again.
    """
    p, d = pd.engines["prefill"], pd.engines["decode"]
    p.kill()
    r = httpx.post(
        pd.coord.url + "/v1/chat/completions",
        json={"model": pd.model, "messages": PROMPT, "max_tokens": 4},
        timeout=120,
    )
    if r.status_code != 200:
        assert r.status_code in (502, 503), r.text
        assert r.json()["error"]["message"] and "Traceback" not in r.text
    assert wait_until(lambda: p_instances(pd) == 0, timeout_s=30)
    assert d.healthy()

    local0 = d.metric("vllm:prompt_tokens_by_source_total", source="local_compute")
    xfers0 = d.metric("vllm:nixl_xfer_time_seconds_count")
    resp = oai(pd).chat.completions.create(model=pd.model, messages=PROMPT, max_tokens=3, extra_body=GREEDY)
    msg = ant(pd).messages.create(model=pd.model, messages=PROMPT, max_tokens=3, extra_body={"temperature": 0})
    assert resp.usage.completion_tokens == 3 and msg.usage.output_tokens == 3
    assert wait_until(
        lambda: d.metric("vllm:prompt_tokens_by_source_total", source="local_compute")
        == local0 + resp.usage.prompt_tokens + msg.usage.input_tokens
    )
    assert d.metric("vllm:nixl_xfer_time_seconds_count") == xfers0

    p.restart()
    assert wait_until(lambda: p_instances(pd) == 1, timeout_s=30)
    # D's first handshake with the new P waits 5 s at most (vLLM's NIXL side channel), and a P still warming up on a
    # loaded machine can miss it: D then fails the request and the Coordinator has D compute the prompt (a missed
    # handoff: tests/test_pd.py's test_missed_handoff_is_served_and_counted). So one answer first, whichever way it
    # went; the next must move the KV.
    warm = oai(pd).chat.completions.create(model=pd.model, messages=PROMPT, max_tokens=3, extra_body=GREEDY)
    assert warm.usage.completion_tokens == 3
    with kv_moved(pd) as prompts:
        resp = oai(pd).chat.completions.create(model=pd.model, messages=PROMPT, max_tokens=3, extra_body=GREEDY)
        prompts.append(resp.usage.prompt_tokens)
    assert resp.usage.completion_tokens == 3
