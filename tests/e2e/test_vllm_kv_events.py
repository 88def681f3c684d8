"""The engines' KV events against real vLLM: what the Coordinator predicts an engine holds is what vLLM reports
it held, and routing on it finds more of the prompt cached than the rotation or the estimate index.

Two union engines (vllm_up.sh: prefix caching, KV events over ZMQ on Unix sockets, blocks of 32 tokens, 64
blocks of cache each, so the trace evicts) get the seeded multi-turn trace of harness/kv_trace.py once per
policy, from empty caches, after the first engine answered some chats' first turns straight (a client the
Coordinator never saw). The prediction is compared with the engine's own `prompt_tokens_details.cached_tokens`
by the Coordinator itself (`motor_kv_prediction_total{outcome}`; each request's log line has both); the hit
rate is the engines' own `vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total` over the run.
"""

from __future__ import annotations

import os
import re

import httpx
import pytest

from harness.coordinator import Coordinator
from harness.kv_trace import caught_up, coordinator_cfg, kv_states, make_trace, measure, predictions
from harness.loopback import wait_until

pytestmark = pytest.mark.vllm

UNIONS = ("union", "union2")
_LINE = re.compile(r"cached_tokens_predicted=(\S+) cached_tokens=(\S+)")


def run_policy(engines, model: str, policy: str, kv_events: bool) -> dict:
    """One run of the trace through a Coordinator of `policy`: its hit rate, the Coordinator's prediction
    outcomes and the (predicted, reported) pairs of its log lines that differ."""
    unions = [(engines[name].address, engines[name].kv_events) for name in UNIONS]
    cfg = coordinator_cfg(unions, model, os.environ["MOTOR_E2E_MODEL_DIR"], policy, kv_events)
    with Coordinator(cfg, ready_timeout_s=180.0) as coord:
        if kv_events:
            assert wait_until(lambda: kv_states(coord) == ["live", "live"], 30), kv_states(coord)
            assert httpx.get(coord.mgmt + "/instances").json()["prompt_tokens"] == {model: "exact"}
            assert caught_up(coord, model, [engines[name].url for name in UNIONS]), kv_states(coord)
        result = measure(make_trace(), model, [engines[name].url for name in UNIONS], lambda i: coord.url)
        n = len(result.usages)
        if kv_events:  # every request is counted, unpredicted when its exact ids were late on a loaded worker
            assert wait_until(lambda: sum(predictions(coord).values()) == n, 10), (n, predictions(coord))
        outcomes = predictions(coord)
        misses = [m.groups() for m in _LINE.finditer(coord.output()) if m.group(1) != m.group(2)]
    unpredicted = outcomes.get("unpredicted", 0.0)
    exact = outcomes.get("exact", 0.0) / max(n - unpredicted, 1.0)
    print(
        f"\n{policy} kv_events={kv_events}: hit rate {result.hit_rate:.3f}, exact predictions {exact:.3f} of the "
        f"{n - unpredicted:.0f} predicted {outcomes}"
    )
    return {
        "hit_rate": result.hit_rate,
        "exact": exact,
        "unpredicted": unpredicted / n,
        "outcomes": outcomes,
        "misses": misses,
    }


EXACT_FLOOR = 0.95  # the figure
# Requests planned on the estimate because their ids took over EXACT_WAIT_S (0.25 s): none on a quiet machine;
# CI's run, its cores shared with the vLLM engines, had some (motor_kv_prediction_total counted them nowhere then).
UNPREDICTED_CEILING = 0.25
RUNS = 3  # of the trace per kv_cache_affinity run, on the estimate and on KV events


def test_kv_events_predict_vllms_cached_tokens_and_find_more_of_it(engines, model):
    """KV events against the estimate over RUNS runs each of the trace: one run's hit rate moves with the timing of
    completions on the loaded cores (the estimate 0.526-0.747 in the runs recorded in docs/kv-events.md and CI,
    KV events 0.700-0.738), so one run each lost now and then (CI: 0.719 against 0.747). A run takes about 12 s."""
    rr = run_policy(engines, model, "round_robin", False)
    estimate = [run_policy(engines, model, "kv_cache_affinity", False) for _ in range(RUNS)]
    events = [run_policy(engines, model, "kv_cache_affinity", True) for _ in range(RUNS)]
    # Runs on 2 loaded cores gave 96.3-100 % once the subscriptions had caught up (the misses: blocks cached on
    # the engine before their events were applied).
    for run in events:
        assert run["exact"] >= EXACT_FLOOR, (run["outcomes"], run["misses"])
        assert run["unpredicted"] <= UNPREDICTED_CEILING, run["outcomes"]
        assert run["hit_rate"] > rr["hit_rate"], (run["hit_rate"], rr["hit_rate"])
    by_events, by_estimate = (sum(run["hit_rate"] for run in runs) / RUNS for runs in (events, estimate))
    assert by_events > by_estimate, ([run["hit_rate"] for run in events], [run["hit_rate"] for run in estimate])
