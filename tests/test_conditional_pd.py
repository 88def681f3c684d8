"""Conditional disaggregation through a live Coordinator: with `conditional_disaggregation`, a P/D model's
short prompts go to the decode engine alone (no prefill leg, no ticket) once that is predicted sooner, and
every answer says how it was placed in Prometheus and the request log."""

from __future__ import annotations

import httpx
import pytest

from harness.clients import openai_client
from harness.configs import coordinator_config, instance
from harness.coordinator import Coordinator
from harness.loopback import wait_until
from harness.metrics import by_label
from tests.conftest import MODEL

PATH = "/v1/chat/completions"


def placements(coord) -> dict[str, float]:
    return by_label(coord, "motor_placements_total", "placement")


def chat(coord, k: int) -> str:
    stream = openai_client(coord).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"short question {k}"}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None and usage.completion_tokens == 8 and usage.prompt_tokens > 0
    return text


@pytest.fixture
def slow_prefill_pool(sims):
    """A prefill engine 40 times slower at prompts than the decode engine."""
    p = sims("prefill", speedup=5.0, prefill_tokens_per_s=200.0)
    d = sims("decode", speedup=5.0, prefill_tokens_per_s=8000.0)
    return p, d


@pytest.mark.parametrize("conditional", [True, False])
def test_short_prompts_go_to_the_decode_engine_alone_when_that_is_sooner(slow_prefill_pool, conditional):
    p, d = slow_prefill_pool
    cfg = coordinator_config(
        [instance(1, "prefill", MODEL, p.address), instance(2, "decode", MODEL, d.address)],
        scheduler_config={"scheduler_type": "slo_aware", "conditional_disaggregation": conditional},
        inference_workers_config={"num_workers": 1},
    )
    with Coordinator(cfg) as coord:
        texts = [chat(coord, k) for k in range(16)]
        assert all(texts)
        p_calls = [r for r in p.requests() if r["path"] == PATH]
        d_calls = [r for r in d.requests() if r["path"] == PATH]
        assert len(d_calls) == 16  # every request decodes on D
        alone = [r for r in d_calls if "kv_transfer_params" not in r["body"]]
        assert wait_until(lambda: sum(placements(coord).values()) == 16)  # (whatever the status: 499 too)
        counted = placements(coord)
        assert wait_until(lambda: coord.output().count("placement=") >= 16)
        log = coord.output()
        if conditional:
            # The model learns both engines first (pairs), then D's prompt speed, then serves alone.
            assert len(alone) >= 4 and len(p_calls) == 16 - len(alone)
            assert counted.get("decode_alone") == len(alone) and counted.get("pd") == len(p_calls)
            assert log.count("placement=decode_alone") == len(alone)
        else:
            assert not alone and len(p_calls) == 16
            assert counted.get("pd") == 16 and not counted.get("decode_alone")
            assert "placement=decode_alone" not in log and log.count("placement=pd") == 16


def test_without_fallback_to_hybrid_a_model_without_a_usable_pair_is_refused(sims):
    p = sims("prefill")
    cfg = coordinator_config(
        [instance(1, "prefill", MODEL, p.address), instance(2, "decode", MODEL, "127.0.0.1:9")],
        scheduler_config={"enable_pd_separation_fallback_to_hybrid": False, "health_check_interval": 0.1},
    )
    with Coordinator(cfg) as coord:
        body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
        assert wait_until(lambda: httpx.post(coord.url + PATH, json=body).status_code == 503)
        r = httpx.post(coord.url + PATH, json=body)
        assert "enable_pd_separation_fallback_to_hybrid" in r.json()["error"]["message"]
