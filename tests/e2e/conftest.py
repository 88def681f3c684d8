"""Fixtures of the e2e suite: the real vLLM engines started by tests/e2e/vllm_up.sh, one Coordinator in front.

`make e2e` runs `vllm_up.sh python -m pytest -m vllm tests/e2e`: the script exports MOTOR_E2E_* (engine
addresses, served model name, run folder). Without them the suite fails with a pointer to `make e2e`: a
suite that cannot reach its engines has not passed, so it never skips.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

from harness.configs import REAL_ENGINE_CHECKS, coordinator_config, instance
from harness.coordinator import Coordinator
from tests.e2e.engines import ROLES, Engine


@dataclass
class Cluster:
    model: str
    engines: dict
    coord: Coordinator


@pytest.fixture(scope="session")
def engines() -> dict:
    missing = [f"MOTOR_E2E_{r.upper()}" for r in ROLES if not os.environ.get(f"MOTOR_E2E_{r.upper()}")]
    if missing or not os.environ.get("MOTOR_E2E_RUN"):
        pytest.fail(
            f"no real vLLM engines ({', '.join(missing) or 'MOTOR_E2E_RUN'} unset): run `make e2e`, which starts them "
            "with tests/e2e/vllm_up.sh",
            pytrace=False,
        )
    run = os.environ["MOTOR_E2E_RUN"]
    return {r: Engine(r, os.environ[f"MOTOR_E2E_{r.upper()}"], run) for r in ROLES}


@pytest.fixture(scope="session")
def model() -> str:
    return os.environ.get("MOTOR_E2E_MODEL", "motor-tiny")


@pytest.fixture(scope="module")
def pd(engines, model) -> Cluster:
    """A one-worker Coordinator in front of the real prefill + decode pair (PD handoff)."""
    cfg = coordinator_config(
        [
            instance(1, "prefill", model, engines["prefill"].address),
            instance(2, "decode", model, engines["decode"].address),
        ],
        models=[{"id": model, "p_max_seqlen": 512, "d_max_seqlen": 512}],
        scheduler_config=REAL_ENGINE_CHECKS,
    )
    # Three vLLM engines share the 2 cores with the Coordinator here: its workers may take longer than 30 s to start.
    with Coordinator(cfg, ready_timeout_s=180.0) as coord:
        yield Cluster(model, engines, coord)
