"""The engines' KV events against real vLLM: what the Coordinator predicts an engine holds is what vLLM reports
it held, and routing on it finds more of the prompt cached than the rotation or the estimate index.

Two union engines (vllm_up.sh: prefix caching, KV events over ZMQ on loopback, blocks of 32 tokens, 64 blocks of
cache each, so the trace evicts) get the seeded multi-turn trace of harness/kv_trace.py once per policy, from
empty caches, after the first engine answered some chats' first turns straight (a client the Coordinator never
saw). The prediction is compared with the engine's own `prompt_tokens_details.cached_tokens` by the
Coordinator itself (`motor_kv_prediction_total{outcome}` and each request's log line); the hit rate is the
engines' own `vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total` over the run.
"""

from __future__ import annotations

import os
import re

import httpx
import pytest

from harness.configs import coordinator_config
from harness.coordinator import Coordinator
from harness.kv_trace import make_trace, measure
from harness.loopback import wait_until
from harness.metrics import by_label

pytestmark = pytest.mark.vllm

UNIONS = ("union", "union2")
_LINE = re.compile(r"cached_tokens_predicted=(\S+) cached_tokens=(\S+)")


def coordinator(engines, model: str, policy: str, kv_events: bool) -> Coordinator:
    instances = [
        {
            "id": k + 1,
            "role": "union",
            "model_name": model,
            "endpoints": [{"id": 0, "address": engines[name].address, "kv_events": engines[name].kv_events}],
        }
        for k, name in enumerate(UNIONS)
    ]
    cfg = coordinator_config(
        instances,
        models=[{"id": model, "tokenizer_path": os.environ["MOTOR_E2E_MODEL_DIR"]}],
        scheduler_config={"scheduler_type": policy, "health_check_interval": 0.5, "metrics_scrape_interval": 1.0},
        kv_event_config={"enable": kv_events},
    )
    return Coordinator(cfg, ready_timeout_s=180.0)


def _states(coord) -> list[str]:
    body = httpx.get(coord.mgmt + "/instances").json()
    return [ep["kv_events"]["state"] for inst in body["instances"] for ep in inst["endpoints"]]


def run_policy(engines, model: str, policy: str, kv_events: bool) -> dict:
    """One run of the trace through a Coordinator of `policy`: its hit rate, the Coordinator's prediction
    outcomes and the (predicted, reported) pairs of its log lines that differ."""
    urls = [engines[name].url for name in UNIONS]
    with coordinator(engines, model, policy, kv_events) as coord:
        if kv_events:
            assert wait_until(lambda: _states(coord) == ["live", "live"], 30), _states(coord)
            assert httpx.get(coord.mgmt + "/instances").json()["prompt_tokens"] == {model: "exact"}
        result = measure(make_trace(), model, urls, lambda i: coord.url)
        n = len(result.usages)
        if kv_events:  # (the Coordinator compares predictions for the prompts whose ids it knows)
            assert wait_until(lambda: sum(by_label(coord, "motor_kv_prediction_total", "outcome").values()) == n, 10)
        outcomes = by_label(coord, "motor_kv_prediction_total", "outcome")
        misses = [m.groups() for m in _LINE.finditer(coord.output()) if m.group(1) != m.group(2)]
    exact = outcomes.get("exact", 0.0) / n
    print(f"\n{policy} kv_events={kv_events}: hit rate {result.hit_rate:.3f}, exact predictions {exact:.3f} {outcomes}")
    return {"hit_rate": result.hit_rate, "exact": exact, "outcomes": outcomes, "misses": misses}


def test_kv_events_predict_vllms_cached_tokens_and_find_more_of_it(engines, model):
    rr = run_policy(engines, model, "round_robin", False)
    estimate = run_policy(engines, model, "kv_cache_affinity", False)
    events = run_policy(engines, model, "kv_cache_affinity", True)
    assert events["exact"] >= 0.95, (events["outcomes"], events["misses"])
    assert events["hit_rate"] > rr["hit_rate"], (events["hit_rate"], rr["hit_rate"])
    assert events["hit_rate"] > estimate["hit_rate"], (events["hit_rate"], estimate["hit_rate"])
