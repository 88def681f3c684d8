"""Shared fixtures: engine simulators in this process, the Coordinator as a real subprocess."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine_sim import SimConfig, launch
from harness.configs import coordinator_config, instance
from harness.coordinator import Coordinator
from harness.redis import RedisServer

MODEL = "qwen3"


class Sims:
    """Starts simulators and stops them all at teardown."""

    def __init__(self):
        self.handles = []

    def __call__(self, role: str = "union", model: str = MODEL, **kw):
        kw.setdefault("speedup", 50.0)
        handle = launch(SimConfig(role=role, model=model, **kw))
        self.handles.append(handle)
        return handle

    def stop(self):
        for h in self.handles:
            h.stop()


@pytest.fixture(scope="module")
def redis():
    """A real redis-server on a free loopback port for the module's cluster-mode tests (no password, no
    persistence); a module that needs another kind defines its own `redis`."""
    server = RedisServer()
    yield server
    server.stop()


@pytest.fixture
def sims():
    pool = Sims()
    yield pool
    pool.stop()


@pytest.fixture(scope="module")
def module_sims():
    pool = Sims()
    yield pool
    pool.stop()


@pytest.fixture(scope="module")
def union_cluster(module_sims):
    """One union engine behind a one-worker Coordinator."""
    u = module_sims("union")
    cfg = coordinator_config(
        [instance(1, "union", MODEL, u.address)], models=[{"id": MODEL, "slo_ttft": 800, "slo_tpot": 40}]
    )
    with Coordinator(cfg) as coord:
        coord.engines = {"union": u}
        yield coord


@pytest.fixture(scope="module")
def pd_cluster(module_sims):
    """One prefill and one decode engine behind a one-worker Coordinator (handoff)."""
    p, d = module_sims("prefill"), module_sims("decode")
    cfg = coordinator_config([instance(1, "prefill", MODEL, p.address), instance(2, "decode", MODEL, d.address)])
    with Coordinator(cfg) as coord:
        coord.engines = {"prefill": p, "decode": d}
        yield coord
