"""The Responses API through the Coordinator in front of a real vLLM prefill + decode pair (NixlConnector).

A Responses request goes through P and D with the prompt's KV really moved (D's NIXL transfers and its
`external_kv_transfer` prompt tokens rise, its local compute does not), its usage billed once and equal to the
union engine's; a follow-up turn (`previous_response_id`) is served whole by D, which holds the stored
response (the engines run with VLLM_ENABLE_RESPONSES_API_STORE=1: tests/e2e/vllm_up.sh). vLLM 0.32 has no
DELETE route: the engine's own 405 is shown, and the Coordinator's delete forgets the id.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from harness.loopback import wait_until
from tests.e2e.test_vllm_pd import direct, kv_moved, oai

pytestmark = pytest.mark.vllm

INPUT = "Tell me about the weather in Paris in spring, in some detail."
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def test_a_response_json_and_stream_through_the_pair(pd):
    c = oai(pd)
    args = dict(model=pd.model, input=INPUT, max_output_tokens=6, **GREEDY)
    with kv_moved(pd, requests=2) as prompts:
        resp = c.responses.create(**args)
        events = list(c.responses.create(**args, stream=True))
        final = events[-1].response
        prompts += [resp.usage.input_tokens, final.usage.input_tokens]
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.status == "incomplete"
    assert resp.usage.output_tokens == 6 and resp.usage.total_tokens == resp.usage.input_tokens + 6
    # D counts the transferred prompt as cached; the client is billed P's count, none of it cached.
    assert resp.usage.input_tokens_details.cached_tokens == 0
    assert resp.model_dump().get("kv_transfer_params") is None
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == final.output_text == resp.output_text  # greedy: the same text both ways
    assert final.usage.output_tokens == 6 and final.usage.input_tokens_details.cached_tokens == 0


def test_usage_through_the_pair_is_the_union_engines(pd):
    body = {"model": pd.model, "input": INPUT, "max_output_tokens": 4, "temperature": 0, "ignore_eos": True}
    union = direct(pd.engines["union"], "/v1/responses", body)["usage"]
    resp = oai(pd).responses.create(model=pd.model, input=INPUT, max_output_tokens=4, **GREEDY)
    got = resp.usage
    assert (got.input_tokens, got.output_tokens, got.total_tokens) == (
        union["input_tokens"],
        union["output_tokens"],
        union["total_tokens"],
    )


def test_a_follow_up_turn_is_served_by_the_decode_engine_holding_the_previous_response(pd):
    c, d = oai(pd), pd.engines["decode"]
    xfers0 = d.metric("vllm:nixl_xfer_time_seconds_count") + 1
    first = c.responses.create(model=pd.model, input=INPUT, max_output_tokens=4, **GREEDY)
    assert wait_until(lambda: d.metric("vllm:nixl_xfer_time_seconds_count") == xfers0)  # its KV came from P

    def computed_on_d() -> float:
        return d.metric("vllm:prompt_tokens_by_source_total", source="local_compute") + d.metric(
            "vllm:prompt_tokens_by_source_total", source="local_cache_hit"
        )

    before = computed_on_d()
    nxt = c.responses.create(
        model=pd.model, input="And in autumn?", previous_response_id=first.id, max_output_tokens=4, **GREEDY
    )
    assert nxt.previous_response_id == first.id and nxt.status == "incomplete"
    # D rendered the stored conversation before the new input: a longer prompt than the first one's.
    assert nxt.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert wait_until(lambda: computed_on_d() == before + nxt.usage.input_tokens)  # D's own prompt, no P
    assert d.metric("vllm:nixl_xfer_time_seconds_count") == xfers0
    got = c.responses.retrieve(nxt.id)
    assert got.id == nxt.id and got.output_text == nxt.output_text and got.previous_response_id == first.id


def test_delete_forgets_what_vllm_cannot_delete_and_cancel_is_vllms_answer(pd):
    c, d = oai(pd), pd.engines["decode"]
    resp = c.responses.create(model=pd.model, input=INPUT, max_output_tokens=2, **GREEDY)
    with pytest.raises(openai.BadRequestError) as e:  # vLLM cancels background responses only
        c.responses.cancel(resp.id)
    assert "Cannot cancel a synchronous response" in e.value.body["message"]
    assert httpx.delete(f"{d.url}/v1/responses/{resp.id}", timeout=10).status_code == 405  # vLLM 0.32: no route
    assert c.responses.delete(resp.id) is None
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(resp.id)
    assert httpx.get(f"{d.url}/v1/responses/{resp.id}", timeout=10).status_code == 200  # D still holds it
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.retrieve("resp_never_served")
    assert e.value.body["type"] == "invalid_request_error"
