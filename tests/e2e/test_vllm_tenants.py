"""Tenants and real vLLM's prefix cache: with two API keys (two tenants) in front of one union engine (prefix
caching on: tests/e2e/vllm_up.sh), the second tenant's same prompt finds nothing of the first's cached, and its
own repeat finds its own, on every route vLLM 0.32 takes `cache_salt` on (chat, completions, responses, messages).
"""

from __future__ import annotations

import uuid

import pytest

from harness.configs import REAL_ENGINE_CHECKS, api_keys, coordinator_config, instance
from harness.coordinator import Coordinator
from tests.test_tenants_prefix import FAMILIES, KEY_A, KEY_B, TENANTS, cached, prompt

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def tenants(engines, model) -> Coordinator:
    """A one-worker Coordinator with two tenants in front of the real union engine."""
    cfg = coordinator_config(
        [instance(1, "union", model, engines["union"].address)],
        models=[{"id": model, "p_max_seqlen": 512, "d_max_seqlen": 512}],
        scheduler_config=REAL_ENGINE_CHECKS,
        api_key_config=api_keys(),
        tenant_config=TENANTS,
    )
    with Coordinator(cfg, ready_timeout_s=180.0) as coord:
        coord.model = model
        yield coord


@pytest.mark.parametrize("family", FAMILIES)
def test_the_second_tenant_finds_nothing_of_the_firsts_prompt_cached(tenants, family):
    # About 160 tokens: five of the engine's 32-token blocks, within its 512-token context. A fresh one each run
    # (the engine's cache outlives a run of the suite).
    text = prompt(f"{family}-{uuid.uuid4().hex}", sentences=12)
    model = tenants.model
    cached(tenants, KEY_A, family, model, text)
    assert cached(tenants, KEY_A, family, model, text) > 0  # vLLM's prefix cache is on: the repeat is cached
    assert cached(tenants, KEY_B, family, model, text) == 0  # another tenant: none of it
    assert cached(tenants, KEY_B, family, model, text) > 0
