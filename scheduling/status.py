"""A point-in-time snapshot of each endpoint: health, breaker and load, as GET /instances and /metrics show them.

Read from shared memory, so any worker answers for all of them. The ledger's numbers are the
Coordinator's own in-flight work; the engine's are what its /metrics said at the last scrape.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduling.health import Health
from scheduling.kv_index import STATE_NAMES
from scheduling.ledger import Ledger
from scheduling.registry import Target, Topology


@dataclass(frozen=True)
class EndpointStatus:
    target: Target
    healthy: bool
    breaker: str  # closed, open or half_open
    inflight_requests: int  # legs this Coordinator has in flight on the endpoint, all workers
    inflight_prompt_tokens: int  # prompt tokens of those legs still prefilling
    inflight_decode_tokens: int  # output tokens budgeted for those legs
    prefilling_requests: int
    held_decode_slots: int  # decode legs promised to requests whose prefill is still running
    engine_running: float  # the engine's vllm:num_requests_running
    engine_waiting: float  # the engine's vllm:num_requests_waiting
    engine_kv_cache_usage: float  # the engine's vllm:kv_cache_usage_perc (0..1)
    engine_seq_cap: float  # a decode engine's learned most sequences at once (scrape.py's seq_cap); 0 until seen
    kv_events: str = "off"  # its KV-event subscription (scheduling/kv_events.py): off, live, replaying, lost
    kv_blocks: int = 0  # the blocks the KV-event index holds for it

    def load_json(self) -> dict:
        return {
            "inflight_requests": self.inflight_requests,
            "inflight_prompt_tokens": self.inflight_prompt_tokens,
            "inflight_decode_tokens": self.inflight_decode_tokens,
            "prefilling_requests": self.prefilling_requests,
            "held_decode_slots": self.held_decode_slots,
            "engine_running": self.engine_running,
            "engine_waiting": self.engine_waiting,
            "engine_kv_cache_usage": self.engine_kv_cache_usage,
            "engine_seq_cap": int(self.engine_seq_cap) or None,
        }


def endpoint_status(view: Topology, ledger: Ledger, health: Health, kv=None) -> list[EndpointStatus]:
    """`kv`: the KV-event rows (SharedState.kv_endpoints), to say each endpoint's subscription."""
    out = []
    for t in view.targets:
        row = kv[t.slot] if kv is not None else None
        requests, prompt_tokens, decode_tokens, prefilling = ledger.load(t.slot)
        running, waiting, kv_usage = health.engine_load(t.slot)
        out.append(
            EndpointStatus(
                t,
                health.is_healthy(t.slot),
                health.breaker(t.slot),
                requests,
                prompt_tokens,
                decode_tokens,
                prefilling,
                ledger.held(t.slot),
                running,
                waiting,
                kv_usage,
                health.get(t.slot, "seq_cap"),
                STATE_NAMES.get(row.state, "off") if row is not None else "off",
                row.blocks if row is not None else 0,
            )
        )
    return out


def instances_json(view: Topology, ledger: Ledger, health: Health, kv=None) -> list[dict]:
    """GET /instances: each instance with its endpoints' health, breaker, load and KV-event subscription."""
    by_instance: dict[int, list[dict]] = {iid: [] for iid in view.instances}
    usable: dict[int, bool] = {}
    for s in endpoint_status(view, ledger, health, kv):
        t = s.target
        usable[t.instance_id] = usable.get(t.instance_id, False) or health.usable(t.slot)
        by_instance[t.instance_id].append(
            {
                "id": t.endpoint_id,
                "address": t.address,
                "healthy": s.healthy,
                "breaker": s.breaker,
                "load": s.load_json(),
                "kv_events": {"state": s.kv_events, "blocks": s.kv_blocks},
            }
        )
    out = []
    for iid, inst in view.instances.items():
        endpoints = by_instance[iid]
        healthy = any(e["healthy"] for e in endpoints)
        paused = iid in view.paused
        out.append(
            {
                **inst.to_json(),
                "paused": paused,
                "healthy": healthy,
                # Takes new requests now: not paused, and some endpoint the scheduler may pick (healthy, and its
                # breaker closed or open long enough to let a probe through), as readiness counts them.
                "schedulable": not paused and usable.get(iid, False),
                "endpoints": endpoints,
            }
        )
    return out
